"""What one request's decoding returns (`GenerationResult`) and what it counted (`DecodeStats`).

Metrics (DESIGN.md invariant 8): alpha = accepted draft tokens / drafted tokens, where a
step drafts `tree.max_depth` tokens (what one path can contribute, not the node count);
tau = tokens emitted per verify step = accepted draft tokens + 1 bonus.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DecodeStats:
    steps: int = 0  # verify steps (speculative and plain)
    drafted_tokens: int = 0  # speculative steps * tree.max_depth
    accepted_tokens: int = 0  # accepted draft tokens, counted before any stop truncation
    accepted_per_position: list[int] = field(default_factory=list)  # [D] steps that accepted depth d+1
    prefill_s: float = 0.0
    decode_s: float = 0.0
    num_new_tokens: int = 0  # tokens returned (after EOS / stop / max_new_tokens truncation)
    lossless: bool = True  # False when any step used a lossy acceptance rule (acceptance="typical")
    plain_steps: int = 0  # steps without a draft (speculation off, probing the plain step cost, fallen back)
    fallback: bool = False  # the request fell back to plain decoding (serving/decode/fallback.py FallbackPolicy)
    fallback_reason: str | None = None
    fallback_step: int | None = None  # decode steps before the first fallback
    fallbacks: int = 0  # times the request fell back (it retries speculation after a while)
    spec_tokens_per_s: float | None = None  # the measured rates the fallback decision compared
    plain_tokens_per_s: float | None = None
    lookup_steps: int = 0  # steps that verified an n-gram lookup chain (serving/decode/lookup.py)
    lookup_accepted: int = 0  # draft tokens accepted from lookup chains (part of accepted_tokens)

    @property
    def alpha(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tau(self) -> float:
        return (self.accepted_tokens + self.steps) / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        total_s = self.prefill_s + self.decode_s
        return self.num_new_tokens / total_s if total_s > 0 else 0.0

    def merge(self, other: "DecodeStats") -> "DecodeStats":
        """Sum of two runs' counts and times (for aggregating over prompts)."""
        depth = max(len(self.accepted_per_position), len(other.accepted_per_position))
        per_position = [0] * depth
        for counts in (self.accepted_per_position, other.accepted_per_position):
            for d, count in enumerate(counts):
                per_position[d] += count
        return DecodeStats(
            steps=self.steps + other.steps, drafted_tokens=self.drafted_tokens + other.drafted_tokens,
            accepted_tokens=self.accepted_tokens + other.accepted_tokens,
            accepted_per_position=per_position, prefill_s=self.prefill_s + other.prefill_s,
            decode_s=self.decode_s + other.decode_s, num_new_tokens=self.num_new_tokens + other.num_new_tokens,
            lossless=self.lossless and other.lossless, plain_steps=self.plain_steps + other.plain_steps,
            fallback=self.fallback or other.fallback, fallbacks=self.fallbacks + other.fallbacks,
            lookup_steps=self.lookup_steps + other.lookup_steps,
            lookup_accepted=self.lookup_accepted + other.lookup_accepted)


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens only; ends with the EOS token or the stop sequence when finish_reason == "stop"
    finish_reason: str  # "stop" | "length" | "error" (the engine ended this sequence alone)
    stats: DecodeStats
    lossless: bool = True  # False when the output does not follow the target's distribution (typical acceptance)
    error: str | None = None  # finish_reason "error": the exception's type and message (serving/decode/engine.py)
