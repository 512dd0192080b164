"""bench/plot.py: the bench report's charts (matplotlib), on hand-built reports. No model
is loaded; the harness's own report reaches the plot in tests/bench/test_bench.py."""

import argparse
import random
import sys

import pytest

from specheads.bench import plot

TREE_SIZES = {"medusa": (5, [8, 16, 32]), "eagle3": (12, [8, 16, 32])}


def method(name, kind, tps, speedup, prompt_tps, tree=None, acceptance=(), identical=True):
    """One report method whose prompts decode 64 tokens each at the tokens/s in `prompt_tps`."""
    prompts = [{"question_id": i, "category": "chat", "num_prompt_tokens": 20, "num_tokens": 64,
                "seconds": 64 / value, "steps": 40, "accepted_tokens": 24, "identical": identical}
               for i, value in enumerate(prompt_tps)]
    overall = {"tokens_per_s": tps, "speedup": speedup, "acceptance_by_depth": list(acceptance),
               "identical": identical, "num_prompts": len(prompts)}
    return {"name": name, "kind": kind, "tree": tree, "overall": overall, "by_category": {}, "prompts": prompts}


def fake_report(heads=("medusa", "eagle3"), tree_nodes=True, tuning=True, num_prompts=8, seed=0):
    """A report shaped like `specheads bench --heads A,B --tree-nodes 8,16,32` on CPU."""
    rng = random.Random(seed)

    def run(name, kind, speedup, tree=None, acceptance=(), identical=True):
        prompt_tps = [24.0 * speedup * rng.uniform(0.8, 1.2) for _ in range(num_prompts)]
        return method(name, kind, sum(prompt_tps) / num_prompts, speedup, prompt_tps, tree, acceptance, identical)

    methods = [run("hf-greedy", "hf-greedy", 1.0), run("engine-plain", "engine-plain", 1.06)]
    for k, label in enumerate(heads):
        own, sizes = TREE_SIZES.get(label, (4, [8, 16]))
        base = [0.62, 0.35, 0.18, 0.08] if label == "medusa" else [0.78, 0.58, 0.41, 0.27, 0.15]
        trees = [(own, "heads-dir-tuned", 1.6 + 0.6 * k)]
        if tree_nodes:
            trees += [(n, "calibrated", 1.7 + 0.5 * k - 0.03 * (n - 8)) for n in sizes]
        for index, (nodes, source, speedup) in enumerate(trees):
            kind_name = "tuned" if source == "heads-dir-tuned" else source
            tree = {"source": source, "num_nodes": nodes + 1, "num_draft_nodes": nodes, "max_depth": len(base),
                    "heads": label, "head_kind": label, "lookup_num_tokens": 0}
            lift = min(1.0, nodes / 16)
            acceptance = [min(0.95, a * (0.8 + 0.3 * lift)) for a in base]
            methods.append(run(f"engine-{label}[{kind_name},{nodes}]", "engine-heads", speedup, tree, acceptance))
            if index == 0:
                methods.append(run(f"engine-{label}+lookup[{kind_name},{nodes}]", "engine-heads+lookup",
                                   speedup + 0.15, dict(tree, lookup_num_tokens=10),
                                   [min(0.97, a + 0.06) for a in acceptance]))
    methods += [run("engine-lookup[10]", "engine-lookup", 1.3), run("hf-prompt-lookup[10]", "hf-prompt-lookup", 1.2),
                run("hf-assisted", "hf-assisted", 0.9, identical=False)]
    sweeps = {label: {"settings": [{"name": f"s{n}", "num_nodes": n, "speedup_vs_plain": 1.2 + 0.1 * k + 0.04 * n
                                    - 0.0015 * n * n} for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)]}
              for k, label in enumerate(heads)} if tuning else {label: None for label in heads}
    config = {"target": "HuggingFaceTB/SmolLM2-135M-Instruct", "num_prompts": num_prompts, "max_new_tokens": 64,
              "dtype": "float32", "device": "cpu"}
    return {"schema": "specheads.bench/1", "config": config, "categories": ["chat"], "reference": "hf-greedy",
            "tuning": sweeps, "methods": methods}


def read_png(path):
    from matplotlib.image import imread

    return imread(path)


def test_write_plots_writes_a_readable_png(tmp_path):
    path = plot.write_plots(fake_report(), tmp_path / "sub" / "bench.png")
    assert path == tmp_path / "sub" / "bench.png"
    image = read_png(path)
    height, width = image.shape[:2]
    assert 1200 <= width <= 2000 and 900 <= height <= 2400, image.shape
    assert image.std() > 0.05  # not a blank canvas
    assert [p.name for p in path.parent.iterdir()] == ["bench.png"]  # no temp file left behind


def test_three_panels_with_titles_and_labels():
    axes = plot.build_figure(fake_report()).axes
    assert [ax.get_title() for ax in axes] == ["Acceptance by draft depth", "Speedup vs tree size",
                                               "Throughput per method (labels: speedup over hf-greedy)"]
    assert all(ax.get_xlabel() for ax in axes) and axes[0].get_ylabel() and axes[1].get_ylabel()
    assert "std across prompts" in axes[2].get_xlabel() and "tokens/s" in axes[2].get_xlabel()
    legend = [t.get_text() for t in axes[0].get_legend().get_texts()]
    assert legend == list(plot.acceptance_series(fake_report()))
    assert all("engine-medusa" in name or "engine-eagle3" in name for name in legend)  # heads methods only
    speedup_lines = {line.get_label(): line for line in axes[1].get_lines()}
    assert list(speedup_lines["hf-greedy (1.0x)"].get_ydata()) == [1.0, 1.0]
    assert list(speedup_lines["medusa: --tree-nodes trees"].get_xdata()) == [8, 16, 32]
    assert list(speedup_lines["medusa: own tree"].get_xdata()) == [5]  # the tuned tree, apart
    assert "eagle3: tune sweep (× engine-plain)" in speedup_lines


def test_acceptance_drops_the_trailing_zeros_of_lookup_chains():
    report = fake_report(heads=("medusa",), tree_nodes=False, tuning=False)
    report["methods"][3]["overall"]["acceptance_by_depth"] = [0.6, 0.3, 0.1, 0.0, 0.0, 0.0, 0.0]
    report["methods"][2]["overall"]["acceptance_by_depth"] = [0.0, 0.0]
    assert plot.acceptance_series(report) == {"engine-medusa[tuned,5]": [0.0],
                                              "engine-medusa+lookup[tuned,5]": [0.6, 0.3, 0.1, 0.0]}


def test_bars_come_from_the_per_prompt_records():
    report = fake_report(heads=(), tuning=False)
    greedy = method("hf-greedy", "hf-greedy", 999.0, 1.0, [10.0, 20.0, 15.0])
    greedy["prompts"].append(dict(greedy["prompts"][0], seconds=0.0))  # no time measured: left out
    report["methods"][0] = greedy
    bar = plot.throughput_bars(report)[0]
    assert (bar.name, bar.num_prompts) == ("hf-greedy", 3)
    assert bar.mean == pytest.approx(15.0)  # the per-prompt mean, not overall tokens_per_s (999)
    assert bar.std == pytest.approx(5.0)  # sample std of 10, 20, 15
    drawn = plot.build_figure(report).axes[-1]
    assert drawn.patches[0].get_width() == pytest.approx(15.0)
    bars, = [c for c in drawn.containers if type(c).__name__ == "BarContainer"]
    first_error_bar = bars.errorbar.lines[2][0].get_segments()[0]  # [[x_low, row], [x_high, row]]
    assert first_error_bar[:, 0] == pytest.approx([10.0, 20.0])


def test_one_prompt_or_no_prompt_records_means_no_error_bar():
    report = fake_report(heads=(), tuning=False, num_prompts=1)
    del report["methods"][1]["prompts"]  # a report without per-prompt records: its overall tokens/s
    bars = plot.throughput_bars(report)
    assert [b.std for b in bars[:2]] == [0.0, 0.0]
    assert bars[1].mean == report["methods"][1]["overall"]["tokens_per_s"]
    assert "1 prompt: no error bars" in plot.build_figure(report).axes[-1].get_xlabel()


def test_report_without_trees_plots_the_stored_tree(tmp_path):
    report = fake_report(tree_nodes=False, tuning=False)
    series = plot.speedup_series(report)
    assert {label: [p.num_draft_nodes for p in points] for label, points in series.items()} == \
        {"medusa": [5], "eagle3": [12]}
    plot.write_plots(report, tmp_path / "p.png")
    assert read_png(tmp_path / "p.png").shape[1] > 1000


def test_report_without_heads_plots_the_bars_alone(tmp_path):
    report = fake_report(heads=(), tuning=False)
    fig = plot.build_figure(report)
    assert [ax.get_title() for ax in fig.axes] == ["Throughput per method (labels: speedup over hf-greedy)"]
    assert "no heads benched" in fig.get_suptitle()
    assert len(fig.axes[0].patches) == len(report["methods"])
    plot.write_plots(report, tmp_path / "p.png")
    assert read_png(tmp_path / "p.png").std() > 0.05


def hide_matplotlib(monkeypatch):
    for name in [name for name in sys.modules if name == "matplotlib" or name.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def test_missing_matplotlib_names_the_extra(monkeypatch, tmp_path):
    hide_matplotlib(monkeypatch)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[plot\]'"):
        plot.write_plots(fake_report(), tmp_path / "p.png")
    assert not list(tmp_path.iterdir())


def test_bench_cli_checks_matplotlib_before_loading_anything(monkeypatch, tmp_path):
    from specheads import bench_cli
    from specheads.errors import UserError

    hide_matplotlib(monkeypatch)
    parser = argparse.ArgumentParser()
    bench_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--target", str(tmp_path / "missing"), "--plot", str(tmp_path / "p.png")])
    with pytest.raises(UserError, match=r"--plot: .*pip install -e '\.\[plot\]'"):
        bench_cli.run(args)
