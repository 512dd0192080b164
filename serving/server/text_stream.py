"""One request's output as text: `stream_text` runs a `SpeculativeDecoder` through
serving/decode/generate.py's `stream` and turns its token deltas into `TextDelta`s with an
`IncrementalDetokenizer` (serving/server/detokenize.py), closing the decode as soon as a stop
string matched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

from specheads.serving.decode.generate import stream
from specheads.serving.decode.stats import GenerationResult
from specheads.serving.server.detokenize import IncrementalDetokenizer


@dataclass
class TextDelta:
    token_ids: list[int]  # the new tokens of this step (cut at a stop string)
    text: str  # the new text they made safe to emit


class TextStream:
    """Iterator of TextDelta; `.result` (GenerationResult) is set once it is exhausted."""

    def __init__(self, deltas: Iterator[TextDelta]):
        self._deltas = deltas
        self.result: GenerationResult | None = None

    def __iter__(self) -> "TextStream":
        return self

    def __next__(self) -> TextDelta:
        try:
            return next(self._deltas)
        except StopIteration as stop:
            self.result = stop.value
            raise


def stream_text(decoder, tokenizer, prompt_ids: Sequence[int], max_new_tokens: int, *, stop: Sequence[str] = (),
                eos_token_id: int | list[int] | None = None, sampling=None, speculate: bool = True,
                skip_special_tokens: bool = True) -> TextStream:
    """Stream a SpeculativeDecoder's output as text deltas, ending at the first stop string.

    The last delta carries the text flushed by finish(). `.result.tokens` is cut right after
    the token that completed the stop string (finish_reason "stop"); the text excludes it.
    """
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop, skip_special_tokens)  # validates stop
    return TextStream(_text_deltas(decoder, detokenizer, list(prompt_ids), max_new_tokens, eos_token_id,
                                   sampling, speculate))


def _text_deltas(decoder, detokenizer: IncrementalDetokenizer, prompt_ids: list[int], max_new_tokens: int,
                 eos_token_id, sampling, speculate: bool):
    decoding = stream(decoder, prompt_ids, max_new_tokens, eos_token_id, sampling=sampling, speculate=speculate)
    tokens: list[int] = []
    for delta in decoding:
        text = detokenizer.push(delta)
        if detokenizer.stopped:
            keep = detokenizer.stop_token_index - len(tokens)
            tokens.extend(delta[:keep])
            yield TextDelta(list(delta[:keep]), text)
            return _stopped_result(decoding, tokens)
        tokens.extend(delta)
        if delta or text:
            yield TextDelta(list(delta), text)
    tail = detokenizer.finish()
    result = decoding.result
    if detokenizer.stopped:  # the stop string only settled in the flushed tail
        tokens = tokens[:detokenizer.stop_token_index]
        result = GenerationResult(tokens=tokens, finish_reason="stop", stats=result.stats, lossless=result.lossless)
        result.stats.num_new_tokens = len(tokens)
    if tail:
        yield TextDelta([], tail)
    return result


def _stopped_result(stream, tokens: list[int]) -> GenerationResult:
    """The result of a decode closed at a stop string: the decoder's own stats, tokens cut."""
    partial = stream.close()
    partial.stats.num_new_tokens = len(tokens)
    return GenerationResult(tokens=tokens, finish_reason="stop", stats=partial.stats, lossless=partial.lossless)
