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


def step_logprobs(logits_TV: torch.Tensor, nodes_A: torch.Tensor, emitted: list[int],
                  num_top: int) -> list[TokenLogprob]:
    """The A tokens one verify step emitted, scored by the rows of its A accepted nodes (module doc)."""
    return score_tokens(logits_TV[nodes_A], emitted, num_top)


def prompt_logprobs(logits_PV: torch.Tensor, prompt: list[int], num_top: int) -> list[TokenLogprob | None]:
    """The prompt's tokens scored by the prefill's rows: None for the first token (nothing
    came before it), then token j by row j - 1. logits_PV: the prefill's rows for every
    prompt position (`steps.prefill(..., all_logits=True)`)."""
    if logits_PV.shape[0] != len(prompt):
        raise ValueError(f"need the prefill's logits at every prompt position, got {logits_PV.shape[0]} rows for "
                         f"{len(prompt)} prompt tokens")
    return [None] + score_tokens(logits_PV[:-1], prompt[1:], num_top)
