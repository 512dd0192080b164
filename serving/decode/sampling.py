"""Sampling: the request's parameters and the target's processed distribution.

This module owns the request's sampling parameters (`SamplingParams`, and `RowSampling`: a
batch's as device tensors), the target's processed distribution (`target_probs` for one set
of parameters, `row_probs` for rows with their own: temperature, then top-k, then top-p) and
inverse-CDF sampling (`sample_rows`).
It is pure: logits in, probabilities and token ids out. The accept rules that use them
(greedy, lossless tree rejection sampling, typical acceptance) are
serving/decode/accept.py's.

Definitions (one verify step emits A accepted draft tokens plus exactly one more token):
- accepted token: a drafted child token that passed its acceptance test; it is emitted
  unchanged and the walk continues at that child with the child's FRESH target
  distribution (residuals never cross depths).
- recovered token: when every child of the last accepted node was rejected, the token
  sampled from that node's final residual distribution. It never equals a rejected child
  token, because the residual has no mass there.
- bonus token: when the last accepted node is a leaf (no children drafted, including the
  root of a tree with no draft nodes), the token sampled from its unmodified p_n.
The final token becomes the next step's root.

Tiny temperatures. A temperature below `GREEDY_BELOW_TEMPERATURE` (1e-5, vLLM's
`_SAMPLING_EPS`) decodes greedily: `SamplingParams.is_greedy` is true, so no random number is
drawn and the output is the target's greedy output. Dividing fp32 logits by such a
temperature overflows (1e-300 rounds to 0.0 in fp32, 1e-40 is a denormal and 30 / 1e-40 is
inf) and the softmax turns into NaN; the limit of softmax(logits / T) as T -> 0 is the argmax
one-hot anyway (up to exact ties). From 1e-5 up, |logits| / T stays far inside fp32 for any
logits a model produces. Logits that give no distribution (NaN, +inf, every one -inf: a
broken target) raise ValueError from `target_probs`; `row_probs` flags the row instead, so
that a batch needs no device sync to find it (the engine ends that one sequence with the
error, serving/decode/engine.py "Faults").

Randomness: `make_generator(params, device)` gives a torch.Generator seeded by the
request's seed (None when unseeded: the global RNG is used).

Shape legend: N or n rows, V vocab, K top-p candidates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


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


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded with the request's seed; None (global RNG) when it has none."""
    if params.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed)
    return generator


@dataclass
class RowSampling:
    """Each row's sampling parameters as device tensors, for a batch processed in one go (the
    decode step keeps them per engine row: serving/decode/steps.py), and the host facts that
    pick the code to run (fixed while the batch is). Greedy rows hold temperature 1, no top-k,
    no top-p: their sampled results are computed and never used."""

    temperature: torch.Tensor  # [n] float64
    top_k: torch.Tensor  # [n] long, 0 = off
    top_p: torch.Tensor  # [n] float64, 1.0 = off
    max_top_k: int  # the largest top_k of the rows (0: none has one)
    any_top_p: bool  # some row has top_p < 1

    @classmethod
    def of(cls, params: list[SamplingParams], device: torch.device | str = "cpu") -> "RowSampling":
        """From host parameters (sampling ones, not greedy), one per row."""
        return cls(temperature=torch.tensor([p.temperature for p in params], dtype=torch.float64, device=device),
                   top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
                   top_p=torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device),
                   max_top_k=max(p.top_k for p in params), any_top_p=min(p.top_p for p in params) < 1)


def target_probs(logits_NV: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The processed target distribution: temperature, then top-k, then top-p. -> [N, V] float32+.

    Greedy (temperature below GREEDY_BELOW_TEMPERATURE) gives the one-hot of the logits
    argmax (first index on ties). top-k keeps every token tied with the k-th largest logit.
    top-p keeps the smallest prefix of tokens, by descending probability, whose mass
    reaches top_p (the top token always survives). Logits that give no distribution (NaN,
    +inf, every one -inf) raise ValueError.
    """
    if params.is_greedy:
        logits_NV = logits_NV.float() if logits_NV.dtype in (torch.float16, torch.bfloat16) else logits_NV
        probs = torch.zeros_like(logits_NV)
        return probs.scatter_(-1, logits_NV.argmax(dim=-1, keepdim=True), 1.0)
    probs, bad = row_probs(logits_NV, RowSampling.of([params] * logits_NV.shape[0], logits_NV.device))
    if bool(bad.any()):
        raise ValueError("the target's logits give no distribution to sample from (NaN, +inf, or every logit -inf)")
    return probs


def row_probs(logits_nV: torch.Tensor, rows: RowSampling) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's processed distribution under its own (sampling) parameters, as
    `target_probs` defines it -> (probs [n, V] float32+, bad [n] bool: the row's logits
    give no distribution; its probs are then uniform). Tensor operations only, except top-p's
    candidate search on a CPU outside a compiled graph (`top_p_keep`)."""
    logits_nV = logits_nV.float() if logits_nV.dtype in (torch.float16, torch.bfloat16) else logits_nV
    vocab = logits_nV.shape[1]
    scaled = logits_nV / rows.temperature.to(logits_nV.dtype)[:, None]
    if 0 < rows.max_top_k:  # rows without top-k (0, or >= V) keep every token (their k-th value is -inf)
        ks_n1 = torch.where(rows.top_k < vocab, rows.top_k, 0)[:, None]
        kth_n1 = scaled.topk(min(rows.max_top_k, vocab), dim=-1).values.gather(-1, (ks_n1 - 1).clamp(min=0))
        scaled = scaled.masked_fill(scaled < kth_n1.masked_fill(ks_n1 == 0, -math.inf), -math.inf)
    probs = scaled.softmax(dim=-1)
    bad = ~torch.isfinite(probs).all(dim=-1)
    probs = torch.where(bad[:, None], 1.0 / vocab, probs)
    if rows.any_top_p:  # rows without top-p keep everything
        keep = top_p_keep(probs, rows.top_p.to(probs.dtype)) | (rows.top_p >= 1)[:, None]
        probs = probs.masked_fill(~keep, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs, bad


def sample_rows(probs_nV: torch.Tensor, u_n: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF samples [n] of unnormalised distributions (float64 sums), one uniform each;
    never a zero-mass token (u * total rounding up to total takes the last token with mass)."""
    cdf_nV = probs_nV.double().cumsum(dim=-1)
    index_n = torch.searchsorted(cdf_nV, cdf_nV[:, -1:] * u_n.double()[:, None], right=True)[:, 0]
    vocab = probs_nV.shape[-1]
    last_with_mass_n = (vocab - 1) - (probs_nV > 0).flip(-1).long().argmax(-1)
    return torch.minimum(index_n, last_with_mass_n)


# Top-p looks for its cut among this many most likely tokens first, and sorts a row's whole
# vocab only when their mass stays below top_p. A stable sort of a 49k vocab costs about 7 ms
# a row on one CPU core (the topk 0.5 ms), more than a bf16 SmolLM2 forward: sampled
# self-instruct on SmolLM2 spent 63% of its time there (py-spy). That search branches on the
# data, which costs a CPU nothing and a GPU a sync per call: elsewhere the vocab is sorted.
TOP_P_CANDIDATES = 256


def top_p_keep(probs_NV: torch.Tensor, top_p: float | torch.Tensor, host_branches: bool | None = None) -> torch.Tensor:
    """The tokens top-p keeps -> bool [N, V]: the smallest prefix, by descending probability
    (ties in index order, as a stable sort puts them), whose mass reaches top_p (a float, or
    [N] per row); a token is dropped when the mass of the tokens before it is >= top_p, so
    the top token always stays. host_branches (default: on a CPU): search the candidates
    first (see TOP_P_CANDIDATES); False sorts the whole vocab, with no device sync."""
    top_p_N1 = top_p[:, None] if isinstance(top_p, torch.Tensor) else torch.full_like(probs_NV[:, :1], top_p)
    if host_branches is None:
        host_branches = probs_NV.device.type == "cpu" and not torch.compiler.is_compiling()
    if not host_branches:
        return _top_p_keep_sorted(probs_NV, top_p_N1)
    k = min(TOP_P_CANDIDATES, probs_NV.shape[-1])
    values_Nk = probs_NV.topk(k, dim=-1).values  # descending
    # clamp: a top_p below float32's smallest value (5e-324) rounds to 0 in the comparison
    kept_N = ((values_Nk.cumsum(dim=-1) - values_Nk) < top_p_N1).sum(dim=-1).clamp_min(1)  # the cut, if inside k
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
        keep_NV[wide_N] = _top_p_keep_sorted(probs_NV[wide_N], top_p_N1[wide_N])
    return keep_NV


def _top_p_keep_sorted(probs_NV: torch.Tensor, top_p_N1: torch.Tensor) -> torch.Tensor:
    sorted_NV, order_NV = probs_NV.sort(dim=-1, descending=True, stable=True)
    keep_sorted_NV = (sorted_NV.cumsum(dim=-1) - sorted_NV) < top_p_N1
    keep_sorted_NV[..., 0] = True
    return torch.zeros_like(keep_sorted_NV).scatter_(-1, order_NV, keep_sorted_NV)


ADAEDL_GAMMA = 0.5  # Pinsker: TV <= sqrt(KL / 2); AdaEDL's bound 1 - sqrt(gamma * H)


def acceptance_bound(logits: torch.Tensor, gamma: float = ADAEDL_GAMMA) -> torch.Tensor:
    """AdaEDL's lower bound on the probability that a drafted token is accepted,
    clamp(1 - sqrt(gamma * H(softmax(logits))), 0, 1) over the last dim (H in nats): [..., V] -> [...].

    Acceptance = 1 - TV(p, q) >= 1 - sqrt(KL / 2) (Pinsker, gamma = 1/2), with the draft's
    entropy standing in for the unknown KL, as AdaEDL does. Medusa's depth cut
    (serving/decode/medusa.py) and EAGLE-2's early stop (serving/decode/eagle.py) read it."""
    entropy = torch.special.entr(torch.softmax(logits.float(), dim=-1)).sum(dim=-1).clamp(min=0.0)
    return (1.0 - (gamma * entropy).sqrt()).clamp(0.0, 1.0)
