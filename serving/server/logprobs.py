"""Token logprobs in OpenAI's response shapes (the engine's scores: serving/decode/logprobs.py).

The engine scores token ids; the worker turns each score into a `ScoredToken` (the token's
text and bytes, its logprob, the top tokens') and the responses shape them:
- chat: `choices[].logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs":
  [{"token", "logprob", "bytes"}]}]}`, `top_logprobs` the request's K most likely tokens;
- completions: `choices[].logprobs = {"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}`, each top_logprobs entry a {token: logprob} dict of the K most likely
  tokens plus the chosen one (so K = 0 still names it), as OpenAI and vLLM do; with `echo`
  the prompt's tokens come first, the first with null logprob and null top_logprobs.
  `text_offset` is each token's offset in the choice's text, counted as the lengths of the
  token strings before it (vLLM's rule), streamed or not.

A token's text is `tokenizer.decode([id])` (vLLM's choice); its `bytes` are the token's own
bytes where the tokenizer says what they are (byte-level BPE, byte-fallback `<0xNN>` pieces),
so a character split over several tokens is rebuilt by joining their bytes; otherwise the
UTF-8 of its text. A logprob of -inf (a masked token) is sent as -9999.0, OpenAI's value.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from specheads.serving.decode.logprobs import TokenLogprob

MAX_LOGPROBS = 20  # top tokens per position: OpenAI's chat limit and vLLM's default --max-logprobs
LOGPROB_FLOOR = -9999.0  # what OpenAI sends for a token too unlikely to score (and JSON has no -inf)
REPLACEMENT_CHAR = "\ufffd"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback pieces


@dataclass(frozen=True)
class TokenPiece:
    text: str
    bytes: list[int]


@dataclass(frozen=True)
class ScoredToken:
    """One token's score, ready to shape. logprob None: the prompt's first token (no score)."""

    piece: TokenPiece
    logprob: float | None
    top: tuple[tuple[TokenPiece, float], ...]  # the K most likely tokens, most likely first


class TokenText:
    """Token id -> its text and bytes (module doc), cached per id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._pieces: dict[int, TokenPiece] = {}
        self._byte_of_char: dict[str, int] | None = None

    def __call__(self, token_id: int) -> TokenPiece:
        piece = self._pieces.get(token_id)
        if piece is None:
            text = self.tokenizer.decode([token_id])
            raw = REPLACEMENT_CHAR in text and self._raw_bytes(token_id)
            piece = self._pieces[token_id] = TokenPiece(text, list(raw or text.encode("utf-8")))
        return piece

    def _raw_bytes(self, token_id: int) -> bytes | None:
        """The bytes of a token whose text is an incomplete character, where the vocab spells them."""
        token = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(token, str):
            return None
        match = _BYTE_PIECE.fullmatch(token)
        if match:
            return bytes([int(match.group(1), 16)])
        if self._byte_of_char is None:
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self._byte_of_char = {char: byte for byte, char in bytes_to_unicode().items()}
        if token and all(char in self._byte_of_char for char in token):  # byte-level BPE (GPT-2's alphabet)
            return bytes(self._byte_of_char[char] for char in token)
        return None

    def score(self, entry: TokenLogprob | None, token_id: int) -> ScoredToken:
        """An engine score (None: the prompt's first token) -> a ScoredToken."""
        if entry is None:
            return ScoredToken(self(token_id), None, ())
        return ScoredToken(self(entry.token), entry.logprob, tuple((self(t), value) for t, value in entry.top))


def _floor(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def chat_logprobs(scored: list[ScoredToken]) -> dict:
    """Chat's `logprobs` object for these tokens (every one has a logprob)."""
    return {"content": [{"token": s.piece.text, "logprob": _floor(s.logprob), "bytes": s.piece.bytes,
                         "top_logprobs": [{"token": piece.text, "logprob": _floor(value), "bytes": piece.bytes}
                                          for piece, value in s.top]}
                        for s in scored]}


def completion_logprobs(scored: list[ScoredToken], text_offset: int) -> tuple[dict, int]:
    """Completions' `logprobs` object for these tokens, the first at text_offset -> (it, the
    offset after the last token)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for s in scored:
        tokens.append(s.piece.text)
        offsets.append(text_offset)
        text_offset += len(s.piece.text)
        if s.logprob is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_floor(s.logprob))
        top = {piece.text: _floor(value) for piece, value in s.top}
        top.setdefault(s.piece.text, _floor(s.logprob))
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}, text_offset
