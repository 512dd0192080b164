"""OpenAI response shapes: turning a job's engine events into completion and chat responses.

Non-streaming answers collect every choice; streaming answers are server-sent events in
OpenAI's chunk format, one chunk per text delta, then a chunk carrying each choice's
`finish_reason` (exactly one per choice), then (with `stream_options.include_usage`) a
usage chunk with no choices, then `data: [DONE]`. With logprobs asked, each choice (or
chunk choice) carries the `logprobs` of its tokens (of the tokens since the last chunk) in
OpenAI's shapes (serving/server/logprobs.py); otherwise `logprobs` is null. Speculation
stats are an extension: `speculation` on each finished choice and, summed over choices, on
the response (the non-streaming body, or the usage chunk). With a reasoning parser
(serving/server/reasoning.py), a chat message carries `reasoning_content` beside `content`
(null when it did not reason), and a stream's deltas carry either.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from specheads.serving.decode.stats import alpha_tau
from specheads.serving.server.logprobs import ScoredToken, chat_logprobs, completion_logprobs
from specheads.serving.server.reasoning import ReasoningStream, split_reasoning
from specheads.serving.server.worker import Event


@dataclass
class ResponseMeta:
    """What every response or chunk of one request shares."""
    chat: bool
    model: str
    num_choices: int
    prompt_tokens: int  # summed over the request's distinct prompts
    include_usage: bool = False
    logprobs: bool = False  # the request asked for logprobs
    reasoning_parser: str | None = None  # chat: split reasoning_content off (serving/server/reasoning.py)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.id


def aggregate_speculation(stats: list[dict]) -> dict:
    """Sum per-choice speculation stats; alpha and tau recomputed from the sums
    (serving/decode/stats.py alpha_tau)."""
    steps = sum(s["steps"] for s in stats)
    drafts = sum(s["drafts"] for s in stats)
    drafted = sum(s["drafted_tokens"] for s in stats)
    accepted = sum(s["accepted_tokens"] for s in stats)
    depth = max((len(s["accepted_per_position"]) for s in stats), default=0)
    per_position = [sum(s["accepted_per_position"][d] for s in stats if d < len(s["accepted_per_position"]))
                    for d in range(depth)]
    return {"enabled": any(s["enabled"] for s in stats), "steps": steps, "drafts": drafts,
            "drafted_tokens": drafted, "accepted_tokens": accepted, "accepted_per_position": per_position,
            **dict(zip(("alpha", "tau"), alpha_tau(accepted, drafted, drafts))),
            "fallback": any(s["fallback"] for s in stats),
            "lookup_accepted_tokens": sum(s["lookup_accepted_tokens"] for s in stats),
            "store_accepted_tokens": sum(s["store_accepted_tokens"] for s in stats)}


def _usage(meta: ResponseMeta, completion_tokens: int) -> dict:
    return {"prompt_tokens": meta.prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": meta.prompt_tokens + completion_tokens}


class Collector:
    """Gathers a job's events into per-choice text, finish reasons and stats."""

    def __init__(self, meta: ResponseMeta, keep_scores: bool = True):
        self.meta = meta
        self.keep_scores = keep_scores  # False: a stream, whose scores go out chunk by chunk
        self.texts = [""] * meta.num_choices
        self.finish: list[str | None] = [None] * meta.num_choices
        self.tokens = [0] * meta.num_choices
        self.stats: list[dict | None] = [None] * meta.num_choices
        self.next_offset = [0] * meta.num_choices  # completions: the text_offset of a choice's next streamed token
        self.scores: list[list[ScoredToken]] = [[] for _ in range(meta.num_choices)]

    @property
    def complete(self) -> bool:
        return all(reason is not None for reason in self.finish)

    def add(self, event: Event) -> None:
        self.texts[event.index] += event.text
        if self.keep_scores:
            self.scores[event.index] += event.logprobs or []
        if event.kind == "finish":
            self.finish[event.index] = event.finish_reason
            self.tokens[event.index] = event.num_tokens
            self.stats[event.index] = event.stats

    def body(self) -> dict:
        meta = self.meta
        choices = []
        for index in range(meta.num_choices):
            choice: dict = {"index": index}
            if meta.chat:
                choice["message"] = self.message(index)
            else:
                choice["text"] = self.texts[index]
            choice.update({"logprobs": self.logprobs(index, self.scores[index], 0),
                           "finish_reason": self.finish[index], "speculation": self.stats[index]})
            choices.append(choice)
        return {"id": meta.response_id, "object": "chat.completion" if meta.chat else "text_completion",
                "created": meta.created, "model": meta.model, "choices": choices,
                "usage": _usage(meta, sum(self.tokens)),
                "speculation": aggregate_speculation([s for s in self.stats if s is not None])}

    def message(self, index: int) -> dict:
        """Choice index's chat message: its text, split by the reasoning parser if there is one."""
        if self.meta.reasoning_parser is None:
            return {"role": "assistant", "content": self.texts[index]}
        reasoning, content = split_reasoning(self.texts[index], self.meta.reasoning_parser)
        return {"role": "assistant", "content": content, "reasoning_content": reasoning or None}

    def logprobs(self, index: int, scores: list[ScoredToken], text_offset: int) -> dict | None:
        """Choice index's `logprobs` object for these scores (completions: the first at
        text_offset), or None without logprobs; keeps where the next one's text_offset starts."""
        if not self.meta.logprobs:
            return None
        if self.meta.chat:
            return chat_logprobs(scores)
        shaped, self.next_offset[index] = completion_logprobs(scores, text_offset)
        return shaped


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


class ChunkWriter:
    """Engine events -> SSE lines for one streaming request."""

    def __init__(self, meta: ResponseMeta):
        self.meta = meta
        self.collector = Collector(meta, keep_scores=False)
        parser = meta.reasoning_parser if meta.chat else None
        self.reasoning = [ReasoningStream(parser) for _ in range(meta.num_choices)] if parser else None

    def _chunk(self, choices: list[dict]) -> dict:
        meta = self.meta
        chunk = {"id": meta.response_id, "object": "chat.completion.chunk" if meta.chat else "text_completion",
                 "created": meta.created, "model": meta.model, "choices": choices}
        if meta.include_usage:
            chunk["usage"] = None
        return chunk

    def _choice(self, index: int, text: str | None, finish_reason: str | None, role: bool = False,
                scores: list[ScoredToken] | None = None, reasoning: str | None = None) -> dict:
        collector = self.collector
        logprobs = None if scores is None else collector.logprobs(index, scores, collector.next_offset[index])
        if self.meta.chat:
            delta: dict = {"role": "assistant"} if role else {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text is not None:
                delta["content"] = text
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}

    def start(self) -> list[str]:
        """Chat streams open with each choice's role."""
        if not self.meta.chat:
            return []
        return [sse(self._chunk([self._choice(i, "", None, role=True)])) for i in range(self.meta.num_choices)]

    def event(self, event: Event) -> list[str]:
        self.collector.add(event)
        reasoning, text = self._split(event)
        if event.kind == "delta":
            return [sse(self._chunk([self._choice(event.index, text, None, scores=event.logprobs,
                                                  reasoning=reasoning)]))] if text or reasoning else []
        text = text if (text or not self.meta.chat) else None
        choice = self._choice(event.index, text, event.finish_reason, scores=event.logprobs, reasoning=reasoning)
        choice["speculation"] = event.stats
        return [sse(self._chunk([choice]))]

    def _split(self, event: Event) -> tuple[str, str]:
        """An event's text -> (reasoning, content) to send now (all content without a parser)."""
        if self.reasoning is None:
            return "", event.text
        stream = self.reasoning[event.index]
        reasoning, content = stream.feed(event.text)
        if event.kind == "finish":
            held_reasoning, held_content = stream.flush()
            reasoning, content = reasoning + held_reasoning, content + held_content
        return reasoning, content

    def end(self) -> list[str]:
        lines = []
        if self.meta.include_usage:
            body = self.collector.body()
            chunk = self._chunk([])
            chunk["usage"] = body["usage"]
            chunk["speculation"] = body["speculation"]
            lines.append(sse(chunk))
        lines.append(sse("[DONE]"))
        return lines
