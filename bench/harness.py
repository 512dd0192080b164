"""`specheads bench` core: decode one prompt set with every method in one process and
measure acceptance, speed and losslessness.

Methods (each a `Method`: a name, a kind and a `generate(prompt) -> PromptRun` callable):
    hf-greedy         HF `generate(do_sample=False)`: the reference for speedup and identity
    engine-plain      SpeculativeDecoder without heads (speculation off)
    engine-heads      SpeculativeDecoder with heads, one method per draft tree
    engine-lookup     SpeculativeDecoder with n-gram lookup drafts and no heads
    engine-heads+lookup  heads (their stored or tuned tree) plus lookup (serving/decode/lookup.py)
    engine-store      SpeculativeDecoder with drafts from a store of the target's replies, no heads
    engine-heads+store   heads plus lookup (when benched) plus the reply store (serving/decode/store.py)
    hf-prompt-lookup  HF `generate(prompt_lookup_num_tokens=N)`
    hf-assisted       HF `generate(assistant_model=draft)` (only with a draft model)

Timing. Every method yields "emission events" (time, tokens emitted) per prompt:
- HF methods: a `BaseStreamer` records the time of each `put` after the prompt's; one put
  is one target forward (greedy: 1 token; prompt lookup / assisted: accepted + 1).
- The engine: `SpeculativeDecoder.stream` yields the prefill's token, then the tokens of
  each verify step; each yield is timed as it arrives.
Methods run interleaved (every method on prompt 1, then on prompt 2, ...) so that load
from other processes spreads evenly over them. The first event is the time to first
token (TTFT). Inter-token latency (ITL): every later event of duration d (since the
previous event) emitting n tokens contributes n samples of d / n; p50/p90 are taken over
all tokens of a method (or category). tokens/s = new tokens / wall seconds of `generate`
(prefill included). speedup = tokens/s / hf-greedy tokens/s over the same prompts.

Dtype and identity. Every method runs in the target's dtype (`specheads bench --dtype`,
"auto" by default: bf16 on a CPU with native bf16); HF methods on the plain `nn.Linear`
weights transformers loaded, the engine on the packed ones (heads/target/cpu_layout.py). In fp32
every output must equal hf-greedy's; in bf16 a verify and HF's one-token steps round
differently, so outputs may part after a near-tie: each first difference is scored by the
fp32 target (bench/divergence.py) and one that is not at a near-tie is reported as a bug.

Acceptance (docs/architecture.md invariant 8): engine alpha = accepted / drafted draft tokens, tau =
(accepted + steps) / steps; acceptance_by_depth[d] = share of steps that accepted a
(d+1)-th draft token. HF peers do not expose drafted counts: alpha is null, tau = new
tokens / target forwards seen by the streamer, acceptance_by_depth from the event sizes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from specheads.bench.divergence import summarise_divergences
from specheads.bench.prompts import WARMUP_NEW_TOKENS, EncodedPrompt
from specheads.serving.decode.stats import alpha_tau

SCHEMA = "specheads.bench/1"
REFERENCE = "hf-greedy"

HEADS_KINDS = ("engine-heads", "engine-heads+lookup", "engine-heads+store")  # method kinds that draft with heads


@dataclass
class PromptRun:
    tokens: list[int]  # new tokens
    seconds: float  # wall time of generate
    events: list[tuple[float, int]]  # (seconds since start, tokens emitted), in order
    steps: int = 0  # verify steps (engine) or target forwards (HF peers)
    drafted_tokens: int | None = None  # None: not observable (HF peers)
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [D]
    fell_back: bool = False  # the engine switched this request to plain decoding (its fallback policy)
    lookup_accepted: int = 0  # accepted draft tokens that came from n-gram lookup chains
    store_accepted: int = 0  # accepted draft tokens that came from reply-store chains
    speculative_steps: int = 0  # verify steps that drafted (engine; tau's denominator)


@dataclass
class Method:
    name: str
    kind: str  # hf-greedy | engine-plain | engine-heads | engine-lookup | engine-heads+lookup | engine-store
    #            | engine-heads+store | hf-prompt-lookup | hf-assisted
    generate: Callable[[list[int], int], PromptRun]  # (prompt ids, max_new_tokens) -> PromptRun
    tree: dict | None = None  # engine-heads: {"source", "num_nodes", "num_draft_nodes", "max_depth"}
    decoder: object = None  # the engine methods' SpeculativeDecoder


def _streamer_cls():
    from transformers.generation.streamers import BaseStreamer

    class EventStreamer(BaseStreamer):
        """Records (time, num tokens) for every put after the prompt's."""

        def __init__(self, start: float):
            self.start = start
            self.events: list[tuple[float, int]] = []
            self.seen_prompt = False

        def put(self, value):
            if not self.seen_prompt:
                self.seen_prompt = True
                return
            self.events.append((time.perf_counter() - self.start, int(value.numel())))

        def end(self):
            pass

    return EventStreamer


def hf_method(name: str, kind: str, target, eos_token_id: int | None, **generate_kwargs) -> Method:
    """transformers' own `generate` on the target as transformers loaded it: its plain
    `nn.Linear`s, not the packed weights the engine runs (heads/target/cpu_layout.py)."""
    streamer_cls = _streamer_cls()
    model = target.model

    def generate(prompt_ids: list[int], max_new_tokens: int) -> PromptRun:
        input_ids = torch.tensor([prompt_ids], device=model.device)
        start = time.perf_counter()
        streamer = streamer_cls(start)
        with torch.inference_mode(), target.plain_weights():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                                 pad_token_id=eos_token_id if eos_token_id is not None else 0,
                                 streamer=streamer, **generate_kwargs)
        seconds = time.perf_counter() - start
        tokens = out[0, len(prompt_ids):].tolist()
        sizes = [n for _, n in streamer.events]
        depth = max(sizes, default=1) - 1
        per_position = [sum(1 for n in sizes if n - 1 > d) for d in range(depth)]
        return PromptRun(tokens=tokens, seconds=seconds, events=streamer.events, steps=len(sizes),
                         accepted_tokens=sum(n - 1 for n in sizes), accepted_per_position=per_position)

    return Method(name, kind, generate)


def engine_method(name: str, kind: str, decoder, eos_token_id: int | None, tree: dict | None = None) -> Method:
    from specheads.serving.decode.generate import stream

    def generate(prompt_ids: list[int], max_new_tokens: int) -> PromptRun:
        # stream() yields the prefill's token, then one delta per verify step: each yield is
        # one emission event, timed as it arrives.
        events: list[tuple[float, int]] = []
        start = time.perf_counter()
        decoding = stream(decoder, prompt_ids, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
        for delta in decoding:
            events.append((time.perf_counter() - start, len(delta)))
        end = time.perf_counter()
        out = decoding.result
        stats = out.stats
        return PromptRun(tokens=out.tokens, seconds=end - start, events=events, steps=stats.steps,
                         drafted_tokens=stats.drafted_tokens, accepted_tokens=stats.accepted_tokens,
                         accepted_per_position=list(stats.accepted_per_position),
                         fell_back=stats.fallback, lookup_accepted=stats.lookup_accepted,
                         store_accepted=stats.store_accepted,
                         speculative_steps=stats.speculative_steps)

    return Method(name, kind, generate, tree, decoder)


def tree_info(tree, source: str) -> dict:
    return {"source": source, "num_nodes": tree.num_nodes, "num_draft_nodes": tree.num_nodes - 1,
            "max_depth": tree.max_depth}


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated q-th percentile (0..100, numpy's default method); None for no values."""
    return float(np.percentile(values, q)) if len(values) else None


def itl_samples(events: list[tuple[float, int]]) -> list[float]:
    samples = []
    for (prev_t, _), (t, num) in zip(events, events[1:]):
        if num > 0:
            samples.extend([(t - prev_t) / num] * num)
    return samples


def summarise(runs: list[PromptRun], identical: list[bool], reference: list[PromptRun] | None) -> dict:
    num_tokens = sum(len(r.tokens) for r in runs)
    seconds = sum(r.seconds for r in runs)
    tokens_per_s = num_tokens / seconds if seconds > 0 else 0.0
    itl = [s for r in runs for s in itl_samples(r.events)]
    steps = sum(r.steps for r in runs)
    drafted = None if any(r.drafted_tokens is None for r in runs) else sum(r.drafted_tokens for r in runs)
    accepted = sum(r.accepted_tokens for r in runs)
    depth = max((len(r.accepted_per_position) for r in runs), default=0)
    per_position = [sum(r.accepted_per_position[d] for r in runs if d < len(r.accepted_per_position))
                    for d in range(depth)]
    alpha = None
    # HF peers: every observed forward; the engine: its speculative steps (alpha_tau's denominator)
    acceptance_steps = steps if drafted is None else sum(r.speculative_steps for r in runs)
    if drafted is None:  # HF peer: each observed forward emitted one token of its own plus the accepted ones
        tau = alpha_tau(num_tokens - steps, 0, steps)[1] if steps else None
    elif drafted == 0:  # the engine without speculation: no drafts to measure
        tau = None
    else:
        alpha, tau = alpha_tau(accepted, drafted, acceptance_steps)
    speedup = None
    if reference is not None:
        ref_s = sum(r.seconds for r in reference)
        ref_tps = sum(len(r.tokens) for r in reference) / ref_s if ref_s > 0 else 0.0
        speedup = tokens_per_s / ref_tps if ref_tps > 0 else None
    ttft = [r.events[0][0] for r in runs if r.events]
    return {
        "num_prompts": len(runs), "num_tokens": num_tokens, "seconds": seconds, "tokens_per_s": tokens_per_s,
        "speedup": speedup,
        "itl_p50_ms": None if not itl else 1000 * percentile(itl, 50),
        "itl_p90_ms": None if not itl else 1000 * percentile(itl, 90),
        "ttft_mean_ms": 1000 * sum(ttft) / len(ttft) if ttft else None,
        "steps": steps, "drafted_tokens": drafted, "accepted_tokens": accepted,
        "alpha": alpha, "tau": tau,
        "acceptance_by_depth": [count / acceptance_steps for count in per_position] if acceptance_steps else [],
        "num_identical": sum(identical), "identical": all(identical),
        "num_fallbacks": sum(r.fell_back for r in runs),
        "lookup_accepted": sum(r.lookup_accepted for r in runs),
        "store_accepted": sum(r.store_accepted for r in runs),
    }


def run_methods(methods: list[Method], prompts: list[EncodedPrompt], max_new_tokens: int, *,
                warmup: bool = True, log: Callable[[str], None] | None = None) -> dict[str, list[PromptRun]]:
    """Decode every prompt with every method (methods[0] must be the hf-greedy reference)."""
    if not methods or methods[0].kind != REFERENCE:
        raise ValueError("the first method must be the hf-greedy reference")
    if warmup:
        for method in methods:
            method.generate(prompts[0].input_ids, min(WARMUP_NEW_TOKENS, max_new_tokens))
            if method.decoder is not None and method.decoder.store is not None:
                method.decoder.store.forget()  # its replies learned from now on are the bench's own
    # Interleaved (prompt-major): load from other processes then hits every method alike.
    runs: dict[str, list[PromptRun]] = {method.name: [] for method in methods}
    for i, prompt in enumerate(prompts):
        if log:
            log(f"bench: prompt {i + 1}/{len(prompts)} ({prompt.category}) x {len(methods)} methods")
        for method in methods:
            runs[method.name].append(method.generate(prompt.input_ids, max_new_tokens))
    return runs


def build_report(methods: list[Method], prompts: list[EncodedPrompt], runs: dict[str, list[PromptRun]],
                 config: dict, checker=None) -> dict:
    """The JSON report (schema: the docstring of specheads/bench_cli.py). checker: a
    bench/divergence.DivergenceChecker that scores each first difference from the reference
    (None: differences are counted, not scored)."""
    reference = runs[methods[0].name]
    categories = sorted({p.category for p in prompts}, key=[p.category for p in prompts].index)
    report = {"schema": SCHEMA, "config": dict(config, num_prompts=len(prompts), max_new_tokens=config.get(
        "max_new_tokens")), "categories": categories, "reference": methods[0].name, "methods": []}
    if checker is not None:
        report["config"]["tie_tolerance"] = checker.tolerance
    for method in methods:
        method_runs = runs[method.name]
        identical = [run.tokens == ref.tokens for run, ref in zip(method_runs, reference)]
        divergences = [None if same or checker is None else checker.check(p.input_ids, ref.tokens, run.tokens)
                       for p, run, ref, same in zip(prompts, method_runs, reference, identical)]
        by_category = {}
        for category in categories:
            idx = [i for i, p in enumerate(prompts) if p.category == category]
            by_category[category] = summarise([method_runs[i] for i in idx], [identical[i] for i in idx],
                                              [reference[i] for i in idx])
        per_prompt = [{"question_id": p.question_id, "category": p.category, "num_prompt_tokens": len(p.input_ids),
                       "num_tokens": len(r.tokens), "seconds": r.seconds, "steps": r.steps,
                       "accepted_tokens": r.accepted_tokens, "identical": same,
                       "first_difference": None if d is None else d.to_json()}
                      for p, r, same, d in zip(prompts, method_runs, identical, divergences)]
        overall = summarise(method_runs, identical, reference)
        if checker is not None:
            overall["divergence"] = summarise_divergences(divergences)
        report["methods"].append({"name": method.name, "kind": method.kind, "tree": method.tree,
                                  "overall": overall, "by_category": by_category, "prompts": per_prompt})
    return report


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_report(report: dict) -> str:
    """Markdown: one overall table, then one row per method x category."""
    header = ("| method | tokens | tok/s | speedup | ITL p50 ms | ITL p90 ms | alpha | tau | acc. by depth "
              "| acc. from lookup/store | identical |")
    rule = "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"

    def row(label: str, s: dict) -> str:
        depth = " ".join(f"{a:.2f}" for a in s["acceptance_by_depth"][:6]) or "-"
        same = "yes" if s["identical"] else f"{s['num_identical']}/{s['num_prompts']}"
        divergence = s.get("divergence")
        if divergence and divergence["num_different"]:
            same += (f", first diff. at {divergence['first_difference_mean']:.0f}, "
                     f"{divergence['num_near_tie']} near-tie")
            if divergence["num_not_near_tie"]:
                same += f", {divergence['num_not_near_tie']} NOT near-tie (bug)"
        chains = f"{s.get('lookup_accepted', 0)}/{s.get('store_accepted', 0)}"
        return (f"| {label} | {s['num_tokens']} | {s['tokens_per_s']:.1f} | {_fmt(s['speedup'], '.2f')}x | "
                f"{_fmt(s['itl_p50_ms'], '.2f')} | {_fmt(s['itl_p90_ms'], '.2f')} | {_fmt(s['alpha'], '.3f')} | "
                f"{_fmt(s['tau'], '.2f')} | {depth} | {chains} | {same} |")

    config = report["config"]
    where = ", ".join(str(config[key]) for key in ("dtype", "layout", "device") if config.get(key))
    lines = [f"### overall ({config['num_prompts']} prompts x {config['max_new_tokens']} new tokens, greedy"
             f"{', ' + where if where else ''})", "", header, rule]
    lines += [row(m["name"], m["overall"]) for m in report["methods"]]
    lines += ["", "### by category", "", header.replace("| method |", "| method | category |", 1),
              rule.replace("|---|", "|---|---|", 1)]
    for m in report["methods"]:
        for category, s in m["by_category"].items():
            lines.append(row(f"{m['name']} | {category}", s))
    return "\n".join(lines)


def heads_trees(heads_config, tree_nodes: list[int] | None) -> list[tuple[object, dict]]:
    """(tree, tree info) per tree to bench: the heads directory's own tree (the tuned one once
    `specheads tune` ran), then one calibrated tree per entry of `tree_nodes` (draft nodes,
    root excluded), expanded from the directory's calibrated accuracy (or the prior guess)."""
    from specheads.serving.decode.config import TreeSpec
    from specheads.serving.decode.trees import DraftTree, DynamicTreeConfig, prior_accuracy

    trees = []
    record = heads_config.tree or {}
    spec = TreeSpec.from_heads_config(heads_config)
    stored, entropy_threshold = spec.tree, spec.entropy_threshold
    if isinstance(stored, DynamicTreeConfig):
        trees.append((stored, {"source": "heads-dir-tuned", "num_nodes": stored.num_nodes + 1,
                               "num_draft_nodes": stored.num_nodes, "max_depth": stored.depth, "dynamic": True}))
    else:
        source = ("heads-dir-tuned" if record.get("tuned") else "heads-dir") if record.get("paths") \
            else "heads-dir-default"
        info = tree_info(stored, source)
        if entropy_threshold is not None:
            info["entropy_threshold"] = entropy_threshold
        trees.append((stored, info))
    accuracy = (heads_config.calibration or {}).get("accuracy")
    calibrated = "calibrated" if accuracy else "prior"
    accuracy = accuracy[:heads_config.num_heads] if accuracy else prior_accuracy(heads_config.num_heads)
    for num in tree_nodes or []:
        if num < 1:
            raise ValueError(f"--tree-nodes entries must be >= 1, got {num}")
        tree = DraftTree.from_calibration(accuracy, num)
        trees.append((tree, tree_info(tree, calibrated)))
    return trees


def heads_label(heads_config, path: str | None, taken: set[str]) -> str:
    """A short name for one heads directory in method names: its kind, made unique."""
    label = heads_config.kind
    if label in taken:
        from pathlib import Path

        label = f"{label}:{Path(path).name}" if path else f"{label}{len(taken)}"
    n = 2
    base = label
    while label in taken:
        label, n = f"{base}-{n}", n + 1
    return label


def engine_kwargs(fallback: bool, cuda_graphs: str | None = None) -> dict:
    """SpeculativeDecoder kwargs: fallback=False keeps every step speculative (measures the
    heads and tree themselves); True keeps the engine's default per-request fallback policy.
    cuda_graphs ("capture" on a GPU, "eager" for the same static-shape path uncaptured) verifies
    through the tree-attention kernel, as generate and serve do on a CUDA device."""
    graphs = {} if cuda_graphs is None else {"cuda_graphs": cuda_graphs, "attn_impl": "tree"}
    return graphs if fallback else {"fallback": None, **graphs}


def make_methods(target, *, heads=None, heads_config=None, heads_list: list[tuple] | None = None,
                 tree_nodes: list[int] | None = None, eos_token_id: int | None = None,
                 prompt_lookup_num_tokens: int = 10, lookup_num_tokens: int = 10, draft_model=None,
                 fallback: bool = True, cuda_graphs: str | None = None, store=None) -> list[Method]:
    """Every method the bench runs on `target` (a TargetAdapter), hf-greedy first.

    heads_list: [(label, heads module, HeadsConfig), ...] to bench side by side (method names
    `engine-<label>[...]`); `heads`/`heads_config` is the one-directory shorthand (names
    `engine-heads[...]`). fallback=False: the engine never switches a request to plain decoding.
    cuda_graphs: every engine method verifies through CUDA graphs and the kernel (engine_kwargs);
    the HF methods stay as transformers runs them.
    lookup_num_tokens > 0 adds the engine's n-gram lookup alone (`engine-lookup[N]`) and with
    each heads directory's first tree (`engine-<label>+lookup[...]`). store (a
    serving/decode/store.py StoreDrafter) adds it alone (`engine-store[N]`) and with each heads
    directory's first tree and lookup (`engine-<label>+lookup+store[...]`), each method with its
    own learned replies (empty at the start: what one method served never drafts for another)."""
    from specheads.serving.decode.config import SpeculativeDecoder
    from specheads.serving.decode.lookup import LookupConfig

    lookup = LookupConfig(num_tokens=lookup_num_tokens) if lookup_num_tokens > 0 else None

    methods = [hf_method(REFERENCE, "hf-greedy", target, eos_token_id),
               engine_method("engine-plain", "engine-plain",
                             SpeculativeDecoder(target, **engine_kwargs(True, cuda_graphs)), eos_token_id)]
    if heads_list and heads is not None:
        raise ValueError("pass heads/heads_config or heads_list, not both")
    groups = list(heads_list or [])
    if heads is not None:
        groups.append(("heads", heads, heads_config))
    for label, module, config in groups:
        tap_layers = config.tap_layers if config.kind != "medusa" else None
        for index, (tree, info) in enumerate(heads_trees(config, tree_nodes)):
            kind = {"heads-dir-tuned": "tuned"}.get(info["source"], info["source"])
            kind = "stored" if kind.startswith("heads-dir") else kind
            variants = [("", None, None, "engine-heads")]
            if index == 0 and lookup is not None:
                variants.append(("+lookup", lookup, None, "engine-heads+lookup"))
            if index == 0 and store is not None:
                variants.append(("+lookup+store" if lookup is not None else "+store", lookup, store,
                                 "engine-heads+store"))
            for suffix, with_lookup, with_store, method_kind in variants:
                name = f"engine-{label}{suffix}[{kind},{info['num_draft_nodes']}]"
                if any(m.name == name for m in methods):
                    continue
                decoder = SpeculativeDecoder(target, module, tree, tap_layers=tap_layers, lookup=with_lookup,
                                             store=with_store and with_store.fresh(),
                                             entropy_threshold=info.get("entropy_threshold"),
                                             **engine_kwargs(fallback, cuda_graphs))
                methods.append(engine_method(name, method_kind, decoder, eos_token_id,
                                             dict(info, heads=label, head_kind=config.kind,
                                                  lookup_num_tokens=lookup_num_tokens if with_lookup else 0,
                                                  store_num_tokens=store.num_tokens if with_store else 0)))
    if lookup is not None:
        methods.append(engine_method(f"engine-lookup[{lookup_num_tokens}]", "engine-lookup",
                                     SpeculativeDecoder(target, lookup=lookup, **engine_kwargs(fallback, cuda_graphs)),
                                     eos_token_id))
    if store is not None:
        methods.append(engine_method(f"engine-store[{store.num_tokens}]", "engine-store",
                                     SpeculativeDecoder(target, store=store.fresh(),
                                                        **engine_kwargs(fallback, cuda_graphs)),
                                     eos_token_id))
    if prompt_lookup_num_tokens > 0:
        methods.append(hf_method(f"hf-prompt-lookup[{prompt_lookup_num_tokens}]", "hf-prompt-lookup", target,
                                 eos_token_id, prompt_lookup_num_tokens=prompt_lookup_num_tokens))
    if draft_model is not None:
        methods.append(hf_method("hf-assisted", "hf-assisted", target, eos_token_id,
                                 assistant_model=draft_model))
    return methods


def run_bench(target, prompts: list[EncodedPrompt], max_new_tokens: int, *, config: dict | None = None,
              warmup: bool = True, log: Callable[[str], None] | None = None, scorer=None, next_turns=None,
              **method_kwargs) -> dict:
    """Python entry point: build the methods, decode, return the JSON report. next_turns:
    (prompts, the reference's runs on them) -> the prompts of the next turn, decoded after them by
    the same methods (None: one turn; bench/prompts.py next_turn_prompts). Every first
    difference from hf-greedy is scored by an fp32 copy of the target (`scorer()` builds
    it; bench/divergence.py); the report's config names the dtype and weight layout."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompts:
        raise ValueError("no prompts to bench")
    methods = make_methods(target, **method_kwargs)
    runs = run_methods(methods, prompts, max_new_tokens, warmup=warmup, log=log)
    later = next_turns(prompts, runs[methods[0].name]) if next_turns is not None else []
    if later:  # the same methods go on (a learning store keeps what the first turns taught it)
        more = run_methods(methods, later, max_new_tokens, warmup=False, log=log)
        prompts = prompts + later
        runs = {name: runs[name] + more[name] for name in runs}
    checker = None
    reference = runs[methods[0].name]
    if any(run.tokens != ref.tokens for method in methods for run, ref in zip(runs[method.name], reference)):
        checker = divergence_checker(target, scorer)
    config = dict(config or {}, max_new_tokens=max_new_tokens, dtype=str(target.dtype).removeprefix("torch."),
                  layout=target.layout)
    return build_report(methods, prompts, runs, config, checker)


def not_near_ties(report: dict) -> list[str]:
    """Methods with an output that differs from hf-greedy other than after a near-tie of the
    fp32 target's logits (bench/divergence.py): a bug in any dtype."""
    return [m["name"] for m in report["methods"] if not m["overall"]["identical"]
            and (m["overall"].get("divergence") or {"num_not_near_tie": 1})["num_not_near_tie"]]


def divergence_checker(target, scorer=None):
    """A DivergenceChecker at the tolerance of target's dtype. Its fp32 scorer: the target
    itself in fp32, else `scorer()` (default: the target's directory loaded again in fp32)."""
    from specheads.bench.divergence import TOLERANCES, DivergenceChecker
    from specheads.heads.target.adapter import TargetAdapter

    if target.dtype == torch.float32:
        fp32 = target
    elif scorer is not None:
        fp32 = scorer()
    else:
        fp32 = TargetAdapter.from_pretrained(target.identity.name_or_path, dtype="float32", device=target.device)
    return DivergenceChecker(fp32, TOLERANCES[target.dtype])
