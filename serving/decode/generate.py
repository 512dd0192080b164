"""One request, decoded on its own: `generate` (the result) and `stream` (token deltas as they
come). Both run it as a batch of one through serving/decode/engine.py's `BatchEngine`, the
same path the server batches requests on; nothing imports this module back.
"""

from __future__ import annotations

import torch

from specheads.serving.decode.config import SpeculativeDecoder
from specheads.serving.decode.engine import BatchEngine
from specheads.serving.decode.sequence import Sequence, SequenceRequest
from specheads.serving.decode.sampling import SamplingParams
from specheads.serving.decode.stats import GenerationResult


def stream(decoder: SpeculativeDecoder, input_ids: list[int] | torch.Tensor, max_new_tokens: int,
           eos_token_id: int | list[int] | None = None, *, sampling: SamplingParams | None = None,
           stop_token_sequences: list[list[int]] | None = None, acceptance: str = "rejection",
           speculate: bool = True) -> "DecodeStream":
    """Like generate, but an iterator of token deltas (list[int]: the prefill's first token,
    then one list per verify step); `.result` holds the GenerationResult once exhausted."""
    request = SequenceRequest(input_ids, max_new_tokens, eos_token_id, sampling, stop_token_sequences,
                              speculate, acceptance)
    if isinstance(max_new_tokens, int) and max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    prompt_len = int(torch.as_tensor(input_ids).reshape(-1).shape[0])
    engine = BatchEngine(decoder, max_batch_size=1,
                         max_cache_len=prompt_len + int(max_new_tokens) + decoder.max_tree_nodes)
    return DecodeStream(engine, engine.check(request))


def generate(decoder: SpeculativeDecoder, input_ids: list[int] | torch.Tensor, max_new_tokens: int,
             eos_token_id: int | list[int] | None = None, *, sampling: SamplingParams | None = None,
             stop_token_sequences: list[list[int]] | None = None, acceptance: str = "rejection",
             speculate: bool = True) -> GenerationResult:
    """Decode up to max_new_tokens new tokens.

    sampling: None or temperature 0 = greedy (the target's own greedy output); otherwise
    lossless tree rejection sampling (serving/decode/sampling.py) with the heads' top-k
    candidates, seeded by sampling.seed. acceptance="typical" (sampling only) is Medusa-2's
    lossy rule; the result then has lossless=False. stop_token_sequences: the output ends
    right after the first occurrence of any of them (finish_reason "stop"). speculate=False:
    plain decoding (one target token per step), the heads unused.
    """
    tokens = stream(decoder, input_ids, max_new_tokens, eos_token_id, sampling=sampling,
                    stop_token_sequences=stop_token_sequences, acceptance=acceptance, speculate=speculate)
    for _ in tokens:
        pass
    return tokens.result


class DecodeStream:
    """Iterator of token deltas (list[int]): the prefill's first token, then one list per
    verify step. `result` is the GenerationResult once exhausted (or closed)."""

    def __init__(self, engine: BatchEngine, seq: Sequence):
        self.engine, self.seq = engine, seq
        self._started = False
        self.result: GenerationResult | None = None

    def __iter__(self):
        return self

    def __next__(self) -> list[int]:
        if self.result is not None:
            raise StopIteration
        seq = self.seq
        if not self._started:
            self._started = True
            return self.engine.add(seq)
        if seq.finish_reason is not None:
            self.result = seq.result()
            raise StopIteration
        tokens = self.engine.step()[seq.seq_id]
        if seq.error is not None:  # the engine ended it alone; a caller of one sequence gets the error itself
            self.result = seq.result()
            raise seq.error
        return tokens

    def close(self) -> GenerationResult:
        """Stop decoding now; -> the result so far (finish_reason "stop" unless it had already
        finished), with the decoder's own stats. A caller that cut the output (a stop string
        in the text) replaces the tokens."""
        if self.result is None:
            self.result = self.seq.close()
        return self.result


def generate_many(decoder: SpeculativeDecoder, prompts: list[list[int]], max_new_tokens: int,
                  eos_token_id: int | list[int] | None = None, *, max_batch_size: int = 32,
                  on_result=None, max_prompt_len: int | None = None,
                  sampling: list[SamplingParams | None] | None = None,
                  prefill_group: int | None = None) -> list[GenerationResult]:
    """Decode many prompts with continuous batching (serving/decode/scheduler.py): up to
    max_batch_size sequences share each target forward, and a finished sequence's row takes
    the next prompt at once. -> one GenerationResult per prompt, in prompt order; each is
    what `generate` gives that prompt alone (greedy, or with sampling[i] for prompt i: give
    each a seed for a reproducible draw; None is greedy).

    on_result(index, result) is called as each one ends; when it returns a prompt (a list of
    token ids), that prompt is decoded too, as index len(prompts so far), at once in the row
    the finished sequence leaves: a conversation's next turn. Its prefill runs only what it
    adds to the context that row caches, as far as the new prompt repeats it token for token
    (BatchEngine.add, `continues`).
    A sequence the engine ends alone (finish_reason "error") raises SequenceFailed: an
    offline job must not keep a reply cut short by a fault. max_prompt_len sizes the KV
    cache (default: the longest of `prompts`); a later prompt longer than that is refused
    with a ValueError.

    prefill_group: admit new prompts (follow-ups too) only once this many rows are free (or
    nothing is left to wait for), with one prefill forward for the group
    (BatchEngine.add_many); a follow-up then prefills its whole context in a new row rather
    than continuing its finished row. That pays where a forward costs its launches more
    than its tokens: on a GPU, where an eager forward of SmolLM2 costs about 23 ms whatever
    it holds. Default: max_batch_size // 8 on a GPU; 1 on a CPU (each prompt prefilled
    alone, as soon as a row is free; a follow-up continues its row)."""
    from specheads.serving.decode.faults import SequenceFailed
    from specheads.serving.decode.scheduler import Scheduler

    if max_new_tokens < 1 or max_batch_size < 1:
        raise ValueError(f"max_new_tokens and max_batch_size must be >= 1, got {max_new_tokens} and {max_batch_size}")
    if not prompts:
        return []
    if sampling is not None and len(sampling) != len(prompts):
        raise ValueError(f"sampling must give one SamplingParams (or None) per prompt: {len(sampling)} for "
                         f"{len(prompts)} prompts")
    max_prompt_len = max(max(map(len, prompts)), max_prompt_len or 0)
    if prefill_group is None:
        prefill_group = max(1, max_batch_size // 8) if decoder.target.device.type == "cuda" else 1
    if not 1 <= prefill_group <= max_batch_size:
        raise ValueError(f"prefill_group must be in [1, max_batch_size={max_batch_size}], got {prefill_group}")
    continuing = on_result is not None and prefill_group == 1
    scheduler = Scheduler(decoder, max_batch_size=max_batch_size,
                          max_cache_len=max_prompt_len + max_new_tokens + decoder.max_tree_nodes,
                          keep_finished=continuing)
    seen = [list(prompt) for prompt in prompts]  # every prompt so far, in index order (follow-ups last)
    results: list[GenerationResult | None] = [None] * len(seen)
    unread, index_of = iter(range(len(seen))), {}

    def request(index: int) -> SequenceRequest:
        params = sampling[index] if sampling is not None and index < len(sampling) else None  # follow-ups: greedy
        return SequenceRequest(seen[index], max_new_tokens, eos_token_id, params)

    def admit(index: int, continues: int | None = None) -> None:
        index_of[scheduler.add(request(index), continues)] = index

    waiting: list[int] = []  # follow-ups to admit (prefill_group > 1), before any unread prompt
    while True:
        free = scheduler.max_batch_size - scheduler.num_active
        if prefill_group == 1:
            while scheduler.has_capacity:
                index = next(unread, None)
                if index is None:
                    break
                admit(index)
        elif free >= prefill_group or not scheduler.num_active:
            while len(waiting) < free and (index := next(unread, None)) is not None:
                waiting.append(index)
            group, waiting = waiting[:free], waiting[free:]
            if group:
                for index, seq_id in zip(group, scheduler.add_many([request(index) for index in group])):
                    index_of[seq_id] = index
        if not scheduler.num_active:
            return results
        for update in scheduler.step():
            if not update.finished:
                continue
            index = index_of.pop(update.seq_id)
            if update.result.finish_reason == "error":
                raise SequenceFailed(f"prompt {index}: {update.result.error}")
            results[index] = update.result
            follow_up = on_result(index, update.result) if on_result is not None else None
            if follow_up is not None:
                seen.append(list(follow_up))
                results.append(None)
                if prefill_group > 1:
                    waiting.append(len(seen) - 1)
                else:
                    admit(len(seen) - 1, update.seq_id if continuing else None)
            elif continuing:
                scheduler.release(update.seq_id)
