"""The accept step for a whole batch, as tensor operations on the target's device.

One call, `accept`, turns a step's drafts (serving/decode/draft_batch.py `DraftBatch`) and
the target's verify logits into each row's accepted path and emitted tokens (`Accepted`),
without reading anything back to the host and without any host data: which rule a row uses
and its sampling parameters are device tensors (`RowSampling`, `RowRules`). The decode step
(serving/decode/steps.py) commits from it on the device and reads it back once
(`HostAccepted`: the tokens the engine streams).

Rules (the definitions of accepted, recovered and bonus tokens are serving/decode/sampling.py's):
- greedy: a draft node is correct when its token is the target's argmax at its parent; the
  accepted path ends at the deepest node whose every ancestor (itself included) is correct,
  the lowest-numbered such node on a tie (a tie needs two siblings with one token: a lookup
  chain that repeats a head's candidate; both paths emit the same tokens). The final token
  is the target's argmax at that node (the bonus token).
- rejection (sampled, lossless): a walk from the root, one level per tree depth for all rows
  at once. At node n with children x_1..x_m (node order), x_i is accepted with probability
  p_i(x_i) = p(x_i) / (1 - mass of the distinct tokens rejected before it) (0 for a repeat);
  the first accepted child is the next node, where the walk continues with that child's own
  distribution. When every child is rejected the final token (recovered) is sampled from p
  with every child token zeroed; at a leaf (bonus) from p itself. This is SpecInfer's
  multi-draft rule for candidates fixed in advance; the output follows the target exactly.
- typical (Medusa-2's, lossy, only by name): a node is correct when its parent's processed
  probability of its token exceeds min(posterior_threshold, posterior_alpha * exp(-H(parent))),
  the path rule is greedy's, and the final token is sampled from the last node's distribution.

Randomness: each sampled row draws its uniforms in one call per step from its own generator
(the request's seed) or the global RNG, float64, on the generator's device (`draw_uniforms`,
before the step: a generator is host state that a compiled step cannot hold): an acceptance
test per (level, child slot) of the decoder's largest tree (`uniform_shape`), and one for
the final token (typical acceptance uses that last one). The count depends on the decoder
alone, not on the batch, so a seeded request gives the same output alone and in any batch.

Logits that give no distribution (NaN, +inf, every one -inf) mark the row `bad`; the engine
ends that sequence with an error after the copy to the host (serving/decode/engine.py).

Shape legend: n rows, T nodes, V vocab, D the batch's deepest draft level, C most children.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specheads.serving.decode.draft_batch import DraftBatch
from specheads.serving.decode.sampling import (GREEDY_BELOW_TEMPERATURE, RowSampling, SamplingParams,
                                               TypicalAcceptance, row_probs, sample_rows)
from specheads.serving.decode.trees import DraftTree, TreePlan

NO_DISTRIBUTION = "the target's logits give no distribution to sample from (NaN, +inf, or every logit -inf)"


@dataclass
class Accepted:
    """Each row's accepted step, on the device; entries past a row's count are padding."""

    path: torch.Tensor  # [n, D+1] long, accepted node indices, root first
    num_nodes: torch.Tensor  # [n] long, A: accepted nodes (root included) = tokens emitted
    emitted: torch.Tensor  # [n, D+1] long, the accepted draft tokens, then the final token at A-1
    depth: torch.Tensor  # [n] long, the row's drafted depth (its deepest valid node; 0: a plain step)
    bad: torch.Tensor  # [n] bool, the row's logits gave no distribution (its sequence fails)


@dataclass
class HostAccepted:
    """One row of a step, read back to the host."""

    path: list[int]  # [A] accepted node indices, root first
    emitted: list[int]  # [A] tokens emitted: accepted draft tokens + the final token
    depth: int  # drafted depth
    bad: bool
    chains: dict[str, int]  # per chain the row verified (by its drafter's name): its accepted tokens
    notes: dict[str, list[int]]  # per drafter that sent some: its notes (serving/decode/draft_batch.py Drafter)
    width: int  # W, the step's path width
    logprobs: list[float] | None = None  # W positions' packed logprobs (serving/decode/logprobs.py)


@dataclass
class RowRules:
    """Which accept rule each row uses (device masks), and the host facts that pick the code."""

    sampling: RowSampling
    rejection: torch.Tensor  # [n] bool, lossless tree rejection sampling
    typical: torch.Tensor  # [n] bool, typical acceptance (lossy)
    any_rejection: bool
    any_typical: bool


def accept(drafts: DraftBatch, logits_nTV: torch.Tensor, target_tokens_nT: torch.Tensor,
           rules: RowRules | None = None, uniforms_nU: torch.Tensor | None = None,
           uniform_shape: tuple[int, int] | None = None,
           typical: TypicalAcceptance = TypicalAcceptance()) -> Accepted:
    """Every row's accepted path (module doc). rules None: every row greedy; otherwise each row
    by its rule, with uniforms_nU from `draw_uniforms` (greedy rows' are never read).
    target_tokens: the greedy argmax of the logits (serving/decode/steps.py greedy_tokens).
    uniform_shape: see accept_rejection."""
    if drafts.max_depth == 0:  # plain steps: the target's token
        accepted = _root_only(target_tokens_nT[:, 0])
    else:  # greedy (module doc): a node is correct when its token is the target's argmax at its parent
        parent_tokens_nT = target_tokens_nT.gather(1, drafts.parents.clamp(min=0))
        end_n = _deepest_accepted(drafts, (drafts.tokens == parent_tokens_nT) & drafts.valid)
        accepted = _path_to(drafts, end_n, target_tokens_nT.gather(1, end_n[:, None])[:, 0])
    if rules is not None and rules.any_rejection:
        sampled = accept_rejection(drafts, logits_nTV, rules.sampling, uniforms_nU, uniform_shape)
        accepted = _choose(rules.rejection, sampled, accepted)
    if rules is not None and rules.any_typical:
        accepted = _choose(rules.typical, accept_typical(drafts, logits_nTV, rules.sampling, uniforms_nU[:, -1],
                                                         typical), accepted)
    return accepted


def draw_uniforms(generators: list[torch.Generator | None], sampled: list[bool], uniform_shape: tuple[int, int],
                  device: torch.device) -> torch.Tensor:
    """[n, (levels + 1) * slots + 1] float64 uniforms for a step (module doc, "Randomness"):
    each sampled row's from its own generator (None: the global RNG), zeros for the others."""
    levels, slots = uniform_shape
    count = (levels + 1) * slots + 1
    rows = [torch.rand(count, generator=gen, dtype=torch.float64, device=device if gen is None else gen.device)
            if draws else torch.zeros(count, dtype=torch.float64, device=device)
            for gen, draws in zip(generators, sampled)]
    return torch.stack(rows)


@dataclass
class TreeSample:
    """One tree's sampled accept (`accept_tree_sampling`)."""

    nodes: torch.Tensor  # [A] long, accepted node indices, root first
    emitted: list[int]  # accepted draft tokens + the final (bonus or recovered) token: A tokens
    final_kind: str  # "bonus" (the last accepted node is a leaf) | "recovered" (all its children rejected)
    lossless: bool  # False only for mode="typical"

    @property
    def num_accepted(self) -> int:
        """Accepted draft tokens (root excluded)."""
        return len(self.emitted) - 1


def accept_tree_sampling(tree: DraftTree, tree_tokens_T: torch.Tensor, target_logits_TV: torch.Tensor,
                         params: SamplingParams, generator: torch.Generator | None = None, *,
                         mode: str = "rejection", typical: TypicalAcceptance = TypicalAcceptance()) -> TreeSample:
    """One static tree's sampled accept (what `accept` does for a row): tree_tokens [T] long
    (node 0 = root), candidates fixed in advance; target_logits [T, V]. mode: "rejection"
    (lossless) | "typical" (lossy). params must sample (not greedy)."""
    num_nodes = tree.num_nodes
    if tree_tokens_T.shape != (num_nodes,) or target_logits_TV.dim() != 2 or target_logits_TV.shape[0] != num_nodes:
        raise ValueError(f"need tree_tokens [T] and target_logits [T, V] with T = {num_nodes}, got "
                         f"{tuple(tree_tokens_T.shape)} and {tuple(target_logits_TV.shape)}")
    if mode not in ("rejection", "typical"):
        raise ValueError(f"mode must be 'rejection' (lossless) or 'typical' (lossy), got {mode!r}")
    if params.is_greedy:
        raise ValueError(f"temperature {params.temperature!r} decodes greedily, which accept_greedy accepts; "
                         f"sampled acceptance needs a temperature >= {GREEDY_BELOW_TEMPERATURE}")
    device = target_logits_TV.device
    drafts = DraftBatch.from_plan(TreePlan(tree, device), tree_tokens_T[None])
    rows = RowSampling.of([params], device)
    if mode == "rejection":
        uniforms = draw_uniforms([generator], [True], (drafts.max_depth, drafts.max_children), device)
        sampled = accept_rejection(drafts, target_logits_TV[None], rows, uniforms)
    else:
        uniforms = draw_uniforms([generator], [True], (0, 0), device)
        sampled = accept_typical(drafts, target_logits_TV[None], rows, uniforms[:, -1], typical)
    if bool(sampled.bad[0]):
        raise ValueError(NO_DISTRIBUTION)
    count = int(sampled.num_nodes[0])
    nodes = sampled.path[0, :count]
    return TreeSample(nodes=nodes, emitted=sampled.emitted[0, :count].tolist(),
                      final_kind="recovered" if int(nodes[-1]) in tree.parents.tolist() else "bonus",
                      lossless=mode == "rejection")


def accept_greedy(drafts: DraftBatch, target_tokens_nT: torch.Tensor) -> Accepted:
    """Greedy acceptance (module doc) alone -> the rows' accepted paths and bonus tokens."""
    return accept(drafts, None, target_tokens_nT)


def accept_rejection(drafts: DraftBatch, logits_nTV: torch.Tensor, rows: RowSampling, uniforms_nU: torch.Tensor,
                     uniform_shape: tuple[int, int] | None = None) -> Accepted:
    """Lossless tree rejection sampling (module doc), every row at once, one level per depth.
    uniforms_nU: `draw_uniforms` of uniform_shape, (levels, children) at least the drafts'
    (max_depth, max_children), default exactly those: a decoder passes its largest tree's, so
    that a seeded row draws the same numbers alone and in any batch."""
    num_rows, num_levels, width = int(logits_nTV.shape[0]), drafts.max_depth, drafts.max_children
    levels, slots = uniform_shape or (num_levels, width)
    if levels < num_levels or slots < width:
        raise ValueError(f"uniform_shape {(levels, slots)} is smaller than the drafts' {(num_levels, width)}")
    device = logits_nTV.device
    tests_nDC = uniforms_nU[:, :-1].reshape(num_rows, levels + 1, slots)[:, :num_levels + 1, :width]
    u_final_n = uniforms_nU[:, -1]
    rows_n = torch.arange(num_rows, device=device)
    node_n = torch.zeros(num_rows, dtype=torch.long, device=device)
    done_n = torch.zeros(num_rows, dtype=torch.bool, device=device)
    final_n = torch.zeros(num_rows, dtype=torch.long, device=device)
    bad_n = torch.zeros(num_rows, dtype=torch.bool, device=device)
    children_nTC = drafts.children() if width else None
    for level in range(num_levels + 1):
        probs_nV, bad_now_n = row_probs(logits_nTV[rows_n, node_n], rows)
        bad_n |= bad_now_n & ~done_n
        p_nV = probs_nV.double()
        if level == num_levels:  # no node this deep has children: every row still walking ends with its bonus
            final_n = torch.where(done_n, final_n, sample_rows(p_nV, u_final_n))
            break
        kids_nC = children_nTC[rows_n, node_n]
        has_nC = kids_nC >= 0
        passes_nC, residual_nV = sibling_tests(p_nV, drafts.tokens.gather(1, kids_nC.clamp(min=0)), has_nC,
                                               tests_nDC[:, level])
        moves_n = passes_nC.any(-1) & ~done_n
        next_n = kids_nC.gather(1, passes_nC.long().argmax(-1, keepdim=True))[:, 0]
        ends_n = ~done_n & ~moves_n
        final_n = torch.where(ends_n, sample_rows(residual_nV, u_final_n), final_n)
        node_n = torch.where(moves_n, next_n, node_n)
        done_n |= ends_n
    accepted = _path_to(drafts, node_n, final_n)  # the walk's path: the root to where it ended
    accepted.bad = bad_n
    return accepted


def sibling_tests(p_nV: torch.Tensor, kid_tokens_nC: torch.Tensor, has_nC: torch.Tensor,
                  u_nC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One level of the rejection walk (module doc) at each row's node: its distribution p
    [n, V] (float64), its children's tokens [n, C] in node order (has: a real child), one
    uniform per child -> (which children pass their test [n, C]: the first that passes is
    accepted, the residual [n, V] to sample the recovered token from when none passes: p
    without the children's tokens, or p itself where rounding left it no mass)."""
    width = int(kid_tokens_nC.shape[1])
    earlier_CC = torch.ones(width, width, dtype=torch.bool, device=p_nV.device).tril(-1)
    same_nCC = (kid_tokens_nC[:, :, None] == kid_tokens_nC[:, None, :]) & has_nC[:, None, :] & earlier_CC
    first_nC = has_nC & ~same_nCC.any(-1)  # a repeat of an earlier child has no mass left
    p_kid_nC = p_nV.gather(1, kid_tokens_nC) * first_nC
    remaining_nC = p_nV.sum(-1, keepdim=True) - (p_kid_nC.cumsum(-1) - p_kid_nC)
    passes_nC = first_nC & (remaining_nC > 0) & (u_nC * remaining_nC < p_kid_nC)
    rejected_nV = torch.zeros_like(p_nV).scatter_add_(1, kid_tokens_nC, has_nC.to(p_nV.dtype)) > 0
    residual_nV = p_nV.masked_fill(rejected_nV, 0.0)
    return passes_nC, torch.where(residual_nV.sum(-1, keepdim=True) > 0, residual_nV, p_nV)


def accept_typical(drafts: DraftBatch, logits_nTV: torch.Tensor, rows: RowSampling, u_n: torch.Tensor,
                   typical: TypicalAcceptance) -> Accepted:
    """Medusa-2's typical acceptance (module doc): LOSSY, only when a request names it. u_n:
    one uniform per row for the final token."""
    num_rows, num_nodes, vocab = logits_nTV.shape
    device = logits_nTV.device
    per_node = RowSampling(rows.temperature.repeat_interleave(num_nodes), rows.top_k.repeat_interleave(num_nodes),
                           rows.top_p.repeat_interleave(num_nodes), rows.max_top_k, rows.any_top_p)
    probs, bad = row_probs(logits_nTV.reshape(num_rows * num_nodes, vocab), per_node)
    probs_nTV = probs.reshape(num_rows, num_nodes, vocab)
    entropy_nT = -torch.special.xlogy(probs_nTV, probs_nTV).sum(-1)
    threshold_nT = torch.clamp(typical.posterior_alpha * torch.exp(-entropy_nT), max=typical.posterior_threshold)
    parents_nT = drafts.parents.clamp(min=0)
    rows_n1 = torch.arange(num_rows, device=device)[:, None]
    candidate_nT = probs_nTV[rows_n1, parents_nT, drafts.tokens]
    correct_nT = (candidate_nT > threshold_nT.gather(1, parents_nT)) & drafts.valid
    end_n = _deepest_accepted(drafts, correct_nT)
    final_n = sample_rows(probs_nTV[rows_n1[:, 0], end_n].double(), u_n)
    accepted = _path_to(drafts, end_n, final_n)
    accepted.bad = bad.reshape(num_rows, num_nodes).any(-1)
    return accepted


def _deepest_accepted(drafts: DraftBatch, correct_nT: torch.Tensor) -> torch.Tensor:
    """-> [n] the deepest node whose ancestors (itself included) are all correct; the root
    counts as correct; the lowest index on a tie."""
    num_nodes = drafts.tokens.shape[1]
    correct_nT = correct_nT.clone()
    correct_nT[:, 0] = True
    ok_nT = ~(drafts.tree_mask & ~correct_nT[:, None, :]).any(-1)
    nodes_T = torch.arange(num_nodes, device=correct_nT.device)
    score_nT = torch.where(ok_nT, drafts.depths * (num_nodes + 1) + (num_nodes - nodes_T), -1)
    return score_nT.argmax(-1)


def _path_to(drafts: DraftBatch, end_n: torch.Tensor, final_n: torch.Tensor) -> Accepted:
    """The root-to-end_n paths, and the tokens they emit: the path's draft tokens (nodes 1..A-1),
    then final_n at A-1."""
    num_rows, num_nodes, num_levels = drafts.tokens.shape[0], drafts.tokens.shape[1], drafts.max_depth
    ancestors_nT = drafts.tree_mask.gather(1, end_n[:, None, None].expand(-1, 1, num_nodes))[:, 0]
    slot_nT = torch.where(ancestors_nT, drafts.depths, num_levels + 1)  # an ancestor's depth is its place
    nodes_nT = torch.arange(num_nodes, device=end_n.device).expand(num_rows, -1)
    path_nD = torch.zeros(num_rows, num_levels + 2, dtype=torch.long, device=end_n.device)
    path_nD = path_nD.scatter_(1, slot_nT, nodes_nT)[:, :num_levels + 1]
    num_nodes_n = drafts.depths.gather(1, end_n[:, None])[:, 0] + 1
    emitted_nD = torch.cat([drafts.tokens.gather(1, path_nD[:, 1:]), final_n[:, None]], 1)
    emitted_nD.scatter_(1, (num_nodes_n - 1)[:, None], final_n[:, None])
    return Accepted(path=path_nD, num_nodes=num_nodes_n, emitted=emitted_nD,
                    depth=(drafts.depths * drafts.valid).amax(-1), bad=torch.zeros_like(end_n, dtype=torch.bool))


def _root_only(final_n: torch.Tensor) -> Accepted:
    zeros_n = torch.zeros_like(final_n)
    return Accepted(path=zeros_n[:, None], num_nodes=zeros_n + 1, emitted=final_n[:, None], depth=zeros_n,
                    bad=zeros_n.bool())


def _choose(rows_n: torch.Tensor, chosen: Accepted, other: Accepted) -> Accepted:
    """chosen's entries in the rows marked, other's elsewhere (both as wide)."""
    return Accepted(**{name: torch.where(rows_n if getattr(other, name).dim() == 1 else rows_n[:, None],
                                         getattr(chosen, name), getattr(other, name))
                       for name in ("path", "num_nodes", "emitted", "depth", "bad")})
