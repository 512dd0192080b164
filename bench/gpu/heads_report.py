"""The broad-heads run's report (bench/gpu/heads.py): what it reads out of each command's output,
the goals, and the markdown.

The run's commands are the project's own (`specheads data prompts`, `data regenerate`, `data
report`, `train`, `python -m specheads.bench.tools.learning_curve`); their figures are read from the
lines they print, by the parsers here, so the report holds what those commands said (a line
that changes shape fails tests/bench/test_gpu_heads.py, not the device run). `render` turns the
run's state (phases, their results, the goals) into OUT/gpu_heads.md.
"""

from __future__ import annotations

import re

# The must-reach figures: (key, what, target, today).
GOALS = (("heldout_top1_d1", "held-out top-1 at depth 1 (the training run's own split)", 0.7, "0.603"),
         ("mt_bench_top1_d1", "MT-bench replies, top-1 at depth 1 (learning_curve, all 80 first turns)", 0.6,
          "0.45"),
         ("mt_bench_tau", "MT-bench tau on at most 16 nodes (`specheads bench` on the returned heads)", 3.0, "2.05"))

SELF_INSTRUCT_LINE = re.compile(r"self-instruct: (\d+) of (\d+) generated prompts kept \((\d+) wanted\), (\d+) from "
                                r"templates; rejected: (.*)")
CONTEXT_LINE = re.compile(r"context: (\d+) source texts usable; refused: (.*)")
METER = re.compile(r"(\d+) tok/s, (\d+) tokens")
REGENERATE_LINE = re.compile(r"(\d+)/(\d+) records done, (\d+) written, (\d+) assistant turns generated")
DATA_REPORT_LINE = re.compile(r"conversations (\d+), replies (\d+), reply tokens (\d+), distinct first prompts (\d+)")
EVAL_LINE = re.compile(r"eval step (\d+)/(\d+) \| top1 ([\d. ]+) \| chain tau est ([\d.]+)")
STEP_LINE = re.compile(r"^step (\d+)/(\d+) loss ([\d.]+).*? \| top1 ([\d. ]+)(?:.*? \| (\d+) loss tok/s)?")
TRAIN_DATA_LINE = re.compile(r"specheads train: train data .*?: (\d+)/(\d+) records used, (\d+) tokens in (\d+) blocks")
FINAL_LINE = re.compile(r"held-out top-1 per head ([\d. ]+); tree of (\d+) nodes, expected accepted draft tokens per "
                        r"step ([\d.]+)")


def screen_text(raw: str) -> str:
    """A command's output as a terminal would leave it: of each line rewritten with carriage
    returns (progress bars), the last state only."""
    return "\n".join(line.rsplit("\r", 1)[-1] for line in raw.split("\n"))


def counts(text: str) -> dict[str, int]:
    """'too short 31, not English 4' (or 'none') -> {'too short': 31, 'not English': 4}."""
    found = {}
    for item in text.split(", "):
        reason, _, number = item.strip().rpartition(" ")
        if reason and number.isdigit():
            found[reason] = int(number)
    return found


def self_instruct_figures(text: str) -> dict:
    """`data prompts --self-instruct`'s summary line -> kept, candidates, wanted, template fills, rejected."""
    found = SELF_INSTRUCT_LINE.findall(text)
    if not found:
        raise ValueError("no 'self-instruct: K of N generated prompts kept' line in the output")
    kept, candidates, wanted, fills, rejected = found[-1]
    return {"kept": int(kept), "candidates": int(candidates), "wanted": int(wanted), "template_fills": int(fills),
            "rejected": counts(rejected)}


def context_figures(text: str) -> dict:
    found = CONTEXT_LINE.findall(text)
    if not found:
        raise ValueError("no 'context: N source texts usable' line in the output")
    usable, refused = found[-1]
    return {"usable_texts": int(usable), "refused": counts(refused)}


def regenerate_figures(text: str) -> dict:
    """regenerate's last meter state (tok/s counted from after the model loads) and its summary."""
    figures = {}
    meter = METER.findall(text)
    if meter:
        figures.update(meter_tok_s=int(meter[-1][0]), meter_tokens=int(meter[-1][1]))
    summary = REGENERATE_LINE.findall(text)
    if summary:
        done, total, written, turns = map(int, summary[-1])
        figures.update(records_done=done, records=total, written=written, turns=turns)
    return figures


def data_report_figures(text: str) -> dict:
    found = DATA_REPORT_LINE.findall(text)
    if not found:
        raise ValueError("no 'conversations N, replies N, reply tokens N' line in the output")
    conversations, replies, tokens, distinct = map(int, found[-1])
    return {"conversations": conversations, "replies": replies, "reply_tokens": tokens,
            "distinct_first_prompts": distinct}


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split()]


def train_figures(text: str) -> dict:
    """A training run's log -> its data, the held-out top-1 by depth at every eval, the last
    logged step (loss, training top-1, loss tok/s) and the final calibration."""
    figures: dict = {"evals": [{"step": int(step), "top1": _floats(top1), "chain_tau": float(tau)}
                               for step, _, top1, tau in EVAL_LINE.findall(text)]}
    data = TRAIN_DATA_LINE.findall(text)
    if data:
        used, records, tokens, blocks = map(int, data[-1])
        figures["data"] = {"records_used": used, "records": records, "tokens": tokens, "blocks": blocks}
    steps = [STEP_LINE.match(line) for line in text.splitlines()]
    steps = [m for m in steps if m]
    if steps:
        step, total, loss, top1, rate = steps[-1].groups()
        figures["last_step"] = {"step": int(step), "steps": int(total), "loss": float(loss), "top1": _floats(top1),
                                "loss_tok_s": int(rate) if rate else None}
    final = FINAL_LINE.findall(text)
    if final:
        top1, nodes, accepted = final[-1]
        figures["final"] = {"top1": _floats(top1), "tree_nodes": int(nodes), "expected_accepted": float(accepted)}
    return figures


def _raw_tables(text: str) -> list[list[list[str]]]:
    """The markdown tables in `text`: each a list of rows of cells, its header and rule included."""
    tables, rows = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows:
            tables.append(rows)
            rows = []
    return tables


def markdown_tables(text: str) -> list[list[dict]]:
    """Every markdown table in `text`, as a list of rows keyed by the header's cells."""
    return [[dict(zip(table[0], row)) for row in table[1:] if not all(set(c) <= set("-:") for c in row)]
            for table in _raw_tables(text)]


def tables_text(text: str) -> str:
    """The markdown tables of `text`, a blank line between them."""
    return "\n\n".join("\n".join("| " + " | ".join(row) + " |" for row in table)
                       for table in _raw_tables(text))


def number(text: str | None) -> float | None:
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return None


def goal_rows(state: dict) -> list[dict]:
    """Each goal per arm: the figure, its target, met (True/False/None where not measured)."""
    train = state["phases"].get("train", {}).get("result", {})
    points = state["phases"].get("score", {}).get("result", {}).get("mt_bench", {}).get("points", {})
    rows = []
    for arm in state["meta"]["arms"]:
        figures = {"heldout_top1_d1": (train.get(arm, {}).get("heads_top1") or [None])[0],
                   "mt_bench_top1_d1": number(points.get(arm, {}).get("fixed-set top-1 depth 1")),
                   "mt_bench_tau": None}
        for key, what, target, today in GOALS:
            value = figures[key]
            rows.append({"goal": key, "what": what, "arm": arm, "value": value, "target": target, "today": today,
                         "met": None if value is None else value >= target})
    return rows


def cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, list):
        return " / ".join(cell(v) for v in value)
    return f"{value:,}" if isinstance(value, int) else str(value)


def _whole(seconds: float | None) -> str | None:
    return None if seconds is None else f"{seconds:.0f}"


def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]


def render(state: dict) -> str:
    """OUT/gpu_heads.md: goals, phases, data, prompts, generation, training, scores, heads."""
    meta, phases = state["meta"], state["phases"]
    lines = [f"# Broad-data EAGLE-3 heads: {meta['target']} on {meta.get('device_name', meta['device'])}", "",
             f"`{meta['command']}`", "", f"Arms: {', '.join(meta['arms'])}; sizes {meta['sizes']}; "
             f"calls so far: {len(meta.get('calls', []))}.", "", "## Goals", ""]
    lines += _table(["goal", "arm", "figure", "target", "today", "met"],
                    [[g["what"], g["arm"], g["value"], g["target"], g["today"],
                      "-" if g["met"] is None else ("yes" if g["met"] else "no")] for g in goal_rows(state)])
    lines += ["", "## Phases", ""]
    lines += _table(["phase", "status", "seconds", "s to its deadline", "note"],
                    [[name, p.get("status", "not run"), _whole(p.get("seconds")), _whole(p.get("budget_s")),
                      p.get("error") or p.get("note") or ""]
                     for name, p in ((name, phases.get(name, {})) for name in meta["phases"])])
    lines += _data_section(phases) + _training_section(state) + _score_section(phases)
    heads = phases.get("heads", {}).get("result")
    if heads:
        lines += ["", "## Heads returned", "", f"Arm **{heads['arm']}** ({heads['why']}): "
                  f"`{' '.join(heads['files'])}`, joined: sha256 {heads['sha256']} ({heads['bytes']:,} bytes). "
                  f"llama.cpp export: {heads['export']}."]
    return "\n".join(lines) + "\n"


def _data_section(phases: dict) -> list[str]:
    lines = ["", "## Prompts and replies", ""]
    broad = phases.get("broad_prompts", {}).get("result")
    if broad:
        lines += _table(["self-instruct round", "seed", "asked", "candidates", "kept", "rejected by reason"],
                        [[r["round"], str(r["seed"]), r["num"], r["candidates"], r["kept"],
                          ", ".join(f"{k} {v}" for k, v in r["rejected"].items()) or "none"]
                         for r in broad["rounds"]])
        lines += ["", f"Self-instruct prompts kept: {broad['kept']} of {broad['wanted']} wanted "
                  f"({broad['template_fills_used']} template prompts filled in). Later rounds count the earlier "
                  "rounds' prompts as evaluation prompts, so none repeats.", ""]
    context = phases.get("context_prompts", {}).get("result")
    if context:
        lines += [f"Context tasks: {context['written']} from {context['usable_texts']} usable source texts; refused: "
                  + (", ".join(f"{k} {v}" for k, v in context["refused"].items()) or "none") + ".", ""]
    rows = [[name, r.get("records_done"), r.get("records"), r.get("meter_tokens"), r.get("meter_tok_s"),
             r.get("wall_tok_s"), r.get("seconds"), "yes" if r.get("partial") else ""]
            for name in ("replies", "context_replies") if (r := phases.get(name, {}).get("result"))]
    if rows:
        lines += _table(["regenerate", "records done", "of", "reply tokens", "tok/s (meter)", "tok/s (wall)",
                         "seconds", "stopped at its deadline"], rows) + [""]
    cut = phases.get("cut", {}).get("result")
    if cut:
        lines += _table(["arm", "conversations", "replies", "reply tokens", "distinct first prompts", "kinds",
                         "reply tokens made"],
                        [[arm, a.get("conversations"), a.get("replies"), a.get("reply_tokens"),
                          a.get("distinct_first_prompts"), ", ".join(f"{k} {v}" for k, v in a["kinds"].items()),
                          a.get("made", {}).get("reply_tokens")] for arm, a in cut["arms"].items()])
    return lines


def _training_section(state: dict) -> list[str]:
    train = state["phases"].get("train", {}).get("result")
    if not train:
        return []
    plan = state["plan"]
    lines = ["", "## Training (held-out top-1 by depth)", ""]
    if "train_left_s" in plan:
        lines += [f"{plan['steps']} steps for each arm, sized when training started: {plan['train_left_s']} s to its "
                  f"deadline, less {plan['assumed_fixed_s']} s of start-up and calibration, at an assumed "
                  f"{plan['assumed_step_s']} s a step ({plan.get('arms_side_by_side', 2)} arm(s) side by side).", ""]
    for arm, r in train.items():
        if not isinstance(r, dict) or "evals" not in r:
            continue
        last = r.get("last_step") or {}
        data = r.get("data") or {}
        lines += [f"**{arm}**: {r.get('steps')} steps, exit {r.get('returncode')}, {r.get('seconds')} s, "
                  f"{last.get('loss_tok_s') or '-'} loss tok/s at the end, training top-1 {cell(last.get('top1'))}; "
                  f"{data.get('tokens', '-')} training tokens in {data.get('blocks', '-')} blocks"
                  + (f"; stopped at step {r['stopped_at']} and finished there" if r.get("stopped_at") else "") + ".",
                  ""]
        rows = [[e["step"], e["top1"], e["chain_tau"]] for e in r["evals"]]
        if r.get("heads_top1"):
            rows.append(["final (calibration)", r["heads_top1"], f"{r.get('tree_nodes')}-node tree: "
                         f"{cell(r.get('expected_accepted'))} drafts accepted a step"])
        lines += _table(["step", "top-1 by depth", "chain tau (estimate)"], rows) + [""]
    return lines


def _score_section(phases: dict) -> list[str]:
    score = phases.get("score", {}).get("result")
    if not score:
        return []
    lines = ["", "## Scores (python -m specheads.bench.tools.learning_curve)", ""]
    for name, title in (("mt_bench", "MT-bench first turns"), ("templates", "unseen template prompts")):
        if name in score:
            lines += [f"### {title}", "", f"`{score[name]['command']}`", "", score[name]["tables"], ""]
    return lines
