"""The learning curve (bench/learning_curve.py): held-out top-1 read from each heads
directory's calibration, tau from its bench report at its own tree, a table and a PNG."""

import json

import pytest
import torch

from conftest import make_tiny_model
from specheads.bench import learning_curve
from specheads.heads.heads_dir import HeadsConfig, save_heads
from specheads.heads.medusa import MedusaHeads
from specheads.heads.target import TargetAdapter


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
                                "--point", f"100000={small}", "--out", str(out)]) == 0
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
