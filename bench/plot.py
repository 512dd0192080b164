"""PNG charts of a bench report, drawn with matplotlib (the optional `plot` extra, `pip install
-e '.[plot]'` in a clone): `specheads bench --plot OUT.png` writes one image with
three panels.

    acceptance by depth   one line per method that drafts with heads (engine-heads, dashed:
                          engine-heads+lookup): the share of verify steps that accepted a draft
                          token at depth d (harness.py's acceptance_by_depth), up to the
                          first of its trailing zeros
    speedup vs tree size  speedup over hf-greedy against draft nodes for the engine-heads
                          trees: per heads directory a line through its --tree-nodes calibrated
                          trees and a star at its own stored or tuned tree, plus each tuned
                          directory's `specheads tune` sweep (speedup over engine-plain, thin
                          dashed); dashed grey: 1.0x, dotted grey: engine-plain
    tokens/s per method   bars: mean tokens/s over prompts, error bars: ±1 sample standard
                          deviation across prompts (per prompt: new tokens / wall seconds of
                          generate, from the report's "prompts" records); labels: the report's
                          overall speedup over hf-greedy

A report without heads gives the bars alone (the title says why); a report whose heads
were benched at their own tree only (no --tree-nodes) still draws that tree's point.
matplotlib is imported only here, when drawing, and only through its object API (Figure
and the Agg canvas): no pyplot state, so a server process can call it too.
"""

from __future__ import annotations

import io
import statistics
from dataclasses import dataclass
from pathlib import Path

from specheads.bench.harness import HEADS_KINDS

INSTALL_HINT = "pip install matplotlib (in a clone of specheads: pip install -e '.[plot]')"
OWN_TREE_SOURCES = ("heads-dir-tuned", "heads-dir", "heads-dir-default")  # the heads dir's tree, not --tree-nodes
TITLE_SIZE, LABEL_SIZE, TICK_SIZE, LEGEND_SIZE = 13, 11, 10, 9
# One colour map per heads directory (shades: tree size, light to dark); fixed colours for the rest.
HEADS_CMAPS = ("Blues", "Oranges", "Greens", "Purples", "Reds")
OTHER_COLOURS = {"hf-greedy": "#4d4d4d", "engine-plain": "#a6a6a6", "engine-lookup": "#17becf",
                 "hf-prompt-lookup": "#bcbd22", "hf-assisted": "#8c564b"}


def require_matplotlib():
    """(Figure, FigureCanvasAgg); an ImportError naming the extra when matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(f"plotting a bench report needs matplotlib, an optional extra: {INSTALL_HINT}") from err
    return Figure, FigureCanvasAgg


# ---- data: what each panel draws, from the report alone (tested without drawing) ----

@dataclass(frozen=True)
class TreePoint:
    num_draft_nodes: int
    speedup: float  # over hf-greedy
    name: str  # method name
    source: str  # tree source: "calibrated" | "prior" | one of OWN_TREE_SOURCES


@dataclass(frozen=True)
class Bar:
    name: str
    kind: str
    mean: float  # tokens/s, mean over prompts
    std: float  # sample standard deviation of tokens/s across prompts; 0.0 for fewer than 2
    num_prompts: int
    speedup: float | None  # the report's overall speedup over hf-greedy
    identical: bool


def heads_label(method: dict) -> str:
    return (method.get("tree") or {}).get("heads", "heads")


def acceptance_series(report: dict) -> dict[str, list[float]]:
    """{method name: acceptance at depth 1, 2, ...} for every method that drafts with heads, cut
    after its first of the trailing zeros (lookup chains make trees deeper than heads reach)."""
    series = {}
    for m in report["methods"]:
        values = list(m["overall"].get("acceptance_by_depth") or [])
        if m["kind"] not in HEADS_KINDS or not values:
            continue
        last = max((d for d, value in enumerate(values) if value > 0), default=-1)
        series[m["name"]] = values[:last + 2]
    return series


def speedup_series(report: dict) -> dict[str, list[TreePoint]]:
    """{heads label: engine-heads trees by draft nodes}; methods without a speedup are left out."""
    series: dict[str, list[TreePoint]] = {}
    for m in report["methods"]:
        if m["kind"] == "engine-heads" and m["overall"].get("speedup") is not None:
            series.setdefault(heads_label(m), []).append(
                TreePoint(m["tree"]["num_draft_nodes"], m["overall"]["speedup"], m["name"], m["tree"]["source"]))
    return {label: sorted(points, key=lambda p: p.num_draft_nodes) for label, points in series.items()}


def tuning_series(report: dict) -> dict[str, list[tuple[int, float]]]:
    """{tuned heads label: [(draft nodes, best measured speedup over engine-plain), ...]}."""
    series = {}
    for label, tuning in (report.get("tuning") or {}).items():
        best: dict[int, float] = {}
        for row in (tuning or {}).get("settings", []):
            if row.get("speedup_vs_plain") is not None:
                best[row["num_nodes"]] = max(best.get(row["num_nodes"], 0.0), row["speedup_vs_plain"])
        if best:
            series[label] = sorted(best.items())
    return series


def prompt_tokens_per_s(method: dict) -> list[float]:
    """tokens/s of each prompt: new tokens / wall seconds of generate (prefill included)."""
    return [p["num_tokens"] / p["seconds"] for p in method.get("prompts") or [] if p["seconds"] > 0]


def throughput_bars(report: dict) -> list[Bar]:
    """One bar per method, in report order, from the per-prompt records."""
    bars = []
    for m in report["methods"]:
        values = prompt_tokens_per_s(m) or [m["overall"]["tokens_per_s"]]
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        bars.append(Bar(m["name"], m["kind"], statistics.fmean(values), std, len(values),
                        m["overall"].get("speedup"), m["overall"].get("identical", True)))
    return bars


def label_colours(report: dict) -> dict[str, tuple]:
    """{heads label: colour map}, in first-seen order (bench methods, then tune sweeps)."""
    from matplotlib import colormaps

    labels = [heads_label(m) for m in report["methods"] if m["kind"] in HEADS_KINDS]
    labels = list(dict.fromkeys(labels + list(report.get("tuning") or {})))
    return {label: colormaps[HEADS_CMAPS[i % len(HEADS_CMAPS)]] for i, label in enumerate(labels)}


def method_colours(report: dict, cmaps: dict) -> dict[str, tuple]:
    """A colour per method: heads methods in their directory's map, darker for bigger trees."""
    colours = {m["name"]: OTHER_COLOURS.get(m["kind"], "#7f7f7f") for m in report["methods"]}
    for label, cmap in cmaps.items():
        group = sorted((m for m in report["methods"] if m["kind"] in HEADS_KINDS and heads_label(m) == label),
                       key=lambda m: (m["tree"]["num_draft_nodes"], m["kind"]))
        for j, m in enumerate(group):
            colours[m["name"]] = cmap(0.45 + 0.5 * j / max(len(group) - 1, 1))
    return colours


# ---- drawing ----

def _style(ax, title: str, x_label: str, y_label: str) -> None:
    ax.set_title(title, fontsize=TITLE_SIZE, fontweight="bold")
    ax.set_xlabel(x_label, fontsize=LABEL_SIZE)
    ax.set_ylabel(y_label, fontsize=LABEL_SIZE)
    ax.tick_params(labelsize=TICK_SIZE)
    ax.grid(alpha=0.3)
    ax.set_axisbelow(True)


def _empty(ax, title: str, message: str) -> None:
    ax.set_title(title, fontsize=TITLE_SIZE, fontweight="bold")
    ax.text(0.5, 0.5, message, ha="center", va="center", fontsize=LABEL_SIZE, color="0.4", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def draw_acceptance(ax, report: dict, colours: dict) -> None:
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    title = "Acceptance by draft depth"
    series = acceptance_series(report)
    if not series:
        _empty(ax, title, "no heads benched\n(specheads bench --heads DIR)")
        return
    kinds = {m["name"]: m["kind"] for m in report["methods"]}
    for name, values in series.items():
        ax.plot(range(1, len(values) + 1), values, marker="o", lw=2, ms=6, color=colours[name], label=name,
                ls="--" if kinds[name] == "engine-heads+lookup" else "-")
    _style(ax, title, "draft depth d (tokens past the verified one)", "verify steps accepting depth d")
    peak = max(value for values in series.values() for value in values)
    ax.set_ylim(0, min(1.02, max(0.1, 1.15 * peak)))
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=LEGEND_SIZE, loc="best", framealpha=0.9)


def draw_speedup(ax, report: dict, cmaps: dict) -> None:
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    title = "Speedup vs tree size"
    series, tuning = speedup_series(report), tuning_series(report)
    if not series and not tuning:
        _empty(ax, title, "no draft trees benched\n(specheads bench --heads DIR --tree-nodes 8,16,32)")
        return
    ax.axhline(1.0, color="0.35", ls="--", lw=1.2, label="hf-greedy (1.0x)")
    plain = next((m["overall"].get("speedup") for m in report["methods"] if m["kind"] == "engine-plain"), None)
    if plain is not None:
        ax.axhline(plain, color="0.6", ls=":", lw=1.5, label=f"engine-plain ({plain:.2f}x)")
    for label, points in series.items():
        colour = cmaps[label](0.8)
        sweep = [p for p in points if p.source not in OWN_TREE_SOURCES]
        if sweep:
            ax.plot([p.num_draft_nodes for p in sweep], [p.speedup for p in sweep], marker="o", lw=2, ms=7,
                    color=colour, label=f"{label}: --tree-nodes trees")
        for p in (p for p in points if p.source in OWN_TREE_SOURCES):
            ax.plot(p.num_draft_nodes, p.speedup, marker="*", ms=17, color=colour, mec="black", mew=0.8, ls="none",
                    zorder=3, label=f"{label}: own tree")  # one per heads directory
    for label, points in tuning.items():
        ax.plot(*zip(*points), marker="x", lw=1.2, ms=6, ls="--", alpha=0.75, color=cmaps[label](0.6),
                label=f"{label}: tune sweep (× engine-plain)")
    benched = {p.num_draft_nodes for points in series.values() for p in points}
    swept = {n for points in tuning.values() for n, _ in points}
    low, high = min(benched | swept), max(benched | swept)
    ticks = benched or swept
    if high >= 8 * low:  # wide range: doubling steps read evenly on a log axis
        ax.set_xscale("log", base=2)
        ax.xaxis.set_minor_locator(NullLocator())
        ticks |= {2 ** k for k in range(high.bit_length()) if low <= 2 ** k <= high}
    ax.xaxis.set_major_locator(FixedLocator(sorted(ticks)))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    _style(ax, title, "tree size (draft nodes)", "speedup (× hf-greedy tokens/s)")
    top = max([1.0, plain or 0.0] + [p.speedup for points in series.values() for p in points]
              + [y for points in tuning.values() for _, y in points])
    ax.set_ylim(0, 1.12 * top)
    ax.legend(fontsize=LEGEND_SIZE, loc="best", framealpha=0.9)


def draw_throughput(ax, report: dict, colours: dict) -> None:
    bars = throughput_bars(report)
    rows = range(len(bars))
    errors = [b.std for b in bars] if any(b.std for b in bars) else None  # None: no zero-width caps
    ax.barh(rows, [b.mean for b in bars], xerr=errors, height=0.7,
            color=[colours[b.name] for b in bars], error_kw={"ecolor": "0.15", "capsize": 3, "elinewidth": 1.2})
    ax.set_yticks(rows, [b.name for b in bars])
    ax.invert_yaxis()  # report order, top to bottom
    reach = max(b.mean + b.std for b in bars)
    boxed = {"facecolor": "white", "edgecolor": "none", "pad": 1.0}  # readable over the hf-greedy line
    for row, b in zip(rows, bars):
        text = "-" if b.speedup is None else f"{b.speedup:.2f}x"
        ax.text(b.mean + b.std + 0.015 * reach, row, text, va="center", fontsize=TICK_SIZE, bbox=boxed)
        if not b.identical:
            ax.text(b.mean + b.std + 0.1 * reach, row, "output differs from hf-greedy", va="center",
                    fontsize=TICK_SIZE, color="#d62728", bbox=boxed)
    greedy = next((b for b in bars if b.kind == "hf-greedy"), None)
    if greedy is not None:
        ax.axvline(greedy.mean, color="0.35", ls="--", lw=1)
    num_prompts = max(b.num_prompts for b in bars)
    spread = (f"mean over {num_prompts} prompts; error bars: ±1 std across prompts" if num_prompts > 1
              else "1 prompt: no error bars")
    _style(ax, "Throughput per method (labels: speedup over hf-greedy)", f"tokens/s ({spread})", "")
    ax.grid(axis="y", visible=False)
    ax.set_xlim(0, reach * (1.35 if any(not b.identical for b in bars) else 1.12))


def _suptitle(report: dict) -> str:
    config = report.get("config") or {}
    where = ", ".join(str(config[k]) for k in ("device", "dtype") if config.get(k))
    num_prompts = config.get("num_prompts", "?")
    return (f"specheads bench: {config.get('target', '?')}, {num_prompts} prompt{'' if num_prompts == 1 else 's'}"
            f" × {config.get('max_new_tokens', '?')} new tokens, greedy" + (f" ({where})" if where else ""))


def build_figure(report: dict):
    """The panels on one matplotlib Figure (with an Agg canvas attached): acceptance and
    speedup side by side above the tokens/s bars; the bars alone when no heads were benched."""
    Figure, FigureCanvasAgg = require_matplotlib()
    bars_height = max(2.5, 0.36 * len(report["methods"]) + 1.0)  # inches: one row per method
    with_heads = bool(acceptance_series(report) or speedup_series(report) or tuning_series(report))
    top_height = 5.5 if with_heads else 0.0
    fig = Figure(figsize=(14, top_height + bars_height + 0.4), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    cmaps = label_colours(report)
    colours = method_colours(report, cmaps)
    title = _suptitle(report)
    if with_heads:
        grid = fig.add_gridspec(2, 2, height_ratios=[top_height, bars_height])
        draw_acceptance(fig.add_subplot(grid[0, 0]), report, colours)
        draw_speedup(fig.add_subplot(grid[0, 1]), report, cmaps)
        draw_throughput(fig.add_subplot(grid[1, :]), report, colours)
    else:
        draw_throughput(fig.add_subplot(), report, colours)
        title += "\nno heads benched: acceptance and tree-size charts need specheads bench --heads DIR"
    fig.suptitle(title, fontsize=TITLE_SIZE + 1)
    return fig


def render(report: dict) -> bytes:
    """The PNG bytes of build_figure(report)."""
    buffer = io.BytesIO()
    build_figure(report).savefig(buffer, format="png", facecolor="white")
    return buffer.getvalue()


def write_plots(report: dict, path: str | Path) -> Path:
    """Write the PNG atomically (temp file + rename): `path` is either old or whole."""
    from specheads.heads import atomic

    atomic.write_bytes(path, render(report))
    return Path(path)
