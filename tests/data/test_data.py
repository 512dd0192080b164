"""Chat data: record shapes, chat template + assistant-only loss mask, the fallback
template, bad records by reason, self-distillation regeneration (resume, determinism) and
the offline feature cache.

Tokenizers are tiny byte-level BPEs built here (vocab < 512), one with a ChatML-style
template and one without; the target is conftest's tiny random Llama with vocab 512.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specheads.data.chat import FALLBACK_TEMPLATE, TemplateError, ensure_chat_template, reply_turns
from specheads.data.records import Conversation, normalize_record
from specheads.data.text import DataError, build_blocks, extract_documents, load_records, load_text_data

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<eos>", "<pad>", "<|im_start|>", "<|im_end|>"]

CHATS = [
    [("system", "You are terse."), ("user", "What is two plus two?"), ("assistant", "Four."),
     ("user", "And three plus three?"), ("assistant", "Six, of course.")],
    [("user", "Say hello."), ("assistant", "Hello there!")],
    [("user", "Name a color."), ("assistant", "Blue is a color.")],
]


def sharegpt(chat):
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    return {"conversations": [{"from": names[r], "value": c} for r, c in chat]}


def openai(chat):
    return {"messages": [{"role": r, "content": c} for r, c in chat]}


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def build_tokenizer(directory: Path, chat_template: str | None) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [content for chat in CHATS for _, content in chat] + ["user assistant system hello"]
    backend.train_from_iterator(corpus * 10, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>",
                                        additional_special_tokens=SPECIALS[2:])
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("chat-tok"), CHATML)


@pytest.fixture(scope="module")
def plain_tok(tmp_path_factory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("plain-tok"), None)


@pytest.fixture(scope="module")
def target_512(tmp_path_factory) -> Path:
    from conftest import make_tiny_model

    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-512"), vocab_size=512, hidden_size=32)


def load_tok(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# ---------------------------------------------------------------------------- records

def test_each_record_shape_is_detected_and_normalised():
    chat = CHATS[1]
    expected = Conversation(tuple({"role": r, "content": c} for r, c in chat))
    assert normalize_record(sharegpt(chat)) == (expected, None)
    assert normalize_record(openai(chat)) == (expected, None)
    assert normalize_record({"text": "plain"}) == ("plain", None)
    assert normalize_record({"body": "plain"}, "body") == ("plain", None)
    assert normalize_record({"input_ids": [3, 4]}) == ([3, 4], None)


def test_bad_records_are_counted_by_reason():
    records = [
        openai(CHATS[1]),
        {"messages": [{"role": "user", "content": "hi"}]},
        {"messages": [{"role": "bot", "content": "hi"}, {"role": "assistant", "content": "x"}]},
        {"conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "x"}]},
        {"conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}]},
        {"messages": []},
        {"title": "nothing"},
    ]
    documents, skipped = extract_documents(records, "text")
    assert len(documents) == 1
    assert skipped == {"'messages' has no assistant turn": 1, "'messages' has unknown role 'bot'": 1,
                       "'conversations' has an empty turn": 1, "'conversations' turn without 'value'": 1,
                       "empty 'messages'": 1, "missing field 'text'": 1}


# ---------------------------------------------------------------------------- template + mask

def masked_text(tokenizer, blocks) -> str:
    return tokenizer.decode(blocks.input_ids.flatten()[blocks.loss_mask.flatten()].tolist())


def test_loss_mask_covers_exactly_the_assistant_tokens(chat_tok):
    tokenizer = load_tok(chat_tok)
    records = [sharegpt(CHATS[0]), openai(CHATS[1])]
    blocks = build_blocks("mem", records, "text", 128, str(chat_tok))
    replies = [c for chat in CHATS[:2] for r, c in chat if r == "assistant"]
    assert masked_text(tokenizer, blocks) == "".join(f"{reply}<|im_end|>\n" for reply in replies)
    # Everything else is there too, without loss: the full renderings, joined by EOS.
    rendered = "<eos>".join(tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in chat], tokenize=False)
                       for chat in CHATS[:2])
    all_ids = blocks.input_ids.flatten()
    assert tokenizer.decode(all_ids[all_ids != tokenizer.pad_token_id].tolist()) == rendered + "<eos>"
    assert blocks.report.num_conversations == 2 and blocks.report.chat_template == "tokenizer"
    assert blocks.report.num_tokens == int(blocks.loss_mask.sum())


def test_text_and_chat_records_mix_in_one_file(chat_tok, tmp_path):
    path = write_jsonl(tmp_path / "mix.jsonl", [openai(CHATS[1]), {"text": "hello"}, sharegpt(CHATS[2])])
    tokenizer = load_tok(chat_tok)
    blocks = build_blocks(str(path), load_records(str(path)), "text", 64, str(chat_tok))
    assert masked_text(tokenizer, blocks) == "Hello there!<|im_end|>\nhello<eos>Blue is a color.<|im_end|>\n"
    assert "3/3 records used" in blocks.report.summary()


def test_tokenizer_without_a_template_uses_the_fallback_and_says_so(plain_tok, capsys):
    tokenizer = load_tok(plain_tok)
    blocks = build_blocks("mem", [openai(CHATS[1])], "text", 32, str(plain_tok))
    out = capsys.readouterr().out
    assert "has no chat template; using the fallback template" in out and FALLBACK_TEMPLATE in out
    assert blocks.report.chat_template == "fallback" and "fallback chat template" in blocks.report.summary()
    assert masked_text(tokenizer, blocks) == "Hello there!<eos>\n"
    assert tokenizer.decode(blocks.input_ids[0][blocks.input_ids[0] != tokenizer.pad_token_id].tolist()) == (
        "<|user|>\nSay hello.\n<|assistant|>\nHello there!<eos>\n<eos>")
    build_blocks("mem", [openai(CHATS[2])], "text", 32, str(plain_tok))
    assert "fallback" not in capsys.readouterr().out  # announced once per tokenizer


def test_a_template_that_does_not_render_the_replies_is_reported(chat_tok):
    """Templates that rewrite earlier turns are trained turn by turn (test_chat_templates.py);
    one that leaves the replies out entirely gives nothing to train on, and says so."""
    tokenizer = load_tok(chat_tok)
    tokenizer.chat_template = CHATML.replace("{{ m['content'] }}", "{% if m['role'] != 'assistant' %}{{ m['content'] }}"
                                             "{% endif %}")
    with pytest.raises(TemplateError, match="does not render the reply after its generation prompt"):
        reply_turns(tokenizer, [{"role": r, "content": c} for r, c in CHATS[1]])
    blocks = build_blocks("mem", [openai(CHATS[1]), {"text": "hello"}], "text", 32, None, tokenizer=tokenizer)
    assert blocks.report.skipped == {"chat template does not render the reply after its generation prompt": 1}
    assert ensure_chat_template(tokenizer) == "tokenizer"


def test_over_long_conversations_are_truncated_or_skipped(chat_tok):
    records = [openai(CHATS[0]), openai(CHATS[1])]
    kept = build_blocks("mem", records, "text", 40, str(chat_tok))  # CHATS[0] is 61 tokens, CHATS[1] 22
    assert kept.report.num_truncated == 1 and kept.report.num_documents == 2
    skipped = build_blocks("mem", records, "text", 40, str(chat_tok), truncate=False)
    assert skipped.report.skipped == {"longer than seq_len": 1} and skipped.report.num_documents == 1
    assert "skipped 1 (longer than seq_len: 1)" in skipped.report.summary()
    with pytest.raises(DataError, match="longer than seq_len: 2"):
        build_blocks("mem", records, "text", 4, str(chat_tok), truncate=False)


def test_a_file_with_bad_records_trains_on_the_good_ones(chat_tok, tmp_path):
    good = [openai(CHATS[i % 3]) for i in range(20)]
    bad = [{"messages": [{"role": "user", "content": "hi"}]}, {"messages": [{"role": "bot", "content": "x"}]}]
    path = write_jsonl(tmp_path / "chat.jsonl", good + bad)

    from specheads.training.config import DataConfig

    data = DataConfig(source=str(path), tokenizer=str(chat_tok), seq_len=32, eval_fraction=0.1)
    train, held_out = load_text_data(data, None, seed=0)
    skipped = {**train.report.skipped}
    for reason, count in held_out.report.skipped.items():
        skipped[reason] = skipped.get(reason, 0) + count
    assert skipped == {"'messages' has no assistant turn": 1, "'messages' has unknown role 'bot'": 1}
    assert train.report.num_documents + held_out.report.num_documents == 20
    assert train.report.num_tokens > 0 and held_out.report.num_tokens > 0


def test_train_main_on_chat_data_with_bad_records(chat_tok, target_512, tmp_path, capsys):
    from specheads.train import main

    records = [openai(CHATS[i % 3]) for i in range(24)] + [{"messages": [{"role": "user", "content": "hi"}]}]
    source = write_jsonl(tmp_path / "chat.jsonl", records)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"""\
target:
  name_or_path: {target_512}
heads:
  num_heads: 2
  num_layers: 1
data:
  source: {source}
  tokenizer: {chat_tok}
  seq_len: 64
train:
  steps: 2
  micro_batch_size: 2
  save_every: 10
  log_every: 1
  output_dir: {tmp_path / 'run'}
calibrate:
  num_nodes: 4
  max_rank: 2
  eval_batches: 1
""")
    assert main([str(recipe)]) == 0
    out = capsys.readouterr().out
    assert "'messages' has no assistant turn: 1" in out
    assert "conversations (tokenizer chat template" in out


# ---------------------------------------------------------------------------- regenerate

def regen_records() -> list:
    return [openai(CHATS[0]), sharegpt(CHATS[1]), {"messages": [{"role": "user", "content": "hi"}]},
            openai(CHATS[2]), sharegpt(CHATS[0]), openai(CHATS[1])]


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_regenerate_writes_one_output_per_valid_input(chat_tok, target_512, tmp_path):
    from specheads.data.regenerate import regenerate

    source = write_jsonl(tmp_path / "in.jsonl", regen_records())
    output = tmp_path / "out.jsonl"
    progress = regenerate(str(target_512), str(source), str(output), tokenizer_path=str(chat_tok),
                          batch_size=2, max_new_tokens=5, log=lambda _: None)
    lines = read_lines(output)
    assert [line["index"] for line in lines] == [0, 1, 3, 4, 5]
    assert progress.skipped == {"'messages' has no assistant turn": 1} and progress.num_written == 5
    for line, record in zip(lines, [regen_records()[i] for i in (0, 1, 3, 4, 5)]):
        original, _ = normalize_record(record)
        assert [m["role"] for m in line["messages"]] == [m["role"] for m in original.messages]
        assert [m["content"] for m in line["messages"] if m["role"] != "assistant"] == [
            m["content"] for m in original.messages if m["role"] != "assistant"]
    assert progress.num_turns == 2 + 1 + 1 + 2 + 1
    # Regenerated data is valid training data.
    blocks = build_blocks(str(output), load_records(str(output)), "text", 128, str(chat_tok))
    assert blocks.report.num_documents == 5


def test_regenerate_turns_records_into_multi_turn_conversations_with_the_targets_own_replies(
        chat_tok, target_512, tmp_path):
    from specheads.data.chat import generation_prompt_ids
    from specheads.data.regenerate import generate_replies, load_generation_target, regenerate

    records = [{"id": "a", "turns": ["hello there", "and then?"]}, {"id": "b", "turns": ["one turn"]},
               {"id": "c", "turns": []}, openai(CHATS[0])]
    source = write_jsonl(tmp_path / "in.jsonl", records)
    output = tmp_path / "out.jsonl"
    # fp32, the exact mode: a reply decoded in a batch of three equals the same reply decoded alone.
    progress = regenerate(str(target_512), str(source), str(output), tokenizer_path=str(chat_tok),
                          batch_size=3, max_new_tokens=6, dtype="float32", log=lambda _: None)
    lines = {line["index"]: line["messages"] for line in read_lines(output)}
    assert list(lines) == [0, 1, 3]  # input order, though record 1's one reply ends before record 0's second
    assert progress.skipped == {"'turns' is not a non-empty list of non-empty strings": 1}
    tokenizer, model = load_tok(chat_tok), load_generation_target(str(target_512), dtype="float32")
    for index in (0, 1):
        messages = lines[index]
        assert [m["content"] for m in messages if m["role"] == "user"] == records[index]["turns"][:len(messages) // 2]
        for turn in range(1, len(messages), 2):  # every reply is the target's, given its own earlier replies
            assert messages[turn]["role"] == "assistant"
            prompt = generation_prompt_ids(tokenizer, messages[:turn])
            assert generate_replies(model, tokenizer, [prompt], 6, 1) == [messages[turn]["content"]]
    assert len(lines[0]) + progress.num_empty_ended * 2 >= 4 and 3 in lines
    # A GPU's way, run on the CPU: every step's forward in static shapes (what CUDA graphs
    # capture), new rows prefilled in groups, a next turn's whole context prefilled anew.
    again = tmp_path / "again.jsonl"
    regenerate(str(target_512), str(source), str(again), tokenizer_path=str(chat_tok), batch_size=3,
               max_new_tokens=6, dtype="float32", log=lambda _: None, cuda_graphs="eager", prefill_group=2)
    assert again.read_bytes() == output.read_bytes()


def test_regenerate_resumes_after_an_interruption_without_duplicates(chat_tok, target_512, tmp_path):
    from specheads.data.regenerate import regenerate
    from specheads.data.reply_progress import progress_path

    source = write_jsonl(tmp_path / "in.jsonl", regen_records())
    run = dict(tokenizer_path=str(chat_tok), batch_size=2, max_new_tokens=5, log=lambda _: None)
    full = tmp_path / "full.jsonl"
    regenerate(str(target_512), str(source), str(full), **run)

    part = tmp_path / "part.jsonl"
    first = regenerate(str(target_512), str(source), str(part), max_batches=1, **run)
    assert first.next_record == 2 and len(read_lines(part)) == 2
    with open(part, "a") as f:  # a crash in the middle of writing the next batch
        f.write('{"index": 3, "messa')
    regenerate(str(target_512), str(source), str(part), **run)
    assert part.read_bytes() == full.read_bytes()  # deterministic (greedy), nothing repeated or lost
    assert json.loads(progress_path(part).read_text())["next_record"] == 6

    again = regenerate(str(target_512), str(source), str(part), **run)  # complete: a no-op
    assert again.num_written == 5 and part.read_bytes() == full.read_bytes()


def test_regenerate_cli_and_its_user_errors(chat_tok, target_512, tmp_path, capsys):
    import argparse

    from specheads import data_cli

    parser = argparse.ArgumentParser(prog="specheads")
    data_cli.add_parser(parser.add_subparsers(dest="command"))
    source = write_jsonl(tmp_path / "in.jsonl", regen_records()[:2])
    output = tmp_path / "out.jsonl"
    argv = ["data", "regenerate", "--target", str(target_512), "--input", str(source), "--output", str(output),
            "--tokenizer", str(chat_tok), "--batch-size", "4", "--max-new-tokens", "3"]
    assert data_cli.run(parser.parse_args(argv)) == 0
    assert len(read_lines(output)) == 2 and "2/2 records done" in capsys.readouterr().out
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text("{}\n")
    argv[argv.index(str(output))] = str(foreign)
    assert data_cli.run(parser.parse_args(argv)) == 2
    assert "exists without foreign.jsonl.progress.json" in capsys.readouterr().err
    assert data_cli.run(parser.parse_args(argv + ["--device", "cuda:7"])) == 2  # checked before any model loads
    assert "--device cuda:7: torch sees" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["regenerate", "cache", "store"])
def test_a_missing_input_is_refused_before_any_target_is_built(command, tmp_path, monkeypatch, capsys):
    """embedded:tiny takes minutes to build on a slow machine the first time: a mistyped --input
    must not wait for it."""
    from specheads.cli import main
    from specheads.data import tiny_target

    def build(*args, **kwargs):
        raise AssertionError("the target was built before --input was checked")

    monkeypatch.setattr(tiny_target, "build_tiny_target", build)
    monkeypatch.setattr(tiny_target.gguf, "smollm2_target", build)
    missing = tmp_path / "sharegpt.jsonl"
    extra = {"regenerate": [], "cache": ["--taps", "1"], "store": []}[command]
    assert main(["data", command, "--target", "embedded:tiny", "--input", str(missing), "--output",
                 str(tmp_path / "out"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"data source {str(missing)!r} does not exist" in err


# ---------------------------------------------------------------------------- feature cache

@pytest.fixture(scope="module")
def cache_blocks(chat_tok):
    return build_blocks("mem", [openai(CHATS[i % 3]) for i in range(6)], "text", 32, str(chat_tok))


def test_feature_cache_prints_its_size_first_and_round_trips(cache_blocks, target_512, tmp_path):
    from specheads.data.feature_cache import FeatureCache, estimate_bytes, write_cache
    from specheads.heads.target.adapter import TargetAdapter

    target = TargetAdapter.from_pretrained(target_512)
    logged = []
    out = tmp_path / "cache"
    write_cache(target, cache_blocks, [1, 2], out, batch_size=3, blocks_per_shard=2, log=logged.append)
    num_blocks = len(cache_blocks)
    expected = estimate_bytes(num_blocks, 32, target.hidden_size, 2, target.vocab_size, None, torch.float32)
    assert f"({expected} bytes)" in logged[0] and "full logits" in logged[0]
    assert all("wrote shard" in line for line in logged[1:]) and len(logged) == 1 + -(-num_blocks // 2)
    assert abs(sum(p.stat().st_size for p in out.glob("shard-*")) - expected) < 0.05 * expected

    cache = FeatureCache(out)
    assert len(cache) == num_blocks
    indices = [4, 0, 3]
    cached = cache.batch(indices)
    input_ids, loss_mask = cache_blocks.batch(indices)
    fresh = target(input_ids, [1, 2])
    assert torch.equal(cached["input_ids"], input_ids) and torch.equal(cached["loss_mask"], loss_mask)
    torch.testing.assert_close(cached["tap_1"], fresh.taps[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cached["tap_2"], fresh.taps[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cached["logits"], fresh.logits, atol=1e-5, rtol=1e-5)
    batches = list(cache.iter_batches(4))
    assert [b["input_ids"].shape[0] for b in batches] == [4, num_blocks - 4]


def test_feature_cache_top_k_and_size_limit(cache_blocks, target_512, tmp_path):
    from specheads.data.feature_cache import FeatureCache, write_cache
    from specheads.heads.target.adapter import TargetAdapter

    target = TargetAdapter.from_pretrained(target_512)
    logged = []
    with pytest.raises(DataError, match="over the limit of 1e-06 GB"):
        write_cache(target, cache_blocks, [1], tmp_path / "big", max_gb=1e-6, log=logged.append)
    assert "about" in logged[0] and not (tmp_path / "big").exists()

    write_cache(target, cache_blocks, [1], tmp_path / "topk", top_k=8, log=lambda _: None)
    cached = FeatureCache(tmp_path / "topk").batch([1])
    fresh = target(cache_blocks.batch([1])[0], [1]).logits.topk(8, dim=-1)
    torch.testing.assert_close(cached["topk_values"], fresh.values, atol=1e-5, rtol=1e-5)
    assert cached["topk_indices"].dtype == torch.int32 and "logits" not in cached


def test_cache_cli_prints_the_estimate_and_refuses_over_the_limit(chat_tok, target_512, tmp_path, capsys):
    import argparse

    from specheads import data_cli
    from specheads.data.feature_cache import FeatureCache

    parser = argparse.ArgumentParser(prog="specheads")
    data_cli.add_parser(parser.add_subparsers(dest="command"))
    source = write_jsonl(tmp_path / "chat.jsonl", [openai(CHATS[i % 3]) for i in range(4)])
    argv = ["data", "cache", "--target", str(target_512), "--input", str(source), "--taps", "0,2",
            "--output", str(tmp_path / "cache"), "--tokenizer", str(chat_tok), "--seq-len", "32"]
    assert data_cli.run(parser.parse_args(argv + ["--max-gb", "1e-9"])) == 2
    captured = capsys.readouterr()
    assert "feature cache:" in captured.out and "over the limit" in captured.err
    assert not (tmp_path / "cache").exists()
    assert data_cli.run(parser.parse_args(argv)) == 0
    assert FeatureCache(tmp_path / "cache").taps == [0, 2]
    assert data_cli.run(parser.parse_args(argv[:6] + ["--taps", "a,b"] + argv[8:])) == 2
    assert "--taps" in capsys.readouterr().err
