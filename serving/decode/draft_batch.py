"""One decode step's drafts for the whole batch, on the target's device (`DraftBatch`), and
the one protocol every proposer of draft tokens follows (`Drafter`).

A row is one sequence's tree. Node 0 is its root, the token the target already chose; its
draft nodes follow, every parent before its children. Rows are padded to one node count T
with *invalid* nodes (`valid` False): padding, or a node left out this step (Medusa's AdaEDL
depth cut, an EAGLE-2 candidate that AdaEDL stopped, a lookup chain with no match, the heads'
nodes of a row whose chain goes alone, every draft node of a row that does not draft). An
invalid node is verified like the others but never accepted, and never anyone's child. Every
field is a device tensor and every shape is known on the host, so the accept step
(serving/decode/accept.py) reads nothing back.

Each drafter of a step returns its own tree for the rows; `DraftBatch.join` merges the chain
sources' chains (n-gram lookup, the reply store) into the heads' tree, one after the other in the
decoder's order. A chain follows the tree built so far from the root while its next token is a
valid child's there (that node becomes the chain's; the chain's own node is left in as an invalid
duplicate, so shapes stay static), and its remaining tokens hang below the last node it shares.
So a chain token that is one of the heads' candidates is one node, not two siblings: under
sampling a repeated sibling could never be accepted (the first took its mass), and under greedy
it would cost a node. Node order among siblings is the order in which the sampled accept rule
tries them: a static tree's rank order, then the chains' nodes. `on_chains` marks each chain's
nodes (its own and those it merged into), which the step counts for the per-source stats.

Shape legend: n rows, T nodes (padded), C most children of one node, L a chain's tokens, K the
chains joined, S the nodes of the tree built so far (join).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch

from specheads.serving.decode.trees import TreePlan


@dataclass
class DraftBatch:
    tokens: torch.Tensor  # [n, T] long target ids, node 0 = the root
    parents: torch.Tensor  # [n, T] long, parent node; the root and padding -1
    depths: torch.Tensor  # [n, T] long, depth = position offset from the root
    tree_mask: torch.Tensor  # [n, T, T] bool, node i attends to node j iff j is i or an ancestor of i
    valid: torch.Tensor  # [n, T] bool, False: a padding node or one left out this step (never accepted)
    max_depth: int  # the deepest node's depth over all rows (host): accept walks this many levels
    max_children: int  # C, the most children any node may have (host; sizes the sampled accept)
    is_chain: bool = False  # one row whose nodes form a chain: the causal mask is its tree mask
    alone: torch.Tensor | None = None  # [n] bool (a chain's): the heads' nodes are not needed in the row
    # [n, K, T] bool (join's, K chains): node t holds a token of chain k (its own valid node or the node it
    # merged into; never the root), for the per-source stats
    on_chains: torch.Tensor | None = None

    @property
    def num_nodes(self) -> int:
        """T, padding included."""
        return int(self.tokens.shape[1])

    @classmethod
    def from_plan(cls, plan: TreePlan, tokens_nT: torch.Tensor) -> "DraftBatch":
        """Every row with the same static tree: expanded views of the plan, no copies."""
        num_rows = int(tokens_nT.shape[0])
        return cls(tokens=tokens_nT, parents=plan.parents.expand(num_rows, -1),
                   depths=plan.position_offsets.expand(num_rows, -1),
                   tree_mask=plan.tree_mask.expand(num_rows, -1, -1), valid=plan.all_valid.expand(num_rows, -1),
                   max_depth=plan.max_depth, max_children=plan.max_children,
                   is_chain=plan.is_chain and num_rows == 1)

    @classmethod
    def roots(cls, roots_n: torch.Tensor) -> "DraftBatch":
        """Plain steps: every row its root alone ([n] long)."""
        num_rows, device = int(roots_n.shape[0]), roots_n.device
        return cls(tokens=roots_n.reshape(num_rows, 1), parents=torch.full((num_rows, 1), -1, device=device),
                   depths=torch.zeros(num_rows, 1, dtype=torch.long, device=device),
                   tree_mask=torch.ones(num_rows, 1, 1, dtype=torch.bool, device=device),
                   valid=torch.ones(num_rows, 1, dtype=torch.bool, device=device), max_depth=0, max_children=0,
                   is_chain=num_rows == 1)

    @classmethod
    def chain(cls, roots_n: torch.Tensor, tokens_nL: torch.Tensor, valid_nL: torch.Tensor,
              alone_n: torch.Tensor | None = None) -> "DraftBatch":
        """Each row's root followed by one chain of L tokens (valid_nL: which of them are drafted;
        a chain source's tree)."""
        num_rows, length = tokens_nL.shape
        device = tokens_nL.device
        nodes = torch.arange(length + 1, device=device)
        return cls(tokens=torch.cat([roots_n[:, None], tokens_nL], 1), parents=(nodes - 1).expand(num_rows, -1),
                   depths=nodes.expand(num_rows, -1),
                   tree_mask=torch.ones(length + 1, length + 1, dtype=torch.bool, device=device).tril()
                   .expand(num_rows, -1, -1),
                   valid=torch.cat([valid_nL.new_ones(num_rows, 1), valid_nL], 1), max_depth=int(length),
                   max_children=1, is_chain=num_rows == 1, alone=alone_n)

    def join(self, chains: list["DraftBatch"]) -> "DraftBatch":
        """This tree (the heads', or the roots alone) with each chain (a chain source's
        `DraftBatch.chain`) merged into the tree built so far, in order (module doc). A row that
        a chain marks `alone` keeps none of this tree's draft nodes (its chain is verified
        alone; the heads' candidates are not needed), so the chains merge under its root alone.
        Each chain's nodes take the next L node slots; where the chain merged, its own node is
        an invalid duplicate (static shapes)."""
        if not chains:
            return self
        if any(chain.max_children > 1 for chain in chains):
            raise ValueError("join merges chains (DraftBatch.chain), not trees")
        valid = self.valid
        for chain in chains:
            if chain.alone is not None and self.num_nodes > 1:
                valid = valid & ~(chain.alone[:, None] & (self.depths > 0))
        num_rows, size = int(self.tokens.shape[0]), self.num_nodes
        total = size + sum(chain.num_nodes - 1 for chain in chains)
        tree = DraftBatch(tokens=_pad(self.tokens, total - size, 0), parents=_pad(self.parents, total - size, -1),
                          depths=_pad(self.depths, total - size, 0),
                          tree_mask=torch.zeros(num_rows, total, total, dtype=torch.bool, device=self.tokens.device),
                          valid=_pad(valid, total - size, False),
                          max_depth=max([self.max_depth] + [chain.max_depth for chain in chains]),
                          max_children=self.max_children + len(chains),  # a chain adds at most one child to a node
                          is_chain=self.is_chain and size == 1 and len(chains) == 1 and chains[0].is_chain)
        tree.tree_mask[:, :size, :size] = self.tree_mask
        first_nT = _pad(_first_of_their_token(self.parents, self.tokens, valid), total - size, False)
        on_chains = []
        for chain in chains:
            on_chains.append(tree._merge(size, chain.tokens[:, 1:], chain.valid[:, 1:], first_nT))
            size += chain.num_nodes - 1
        tree.on_chains = torch.stack(on_chains, 1)
        return tree

    def _merge(self, size: int, chain_nL: torch.Tensor, chain_valid_nL: torch.Tensor,
               first_nT: torch.Tensor) -> torch.Tensor:
        """Merge one chain into this tree's first `size` nodes (the tree so far), writing its
        nodes into slots [size, size + L) (join) -> [n, T] bool, the nodes on the chain.

        The chain shares its first m tokens with the tree so far when a path from the root
        holds them, each node the first valid child of its parent with its token (first_nT:
        the nodes that are, updated here with the chain's own; a later sibling with the same
        token is never accepted under sampling). Those m nodes are the chain's; its own nodes
        1..m are invalid duplicates (under the shared node's parent), and its nodes m+1..L
        hang below the m-th shared node (the root when m = 0)."""
        length, device = int(chain_nL.shape[1]), chain_nL.device
        depths_nS, mask_nSS = self.depths[:, :size], self.tree_mask[:, :size, :size]
        in_chain_nS = (depths_nS >= 1) & (depths_nS <= length)
        at_nS = (depths_nS - 1).clamp(0, length - 1)  # the chain position a node at this depth would be
        same_nS = first_nT[:, :size] & in_chain_nS & (self.tokens[:, :size] == chain_nL.gather(1, at_nS)) \
            & chain_valid_nL.gather(1, at_nS)
        same_nS[:, 0] = True  # the root
        shared_nS = ~(mask_nSS & ~same_nS[:, None, :]).any(-1) & in_chain_nS  # its path is the chain's prefix
        shared_n = shared_nS.sum(-1)  # m: at most one shared node per depth, on one path
        # path_nX [n, L + 2]: the shared node at depth k (the root at 0); slot L + 1 takes the rest
        slot_nS = torch.where(shared_nS, depths_nS, length + 1)
        path_nX = torch.zeros(shared_n.shape[0], length + 2, dtype=torch.long, device=device)
        path_nX.scatter_(1, slot_nS, torch.arange(size, device=device).expand_as(slot_nS))
        position_L = torch.arange(1, length + 1, device=device)  # k, the chain position = depth
        merged_nL = position_L <= shared_n[:, None]
        own = slice(size, size + length)
        self.tokens[:, own], self.depths[:, own] = chain_nL, position_L.expand_as(chain_nL)
        self.valid[:, own] = chain_valid_nL & ~merged_nL
        first_nT[:, own] = self.valid[:, own]  # its own valid nodes are new tokens under their parents
        self.parents[:, own] = torch.where(position_L <= shared_n[:, None] + 1, path_nX.gather(1, (position_L - 1)
                                           .expand_as(chain_nL)), size + position_L - 2)
        # a node's mask row: the row of the shared node above it (its parent for a duplicate, the m-th for
        # the rest), then its own nodes from m + 1 down to itself (itself alone for a duplicate)
        above_nL = path_nX.gather(1, torch.minimum(position_L - 1, shared_n[:, None]))
        self.tree_mask[:, own] = self.tree_mask.gather(1, above_nL[:, :, None].expand(-1, -1, self.num_nodes))
        after_nL = position_L > shared_n[:, None]  # [n, L] the chain positions it does not share
        self.tree_mask[:, own, own] = torch.eye(length, dtype=torch.bool, device=device) \
            | (after_nL[:, None, :] & (position_L[None, :, None] >= position_L[None, None, :]))
        on_nT = torch.zeros_like(self.valid)
        on_nT[:, :size] = shared_nS
        on_nT[:, own] = self.valid[:, own]
        return on_nT

    def padded(self, num_nodes: int) -> "DraftBatch":
        """The same rows with invalid padding nodes up to num_nodes (>= T): a padding node
        sees only itself."""
        pad = num_nodes - self.num_nodes
        if pad < 0:
            raise ValueError(f"cannot pad {self.num_nodes} nodes to {num_nodes}")
        if pad == 0:
            return self
        num_rows, device = int(self.tokens.shape[0]), self.tokens.device
        mask = torch.eye(num_nodes, dtype=torch.bool, device=device).repeat(num_rows, 1, 1)
        mask[:, :self.num_nodes, :self.num_nodes] = self.tree_mask
        on_chains = None if self.on_chains is None else \
            torch.cat([self.on_chains, self.on_chains.new_zeros(num_rows, self.on_chains.shape[1], pad)], 2)
        return replace(self, tokens=_pad(self.tokens, pad, 0), parents=_pad(self.parents, pad, -1),
                       depths=_pad(self.depths, pad, 0), tree_mask=mask, valid=_pad(self.valid, pad, False),
                       is_chain=self.is_chain and num_rows == 1, on_chains=on_chains)

    def children(self) -> torch.Tensor:
        """[n, T, C] long: each node's valid children in node order, padded with -1."""
        num_rows, num_nodes, width = int(self.tokens.shape[0]), self.num_nodes, self.max_children
        device = self.tokens.device
        nodes_T = torch.arange(num_nodes, device=device)
        is_child_nTT = (self.parents[:, None, :] == nodes_T[None, :, None]) & self.valid[:, None, :]  # [n, parent, child]
        slot_nTT = torch.where(is_child_nTT, is_child_nTT.long().cumsum(-1) - 1, width)  # width: the dump slot
        table = torch.full((num_rows, num_nodes, width + 1), -1, dtype=torch.long, device=device)
        table.scatter_(2, slot_nTT, nodes_T.expand(num_rows, num_nodes, -1))
        return table[..., :width]


def _pad(values_nT: torch.Tensor, pad: int, fill) -> torch.Tensor:
    return torch.cat([values_nT, values_nT.new_full((values_nT.shape[0], pad), fill)], 1)


def _first_of_their_token(parents_nT: torch.Tensor, tokens_nT: torch.Tensor, valid_nT: torch.Tensor) -> torch.Tensor:
    """[n, T] bool: the valid nodes that no earlier valid sibling has the token of (the one a
    walk down the tree takes for that token; a repeat is never accepted)."""
    num_nodes = int(tokens_nT.shape[1])
    earlier_TT = torch.ones(num_nodes, num_nodes, dtype=torch.bool, device=tokens_nT.device).tril(-1)
    repeat_nTT = (parents_nT[:, :, None] == parents_nT[:, None, :]) & (tokens_nT[:, :, None] == tokens_nT[:, None, :]) \
        & valid_nT[:, None, :] & earlier_TT
    return valid_nT & ~repeat_nTT.any(-1)


class Drafter(Protocol):
    """What the decode step (serving/decode/steps.py `DeviceStep`) asks of every proposer of
    draft tokens: the heads (serving/decode/medusa.py, eagle.py: a tree) and the chain sources
    (n-gram lookup, serving/decode/lookup.py; the reply store, serving/decode/store.py: one
    chain). The step never branches on the kind.

    A decoder's drafter is shared by its engines; `attach` gives each engine its own copy,
    which keeps the per-sequence state in tensors with one row per engine row that move with
    the cache's rows (`TreeStaticCache.follow`). `draft` and `observe` run inside the warm
    step: tensor operations on the target's device, no host data, no read (they may be
    compiled). `prepare` is the host's part before a step. `start` runs when a sequence joins.
    """

    name: str  # "heads", or a chain source's name (serving/decode/stats.py CHAIN_SOURCES)
    num_nodes: int  # nodes of its tree, root included (sizes the cache and the step's tree)
    max_depth: int  # its deepest node
    max_children: int  # the most children of one of its nodes
    num_notes: int  # k, the values per row its observe sends to the host (0: none)
    lookahead: int  # its state at a position reads the tokens up to this many positions after it

    def attach(self, cache, max_cache_len: int) -> "Drafter":
        """A copy of this drafter for one engine: per-row state for the cache's rows, on the
        target's device, following the cache's rows (the models and tree plans are shared)."""

    def start(self, row: int, prefilled) -> torch.Tensor | None:
        """A sequence took row `row` (its prefill: serving/decode/steps.py `Prefilled`) -> its
        first note for the host ([k] long, read with the prefill's token), or None."""

    def prepare(self, seqs: list, drafting: list[bool]) -> list[int]:
        """On the host, before a step: for each sequence (its `notes` hold what this drafter's
        last `observe` sent back), 0: nothing to propose, 1: a proposal, 2: a proposal that
        goes alone (the heads' draft is not needed for it). `drafting`: which of them draft."""

    def draft(self, rows: slice, roots_n: torch.Tensor, lens_n: torch.Tensor, key_bound: int) -> DraftBatch:
        """The rows' trees under their roots [n]; lens_n: their committed lengths (device);
        key_bound: the positions an attention over a row's cache may need (a host bound). A chain
        source's draft takes one more argument, num_tokens: the chain's length this step (its
        `step_tokens`, which `prepare` sets: the longest chain it proposes, so the verify spends no
        node on padding; or its full num_tokens where the step's shapes are fixed)."""

    def observe(self, rows: slice, taps_nTX: torch.Tensor, path_nW: torch.Tensor, num_nodes_n: torch.Tensor,
                emitted_nW: torch.Tensor, lens_n: torch.Tensor, key_bound: int) -> torch.Tensor | None:
        """What the step accepted (before the commit): the verify's taps at every node, each row's
        accepted path, count and emitted tokens; lens_n the committed lengths before it. Writes
        the drafter's state for the next step -> notes for the host [n, k] long, or None."""

    def finish(self, seq) -> None:
        """seq ended well (finish reason stop or length) in this engine: what the drafter may
        learn from its reply (the reply store learns it: serving/decode/learned_store.py)."""
