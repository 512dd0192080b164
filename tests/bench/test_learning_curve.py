"""The learning curve (bench/tools/learning_curve.py): held-out top-1 read from each heads
directory's calibration, tau from its bench report at its own tree, a table and a PNG; with
--eval-prompts, every point's top-1 on one fixed set of the target's greedy replies, by the
training loss's own rule; --series groups the points."""

import json
import re

import pytest
import torch

from transformers import AutoTokenizer

from conftest import make_byte_bpe_tokenizer, make_tiny_model
from specheads.bench.tools import learning_curve
from specheads.heads.artefacts.heads_dir import HeadsConfig, load_heads, save_heads
from specheads.heads.medusa import MedusaHeads
from specheads.heads.target.adapter import TargetAdapter


def _heads_dir(root, target, name: str, top1: list[float]):
    torch.manual_seed(0)
    heads = MedusaHeads(target.hidden_size, target.vocab_size, len(top1), 1)
    config = HeadsConfig(kind="medusa", hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                         num_heads=len(top1), num_layers=1, tap_layers=[target.num_layers], target=target.identity,
                         calibration={"accuracy": [[a, a / 4] for a in top1]})
    return save_heads(root / name, heads, config)


def _bench(path, tau: float):
    methods = [{"name": "hf-greedy", "kind": "hf-greedy", "tree": None, "overall": {"tau": 1.0}},
               {"name": "engine-medusa[calibrated,8]", "kind": "engine-heads", "tree": {"source": "calibrated"},
                "overall": {"tau": 9.9}},
               {"name": "engine-medusa[heads-dir,4]", "kind": "engine-heads", "tree": {"source": "heads-dir"},
                "overall": {"tau": tau}}]
    path.write_text(json.dumps({"schema": "specheads.bench/1", "methods": methods}))
    return path


def test_curve_reads_calibration_and_the_own_tree_tau(tmp_path, capsys):
    target = TargetAdapter.from_pretrained(make_tiny_model("llama", tmp_path / "target"))
    small = _heads_dir(tmp_path, target, "small", [0.4, 0.2, 0.1])
    large = _heads_dir(tmp_path, target, "large", [0.7, 0.5, 0.3])
    out = tmp_path / "curve.png"
    assert learning_curve.main(["--point", f"1000000={large}:{_bench(tmp_path / 'l.json', 2.5)}",
                                "--point", f"100000={small}", "--output", str(out)]) == 0
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("| 1")]
    assert rows == ["| 100,000 | 0.400 | 0.200 | 0.100 | - |", "| 1,000,000 | 0.700 | 0.500 | 0.300 | 2.50 |"]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_points_are_named(tmp_path):
    with pytest.raises(ValueError, match="TOKENS=HEADS_DIR"):
        learning_curve.parse_point("lots=runs/x")
    with pytest.raises(ValueError, match="no engine-heads method at the heads directory's own tree"):
        learning_curve.bench_tau({"methods": [{"kind": "engine-heads", "tree": {"source": "calibrated"},
                                               "overall": {"tau": 2.0}}]}, "b.json")


def test_top1_hits_score_depth_d_at_t_against_the_target_at_t_plus_d():
    want = torch.arange(10, 20)  # the target's argmax after positions 0..9
    prompt_len = 4
    perfect = torch.stack([torch.cat([want[1 + j:], torch.full((1 + j,), -1)]) for j in range(3)])
    hits, counts = learning_curve.top1_hits(perfect, want, prompt_len)
    assert hits == counts == [6, 5, 4]  # from t = 3 (the draft right after the prompt) to t = 8 - j
    off_by_one = torch.stack([torch.cat([want[j:], torch.full((j,), -1)]) for j in range(3)])
    assert learning_curve.top1_hits(off_by_one, want, prompt_len)[0] == [0, 0, 0]


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_fixed_set_top1_is_the_training_metric_on_those_replies(kind, tmp_path):
    """The fixed-set figure equals the training loss's own top-1 (training/losses.py) on the
    same sequences with the loss mask from the draft after the prompt on."""
    from transformers import AutoModelForCausalLM

    from specheads.heads.eagle3 import next_token_embeddings
    from specheads.heads.artefacts.heads_dir import build_heads, eagle_heads_config
    from specheads.training.losses import eagle_ttt_loss, medusa_distill_loss

    target = TargetAdapter.from_pretrained(make_tiny_model("llama", tmp_path / "target", num_layers=3))
    prompt = torch.randint(3, 256, (7,), generator=torch.Generator().manual_seed(1)).tolist()
    reply = learning_curve.greedy_reply(target, prompt, 20, eos_token_id=None)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "target").generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=20, min_new_tokens=20)
    assert reply == hf[0, len(prompt):].tolist()  # the target's own greedy reply
    ids = prompt + reply
    ids_BL = torch.tensor([ids])
    mask_BL = torch.zeros(1, len(ids), dtype=torch.bool)
    mask_BL[:, len(prompt) - 1:] = True
    for seed in range(50):  # random heads, until one whose first candidates hit the target somewhere
        torch.manual_seed(seed)
        if kind == "medusa":
            config = HeadsConfig(kind="medusa", hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                                 num_heads=3, num_layers=1, tap_layers=[target.num_layers], target=target.identity)
        else:
            config = eagle_heads_config(target, num_steps=3, draft_vocab_size=128)
        heads = build_heads(config).eval()
        if kind == "eagle3":
            d2t = torch.arange(128) + 1  # draft id i is target id 2i + 1
            t2d = torch.zeros(256, dtype=torch.bool)
            t2d[1::2] = True
            heads.set_draft_vocab(d2t, t2d)
        heads.init_lm_heads_from(target.lm_head())
        if kind == "medusa":  # its blocks start at zero (each head the target's lm_head): make them differ
            with torch.no_grad():
                heads.block_weight.normal_(0.0, 0.5)
        got = learning_curve.fixed_set_top1(heads, config, target, [(ids, len(prompt))], depths=3)
        with torch.inference_mode():
            out = target(ids_BL, config.tap_layers)
            if kind == "medusa":
                want = medusa_distill_loss(heads(out.taps[-1]), out.logits, mask_BL).head_top1
            else:
                logits, _ = heads(torch.cat(out.taps, -1), next_token_embeddings(target.embeddings(), ids_BL), 3)
                want = eagle_ttt_loss(logits, out.logits, mask_BL, heads.draft_to_target()).head_top1
        assert got == pytest.approx(want.tolist(), abs=1e-6)
        if sum(got) > 0:
            break
    assert 0 < sum(got) < 3, "no random head hit the target: the comparison above proved little"


def test_the_cli_scores_every_point_on_one_fixed_set_per_series(tmp_path, capsys):
    directory = make_tiny_model("llama", tmp_path / "target", vocab_size=300)  # the byte BPE's ids
    make_byte_bpe_tokenizer(directory, ["def f(x): return x + 1", "the quick brown fox"])
    target = TargetAdapter.from_pretrained(directory)
    small = _heads_dir(tmp_path, target, "small", [0.4, 0.2, 0.1])
    large = _heads_dir(tmp_path, target, "large", [0.7, 0.5, 0.3])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": "c", "turns": [text]}) + "\n"
                               for i, text in enumerate(["def f(x):", "the quick", "brown fox"])))
    out = tmp_path / "curve.png"
    assert learning_curve.main(["--series", "1 epoch", "--point", f"1000={small}", "--series", "3 epochs",
                                "--point", f"3000={large}", "--point", f"1000={small}", "--eval-prompts",
                                str(prompts), "--target", str(directory), "--limit", "2", "--max-new-tokens", "6",
                                "--dtype", "float32", "--output", str(out)]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert [(r[0], r[1]) for r in rows] == [("| 1 epoch", "1,000"), ("| 3 epochs", "1,000"),
                                                ("| 3 epochs", "3,000")]
    sequences = learning_curve.eval_sequences(
        target, AutoTokenizer.from_pretrained(directory), str(prompts), 2, 6)
    heads, config = load_heads(large)
    want = learning_curve.fixed_set_top1(heads, config, target, sequences, 3)
    assert rows[2][5:8] == [f"{a:.3f}" for a in want]  # held-out columns 2-4, fixed-set 5-7
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replies_decoded_together_are_each_the_reply_alone(tmp_path):
    """--batch-size N: the replies decode N at a time, each the one its prompt gets alone."""
    target = TargetAdapter.from_pretrained(make_tiny_model("llama", tmp_path / "target", num_layers=2))
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (length,), generator=generator).tolist() for length in (5, 9, 3, 7)]
    together = learning_curve.greedy_replies(target, prompts, 10, eos_token_id=None, batch_size=3)
    assert together == [learning_curve.greedy_reply(target, p, 10, eos_token_id=None) for p in prompts]
    assert all(len(reply) == 10 for reply in together)
    with pytest.raises(SystemExit):
        learning_curve.main(["--point", f"1000={tmp_path}", "--eval-prompts", "p.jsonl", "--target", "t",
                             "--batch-size", "0"])


def test_eval_prompts_need_a_target(tmp_path):
    with pytest.raises(SystemExit):
        learning_curve.main(["--point", f"1000={tmp_path}", "--eval-prompts", "p.jsonl"])
    with pytest.raises(SystemExit):
        learning_curve.main(["--point", f"1000={tmp_path}", "--by-category"])


def test_category_top1_splits_depth_1_by_category_and_by_the_targets_certainty(tmp_path, monkeypatch, capsys):
    """Depth-1 hits counted by hand from the heads' and the target's own forwards, over sequences
    that are not replies (the split does not care); SURE is set to the median of the target's top
    probabilities so that both sides of it hold positions, and the slices' edges so that each
    slice by prompt length and by reply position holds some."""
    directory = make_tiny_model("llama", tmp_path / "target", vocab_size=300)
    make_byte_bpe_tokenizer(directory, ["def f(x): return x + 1", "the quick brown fox"])
    target = TargetAdapter.from_pretrained(directory)
    heads_dir = _heads_dir(tmp_path, target, "h", [0.4, 0.2])
    heads, config = load_heads(heads_dir)
    heads.init_lm_heads_from(target.lm_head())  # with zero blocks the depth-1 head is the target's lm_head,
    # so it hits where the target's argmax repeats, as it does over a run of one token
    generator = torch.Generator().manual_seed(2)
    sequences = []
    for (category, token), prompt_len in zip((("a", 7), ("b", 50), ("a", 120)), (5, 8, 5)):
        ids = torch.cat([torch.randint(3, 300, (11,), generator=generator), torch.full((10,), token),
                         torch.randint(3, 300, (6,), generator=generator)]).tolist()
        sequences.append((ids, prompt_len, category))
    tops, expected = [], {}
    with torch.inference_mode():
        for ids, prompt_len, category in sequences:
            out = target(torch.tensor([ids]), config.tap_layers)
            top, want = out.logits[0].softmax(-1).max(-1)
            draft = heads(out.taps[-1], num_heads=1)[0, 0].argmax(-1)
            for t in range(prompt_len, len(ids)):
                row = (bool(draft[t - 1] == want[t]), float(top[t]))
                tops.append(row[1])
                copied = "wanted token in the prompt" if int(want[t]) in ids[:prompt_len] else \
                    "wanted token not in the prompt"
                for name in (category, "all", "prompt of 0-5 tokens" if prompt_len <= 5 else "prompt of 6+ tokens",
                             "reply tokens 0-7" if t - prompt_len < 8 else "reply tokens 8+", copied):
                    expected.setdefault(name, []).append(row)
    sure = sorted(tops)[len(tops) // 2]
    monkeypatch.setattr(learning_curve, "SURE", sure)
    monkeypatch.setattr(learning_curve, "PROMPT_EDGES", (0, 6))
    monkeypatch.setattr(learning_curve, "REPLY_EDGES", (0, 8))
    got = learning_curve.category_top1(heads, config, target, sequences)
    assert list(got) == ["a", "b", "all", "prompt of 0-5 tokens", "prompt of 6+ tokens", "reply tokens 0-7",
                         "reply tokens 8+"] + [name for name in ("wanted token in the prompt",
                                                                 "wanted token not in the prompt") if name in expected]
    assert "wanted token not in the prompt" in got
    for taken in ("all", "reply tokens 8+"):
        with pytest.raises(ValueError, match=re.escape(f"category '{taken}' is the name of one of --by-category's")):
            learning_curve.category_top1(heads, config, target, sequences[:1] + [(sequences[1][0], 5, taken)])
    for name, rows in expected.items():
        sure_rows = [hit for hit, p in rows if p >= sure]
        assert got[name]["positions"] == len(rows)
        assert got[name]["top1"] == pytest.approx(sum(hit for hit, _ in rows) / len(rows))
        assert got[name]["sure_share"] == pytest.approx(len(sure_rows) / len(rows))
        assert got[name]["sure_top1"] == pytest.approx(sum(sure_rows) / max(len(sure_rows), 1))
    assert 0 < got["all"]["sure_share"] < 1 and 0 < got["all"]["top1"] < 1
    assert got["all"]["top1"] == pytest.approx(learning_curve.fixed_set_top1(heads, config, target, sequences, 1)[0])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [text]}) + "\n"
                               for i, (c, text) in enumerate([("x", "def f(x):"), ("y", "the quick")])))
    assert learning_curve.main(["--point", f"1000={heads_dir}", "--eval-prompts", str(prompts), "--target",
                                str(directory), "--max-new-tokens", "4", "--dtype", "float32", "--by-category"]) == 0
    table = capsys.readouterr().out
    assert [line.split(" | ")[1] for line in table.splitlines() if line.startswith(f"| {heads_dir} |")][:3] == \
        ["x", "y", "all"]
    assert "| prompt of 0-5 tokens |" in table or "| prompt of 6+ tokens |" in table
