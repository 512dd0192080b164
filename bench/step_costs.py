"""What one speculative step costs on this machine: verify forwards of T tree tokens against
one decode step, and the heads' draft cost per depth. These numbers decide which trees can
pay (a tree of T nodes must emit more than cost(T) / cost(1) tokens per step).

    python -m specheads.bench.step_costs --target embedded:smollm2 [--prefix 300] [--trees 1,4,8,16,32,64]

Everything runs through the serving path: the target adapter over a `TreeStaticCache` after
a prefill of `--prefix` tokens, a 4-D tree mask, and the real drafters (an EAGLE-3 head and
Medusa heads of the sizes a recipe trains, randomly initialised: their cost does not depend
on their weights). Each figure is the median of `--repeats` timed calls after one warm-up.
Run it alone: two busy cores make every figure meaningless.
"""

from __future__ import annotations

import argparse

import torch

from specheads.bench.gpu_kernels import time_ms


def verify_costs(decoder, state, trees: list[int], repeats: int) -> dict[int, float]:
    """ms of one verify forward of T chain tokens (a 4-D mask, as for a tree) per T."""
    target, cache = decoder.target, state.cache
    costs = {}
    for num_nodes in trees:
        tokens_1T = torch.full((1, num_nodes), int(state.root), dtype=torch.long)
        mask = cache.attention_mask(torch.ones(num_nodes, num_nodes, dtype=torch.bool).tril())
        positions = (torch.arange(num_nodes) + state.prefix_len)[None]
        with torch.inference_mode():
            costs[num_nodes] = time_ms(lambda: target(tokens_1T, decoder.tap_layers, attention_mask=mask,
                                                      position_ids=positions, past_key_values=cache,
                                                      use_cache=True), target.device, 1, repeats)
    return costs


def eagle_draft_costs(target, prompt_1P: torch.Tensor, depths: list[int], repeats: int,
                      draft_vocab_size: int) -> dict[int, float]:
    """ms of one EAGLE-3 chain draft of each depth (one head run per level), in steady state."""
    from specheads.heads.heads_dir import build_heads, eagle_heads_config
    from specheads.serving.decode.cache import TreeStaticCache
    from specheads.serving.decode.config import SpeculativeDecoder
    from specheads.serving.decode.steps import prefill
    from specheads.serving.decode.trees import DraftTree

    config = eagle_heads_config(target, num_steps=max(depths), draft_vocab_size=draft_vocab_size)
    head = build_heads(config).eval()
    costs = {}
    for depth in depths:
        decoder = SpeculativeDecoder(target, head, DraftTree.chain(depth), tap_layers=config.tap_layers)
        with torch.inference_mode():
            state = prefill(target, prompt_1P, decoder.tap_layers,
                            TreeStaticCache(target.config, max_cache_len=prompt_1P.shape[1] + 128))
            _, state.draft_cache = decoder.drafter.draft(state)  # the head's first run covers the whole prompt
            # Steady state: one new committed position per step (a step that accepted nothing).
            state.hidden, state.next_tokens = state.hidden[-1:], state.next_tokens[-1:]
            costs[depth] = time_ms(lambda: decoder.drafter.draft(state), target.device, 1, repeats)
    return costs


def main(argv: list[str] | None = None) -> int:
    from specheads.heads.medusa import MedusaHeads
    from specheads.heads.target import TargetAdapter
    from specheads.runner import resolve_target_name
    from specheads.serving.decode.cache import TreeStaticCache
    from specheads.serving.decode.config import SpeculativeDecoder
    from specheads.serving.decode.steps import prefill
    from specheads.serving.decode.trees import DraftTree

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="embedded:smollm2")
    p.add_argument("--prefix", type=int, default=300)
    p.add_argument("--trees", default="1,4,8,16,32,64")
    p.add_argument("--depths", default="1,2,3,4,5,6")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--draft-vocab", type=int, default=8192, help="the heads' draft vocabulary (the recipes' size)")
    args = p.parse_args(argv)
    target = TargetAdapter.from_pretrained(resolve_target_name(args.target))
    plain = SpeculativeDecoder(target)
    prompt_1P = torch.randint(10, target.vocab_size, (1, args.prefix), generator=torch.Generator().manual_seed(0))
    trees = [int(t) for t in args.trees.split(",")]
    with torch.inference_mode():
        state = prefill(target, prompt_1P, plain.tap_layers,
                        TreeStaticCache(target.config, max_cache_len=args.prefix + max(trees) + 8))
    verify = verify_costs(plain, state, trees, args.repeats)
    print(f"verify after a {args.prefix}-token prefix, {torch.get_num_threads()} threads:")
    for num_nodes, ms in verify.items():
        print(f"  T={num_nodes:3d}  {ms:8.1f} ms  {ms / verify[trees[0]]:5.2f}x T={trees[0]}")
    depths = [int(d) for d in args.depths.split(",")]
    print(f"EAGLE-3 draft (one decoder layer, chain, {args.draft_vocab} draft vocab):")
    for depth, ms in eagle_draft_costs(target, prompt_1P, depths, args.repeats, args.draft_vocab).items():
        print(f"  depth {depth}  {ms:7.1f} ms")
    hidden_1H, root_1 = state.hidden[-1:], state.root
    for vocab in sorted({target.vocab_size, min(args.draft_vocab, target.vocab_size)}, reverse=True):
        heads = MedusaHeads(target.hidden_size, target.vocab_size, max(depths), draft_vocab_size=vocab)
        medusa = SpeculativeDecoder(target, heads, DraftTree.chain(max(depths)))
        with torch.inference_mode():
            ms = time_ms(lambda: medusa.drafter.draft_tokens(hidden_1H, root_1), target.device, 1, args.repeats)
        print(f"Medusa draft ({max(depths)} heads over {heads.draft_vocab_size} tokens, one call): {ms:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
