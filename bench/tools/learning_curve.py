"""A learning curve: how the heads' acceptance grows with training data, so a user can judge
how much data their own model needs.

    python -m specheads.bench.tools.learning_curve --point 100000=runs/lc-100k/heads:runs/lc-100k/bench.json \
        --point 300000=runs/lc-300k/heads:runs/lc-300k/bench.json ... [--depths 3] [--output curve.png] \
        [--series NAME --point ...] [--eval-prompts FILE --target T [--limit N] [--max-new-tokens N] [--by-category]
        [--device auto|cpu|cuda] [--batch-size N]]

Each point is one training run: TOKENS (the reply tokens it trained on, the x axis), its heads
directory and, optionally, a `specheads bench --output-json` report of those heads. From the heads
directory: held-out top-1 accuracy per draft depth (the calibration training writes,
`calibration.accuracy[depth][0]`: the share of held-out positions where the head's first
candidate is the target's own next token, given the target's own previous tokens). From the
bench report: tau on its prompts (serving/decode/stats.alpha_tau, as the bench computes it)
of the first engine-heads method at the heads directory's own tree. Prints a markdown table
and, with --output, draws both against TOKENS on a log axis with matplotlib (bench/plot.py's
object API, written atomically).

Each run's held-out split is its own (a share of its own data), so points trained on
different data are scored on different texts. `--eval-prompts` scores every point on one
fixed set as well: the target's own greedy replies to those prompts (Spec-Bench format, with
the chat template; MT-bench's first turns measure what serving sees), generated once
(--batch-size of them decoding together; on a GPU, decoding one at a time costs minutes), and
each heads directory's top-1 per depth on them, by the same rule as the held-out figure (the
head's first candidate at position t and depth d against the target's argmax at t + d, given
the target's own previous tokens), over every reply position from the one after the prompt.
`--series NAME` names the points after it (say, the epochs they trained): one line per series.
`--by-category` adds a table of depth-1 top-1 per prompt category of the fixed set, overall and
at the positions where the target is sure of its token (top probability >= SURE): where the
heads miss although the target is sure, the text is not to blame; what the heads learnt is.
Its last rows slice all positions by prompt length, by position in the reply and by whether
the wanted token is in the prompt, so that a length or position effect shows apart from the
kind of text.
"""

from __future__ import annotations

import argparse
import bisect
import io
import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from specheads.bench.plot import OWN_TREE_SOURCES, require_matplotlib
from specheads.runner import DEVICE_HELP


SURE = 0.95  # category_top1: the target's top probability from which a position counts as one it is sure of
PROMPT_EDGES = (0, 61, 121, 251)  # category_top1's slices by prompt length in tokens: 0-60, 61-120, 121-250, 251+
REPLY_EDGES = (0, 16, 48)  # and by the position's index in the reply: 0-15, 16-47, 48+
IN_PROMPT, NOT_IN_PROMPT = "wanted token in the prompt", "wanted token not in the prompt"


@dataclass(frozen=True)
class CurvePoint:
    num_tokens: int  # reply tokens the heads trained on
    top1: list[float]  # held-out top-1 per draft depth (depth 1 first)
    tau: float | None  # on the bench report's prompts; None without a report
    label: str  # the heads directory
    series: str = ""  # --series
    fixed_top1: list[float] | None = None  # top-1 per depth on --eval-prompts' replies
    by_category: dict[str, dict] | None = None  # --by-category: category_top1 on those replies


def greedy_reply(target, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    """The target's own greedy continuation of a prompt: the engine's plain decoding."""
    return greedy_replies(target, [prompt_ids], max_new_tokens, eos_token_id)[0]


def greedy_replies(target, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None,
                   batch_size: int = 1) -> list[list[int]]:
    """The target's own greedy continuation of each prompt, up to batch_size of them decoding
    together (the engine's continuous batching: each is the reply that prompt gets alone)."""
    from specheads.serving.decode.config import SpeculativeDecoder
    from specheads.serving.decode.generate import generate_many

    results = generate_many(SpeculativeDecoder(target), prompts, max_new_tokens, eos_token_id,
                            max_batch_size=max(1, min(batch_size, len(prompts))))  # the cache holds this many rows
    return [list(result.tokens) for result in results]


def top1_hits(draft_JL: torch.Tensor, want_L: torch.Tensor, prompt_len: int) -> tuple[list[int], list[int]]:
    """(hits, counts) per depth: draft_JL[j, t] (a target id) against want_L[t + 1 + j], the
    target's argmax there, for t from prompt_len - 1 (the draft after the prompt) on."""
    length = want_L.shape[0]
    hits, counts = [], []
    for j in range(draft_JL.shape[0]):
        got, want = draft_JL[j, prompt_len - 1:length - 1 - j], want_L[prompt_len + j:]
        hits.append(int((got == want).sum()))
        counts.append(int(want.numel()))
    return hits, counts


@torch.inference_mode()
def first_candidates(heads, config, target, sequences: list[tuple], depths: int, target_outputs: dict | None = None):
    """Per (token ids, prompt length, ...) sequence: (draft_JL, the heads' first candidate at each
    depth and position as target ids; want_L, the target's argmax after each position; top_L, the
    target's probability of it). Medusa heads give at most num_heads depths.

    target_outputs: a dict shared across calls, so that the target runs once per sequence and
    tap set however many heads directories are scored on them."""
    from specheads.heads.eagle3 import next_token_embeddings

    target_outputs = {} if target_outputs is None else target_outputs
    to_target = heads.draft_to_target()  # draft id -> target id; None: the heads draft target ids
    if config.kind == "medusa":
        depths = min(depths, config.num_heads)  # an EAGLE head unrolls to any depth
    for index, (ids, *_) in enumerate(sequences):
        ids_BL = torch.tensor([ids], device=target.device)
        key = (index, tuple(config.tap_layers))
        if key not in target_outputs:
            out = target(ids_BL, list(config.tap_layers))
            top_L, want_L = out.logits[0].float().softmax(-1).max(-1)
            target_outputs[key] = (torch.cat(out.taps, dim=-1), want_L, top_L)
        taps_BLnH, want_L, top_L = target_outputs[key]
        if config.kind == "medusa":
            logits_JBLV = heads(taps_BLnH, num_heads=depths)
        else:
            logits_JBLV, _ = heads(taps_BLnH, next_token_embeddings(target.embeddings(), ids_BL), num_steps=depths)
        draft_JL = logits_JBLV[:, 0].argmax(-1)
        yield (draft_JL if to_target is None else to_target[draft_JL]), want_L, top_L


def fixed_set_top1(heads, config, target, sequences: list[tuple], depths: int,
                   target_outputs: dict | None = None) -> list[float]:
    """Top-1 per depth (module docstring) of `heads` over (token ids, prompt length) pairs."""
    hits, counts = None, None
    for (draft_JL, want_L, _), (_, prompt_len, *_) in zip(
            first_candidates(heads, config, target, sequences, depths, target_outputs), sequences):
        got, num = top1_hits(draft_JL, want_L, prompt_len)
        hits = got if hits is None else [h + g for h, g in zip(hits, got)]
        counts = num if counts is None else [c + n for c, n in zip(counts, num)]
    return [h / c if c else 0.0 for h, c in zip(hits or [], counts or [])]


def bucket(value: int, edges: tuple[int, ...]) -> str:
    """The edges' interval holding value: "lo-hi" (both included), or "lo+" past the last edge."""
    index = bisect.bisect_right(edges, value) - 1
    return f"{edges[index]}+" if index + 1 == len(edges) else f"{edges[index]}-{edges[index + 1] - 1}"


def slice_names() -> list[str]:
    """category_top1's slices, in table order."""
    prompt = [f"prompt of {bucket(edge, PROMPT_EDGES)} tokens" for edge in PROMPT_EDGES]
    return prompt + [f"reply tokens {bucket(edge, REPLY_EDGES)}" for edge in REPLY_EDGES] + [IN_PROMPT, NOT_IN_PROMPT]


def category_top1(heads, config, target, sequences: list[tuple[list[int], int, str]],
                  target_outputs: dict | None = None) -> dict[str, dict]:
    """Depth-1 top-1 per prompt category (and "all") over (token ids, prompt length, category)
    sequences, overall and at the positions where the target is sure (its top probability >= SURE):
    {name: {"positions", "top1", "sure_share", "sure_top1"}}, the categories sorted, then "all", then
    the same over slices of all positions: by the prompt's length in tokens (PROMPT_EDGES), by the
    position's index in the reply (REPLY_EDGES), and by whether the token wanted there is one of the
    prompt's (copying). Where the heads miss although the target is sure, the miss is the heads'
    (their data or capacity), not the text's entropy; the slices tell a length or position effect
    from one of the kind of text."""
    slices = slice_names()
    for _, _, category in sequences:
        if category == "all" or category in slices:
            raise ValueError(f"prompt category {category!r} is the name of one of --by-category's own rows "
                             f"(all, {', '.join(slices)}): rename it in the prompts file")
    tally: dict[str, list[int]] = {}
    for (draft_JL, want_L, top_L), (ids, prompt_len, category) in zip(
            first_candidates(heads, config, target, sequences, 1, target_outputs), sequences):
        hit_T = (draft_JL[0, prompt_len - 1:-1] == want_L[prompt_len:]).tolist()
        sure_T = (top_L[prompt_len:] >= SURE).tolist()
        prompt_tokens = set(ids[:prompt_len])
        length_slice = f"prompt of {bucket(prompt_len, PROMPT_EDGES)} tokens"
        for index, (hit, sure, want) in enumerate(zip(hit_T, sure_T, want_L[prompt_len:].tolist())):
            copy_slice = IN_PROMPT if want in prompt_tokens else NOT_IN_PROMPT
            for name in (category, "all", length_slice, f"reply tokens {bucket(index, REPLY_EDGES)}", copy_slice):
                counts = tally.setdefault(name, [0, 0, 0, 0])
                counts[0] += hit
                counts[1] += 1
                counts[2] += hit and sure
                counts[3] += sure
    order = sorted(name for name in tally if name != "all" and name not in slices) + ["all"] + slices
    rows = {}
    for name in order:
        if name in tally:
            hits, n, sure_hits, sure = tally[name]
            rows[name] = {"positions": n, "top1": hits / n, "sure_share": sure / n,
                          "sure_top1": sure_hits / sure if sure else 0.0}
    return rows


def eval_sequences(target, tokenizer, prompts_path: str, limit: int | None, max_new_tokens: int,
                   batch_size: int = 1):
    """(prompt + the target's greedy reply, prompt length, category) for each prompt of the file;
    batch_size replies decode together."""
    from specheads.bench.prompts import encode_prompts, load_prompts

    encoded = encode_prompts(tokenizer, load_prompts(prompts_path, limit=limit))
    replies = greedy_replies(target, [p.input_ids for p in encoded], max_new_tokens, tokenizer.eos_token_id,
                             batch_size)
    return [(p.input_ids + reply, len(p.input_ids), p.category) for p, reply in zip(encoded, replies)]


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
                     "`specheads bench --heads DIR --output-json OUT` report")


def load_point(num_tokens: int, heads_dir: str, bench_json: str | None, series: str = "") -> CurvePoint:
    from specheads.heads.artefacts.heads_dir import read_heads_config

    config = read_heads_config(heads_dir)
    accuracy = (config.calibration or {}).get("accuracy")
    if not accuracy:
        raise ValueError(f"{heads_dir}: the heads config has no calibration accuracy; train with a recipe that "
                         "calibrates (calibrate: ...) so held-out top-1 is measured")
    tau = None
    if bench_json is not None:
        tau = bench_tau(json.loads(Path(bench_json).read_text()), bench_json)
    return CurvePoint(num_tokens, [float(depth[0]) for depth in accuracy], tau, heads_dir, series)


def _cells(values: list[float] | None, depths: int) -> list[str]:
    return [f"{values[d]:.3f}" if values is not None and d < len(values) else "-" for d in range(depths)]


def format_table(points: list[CurvePoint], depths: int) -> str:
    series = any(p.series for p in points)
    fixed = any(p.fixed_top1 is not None for p in points)
    header = ["series"] * series + ["reply tokens"] + [f"top-1 depth {d}" for d in range(1, depths + 1)]
    header += [f"fixed-set top-1 depth {d}" for d in range(1, depths + 1)] * fixed + ["tau"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * series + "---:|" * (len(header) - series)]
    for p in points:
        row = [p.series] * series + [f"{p.num_tokens:,}"] + _cells(p.top1, depths)
        row += _cells(p.fixed_top1, depths) * fixed + ["-" if p.tau is None else f"{p.tau:.2f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def render(points: list[CurvePoint], depths: int) -> bytes:
    """PNG: held-out top-1 per depth (left) and tau (right) against reply tokens."""
    Figure, FigureCanvasAgg = require_matplotlib()
    fig = Figure(figsize=(11, 4.2), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    x = sorted({p.num_tokens for p in points})
    names = list(dict.fromkeys(p.series for p in points))
    markers = "osD^v"
    fixed = any(p.fixed_top1 is not None for p in points)
    for index, name in enumerate(names):
        group = [p for p in points if p.series == name]
        marker, prefix = markers[index % len(markers)], f"{name}, " if name else ""
        for depth in range(depths):
            colour = f"C{depth}"
            ys = [(p.num_tokens, p.top1[depth]) for p in group if depth < len(p.top1)]
            left.plot([t for t, _ in ys], [a for _, a in ys], marker=marker, color=colour,
                      label=f"{prefix}depth {depth + 1}, held out")
            ys = [(p.num_tokens, p.fixed_top1[depth]) for p in group
                  if p.fixed_top1 is not None and depth < len(p.fixed_top1)]
            if ys:
                left.plot([t for t, _ in ys], [a for _, a in ys], marker=marker, color=colour, linestyle="--",
                          label=f"{prefix}depth {depth + 1}, fixed set")
        taus = [(p.num_tokens, p.tau) for p in group if p.tau is not None]
        if taus:
            right.plot([t for t, _ in taus], [v for _, v in taus], marker=marker, color="#d62728",
                       label=name or None)
    left.set(xscale="log", ylim=(0, 1), xlabel="training reply tokens", ylabel="top-1",
             title="Top-1 by draft depth" + (" (dashed: the fixed evaluation set)" if fixed else " (held out)"))
    left.legend(fontsize="small")
    taus = [p for p in points if p.tau is not None]
    if taus and any(names):
        right.legend()
    right.set(xscale="log", xlabel="training reply tokens", ylabel="tau (tokens per verify step)",
              title="tau on the bench prompts" if taus else "tau (no bench report given)")
    for axis in (left, right):
        axis.set_xticks(x, [f"{t / 1000:g}k" for t in x])
        axis.grid(alpha=0.3)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


class _SeriesPoint(argparse.Action):
    """--series NAME and --point SPEC into one list of (series, spec or None), in order."""

    def __call__(self, parser, namespace, value, option_string=None):
        points = list(getattr(namespace, self.dest, None) or [])
        series = points[-1][0] if points else ""
        points.append((value, None) if option_string == "--series" else (series, value))
        setattr(namespace, self.dest, points)


def score_on_fixed_set(points: list[CurvePoint], args) -> list[CurvePoint]:
    """Every point's top-1 on the target's replies to --eval-prompts (generated once)."""
    from specheads.heads.artefacts.heads_dir import load_heads
    from specheads.runner import load_target_and_tokenizer, resolve_device

    target, tokenizer = load_target_and_tokenizer(args.target, heads=[p.label for p in points], dtype=args.dtype,
                                                  device=resolve_device(args.device))
    sequences = eval_sequences(target, tokenizer, args.eval_prompts, args.limit, args.max_new_tokens, args.batch_size)
    scored, target_outputs = [], {}
    for point in points:
        heads, config = load_heads(point.label, target.identity, device=target.device, dtype=target.dtype)
        top1 = fixed_set_top1(heads, config, target, sequences, args.depths, target_outputs)
        by_category = category_top1(heads, config, target, sequences, target_outputs) if args.by_category else None
        scored.append(replace(point, fixed_top1=top1, by_category=by_category))
    return scored


def format_categories(points: list[CurvePoint]) -> str:
    """Markdown: each point's category_top1, one row per category, then "all", then the slices."""
    lines = [f"| heads | category | reply positions | top-1 depth 1 | target sure (p >= {SURE:.2f}) | "
             "top-1 where sure |",
             "|---|---|---:|---:|---:|---:|"]
    for p in points:
        for name, c in p.by_category.items():
            lines.append(f"| {p.label} | {name} | {c['positions']} | {c['top1']:.3f} | {c['sure_share']:.2f} | "
                         f"{c['sure_top1']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--point", action=_SeriesPoint, dest="points", required=True,
                   metavar="TOKENS=HEADS_DIR[:BENCH_JSON]",
                   help="one training run: its reply tokens, heads directory and optional bench report")
    p.add_argument("--series", action=_SeriesPoint, dest="points", metavar="NAME",
                   help="the series of the --point flags after it (one line each in the plot)")
    p.add_argument("--depths", type=int, default=3, help="draft depths to show (default 3)")
    p.add_argument("--eval-prompts", help="also score every point on the target's greedy replies to these "
                                          "prompts (Spec-Bench jsonl, e.g. MT-bench's)")
    p.add_argument("--target", help="the target the heads draft for (needed with --eval-prompts)")
    p.add_argument("--limit", type=int, help="with --eval-prompts: its first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=96, help="with --eval-prompts: reply length (default 96)")
    p.add_argument("--dtype", default="auto", help="with --eval-prompts: the target's dtype, as `specheads bench` "
                                                   "takes it (default auto: the device's fast dtype)")
    p.add_argument("--device", default="auto", help="with --eval-prompts: " + DEVICE_HELP + " (default auto)")
    p.add_argument("--batch-size", type=int, default=1,
                   help="with --eval-prompts: replies decoded together (default 1; on a GPU, as many as the prompts)")
    p.add_argument("--by-category", action="store_true",
                   help="with --eval-prompts: also depth-1 top-1 per prompt category, overall and where the target "
                        "is sure of its token, and over slices by prompt length, reply position and copying (a second "
                        "table)")
    p.add_argument("--output", metavar="PNG", help="write the PNG here")
    args = p.parse_args(argv)
    if args.depths < 1:
        p.error(f"--depths must be >= 1, got {args.depths}")
    if args.by_category and not args.eval_prompts:
        p.error("--by-category needs --eval-prompts (the prompts whose categories are scored)")
    if args.eval_prompts and not args.target:
        p.error("--eval-prompts needs --target, the model whose replies the heads are scored on")
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    try:
        points = sorted((load_point(*parse_point(spec), series=series) for series, spec in args.points
                         if spec is not None), key=lambda q: (q.series, q.num_tokens))
        if args.eval_prompts:
            points = score_on_fixed_set(points, args)
    except (ValueError, FileNotFoundError) as err:
        p.error(str(err))
    print(format_table(points, args.depths))
    if args.by_category:
        print()
        print(format_categories(points))
    if args.output:
        from specheads.heads import atomic

        atomic.write_bytes(args.output, render(points, args.depths))
        print(f"learning curve: wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
