"""Benchmark prompts: Spec-Bench `question.jsonl` records and their tokenization.

One JSON object per line: {"question_id": int | str, "category": str, "turns": [str, ...]}.
The bench decodes the first turn; with `--turns 2` also the second, after the reference's reply
to the first (`next_turn_prompts`), as MT-bench does. The default is the project's own prompt set (6
categories: chat, code, math, summarisation, translation, retrieval), shipped with MT-bench's
questions in prompts/ (specheads.prompts).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specheads.prompts import default_prompts_path
# The untimed warm-up before timed decoding (bench/harness.py, bench/tune.py, bench/tools/serve_load.py)
# decodes at most this many new tokens, so one-off costs (first kernel calls, allocator growth,
# lazy imports) are not timed.
WARMUP_NEW_TOKENS = 8


@dataclass(frozen=True)
class BenchPrompt:
    question_id: int | str
    category: str
    text: str  # first turn
    later_turns: tuple[str, ...] = ()  # the user's next turns


@dataclass(frozen=True)
class EncodedPrompt:
    question_id: int | str
    category: str
    input_ids: list[int]  # [P] prompt token ids (chat template applied when the tokenizer has one)


def _parse_line(line: str, where: str) -> BenchPrompt:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON ({err.msg})") from err
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object with question_id, category and turns")
    missing = [key for key in ("question_id", "category", "turns") if key not in record]
    if missing:
        raise ValueError(f"{where}: missing {missing} (Spec-Bench format: question_id, category, turns)")
    turns, category = record["turns"], record["category"]
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
        raise ValueError(f"{where}: 'turns' must be a non-empty list whose first item is non-empty text")
    if not isinstance(category, str) or not category:
        raise ValueError(f"{where}: 'category' must be a non-empty string")
    if not isinstance(record["question_id"], (int, str)) or isinstance(record["question_id"], bool):
        raise ValueError(f"{where}: 'question_id' must be an int or a string")
    later = tuple(turn for turn in turns[1:] if isinstance(turn, str) and turn.strip())
    if len(later) != len(turns) - 1:
        raise ValueError(f"{where}: every item of 'turns' must be non-empty text")
    return BenchPrompt(record["question_id"], category, turns[0], later)


def load_prompts(path: str | Path | None = None, limit: int | None = None,
                 per_category: int | None = None) -> list[BenchPrompt]:
    """Read a Spec-Bench jsonl file (default: the shipped set). Blank lines are skipped;
    a malformed line raises ValueError naming the file and its 1-based line number.
    per_category keeps the first N prompts of each category; limit then the first N overall."""
    path = Path(path) if path is not None else default_prompts_path()
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {str(path)!r} does not exist")
    prompts = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                prompts.append(_parse_line(line, f"{path}:{line_no}"))
    if not prompts:
        raise ValueError(f"prompts file {str(path)!r} has no prompts")
    if per_category:
        kept, counts = [], {}
        for prompt in prompts:
            counts[prompt.category] = counts.get(prompt.category, 0) + 1
            if counts[prompt.category] <= per_category:
                kept.append(prompt)
        prompts = kept
    return prompts[:limit] if limit else prompts


def encode_prompts(tokenizer, prompts: list[BenchPrompt]) -> list[EncodedPrompt]:
    """Token ids per prompt: through the tokenizer's chat template (one user turn plus the
    generation prompt) when it has one, else the raw text without special tokens."""
    return [_encode(tokenizer, prompt, [{"role": "user", "content": prompt.text}], prompt.category)
            for prompt in prompts]


def next_turn_prompts(tokenizer, prompts: list[BenchPrompt], replies: list[list[int]]) -> list[EncodedPrompt]:
    """The second turn of each prompt that has one: its first turn, `replies` (the reference's
    reply to it, token ids), then the user's second turn, as one conversation; category
    'CATEGORY (turn 2)'. Without a chat template the turns are joined as plain text."""
    encoded = []
    for prompt, reply in zip(prompts, replies):
        if not prompt.later_turns:
            continue
        answer = tokenizer.decode(reply, skip_special_tokens=True)
        messages = [{"role": "user", "content": prompt.text}, {"role": "assistant", "content": answer},
                    {"role": "user", "content": prompt.later_turns[0]}]
        encoded.append(_encode(tokenizer, prompt, messages, f"{prompt.category} (turn 2)"))
    return encoded


def _encode(tokenizer, prompt: BenchPrompt, messages: list[dict], category: str) -> EncodedPrompt:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = "\n\n".join(message["content"] for message in messages)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"prompt {prompt.question_id!r} is empty after tokenization")
    return EncodedPrompt(prompt.question_id, category, list(ids))
