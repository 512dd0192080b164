"""`specheads tune` (bench/tune.py, specheads/tune_cli.py) on a tiny random Llama with random
Medusa heads: the sweep's candidates, the stored tree, the sweep record, and that bench and
the decoder then use the tuned tree. No timing asserts (which setting wins is load-dependent)."""

import argparse
import json

import pytest
import torch

from conftest import make_tiny_model
from specheads.bench.step_costs import StepCostTable
from specheads.bench.tune import format_tuning, tune_heads_dir
from specheads.bench.tune_candidates import (ADAEDL_THRESHOLD, ADAEDL_TWINS, adaedl_twins, candidate_settings,
                                             dynamic_settings, static_settings)
from specheads.heads.artefacts.heads_dir import (HeadsConfig, TUNING_NAME, read_heads_config, read_tuning, save_heads,
                                                 update_tree)
from specheads.heads.medusa import MedusaHeads
from specheads.heads.target.adapter import TargetAdapter
from specheads.serving.decode.config import TreeSpec
from specheads.serving.decode.trees import DraftTree

NUM_HEADS = 3
ACCURACY = [[0.6, 0.2, 0.1, 0.05], [0.4, 0.15, 0.05, 0.02], [0.3, 0.1, 0.05, 0.01]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tune")
    target_dir = make_tiny_model("llama", root / "target", vocab_size=512)  # 512: make_tokenizer's ids fit
    target = TargetAdapter.from_pretrained(target_dir)
    torch.manual_seed(0)
    heads = MedusaHeads(target.hidden_size, target.vocab_size, NUM_HEADS, 1)
    config = HeadsConfig(kind="medusa", hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                         num_heads=NUM_HEADS, num_layers=1, tap_layers=[target.num_layers], target=target.identity,
                         tree={"paths": [[0], [1], [0, 0]]}, calibration={"accuracy": ACCURACY})
    return root, target_dir, target, heads, config


def fresh_heads_dir(setup, name: str):
    root, _, _, heads, config = setup
    return save_heads(root / name, heads, config)


def test_candidates_cover_chains_and_budgets_without_duplicates(setup):
    config = setup[4]
    settings = static_settings(ACCURACY, eagle=False, node_budgets=(4, 8))
    names = [s.name for s in settings]
    assert names[:3] == ["chain-1", "chain-2", "chain-3"]
    keys = [tuple(map(tuple, s.record["paths"])) for s in settings]
    assert len(set(keys)) == len(keys), "duplicate trees in the sweep"
    for s in settings:  # every record is a valid tree of the advertised shape
        tree = DraftTree.from_paths(s.record["paths"])
        assert (tree.num_nodes - 1, tree.max_depth) == (s.num_nodes, s.max_depth)
    assert any(s.max_depth == 1 and s.num_nodes == 4 for s in settings)  # a wide, shallow tree too
    # max_settings bounds the static trees; the AdaEDL twins of the best two come on top.
    candidates = candidate_settings(config, max_settings=4)
    assert [s.entropy_threshold is None for s in candidates] == [True] * 4 + [False] * ADAEDL_TWINS
    for twin in candidates[4:]:
        assert twin.record["entropy_threshold"] == ADAEDL_THRESHOLD and twin.max_depth > 1
        assert twin.record["paths"] == next(s.record["paths"] for s in candidates[:4] if twin.name.startswith(s.name))
    with pytest.raises(ValueError, match="depth limits must be in 1..3"):
        static_settings(ACCURACY, eagle=False, depths=[4])
    # EAGLE drafts level by level: a deeper tree is estimated to cost more than Medusa's.
    medusa = {s.name: s.estimate for s in settings}
    eagle = {s.name: s.estimate for s in static_settings(ACCURACY, eagle=True, node_budgets=(4, 8))}
    assert eagle["chain-3"] < medusa["chain-3"]


def test_tune_stores_a_loadable_tree_and_one_sweep_entry_per_setting(setup):
    _, _, target, _, _ = setup
    heads_dir = fresh_heads_dir(setup, "heads-a")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 9, 7)]
    report = tune_heads_dir(target, str(heads_dir), prompts, max_new_tokens=10, budget_s=30, max_settings=5,
                            node_budgets=(4, 6), progress=False)
    config = read_heads_config(heads_dir)
    # The candidates were ranked by the step costs tune measured on this machine first.
    costs = StepCostTable.from_json(report["step_costs"])
    assert costs.verify_ms and costs.draft_kind == "medusa" and costs.draft_ms
    expected = candidate_settings(config, max_settings=5, node_budgets=(4, 6), costs=costs)
    assert [r["name"] for r in report["settings"]] + [s["name"] for s in report["skipped"]] != []
    assert sorted(r["name"] for r in report["settings"]) == sorted(s.name for s in expected)
    assert report["skipped"] == []
    rates = [r["tokens_per_s"] for r in report["settings"]]
    assert rates == sorted(rates, reverse=True)
    for row in report["settings"]:
        assert row["identical"], row["name"]  # lossless: every tree reproduces plain greedy
        assert row["tau"] >= 1.0 and 0.0 <= row["alpha"] <= 1.0 and row["step_cost"] > 0
        assert row["tokens"] == report["plain"]["tokens"]
    winner = next(r for r in report["settings"] if r["name"] == report["winner"])
    assert config.tree["paths"] == winner["tree"]["paths"]
    assert config.tree["tuned"]["setting"] == winner["name"]
    tree = TreeSpec.from_heads_config(config).tree
    assert tree.num_nodes - 1 == winner["num_nodes"] and tree.max_depth == winner["max_depth"]
    stored = read_tuning(heads_dir)
    assert stored["winner"] == report["winner"] and len(stored["settings"]) == len(expected)
    assert config.calibration == {"accuracy": ACCURACY}  # only the tree changed
    assert "(chosen)" in format_tuning(report)
    assert not [p for p in heads_dir.iterdir() if p.name.startswith(".")], "temp files left behind"
    # The winner measured again without and with n-gram lookup; stored only when it was faster.
    lookup = report["lookup"]
    assert lookup["num_tokens"] == 10 and lookup["without"]["identical"] and lookup["with"]["identical"]
    assert lookup["chosen"] == (lookup["with"]["tokens_per_s"] > lookup["without"]["tokens_per_s"])
    assert ("lookup" in config.tree) == lookup["chosen"]
    assert "n-gram lookup (10 tokens)" in format_tuning(report)


def test_tuned_lookup_is_stored_and_used_by_default(tmp_path):
    from test_server_support import build_tiny_setup

    from specheads.bench.tune import stored_tree
    from specheads.runner import load_decoder
    from specheads.serving.decode.lookup import LookupConfig
    from specheads.serving.decode.config import parse_tree_field

    row = {"name": "chain-2", "tree": {"paths": [[0], [0, 0]]}, "num_nodes": 2, "tokens_per_s": 10.0,
           "speedup_vs_plain": 1.2, "tau": 1.5, "step_cost": 1.1}
    report = {"winner": "chain-2", "device": "cpu", "torch_threads": 1, "settings": [row],
              "lookup": {"num_tokens": 7, "chosen": True, "with": {"tokens_per_s": 12.0}, "without": {}}}
    tree = stored_tree(report)
    assert tree["lookup"] == {"num_tokens": 7} and tree["tuned"]["tokens_per_s_with_lookup"] == 12.0
    assert "lookup" not in stored_tree(dict(report, lookup=dict(report["lookup"], chosen=False)))
    assert "lookup" not in stored_tree(dict(report, lookup=None))
    assert parse_tree_field(tree).lookup == LookupConfig(num_tokens=7)
    assert parse_tree_field({"paths": [[0]]}).lookup is None and parse_tree_field(None).lookup is None
    with pytest.raises(ValueError, match="num_tokens"):
        parse_tree_field({"lookup": {"num_tokens": 0}}).lookup
    with pytest.raises(ValueError, match="keys from"):
        parse_tree_field({"lookup": {"tokens": 7}}).lookup
    target_dir, heads_dir = build_tiny_setup(tmp_path)
    assert load_decoder(str(target_dir), str(heads_dir), progress=False)[0].lookup is None
    update_tree(heads_dir, tree)
    assert load_decoder(str(target_dir), str(heads_dir), progress=False)[0].lookup == LookupConfig(num_tokens=7)
    assert load_decoder(str(target_dir), str(heads_dir), progress=False, lookup_num_tokens=0)[0].lookup is None
    assert load_decoder(str(target_dir), str(heads_dir), progress=False,
                        lookup_num_tokens=3)[0].lookup == LookupConfig(num_tokens=3)
    assert load_decoder(str(target_dir), None, progress=False, lookup_num_tokens=4)[0].lookup.num_tokens == 4
    with pytest.raises(ValueError, match="--lookup-num-tokens must be >= 0"):
        load_decoder(str(target_dir), str(heads_dir), progress=False, lookup_num_tokens=-1)


def test_bench_uses_the_tuned_tree(setup):
    from specheads.bench.harness import heads_trees, run_bench
    from specheads.bench.prompts import EncodedPrompt
    from specheads.heads.artefacts.heads_dir import load_heads

    _, _, target, _, _ = setup
    heads_dir = fresh_heads_dir(setup, "heads-b")
    update_tree(heads_dir, {"paths": [[0], [0, 0]], "tuned": {"setting": "chain-2"}}, {"settings": []})
    heads, config = load_heads(heads_dir, target=target.identity)
    (tree, info), = heads_trees(config, None)
    assert info["source"] == "heads-dir-tuned" and tree.max_depth == 2 and tree.is_chain
    report = run_bench(target, [EncodedPrompt(0, "a", [5, 6, 7])], 6, heads=heads, heads_config=config,
                       warmup=False, prompt_lookup_num_tokens=0, lookup_num_tokens=0)
    assert [m["name"] for m in report["methods"]] == ["hf-greedy", "engine-plain", "engine-heads[tuned,2]"]
    assert all(m["overall"]["identical"] for m in report["methods"])


def test_update_tree_rejects_a_tree_without_paths(setup):
    heads_dir = fresh_heads_dir(setup, "heads-c")
    before = (heads_dir / "config.json").read_text()
    with pytest.raises(ValueError, match="'paths'.*'dynamic'"):
        update_tree(heads_dir, {"num_nodes": 3})
    assert (heads_dir / "config.json").read_text() == before
    assert not (heads_dir / TUNING_NAME).exists()


def test_tune_cli(setup, tmp_path, capsys):
    from test_bench import make_tokenizer

    from specheads import tune_cli

    _, target_dir, _, _, _ = setup
    make_tokenizer(target_dir)
    heads_dir = fresh_heads_dir(setup, "heads-d")
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": "code", "turns": [f"def f{i}(x):"]})
                                 for i in range(2)) + "\n")
    parser = argparse.ArgumentParser()
    tune_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["tune", "--target", str(target_dir), "--heads", str(heads_dir), "--prompts",
                              str(prompts), "--max-new-tokens", "6", "--budget-s", "20", "--depths", "1,2",
                              "--node-budgets", "3", "--output-json", str(tmp_path / "t.json"), "--quiet"])
    assert tune_cli.run(args) == 0
    out = capsys.readouterr().out
    assert "(chosen)" in out
    report = json.loads((tmp_path / "t.json").read_text())
    assert {r["name"] for r in report["settings"]} == {"chain-1", "chain-2", "tree-d1-n3", "tree-d2-n3",
                                                       "chain-2-adaedl0.3", "tree-d2-n3-adaedl0.3"}
    assert read_heads_config(heads_dir).tree["tuned"]["setting"] == report["winner"]
    bad = parser.parse_args(["tune", "--target", str(target_dir), "--heads", str(heads_dir), "--depths", "0"])
    with pytest.raises(ValueError, match="--depths expects positive integers"):
        tune_cli.run(bad)


def test_a_stored_dynamic_tree_is_benched_as_one(setup):
    """When tune picks a dynamic tree (EAGLE heads), config.json holds {"dynamic": {...}} and
    bench hands the decoder a DynamicTreeConfig."""
    from specheads.bench.harness import heads_trees
    from specheads.serving.decode.trees import DynamicTreeConfig

    heads_dir = fresh_heads_dir(setup, "heads-e")
    record = {"depth": 2, "top_k": 4, "num_nodes": 8, "entropy_threshold": None}
    config = update_tree(heads_dir, {"dynamic": record, "tuned": {"setting": "dynamic-d2-k4-n8"}})
    (tree, info), = heads_trees(config, None)
    assert tree == DynamicTreeConfig(**record)
    assert info == {"source": "heads-dir-tuned", "num_nodes": 9, "num_draft_nodes": 8, "max_depth": 2, "dynamic": True}


def test_eagle_candidates_get_adaedl_twins_of_the_deepest_dynamic_trees():
    dynamic = dynamic_settings(4)
    twins = adaedl_twins(dynamic, eagle=True)
    assert len(twins) == ADAEDL_TWINS
    for twin in twins:
        assert twin.kind == "dynamic" and twin.max_depth == 4 and twin.entropy_threshold is None
        assert twin.tree.entropy_threshold == ADAEDL_THRESHOLD
        assert twin.record["dynamic"]["entropy_threshold"] == ADAEDL_THRESHOLD
    assert twins[0].num_nodes == max(s.num_nodes for s in dynamic)


def test_tune_tries_the_reply_store_and_stores_it_when_faster(setup, tmp_path):
    from specheads.bench.tune import stored_tree
    from specheads.heads.artefacts.reply_store import ReplyStore, write_store
    from specheads.serving.decode.store import StoreConfig, StoreDrafter

    _, _, target, _, _ = setup
    heads_dir = fresh_heads_dir(setup, "heads-store")
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 8)]
    with torch.no_grad():
        replies = [target.model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=10,
                                         pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    write_store(tmp_path / "s", replies, target=target.identity, tokenizer={"fingerprint": "-"})
    store = StoreDrafter(ReplyStore(tmp_path / "s"), StoreConfig(num_tokens=4))
    report = tune_heads_dir(target, str(heads_dir), prompts, max_new_tokens=10, budget_s=30, max_settings=2,
                            node_budgets=(3,), progress=False, lookup_num_tokens=0, store=store)
    measured = report["store"]
    assert measured["path"] == str((tmp_path / "s").resolve()) and measured["config"]["num_tokens"] == 4
    assert measured["without"]["identical"] and measured["with"]["identical"]
    assert measured["chosen"] == (measured["with"]["tokens_per_s"] > measured["without"]["tokens_per_s"])
    config = read_heads_config(heads_dir)
    assert ("store" in config.tree) == measured["chosen"]
    assert "reply store" in format_tuning(report)
    chosen = stored_tree(dict(report, store=dict(measured, chosen=True)))
    assert chosen["store"] == {"path": measured["path"], **measured["config"]}
    spec = TreeSpec.from_heads_config(HeadsConfig(**{**config.to_dict(), "target": config.target, "tree": chosen}))
    assert spec.store == StoreConfig(num_tokens=4) and spec.store_path == measured["path"]
    assert "store" not in stored_tree(dict(report, store=dict(measured, chosen=False)))


def test_tune_says_when_no_setting_beat_plain_decoding():
    from specheads.bench.tune import best_speedup, format_tuning, slower_than_plain

    def row(name, speedup):
        return {"name": name, "num_nodes": 4, "max_depth": 1, "tokens_per_s": 40.0 * speedup,
                "speedup_vs_plain": speedup, "tau": 1.3, "alpha": 0.3, "step_ms": 30.0, "step_cost": 1.4,
                "identical": True, "lossless": True}

    report = {"winner": "tree-a", "num_prompts": 1, "max_new_tokens": 8, "device": "cpu", "torch_threads": 2,
              "plain": {"tokens_per_s": 40.0, "step_ms": 25.0}, "skipped": [], "lookup": None, "store": None,
              "settings": [row("tree-a", 0.96), row("chain-1", 0.9)]}
    assert best_speedup(report) == 0.96
    assert "0.96x plain decoding's 40.0 tok/s" in slower_than_plain(report)
    assert "speculation did not pay" in format_tuning(report)
    # lookup measured with the winner counts: a faster branch is a gain
    report["lookup"] = {"num_tokens": 8, "chosen": True, "with": row("with", 1.1), "without": row("without", 0.96)}
    assert best_speedup(report) == 1.1 and slower_than_plain(report) is None
    assert "did not pay" not in format_tuning(report)


def test_a_tuning_that_did_not_pay_makes_generate_and_serve_decode_plainly(setup, capsys):
    """stored_tree records "plain" when no setting beat plain decoding, and load_decoder (generate,
    serve) then builds a decoder without heads, saying why in one line."""
    from specheads.bench.tune import stored_tree
    from specheads.runner import load_decoder

    def row(name, speedup):
        return {"name": name, "num_nodes": 1, "max_depth": 1, "tokens_per_s": 40.0 * speedup,
                "speedup_vs_plain": speedup, "tau": 1.1, "alpha": 0.1, "step_ms": 30.0, "step_cost": 1.4,
                "tree": {"paths": [[0]]}, "identical": True, "lossless": True}

    report = {"winner": "chain-1", "device": "cpu", "torch_threads": 2, "plain": {"tokens_per_s": 40.0},
              "settings": [row("chain-1", 0.8)], "lookup": None, "store": None, "conditions": {"device": "cpu-avx2"}}
    assert stored_tree(report)["plain"] is True
    assert "plain" not in stored_tree(dict(report, settings=[row("chain-1", 1.2)]))
    heads_dir = fresh_heads_dir(setup, "plain")
    update_tree(heads_dir, stored_tree(report), report)
    assert TreeSpec.from_heads_config(read_heads_config(heads_dir)).plain
    decoder, _ = load_decoder(str(setup[1]), str(heads_dir), dtype="float32")
    assert decoder.drafter is None and not decoder.speculates
    assert "decoding plainly" in capsys.readouterr().err


def test_a_tuning_is_kept_only_under_the_conditions_it_was_measured_in(setup):
    """retune_reason: never tuned, another device class, dtype, kernel or thread count, CUDA graphs,
    or a decode step that moved by more than RETUNE_STEP_CHANGE -> tune again; else keep it."""
    from specheads.bench.tune import RETUNE_STEP_CHANGE, conditions, retune_reason

    costs = StepCostTable(dtype="float32", layout="plain", threads=2, prefix=8, verify_ms={1: 10.0, 4: 12.0},
                          draft_ms={})
    now = conditions(setup[2], costs)
    assert now["decode_ms"] == 10.0 and now["dtype"] == "float32" and now["device"].startswith("cpu-")
    assert retune_reason(None, now) == "never tuned"
    assert "recorded their conditions" in retune_reason({"setting": "chain-1"}, now)
    assert retune_reason({"conditions": now}, now) is None
    assert retune_reason({"conditions": dict(now, decode_ms=10.0 * (1 + RETUNE_STEP_CHANGE / 2))}, now) is None
    assert "decode step cost 20.0 ms when tuned" in retune_reason({"conditions": dict(now, decode_ms=20.0)}, now)
    for key, other in (("device", "cpu-avx512bf16"), ("dtype", "bfloat16"), ("row_kernel", "avx2"), ("threads", 8),
                       ("cuda_graphs", "capture")):
        assert key in retune_reason({"conditions": dict(now, **{key: other})}, now)


def test_tune_measures_the_engine_as_serve_runs_it(setup, monkeypatch):
    """cuda_graphs reaches every decoder of the sweep (here the static-shape path a CPU can run,
    "eager"; "capture" on a GPU), the plain reference included, and the report records it."""
    from specheads.bench import tune as tune_module
    from specheads.serving.decode.config import SpeculativeDecoder

    built = []
    real_init = SpeculativeDecoder.__init__

    def recording_init(self, *args, **kwargs):
        built.append(kwargs.get("cuda_graphs"))
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(SpeculativeDecoder, "__init__", recording_init)
    _, _, target, heads, config = setup
    settings = static_settings(ACCURACY, eagle=False, node_budgets=(4,))[:2]
    report = tune_module.tune(target, heads, config, [[5, 6, 7, 8]], max_new_tokens=4, settings=settings,
                              progress=False, lookup_num_tokens=0, cuda_graphs="eager")
    assert built and set(built) == {"eager"}
    assert report["conditions"]["cuda_graphs"] == "eager"
