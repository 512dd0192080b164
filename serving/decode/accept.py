"""The accept step for a whole batch, as tensor operations on the target's device.

One call, `accept`, turns a step's drafts (serving/decode/draft_batch.py `DraftBatch`) and
the target's verify logits into each row's accepted path and emitted tokens (`Accepted`),
without reading anything back to the host. `Accepted.to_host` is then the step's one
device-to-host copy: the tokens the engine streams, with the path it commits.

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
(the request's seed) or the global RNG, float64, on the generator's device: an acceptance
test per (level, child slot) of the decoder's largest tree (`uniform_shape`), and one for
the final token. The count depends on the decoder alone, not on the batch, so a seeded
request gives the same output alone and in any batch.

Logits that give no distribution (NaN, +inf, every one -inf) mark the row `bad`; the engine
ends that sequence with an error after the copy to the host (serving/decode/engine.py).

Shape legend: n rows, T nodes, V vocab, D the batch's deepest draft level, C most children.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specheads.serving.decode.draft_batch import DraftBatch
from specheads.serving.decode.sampling import (GREEDY_BELOW_TEMPERATURE, SamplingParams, TypicalAcceptance, row_probs,
                                               sample_rows)
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

    def to_host(self, extra_nX: torch.Tensor | None = None) -> "HostAccepted":
        """The step's one device-to-host copy; extra_nX: per-row values to bring along in it
        (float64; token logprobs), returned as HostAccepted.extra."""
        ints = torch.cat([self.num_nodes[:, None], self.depth[:, None], self.bad[:, None].long(), self.path,
                          self.emitted], 1)
        width = int(self.path.shape[1])
        if extra_nX is None:
            packed, extra = ints.tolist(), None
        else:  # float64 holds the ints exactly (token ids and node indices are far below 2**53)
            rows = torch.cat([ints.double(), extra_nX.double()], 1).tolist()
            packed = [[int(value) for value in row[:3 + 2 * width]] for row in rows]
            extra = [row[3 + 2 * width:] for row in rows]
        return HostAccepted(paths=[row[3:3 + row[0]] for row in packed],
                            emitted=[row[3 + width:3 + width + row[0]] for row in packed],
                            depths=[row[1] for row in packed], bad=[bool(row[2]) for row in packed], extra=extra)


@dataclass
class HostAccepted:
    paths: list[list[int]]  # [n][A] accepted node indices, root first
    emitted: list[list[int]]  # [n][A] tokens emitted: accepted draft tokens + the final token
    depths: list[int]  # [n] drafted depth
    bad: list[bool]  # [n]
    extra: list[list[float]] | None = None  # [n][X] values that came along (Accepted.to_host's extra_nX)

    @classmethod
    def root_only(cls, num_rows: int) -> "HostAccepted":
        """Every row its root alone (rows that failed: nothing of theirs is read)."""
        return cls(paths=[[0]] * num_rows, emitted=[[0]] * num_rows, depths=[0] * num_rows, bad=[False] * num_rows)


def accept(drafts: DraftBatch, logits_nTV: torch.Tensor, target_tokens_nT: torch.Tensor,
           samplings: list[SamplingParams | None], generators: list[torch.Generator | None],
           acceptances: list[str], uniform_shape: tuple[int, int] | None = None,
           typical: TypicalAcceptance = TypicalAcceptance()) -> Accepted:
    """Every row's accepted path (module doc). samplings[i] None: greedy; acceptances[i]:
    "rejection" (lossless) or "typical" (lossy, sampling only). target_tokens: the greedy
    argmax of the logits (serving/decode/steps.py greedy_tokens). uniform_shape: see
    accept_rejection."""
    accepted = accept_greedy(drafts, target_tokens_nT)
    for rule in ("rejection", "typical"):
        rows = [i for i, (params, how) in enumerate(zip(samplings, acceptances)) if params is not None and how == rule]
        if rows:
            sub = drafts if len(rows) == drafts.num_rows else drafts.rows(rows)
            index = torch.tensor(rows, device=logits_nTV.device)
            logits = logits_nTV if len(rows) == drafts.num_rows else logits_nTV.index_select(0, index)
            params, gens = [samplings[i] for i in rows], [generators[i] for i in rows]
            sampled = accept_rejection(sub, logits, params, gens, uniform_shape) if rule == "rejection" \
                else accept_typical(sub, logits, params, gens, typical)
            accepted = _put_rows(accepted, index, sampled)
    return accepted


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
    drafts = DraftBatch.from_plan(TreePlan(tree, target_logits_TV.device), tree_tokens_T[None])
    sampled = accept_rejection(drafts, target_logits_TV[None], [params], [generator]) if mode == "rejection" \
        else accept_typical(drafts, target_logits_TV[None], [params], [generator], typical)
    host = sampled.to_host()
    if host.bad[0]:
        raise ValueError(NO_DISTRIBUTION)
    nodes = host.paths[0]
    return TreeSample(nodes=torch.tensor(nodes, dtype=torch.long, device=tree_tokens_T.device), emitted=host.emitted[0],
                      final_kind="recovered" if nodes[-1] in tree.parents.tolist() else "bonus",
                      lossless=mode == "rejection")


def accept_greedy(drafts: DraftBatch, target_tokens_nT: torch.Tensor) -> Accepted:
    """Greedy acceptance (module doc) -> the rows' accepted paths and bonus tokens."""
    if drafts.max_depth == 0:  # plain steps: the target's token
        return _root_only(drafts, target_tokens_nT[:, 0])
    parent_tokens_nT = target_tokens_nT.gather(1, drafts.parents.clamp(min=0))
    correct_nT = (drafts.tokens == parent_tokens_nT) & drafts.valid
    end_n = _deepest_accepted(drafts, correct_nT)
    return _path_to(drafts, end_n, target_tokens_nT.gather(1, end_n[:, None])[:, 0])


def accept_rejection(drafts: DraftBatch, logits_nTV: torch.Tensor, params: list[SamplingParams],
                     generators: list[torch.Generator | None], uniform_shape: tuple[int, int] | None = None) -> Accepted:
    """Lossless tree rejection sampling (module doc), every row at once, one level per depth.
    uniform_shape: (levels, children) of the uniforms each row draws per step, at least the
    drafts' (max_depth, max_children), default exactly those: a decoder passes its largest
    tree's, so that a seeded row draws the same numbers alone and in any batch."""
    num_rows, num_levels, width = drafts.num_rows, drafts.max_depth, drafts.max_children
    levels, slots = uniform_shape or (num_levels, width)
    if levels < num_levels or slots < width:
        raise ValueError(f"uniform_shape {(levels, slots)} is smaller than the drafts' {(num_levels, width)}")
    device = logits_nTV.device
    uniforms = _uniforms(num_rows, (levels + 1) * slots + 1, generators, device)
    tests_nDC = uniforms[:, :-1].reshape(num_rows, levels + 1, slots)[:, :num_levels + 1, :width]
    u_final_n = uniforms[:, -1]
    rows_n = torch.arange(num_rows, device=device)
    node_n = torch.zeros(num_rows, dtype=torch.long, device=device)
    path_nD = torch.zeros(num_rows, num_levels + 1, dtype=torch.long, device=device)
    done_n = torch.zeros(num_rows, dtype=torch.bool, device=device)
    final_n = torch.zeros(num_rows, dtype=torch.long, device=device)
    bad_n = torch.zeros(num_rows, dtype=torch.bool, device=device)
    children_nTC = drafts.children() if width else None
    for level in range(num_levels + 1):
        probs_nV, bad_now_n = row_probs(logits_nTV[rows_n, node_n], params)
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
        path_nD[:, level + 1] = torch.where(moves_n, next_n, path_nD[:, level + 1])
        node_n = torch.where(moves_n, next_n, node_n)
        done_n |= ends_n
    num_nodes_n = drafts.depths.gather(1, node_n[:, None])[:, 0] + 1
    return Accepted(path=path_nD, num_nodes=num_nodes_n, emitted=_emitted(drafts, path_nD, num_nodes_n, final_n),
                    depth=_drafted_depth(drafts), bad=bad_n)


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


def accept_typical(drafts: DraftBatch, logits_nTV: torch.Tensor, params: list[SamplingParams],
                   generators: list[torch.Generator | None], typical: TypicalAcceptance) -> Accepted:
    """Medusa-2's typical acceptance (module doc): LOSSY, only when a request names it."""
    num_rows, num_nodes, vocab = logits_nTV.shape
    device = logits_nTV.device
    probs, bad = row_probs(logits_nTV.reshape(num_rows * num_nodes, vocab),
                           [p for p in params for _ in range(num_nodes)])
    probs_nTV = probs.reshape(num_rows, num_nodes, vocab)
    entropy_nT = -torch.special.xlogy(probs_nTV, probs_nTV).sum(-1)
    threshold_nT = torch.clamp(typical.posterior_alpha * torch.exp(-entropy_nT), max=typical.posterior_threshold)
    parents_nT = drafts.parents.clamp(min=0)
    rows_n1 = torch.arange(num_rows, device=device)[:, None]
    candidate_nT = probs_nTV[rows_n1, parents_nT, drafts.tokens]
    correct_nT = (candidate_nT > threshold_nT.gather(1, parents_nT)) & drafts.valid
    end_n = _deepest_accepted(drafts, correct_nT)
    u_n = _uniforms(num_rows, 1, generators, device)[:, 0]
    final_n = sample_rows(probs_nTV[rows_n1[:, 0], end_n].double(), u_n)
    accepted = _path_to(drafts, end_n, final_n)
    accepted.bad = bad.reshape(num_rows, num_nodes).any(-1)
    return accepted


def _deepest_accepted(drafts: DraftBatch, correct_nT: torch.Tensor) -> torch.Tensor:
    """-> [n] the deepest node whose ancestors (itself included) are all correct; the root
    counts as correct; the lowest index on a tie."""
    num_nodes = drafts.num_nodes
    correct_nT = correct_nT.clone()
    correct_nT[:, 0] = True
    ok_nT = ~(drafts.tree_mask & ~correct_nT[:, None, :]).any(-1)
    nodes_T = torch.arange(num_nodes, device=correct_nT.device)
    score_nT = torch.where(ok_nT, drafts.depths * (num_nodes + 1) + (num_nodes - nodes_T), -1)
    return score_nT.argmax(-1)


def _path_to(drafts: DraftBatch, end_n: torch.Tensor, final_n: torch.Tensor) -> Accepted:
    """The root-to-end_n paths, and the tokens they emit with final_n at the end."""
    num_rows, num_nodes, num_levels = drafts.num_rows, drafts.num_nodes, drafts.max_depth
    ancestors_nT = drafts.tree_mask.gather(1, end_n[:, None, None].expand(-1, 1, num_nodes))[:, 0]
    slot_nT = torch.where(ancestors_nT, drafts.depths, num_levels + 1)  # an ancestor's depth is its place
    nodes_nT = torch.arange(num_nodes, device=end_n.device).expand(num_rows, -1)
    path_nD = torch.zeros(num_rows, num_levels + 2, dtype=torch.long, device=end_n.device)
    path_nD = path_nD.scatter_(1, slot_nT, nodes_nT)[:, :num_levels + 1]
    num_nodes_n = drafts.depths.gather(1, end_n[:, None])[:, 0] + 1
    return Accepted(path=path_nD, num_nodes=num_nodes_n, emitted=_emitted(drafts, path_nD, num_nodes_n, final_n),
                    depth=_drafted_depth(drafts), bad=torch.zeros_like(end_n, dtype=torch.bool))


def _emitted(drafts: DraftBatch, path_nD: torch.Tensor, num_nodes_n: torch.Tensor,
             final_n: torch.Tensor) -> torch.Tensor:
    """[n, D+1]: the tokens of path nodes 1..A-1, then final_n at A-1."""
    drafted_nD = torch.cat([drafts.tokens.gather(1, path_nD[:, 1:]), final_n[:, None]], 1)
    return drafted_nD.scatter_(1, (num_nodes_n - 1)[:, None], final_n[:, None])


def _drafted_depth(drafts: DraftBatch) -> torch.Tensor:
    return (drafts.depths * drafts.valid).amax(-1)


def _root_only(drafts: DraftBatch, final_n: torch.Tensor) -> Accepted:
    zeros_n = torch.zeros_like(final_n)
    return Accepted(path=zeros_n[:, None].clone(), num_nodes=zeros_n + 1, emitted=final_n[:, None].clone(),
                    depth=zeros_n, bad=zeros_n.bool())


def _put_rows(accepted: Accepted, index_m: torch.Tensor, rows: Accepted) -> Accepted:
    """accepted with rows' entries written at index_m (paths padded to the wider of the two)."""
    width = max(accepted.path.shape[1], rows.path.shape[1])
    fields = {}
    for name in ("path", "num_nodes", "emitted", "depth", "bad"):
        into, values = getattr(accepted, name), getattr(rows, name)
        if into.dim() == 2:
            into, values = _widen(into, width), _widen(values, width)
        fields[name] = into.index_copy(0, index_m, values)
    return Accepted(**fields)


def concat_accepted(parts: list[Accepted]) -> Accepted:
    """Rows accepted apart, one Accepted (paths padded to the widest)."""
    width = max(part.path.shape[1] for part in parts)
    return Accepted(**{name: torch.cat([_widen(getattr(part, name), width) if name in ("path", "emitted")
                                        else getattr(part, name) for part in parts])
                       for name in ("path", "num_nodes", "emitted", "depth", "bad")})


def _widen(values_nD: torch.Tensor, width: int) -> torch.Tensor:
    pad = width - values_nD.shape[1]
    return values_nD if pad == 0 else torch.cat([values_nD, values_nD.new_zeros(values_nD.shape[0], pad)], 1)


def _uniforms(num_rows: int, count: int, generators: list[torch.Generator | None],
              device: torch.device) -> torch.Tensor:
    """[n, count] float64 uniforms, each row from its own generator (None: the global RNG)."""
    rows = [torch.rand(count, generator=gen, dtype=torch.float64,
                       device=device if gen is None else gen.device) for gen in generators]
    return torch.stack(rows).to(device)
