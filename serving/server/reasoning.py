"""Reasoning split off a chat reply, as vLLM's and SGLang's reasoning parsers do
(`specheads serve --reasoning-parser qwen3|deepseek_r1`): the text between `<think>` and
`</think>` goes to the message's `reasoning_content` (a stream's `delta.reasoning_content`),
the rest to `content`.

- qwen3: a reply that opens with `<think>` (after whitespace) reasons until `</think>`; one
  that does not (Qwen3 with `enable_thinking: false`, or a reply that never thinks) is content.
- deepseek_r1: the template opens the thinking in the prompt, so a reply reasons until
  `</think>` (a `<think>` it writes itself is dropped); one without `</think>` is reasoning.

The same rule splits a whole reply and a stream, so both give the same text: a stream holds
back only what may be the start of a tag (at most 7 characters) until the next delta decides
it. Tags are matched in the detokenized text, whether the tokenizer has them as one token or
several. The generated tokens, and so the output, are the same with or without a parser.
"""

from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


class ReasoningStream:
    """One reply's text as it streams -> (reasoning, content) pieces to send."""

    def __init__(self, parser: str):
        if parser not in PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}, got {parser!r}")
        self.parser = parser
        self.state = "start"  # -> "reasoning" -> "content", or "start" -> "content" (qwen3 without <think>)
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content, buffer = [], [], self.held + text
        self.held = ""
        while buffer:
            if self.state == "start":
                opened = buffer.lstrip()
                if len(opened) < len(THINK_START) and THINK_START.startswith(opened):
                    self.held = buffer  # whitespace, or what may become <think>
                    break
                if opened.startswith(THINK_START):
                    self.state, buffer = "reasoning", opened[len(THINK_START):]
                else:
                    self.state = "reasoning" if self.parser == "deepseek_r1" else "content"
            elif self.state == "reasoning":
                end = buffer.find(THINK_END)
                if end >= 0:
                    reasoning.append(buffer[:end])
                    self.state, buffer = "content", buffer[end + len(THINK_END):]
                    continue
                keep = _partial_tag(buffer, THINK_END)
                reasoning.append(buffer[:len(buffer) - keep])
                self.held, buffer = buffer[len(buffer) - keep:], ""
            else:
                content.append(buffer)
                buffer = ""
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """The reply ended: what was held back, where it belongs."""
        held, self.held = self.held, ""
        if self.state == "reasoning" or (self.state == "start" and self.parser == "deepseek_r1"):
            return held, ""
        return "", held


def split_reasoning(text: str, parser: str) -> tuple[str, str]:
    """A whole reply -> (reasoning, content), by the same rule as a stream."""
    stream = ReasoningStream(parser)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.flush()
    return reasoning + more_reasoning, content + more_content


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (0 if none)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
