"""A request to the decode engine and a sequence's host state inside it (serving/decode/engine.py
decodes them): the request's settings, the tokens and logprobs so far, the fallback window,
what the drafters last sent back, and the result it ends with. Its device state is a row of
the engine's tensors (serving/decode/steps.py `DeviceStep`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specheads.serving.decode.fallback import SpeculationWindow
from specheads.serving.decode.faults import describe
from specheads.serving.decode.logprobs import TokenLogprob, prompt_logprobs, score_tokens
from specheads.serving.decode.sampling import SamplingParams
from specheads.serving.decode.stats import DecodeStats, GenerationResult


@dataclass
class SequenceRequest:
    input_ids: list[int] | torch.Tensor
    max_new_tokens: int
    eos_token_id: int | list[int] | None = None
    sampling: SamplingParams | None = None  # None or temperature 0: greedy
    stop_token_sequences: list[list[int]] | None = None  # the output ends right after the first one
    speculate: bool = True  # False: plain decoding for this sequence (the heads are not used)
    acceptance: str = "rejection"  # "typical": Medusa-2's lossy rule (sampling only), reported lossy
    # K >= 0: each new token's logprob and the K most likely tokens' (serving/decode/logprobs.py);
    # with prompt_logprobs, the prompt's tokens' too (its prefill keeps every position's logits)
    logprobs: int | None = None
    prompt_logprobs: bool = False


@dataclass
class Sequence:
    """One request inside the engine."""

    seq_id: int
    prompt_1P: torch.Tensor
    max_new_tokens: int
    eos_ids: frozenset[int]
    stop_sequences: list[list[int]]
    sampling: SamplingParams | None  # None: greedy
    acceptance: str
    window: SpeculationWindow  # the fallback policy's state for this sequence (serving/decode/fallback.py's alone)
    generator: torch.Generator | None
    stats: DecodeStats
    prompt: list[int] = field(default_factory=list)  # the prompt's token ids (host)
    prefix_len: int = 0  # S, the positions its cache row commits (the root is not among them)
    notes: dict[str, list[int]] = field(default_factory=dict)  # per drafter: what its last observe sent back
    drafting_on_device: bool = False  # the row's drafting flag as the device holds it
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    joined: bool = False  # takes part in decode steps (set at the latest by the first step after add)
    error: Exception | None = None  # what ended this sequence alone (finish_reason "error")
    num_top_logprobs: int | None = None  # SequenceRequest.logprobs
    logprobs: list[TokenLogprob] | None = None  # one per token in `tokens` (num_top_logprobs set)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (asked for), None first

    def score_prefill(self, logits_LV: torch.Tensor, first_token: int) -> None:
        """The prefill's rows score its first token (a sequence always takes it) and, if asked,
        the prompt."""
        if self.logprobs is None:
            return
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs(logits_LV, self.prompt, self.num_top_logprobs)
        self.logprobs = score_tokens(logits_LV[-1:], [first_token], self.num_top_logprobs)

    def close(self) -> GenerationResult:
        """Stop here: the result so far, finish_reason "stop" unless it had finished."""
        if self.finish_reason is None:
            self.finish_reason = "stop"
        return self.result()

    def result(self) -> GenerationResult:
        self.stats.num_new_tokens = len(self.tokens)
        return GenerationResult(tokens=self.tokens, finish_reason=self.finish_reason or "length",
                                stats=self.stats, lossless=self.stats.lossless,
                                error=None if self.error is None else describe(self.error),
                                logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs)


def as_prompt(input_ids, device: torch.device) -> torch.Tensor:
    """A request's input_ids as a [1, P] tensor on `device`; refused when empty or batched."""
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be a non-empty list of ints or a [1, P] tensor, got shape {tuple(ids.shape)}")
    return ids
