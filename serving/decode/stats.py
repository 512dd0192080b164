"""What one request's decoding returns (`GenerationResult`) and what it counted (`DecodeStats`).

Metrics (docs/architecture.md invariant 8), defined once in `alpha_tau` and read by generate, bench,
tune, the server's responses and /metrics alike:
- alpha = accepted draft tokens / drafted tokens, where a step drafts `tree.max_depth`
  tokens (what one path can contribute, not the node count);
- tau = tokens emitted per *speculative* verify step = accepted draft tokens + 1 bonus.
  Plain steps (speculation off, probing the plain cost, fallen back) are not counted: they
  emit one token by construction, so counting them would make tau after a fallback measure
  the fallback instead of the drafts. Tokens/s is where fallbacks show.
Both are 0.0 when nothing was drafted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The chain drafters (serving/decode/draft_batch.py Drafter: lookup, store) whose steps and accepted tokens are counted.
CHAIN_SOURCES = ("lookup", "store")


def alpha_tau(accepted_tokens: int, drafted_tokens: int, speculative_steps: int) -> tuple[float, float]:
    """(alpha, tau) from the counts (module doc): the one definition."""
    alpha = accepted_tokens / drafted_tokens if drafted_tokens else 0.0
    tau = (accepted_tokens + speculative_steps) / speculative_steps if speculative_steps else 0.0
    return alpha, tau


@dataclass
class DecodeStats:
    steps: int = 0  # verify steps (speculative and plain)
    drafted_tokens: int = 0  # speculative steps * tree.max_depth
    accepted_tokens: int = 0  # accepted draft tokens, counted before any stop truncation
    accepted_per_position: list[int] = field(default_factory=list)  # [D] steps that accepted depth d+1
    prefill_s: float = 0.0
    prefill_reused_tokens: int = 0  # prompt positions kept from the cache of the turn it continues (not run)
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
    # Chains are merged into the heads' tree (serving/decode/draft_batch.py join): an accepted token that a
    # chain shares with the heads' tree or another chain counts for each of them.
    lookup_steps: int = 0  # steps that verified an n-gram lookup chain (serving/decode/lookup.py)
    lookup_accepted: int = 0  # draft tokens accepted from lookup chains (part of accepted_tokens)
    store_steps: int = 0  # steps that verified a reply-store chain (serving/decode/store.py)
    store_accepted: int = 0  # draft tokens accepted from reply-store chains (part of accepted_tokens)

    def count_step(self, depth: int, num_accepted: int, seconds: float) -> None:
        """One committed step that drafted `depth` tokens along a path (0: a plain step) and
        accepted num_accepted of them."""
        self.decode_s += seconds
        self.steps += 1
        if depth == 0:  # a plain step (speculation off, probing or fallen back)
            self.plain_steps += 1
            return
        self.drafted_tokens += depth
        self.accepted_tokens += num_accepted
        if len(self.accepted_per_position) < depth:
            self.accepted_per_position += [0] * (depth - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def count_chain(self, source: str, num_accepted: int) -> None:
        """One step that verified a chain from `source` (one of CHAIN_SOURCES), num_accepted of
        its tokens accepted."""
        if source not in CHAIN_SOURCES:
            raise ValueError(f"chain source must be one of {CHAIN_SOURCES}, got {source!r}")
        setattr(self, f"{source}_steps", getattr(self, f"{source}_steps") + 1)
        setattr(self, f"{source}_accepted", getattr(self, f"{source}_accepted") + num_accepted)

    @property
    def speculative_steps(self) -> int:
        """Verify steps that drafted (tau's denominator)."""
        return self.steps - self.plain_steps

    @property
    def alpha(self) -> float:
        return alpha_tau(self.accepted_tokens, self.drafted_tokens, self.speculative_steps)[0]

    @property
    def tau(self) -> float:
        return alpha_tau(self.accepted_tokens, self.drafted_tokens, self.speculative_steps)[1]

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
            prefill_reused_tokens=self.prefill_reused_tokens + other.prefill_reused_tokens,
            decode_s=self.decode_s + other.decode_s, num_new_tokens=self.num_new_tokens + other.num_new_tokens,
            lossless=self.lossless and other.lossless, plain_steps=self.plain_steps + other.plain_steps,
            fallback=self.fallback or other.fallback, fallbacks=self.fallbacks + other.fallbacks,
            lookup_steps=self.lookup_steps + other.lookup_steps,
            lookup_accepted=self.lookup_accepted + other.lookup_accepted,
            store_steps=self.store_steps + other.store_steps, store_accepted=self.store_accepted + other.store_accepted)


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens only; ends with the EOS token or the stop sequence when finish_reason == "stop"
    finish_reason: str  # "stop" | "length" | "error" (the engine ended this sequence alone)
    stats: DecodeStats
    lossless: bool = True  # False when the output does not follow the target's distribution (typical acceptance)
    error: str | None = None  # finish_reason "error": the exception's type and message (serving/decode/engine.py)
    # SequenceRequest.logprobs set: one serving/decode/logprobs.py TokenLogprob per token in `tokens`;
    # prompt_logprobs: one per prompt token, None for the first
    logprobs: list | None = None
    prompt_logprobs: list | None = None
