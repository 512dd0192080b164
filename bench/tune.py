"""`specheads tune`: pick the draft tree that decodes fastest on this hardware.

Tree size trades acceptance against verify cost, and the balance depends on the machine:
on 2 CPU cores a verify step over 17 nodes costs about two plain steps, on a GPU it costs
about one. So the tree is chosen by measurement, not by the calibrated acceptance alone.

Settings swept:
- static trees from the heads' calibrated accuracy[depth][rank] (a prior guess without
  calibration): every depth limit d in 1..D as a chain (top-1 only), and best-first
  expansions (heads.tree_paths.expand_paths) of each node budget under each depth limit;
  duplicates removed. When there are more than `max_settings`, the ones with the best
  estimated speed are kept (dynamic settings come on top): (1 + expected accepted tokens) /
  (the step's cost in decode steps). The cost is this machine's, measured first
  (bench/step_costs.py: a verify of the tree's nodes plus drafting its depth, in the dtype
  and layout the engine runs); without measured costs, a prior: 1 + NODE_COST * nodes +
  DEPTH_COST * depth for EAGLE's sequential drafting.
- dynamic EAGLE-2 trees (EAGLE heads only): serving/decode/trees.py's
  DynamicTreeConfig(depth, top_k, num_nodes) over a small grid.
- AdaEDL twins (on top, like the dynamic trees): the deepest dynamic trees (EAGLE) or the
  two best-estimated static trees (Medusa) again, with drafting stopped where AdaEDL's
  acceptance bound falls below ADAEDL_THRESHOLD (serving/decode/sampling.acceptance_bound).
  A deep tree whose later levels are rarely accepted then costs less on easy-to-guess steps.

Measurement: real greedy decoding of the prompts with every setting, interleaved
(prompt-major: every setting on prompt 1, then on prompt 2, ...) so load from other
processes hits all settings alike, until the time budget is spent (at least one prompt).
Per setting: tokens/s, tau, alpha and the cost of one step (draft + verify + accept) in
plain-step units (plain decoding without heads runs as the reference). The winner is the
fastest setting whose outputs keep plain decoding's: identical, or (bf16) parting only
after a near-tie of the fp32 target's logits (bench/divergence.py; "near-tie" in the table).

N-gram lookup (serving/decode/lookup.py): then the winner is measured again, interleaved with
itself plus lookup drafts of `lookup_num_tokens` tokens, on the prompts the sweep got to;
when lookup is faster (and still identical) the stored tree records it
(`"lookup": {"num_tokens": N}`), and `generate`/`serve` use it unless told otherwise.

Reply store (serving/decode/store.py; `specheads tune --store DIR`): then the winner, with lookup
if it was kept, is measured again the same way without and with the store's chains as one more
branch; when the store is faster (and still identical) the stored tree records it
(`"store": {"path": DIR, ...its settings}`), and `generate`/`serve` use it unless `--store none`.

The winner (best tokens/s) is written into the heads directory's config `tree` field and
the sweep into tuning.json beside it (heads.heads_dir.update_tree), atomically; `generate`,
`serve` and `bench` then use it by default.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from specheads.bench.prompts import WARMUP_NEW_TOKENS
from specheads.bench.tune_candidates import NODE_BUDGETS, Setting, candidate_settings
from specheads.serving.decode.generate import generate
from specheads.serving.decode.stats import alpha_tau

SCHEMA = "specheads.tune/1"
@dataclass
class Measured:
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    accepted: int = 0
    drafted: int = 0
    speculative_steps: int = 0
    outputs: list = field(default_factory=list)

    def add(self, result, seconds: float) -> None:
        self.tokens += len(result.tokens)
        self.seconds += seconds
        self.steps += result.stats.steps
        self.accepted += result.stats.accepted_tokens
        self.drafted += result.stats.drafted_tokens
        self.speculative_steps += result.stats.speculative_steps
        self.outputs.append(list(result.tokens))


def _decoder(target, heads, heads_config, setting: Setting, lookup=None, store=None, cuda_graphs: str | None = None):
    from specheads.bench.harness import engine_kwargs
    from specheads.serving.decode.config import SpeculativeDecoder

    tap_layers = heads_config.tap_layers if heads_config.kind != "medusa" else None
    # Fallback off: the tree itself is measured, not the engine's switch to plain decoding. The
    # engine runs as serve runs it (cuda_graphs: "capture" on a GPU, as `specheads serve` does).
    return SpeculativeDecoder(target, heads, setting.tree, tap_layers=tap_layers, lookup=lookup, store=store,
                              entropy_threshold=setting.entropy_threshold, **engine_kwargs(False, cuda_graphs))


def measure_lookup(target, heads, heads_config, setting: Setting, prompts: list[list[int]], plain: Measured,
                   num_tokens: int, max_new_tokens: int, eos_token_id, cuda_graphs: str | None = None) -> dict:
    """The winning setting without and with n-gram lookup drafts, interleaved on `prompts`
    (those plain decoding was measured on) -> {"num_tokens", "chosen", "without", "with"}."""
    from specheads.serving.decode.lookup import LookupConfig

    return {"num_tokens": num_tokens, **measure_branch(target, heads, heads_config, setting, prompts, plain,
                                                       max_new_tokens, eos_token_id, {"cuda_graphs": cuda_graphs},
                                                       {"lookup": LookupConfig(num_tokens=num_tokens)})}


def measure_store(target, heads, heads_config, setting: Setting, prompts: list[list[int]], plain: Measured,
                  store, lookup, max_new_tokens: int, eos_token_id, cuda_graphs: str | None = None) -> dict:
    """The winning setting (with `lookup`, a LookupConfig or None) without and with the reply
    store's chains (`store`: a serving/decode/store.py StoreDrafter), interleaved on `prompts`
    -> {"path", "config", "chosen", "without", "with"}."""
    from specheads.runner import STORE_LEARN

    path = STORE_LEARN if store.store is None else str(store.store.directory.resolve())
    return {"path": path, "config": dataclasses.asdict(store.config),
            **measure_branch(target, heads, heads_config, setting, prompts, plain, max_new_tokens, eos_token_id,
                             {"lookup": lookup, "cuda_graphs": cuda_graphs}, {"store": store})}


def _warm_up(decoder, prompt: list[int], max_new_tokens: int, eos_token_id) -> None:
    """The untimed decode before a decoder is timed; a learning store then forgets its reply, so
    the timed runs do not draft the warm-up's reply back."""
    generate(decoder, prompt, max_new_tokens=min(WARMUP_NEW_TOKENS, max_new_tokens), eos_token_id=eos_token_id)
    if decoder.store is not None:
        decoder.store.forget()


def measure_branch(target, heads, heads_config, setting: Setting, prompts: list[list[int]], plain: Measured,
                   max_new_tokens: int, eos_token_id, base: dict, extra: dict) -> dict:
    """The setting's decoder with the chain sources `base` (decoder kwargs), without and with
    `extra` too, interleaved on `prompts` -> {"chosen": with is lossless and faster, "without",
    "with"}."""
    decoders = {"without": _decoder(target, heads, heads_config, setting, **base),
                "with": _decoder(target, heads, heads_config, setting, **base, **extra)}  # base carries cuda_graphs
    measured = {name: Measured() for name in decoders}
    for decoder in decoders.values():
        _warm_up(decoder, prompts[0], max_new_tokens, eos_token_id)
    for prompt in prompts:
        for name, decoder in decoders.items():
            measured[name].add(*_timed(decoder, prompt, max_new_tokens, eos_token_id))
    judge = OutputJudge(target, prompts)
    rows = {name: summary(m, plain, plain.outputs, judge) for name, m in measured.items()}
    chosen = rows["with"]["lossless"] and rows["with"]["tokens_per_s"] > rows["without"]["tokens_per_s"]
    return {"chosen": chosen, **rows}


def _timed(decoder, prompt: list[int], max_new_tokens: int, eos_token_id):
    start = time.perf_counter()
    result = generate(decoder, prompt, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
    return result, time.perf_counter() - start


class OutputJudge:
    """Whether a setting keeps plain decoding's output on `prompts`: identical, or parting from
    it only after a near-tie of the fp32 target's logits, as a bf16 verify and a bf16 decode
    step may (bench/divergence.py). The fp32 scorer is loaded at the first difference."""

    def __init__(self, target, prompts: list[list[int]]):
        self.target, self.prompts, self.checker = target, prompts, None

    def keeps(self, outputs: list, reference: list) -> bool:
        for prompt, tokens, expected in zip(self.prompts, outputs, reference):
            if tokens == expected:
                continue
            if self.checker is None:
                from specheads.bench.harness import divergence_checker

                self.checker = divergence_checker(self.target)
            if not self.checker.check(prompt, expected, tokens).near_tie:
                return False
        return True


def summary(measured: Measured, plain: Measured, reference_outputs: list, judge: OutputJudge | None = None) -> dict:
    """One setting's row. "identical": every output equals plain decoding's; "lossless": that,
    or (judge) every difference comes after a near-tie."""
    tokens_per_s = measured.tokens / measured.seconds if measured.seconds > 0 else 0.0
    plain_tps = plain.tokens / plain.seconds if plain.seconds > 0 else 0.0
    step_s = measured.seconds / measured.steps if measured.steps else None
    plain_step_s = plain.seconds / plain.steps if plain.steps else None
    identical = measured.outputs == reference_outputs[:len(measured.outputs)]
    return {"tokens": measured.tokens, "seconds": measured.seconds, "tokens_per_s": tokens_per_s,
            "speedup_vs_plain": tokens_per_s / plain_tps if plain_tps else None,
            "steps": measured.steps,
            **dict(zip(("alpha", "tau"), alpha_tau(measured.accepted, measured.drafted, measured.speculative_steps)
                       if measured.drafted else (None, None))),
            "step_ms": 1000 * step_s if step_s else None,
            "step_cost": step_s / plain_step_s if step_s and plain_step_s else None,
            "identical": identical,
            "lossless": identical or (judge is not None and judge.keeps(measured.outputs, reference_outputs))}


def tune(target, heads, heads_config, prompts: list[list[int]], *, max_new_tokens: int = 64,
         budget_s: float = 120.0, eos_token_id: int | None = None, max_settings: int = 16,
         depths: list[int] | None = None, node_budgets: tuple[int, ...] = NODE_BUDGETS,
         settings: list[Setting] | None = None, progress: bool = True,
         log: Callable[[str], None] | None = None, lookup_num_tokens: int = 10, costs=None, store=None,
         cuda_graphs: str | None = None) -> dict:
    """Measure every setting on `prompts` within `budget_s`; -> the tuning report (winner first).
    costs: this machine's StepCostTable, which ranks the candidates (None: the prior). store: a
    serving/decode/store.py StoreDrafter to try on the winner (module doc). cuda_graphs: the
    engine's graphs, as serve runs it ("capture" on a GPU; bench/harness.py engine_kwargs).

    Settings the decoder refuses (ValueError, e.g. a tree the heads cannot draft) are
    recorded with their error and skipped, never silently dropped.
    """
    from tqdm.auto import tqdm

    from specheads.bench.harness import engine_kwargs
    from specheads.serving.decode.config import SpeculativeDecoder

    if not prompts:
        raise ValueError("tune needs at least one prompt")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if budget_s <= 0:
        raise ValueError(f"budget_s must be > 0 seconds, got {budget_s}")
    settings = settings if settings is not None else candidate_settings(
        heads_config, max_settings=max_settings, depths=depths, node_budgets=node_budgets, costs=costs)
    decoders, skipped = {}, []
    plain_decoder = SpeculativeDecoder(target, **engine_kwargs(True, cuda_graphs))
    for setting in settings:
        try:
            decoders[setting.name] = _decoder(target, heads, heads_config, setting, cuda_graphs=cuda_graphs)
            _warm_up(decoders[setting.name], prompts[0], max_new_tokens, eos_token_id)  # and fail early
        except (ValueError, NotImplementedError) as err:
            skipped.append({"name": setting.name, "kind": setting.kind, "error": f"{type(err).__name__}: {err}"})
            decoders.pop(setting.name, None)
    active = [s for s in settings if s.name in decoders]
    if not active:
        raise ValueError(f"no tree setting could be decoded: {skipped}")
    _warm_up(plain_decoder, prompts[0], max_new_tokens, eos_token_id)
    plain = Measured()
    measured = {s.name: Measured() for s in active}
    start = time.perf_counter()
    bar = tqdm(total=len(prompts), desc=f"tune: {len(active)} trees x prompts", unit="prompt", disable=not progress)
    num_prompts = 0
    for prompt in prompts:
        plain.add(*_timed(plain_decoder, prompt, max_new_tokens, eos_token_id))
        for setting in active:
            measured[setting.name].add(*_timed(decoders[setting.name], prompt, max_new_tokens, eos_token_id))
        num_prompts += 1
        bar.update(1)
        if time.perf_counter() - start > budget_s:
            break
    bar.close()
    if log and num_prompts < len(prompts):
        log(f"tune: time budget {budget_s:.0f} s spent after {num_prompts}/{len(prompts)} prompts")
    judge = OutputJudge(target, prompts[:num_prompts])
    rows = []
    for setting in active:
        row = {"name": setting.name, "kind": setting.kind, "num_nodes": setting.num_nodes,
               "max_depth": setting.max_depth, "estimate": setting.estimate, "tree": setting.record}
        row.update(summary(measured[setting.name], plain, plain.outputs, judge))
        rows.append(row)
    rows.sort(key=lambda r: -r["tokens_per_s"])
    winner = next((r for r in rows if r["lossless"]), None)
    if winner is None:
        raise ValueError("no tree setting reproduced plain greedy decoding (token for token, or parting only after "
                         f"a near-tie); not storing a tree (settings: {[r['name'] for r in rows]})")
    lookup = store_report = None
    setting = next(s for s in active if s.name == winner["name"])
    if lookup_num_tokens > 0:
        lookup = measure_lookup(target, heads, heads_config, setting, prompts[:num_prompts], plain,
                                lookup_num_tokens, max_new_tokens, eos_token_id, cuda_graphs)
    if store is not None:
        from specheads.serving.decode.lookup import LookupConfig

        kept = LookupConfig(num_tokens=lookup["num_tokens"]) if lookup and lookup["chosen"] else None
        store_report = measure_store(target, heads, heads_config, setting, prompts[:num_prompts], plain, store, kept,
                                     max_new_tokens, eos_token_id, cuda_graphs)
    plain_row = summary(plain, plain, plain.outputs)
    device = str(getattr(target, "device", "cpu"))
    return {"schema": SCHEMA, "winner": winner["name"], "device": device, "torch_threads": torch.get_num_threads(),
            "conditions": conditions(target, costs, cuda_graphs),
            "num_prompts": num_prompts, "max_new_tokens": max_new_tokens, "budget_s": budget_s,
            "seconds": time.perf_counter() - start, "plain": plain_row, "settings": rows, "skipped": skipped,
            "lookup": lookup, "store": store_report, "step_costs": costs.to_json() if costs is not None else None}


def stored_tree(report: dict) -> dict:
    """The winner as config.json's `tree` field: the tree itself plus what was measured."""
    winner = next(r for r in report["settings"] if r["name"] == report["winner"])
    tree = dict(winner["tree"])
    if "paths" in tree:
        tree["num_nodes"] = winner["num_nodes"]
    tree["tuned"] = {"setting": winner["name"], "device": report["device"], "torch_threads": report["torch_threads"],
                     "tokens_per_s": winner["tokens_per_s"], "speedup_vs_plain": winner["speedup_vs_plain"],
                     "tau": winner["tau"], "step_cost": winner["step_cost"], "sweep": "tuning.json",
                     "conditions": report.get("conditions")}
    lookup = report.get("lookup")
    if lookup and lookup["chosen"]:
        tree["lookup"] = {"num_tokens": lookup["num_tokens"]}
        tree["tuned"]["tokens_per_s_with_lookup"] = lookup["with"]["tokens_per_s"]
    store = report.get("store")
    if store and store["chosen"]:
        tree["store"] = {"path": store["path"], **store["config"]}
        tree["tuned"]["tokens_per_s_with_store"] = store["with"]["tokens_per_s"]
    if slower_than_plain(report):  # generate and serve decode plainly here (serving/decode/config.py TreeSpec)
        tree["plain"] = True
    return tree


def conditions(target, costs=None, cuda_graphs: str | None = None) -> dict:
    """What a tuning's measurements depend on here: the device (a GPU's name; a CPU's bf16 class),
    the dtype, the weight layout and row kernel, threads, CUDA graphs, and (with `costs`) the
    measured decode step. A tree tuned under other conditions is tuned again (`retune_reason`)."""
    device = torch.device(getattr(target, "device", "cpu"))
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        from specheads.heads.target.cpu_layout import cpu_has_native_bf16
        from specheads.heads.target.cpu_kernels import cpu_flags

        flags = set(cpu_flags().split())
        name = "cpu-" + ("avx512bf16" if cpu_has_native_bf16() else "avx512" if "avx512f" in flags
                         else "avx2" if "avx2" in flags else "other")
    fused = getattr(target, "fused", None)
    return {"device": name, "dtype": str(target.dtype).removeprefix("torch."), "layout": target.layout,
            "row_kernel": getattr(fused, "row_kernel", None), "threads": torch.get_num_threads(),
            "cuda_graphs": cuda_graphs, "decode_ms": None if costs is None else round(costs.verify_ms[1], 3)}


# A tuned tree is tuned again when this machine's decode step costs this much more or less.
RETUNE_STEP_CHANGE = 0.25


def retune_reason(tuned: dict | None, now: dict) -> str | None:
    """Why a stored tuning (config.json's tree["tuned"]) no longer fits this machine's `conditions`,
    or None when it still does: never tuned, tuned under other conditions, or a decode step that
    moved by more than RETUNE_STEP_CHANGE (a new kernel, another machine)."""
    if not tuned:
        return "never tuned"
    before = tuned.get("conditions")
    if not before:
        return "tuned before tunings recorded their conditions"
    for key in ("device", "dtype", "layout", "row_kernel", "threads", "cuda_graphs"):
        if before.get(key) != now.get(key):
            return f"tuned with {key} {before.get(key)!r}, now {now.get(key)!r}"
    old, new = before.get("decode_ms"), now.get("decode_ms")
    if old and new and abs(new - old) > RETUNE_STEP_CHANGE * old:
        return f"the decode step cost {old:.1f} ms when tuned and {new:.1f} ms now"
    return None


def best_speedup(report: dict) -> float | None:
    """The fastest measured way to decode with these heads, against plain decoding on the same
    prompts: the winner alone, or with the lookup or store branch it was measured with."""
    winner = next(r for r in report["settings"] if r["name"] == report["winner"])
    rows = [winner] + [branch["with"] for branch in (report.get("lookup"), report.get("store")) if branch]
    speedups = [row["speedup_vs_plain"] for row in rows if row.get("speedup_vs_plain") is not None]
    return max(speedups) if speedups else None


def slower_than_plain(report: dict) -> str | None:
    """A warning when no setting beat plain decoding here, or None. Then the heads directory records
    it (stored_tree's "plain"): generate and serve decode plainly with these heads, and the user
    should know that, on this machine, they are slower than no heads."""
    best = best_speedup(report)
    if best is None or best >= 1.0:
        return None
    return (f"speculation did not pay on this machine: the fastest setting ({report['winner']}) made {best:.2f}x "
            f"plain decoding's {report['plain']['tokens_per_s']:.1f} tok/s, so generate and serve decode plainly with "
            "these heads here (the tree is kept for bench). Heads trained on more data, or a GPU, are what change this")


def format_tuning(report: dict) -> str:
    """Markdown table of the sweep, fastest first."""
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    lines = [f"### tune ({report['num_prompts']} prompts x {report['max_new_tokens']} new tokens, {report['device']}, "
             f"{report['torch_threads']} threads; plain {report['plain']['tokens_per_s']:.1f} tok/s, "
             f"{fmt(report['plain']['step_ms'], '.2f')} ms/step)", "",
             "| setting | nodes | depth | tok/s | vs plain | tau | alpha | step ms | step cost | identical |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in report["settings"]:
        mark = " (chosen)" if r["name"] == report["winner"] else ""
        lines.append(f"| {r['name']}{mark} | {r['num_nodes']} | {r['max_depth']} | {r['tokens_per_s']:.1f} | "
                     f"{fmt(r['speedup_vs_plain'], '.2f')}x | {fmt(r['tau'], '.2f')} | {fmt(r['alpha'], '.3f')} | "
                     f"{fmt(r['step_ms'], '.2f')} | {fmt(r['step_cost'], '.2f')} | "
                     f"{'yes' if r['identical'] else 'near-tie' if r['lossless'] else 'NO'} |")
    for s in report["skipped"]:
        lines.append(f"| {s['name']} (skipped: {s['error']}) | | | | | | | | | |")
    if report.get("step_costs"):
        from specheads.bench.step_costs import StepCostTable

        lines += ["", "Candidates were ranked by these measured costs:", "",
                  StepCostTable.from_json(report["step_costs"]).format()]
    lookup = report.get("lookup")
    if lookup:
        lines += ["", f"n-gram lookup ({lookup['num_tokens']} tokens) on {report['winner']}, measured again side by "
                      f"side: {lookup['with']['tokens_per_s']:.1f} tok/s (tau {fmt(lookup['with']['tau'], '.2f')}) "
                      f"with, {lookup['without']['tokens_per_s']:.1f} tok/s without: "
                      + ("stored (generate/serve use it; --lookup-num-tokens 0 turns it off)" if lookup["chosen"]
                         else "not used")]
    store = report.get("store")
    if store:
        lines += ["", f"reply store {store['path']} ({store['config']['num_tokens']} tokens) on {report['winner']}, "
                      f"measured again side by side: {store['with']['tokens_per_s']:.1f} tok/s (tau "
                      f"{fmt(store['with']['tau'], '.2f')}) with, "
                      f"{store['without']['tokens_per_s']:.1f} tok/s without: "
                      + ("stored (generate/serve use it; --store none turns it off)" if store["chosen"]
                         else "not used")]
    warning = slower_than_plain(report)
    if warning:
        lines += ["", f"**{warning}.**"]
    return "\n".join(lines)


def tune_heads_dir(target, heads_dir: str, prompts: list[list[int]], *, reuse: bool = False,
                   log: Callable[[str], None] | None = None, **kwargs) -> dict:
    """Load the heads in `heads_dir`, measure this machine's step costs with them, tune, store
    the winner and the sweep; -> the report. reuse: keep the stored tuning (and return its
    report) unless `retune_reason` says it no longer fits this machine."""
    from specheads.bench.step_costs import measure_step_costs
    from specheads.heads.artefacts.heads_dir import check_writable, load_heads, read_heads_config, read_tuning, \
        update_tree

    check_writable(heads_dir)  # the winner is stored there: a Hub id fails now, not after the sweep
    heads, heads_config = load_heads(heads_dir, target=target.identity, device=target.device, dtype=target.dtype)
    if kwargs.get("costs") is None:
        kwargs["costs"] = measure_step_costs(target, heads, heads_config)
    if reuse:
        reason = retune_reason((read_heads_config(heads_dir).tree or {}).get("tuned"),
                               conditions(target, kwargs["costs"], kwargs.get("cuda_graphs")))
        if reason is None and read_tuning(heads_dir) is not None:
            return read_tuning(heads_dir)
        if log:
            log(f"tune: tuning {heads_dir} again ({reason})")
    kwargs["log"] = log
    report = tune(target, heads, heads_config, prompts, **kwargs)
    report["heads"] = str(heads_dir)
    update_tree(heads_dir, stored_tree(report), report)
    return report
