"""`specheads data store` (data/reply_store.py) and the store on the command line.

The builder keeps exactly the assistant tokens of chat records (through the template's
end-of-turn marker, as training's loss mask has them), one store sequence per reply, counts
the records it leaves out, and records the target and its tokenizer. `generate --store` drafts
from it with greedy output unchanged; a heads directory that records a store (relative to
itself) is used by default and `--store none` turns it off; a store built with another tokenizer
is refused with one line (exit status 2).
"""

from __future__ import annotations

import json

import pytest
import torch

from specheads.cli import main
from specheads.data.reply_store import NOT_A_CHAT, build_store, reply_runs
from specheads.data.text import DataError, load_tokenizer
from specheads.heads.artefacts.heads_dir import update_tree
from specheads.heads.artefacts.reply_store import ReplyStore, tokenizer_fingerprint
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


def test_reply_runs_are_the_masked_spans():
    assert reply_runs([1, 2, 3, 4, 5, 6], [False, True, True, False, True, False]) == [[2, 3], [5]]
    assert reply_runs([1, 2], [True, True]) == [[1, 2]] and reply_runs([1], None) == []


def test_the_store_holds_the_assistant_tokens(setup):
    from specheads.data.chat import ensure_chat_template, reply_turns

    root, target_dir, _, records = setup
    manifest, report = build_store(str(records), str(target_dir), str(root / "store"))
    tokenizer = load_tokenizer(str(target_dir))
    ensure_chat_template(tokenizer)
    expected = []
    for record in CHATS[:2]:
        for turn in reply_turns(tokenizer, record["messages"]):
            expected.append(turn.reply)  # the reply's text through its end-of-turn marker
    store = ReplyStore(root / "store")
    held = []
    position = 0
    for _ in range(manifest.num_sequences):
        reply = []
        while int(store.index.tokens[position]) != 0xFFFFFFFF:
            reply.append(int(store.index.tokens[position]))
            position += 1
        held.append(reply)
        position += 1
    assert [tokenizer.decode(reply) for reply in held] == expected
    assert report.num_replies == manifest.num_sequences == 3 and report.num_conversations == 2
    assert report.num_tokens == manifest.num_tokens == sum(len(reply) for reply in held)
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


def test_the_command_line(setup, capsys):
    root, target_dir, heads_dir, records = setup
    store = root / "cli-store"
    assert main(["data", "store", "--input", str(records), "--target", str(target_dir), "--output", str(store)]) == 0
    assert "3 replies" in capsys.readouterr().out
    prompt = "the cat sat"
    common = ["generate", "--target", str(target_dir), "--prompt", prompt, "--max-new-tokens", "12", "--dtype",
              "float32", "--output-json", "-"]
    assert main(common) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(common + ["--store", str(store)]) == 0
    stored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert stored["text"] == plain["text"] and stored["speculative"] and not plain["speculative"]
    assert 0 <= stored["store_accepted"] <= stored["accepted_tokens"]


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
