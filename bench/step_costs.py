"""What one speculative step costs on this machine: verify forwards of T tree tokens against
one decode step, and the heads' draft cost per depth. These numbers decide which trees can
pay (a tree of T nodes must emit more than cost(T) / cost(1) tokens per step): `specheads
tune` estimates every candidate tree from them, and `specheads bench` prints and stores them.

    python -m specheads.bench.step_costs --target embedded:smollm2 [--dtype auto] [--prefix 300] \
        [--trees 1,2,4,8,16,32,64] [--heads DIR] [--plain-weights]

Everything runs through the serving path, in the dtype and weight layout the engine runs
(runner.load_target_and_tokenizer: "auto" is the device's fast dtype, packed weights on a
CPU): the target adapter over a `TreeStaticCache` after a prefill of `--prefix` tokens, a
4-D tree mask, and the real drafters (the heads of `--heads`, or an EAGLE-3 head and Medusa
heads of the sizes a recipe trains, randomly initialised: their cost does not depend on
their weights). Each figure is the median of `--repeats` timed calls after one warm-up; the
verify sizes are timed in rounds (each round times every T once), so that a drift of the
memory speed during the run moves every T alike.
Run it alone: two busy cores make every figure meaningless.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from dataclasses import asdict, dataclass, fields

import torch

from specheads.bench.support import time_ms

VERIFY_SIZES = (1, 2, 4, 8, 16, 32, 64)
DRAFT_DEPTHS = (1, 2, 3, 4, 5, 6)


@dataclass
class StepCostTable:
    """Measured step costs of one target (+ heads) on this machine, in one dtype and layout."""

    dtype: str
    layout: str  # "packed" | "plain" (heads/target/cpu_layout.py)
    threads: int
    prefix: int  # committed tokens before the timed forwards
    verify_ms: dict[int, float]  # T -> ms of one verify forward of T tokens (T=1: a decode step)
    draft_ms: dict[int, float]  # depth -> ms of drafting a chain that deep ({} without heads)
    draft_kind: str | None = None  # "eagle" (one head run per level) | "medusa" (one call for every depth)

    def verify_cost(self, num_nodes: int) -> float:
        """One verify of num_nodes tokens in decode steps, interpolated linearly between the
        measured sizes (beyond the largest: extrapolated from the last two)."""
        return _interpolate(self.verify_ms, num_nodes) / self.verify_ms[min(self.verify_ms)]

    def draft_cost(self, depth: int) -> float:
        """Drafting a tree `depth` deep, in decode steps (0 without measured drafts)."""
        if not self.draft_ms or depth < 1:
            return 0.0
        return _interpolate(self.draft_ms, depth) / self.verify_ms[min(self.verify_ms)]

    def step_cost(self, num_nodes: int, depth: int) -> float:
        """draft + verify of a tree of num_nodes nodes (root included), in decode steps."""
        return self.verify_cost(num_nodes) + self.draft_cost(depth)

    def to_json(self) -> dict:
        return {key: ({str(k): v for k, v in value.items()} if isinstance(value, dict) else value)
                for key, value in asdict(self).items()}

    @classmethod
    def from_json(cls, record: dict) -> "StepCostTable":
        """The table of `to_json()` (keys beside its fields, such as the bench's "heads" label, are ignored)."""
        names = {field.name for field in fields(cls)}
        tables = {key: {int(k): float(v) for k, v in record[key].items()} for key in ("verify_ms", "draft_ms")}
        return cls(**{**{key: value for key, value in record.items() if key in names}, **tables})

    def format(self, verify: bool = True) -> str:
        """Markdown: the verify table (unless verify=False), then the draft table."""
        base = self.verify_ms[min(self.verify_ms)]
        lines = []
        if verify:
            lines += [f"step costs ({self.dtype}, {self.layout} weights, {self.threads} threads, after a "
                      f"{self.prefix}-token prefix):", "", "| verify T | ms | x decode step |", "|---:|---:|---:|"]
            lines += [f"| {num} | {ms:.1f} | {ms / base:.2f} |" for num, ms in sorted(self.verify_ms.items())]
        if self.draft_ms:
            lines += ["", f"| draft depth ({self.draft_kind}) | ms | x decode step |", "|---:|---:|---:|"]
            lines += [f"| {depth} | {ms:.1f} | {ms / base:.2f} |" for depth, ms in sorted(self.draft_ms.items())]
        return "\n".join(lines)


def _interpolate(table: dict[int, float], x: int) -> float:
    keys = sorted(table)
    if x in table:
        return table[x]
    if len(keys) == 1:
        return table[keys[0]] * x / keys[0]
    low = max([k for k in keys if k < x], default=keys[0])
    high = min([k for k in keys if k > x], default=keys[-1])
    if low == high:  # outside the measured range: the nearest segment's slope
        low, high = (keys[0], keys[1]) if x < keys[0] else (keys[-2], keys[-1])
    slope = (table[high] - table[low]) / (high - low)
    return table[low] + slope * (x - low)


def verify_costs(decoder, cache, root: int, prefix_len: int, trees: list[int], repeats: int) -> dict[int, float]:
    """ms of one verify forward of T chain tokens (a 4-D mask, as for a tree) per T, after the
    prefix_len positions the cache holds: the median of `repeats` rounds, each of which times
    every T once, so that a drift of the machine's memory speed moves every T alike."""
    target = decoder.target
    calls = {}
    for num_nodes in trees:
        tokens_1T = torch.full((1, num_nodes), root, dtype=torch.long, device=target.device)
        mask = cache.attention_mask(torch.ones(num_nodes, num_nodes, dtype=torch.bool, device=target.device).tril())
        positions = (torch.arange(num_nodes, device=target.device) + prefix_len)[None]
        calls[num_nodes] = functools.partial(target, tokens_1T, decoder.tap_layers, attention_mask=mask,
                                             position_ids=positions, past_key_values=cache, use_cache=True)
    samples = {num_nodes: [] for num_nodes in trees}
    with torch.inference_mode():
        for call in calls.values():
            call()  # warm-up
        for _ in range(repeats):
            for num_nodes, call in calls.items():
                samples[num_nodes].append(time_ms(call, target.device, 0, 1))
    return {num_nodes: statistics.median(times) for num_nodes, times in samples.items()}


def draft_costs(target, heads, tap_layers: list[int] | None, prompt_1P: torch.Tensor, depths: list[int],
                repeats: int) -> dict[int, float]:
    """ms of one chain draft of each depth by `heads`, in steady state, with what the drafter
    does after the step's accept (EAGLE: one head run per level, then the head's run over the
    step's accepted positions; Medusa: one call of every head)."""
    from specheads.serving.decode.cache import TreeStaticCache
    from specheads.serving.decode.config import SpeculativeDecoder
    from specheads.serving.decode.steps import prefill
    from specheads.serving.decode.trees import DraftTree

    costs = {}
    for depth in depths:
        decoder = SpeculativeDecoder(target, heads, DraftTree.chain(depth), tap_layers=tap_layers)
        with torch.inference_mode():
            max_cache_len = prompt_1P.shape[1] + 128
            cache = TreeStaticCache(target.config, max_cache_len=max_cache_len, device=target.device)
            prefilled = prefill(target, prompt_1P, decoder.tap_layers, cache)
            drafter = decoder.drafter.attach(cache, max_cache_len)
            drafter.start(0, prefilled)  # an EAGLE head runs over the prompt when the sequence joins
            lens_1 = cache.lengths.device_lens[:1]
            draft = (slice(0, 1), prefilled.root, lens_1, max_cache_len)
            # what the step's accept hands the drafter: a step that accepted nothing (the root alone)
            taps_1TX = prefilled.taps[-1:][None].expand(1, depth + 1, -1)
            path_1W = torch.zeros(1, depth + 1, dtype=torch.long, device=target.device)
            observe = (slice(0, 1), taps_1TX, path_1W, lens_1.new_ones(1), path_1W, lens_1, max_cache_len)
            costs[depth] = time_ms(lambda: (drafter.draft(*draft), drafter.observe(*observe)), target.device, 1,
                                   repeats)
    return costs


def measure_step_costs(target, heads=None, heads_config=None, *, prefix: int = 300,
                       trees: tuple[int, ...] = VERIFY_SIZES, depths: tuple[int, ...] | None = None,
                       repeats: int = 7, plain_weights: bool = False) -> StepCostTable:
    """The StepCostTable of `target` (+ `heads`, whose tap layers come from heads_config) here.
    plain_weights: measure the target's original `nn.Linear`s instead of its packed ones."""
    if plain_weights and target.packed is not None:
        with target.plain_weights():
            table = measure_step_costs(target, heads, heads_config, prefix=prefix, trees=trees, depths=depths,
                                       repeats=repeats)
        table.layout = "plain"
        return table
    from specheads.serving.decode.cache import TreeStaticCache
    from specheads.serving.decode.config import SpeculativeDecoder, is_eagle
    from specheads.serving.decode.steps import prefill

    plain = SpeculativeDecoder(target)
    generator = torch.Generator().manual_seed(0)
    prompt_1P = torch.randint(10, target.vocab_size, (1, prefix), generator=generator).to(target.device)
    with torch.inference_mode():
        cache = TreeStaticCache(target.config, max_cache_len=prefix + max(trees) + 8, device=target.device)
        root = int(prefill(target, prompt_1P, plain.tap_layers, cache).root)
    verify = verify_costs(plain, cache, root, prefix, list(trees), repeats)
    draft, kind = {}, None
    if heads is not None:
        kind = "eagle" if is_eagle(heads) else "medusa"
        max_depth = heads_config.num_heads if heads_config is not None else getattr(heads, "num_heads", 1)
        wanted = [d for d in (depths or DRAFT_DEPTHS) if d <= max_depth] or [1]
        tap_layers = heads_config.tap_layers if heads_config is not None and kind == "eagle" else None
        draft = draft_costs(target, heads, tap_layers, prompt_1P, wanted, repeats)
    return StepCostTable(dtype=str(target.dtype).removeprefix("torch."), layout=target.layout,
                         threads=torch.get_num_threads(), prefix=prefix, verify_ms=verify, draft_ms=draft,
                         draft_kind=kind)


def _random_heads(target, kind: str, num_steps: int, draft_vocab_size: int):
    """Heads of the sizes a recipe trains, randomly initialised (their cost does not depend on weights)."""
    from specheads.heads.artefacts.heads_dir import build_heads, eagle_heads_config
    from specheads.heads.medusa import MedusaHeads

    if kind == "eagle":
        config = eagle_heads_config(target, num_steps=num_steps, draft_vocab_size=draft_vocab_size)
        return build_heads(config).eval().to(target.dtype), config
    heads = MedusaHeads(target.hidden_size, target.vocab_size, num_steps,
                        draft_vocab_size=min(draft_vocab_size, target.vocab_size))
    return heads.eval().to(target.dtype), None


def main(argv: list[str] | None = None) -> int:
    from specheads.runner import DTYPE_HELP, HEADS_HELP, TARGET_HELP, load_inference_target

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="embedded:smollm2", help=TARGET_HELP)
    p.add_argument("--heads", help=HEADS_HELP + " (default: random EAGLE-3 and Medusa heads of recipe size)")
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    p.add_argument("--prefix", type=int, default=300)
    p.add_argument("--trees", default=",".join(map(str, VERIFY_SIZES)))
    p.add_argument("--depths", default=",".join(map(str, DRAFT_DEPTHS)))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="the random heads' draft vocabulary (the recipes' size)")
    p.add_argument("--plain-weights", action="store_true",
                   help="measure the target's linear layers as transformers loaded them, not packed (the baseline)")
    args = p.parse_args(argv)
    target = load_inference_target(args.target, heads=[args.heads] if args.heads else [], dtype=args.dtype)
    trees = tuple(int(t) for t in args.trees.split(","))
    depths = tuple(int(d) for d in args.depths.split(","))
    if args.heads:
        from specheads.heads.artefacts.heads_dir import load_heads

        heads, config = load_heads(args.heads, target=target.identity, device=target.device, dtype=target.dtype)
        candidates = [(heads, config)]
    else:
        candidates = [_random_heads(target, kind, max(depths), args.draft_vocab) for kind in ("eagle", "medusa")]
    for index, (heads, config) in enumerate(candidates):
        table = measure_step_costs(target, heads, config, prefix=args.prefix, trees=trees, depths=depths,
                                   repeats=args.repeats, plain_weights=args.plain_weights)
        print(table.format(verify=index == 0))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
