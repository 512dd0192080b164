"""bench/step_costs.py runs through the serving path on a tiny target (its figures mean
nothing here; this keeps the tool from rotting)."""

from __future__ import annotations

from specheads.bench.step_costs import main


def test_step_costs_reports_every_tree_size_and_depth(tiny_llama_dir, capsys):
    assert main(["--target", str(tiny_llama_dir), "--prefix", "20", "--trees", "1,4", "--depths", "1,2",
                 "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "T=  1" in out and "T=  4" in out
    assert "depth 1" in out and "depth 2" in out and "Medusa draft" in out
    assert main(["--target", str(tiny_llama_dir), "--prefix", "20", "--trees", "1", "--depths", "1",
                 "--repeats", "1", "--draft-vocab", "64"]) == 0
    out = capsys.readouterr().out
    assert "over 256 tokens" in out and "over 64 tokens" in out  # Medusa over the full and the draft vocab
