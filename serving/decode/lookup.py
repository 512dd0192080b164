"""N-gram lookup drafts from the sequence's own context, alone or as one more tree branch.

Prompt-lookup decoding (vLLM's `ngram` method, HF `prompt_lookup_num_tokens`) drafts the
tokens that followed the last occurrence of the context's final n-gram. It costs no model
forward, so it wins wherever text repeats (code, retrieval, summaries quoting their source,
and the loops of small models' greedy outputs), and it drafts nothing elsewhere. Heads are
the other way round. The engine combines them per step (`LookupConfig`):

- a match of at least `alone_at_ngram` tokens: the step verifies the lookup chain alone and
  skips the heads' draft (on a CPU an EAGLE draft costs about a target step);
- a shorter match: the heads' tree plus the lookup chain as one more branch under the root;
- no match: the heads' tree alone (or, without heads, a plain step).
Verification and acceptance are unchanged, so greedy output is still the target's own.
Sampled requests use it too: a lookup token is a candidate fixed in advance (a point-mass
draft), exactly like the heads' top-k candidates, so the tree's recursive rejection
sampling (serving/decode/sampling.py) keeps the target's distribution; the chain is the root's
last child, tried after the heads' candidates. The proposal depends only on the tokens, so
a seed still gives the same output.

`NgramIndex` keeps, per n-gram (n <= max_ngram) of the context, where its most recent
continuation starts, updated as tokens arrive (O(max_ngram) per token). A proposal copies
from there; when the copy reaches the end of the context it goes on copying its own output,
so a loop of period p is drafted for as long as asked (the match just before the suffix is
exactly p back).

`with_lookup_chain(tree, L)` appends the chain to a tree as nodes T..T+L-1, child of the root
and of each other. That breaks DraftTree's (depth, path) node order, but not what verify
and accept need: every parent comes before its children.

Shape legend: T tree nodes of the heads' draft, L lookup tokens, D max depth.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from specheads.serving.decode.trees import DraftTree


@dataclass(frozen=True)
class LookupConfig:
    """num_tokens: the longest chain drafted; n-grams of max_ngram down to min_ngram tokens are
    looked up (longest first); alone_at_ngram: a match at least this long skips the heads'
    draft for the step ("max": max_ngram; None: heads always draft too)."""

    num_tokens: int = 10
    max_ngram: int = 3
    min_ngram: int = 1
    alone_at_ngram: int | str | None = "max"

    def __post_init__(self):
        for name in ("num_tokens", "max_ngram", "min_ngram"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"lookup {name} must be an int >= 1, got {value!r}")
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"lookup min_ngram ({self.min_ngram}) must be <= max_ngram ({self.max_ngram})")
        if self.alone_at_ngram == "max":
            object.__setattr__(self, "alone_at_ngram", self.max_ngram)
        alone = self.alone_at_ngram
        if alone is not None and (isinstance(alone, bool) or not isinstance(alone, int)
                                  or not self.min_ngram <= alone <= self.max_ngram):
            raise ValueError(f"lookup alone_at_ngram must be 'max', None or an int in [min_ngram, max_ngram] = "
                             f"[{self.min_ngram}, {self.max_ngram}], got {alone!r}")


class NgramIndex:
    """One sequence's context (prompt + output so far) and its n-gram continuation index."""

    def __init__(self, config: LookupConfig, tokens: list[int] | None = None):
        self.config = config
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> start of its latest continuation
        self.extend(tokens or [])

    def extend(self, new_tokens: list[int]) -> None:
        tokens, index, max_n = self.tokens, self._next, self.config.max_ngram
        for token in new_tokens:
            end = len(tokens)  # the n-grams ending here are now followed by `token`
            for n in range(1, min(max_n, end) + 1):
                index[tuple(tokens[end - n:end])] = end
            tokens.append(int(token))

    def propose(self) -> tuple[list[int], int]:
        """-> (up to num_tokens drafted tokens, the matched n-gram's length); ([], 0) if none."""
        tokens, config = self.tokens, self.config
        for n in range(min(config.max_ngram, len(tokens)), config.min_ngram - 1, -1):
            start = self._next.get(tuple(tokens[-n:]))
            if start is None:
                continue
            context_len = len(tokens)
            draft: list[int] = []
            for offset in range(config.num_tokens):
                position = start + offset
                draft.append(tokens[position] if position < context_len else draft[position - context_len])
            return draft, n
        return [], 0


def with_lookup_chain(tree: DraftTree, length: int) -> DraftTree:
    """`tree` plus a chain of `length` nodes under the root (nodes T..T+L-1, rank max_rank+1
    at depth 1, so its rank paths stay distinct)."""
    if length < 1:
        raise ValueError(f"a lookup chain needs at least one token, got {length}")
    num_base = tree.num_nodes
    num_nodes = num_base + length
    chain = torch.arange(num_base, num_nodes)
    parents = torch.cat([tree.parents, torch.cat([torch.zeros(1, dtype=torch.long), chain[:-1]])])
    depths = torch.cat([tree.depths, torch.arange(1, length + 1)])
    first_rank = tree.max_rank + 1
    ranks = torch.cat([tree.ranks, torch.tensor([first_rank] + [0] * (length - 1), dtype=torch.long)])
    tree_mask = torch.zeros(num_nodes, num_nodes, dtype=torch.bool)
    tree_mask[:num_base, :num_base] = tree.tree_mask
    tree_mask[num_base:, 0] = True
    tree_mask[num_base:, num_base:] = torch.ones(length, length, dtype=torch.bool).tril()
    max_depth = max(tree.max_depth, length)
    base_leaves = tree.leaf_paths if num_base > 1 else tree.leaf_paths[:0]  # the root is a parent now
    leaf_paths = torch.full((base_leaves.shape[0] + 1, max_depth + 1), -1, dtype=torch.long)
    leaf_paths[:base_leaves.shape[0], :base_leaves.shape[1]] = base_leaves
    leaf_paths[-1, :length + 1] = torch.cat([torch.zeros(1, dtype=torch.long), chain])
    chain_paths = tuple((first_rank,) + (0,) * i for i in range(length))
    return DraftTree(rank_paths=tree.rank_paths + chain_paths, parents=parents, depths=depths, ranks=ranks,
                     tree_mask=tree_mask, position_offsets=depths.clone(), leaf_paths=leaf_paths)


def lookup_from_tree_field(tree: dict | None) -> LookupConfig | None:
    """The lookup a heads directory's `tree` records (`{"lookup": {"num_tokens": 10, ...}}`,
    written by `specheads tune` when lookup made the tuned tree faster), or None."""
    spec = (tree or {}).get("lookup")
    if spec is None:
        return None
    allowed = [f.name for f in fields(LookupConfig)]
    if not isinstance(spec, dict) or set(spec) - set(allowed):
        raise ValueError(f"the heads tree's 'lookup' must be an object with keys from {allowed}, got {spec!r}")
    return LookupConfig(**spec)
