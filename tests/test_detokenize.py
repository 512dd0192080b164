"""Incremental detokenization and string stop sequences (serving/detokenize.py).

Two real tokenizers, both built offline: the embedded target's byte-level BPE, and a
Llama-style SentencePiece BPE (Metaspace-like normalizer, byte fallback, leading-space
strip) trained here on a few lines. Property: pushing any token sequence in any chunking
and then finishing yields exactly tokenizer.decode(all tokens).
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specheads.serving.detokenize import IncrementalDetokenizer, TextDelta, stream_text

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


# -- stream_text on a real decoder -------------------------------------------------------------------


@pytest.fixture(scope="module")
def decoder(embedded_target_dir):
    """The embedded target (a real trained Llama + its tokenizer) with random Medusa heads."""
    from torch import nn

    from specheads.heads.medusa import MedusaHeads
    from specheads.heads.target import TargetAdapter
    from specheads.serving.decode import SpeculativeDecoder
    from specheads.serving.tree import DraftTree

    target = TargetAdapter.from_pretrained(embedded_target_dir)
    torch.manual_seed(0)
    heads = MedusaHeads(target.hidden_size, target.vocab_size, 3)
    heads.init_lm_heads_from(target.lm_head())
    nn.init.normal_(heads.block_weight, std=0.2)
    return SpeculativeDecoder(target, heads, DraftTree.from_paths([[0], [1], [0, 0], [0, 0, 0]]))


PROMPT_TEXT = "def main():\n    parser = argparse."


def test_stream_text_without_stop_matches_generate(decoder, byte_bpe):
    prompt = byte_bpe.encode(PROMPT_TEXT, add_special_tokens=False)
    reference = decoder.generate(prompt, 24)
    stream = stream_text(decoder, byte_bpe, prompt, 24)
    deltas = list(stream)
    assert all(isinstance(d, TextDelta) for d in deltas)
    assert [t for d in deltas for t in d.token_ids] == reference.tokens == stream.result.tokens
    assert "".join(d.text for d in deltas) == byte_bpe.decode(reference.tokens)
    assert stream.result.finish_reason == "length"


def test_stream_text_stops_at_a_string_and_cuts_tokens(decoder, byte_bpe):
    prompt = byte_bpe.encode(PROMPT_TEXT, add_special_tokens=False)
    reference = decoder.generate(prompt, 40)
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
    reference = decoder.generate(prompt, 12).tokens
    eos = reference[4]
    stream = stream_text(decoder, byte_bpe, prompt, 12, eos_token_id=eos)
    deltas = list(stream)
    tokens = stream.result.tokens
    assert tokens == reference[:reference.index(eos) + 1] and stream.result.finish_reason == "stop"
    assert "".join(d.text for d in deltas) == byte_bpe.decode(tokens)
    with pytest.raises(ValueError, match="empty"):
        stream_text(decoder, byte_bpe, prompt, 12, stop=[""])
