"""Context tasks: first turns that hand the target a long text and ask it to work on that text.

    specheads data prompts --output prompts.jsonl --context-from REPLIES.jsonl [--context-fraction F]

The template prompts (data/chat_prompts.py) and self-instruct ones are short: the longest
first turn is about 400 characters. Heads trained on the replies to them never see what a
user who pastes a document asks for, where the reply copies names, numbers and phrases
from a long context (MT-bench's extraction, Spec-Bench's summarization and RAG). Measured
on SmolLM2 with heads trained on 4M reply tokens of template prompts: where the target is
at least 95% sure of its next token, the heads' top-1 is 0.87 on held-out replies to
template prompts, 0.41 on MT-bench's extraction replies.

A context task is a passage and an instruction (CONTEXT_TASKS, per kind) that names it.
Passages come from `--context-from` files: chat records (their assistant turns: an earlier
`data regenerate` output is the target's own text) or text records (say, a user's own
documents), never evaluation data. One to three of them are joined into one passage of at
most MAX_PASSAGE_CHARS, each source text used about equally often. Code tasks take only
texts that hold a fenced code block. A source text is refused, counted by reason (too
short, too long, repetitive (a loop), holds an evaluation prompt or its first 60 characters, a duplicate), never
silently; a passage that would make a prompt equal to one already made is drawn again.

Records have chat_prompts' shape, category "context/<kind>"; a share gets one follow-up
turn (no third: a long first turn leaves less room in a training block).
"""

from __future__ import annotations

import random
import zlib
from collections import Counter

from specheads.data.chat_prompts import follow_ups, normalize

CONTEXT = "context/"  # category prefix
MIN_TEXT_CHARS, MAX_TEXT_CHARS, MAX_PASSAGE_CHARS = 300, 2400, 2400
# zlib-compressed size / size below which a text is a loop: a small target's replies can repeat a phrase
# to the end (of SmolLM2's replies of 300+ characters, a quarter compress below 0.21, half below 0.34)
MIN_COMPRESSION = 0.3
JOINED = (1, 1, 2, 2, 3)  # how many source texts a passage joins, drawn uniformly (as many as fit)
REJECT_REASONS = ("empty", "too short", "too long", "repetitive", "holds an evaluation prompt", "duplicate")
CONTEXT_TASKS = {
    "extraction": [
        "List every number in the text below, with what each one counts or measures.\n\n{passage}",
        "Extract the names of all people, places, products and organisations in this text, as a bulleted "
        "list.\n\n{passage}",
        "From the following text, pull out each step or recommendation it gives, in order, keeping its own "
        "wording.\n\n{passage}",
        "Return the key facts of this text as JSON, one field per fact.\n\nText:\n{passage}",
        "{passage}\n\nWhich sentences above give a date, an amount or a quantity? Copy them exactly.",
        "Put the information in this text into a Markdown table.\n\n{passage}",
    ],
    "summarization": [
        "Summarize the following text in three sentences.\n\n{passage}",
        "{passage}\n\nSum up the text above in one paragraph.",
        "Give this text a headline and a two-sentence summary.\n\n{passage}",
        "Boil this down to five bullet points for someone with no time.\n\n{passage}",
    ],
    "qa": [
        "Using only the text below, say what its main point is and what supports it.\n\n{passage}",
        "Read this and tell me: what does it say to do first, and why?\n\nText: {passage}",
        "{passage}\n\nGoing only by the passage above, what would a reader still not know?",
        "Here is a document:\n\n{passage}\n\nWrite three questions it answers, each with the answer quoted from it.",
    ],
    "rewriting": [
        "Rewrite the following so that a ten-year-old can follow it, keeping every fact.\n\n{passage}",
        "Make this text more formal without changing what it says:\n\n{passage}",
        "Proofread the text below and give back the corrected version in full.\n\n{passage}",
        "Cut this text to half its length, keeping its structure.\n\n{passage}",
    ],
    "analysis": [
        "What are the strengths and weaknesses of what this text says?\n\n{passage}",
        "Check the following answer for mistakes and explain each one.\n\n{passage}",
        "{passage}\n\nIs everything above correct? Quote anything doubtful and say why.",
    ],
    "code": [
        "Explain what the code in this text does, step by step.\n\n{passage}",
        "Find any bugs in the code below and give a fixed version.\n\n{passage}",
        "Add comments and type hints to the code in this answer.\n\n{passage}",
        "Write unit tests for the code in the following text.\n\n{passage}",
    ],
}
FOLLOW_UP_KIND = {"extraction": "extraction", "summarization": "summarization", "qa": "rag", "code": "coding"}


def source_texts(paths: list[str], text_field: str = "text") -> list[str]:
    """The texts passages are made of, in file order: each chat record's assistant turns, or a
    text record's text. A record of neither kind (or malformed) is an error naming its file and
    index: a file given as context that holds nothing usable is a mistake."""
    from specheads.data.records import Conversation, normalize_record
    from specheads.data.text import load_records

    texts = []
    for path in paths:
        for index, record in enumerate(load_records(path)):
            document, why = normalize_record(record, text_field)
            if isinstance(document, Conversation):
                texts += [m["content"] for m in document.messages if m["role"] == "assistant"]
            elif isinstance(document, str):
                texts.append(document)
            else:
                raise ValueError(f"--context-from {path}: record {index} gives no text "
                                 f"({why or 'it holds token ids'}); expected chat records or text records")
    return texts


def usable_texts(texts: list[str], eval_turns: list[str]) -> tuple[list[str], Counter]:
    """texts -> (those passages may use, refused counts by REJECT_REASONS)."""
    eval_heads = {normalize(t)[:60] for t in eval_turns}
    kept, seen, rejected = [], set(), Counter()
    for text in texts:
        text = text.strip()
        key = normalize(text)
        if not text:
            reason = "empty"
        elif len(text) < MIN_TEXT_CHARS:
            reason = "too short"
        elif len(text) > MAX_TEXT_CHARS:
            reason = "too long"
        elif len(zlib.compress(text.encode())) < MIN_COMPRESSION * len(text.encode()):
            reason = "repetitive"
        elif any(head in key for head in eval_heads):
            reason = "holds an evaluation prompt"
        elif key in seen:
            reason = "duplicate"
        else:
            seen.add(key)
            kept.append(text)
            continue
        rejected[reason] += 1
    return kept, rejected


def context_prompts(num: int, texts: list[str], seed: int = 0, follow_up_fraction: float = 0.5,
                    taken: set[str] = frozenset()) -> list[dict]:
    """num context-task records (module doc) from usable `texts`, deterministic for a seed;
    every first turn distinct after normalize() from each other and from `taken`."""
    if num < 0:
        raise ValueError(f"context_prompts: num must be >= 0, got {num}")
    if num and not texts:
        raise ValueError("context_prompts: no usable source text (module doc: each must be "
                         f"{MIN_TEXT_CHARS}-{MAX_TEXT_CHARS} characters and hold no evaluation prompt)")
    rng = random.Random(seed)
    code = [t for t in texts if "```" in t]
    kinds = [kind for kind in CONTEXT_TASKS if kind != "code" or code]
    pools = {"code": code, "any": texts}
    order = {name: [] for name in pools}
    seen, records, attempts = set(taken), [], 0
    while len(records) < num:
        attempts += 1
        if attempts > 20 * num + 100:
            raise ValueError(f"context_prompts: only {len(records)} distinct prompts from {len(texts)} source "
                             f"texts after {attempts - 1} draws; give more texts or ask for fewer prompts")
        kind = kinds[len(records) % len(kinds)]
        pool = "code" if kind == "code" else "any"
        parts = []
        for _ in range(rng.choice(JOINED)):
            if not order[pool]:  # every text once per pass, in a new order each pass
                order[pool] = rng.sample(pools[pool], len(pools[pool]))
            following = order[pool][-1]
            if parts and (following in parts or sum(len(p) + 2 for p in parts) + len(following) > MAX_PASSAGE_CHARS):
                break
            parts.append(order[pool].pop())
        text = rng.choice(CONTEXT_TASKS[kind]).format(passage="\n\n".join(parts))
        key = normalize(text)
        if key in seen:
            continue
        seen.add(key)
        records.append({"category": CONTEXT + kind, "turns": [text] + follow_ups(
            FOLLOW_UP_KIND.get(kind, kind), rng, follow_up_fraction, 0.0)})
    return records


def mixed_in(records: list[dict], context: list[dict], seed: int = 0) -> list[dict]:
    """records and context records in one order, deterministic for a seed, numbered afresh."""
    merged = [{k: v for k, v in r.items() if k != "id"} for r in records + context]
    random.Random(seed + 2).shuffle(merged)
    return [{"id": f"p{i:05d}", **r} for i, r in enumerate(merged)]
