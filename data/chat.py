"""Chat template + assistant-only loss mask.

A conversation is rendered with the target tokenizer's own chat template
(`tokenizer.apply_chat_template`). A tokenizer without a template gets FALLBACK_TEMPLATE, a
plain role-tagged layout, announced once per tokenizer on stdout (the newline after each
turn is a Jinja expression because transformers renders with trim_blocks):

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}{eos}\\n

How assistant spans are found (works for any template that renders prefixes stably, no
`{% generation %}` markers needed): the conversation is rendered to text prefix by prefix.
For assistant turn i, `render(messages[:i], add_generation_prompt=True)` ends where the
reply starts and `render(messages[:i+1])` ends where it stops (including the template's
end-of-turn marker, which the heads must learn to predict). Both must be string prefixes
of the full rendering; a template that rewrites earlier turns (e.g. strips reasoning from
past replies) breaks this and the record is reported as "chat template is not prefix-stable".
The full text is then tokenized once (this is what `apply_chat_template(tokenize=True)`
does) with character offsets, and a token is in the loss mask when it starts inside an
assistant character span. Offsets need a fast tokenizer.
"""

from __future__ import annotations

from specheads.data.records import Conversation

FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_announced: set[str] = set()


class TemplateError(ValueError):
    """A conversation the template cannot render into stable assistant spans."""


def ensure_chat_template(tokenizer) -> str:
    """Give `tokenizer` the fallback template when it has none; -> "tokenizer" | "fallback"."""
    if getattr(tokenizer, "chat_template", None):
        return "tokenizer"
    tokenizer.chat_template = FALLBACK_TEMPLATE
    name = getattr(tokenizer, "name_or_path", "") or "(unnamed)"
    if name not in _announced:
        _announced.add(name)
        print(f"data: tokenizer {name!r} has no chat template; using the fallback template:\n"
              f"{FALLBACK_TEMPLATE}", flush=True)
    return "fallback"


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """-> (full rendered text, character spans [start, end) of each assistant reply)."""
    full = render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = render(tokenizer, messages[:i + 1])
        if not (full.startswith(prompt) and upto.startswith(prompt) and full.startswith(upto)
                and len(upto) > len(prompt)):
            raise TemplateError("chat template is not prefix-stable")
        start = len(prompt)
        spans.append((start, len(upto)))
    return full, spans


def tokenize_conversation(tokenizer, conversation: Conversation) -> tuple[list[int], list[bool]]:
    """-> token ids and the assistant-only loss mask (same length)."""
    full, spans = assistant_spans(tokenizer, conversation.to_list())
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    mask = [any(a <= start < b for a, b in spans) for start, _ in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), mask


def generation_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` followed by the template's assistant generation prompt."""
    text = render(tokenizer, messages, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
