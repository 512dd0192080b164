"""bench/: prompt loading, the bench harness on a tiny random target with random Medusa
heads, the JSON report and the PNG plot. No timing asserts."""

import argparse
import json

import pytest
import torch

from conftest import make_byte_bpe_tokenizer, make_tiny_model
from specheads.bench.harness import format_report, run_bench
from specheads.bench.prompts import EncodedPrompt, encode_prompts, load_prompts
from specheads.heads.artefacts.heads_dir import HeadsConfig, load_heads, save_heads
from specheads.heads.medusa import MedusaHeads
from specheads.heads.target.adapter import TargetAdapter

CATEGORIES = ["chat", "code", "math", "summarisation", "translation", "retrieval"]
NUM_HEADS = 3


def make_tokenizer(directory):
    """Byte-level BPE over the full byte alphabet (any text encodes), vocab < 512."""
    return make_byte_bpe_tokenizer(directory, ["def f(x):\n    return x + 1\n", "the cat sat on the mat\n"])


@pytest.fixture(scope="module")
def bench_setup(tmp_path_factory):
    """A tiny Llama (vocab 512) with a tokenizer, and random Medusa heads saved beside it."""
    root = tmp_path_factory.mktemp("bench")
    target_dir = make_tiny_model("llama", root / "target", vocab_size=512)
    make_tokenizer(target_dir)
    target = TargetAdapter.from_pretrained(target_dir)
    torch.manual_seed(0)
    heads = MedusaHeads(target.hidden_size, target.vocab_size, NUM_HEADS, 1)
    config = HeadsConfig(kind="medusa", hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                         num_heads=NUM_HEADS, num_layers=1, tap_layers=[target.num_layers], target=target.identity,
                         tree={"paths": [[0], [1], [0, 0], [0, 0, 0]]},
                         calibration={"accuracy": [[0.5, 0.2, 0.1], [0.3, 0.1, 0.05], [0.2, 0.05, 0.02]]})
    heads_dir = save_heads(root / "heads", heads, config)
    return target_dir, heads_dir, target


def write_prompts(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_default_prompts_load_and_cover_categories():
    prompts = load_prompts()
    assert 24 <= len(prompts) <= 36
    assert {p.category for p in prompts} == set(CATEGORIES)
    assert len({p.question_id for p in prompts}) == len(prompts)
    assert all(p.text.strip() for p in prompts)


def test_loader_names_the_bad_line(tmp_path):
    good = json.dumps({"question_id": 1, "category": "chat", "turns": ["hi"]})
    for bad, needle in [("{not json", "not valid JSON"),
                        (json.dumps({"question_id": 2, "turns": ["x"]}), "category"),
                        (json.dumps({"question_id": 3, "category": "chat", "turns": []}), "turns")]:
        path = write_prompts(tmp_path / "p.jsonl", [good, "", bad])
        with pytest.raises(ValueError, match=rf"p\.jsonl:3: .*{needle}"):
            load_prompts(path)


def test_encode_uses_chat_template_when_present(bench_setup):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bench_setup[0])
    prompts = load_prompts(limit=1)
    raw = encode_prompts(tokenizer, prompts)[0].input_ids
    assert raw == tokenizer(prompts[0].text, add_special_tokens=False)["input_ids"]
    tokenizer.chat_template = "{% for m in messages %}U: {{ m['content'] }}\n{% endfor %}A:"
    templated = encode_prompts(tokenizer, prompts)[0].input_ids
    assert tokenizer.decode(templated) == f"U: {prompts[0].text}\nA:"


def test_run_bench_python_api(bench_setup, tmp_path):
    target_dir, heads_dir, target = bench_setup
    heads, config = load_heads(heads_dir, target=target.identity)
    gen = torch.Generator().manual_seed(1)
    prompts = [EncodedPrompt(i, category, torch.randint(3, 512, (6,), generator=gen).tolist())
               for i, category in enumerate(["a", "b", "a"])]
    from transformers import AutoModelForCausalLM

    draft_model = AutoModelForCausalLM.from_pretrained(
        make_tiny_model("llama", tmp_path / "draft", seed=3, vocab_size=512, num_layers=1))
    report = run_bench(target, prompts, 10, heads=heads, heads_config=config, tree_nodes=[2, 6],
                       eos_token_id=None, warmup=False, draft_model=draft_model)
    kinds = [m["kind"] for m in report["methods"]]
    assert kinds == ["hf-greedy", "engine-plain", "engine-heads", "engine-heads+lookup", "engine-heads", "engine-heads",
                     "engine-lookup", "hf-prompt-lookup", "hf-assisted"]
    names = [m["name"] for m in report["methods"]]
    assert "engine-heads+lookup[stored,4]" in names and "engine-lookup[10]" in names
    hybrid = next(m for m in report["methods"] if m["kind"] == "engine-heads+lookup")
    assert hybrid["tree"]["lookup_num_tokens"] == 10 and hybrid["tree"]["num_draft_nodes"] == 4
    trees = [m["tree"] for m in report["methods"] if m["kind"] == "engine-heads"]
    assert [t["num_draft_nodes"] for t in trees] == [4, 2, 6]
    assert [t["source"] for t in trees] == ["heads-dir", "calibrated", "calibrated"]
    for m in report["methods"]:
        assert m["overall"]["identical"], m["name"]
        assert m["overall"]["num_tokens"] == 30
        assert set(m["by_category"]) == {"a", "b"}
        if m["kind"] == "engine-heads":
            assert 0.0 <= m["overall"]["alpha"] <= 1.0
            assert m["overall"]["tau"] >= 1.0
            assert len(m["overall"]["acceptance_by_depth"]) == m["tree"]["max_depth"]
    assert "engine-heads[stored,4]" in format_report(report)
    from matplotlib.image import imread

    from specheads.bench.plot import throughput_bars, write_plots

    for bar, m in zip(throughput_bars(report), report["methods"]):  # the harness's per-prompt records
        assert bar.num_prompts == 3
        assert bar.mean == pytest.approx(sum(p["num_tokens"] / p["seconds"] for p in m["prompts"]) / 3)
    assert imread(write_plots(report, tmp_path / "plots.png")).shape[1] > 1000


def test_run_bench_cuda_graphs_path_is_lossless(bench_setup):
    """CUDA graphs (bench on a CUDA device) build every engine method on the graph path (static
    cache, kernel verify); "eager" runs that path uncaptured on a CPU, and fp32 stays
    token-identical to HF greedy."""
    from specheads.bench.harness import make_methods

    _, heads_dir, target = bench_setup
    heads, config = load_heads(heads_dir, target=target.identity)
    methods = make_methods(target, heads=heads, heads_config=config, eos_token_id=None, prompt_lookup_num_tokens=0,
                           lookup_num_tokens=3, fallback=False, cuda_graphs="eager")
    engines = [m for m in methods if m.kind.startswith("engine")]
    assert [m.kind for m in engines] == ["engine-plain", "engine-heads", "engine-heads+lookup", "engine-lookup"]
    assert all(m.decoder.cuda_graphs == "eager" and m.decoder.attn_impl == "tree" for m in engines)
    gen = torch.Generator().manual_seed(2)
    prompts = [EncodedPrompt(i, "a", torch.randint(3, 512, (5,), generator=gen).tolist()) for i in range(2)]
    report = run_bench(target, prompts, 8, heads=heads, heads_config=config, eos_token_id=None, warmup=False,
                       prompt_lookup_num_tokens=0, lookup_num_tokens=3, fallback=False, cuda_graphs="eager")
    assert [m["name"] for m in report["methods"]] == [m.name for m in methods]
    for m in report["methods"]:
        assert m["overall"]["identical"], m["name"]


def test_bench_cli_json(bench_setup, tmp_path, capsys):
    from specheads import bench_cli

    target_dir, heads_dir, _ = bench_setup
    lines = [json.dumps({"question_id": i, "category": c, "turns": [f"Question {i} about {c}: what now?", "more"]})
             for i, c in enumerate(CATEGORIES)]
    prompts = write_prompts(tmp_path / "q.jsonl", lines)
    parser = argparse.ArgumentParser()
    bench_cli.add_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "report.json"
    args = parser.parse_args(["bench", "--target", str(target_dir), "--heads", str(heads_dir), "--prompts",
                              str(prompts), "--max-new-tokens", "6", "--tree-nodes", "3", "--output-json", str(out),
                              "--plot", str(tmp_path / "p.png"), "--no-warmup", "--dtype", "float32"])
    assert bench_cli.run(args) == 0  # fp32, the exact mode: identity to HF greedy is the claim (bf16 gives near-ties)
    assert "| hf-greedy |" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["schema"] == "specheads.bench/1"
    assert report["categories"] == CATEGORIES
    assert {m["kind"] for m in report["methods"]} == {"hf-greedy", "engine-plain", "engine-heads", "engine-heads+lookup",
                                                      "engine-lookup", "hf-prompt-lookup"}
    for m in report["methods"]:
        assert set(m["by_category"]) == set(CATEGORIES)
        assert m["overall"]["identical"], m["name"]
        assert len(m["prompts"]) == len(CATEGORIES)
    assert (tmp_path / "p.png").read_bytes().startswith(b"\x89PNG")


def test_bench_cli_rejects_tree_nodes_without_heads(bench_setup):
    from specheads import bench_cli

    parser = argparse.ArgumentParser()
    bench_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--target", str(bench_setup[0]), "--tree-nodes", "4"])
    with pytest.raises(ValueError, match="--tree-nodes needs --heads"):
        bench_cli.run(args)
    for flag in ("--lookup-num-tokens", "--prompt-lookup-num-tokens"):
        args = parser.parse_args(["bench", "--target", str(bench_setup[0]), flag, "-1"])
        with pytest.raises(ValueError, match=f"{flag} must be >= 0"):
            bench_cli.run(args)


def test_bench_cli_several_heads_side_by_side_with_tuning(bench_setup, tmp_path, capsys):
    """--heads A --heads B (or A,B) benches both in one run, each at its tuned tree; the
    report carries each directory's tune sweep and the plot draws it."""
    from specheads import bench_cli
    from specheads.heads.artefacts.heads_dir import update_tree

    target_dir, heads_dir, target = bench_setup
    heads, config = load_heads(heads_dir, target=target.identity)
    second = save_heads(tmp_path / "second", heads, config)
    sweep = {"settings": [{"name": "chain-1", "num_nodes": 1, "speedup_vs_plain": 1.1},
                          {"name": "chain-2", "num_nodes": 2, "speedup_vs_plain": 1.3}]}
    update_tree(second, {"paths": [[0], [0, 0]], "tuned": {"setting": "chain-2"}}, sweep)
    prompts = write_prompts(tmp_path / "q.jsonl", [json.dumps({"question_id": 1, "category": "code",
                                                               "turns": ["def f(x):"]})])
    parser = argparse.ArgumentParser()
    bench_cli.add_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "report.json"
    for heads_args in (["--heads", str(heads_dir), "--heads", str(second)], ["--heads", f"{heads_dir},{second}"]):
        args = parser.parse_args(["bench", "--target", str(target_dir), *heads_args, "--prompts", str(prompts),
                                  "--max-new-tokens", "5", "--output-json", str(out), "--plot", str(tmp_path / "p.png"),
                                  "--no-warmup", "--prompt-lookup-num-tokens", "0", "--lookup-num-tokens", "0",
                                  "--no-fallback"])
        assert bench_cli.run(args) == 0
        report = json.loads(out.read_text())
        names = [m["name"] for m in report["methods"]]
        assert names == ["hf-greedy", "engine-plain", "engine-medusa[stored,4]", "engine-medusa:second[tuned,2]"]
        assert [m["tree"]["heads"] for m in report["methods"][2:]] == ["medusa", "medusa:second"]
        assert all(m["overall"]["identical"] for m in report["methods"])
        assert all(m["overall"]["num_fallbacks"] == 0 for m in report["methods"])  # --no-fallback
        assert report["tuning"] == {"medusa": None, "medusa:second": sweep}
        assert (tmp_path / "p.png").read_bytes().startswith(b"\x89PNG")
    assert "engine-medusa:second[tuned,2]" in capsys.readouterr().out


def test_run_bench_with_a_reply_store(bench_setup, tmp_path):
    """--store adds the store alone and beside each heads directory's first tree and lookup; every
    output stays HF greedy's, and the tables show what the store's chains gave."""
    from specheads.heads.artefacts.reply_store import ReplyStore, write_store
    from specheads.serving.decode.store import StoreConfig, StoreDrafter

    _, heads_dir, target = bench_setup
    heads, config = load_heads(heads_dir, target=target.identity)
    gen = torch.Generator().manual_seed(3)
    prompts = [EncodedPrompt(i, "a", torch.randint(3, 512, (5,), generator=gen).tolist()) for i in range(2)]
    with torch.no_grad():  # the store holds the target's own replies to the prompts
        replies = [target.model.generate(torch.tensor([p.input_ids]), do_sample=False, max_new_tokens=10,
                                         pad_token_id=0)[0, 5:].tolist() for p in prompts]
    write_store(tmp_path / "s", replies, target=target.identity, tokenizer={"fingerprint": "-"})
    store = StoreDrafter(ReplyStore(tmp_path / "s"), StoreConfig(num_tokens=4, min_match=1))
    report = run_bench(target, prompts, 10, heads=heads, heads_config=config, eos_token_id=None, warmup=False,
                       prompt_lookup_num_tokens=0, lookup_num_tokens=3, fallback=False, store=store)
    names = [m["name"] for m in report["methods"]]
    assert "engine-heads+lookup+store[stored,4]" in names and "engine-store[4]" in names
    for m in report["methods"]:
        assert m["overall"]["identical"], m["name"]
        assert m["overall"]["store_accepted"] <= m["overall"]["accepted_tokens"]
    alone = next(m for m in report["methods"] if m["kind"] == "engine-store")
    assert 0 < alone["overall"]["store_accepted"] == alone["overall"]["accepted_tokens"]
    hybrid = next(m for m in report["methods"] if m["kind"] == "engine-heads+store")
    assert hybrid["tree"]["store_num_tokens"] == 4 and hybrid["tree"]["lookup_num_tokens"] == 3
    assert "acc. from lookup/store" in format_report(report)


def test_bench_cli_second_turns_with_a_learning_store(bench_setup, tmp_path):
    """--turns 2 decodes each prompt's second turn after the reference's first reply, reported
    apart; --store learn benches a store that starts empty and learns the replies it serves."""
    from specheads import bench_cli

    target_dir, _, _ = bench_setup
    lines = [json.dumps({"question_id": i, "category": c, "turns": [f"Question {i} about {c}?", f"And {i} again?"]})
             for i, c in enumerate(CATEGORIES[:2])]
    prompts = write_prompts(tmp_path / "q.jsonl", lines)
    parser = argparse.ArgumentParser()
    bench_cli.add_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "report.json"
    common = ["bench", "--target", str(target_dir), "--prompts", str(prompts), "--max-new-tokens", "6", "--no-warmup",
              "--dtype", "float32", "--lookup-num-tokens", "0", "--prompt-lookup-num-tokens", "0", "--store", "learn"]
    assert bench_cli.run(parser.parse_args(common + ["--turns", "2", "--output-json", str(out)])) == 0
    report = json.loads(out.read_text())
    assert report["categories"] == ["chat", "code", "chat (turn 2)", "code (turn 2)"]
    assert report["config"]["turns"] == 2
    store = next(m for m in report["methods"] if m["kind"] == "engine-store")
    assert store["overall"]["identical"] and len(store["prompts"]) == 4
    with pytest.raises(ValueError, match="--passes and --turns 2"):
        bench_cli.run(parser.parse_args(common + ["--turns", "2", "--passes", "2"]))
