"""Side-by-side decoding comparison on one set of prompts: HF `generate` (greedy), the
engine with speculation off, and the engine with heads. Every method decodes the same
prompts with the same limits; outputs are checked against HF greedy token for token.

This is the small table the demo prints; `specheads bench` (bench/harness.py) is the full
harness (per-category metrics, ITL, peers, JSON and plots).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class MethodResult:
    name: str
    num_tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    identical: bool = True
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def alpha(self) -> float | None:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def tau(self) -> float | None:
        return self.num_tokens / self.steps if self.steps else None


def hf_generate(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    input_ids = torch.tensor([prompt_ids], device=model.device)
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                         pad_token_id=eos_token_id if eos_token_id is not None else 0)
    return out[0, len(prompt_ids):].tolist()


def run_hf(model, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None) -> MethodResult:
    result = MethodResult("HF generate (greedy)")
    for prompt in prompts:
        start = time.perf_counter()
        tokens = hf_generate(model, prompt, max_new_tokens, eos_token_id)
        result.seconds += time.perf_counter() - start
        result.num_tokens += len(tokens)
        result.steps += len(tokens)
        result.outputs.append(tokens)
    return result


def run_engine(name: str, decoder, prompts: list[list[int]], max_new_tokens: int,
               eos_token_id: int | None) -> MethodResult:
    result = MethodResult(name)
    for prompt in prompts:
        start = time.perf_counter()
        out = decoder.generate(prompt, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
        result.seconds += time.perf_counter() - start
        result.num_tokens += len(out.tokens)
        result.steps += out.stats.steps
        result.drafted_tokens += out.stats.drafted_tokens
        result.accepted_tokens += out.stats.accepted_tokens
        result.outputs.append(out.tokens)
    return result


def compare(methods: dict, model, prompts: list[list[int]], max_new_tokens: int,
            eos_token_id: int | None, warmup: bool = True) -> list[MethodResult]:
    """methods: name -> decoder (SpeculativeDecoder). HF generate runs first as the reference."""
    if warmup:
        hf_generate(model, prompts[0], 4, eos_token_id)
        for decoder in methods.values():
            decoder.generate(prompts[0], max_new_tokens=4, eos_token_id=eos_token_id)
    reference = run_hf(model, prompts, max_new_tokens, eos_token_id)
    results = [reference]
    for name, decoder in methods.items():
        res = run_engine(name, decoder, prompts, max_new_tokens, eos_token_id)
        res.identical = res.outputs == reference.outputs
        results.append(res)
    return results


def format_table(results: list[MethodResult]) -> str:
    base = results[0].tokens_per_s
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    lines = ["| method | tokens | tokens/s | speedup | alpha | tau | identical to HF greedy |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in results:
        speedup = r.tokens_per_s / base if base else None
        tau = r.tau if r.drafted_tokens else None
        lines.append(f"| {r.name} | {r.num_tokens} | {r.tokens_per_s:.1f} | {fmt(speedup, '.2f')}x | "
                     f"{fmt(r.alpha, '.3f')} | {fmt(tau, '.2f')} | {'yes' if r.identical else 'NO'} |")
    return "\n".join(lines)
