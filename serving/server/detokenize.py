"""Incremental detokenization with string stop sequences, for streaming text.

Decoding each new token alone is wrong for two common tokenizer families:
- byte-level BPE (GPT-2 style) and byte-fallback SentencePiece split one multi-byte UTF-8
  character over several tokens; decoded alone, each part comes out as U+FFFD;
- SentencePiece-style (Metaspace) decoders strip the leading space of the first token, so
  the decode of a suffix is not the suffix of the decode.

Both are solved by decoding a short window with left context and emitting only what the new
tokens add, holding back text that ends in U+FFFD (an incomplete character) until a later
token completes it or `finish()` flushes it. Two text sources do this, token by token:

- `DecodeStreamText`, for fast tokenizers (`backend_tokenizer`, tokenizers >= 0.21.1): the
  tokenizers library's own `DecodeStream` (Rust; vLLM's FastIncrementalDetokenizer uses it),
  primed with the shortest prompt suffix that decodes to clean text, so the first generated
  token gets the leading space it has after the prompt.
- `WindowText`, the same window kept in Python (vLLM / TGI's prefix and read offsets) on top
  of `tokenizer.decode`. It is used for slow tokenizers, for tokenizers without DecodeStream,
  and where DecodeStream was measured to differ from `tokenizer.decode(ids)`: DecodeStream
  runs only the backend's decoder, so it misses what transformers' `decode()` does after it.
  That is `clean_up_tokenization_spaces` on a non-BPE model (WordPiece, Unigram: "a , b ."
  decodes to "a, b."; transformers >= 5 skips it for BPE) and any `_decode` override (CPM).
  `decode_stream_matches` detects both by decoding a probe text both ways
  (tests/serving/server/test_detokenize.py::test_cleanup_tokenizers_keep_the_window).

Neither source matches decode() for a byte-fallback run of bytes that is not valid UTF-8:
decode() then turns the run's earlier, valid bytes into U+FFFD too, after they were emitted.
DecodeStream raises "Invalid prefix" there (vLLM resets its stream, its issue 17448);
`DecodeStreamText` restarts from the tokens not yet emitted, so no text is lost.

Stop strings: emitted text never contains a stop string (OpenAI semantics). Any tail that
could be the start of one is held back until it is resolved; when one appears, `stopped`
becomes True, the text ends right before it and `stop_token_index` says how many pushed
tokens were needed to complete it, so a caller can cut its token list there.

serving/server/text_stream.py's `stream_text` runs one request through it.
"""

from __future__ import annotations

import weakref
from bisect import bisect_left
from typing import Sequence

import tokenizers
from packaging.version import Version
from tokenizers import Tokenizer


# Older tokenizers lack DecodeStream or mis-decode with it (vLLM requires the same version).
HAS_DECODE_STREAM = Version(tokenizers.__version__) >= Version("0.21.1")
if HAS_DECODE_STREAM:
    from tokenizers.decoders import DecodeStream

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as left context for the first generated tokens (leading-space rules).
PROMPT_CONTEXT_TOKENS = 5
# DecodeStream's prompt seed: the shortest suffix of at most this many tokens with clean text.
MAX_SEED_TOKENS = 24
# Text that transformers' decode() changes when it cleans up tokenization spaces.
CLEANUP_PROBE = "a , b . c ! d ? e 's f n't g 've"
INVALID_PREFIX = "Invalid prefix encountered"  # DecodeStream's error when a token rewrote emitted text
# What transformers' clean_up_tokenization rewrites (each loses its space), as of 4.x and 5.x.
CLEANUP_PATTERNS = (" .", " ?", " !", " ,", " ' ", " n't", " 'm", " 's", " 've", " 're")


_MATCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> decode_stream_matches


def decode_stream_matches(tokenizer) -> bool:
    """True when tokenizers' DecodeStream gives this tokenizer's decode() text: a fast
    tokenizer whose decode() adds nothing to its backend's decoder on the probe text.
    Probed once per tokenizer object, not once per request."""
    try:
        return _MATCHES[tokenizer]
    except (KeyError, TypeError):  # TypeError: an object that takes no weak reference
        pass
    backend = getattr(tokenizer, "backend_tokenizer", None)
    matches = HAS_DECODE_STREAM and isinstance(backend, Tokenizer)
    if matches:
        ids = backend.encode(CLEANUP_PROBE, add_special_tokens=False).ids
        matches = tokenizer.decode(ids) == backend.decode(ids)
    try:
        _MATCHES[tokenizer] = matches
    except TypeError:
        pass
    return matches


def make_text_source(tokenizer, prompt_ids: Sequence[int] | None, skip_special_tokens: bool):
    """The text source for this tokenizer (see the module docstring)."""
    prompt_ids = [int(t) for t in list(prompt_ids if prompt_ids is not None else ())[-MAX_SEED_TOKENS:]]
    if decode_stream_matches(tokenizer):
        return DecodeStreamText(tokenizer.backend_tokenizer, prompt_ids, skip_special_tokens)
    return WindowText(tokenizer, prompt_ids, skip_special_tokens)


class DecodeStreamText:
    """Per-token text from tokenizers' DecodeStream.

    step(token) -> the text it made stable ("" while held); flush() -> the held text, as
    decode() gives it. `_window` is the ids from the emission point before the last one, so
    flush() has left context; `_window[:_num_settled]` is text already returned.
    """

    def __init__(self, backend, prompt_ids: list[int], skip_special_tokens: bool):
        self._backend = backend
        self._skip = skip_special_tokens
        seed = self._seed(prompt_ids)
        self._stream = self._stream_after(seed)
        self._window = seed
        self._num_settled = len(seed)

    def _seed(self, prompt_ids: list[int]) -> list[int]:
        """The shortest prompt suffix that decodes to non-empty text without U+FFFD: one that
        starts on a character boundary and holds a token that is not skipped, so the first
        generated token decodes as it does after the whole prompt."""
        for length in range(1, len(prompt_ids) + 1):
            seed = prompt_ids[len(prompt_ids) - length:]
            text = self._backend.decode(seed, skip_special_tokens=self._skip)
            if text and REPLACEMENT_CHAR not in text:
                return seed
        return prompt_ids  # no clean suffix (an all-special prompt, a broken character): all of it

    def _stream_after(self, ids: list[int]):
        """A stream whose next step decodes as after ids (a prompt seed, flushed text)."""
        stream = DecodeStream(skip_special_tokens=self._skip)
        for token in ids:
            try:
                stream.step(self._backend, token)
            except Exception as error:  # the ids hold a broken byte run: start after it
                if INVALID_PREFIX not in str(error):
                    raise
                stream = DecodeStream(skip_special_tokens=self._skip)
                stream.step(self._backend, token)
        return stream

    def step(self, token: int) -> str:
        self._window.append(token)
        try:
            text = self._stream.step(self._backend, token)
        except Exception as error:  # tokenizers raises a bare Exception
            if INVALID_PREFIX not in str(error):
                raise
            return self._restart()
        if text is None:
            return ""
        self._window = self._window[self._num_settled:]
        self._num_settled = len(self._window)
        return text

    def _restart(self) -> str:
        """The last token rewrote emitted text (see the module docstring): decode the tokens
        not yet emitted in a fresh stream. Its first step cannot raise (its prefix is empty),
        so each nested restart starts later and this ends."""
        pending = self._window[self._num_settled:]
        self._window = self._window[:self._num_settled]
        self._stream = DecodeStream(skip_special_tokens=self._skip)
        return "".join(self.step(token) for token in pending)

    def flush(self) -> str:
        if len(self._window) == self._num_settled:
            return ""
        settled = self._backend.decode(self._window[:self._num_settled], skip_special_tokens=self._skip)
        text = self._backend.decode(self._window, skip_special_tokens=self._skip)
        self._num_settled = len(self._window)
        self._stream = self._stream_after(self._window)  # later steps continue after the flushed text
        return text[len(settled):]


def may_be_cleaned_up(text: str) -> bool:
    """True when text ends in a proper prefix of a clean-up pattern, so the next token could
    make decode() rewrite that end ("don '" + "t" decodes to "don't")."""
    return any(len(tail) < len(pattern) and pattern.startswith(tail)
               for tail in (text[-3:], text[-2:], text[-1:]) if tail for pattern in CLEANUP_PATTERNS)


class WindowText:
    """Per-token text from `tokenizer.decode` over a window with left context.

    text = decode(ids) minus decode(ids[:read]); ids start at the previous emission point.
    With clean_up_tokenization_spaces, text that clean-up could still rewrite is held too.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # With skip_special_tokens the decoder drops special ids before decoding, so they are
        # dropped here too: windows then never start on a token that decodes to nothing.
        self._special = frozenset(getattr(tokenizer, "all_special_ids", ()) or ()) if skip_special_tokens \
            else frozenset()
        self._ids = [t for t in prompt_ids if t not in self._special][-PROMPT_CONTEXT_TOKENS:]
        self._read = len(self._ids)  # ids[:read] is text already returned
        self._read_text = self._decode(self._ids)
        self._cleanup = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def step(self, token: int) -> str:
        if token in self._special:
            return ""
        self._ids.append(token)
        text = self._decode(self._ids)
        if text.endswith(REPLACEMENT_CHAR) or (self._cleanup and may_be_cleaned_up(text)):
            return ""  # an incomplete character, or a space clean-up may remove: wait for more tokens
        return self._advance(text)

    def flush(self) -> str:
        """The held text; incomplete characters decode as U+FFFD."""
        if len(self._ids) == self._read:
            return ""
        return self._advance(self._decode(self._ids))

    def _advance(self, text: str) -> str:
        common = len(self._read_text)
        if not text.startswith(self._read_text):  # the last token rewrote text already returned
            # (an invalid byte run, a clean-up chain): what follows the common part is new
            common = next((i for i, (a, b) in enumerate(zip(text, self._read_text)) if a != b),
                          min(len(text), common))
        new_text = text[common:]
        self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        self._read_text = self._decode(self._ids)
        return new_text


class IncrementalDetokenizer:
    """Turns pushed token ids into safe-to-emit text; see the module docstring.

    tokenizer: a Hugging Face tokenizer (anything with `decode(ids, skip_special_tokens=)`
    and `all_special_ids`). prompt_ids: the prompt, used only as left context so the first
    generated token decodes as it would after the prompt. stop: stop strings (non-empty).
    `source` is the text source chosen for the tokenizer (DecodeStreamText or WindowText).
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
        self.source = make_text_source(tokenizer, prompt_ids, skip_special_tokens)
        self._num_chars = 0  # stable text so far: emitted, then pending
        self._token_ends: list[int] = []  # per pushed token: _num_chars once it was decoded
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

    def push(self, token_ids: Sequence[int]) -> str:
        """Add generated tokens; -> the text that became safe to emit ("" after a stop)."""
        if self.stopped:
            return ""
        pieces = []
        for token in token_ids:
            piece = self.source.step(int(token))
            pieces.append(piece)
            self._num_chars += len(piece)
            self._token_ends.append(self._num_chars)
        return self._release("".join(pieces))

    def finish(self) -> str:
        """Flush the held-back text (incomplete characters decode as U+FFFD), never past a stop."""
        if self.stopped:
            return ""
        tail = self.source.flush()
        if tail:  # it belongs to the last token: none before it completed it
            self._num_chars += len(tail)
            self._token_ends[-1] = self._num_chars
        out = self._release(tail)
        if not self.stopped and self._pending:
            out += self._pending
            self._chunks.append(self._pending)
            self._pending = ""
        return out

    def _release(self, stable: str) -> str:
        """`stable` is the newest stable text; -> the text to emit now."""
        if not self.stop:
            if stable:
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
            stop_end = self._num_chars - len(buffer) + index + len(stop_string)  # in chars of all stable text
            self.stop_token_index = bisect_left(self._token_ends, stop_end) + 1
            self._pending = ""
            return out
        keep = self._stop_prefix_len(buffer)
        out = buffer[:len(buffer) - keep]
        self._pending = buffer[len(buffer) - keep:]
        if out:
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
