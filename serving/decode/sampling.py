"""Lossless sampling for tree speculative decoding: the accept step when temperature > 0.

This module owns the request's sampling parameters (`SamplingParams`), the target's
processed distribution (`target_probs`: temperature, then top-k, then top-p) and the tree
accept rule (`accept_tree_sampling`). It is pure: token ids, logits and probabilities in,
accepted node indices and emitted tokens out. It never calls a model or touches a cache.

Per-node conventions (match serving/decode/steps.py): node 0 is the root, a token the target
already chose. `target_logits[n]` is the target's prediction for the token AFTER node n,
given the prefix plus the path root..n; its processed distribution `p_n` is what the output
must follow. Siblings are tried in node order (for trees built by DraftTree.from_paths that
is rank order).

Definitions (one verify step emits A accepted draft tokens plus exactly one more token):
- accepted token: a drafted child token that passed its acceptance test; it is emitted
  unchanged and the walk continues at that child with the child's FRESH target
  distribution (residuals never cross depths).
- recovered token: when every child of the last accepted node was rejected, the token
  sampled from that node's final residual distribution (see below). It never equals a
  rejected child token, because the residual has no mass there.
- bonus token: when the last accepted node is a leaf (no children drafted, including the
  root of a tree with no draft nodes), the token sampled from its unmodified p_n.
The final token becomes the next step's root. `TreeSample.final_kind` says which it was.

Recursive rejection sampling at node n with children x_1..x_m (SpecInfer's multi-draft
rule) with candidates fixed in advance: Medusa's static tree and EAGLE's dynamic tree both
take the heads' top-k, and n-gram lookup copies the context, functions of the context alone.
The draft distribution of each child is then a point mass at x_i:
    p_1 = p_n
    for i = 1..m: accept x_i with probability p_i(x_i), then stop;
                  else p_{i+1} = p_i with x_i zeroed, renormalised
    all rejected: the recovered token ~ p_{m+1}.
Equivalently p_i(x_i) = p(x_i) / (1 - sum of p over the distinct tokens rejected before), 0
for a repeat. The emitted token has distribution p_n, and by induction over depths the whole
output follows the target. Conditioned on the candidates this is exact whatever produced
them, so it would also be lossless for sampled drafts (at a lower acceptance rate than the
rule that divides by their draft probabilities). No drafter samples its candidates, so that
rule is not here: tests/serving/decode/test_sampling.py keeps it as a reference, with
controls showing that the statistical test catches a draft distribution that does not
match how the children were drawn.

Numerical guard: a rejection has probability zero when the residual mass is zero; if
rounding produces one anyway the residual is undefined and p_i is kept.

Tiny temperatures. A temperature below `GREEDY_BELOW_TEMPERATURE` (1e-5, vLLM's
`_SAMPLING_EPS`) decodes greedily: `SamplingParams.is_greedy` is true, so no random number is
drawn and the output is the target's greedy output. Dividing fp32 logits by such a
temperature overflows (1e-300 rounds to 0.0 in fp32, 1e-40 is a denormal and 30 / 1e-40 is
inf) and the softmax turns into NaN; the limit of softmax(logits / T) as T -> 0 is the argmax
one-hot anyway (up to exact ties). From 1e-5 up, |logits| / T stays far inside fp32 for any
logits a model produces. Logits that give no distribution (NaN, +inf, every one -inf: a
broken target) raise ValueError from `target_probs` instead of reaching `torch.multinomial`;
the engine ends that one sequence with the error (serving/decode/engine.py, "Faults").

Greedy acceptance is not here: below GREEDY_BELOW_TEMPERATURE the engine accepts with
`TreePlan.accept_greedy` (serving/decode/trees.py), and `accept_tree_sampling` refuses greedy
parameters.

Typical acceptance (Medusa-2's, `mode="typical"`) is LOSSY and only available by name:
a node is accepted when p_parent(token) > min(posterior_threshold, posterior_alpha *
exp(-H(p_parent))); the longest accepted path wins; the last token is sampled from p at its
last node. Results carry `lossless=False`.

Randomness: `make_generator(params, device)` gives a torch.Generator seeded by the
request's seed (None when unseeded: the global RNG is used). One uniform per acceptance
test and one for the final token, drawn in float64 on the generator's device; the final
token is sampled by inverse CDF. Same seed, same inputs -> same output.

Shape legend: T tree nodes (root included), V vocab, N rows, A accepted nodes (root included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specheads.serving.decode.trees import DraftTree, accepted_path

DEFAULT_POSTERIOR_THRESHOLD = 0.09  # Medusa's defaults for typical acceptance
DEFAULT_POSTERIOR_ALPHA = 0.3
MAX_SEED = 2 ** 64 - 1
GREEDY_BELOW_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS; see "Tiny temperatures" in the module doc


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # >= 0; below GREEDY_BELOW_TEMPERATURE (0 included) = greedy
    top_p: float = 1.0  # in (0, 1]; 1 = off
    top_k: int = 0  # >= 0; 0 = off
    seed: int | None = None  # in [0, 2**64 - 1]; None = unseeded

    def __post_init__(self):
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) \
                or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be None or an integer in [0, 2**64 - 1], got {self.seed!r}")

    @property
    def is_greedy(self) -> bool:
        """Temperature 0, or so small that sampling would overflow (see the module doc)."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE


@dataclass(frozen=True)
class TypicalAcceptance:
    """Medusa's lossy typical acceptance; used only with mode="typical"."""
    posterior_threshold: float = DEFAULT_POSTERIOR_THRESHOLD  # in [0, 1]
    posterior_alpha: float = DEFAULT_POSTERIOR_ALPHA  # >= 0

    def __post_init__(self):
        if not 0 <= self.posterior_threshold <= 1:
            raise ValueError(f"posterior_threshold must be in [0, 1], got {self.posterior_threshold!r}")
        if not (math.isfinite(self.posterior_alpha) and self.posterior_alpha >= 0):
            raise ValueError(f"posterior_alpha must be a finite number >= 0, got {self.posterior_alpha!r}")


@dataclass
class TreeSample:
    nodes: torch.Tensor  # [A] long, accepted node indices, root first
    emitted: list[int]  # accepted draft tokens + the final (bonus or recovered) token: A tokens
    final_kind: str  # "bonus" (last accepted node is a leaf) | "recovered" (all its children rejected)
    lossless: bool  # False only for mode="typical"

    @property
    def num_accepted(self) -> int:
        """Accepted draft tokens (root excluded)."""
        return len(self.emitted) - 1


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded with the request's seed; None (global RNG) when it has none."""
    if params.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed)
    return generator


def target_probs(logits_NV: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The processed target distribution: temperature, then top-k, then top-p. -> [N, V] float32+.

    Greedy (temperature below GREEDY_BELOW_TEMPERATURE) gives the one-hot of the logits
    argmax (first index on ties). top-k keeps every token tied with the k-th largest logit.
    top-p keeps the smallest prefix of tokens, by descending probability, whose mass
    reaches top_p (the top token always survives). Logits that give no distribution (NaN,
    +inf, every one -inf) raise ValueError.
    """
    logits_NV = logits_NV.float() if logits_NV.dtype in (torch.float16, torch.bfloat16) else logits_NV
    if params.is_greedy:
        probs = torch.zeros_like(logits_NV)
        return probs.scatter_(-1, logits_NV.argmax(dim=-1, keepdim=True), 1.0)
    scaled = logits_NV / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = scaled.topk(params.top_k, dim=-1).values[..., -1:]  # [N, 1]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    probs = scaled.softmax(dim=-1)
    if not bool(torch.isfinite(probs).all()):
        raise ValueError("the target's logits give no distribution to sample from (NaN, +inf, or every logit -inf)")
    if params.top_p < 1:
        probs = probs.masked_fill(~top_p_keep(probs, params.top_p), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


# Top-p looks for its cut among this many most likely tokens first, and sorts a row's whole
# vocab only when their mass stays below top_p. A stable sort of a 49k vocab costs about 7 ms
# a row on one CPU core (the topk 0.5 ms), more than a bf16 SmolLM2 forward: sampled
# self-instruct on SmolLM2 spent 63% of its time there (py-spy).
TOP_P_CANDIDATES = 256


def top_p_keep(probs_NV: torch.Tensor, top_p: float) -> torch.Tensor:
    """The tokens top-p keeps -> bool [N, V]: the smallest prefix, by descending probability
    (ties in index order, as a stable sort puts them), whose mass reaches top_p; a token is
    dropped when the mass of the tokens before it is >= top_p, so the top token always stays."""
    k = min(TOP_P_CANDIDATES, probs_NV.shape[-1])
    values_Nk = probs_NV.topk(k, dim=-1).values  # descending
    # clamp: a top_p below float32's smallest value (5e-324) rounds to 0 in the comparison
    kept_N = ((values_Nk.cumsum(dim=-1) - values_Nk) < top_p).sum(dim=-1).clamp_min(1)  # the cut, if inside k
    smallest_N1 = values_Nk.gather(-1, (kept_N - 1)[:, None])
    keep_NV = probs_NV >= smallest_N1
    tied_N = keep_NV.sum(dim=-1) > kept_N  # tokens tied with the smallest kept one straddle the cut
    if bool(tied_N.any()):  # (common with bf16 logits): the first ones in index order stay
        probs_MV, smallest_M1, kept_M = probs_NV[tied_N], smallest_N1[tied_N], kept_N[tied_N]
        above_MV, tied_MV = probs_MV > smallest_M1, probs_MV == smallest_M1
        room_M1 = (kept_M - above_MV.sum(dim=-1))[:, None]
        keep_NV[tied_N] = above_MV | (tied_MV & (tied_MV.cumsum(dim=-1) <= room_M1))
    wide_N = kept_N == k  # every candidate kept: the cut may lie beyond them
    if bool(wide_N.any()):
        keep_NV[wide_N] = _top_p_keep_sorted(probs_NV[wide_N], top_p)
    return keep_NV


def _top_p_keep_sorted(probs_NV: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_NV, order_NV = probs_NV.sort(dim=-1, descending=True, stable=True)
    keep_sorted_NV = (sorted_NV.cumsum(dim=-1) - sorted_NV) < top_p
    keep_sorted_NV[..., 0] = True
    return torch.zeros_like(keep_sorted_NV).scatter_(-1, order_NV, keep_sorted_NV)


def _uniforms(count: int, generator: torch.Generator | None, device: torch.device) -> list[float]:
    if generator is not None:
        device = generator.device
    return torch.rand(count, generator=generator, dtype=torch.float64, device=device).tolist()


def _sample(probs_V: torch.Tensor, u: float) -> int:
    """Inverse-CDF sample of an unnormalised distribution; never returns a zero-mass token."""
    cdf = probs_V.double().cumsum(dim=0)
    index = int(torch.searchsorted(cdf, cdf[-1:] * u, right=True))
    if index >= cdf.shape[0]:  # u * total rounded up to total
        index = int(torch.nonzero(probs_V).max())
    return index


def _children(tree: DraftTree) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in range(tree.num_nodes)]
    for node, parent in enumerate(tree.parents.tolist()):
        if parent >= 0:
            children[parent].append(node)
    return children


def _reject_deterministic(p_V: torch.Tensor, tokens: list[int],
                          uniforms: list[float]) -> tuple[int | None, torch.Tensor]:
    """Children fixed in advance (q = point mass). -> (index of the accepted child | None, residual)."""
    p_child = p_V[tokens].double().tolist()
    total = float(p_V.double().sum())  # 1 up to rounding
    rejected: dict[int, float] = {}  # distinct rejected token -> its original p
    for i, (token, u) in enumerate(zip(tokens, uniforms)):
        if token in rejected:
            continue  # p_i(token) = 0 after its first rejection
        remaining = total - sum(rejected.values())
        if remaining > 0 and u < p_child[i] / remaining:
            return i, p_V
        rejected[token] = p_child[i]
    residual = p_V.clone()
    residual[list(rejected)] = 0.0
    return None, residual if float(residual.sum()) > 0 else p_V


def _accept_typical(tree: DraftTree, tree_tokens_T: torch.Tensor, probs_TV: torch.Tensor,
                    typical: TypicalAcceptance, generator: torch.Generator | None) -> TreeSample:
    device = probs_TV.device
    entropy_T = -torch.special.xlogy(probs_TV, probs_TV).sum(dim=-1)
    threshold_T = torch.clamp(typical.posterior_alpha * torch.exp(-entropy_T), max=typical.posterior_threshold)
    parents = tree.parents[1:].to(device)
    candidate_prob = probs_TV[parents].gather(-1, tree_tokens_T[1:, None])[:, 0]  # [T-1]
    ok_T = torch.cat([torch.ones(1, dtype=torch.bool, device=device), candidate_prob > threshold_T[parents]])
    nodes = accepted_path(tree.leaf_paths.to(device), ok_T)
    last = int(nodes[-1])
    final = _sample(probs_TV[last], _uniforms(1, generator, device)[0])
    is_leaf = last not in set(tree.parents.tolist())
    return TreeSample(nodes=nodes, emitted=tree_tokens_T[nodes[1:]].tolist() + [final],
                      final_kind="bonus" if is_leaf else "recovered", lossless=False)


def accept_tree_sampling(tree: DraftTree, tree_tokens_T: torch.Tensor, target_logits_TV: torch.Tensor,
                         params: SamplingParams, generator: torch.Generator | None = None, *,
                         mode: str = "rejection", typical: TypicalAcceptance = TypicalAcceptance()) -> TreeSample:
    """Accept a prefix of one root-to-leaf path and sample the final token (see the module doc).

    tree_tokens_T [T] long (node 0 = root), candidates fixed in advance; target_logits_TV [T, V].
    mode: "rejection" (lossless) | "typical" (lossy). params must sample (not greedy).
    """
    num_nodes = tree.num_nodes
    if tree_tokens_T.shape != (num_nodes,) or target_logits_TV.dim() != 2 or target_logits_TV.shape[0] != num_nodes:
        raise ValueError(f"need tree_tokens [T] and target_logits [T, V] with T = {num_nodes}, got "
                         f"{tuple(tree_tokens_T.shape)} and {tuple(target_logits_TV.shape)}")
    if mode not in ("rejection", "typical"):
        raise ValueError(f"mode must be 'rejection' (lossless) or 'typical' (lossy), got {mode!r}")
    if params.is_greedy:
        raise ValueError(f"temperature {params.temperature!r} decodes greedily, which TreePlan.accept_greedy "
                         f"accepts; accept_tree_sampling needs a temperature >= {GREEDY_BELOW_TEMPERATURE}")
    if mode == "typical":
        return _accept_typical(tree, tree_tokens_T, target_probs(target_logits_TV, params), typical, generator)

    def probs_V(node: int) -> torch.Tensor:
        # Only the rows the walk visits (a path, of T) are processed; each row's processing is
        # its own, so this equals processing all T rows at once.
        return target_probs(target_logits_TV[node:node + 1], params)[0]

    children = _children(tree)
    tokens = tree_tokens_T.tolist()
    uniforms = _uniforms(num_nodes, generator, target_logits_TV.device)  # <= T-1 tests + 1 final
    next_u = 0
    path = [0]
    while True:
        node = path[-1]
        kids = children[node]
        if not kids:
            final_kind, residual = "bonus", probs_V(node)
            break
        kid_tokens = [tokens[k] for k in kids]
        chosen, residual = _reject_deterministic(probs_V(node), kid_tokens, uniforms[next_u:next_u + len(kids)])
        next_u += len(kids) if chosen is None else chosen + 1
        if chosen is None:
            final_kind = "recovered"
            break
        path.append(kids[chosen])
    final = _sample(residual, uniforms[-1])
    nodes = torch.tensor(path, dtype=torch.long, device=tree_tokens_T.device)
    return TreeSample(nodes=nodes, emitted=[tokens[n] for n in path[1:]] + [final], final_kind=final_kind,
                      lossless=True)


ADAEDL_GAMMA = 0.5  # Pinsker: TV <= sqrt(KL / 2); AdaEDL's bound 1 - sqrt(gamma * H)


def acceptance_bound(logits: torch.Tensor, gamma: float = ADAEDL_GAMMA) -> torch.Tensor:
    """AdaEDL's lower bound on the probability that a drafted token is accepted,
    clamp(1 - sqrt(gamma * H(softmax(logits))), 0, 1) over the last dim (H in nats): [..., V] -> [...].

    Acceptance = 1 - TV(p, q) >= 1 - sqrt(KL / 2) (Pinsker, gamma = 1/2), with the draft's
    entropy standing in for the unknown KL, as AdaEDL does. Medusa's depth cut
    (serving/decode/medusa.py) and EAGLE-2's early stop (serving/decode/eagle.py) read it."""
    entropy = torch.special.entr(torch.softmax(logits.float(), dim=-1)).sum(dim=-1).clamp(min=0.0)
    return (1.0 - (gamma * entropy).sqrt()).clamp(0.0, 1.0)
