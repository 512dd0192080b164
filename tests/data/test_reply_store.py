"""`specheads data store` (data/reply_store.py) and the store on the command line.

The builder keeps exactly the assistant tokens of chat records (through the template's
end-of-turn marker, as training's loss mask has them), one store sequence per reply after its
mark (the last --mark-tokens tokens of the prompt serving feeds for that turn; 0: bare replies),
counts the records it leaves out, and records the target and its tokenizer. `generate --store`
over a store of the target's own greedy reply drafts it from the first step, with greedy output
unchanged; a heads directory that records a store (relative to itself) is used by default and
`--store none` turns it off; a store built with another tokenizer is refused with one line (exit
status 2).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from specheads.cli import main
from specheads.data.reply_store import NOT_A_CHAT, build_store, marked_replies, reply_spans
from specheads.data.text import DataError, load_tokenizer
from specheads.heads.artefacts.heads_dir import update_tree
from specheads.heads.artefacts.reply_store import SEPARATOR, ReplyStore, tokenizer_fingerprint
from specheads.heads.target.adapter import TargetAdapter

from conftest import make_byte_bpe_tokenizer
from test_server_support import build_tiny_setup

CHATS = [
    {"messages": [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "def f(x): return x"},
                  {"role": "user", "content": "again"}, {"role": "assistant", "content": "the cat sat"}]},
    {"messages": [{"role": "user", "content": "and you"}, {"role": "assistant", "content": "the cat sat on the mat"}]},
    {"text": "plain text is not a reply"},
    {"messages": [{"role": "user", "content": "no answer"}]},
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("store-cli")
    target_dir, heads_dir = build_tiny_setup(root)
    records = root / "replies.jsonl"
    records.write_text("".join(json.dumps(record) + "\n" for record in CHATS))
    return root, target_dir, heads_dir, records


def stored_sequences(store: ReplyStore) -> list[list[int]]:
    """The store's token array cut at its separators."""
    tokens = store._token_array.astype(np.int64)
    ends = np.flatnonzero(tokens == SEPARATOR)
    return [tokens[start:end].tolist() for start, end in zip(np.concatenate([[0], ends[:-1] + 1]), ends)]


def test_reply_spans_are_the_masked_runs_and_marks_what_comes_before():
    assert reply_spans([False, True, True, False, True, False]) == [(1, 3), (4, 5)]
    assert reply_spans([True, True]) == [(0, 2)] and reply_spans(None) == []
    ids, mask = [1, 2, 3, 4, 5, 6], [False, True, True, False, True, False]
    assert marked_replies(ids, mask, 2) == [([1], [2, 3]), ([3, 4], [5])]  # the first reply's prompt is shorter
    assert marked_replies(ids, mask, 0) == [([], [2, 3]), ([], [5])]


@pytest.mark.parametrize("mark_tokens", [8, 40, 0])
def test_the_store_holds_each_reply_after_its_prompt_s_tail(setup, tmp_path, mark_tokens):
    """Each sequence: the last mark_tokens tokens of the prompt serving feeds for that turn
    (the template's generation prompt; for turn 2 with 40, the end of turn 1 too), then the
    reply's text through its end-of-turn marker."""
    from specheads.data.chat import ensure_chat_template, generation_prompt_ids, reply_turns

    root, target_dir, _, records = setup
    manifest, report = build_store(str(records), str(target_dir), str(tmp_path / "store"), mark_tokens=mark_tokens)
    tokenizer = load_tokenizer(str(target_dir))
    ensure_chat_template(tokenizer)
    expected_marks, expected_replies = [], []
    for record in CHATS[:2]:
        messages = record["messages"]
        turns = reply_turns(tokenizer, messages)
        for turn, index in zip(turns, [i for i, message in enumerate(messages) if message["role"] == "assistant"]):
            prompt = generation_prompt_ids(tokenizer, messages[:index])
            expected_marks.append(prompt[len(prompt) - min(mark_tokens, len(prompt)):])
            expected_replies.append(turn.reply)  # the reply's text through its end-of-turn marker
    assert max(map(len, expected_marks)) == mark_tokens
    if mark_tokens == 40:  # the first prompt is shorter; the second's tail holds the end of turn 1
        assert len(expected_marks[0]) < 40 and "return x" in tokenizer.decode(expected_marks[1])
    held = stored_sequences(ReplyStore(tmp_path / "store"))
    marks = [sequence[:len(mark)] for sequence, mark in zip(held, expected_marks)]
    assert marks == expected_marks
    assert [tokenizer.decode(sequence[len(mark):]) for sequence, mark in zip(held, expected_marks)] == expected_replies
    assert report.num_replies == manifest.num_sequences == 3 and report.num_conversations == 2
    assert report.num_mark_tokens == manifest.num_mark_tokens == sum(map(len, expected_marks))
    assert report.num_tokens == manifest.num_reply_tokens == sum(map(len, held)) - manifest.num_mark_tokens
    assert manifest.num_tokens == sum(map(len, held)) and manifest.mark_tokens == mark_tokens
    assert report.skipped[NOT_A_CHAT] == 1 and sum(report.skipped.values()) == 2  # the text and the turn-less chat
    assert manifest.target == TargetAdapter.from_pretrained(target_dir).identity
    assert manifest.tokenizer["fingerprint"] == tokenizer_fingerprint(tokenizer)
    assert "3 replies" in report.summary(manifest) and "skipped 2" in report.summary(manifest)


def test_no_replies_is_an_error(setup, tmp_path):
    _, target_dir, _, _ = setup
    texts = tmp_path / "texts.jsonl"
    texts.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(DataError, match="no chat records with assistant replies"):
        build_store(str(texts), str(target_dir), str(tmp_path / "s"))
    assert not (tmp_path / "s").exists()


def char_level_target(target_dir, directory):
    """The tiny target beside a tokenizer of one character per id over its whole vocabulary, no
    merges: any ids decode to text that tokenizes back to the same ids. (The random target's
    greedy ids, decoded with the byte-level BPE, are broken UTF-8 and ids that BPE would never
    produce: tokenized again they are other ids, so no store built from text could draft them.)"""
    from tokenizers import Tokenizer, decoders, models
    from transformers import AutoConfig, PreTrainedTokenizerFast

    directory.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(target_dir / name, directory / name)
    specials = ["<pad>", "<bos>", "<eos>"]  # the tiny target's pad, bos and eos ids
    chars = [chr(code) for code in (9, 10, *range(32, 127))]
    num_others = AutoConfig.from_pretrained(directory).vocab_size - len(specials) - len(chars)
    chars += [chr(0x400 + k) for k in range(num_others)]
    backend = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(specials + chars)}, merges=[]))
    backend.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                            clean_up_tokenization_spaces=False).save_pretrained(directory)
    return directory


def test_the_command_line(setup, tmp_path, capsys):
    """`data store` over the target's own greedy reply to a chat prompt, then `generate --store`
    on that prompt: the store's chain is accepted and the text is plain greedy's; with marks the
    first step drafts (the prompt's assistant header matches the mark), without them it cannot."""
    from specheads.data.chat import ensure_chat_template, render

    root, target_dir, _, records = setup
    assert main(["data", "store", "--input", str(records), "--target", str(target_dir), "--output",
                 str(tmp_path / "chats")]) == 0
    assert "3 replies" in capsys.readouterr().out
    target = char_level_target(target_dir, tmp_path / "char-target")
    tokenizer = load_tokenizer(str(target))
    ensure_chat_template(tokenizer)
    messages = [{"role": "user", "content": "the cat sat"}]
    common = ["generate", "--target", str(target), "--prompt", render(tokenizer, messages, True), "--max-new-tokens",
              "12", "--dtype", "float32", "--output-json", "-"]

    def generate(*extra) -> dict:
        assert main(common + list(extra)) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    plain = generate()
    own = tmp_path / "own.jsonl"
    own.write_text(json.dumps({"messages": messages + [{"role": "assistant", "content": plain["text"]}]}) + "\n")
    stored = {}
    for mark_tokens in (8, 0):
        store = tmp_path / f"store-{mark_tokens}"
        assert main(["data", "store", "--input", str(own), "--target", str(target), "--output", str(store),
                     "--mark-tokens", str(mark_tokens)]) == 0
        capsys.readouterr()
        stored[mark_tokens] = generate("--store", str(store))
    for run in stored.values():
        assert run["text"] == plain["text"] and run["speculative"] and not plain["speculative"]
        assert 0 < run["store_accepted"] == run["accepted_tokens"]
    assert plain["num_tokens"] == 12 and stored[8]["steps"] < stored[0]["steps"]


def test_bench_and_tune_take_a_store_on_the_command_line(setup, tmp_path):
    """`bench --store` benches the store alone and beside the heads; `tune --store` measures the
    winner with and without it; both refuse a corrupt store before the target loads."""
    import shutil

    root, target_dir, heads_dir, records = setup
    store, heads = tmp_path / "store", tmp_path / "heads"
    build_store(str(records), str(target_dir), str(store))
    shutil.copytree(heads_dir, heads)  # tune writes its winner into the directory
    prompts = tmp_path / "q.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "chat", "turns": ["the cat sat"]}) + "\n")
    common = ["--target", str(target_dir), "--heads", str(heads), "--prompts", str(prompts), "--max-new-tokens",
              "6", "--dtype", "float32", "--store", str(store)]
    assert main(["bench", *common, "--lookup-num-tokens", "3", "--prompt-lookup-num-tokens", "0", "--no-warmup",
                 "--output-json", str(tmp_path / "bench.json")]) == 0
    kinds = {method["kind"] for method in json.loads((tmp_path / "bench.json").read_text())["methods"]}
    assert {"engine-store", "engine-heads+store"} <= kinds
    assert main(["tune", *common, "--budget-s", "5", "--depths", "1", "--node-budgets", "2", "--lookup-num-tokens",
                 "0", "--quiet", "--output-json", str(tmp_path / "tune.json")]) == 0
    assert json.loads((tmp_path / "tune.json").read_text())["store"]["path"] == str(store)
    (store / "tokens.bin").write_bytes(b"")
    for command in ("bench", "tune"):
        assert main([command, *common]) == 2


def test_a_recorded_store_is_used_by_default_and_none_turns_it_off(setup):
    from specheads.runner import load_decoder

    root, target_dir, heads_dir, records = setup
    build_store(str(records), str(target_dir), str(heads_dir / "replies"))
    tree = {"paths": [[0], [0, 0]], "store": {"path": "replies", "num_tokens": 5}}
    update_tree(heads_dir, tree)
    decoder = load_decoder(str(target_dir), str(heads_dir), progress=False)[0]
    assert decoder.store.config.num_tokens == 5 and decoder.chain_sources[-1] is decoder.store
    assert load_decoder(str(target_dir), str(heads_dir), progress=False, store="none")[0].store is None
    update_tree(heads_dir, {"paths": [[0], [0, 0]]})
    assert load_decoder(str(target_dir), str(heads_dir), progress=False)[0].store is None


def test_a_store_for_another_tokenizer_is_refused_on_one_line(setup, tmp_path, capsys):
    root, target_dir, _, records = setup
    other = tmp_path / "other-target"
    other.mkdir()
    for name in ("config.json", "model.safetensors"):
        (other / name).write_bytes((target_dir / name).read_bytes())
    make_byte_bpe_tokenizer(other, ["completely different words here\n", "zebra quartz\n"])
    assert main(["data", "store", "--input", str(records), "--target", str(other), "--output",
                 str(tmp_path / "s")]) == 0
    capsys.readouterr()
    code = main(["generate", "--target", str(target_dir), "--prompt", "the cat", "--max-new-tokens", "2",
                 "--store", str(tmp_path / "s")])
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if "error" in line]  # (the other lines: the weights' loading bar)
    assert code == 2 and len(errors) == 1 and "another vocabulary" in errors[0] and "specheads data store" in errors[0]
    (tmp_path / "s" / "tokens.bin").write_bytes(b"")
    assert main(["generate", "--target", str(target_dir), "--prompt", "the cat", "--store", str(tmp_path / "s")]) == 2
    assert "corrupt" in capsys.readouterr().err
    torch.manual_seed(0)
