"""Record shapes: detect, per record, what a training record holds and normalise it.

Accepted shapes (checked in this order, per record, so one file may mix them):
  - ShareGPT: `conversations`, a list of {"from", "value"}; `from` in human/user, gpt/assistant, system;
  - OpenAI:   `messages`, a list of {"role", "content"}; `role` in user, assistant, system; an
              assistant turn may carry its reasoning as `reasoning_content` (a string; null or
              "" = none), as vLLM, DeepSeek and Qwen3's template name it;
  - text:     a string in the text field (`DataConfig.text_field`, "text" by default);
  - tokens:   `input_ids`, a list of token ids (pre-tokenized; needs no tokenizer).

A chat record becomes a `Conversation` (a list of {"role", "content"} with roles system,
user, assistant); a text record a str; a tokens record a list[int]. A record that is none of
these, or is malformed, gives a reason string instead; callers count reasons and report
them, nothing is dropped silently.
"""

from __future__ import annotations

from dataclasses import dataclass

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}
OPENAI_ROLES = {"user": "user", "assistant": "assistant", "system": "system"}
REASONING_KEY = "reasoning_content"


@dataclass(frozen=True)
class Conversation:
    # each {"role": "system"|"user"|"assistant", "content": str}, an assistant turn with
    # its non-empty "reasoning_content": str when the record gave one
    messages: tuple[dict, ...]

    def to_list(self) -> list[dict]:
        return [dict(m) for m in self.messages]


Document = str | list | Conversation


def _conversation(turns, field: str, role_key: str, content_key: str,
                  roles: dict[str, str]) -> tuple[Conversation | None, str | None]:
    if not isinstance(turns, list):
        return None, f"{field!r} is not a list ({type(turns).__name__})"
    if not turns:
        return None, f"empty {field!r}"
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None, f"{field!r} has a turn that is not a mapping"
        if turn.get(role_key) is None or turn.get(content_key) is None:  # datasets fills absent keys with None
            missing = role_key if turn.get(role_key) is None else content_key
            return None, f"{field!r} turn without {missing!r}"
        role, content = turn[role_key], turn[content_key]
        if role not in roles:
            return None, f"{field!r} has unknown role {role!r}"
        if not isinstance(content, str):
            return None, f"{field!r} turn {content_key!r} is not a string"
        if not content.strip():
            return None, f"{field!r} has an empty turn"
        message = {"role": roles[role], "content": content}
        reasoning = turn.get(REASONING_KEY)
        if reasoning is not None:
            if not isinstance(reasoning, str):
                return None, f"{field!r} turn {REASONING_KEY!r} is not a string"
            if message["role"] != "assistant":
                return None, f"{field!r} has {REASONING_KEY!r} on a {message['role']} turn"
            if reasoning.strip():
                message[REASONING_KEY] = reasoning
        messages.append(message)
    if not any(m["role"] == "assistant" for m in messages):
        return None, f"{field!r} has no assistant turn"
    return Conversation(tuple(messages)), None


def normalize_record(record, text_field: str = "text") -> tuple[Document | None, str | None]:
    """-> (document, None) or (None, why the record gives no document)."""
    if isinstance(record, str):
        return (record, None) if record.strip() else (None, "empty text")
    if not isinstance(record, dict):
        return None, f"not a mapping ({type(record).__name__})"
    if record.get("conversations") is not None:
        return _conversation(record["conversations"], "conversations", "from", "value", SHAREGPT_ROLES)
    if record.get("messages") is not None:
        return _conversation(record["messages"], "messages", "role", "content", OPENAI_ROLES)
    text = record.get(text_field)
    if text is not None:
        if not isinstance(text, str):
            return None, f"{text_field!r} is not a string ({type(text).__name__})"
        return (text, None) if text.strip() else (None, f"empty {text_field!r}")
    token_ids = record.get("input_ids")
    if token_ids is not None:
        if not (isinstance(token_ids, list) and all(isinstance(t, int) and t >= 0 for t in token_ids)):
            return None, "input_ids is not a list of token ids"
        return (token_ids, None) if token_ids else (None, "empty input_ids")
    return None, f"missing field {text_field!r}"
