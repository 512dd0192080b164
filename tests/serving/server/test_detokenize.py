"""Incremental detokenization and string stop sequences (serving/server/detokenize.py).

Real tokenizers, all built offline: the embedded target's byte-level BPE (GPT-2 / SmolLM2
style), a Llama-style SentencePiece BPE (Metaspace-like normalizer, byte fallback,
leading-space strip), and for the clean-up case a BERT-style WordPiece and a T5-style
Unigram, trained here on a few lines. Property: pushing any token sequence in any chunking
and then finishing yields exactly tokenizer.decode(all tokens), after the prompt if any.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specheads.serving.decode.generate import generate
from specheads.serving.server.detokenize import DecodeStreamText, IncrementalDetokenizer, WindowText, decode_stream_matches
from specheads.serving.server.text_stream import TextDelta, stream_text

SAMPLE_TEXTS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "def foo(x):\n    return x + 1  # done",
    "Emoji 😀🎉 and CJK 中文字符 and accents: héllo naïve café.",
    "stop here STOP now. The end.",
]


@pytest.fixture(scope="module")
def byte_bpe(embedded_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_target_dir)


def _train_sentencepiece_bpe():
    """A Llama-2 style tokenizer: ▁ starts words, <0xNN> byte fallback, decode strips one leading space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizer
    base.train_from_iterator(SAMPLE_TEXTS * 10, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                                     show_progress=False))
    model = json.loads(base.to_str())["model"]
    vocab = {token: index for index, token in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)])}
    for token in model["vocab"]:
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def sp_bpe():
    return _train_sentencepiece_bpe()


def run(tokenizer, tokens, chunks, **kwargs) -> tuple[IncrementalDetokenizer, list[str]]:
    """Push tokens in chunks of the given sizes (cycled), then finish."""
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    outputs, position, index = [], 0, 0
    while position < len(tokens):
        size = chunks[index % len(chunks)] if chunks else 1
        outputs.append(detok.push(tokens[position:position + size]))
        position += size
        index += 1
    outputs.append(detok.finish())
    return detok, outputs


def test_sanity_tokenizers_split_multibyte_characters(byte_bpe, sp_bpe):
    for tokenizer in (byte_bpe, sp_bpe):
        ids = tokenizer.encode("a 😺 語", add_special_tokens=False)  # unseen by both
        assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # the hard case really occurs
    ids = sp_bpe.encode("Hello world, the fox", add_special_tokens=False)
    assert any(sp_bpe.decode(ids[k:]) != sp_bpe.decode(ids)[len(sp_bpe.decode(ids[:k])):]
               for k in range(1, len(ids)))  # a suffix's decode loses its leading space


@pytest.mark.parametrize("name", ["byte_bpe", "sp_bpe"])
@pytest.mark.parametrize("chunks", [[1], [2, 1, 3], [7]])
def test_streamed_text_equals_full_decode_on_real_text(request, name, chunks):
    tokenizer = request.getfixturevalue(name)
    for text in SAMPLE_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        detok, outputs = run(tokenizer, ids, chunks)
        assert "".join(outputs) == tokenizer.decode(ids) == detok.text
        assert all("\ufffd" not in out for out in outputs)  # no half characters were ever emitted


def _random_ids(tokenizer):
    """Any token id, except SentencePiece byte-fallback tokens (<0xNN>): there, an invalid
    UTF-8 byte run makes decode() retroactively turn the run's earlier (valid) bytes into
    U+FFFD, which no stream can reproduce without unbounded look-ahead. Valid byte runs are
    covered by the multi-byte text property below."""
    ids = [i for i in range(len(tokenizer)) if not tokenizer.convert_ids_to_tokens(i).startswith("<0x")]
    return st.sampled_from(ids)


@pytest.mark.parametrize("name", ["byte_bpe", "sp_bpe"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_property_any_tokens_any_chunking(request, name, skip_special_tokens):
    tokenizer = request.getfixturevalue(name)
    tokens_st = st.lists(st.one_of(_random_ids(tokenizer), st.sampled_from(tokenizer.all_special_ids)), max_size=40)
    chunks_st = st.lists(st.integers(1, 4), min_size=1, max_size=5)

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(tokens=tokens_st, chunks=chunks_st)
    def check(tokens, chunks):
        detok, outputs = run(tokenizer, tokens, chunks, skip_special_tokens=skip_special_tokens)
        assert "".join(outputs) == tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    check()


@pytest.mark.parametrize("name", ["byte_bpe", "sp_bpe"])
def test_property_text_with_multibyte_characters(request, name):
    tokenizer = request.getfixturevalue(name)
    alphabet = st.sampled_from(list("ab cd\n.😀🎉中文字é😺語") + [" the", " stop"])

    @settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(pieces=st.lists(alphabet, max_size=30), chunks=st.lists(st.integers(1, 3), min_size=1, max_size=4))
    def check(pieces, chunks):
        ids = tokenizer.encode("".join(pieces), add_special_tokens=False)
        detok, outputs = run(tokenizer, ids, chunks)
        assert "".join(outputs) == tokenizer.decode(ids)
        assert all("\ufffd" not in out for out in outputs)

    check()


@pytest.mark.parametrize("name", ["byte_bpe", "sp_bpe"])
def test_prompt_context_gives_the_continuation_of_the_prompt(request, name):
    tokenizer = request.getfixturevalue(name)
    prompt = tokenizer.encode("Hello there", add_special_tokens=False)
    generated = tokenizer.encode(" world, the fox", add_special_tokens=False)
    everything = prompt + generated
    expected = tokenizer.decode(everything)[len(tokenizer.decode(prompt)):]
    detok, outputs = run(tokenizer, generated, [1], prompt_ids=prompt)
    assert "".join(outputs) == expected
    assert expected.startswith(" world")


@pytest.mark.parametrize("name", ["byte_bpe", "sp_bpe"])
def test_stop_string_spanning_tokens_in_any_chunking(request, name):
    tokenizer = request.getfixturevalue(name)
    text = "the quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(text, add_special_tokens=False)
    for chunks in ([1], [2], [3, 1], [len(ids)]):
        detok, outputs = run(tokenizer, ids, chunks, stop=["fox jumps", "zebra"])
        emitted = "".join(outputs)
        assert detok.stopped and detok.stop_string == "fox jumps"
        assert emitted == detok.text == "the quick brown "
        needed = detok.stop_token_index
        assert "fox jumps" in tokenizer.decode(ids[:needed])
        assert "fox jumps" not in tokenizer.decode(ids[:needed - 1])
        assert detok.push(ids) == "" and detok.finish() == ""  # nothing after a stop


def test_stop_prefix_is_held_back_then_released(byte_bpe):
    detok = IncrementalDetokenizer(byte_bpe, stop=["STOP"])
    out = ""
    for piece in ["abc S", "T", "O", "x"]:
        out += detok.push(byte_bpe.encode(piece, add_special_tokens=False))
        if piece in ("T", "O"):
            assert not out.endswith("S") and not out.endswith("ST")  # a possible stop start is held
    assert out == "abc STOx" and not detok.stopped


def test_stop_arriving_in_pieces_and_earliest_stop_wins(byte_bpe):
    detok = IncrementalDetokenizer(byte_bpe, stop=["END", "D!"])
    pieces = ["one tw", "o E", "N", "D! more"]
    out = "".join(detok.push(byte_bpe.encode(p, add_special_tokens=False)) for p in pieces)
    assert out == "one two " and detok.stopped and detok.stop_string == "END"
    total = sum(len(byte_bpe.encode(p, add_special_tokens=False)) for p in pieces[:3])
    assert detok.stop_token_index <= total + 1


def test_stop_with_multibyte_characters(byte_bpe):
    ids = byte_bpe.encode("hi 中文字 ok", add_special_tokens=False)
    detok, outputs = run(byte_bpe, ids, [1], stop=["文"])
    assert "".join(outputs) == "hi 中" and detok.stopped
    assert byte_bpe.decode(ids[:detok.stop_token_index]).endswith("文")
    assert "文" not in byte_bpe.decode(ids[:detok.stop_token_index - 1])


def test_stop_only_in_flushed_tail(byte_bpe):
    ids = byte_bpe.encode("abc", add_special_tokens=False)
    detok, outputs = run(byte_bpe, ids, [len(ids)], stop=["c", "cd"])
    assert "".join(outputs) == "ab" and detok.stopped and detok.stop_token_index == len(ids)


def test_bad_stop_strings_are_rejected(byte_bpe):
    with pytest.raises(ValueError, match="empty"):
        IncrementalDetokenizer(byte_bpe, stop=["ok", ""])
    with pytest.raises(TypeError, match=r"stop\[0\]"):
        IncrementalDetokenizer(byte_bpe, stop=[3])


# -- the text source: DecodeStream for fast tokenizers, the window where it differs ---------------


@pytest.mark.parametrize("name", ["byte_bpe", "sp_bpe"])
def test_fast_tokenizers_stream_through_decode_stream(request, name, monkeypatch):
    tokenizer = request.getfixturevalue(name)
    ids = tokenizer.encode(SAMPLE_TEXTS[2], add_special_tokens=False)
    expected = tokenizer.decode(ids)[len(tokenizer.decode(ids[:3])):]
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=ids[:3], stop=["zebra"])
    assert isinstance(detok.source, DecodeStreamText)
    calls = []
    decode = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda *args, **kwargs: calls.append(args) or decode(*args, **kwargs))
    out = "".join(detok.push([token]) for token in ids[3:]) + detok.finish()
    assert out == expected
    assert calls == []  # the text came from tokenizers' DecodeStream, not from Python-side decodes


@pytest.mark.parametrize("name", ["byte_bpe", "sp_bpe"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_property_generated_text_is_the_decode_after_the_prompt(request, name, skip_special_tokens):
    """Prompt: text, then maybe special tokens. Generated: encoded text (characters split over
    byte tokens, emoji, CJK, leading spaces), random ids and special tokens, in any chunking."""
    tokenizer = request.getfixturevalue(name)
    specials = st.sampled_from(tokenizer.all_special_ids)
    pieces = st.lists(st.sampled_from(list("ab cd\n.😀🎉中文字é😺語") + [" the", " stop", "Hello"]), max_size=8)
    text_ids = pieces.map(lambda p: tokenizer.encode("".join(p), add_special_tokens=False))
    prompt_st = st.tuples(text_ids, st.lists(specials, max_size=2)).map(lambda parts: parts[0] + parts[1])
    parts = st.one_of(text_ids, st.lists(_random_ids(tokenizer), max_size=3), st.lists(specials, max_size=1))
    generated_st = st.lists(parts, max_size=6).map(lambda chunks: sum(chunks, []))
    chunks_st = st.lists(st.integers(1, 4), min_size=1, max_size=5)

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(prompt=prompt_st, generated=generated_st, chunks=chunks_st)
    def check(prompt, generated, chunks):
        full = tokenizer.decode(prompt + generated, skip_special_tokens=skip_special_tokens)
        head = tokenizer.decode(prompt, skip_special_tokens=skip_special_tokens)
        assert full.startswith(head)
        detok, outputs = run(tokenizer, generated, chunks, prompt_ids=prompt, skip_special_tokens=skip_special_tokens)
        assert "".join(outputs) == full[len(head):] == detok.text

    check()


def test_an_invalid_byte_run_does_not_break_the_stream(sp_bpe):
    """A byte-fallback run that is not valid UTF-8 makes decode() turn the "é" already emitted
    into U+FFFD too; DecodeStream raises there, and the stream restarts after the "é"."""
    from tokenizers.decoders import DecodeStream

    bytes_ids = sp_bpe.convert_tokens_to_ids(["<0xC3>", "<0xA9>", "<0xE4>"])  # "é", then half of "中"
    ids = sp_bpe.encode("caf", add_special_tokens=False) + bytes_ids
    ids += sp_bpe.encode(" the end", add_special_tokens=False)
    stream = DecodeStream(skip_special_tokens=True)
    with pytest.raises(Exception, match="Invalid prefix"):
        for token in ids:
            stream.step(sp_bpe.backend_tokenizer, token)
    assert sp_bpe.decode(ids) == "caf\ufffd\ufffd\ufffd the end"
    detok, outputs = run(sp_bpe, ids, [1])
    assert "".join(outputs) == "café\ufffd the end"


CLEANUP_TEXT = "I don't know , it's fine . Is it ? Yes ! We've won , you're right ."


def _train_cleanup_tokenizer(kind: str):
    """A tokenizer whose transformers decode() cleans up spaces after the backend's decoder
    (" ," -> ","; "don ' t" -> "don't"): a BERT-style WordPiece or a T5-style Unigram."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = (SAMPLE_TEXTS + [CLEANUP_TEXT]) * 20
    if kind == "wordpiece":
        backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        backend.normalizer = normalizers.BertNormalizer(lowercase=True)
        backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        backend.decoder = decoders.WordPiece()
        backend.train_from_iterator(texts, trainers.WordPieceTrainer(
            vocab_size=300, special_tokens=["[UNK]", "[SEP]", "[PAD]"], show_progress=False))
        return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", sep_token="[SEP]",
                                       pad_token="[PAD]", clean_up_tokenization_spaces=True)
    backend = Tokenizer(models.Unigram())
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.train_from_iterator(texts, trainers.UnigramTrainer(
        vocab_size=200, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>", show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=True)


@pytest.fixture(scope="module", params=["wordpiece", "unigram"])
def cleanup_tokenizer(request):
    return _train_cleanup_tokenizer(request.param)


def test_cleanup_tokenizers_keep_the_window(cleanup_tokenizer):
    """Measured: DecodeStream runs only the backend's decoder, so it misses transformers'
    clean-up of tokenization spaces (non-BPE models); such tokenizers keep WindowText."""
    from tokenizers.decoders import DecodeStream

    tokenizer = cleanup_tokenizer
    ids = tokenizer.encode(CLEANUP_TEXT, add_special_tokens=False)
    stream = DecodeStream(skip_special_tokens=True)
    streamed = "".join(stream.step(tokenizer.backend_tokenizer, token) or "" for token in ids)
    assert streamed != tokenizer.decode(ids, skip_special_tokens=True)
    assert not decode_stream_matches(tokenizer)
    assert isinstance(IncrementalDetokenizer(tokenizer).source, WindowText)


@pytest.mark.parametrize("chunks", [[1], [2, 1, 3]])
def test_cleanup_tokenizers_stream_the_cleaned_text(cleanup_tokenizer, chunks):
    """Token by token, the window used to emit "don '" before clean-up could make it "don't";
    text that clean-up may still rewrite is now held back."""
    tokenizer = cleanup_tokenizer
    for text in [CLEANUP_TEXT] + SAMPLE_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        detok, outputs = run(tokenizer, ids, chunks)
        assert "".join(outputs) == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_decode_override_keeps_the_window(byte_bpe):
    """DecodeStream would bypass a tokenizer class that overrides _decode."""

    class ShoutingTokenizer(type(byte_bpe)):
        def _decode(self, *args, **kwargs):
            return super()._decode(*args, **kwargs).upper()

    tokenizer = ShoutingTokenizer(tokenizer_object=byte_bpe.backend_tokenizer)
    ids = tokenizer.encode(SAMPLE_TEXTS[0], add_special_tokens=False)
    detok, outputs = run(tokenizer, ids, [1])
    assert isinstance(detok.source, WindowText)
    assert "".join(outputs) == tokenizer.decode(ids) == SAMPLE_TEXTS[0].upper()


# -- stream_text on a real decoder -------------------------------------------------------------------


@pytest.fixture(scope="module")
def decoder(embedded_target_dir):
    """The embedded target (a real trained Llama + its tokenizer) with random Medusa heads."""
    from torch import nn

    from specheads.heads.medusa import MedusaHeads
    from specheads.heads.target.adapter import TargetAdapter
    from specheads.serving.decode.config import SpeculativeDecoder
    from specheads.serving.decode.trees import DraftTree

    target = TargetAdapter.from_pretrained(embedded_target_dir)
    torch.manual_seed(0)
    heads = MedusaHeads(target.hidden_size, target.vocab_size, 3)
    heads.init_lm_heads_from(target.lm_head())
    nn.init.normal_(heads.block_weight, std=0.2)
    return SpeculativeDecoder(target, heads, DraftTree.from_paths([[0], [1], [0, 0], [0, 0, 0]]))


PROMPT_TEXT = "def main():\n    parser = argparse."


def test_stream_text_without_stop_matches_generate(decoder, byte_bpe):
    prompt = byte_bpe.encode(PROMPT_TEXT, add_special_tokens=False)
    reference = generate(decoder, prompt, 24)
    stream = stream_text(decoder, byte_bpe, prompt, 24)
    deltas = list(stream)
    assert all(isinstance(d, TextDelta) for d in deltas)
    assert [t for d in deltas for t in d.token_ids] == reference.tokens == stream.result.tokens
    assert "".join(d.text for d in deltas) == byte_bpe.decode(reference.tokens)
    assert stream.result.finish_reason == "length"


def test_stream_text_stops_at_a_string_and_cuts_tokens(decoder, byte_bpe):
    prompt = byte_bpe.encode(PROMPT_TEXT, add_special_tokens=False)
    reference = generate(decoder, prompt, 40)
    full_text = byte_bpe.decode(reference.tokens)
    stop = full_text[len(full_text) // 3:len(full_text) // 3 + 4]
    cut = full_text.find(stop)
    needed = next(k for k in range(1, len(reference.tokens) + 1) if stop in byte_bpe.decode(reference.tokens[:k]))
    stream = stream_text(decoder, byte_bpe, prompt, 40, stop=[stop])
    deltas = list(stream)
    result = stream.result
    assert "".join(d.text for d in deltas) == full_text[:cut]
    assert result.finish_reason == "stop"
    assert result.tokens == reference.tokens[:needed] == [t for d in deltas for t in d.token_ids]
    assert result.stats.num_new_tokens == len(result.tokens)
    assert 1 + result.stats.steps + result.stats.accepted_tokens >= len(result.tokens)
    assert result.stats.steps < reference.stats.steps  # the decode really ended early


def test_stream_text_eos_is_not_text(decoder, byte_bpe):
    prompt = byte_bpe.encode(PROMPT_TEXT, add_special_tokens=False)
    reference = generate(decoder, prompt, 12).tokens
    eos = reference[4]
    stream = stream_text(decoder, byte_bpe, prompt, 12, eos_token_id=eos)
    deltas = list(stream)
    tokens = stream.result.tokens
    assert tokens == reference[:reference.index(eos) + 1] and stream.result.finish_reason == "stop"
    assert "".join(d.text for d in deltas) == byte_bpe.decode(tokens)
    with pytest.raises(ValueError, match="empty"):
        stream_text(decoder, byte_bpe, prompt, 12, stop=[""])
