"""Token log-probabilities from the target's own logits (what a server's `logprobs` reports).

Which row scores which token. Every emitted token was chosen by one row of the target's
logits, the row of the position before it (its parent):
- the prefill's last row chose the first token; with prompt logprobs, prompt token j is
  scored by the prefill's row j - 1, and the first prompt token has no score (None);
- a verify step accepts a path of A nodes, root first. The root's token was emitted (and
  scored) by the step before. Accepted node i (i >= 1) was chosen against node i-1's row, and
  the bonus token (the next root) against the last accepted node's row. So the A tokens a
  step emits (accepted draft tokens + bonus) are scored by the rows at the A accepted nodes,
  in order: `logits_TV[nodes_A]`. A plain step is the case A = 1.

The distribution is the target's raw one: log_softmax of its logits in fp32, before
temperature, top-k or top-p (vLLM's default `raw_logprobs`), whatever rule picked the
token. In fp32 that equals HF's `generate(output_logits=True)` log_softmax for the same
tokens (up to fp differences between batch shapes).

Shape legend: N scored rows, V vocab, K top logprobs, T tree nodes, A accepted nodes, P prompt tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted (or prompt) token's log-probability under the row that chose it."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the row's K most likely tokens and their logprobs, most likely first


def score_tokens(logits_NV: torch.Tensor, tokens: list[int], num_top: int) -> list[TokenLogprob]:
    """Rows of logits and the token each row chose -> each token's logprob and its row's
    num_top most likely tokens (one host copy for all rows)."""
    if logits_NV.dim() != 2 or logits_NV.shape[0] != len(tokens):
        raise ValueError(f"need one logits row per token, got logits {tuple(logits_NV.shape)} for {len(tokens)} tokens")
    if num_top < 0:
        raise ValueError(f"num_top must be >= 0, got {num_top}")
    if not tokens:
        return []
    vocab = int(logits_NV.shape[1])
    if vocab >= 2 ** 24:
        raise ValueError(f"a vocab of {vocab} tokens is past what fp32 holds exactly (2**24)")
    num_top = min(num_top, vocab)
    logprobs_NV = torch.log_softmax(logits_NV.float(), dim=-1)
    tokens_N1 = torch.tensor(tokens, dtype=torch.long, device=logits_NV.device)[:, None]
    top_values_NK, top_ids_NK = logprobs_NV.topk(num_top, dim=-1)
    # fp32 holds token ids exactly below 2**24 (every vocab there is), so values and ids come back in one copy
    rows = torch.cat([logprobs_NV.gather(-1, tokens_N1), top_values_NK, top_ids_NK.float()], dim=1).tolist()
    return [TokenLogprob(token=token, logprob=row[0],
                         top=tuple(zip((int(i) for i in row[1 + num_top:]), row[1:1 + num_top])))
            for token, row in zip(tokens, rows)]


def step_logprob_rows(logits_nTV: torch.Tensor, path_nA: torch.Tensor, emitted_nA: torch.Tensor,
                      num_top: int) -> torch.Tensor:
    """A verify step's emitted tokens scored on the device, for the step's one copy to the
    host (serving/decode/steps.py DeviceStep.read): each row's A accepted nodes' rows score
    its A emitted tokens (module doc). path and emitted [n, A] (padded past a row's count).
    -> [n, A * (1 + 2K)] float64: per token its logprob, the K top logprobs, the K top ids."""
    vocab = int(logits_nTV.shape[-1])
    if vocab >= 2 ** 24:
        raise ValueError(f"a vocab of {vocab} tokens is past what fp32 holds exactly (2**24)")
    num_top = min(num_top, vocab)
    rows_nA = logits_nTV.gather(1, path_nA[:, :, None].expand(-1, -1, vocab))  # [n, A, V]
    logprobs_nAV = torch.log_softmax(rows_nA.float(), dim=-1)
    top_values_nAK, top_ids_nAK = logprobs_nAV.topk(num_top, dim=-1)
    chosen_nA1 = logprobs_nAV.gather(-1, emitted_nA[:, :, None])
    packed = torch.cat([chosen_nA1, top_values_nAK, top_ids_nAK.float()], dim=-1).double()
    return packed.reshape(packed.shape[0], -1)


def unpack_step_logprobs(values: list[float], emitted: list[int], num_top: int,
                         num_positions: int) -> list[TokenLogprob]:
    """One row of step_logprob_rows (num_positions = its A), on the host -> the entries of its
    emitted tokens, num_top each (at most the K it was packed with)."""
    width = len(values) // num_positions
    packed_top = (width - 1) // 2
    num_top = min(num_top, packed_top)
    entries = []
    for index, token in enumerate(emitted):
        row = values[index * width:(index + 1) * width]
        entries.append(TokenLogprob(token=token, logprob=row[0], top=tuple(
            zip((int(i) for i in row[1 + packed_top:1 + packed_top + num_top]), row[1:1 + num_top]))))
    return entries


def prompt_logprobs(logits_PV: torch.Tensor, prompt: list[int], num_top: int) -> list[TokenLogprob | None]:
    """The prompt's tokens scored by the prefill's rows: None for the first token (nothing
    came before it), then token j by row j - 1. logits_PV: the prefill's rows for every
    prompt position (`steps.prefill(..., all_logits=True)`)."""
    if logits_PV.shape[0] != len(prompt):
        raise ValueError(f"need the prefill's logits at every prompt position, got {logits_PV.shape[0]} rows for "
                         f"{len(prompt)} prompt tokens")
    return [None] + score_tokens(logits_PV[:-1], prompt[1:], num_top)
