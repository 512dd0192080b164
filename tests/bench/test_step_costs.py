"""bench/step_costs.py runs through the serving path on a tiny target (its figures mean
nothing here; this keeps the tool from rotting), and its table's arithmetic, which tune's
estimates rest on, is exact."""

from __future__ import annotations

import pytest

from specheads.bench.step_costs import StepCostTable, main


def test_step_costs_reports_every_tree_size_and_depth(tiny_llama_dir, capsys):
    assert main(["--target", str(tiny_llama_dir), "--prefix", "20", "--trees", "1,2,4", "--depths", "1,2",
                 "--repeats", "1", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "step costs (float32," in out
    for row in ("| 1 |", "| 2 |", "| 4 |"):
        assert row in out
    assert "draft depth (eagle)" in out and "draft depth (medusa)" in out
    assert out.count("| 2 |") == 3  # verify T=2, and depth 2 of each drafter
    assert main(["--target", str(tiny_llama_dir), "--prefix", "8", "--trees", "1", "--depths", "1",
                 "--repeats", "1", "--dtype", "float32", "--plain-weights"]) == 0
    assert "step costs (float32, plain weights" in capsys.readouterr().out


def _table() -> StepCostTable:
    return StepCostTable(dtype="bfloat16", layout="packed", threads=2, prefix=300,
                         verify_ms={1: 10.0, 4: 12.0, 8: 14.0, 16: 20.0}, draft_ms={1: 1.0, 2: 2.0, 4: 3.0},
                         draft_kind="eagle")


def test_step_cost_table_interpolates_in_decode_steps():
    table = _table()
    assert table.verify_cost(1) == 1.0
    assert table.verify_cost(6) == pytest.approx(1.3)  # halfway between T=4 (1.2) and T=8 (1.4)
    assert table.verify_cost(24) == pytest.approx(2.6)  # beyond T=16: the last segment's slope
    assert table.draft_cost(3) == pytest.approx(0.25)
    assert table.draft_cost(0) == 0.0
    assert table.step_cost(8, 2) == pytest.approx(1.6)
    no_heads = StepCostTable("float32", "plain", 2, 300, {1: 10.0, 8: 15.0}, {})
    assert no_heads.step_cost(8, 3) == pytest.approx(1.5)


def test_step_cost_table_round_trips_through_json():
    import json

    table = _table()
    assert StepCostTable.from_json(json.loads(json.dumps(table.to_json()))) == table
