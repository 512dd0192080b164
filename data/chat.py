"""Chat template + assistant-only loss mask, in one sequence or turn by turn; thinking mode.

A conversation is rendered with the target tokenizer's own chat template
(`tokenizer.apply_chat_template`). A tokenizer without a template gets FALLBACK_TEMPLATE, a
plain role-tagged layout, announced once per tokenizer on stdout (the newline after each
turn is a Jinja expression because transformers renders with trim_blocks):

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}{eos}\\n

Where each reply is (no `{% generation %}` markers needed): for assistant turn i,
`render(messages[:i], add_generation_prompt=True)` is the prompt the model is given at
inference, and the reply is what `render(messages[:i+1])` adds to it, through the template's
end-of-turn marker (the heads must learn to predict it) but not an end-of-conversation marker
that the template writes only after the last message (Phi-3's EOS): the turn ends where the
rendering with and without a generation prompt part. A template that renders the system
message beside the last user turn only (Mistral's) does not start `render(messages[:i+1])`
with that prompt; there the reply starts where a placeholder reply would.

One sequence or turn by turn:
  - the template renders prefixes stably (each turn's prompt and reply are a prefix of the
    whole conversation's rendering: Llama 3, Qwen2.5, Gemma, Phi-3, SmolLM2): the whole
    conversation is one training sequence, with loss on every reply;
  - it rewrites earlier turns (Qwen3 drops the reasoning of replies before the last user
    turn; Mistral moves the system message to the last user turn): each reply becomes its own
    sequence, its prompt as the model sees it at inference followed by the reply, loss on the
    reply only. Later turns repeat the conversation before them, as inference does.
A reply the template cannot place is a TemplateError (the record is skipped and counted).

Thinking mode (`thinking`: "default" | "on" | "off"): "on"/"off" pass `enable_thinking`
to the template (Qwen3's switch; a template without one is refused), "default" passes
nothing. Reasoning travels with a reply as `reasoning_content` or as `<think>...</think>`
at the start of its content; the template decides where it is rendered. With thinking off
the model writes none, so a record's reasoning is left out (and counted).

The text is tokenized once per sequence (as `apply_chat_template(tokenize=True)` does) with
character offsets, and a token has loss when it starts inside a reply. Offsets need a fast
tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from specheads.data.records import REASONING_KEY, Conversation

FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
THINKING_MODES = ("default", "on", "off")
THINKING_SWITCH = "enable_thinking"  # the template variable Qwen3's template reads
THINK_START, THINK_END = "<think>", "</think>"
PLACEHOLDER_REPLY = "specheads-placeholder-reply"  # no surrounding whitespace: templates may trim
TURN_END_WINDOW = 64  # characters before the parting of two renderings: longer than any special token

_announced: set[str] = set()


class TemplateError(ValueError):
    """A conversation the template cannot render into assistant replies."""


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


def thinking_kwargs(tokenizer, thinking: str) -> dict:
    """The template keyword arguments of a thinking mode: {} for "default", else
    {"enable_thinking": on}; refused when the tokenizer's template has no such switch."""
    if thinking not in THINKING_MODES:
        raise ValueError(f"thinking: expected one of {', '.join(THINKING_MODES)}, got {thinking!r}")
    if thinking == "default":
        return {}
    template = getattr(tokenizer, "chat_template", None) or ""
    texts = template.values() if isinstance(template, dict) else [template]
    if not any(THINKING_SWITCH in text for text in texts):
        name = getattr(tokenizer, "name_or_path", "") or "(unnamed)"
        raise ValueError(f"thinking {thinking!r}: the chat template of tokenizer {name!r} has no "
                         f"{THINKING_SWITCH} switch (Qwen3's has one); use thinking 'default'")
    return {THINKING_SWITCH: thinking == "on"}


def split_reasoning(text: str) -> tuple[str | None, str]:
    """-> (the reasoning of a reply written as `<think>R</think>C`, or None; the content C)."""
    if THINK_END not in text:
        return None, text
    reasoning, _, content = text.partition(THINK_END)
    return reasoning.split(THINK_START)[-1].strip("\n"), content.lstrip("\n")


def reasoning_of(message: dict) -> str | None:
    """An assistant message's reasoning: `reasoning_content`, else a `<think>` block in its content."""
    if message.get(REASONING_KEY):
        return message[REASONING_KEY]
    return split_reasoning(message["content"])[0] or None


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False,
           template_kwargs: dict | None = None) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **(template_kwargs or {}))


@dataclass(frozen=True)
class ReplyTurn:
    """Assistant turn i of a conversation as the template renders it."""

    prompt: str  # render(messages[:i], add_generation_prompt=True): what the model is given
    upto: str  # render(messages[:i + 1]), cut after reply i's end-of-turn marker
    reply_start: int  # where reply i starts in `upto`

    @property
    def reply(self) -> str:
        return self.upto[self.reply_start:]

    @property
    def alone(self) -> str:
        """The turn's own training text: its prompt, then its reply."""
        return self.prompt + self.reply

    def in_place(self, full: str) -> bool:
        """Whether this turn is a prefix of the whole conversation's rendering `full`."""
        return self.reply_start == len(self.prompt) and self.upto.startswith(self.prompt) and full.startswith(self.upto)


def reply_turns(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> list[ReplyTurn]:
    """One ReplyTurn per assistant message; TemplateError when a reply cannot be placed (its
    content, without reasoning, is not where its rendering should be)."""
    turns = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:i], True, template_kwargs)
        upto = render(tokenizer, messages[:i + 1], False, template_kwargs)
        upto = upto[:_turn_end(tokenizer, messages[:i + 1], upto, template_kwargs)]
        start = len(prompt) if upto.startswith(prompt) else _placeholder_start(tokenizer, messages[:i], upto,
                                                                              template_kwargs)
        content = split_reasoning(message["content"])[1].strip()
        if start is None or content not in upto[start:]:
            raise TemplateError("chat template does not render the reply after its generation prompt")
        turns.append(ReplyTurn(prompt, upto, start))
    return turns


def _turn_end(tokenizer, messages: list[dict], upto: str, template_kwargs: dict | None) -> int:
    """Where the last reply of `upto` ends: where the rendering with a generation prompt (the
    conversation goes on) parts from it, token by token, when what it leaves out is only special
    tokens and whitespace (an end-of-conversation marker); else the end of `upto`. Only the
    text around the parting is tokenized (TURN_END_WINDOW characters before it)."""
    from jinja2 import TemplateError as JinjaError

    try:
        going_on = render(tokenizer, messages, True, template_kwargs)
    except JinjaError:  # a template may refuse a generation prompt after a reply
        return len(upto)
    parting = next((k for k, (a, b) in enumerate(zip(upto, going_on)) if a != b), min(len(upto), len(going_on)))
    if parting == len(upto):  # the usual case: the generation prompt only adds
        return len(upto)
    window = max(parting - TURN_END_WINDOW, 0)  # the same text in both: the same tokens up to the parting
    ours = tokenizer(upto[window:], add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    theirs = tokenizer(going_on[window:], add_special_tokens=False, verbose=False)["input_ids"]
    ids = ours["input_ids"]
    common = next((k for k, (a, b) in enumerate(zip(ids, theirs)) if a != b), min(len(ids), len(theirs)))
    special = set(tokenizer.all_special_ids)
    if common < len(ids) and all(token in special or not tokenizer.decode([token]).strip() for token in ids[common:]):
        return window + ours["offset_mapping"][common][0]
    return len(upto)


def _placeholder_start(tokenizer, before: list[dict], upto: str, template_kwargs: dict | None) -> int | None:
    """Where a reply after `before` starts, found from a placeholder reply's rendering; None
    when that rendering does not lead `upto` to the reply."""
    placeholder = render(tokenizer, before + [{"role": "assistant", "content": PLACEHOLDER_REPLY}], False,
                         template_kwargs)
    start = placeholder.find(PLACEHOLDER_REPLY)
    return start if start >= 0 and upto.startswith(placeholder[:start]) else None


@dataclass(frozen=True)
class ChatTokens:
    """A conversation's training sequences: one, or one per reply (turn by turn)."""

    sequences: tuple[tuple[list[int], list[bool]], ...]  # (token ids, loss mask), same length each
    turn_by_turn: bool
    num_reasoning_left_out: int = 0  # replies whose reasoning is not trained on (thinking off, or not rendered)


def tokenize_conversation(tokenizer, conversation: Conversation, template_kwargs: dict | None = None) -> ChatTokens:
    """-> token ids and assistant-only loss masks: the whole conversation in one sequence when
    the template renders it prefix-stably, else one sequence per reply (module doc)."""
    messages, num_dropped = _without_reasoning_when_thinking_off(conversation.to_list(), template_kwargs)
    turns = reply_turns(tokenizer, messages, template_kwargs)
    full = render(tokenizer, messages, False, template_kwargs)
    stable = all(turn.in_place(full) for turn in turns)
    if stable:
        texts = [(full, [(len(turn.prompt), len(turn.upto)) for turn in turns])]
    else:
        texts = [(turn.alone, [(len(turn.prompt), len(turn.alone))]) for turn in turns]
    replies = [m for m in messages if m["role"] == "assistant"]
    not_rendered = sum(1 for message, turn in zip(replies, turns)
                       if (reasoning := reasoning_of(message)) and reasoning.strip() not in turn.reply)
    return ChatTokens(tuple(_tokenize_spans(tokenizer, text, spans) for text, spans in texts),
                      turn_by_turn=not stable,
                      num_reasoning_left_out=num_dropped + not_rendered)


def _without_reasoning_when_thinking_off(messages: list[dict], template_kwargs: dict | None) -> tuple[list[dict], int]:
    """With thinking off the model writes no reasoning: -> messages without it, and how many had some."""
    if (template_kwargs or {}).get(THINKING_SWITCH) is not False:
        return messages, 0
    dropped = 0
    for message in messages:
        if message["role"] == "assistant" and reasoning_of(message):
            dropped += 1
            message.pop(REASONING_KEY, None)
            message["content"] = split_reasoning(message["content"])[1]
    return messages, dropped


def _tokenize_spans(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    mask = [any(a <= start < b for a, b in spans) for start, _ in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), mask


def generation_prompt_ids(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """Token ids of `messages` followed by the template's assistant generation prompt."""
    text = render(tokenizer, messages, add_generation_prompt=True, template_kwargs=template_kwargs)
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def reply_message(tokenizer, token_ids: list[int]) -> dict:
    """The assistant message of a generated reply: `</think>` splits off its reasoning
    (`reasoning_content`), the rest is its content; both stripped. The split is made on the
    token ids when `</think>` is one token, so that a tokenizer that counts it special (and
    drops it when decoding) splits the same."""
    end_id = tokenizer.convert_tokens_to_ids(THINK_END)
    if isinstance(end_id, int) and end_id != tokenizer.unk_token_id and end_id in token_ids:
        cut = token_ids.index(end_id)
        reasoning = tokenizer.decode(token_ids[:cut], skip_special_tokens=True).split(THINK_START)[-1]
        content = tokenizer.decode(token_ids[cut + 1:], skip_special_tokens=True)
    else:
        reasoning, content = split_reasoning(tokenizer.decode(token_ids, skip_special_tokens=True))
    message = {"role": "assistant", "content": content.strip()}
    if reasoning and reasoning.strip():
        message[REASONING_KEY] = reasoning.strip()
    return message
