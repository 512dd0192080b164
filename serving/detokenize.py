"""Incremental detokenization with string stop sequences, for streaming text.

Decoding each new token alone is wrong for two common tokenizer families:
- byte-level BPE (GPT-2 style) and byte-fallback SentencePiece split one multi-byte UTF-8
  character over several tokens; decoded alone, each part comes out as U+FFFD;
- SentencePiece-style (Metaspace) decoders strip the leading space of the first token, so
  the decode of a suffix is not the suffix of the decode.

`IncrementalDetokenizer` therefore decodes a short window with left context (vLLM / TGI's
prefix and read offsets): text = decode(tokens[prefix:]) minus decode(tokens[prefix:read]).
When the window's text ends in U+FFFD the tail may be an incomplete character, so it is held
back until a later token completes it (or `finish()`). Each push decodes only the tokens
since the last stable point plus one chunk of context, so streaming stays linear in the
output length (a model that keeps emitting bytes that never form a character grows the
window until they do; real text does not).

Stop strings: emitted text never contains a stop string (OpenAI semantics). Any tail that
could be the start of one is held back until it is resolved; when one appears, `stopped`
becomes True, the text ends right before it and `stop_token_index` says how many pushed
tokens were needed to complete it, so a caller can cut its token list there.

`stream_text` runs a `SpeculativeDecoder` and turns its token deltas into `TextDelta`s,
closing the decode as soon as a stop string matched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

from specheads.serving.stats import GenerationResult

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as left context for the first generated tokens (leading-space rules).
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns pushed token ids into safe-to-emit text; see the module docstring.

    tokenizer: a Hugging Face tokenizer (anything with `decode(ids, skip_special_tokens=)`
    and `all_special_ids`). prompt_ids: the prompt, used only as left context so the first
    generated token decodes as it would after the prompt. stop: stop strings (non-empty).
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int] | None = None, stop: Sequence[str] = (),
                 skip_special_tokens: bool = True):
        if isinstance(stop, str):
            stop = (stop,)
        stop = tuple(stop)
        for index, item in enumerate(stop):
            if not isinstance(item, str):
                raise TypeError(f"stop[{index}] must be a str, got {type(item).__name__}")
            if not item:
                raise ValueError(f"stop[{index}] is an empty string; stop strings must be non-empty "
                                 "(an empty stop would match before any text)")
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        # With skip_special_tokens the decoder drops special ids before decoding, so they are
        # dropped here too: windows then never start on a token that decodes to nothing.
        self._special = frozenset(getattr(tokenizer, "all_special_ids", ()) or ()) if skip_special_tokens \
            else frozenset()
        context = [int(t) for t in (prompt_ids or [])[-PROMPT_CONTEXT_TOKENS:] if int(t) not in self._special]
        self._ids: list[int] = context  # decodable ids: prompt context, then generated ids
        self._pushed_at: list[int] = [0] * len(context)  # per id: pushed tokens up to and including it
        self._prefix = 0  # window start (left context)
        self._read = len(context)  # end of the stable (already decoded) part
        self._num_pushed = 0
        self._pending = ""  # stable text held back because it may start a stop string
        self._chunks: list[str] = []
        self._max_stop = max((len(s) for s in stop), default=0)
        self.stopped = False
        self.stop_token_index: int | None = None
        self.stop_string: str | None = None

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self._ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add generated tokens; -> the text that became safe to emit ("" after a stop)."""
        if self.stopped:
            return ""
        for token in token_ids:
            self._num_pushed += 1
            token = int(token)
            if token not in self._special:
                self._ids.append(token)
                self._pushed_at.append(self._num_pushed)
        if len(self._ids) == self._read:
            return ""
        prefix_text = self._decode(self._prefix, self._read)
        new_text = self._decode(self._prefix, len(self._ids))
        if new_text.endswith(REPLACEMENT_CHAR) or not new_text.startswith(prefix_text):
            return ""  # an incomplete character (or an unsettled context): wait for more tokens
        return self._advance(new_text[len(prefix_text):], len(prefix_text))

    def finish(self) -> str:
        """Flush the held-back text (incomplete characters decode as U+FFFD), never past a stop."""
        if self.stopped:
            return ""
        out = ""
        if len(self._ids) > self._read:
            prefix_text = self._decode(self._prefix, self._read)
            new_text = self._decode(self._prefix, len(self._ids))
            out = self._advance(new_text[len(prefix_text):], len(prefix_text))
        if not self.stopped and self._pending:
            out += self._pending
            self._chunks.append(self._pending)
            self._pending = ""
        return out

    def _advance(self, stable: str, prefix_chars: int) -> str:
        """Tokens up to len(_ids) are stable and add `stable`; -> text to emit now."""
        window_start, window_read = self._prefix, self._read
        self._prefix, self._read = self._read, len(self._ids)
        if not self.stop:
            self._chunks.append(stable)
            return stable
        buffer = self._pending + stable
        match = self._find_stop(buffer)
        if match is not None:
            index, stop_string = match
            out = buffer[:index]
            self._chunks.append(out)
            self.stopped = True
            self.stop_string = stop_string
            # The stop's end, in chars of the window's text (decoded from window_start).
            end_in_window = prefix_chars + index + len(stop_string) - len(self._pending)
            self.stop_token_index = self._tokens_to_reach(window_start, window_read, end_in_window)
            self._pending = ""
            return out
        keep = self._stop_prefix_len(buffer)
        out = buffer[:len(buffer) - keep]
        self._pending = buffer[len(buffer) - keep:]
        self._chunks.append(out)
        return out

    def _find_stop(self, buffer: str) -> tuple[int, str] | None:
        """The earliest stop string in buffer (the longest one on a tie), as (index, stop)."""
        best = None
        for stop in self.stop:
            index = buffer.find(stop)
            if index >= 0 and (best is None or index < best[0] or (index == best[0] and len(stop) > len(best[1]))):
                best = (index, stop)
        return best

    def _stop_prefix_len(self, buffer: str) -> int:
        """Length of the longest tail of buffer that is a proper prefix of some stop string."""
        for length in range(min(len(buffer), self._max_stop - 1), 0, -1):
            tail = buffer[len(buffer) - length:]
            if any(stop.startswith(tail) for stop in self.stop):
                return length
        return 0

    def _tokens_to_reach(self, window_start: int, window_read: int, end_chars: int) -> int:
        """Pushed tokens needed until the window's text (decoded from window_start) has its
        first end_chars chars settled. The stop ends inside ids[window_read:], so each end point
        there is tried (a handful of tokens, once per request).
        """
        full = self._decode(window_start, len(self._ids))
        target = end_chars
        for end in range(window_read + 1, len(self._ids) + 1):
            text = self._decode(window_start, end)
            if len(text) >= target and text[:target] == full[:target]:
                return self._pushed_at[end - 1]
        return self._num_pushed


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
    stream = decoder.stream(prompt_ids, max_new_tokens, eos_token_id, sampling=sampling, speculate=speculate)
    tokens: list[int] = []
    for delta in stream:
        text = detokenizer.push(delta)
        if detokenizer.stopped:
            keep = detokenizer.stop_token_index - len(tokens)
            tokens.extend(delta[:keep])
            yield TextDelta(list(delta[:keep]), text)
            return _stopped_result(stream, tokens)
        tokens.extend(delta)
        if delta or text:
            yield TextDelta(list(delta), text)
    tail = detokenizer.finish()
    result = stream.result
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
