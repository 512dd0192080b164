"""One decode step's drafts for the whole batch, on the target's device: `DraftBatch`.

Every drafter (Medusa heads, EAGLE heads with a static or an EAGLE-2 tree) returns one for
the rows it drafts; the engine pads in the rows that do not draft (their root alone), adds
the chains of the chain sources (n-gram lookup, the reply store: `with_chains`), verifies it
in one forward and accepts from it
(serving/decode/accept.py). The accept step reads nothing back to the host: every field it
needs is a device tensor and every shape is known on the host, so a whole step costs one
device-to-host copy (the accepted tokens) and can be captured.

A row is one sequence's tree. Node 0 is its root, the token the target already chose; its
draft nodes follow, every parent before its children. Rows are padded to one node count T
with *invalid* nodes (`valid` False): padding, or a node a drafter left out this step
(Medusa's AdaEDL depth cut, an EAGLE-2 candidate that AdaEDL stopped). An invalid node is
verified like the others but never accepted, and never anyone's child.

Node order among siblings is the order in which they are tried by the sampled accept rule
(serving/decode/accept.py): a static tree's rank order, and the chains (lookup's, then the
store's) after the heads' candidates.

Shape legend: n rows, T nodes (padded), C most children of one node, E chain nodes added to a row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    heads_drafted: list[bool] | None = None  # [n] the heads drafted the row (None: every row)
    # [n][S] per row and chain source (with_chains): (first node, length) of its chain, None for none
    chain_spans: list[list[tuple[int, int] | None]] | None = None

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

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
                   is_chain=num_rows == 1, heads_drafted=[False] * num_rows)

    def padded(self, num_nodes: int) -> "DraftBatch":
        """The same rows with invalid padding nodes up to num_nodes (>= T): a padding node
        sees only itself."""
        pad = num_nodes - self.num_nodes
        if pad < 0:
            raise ValueError(f"cannot pad {self.num_nodes} nodes to {num_nodes}")
        if pad == 0:
            return self
        num_rows, device = self.num_rows, self.tokens.device
        mask = torch.eye(num_nodes, dtype=torch.bool, device=device).repeat(num_rows, 1, 1)
        mask[:, :self.num_nodes, :self.num_nodes] = self.tree_mask
        return replace(self, tokens=_pad(self.tokens, pad, 0), parents=_pad(self.parents, pad, -1),
                       depths=_pad(self.depths, pad, 0), tree_mask=mask, valid=_pad(self.valid, pad, False),
                       is_chain=self.is_chain and num_rows == 1)

    def rows(self, indices: list[int]) -> "DraftBatch":
        """The given rows, in that order."""
        index = torch.tensor(indices, dtype=torch.long, device=self.tokens.device)
        pick = (lambda values: None if values is None else [values[i] for i in indices])
        return replace(self, tokens=self.tokens.index_select(0, index), parents=self.parents.index_select(0, index),
                       depths=self.depths.index_select(0, index), tree_mask=self.tree_mask.index_select(0, index),
                       valid=self.valid.index_select(0, index), is_chain=self.is_chain and len(indices) == 1,
                       heads_drafted=pick(self.heads_drafted), chain_spans=pick(self.chain_spans))

    @classmethod
    def merge(cls, base: "DraftBatch", drafted: "DraftBatch | None", rows: list[int]) -> "DraftBatch":
        """base's rows with `drafted`'s rows in their places (drafted row i -> row rows[i]),
        padded to the larger node count. base: every row's plain draft (`roots`)."""
        if drafted is None or not rows:
            return base
        if len(rows) == base.num_rows:  # every row drafted, in order
            return replace(drafted, heads_drafted=[True] * len(rows))
        num_nodes = drafted.num_nodes
        merged = base.padded(num_nodes)
        index = torch.tensor(rows, dtype=torch.long, device=base.tokens.device)
        for name in ("tokens", "parents", "depths", "tree_mask", "valid"):
            getattr(merged, name).index_copy_(0, index, getattr(drafted, name))
        heads_drafted = list(base.heads_drafted)
        for row in rows:
            heads_drafted[row] = True
        return replace(merged, max_depth=drafted.max_depth, max_children=drafted.max_children, is_chain=False,
                       heads_drafted=heads_drafted)

    def with_chains(self, chains: list[list[list[int]]]) -> "DraftBatch":
        """Each row's chains (chains[row][source]: target ids, [] for none; serving/decode/lookup.py
        `ChainSource`) as branches under its root, after its heads' nodes, in source order: the
        root's last children, so the sampled accept tries them after the heads' candidates. A
        row's chains follow one another from node T on; a chain that an earlier chain of the row
        starts with (or repeats) adds no path and is left out. Rows are padded with invalid
        nodes to the longest row. chain_spans[row][source] records where each chain went."""
        num_rows, num_base, device = self.num_rows, self.num_nodes, self.tokens.device
        spans: list[list[tuple[int, int] | None]] = []
        rows: list[list[tuple[int, int, int, int]]] = []  # (token, parent, depth, chain) per added node
        for row_chains in chains:
            row_spans, nodes, kept = [], [], []
            for chain in row_chains:
                if not chain or any(earlier[:len(chain)] == chain for earlier in kept):
                    row_spans.append(None)
                    continue
                first = num_base + len(nodes)
                nodes += [(token, first + step - 1 if step else 0, step + 1, len(kept))
                          for step, token in enumerate(chain)]
                row_spans.append((first, len(chain)))
                kept.append(list(chain))
            spans.append(row_spans)
            rows.append(nodes)
        width = max(len(nodes) for nodes in rows)
        if width == 0:
            return self
        num_nodes = num_base + width
        # padding: token 0, no parent, depth 0, a chain of its own (it sees only itself)
        table = torch.tensor([[list(node) for node in nodes]
                              + [[0, -1, 0, -1 - pad] for pad in range(width - len(nodes))] for nodes in rows],
                             dtype=torch.long, device=device)  # [n, E, 4]
        tokens_nE, parents_nE, depths_nE, chain_nE = table.unbind(-1)
        valid_nE = parents_nE >= 0
        mask = torch.zeros(num_rows, num_nodes, num_nodes, dtype=torch.bool, device=device)
        mask[:, :num_base, :num_base] = self.tree_mask
        mask[:, num_base:, 0] = valid_nE
        # a chain node attends to its own chain's nodes up to its depth (its ancestors and itself)
        mask[:, num_base:, num_base:] = (chain_nE[:, :, None] == chain_nE[:, None, :]) \
            & (depths_nE[:, None, :] <= depths_nE[:, :, None])
        most_chains = max(sum(span is not None for span in row_spans) for row_spans in spans)
        return replace(
            self, tokens=torch.cat([self.tokens, tokens_nE], 1), parents=torch.cat([self.parents, parents_nE], 1),
            depths=torch.cat([self.depths, depths_nE], 1), tree_mask=mask, valid=torch.cat([self.valid, valid_nE], 1),
            max_depth=max(self.max_depth, max(len(chain) for row_chains in chains for chain in row_chains)),
            max_children=self.max_children + most_chains,
            is_chain=self.is_chain and num_base == 1 and most_chains == 1, chain_spans=spans)

    def children(self) -> torch.Tensor:
        """[n, T, C] long: each node's valid children in node order, padded with -1."""
        num_rows, num_nodes, width = self.num_rows, self.num_nodes, self.max_children
        device = self.tokens.device
        nodes_T = torch.arange(num_nodes, device=device)
        is_child_nTT = (self.parents[:, None, :] == nodes_T[None, :, None]) & self.valid[:, None, :]  # [n, parent, child]
        slot_nTT = torch.where(is_child_nTT, is_child_nTT.long().cumsum(-1) - 1, width)  # width: the dump slot
        table = torch.full((num_rows, num_nodes, width + 1), -1, dtype=torch.long, device=device)
        table.scatter_(2, slot_nTT, nodes_T.expand(num_rows, num_nodes, -1))
        return table[..., :width]


def _pad(values_nT: torch.Tensor, pad: int, fill) -> torch.Tensor:
    return torch.cat([values_nT, values_nT.new_full((values_nT.shape[0], pad), fill)], 1)
