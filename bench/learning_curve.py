"""A learning curve: how the heads' acceptance grows with training data, so a user can judge
how much data their own model needs.

    python -m specheads.bench.learning_curve --point 100000=runs/lc-100k/heads:runs/lc-100k/bench.json \
        --point 300000=runs/lc-300k/heads:runs/lc-300k/bench.json ... [--depths 3] [--out curve.png]

Each point is one training run: TOKENS (the reply tokens it trained on, the x axis), its heads
directory and, optionally, a `specheads bench --json` report of those heads. From the heads
directory: held-out top-1 accuracy per draft depth (the calibration training writes,
`calibration.accuracy[depth][0]`: the share of held-out positions where the head's first
candidate is the target's own next token, given the target's own previous tokens). From the
bench report: tau on its prompts (serving/decode/stats.alpha_tau, as the bench computes it)
of the first engine-heads method at the heads directory's own tree. Prints a markdown table
and, with --out, draws both against TOKENS on a log axis with matplotlib (bench/plot.py's
object API, written atomically).
"""

from __future__ import annotations

import argparse
import io
import json
from dataclasses import dataclass
from pathlib import Path

from specheads.bench.plot import OWN_TREE_SOURCES, require_matplotlib


@dataclass(frozen=True)
class CurvePoint:
    num_tokens: int  # reply tokens the heads trained on
    top1: list[float]  # held-out top-1 per draft depth (depth 1 first)
    tau: float | None  # on the bench report's prompts; None without a report
    label: str  # the heads directory


def parse_point(spec: str) -> tuple[int, str, str | None]:
    """'TOKENS=HEADS_DIR[:BENCH_JSON]' -> (tokens, heads dir, bench json or None)."""
    tokens, sep, rest = spec.partition("=")
    if not sep or not rest or not tokens.strip().isdigit() or int(tokens) < 1:
        raise ValueError(f"a learning-curve point must look like TOKENS=HEADS_DIR[:BENCH_JSON] with TOKENS a "
                         f"positive integer, got {spec!r}")
    heads_dir, _, bench = rest.partition(":")
    return int(tokens), heads_dir, bench or None


def bench_tau(report: dict, source: str) -> float:
    """tau of the report's first engine-heads method at its heads directory's own tree."""
    for method in report.get("methods", []):
        tree = method.get("tree") or {}
        if method.get("kind") == "engine-heads" and tree.get("source") in OWN_TREE_SOURCES:
            tau = method["overall"].get("tau")
            if tau is None:
                break
            return float(tau)
    raise ValueError(f"{source}: no engine-heads method at the heads directory's own tree with a tau; expected a "
                     "`specheads bench --heads DIR --json OUT` report")


def load_point(num_tokens: int, heads_dir: str, bench_json: str | None) -> CurvePoint:
    from specheads.heads.heads_dir import read_heads_config

    config = read_heads_config(heads_dir)
    accuracy = (config.calibration or {}).get("accuracy")
    if not accuracy:
        raise ValueError(f"{heads_dir}: the heads config has no calibration accuracy; train with a recipe that "
                         "calibrates (calibrate: ...) so held-out top-1 is measured")
    tau = None
    if bench_json is not None:
        tau = bench_tau(json.loads(Path(bench_json).read_text()), bench_json)
    return CurvePoint(num_tokens, [float(depth[0]) for depth in accuracy], tau, heads_dir)


def format_table(points: list[CurvePoint], depths: int) -> str:
    header = "| reply tokens | " + " | ".join(f"top-1 depth {d}" for d in range(1, depths + 1)) + " | tau |"
    lines = [header, "|" + "---:|" * (depths + 2)]
    for p in points:
        top1 = [f"{p.top1[d]:.3f}" if d < len(p.top1) else "-" for d in range(depths)]
        lines.append(f"| {p.num_tokens:,} | " + " | ".join(top1) + f" | {'-' if p.tau is None else f'{p.tau:.2f}'} |")
    return "\n".join(lines)


def render(points: list[CurvePoint], depths: int) -> bytes:
    """PNG: held-out top-1 per depth (left) and tau (right) against reply tokens."""
    Figure, FigureCanvasAgg = require_matplotlib()
    fig = Figure(figsize=(11, 4.2), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    x = [p.num_tokens for p in points]
    for depth in range(depths):
        ys = [(p.num_tokens, p.top1[depth]) for p in points if depth < len(p.top1)]
        left.plot([t for t, _ in ys], [a for _, a in ys], marker="o", label=f"depth {depth + 1}")
    left.set(xscale="log", ylim=(0, 1), xlabel="training reply tokens", ylabel="held-out top-1",
             title="Held-out top-1 by draft depth")
    left.legend()
    taus = [(p.num_tokens, p.tau) for p in points if p.tau is not None]
    if taus:
        right.plot([t for t, _ in taus], [v for _, v in taus], marker="o", color="#d62728")
    right.set(xscale="log", xlabel="training reply tokens", ylabel="tau (tokens per verify step)",
              title="tau on the bench prompts" if taus else "tau (no bench report given)")
    for axis in (left, right):
        axis.set_xticks(x, [f"{t / 1000:g}k" for t in x])
        axis.grid(alpha=0.3)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--point", action="append", required=True, metavar="TOKENS=HEADS_DIR[:BENCH_JSON]",
                   help="one training run: its reply tokens, heads directory and optional bench report")
    p.add_argument("--depths", type=int, default=3, help="draft depths to show (default 3)")
    p.add_argument("--out", help="write the PNG here")
    args = p.parse_args(argv)
    if args.depths < 1:
        p.error(f"--depths must be >= 1, got {args.depths}")
    try:
        points = sorted((load_point(*parse_point(spec)) for spec in args.point), key=lambda q: q.num_tokens)
    except (ValueError, FileNotFoundError) as err:
        p.error(str(err))
    print(format_table(points, args.depths))
    if args.out:
        from specheads.heads import atomic

        atomic.write_bytes(args.out, render(points, args.depths))
        print(f"learning curve: wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
