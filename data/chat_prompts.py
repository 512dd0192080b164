"""Chat prompts for distilling heads of an instruction-tuned target, built locally (no hub).

    specheads data prompts --output prompts.jsonl [--num N] [--seed S] [--follow-up-fraction F]
    specheads data prompts --output prompts.jsonl --self-instruct --target T   # part written by the target
    specheads data report --input replies.jsonl --target T [--draft-vocab-size N --eval-replies FILE]
    (in a recipe) data.source: embedded:chat   # prompts + the target's replies, generated once and cached

Heads learn to predict the target's own replies, so the prompts only have to make the
target talk the way it does for real users: many kinds of request, on many subjects. They
are built here from prompt families (a template and the value lists of its slots: subjects,
audiences, lengths, styles, numbers, languages, invented names and passages), written for
this project, across the kinds of request chat benchmarks cover: MT-bench's writing,
role-play, reasoning, math, coding, extraction, STEM and humanities, Spec-Bench's
translation, summarization, QA, math reasoning and retrieval-augmented answering, plus
everyday advice. data/self_instruct.py adds prompts the target writes itself.

A prompt is one point of a family's slot product, so the space is counted exactly
(`max_prompts`), sampled without replacement and spread evenly over kinds and then over
each kind's families. Every first turn is distinct after `normalize`. A share of the
conversations get a second turn, and some of those a third, that depend on the first reply
("Make it shorter.", "Now give an example in Python."), chosen per kind.

Records are `{"id": "p00042", "category": "...", "turns": ["...", ...]}` (MT-bench's
shape). data/chat_data.py's `self_distilled_chat` (the recipe source `embedded:chat`) has the
target reply to them, once per target and settings, into the specheads cache: resumable (data
regenerate's progress file) and lock-guarded, so several ranks or runs generate once.

They are disjoint from MT-bench and Spec-Bench, the evaluation sets: no template or
subject was taken from them, and tests/data/test_chat_prompts.py checks that no evaluation
prompt (or its first 60 characters) appears among them.
"""

from __future__ import annotations

import json
import math
import random
import re
import string
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from specheads.data.chat_text import FOLLOW_UPS, PASSAGES, RAG_QUESTIONS, SLOTS, TEMPLATES, THIRD_TURNS

EMBEDDED_CHAT = "embedded:chat"
CHAT_DATA_VERSION = 4  # bump when the prompts or their generation change: cached replies are rebuilt


def normalize(text: str) -> str:
    """The form prompts are compared in: lower case, runs of whitespace and punctuation -> one space."""
    return re.sub(r"[\W_]+", " ", text.lower()).strip()


@dataclass(frozen=True)
class Family:
    """Prompts of one kind from one template: its text is `template` with every slot it names
    filled from `values` (slot -> choices); its points are the product of those choices."""

    kind: str
    template: str
    values: tuple[tuple[str, tuple[str, ...]], ...]  # only the slots the template names

    @property
    def size(self) -> int:
        return math.prod(len(choices) for _, choices in self.values)

    def text(self, index: int) -> str:
        """The index-th point of the slot product (mixed radix), as text."""
        filled = {}
        for slot, choices in self.values:
            index, digit = divmod(index, len(choices))
            filled[slot] = choices[digit]
        return self.template.format(**filled)


@lru_cache(maxsize=1)
def prompt_families() -> tuple[Family, ...]:
    """Every family of every kind (TEMPLATES x PASSAGES x RAG_QUESTIONS filled in)."""
    families = []
    for kind, templates in TEMPLATES.items():
        for template in templates:
            for text in _expand_passages(template):
                slots = [name for _, name, _, _ in string.Formatter().parse(text) if name]
                families.append(Family(kind, text, tuple((s, tuple(SLOTS[s])) for s in dict.fromkeys(slots))))
    return tuple(families)


def _expand_passages(template: str) -> list[str]:
    """A template naming {passage} (and {question}) -> one template per passage (and question)."""
    if "{passage}" not in template:
        return [template]
    out = []
    for passage, questions in zip(PASSAGES, RAG_QUESTIONS):
        with_passage = template.replace("{passage}", passage)
        if "{question" not in template:
            out.append(with_passage)
            continue
        out += [with_passage.replace("{question}", q).replace("{question_lower}", q[0].lower() + q[1:])
                for q in questions]
    return out


def max_prompts() -> int:
    """How many distinct first turns build_prompts can make."""
    return sum(family.size for family in prompt_families())


def _spread(num: int, capacities: list[int]) -> list[int]:
    """num split as evenly as the capacities allow (each share <= its capacity); sum(capacities) >= num."""
    shares, open_ = [0] * len(capacities), [i for i, c in enumerate(capacities) if c > 0]
    left = num
    while left:
        each, extra = divmod(left, len(open_))
        for rank, i in enumerate(open_):
            shares[i] += min(each + (rank < extra), capacities[i] - shares[i])
        left = num - sum(shares)
        open_ = [i for i in open_ if shares[i] < capacities[i]]
    return shares


def build_prompts(num: int, seed: int = 0, follow_up_fraction: float = 0.5,
                  third_turn_fraction: float = 0.5) -> list[dict]:
    """`num` prompt records with distinct first turns (module doc), deterministic for a seed.
    follow_up_fraction of them get a second turn; third_turn_fraction of those a third."""
    limit = max_prompts()
    if not 1 <= num <= limit:
        raise ValueError(f"build_prompts: need 1 <= num <= {limit} (the most distinct prompts the templates "
                         f"make), got {num}")
    if not (0 <= follow_up_fraction <= 1 and 0 <= third_turn_fraction <= 1):
        raise ValueError(f"follow_up_fraction and third_turn_fraction must be in [0, 1], got "
                         f"{follow_up_fraction} and {third_turn_fraction}")
    rng = random.Random(seed)
    by_kind: dict[str, list[Family]] = {}
    for family in prompt_families():
        by_kind.setdefault(family.kind, []).append(family)
    kinds = sorted(by_kind)
    rng.shuffle(kinds)  # which kinds get the remainder of an uneven split
    firsts = []
    for kind, count in zip(kinds, _spread(num, [sum(f.size for f in by_kind[k]) for k in kinds])):
        families = by_kind[kind]
        for family, share in zip(families, _spread(count, [f.size for f in families])):
            firsts += [(kind, family.text(i)) for i in rng.sample(range(family.size), share)]
    rng.shuffle(firsts)
    counts = Counter(normalize(text) for _, text in firsts)
    if len(counts) < num:  # slot values that normalize alike: fix the lists, never drop silently
        clash = next(text for text, n in counts.items() if n > 1)
        raise RuntimeError(f"build_prompts: two templates or slot values make the same prompt: {clash!r}")
    return [{"id": f"p{i:05d}", "category": kind, "turns": [text] + follow_ups(kind, rng, follow_up_fraction,
                                                                               third_turn_fraction)}
            for i, (kind, text) in enumerate(firsts)]


def follow_ups(kind: str, rng: random.Random, follow_up_fraction: float, third_turn_fraction: float) -> list[str]:
    """The later user turns of one conversation: none, a kind's follow-up, or that and a third turn."""
    if rng.random() >= follow_up_fraction:
        return []
    turns = [rng.choice(FOLLOW_UPS.get(kind, THIRD_TURNS))]
    if rng.random() < third_turn_fraction:
        turns.append(rng.choice([t for t in THIRD_TURNS if t != turns[0]]))
    return turns


def write_records(output: str | Path, records: list[dict]) -> Path:
    """Prompt records as JSON lines, written atomically."""
    from specheads.heads import atomic

    atomic.write_text(Path(output), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return Path(output)


def write_prompts(output: str | Path, num: int, seed: int = 0, follow_up_fraction: float = 0.5,
                  third_turn_fraction: float = 0.5) -> Path:
    """Write build_prompts(...) as JSON lines, atomically."""
    return write_records(output, build_prompts(num, seed, follow_up_fraction, third_turn_fraction))


def report_chat_data(path: str | Path, tokenizer_path: str, draft_vocab_size: int | None = None,
                     eval_paths: list[str | Path] = (), thinking: str = "default",
                     trust_remote_code: bool = False) -> dict:
    """What a file of chat records (regenerate's output) holds: conversations, reply tokens (the
    tokens under the assistant loss mask, as training counts them: data/chat.py), conversations by
    number of replies, distinct first prompts (after normalize), and, given draft_vocab_size and
    evaluation files, the share of the evaluation replies' tokens the draft vocabulary covers (the
    draft_vocab_size most frequent training reply tokens plus EOS: heads/draft_vocab.py).
    thinking: the chat template's thinking mode, as training renders the records (data/chat.py).
    trust_remote_code: allow the tokenizer's own code."""
    import torch

    from specheads.data.chat import ensure_chat_template, thinking_kwargs
    from specheads.data.text import load_records, load_tokenizer
    from specheads.heads.draft_vocab import build_draft_vocab

    tokenizer = load_tokenizer(tokenizer_path, trust_remote_code)
    ensure_chat_template(tokenizer)
    template_kwargs = thinking_kwargs(tokenizer, thinking)
    ids, replies, firsts, skipped = _reply_tokens(load_records(str(path)), tokenizer, template_kwargs)
    report = {"conversations": len(replies), "reply_tokens": len(ids), "replies": sum(replies),
              "conversations_by_replies": dict(sorted(Counter(replies).items())),
              "distinct_first_prompts": len(firsts), "skipped": dict(skipped)}
    if draft_vocab_size and eval_paths:
        vocab_size = max(len(tokenizer), max(ids, default=0) + 1)
        counts_V = torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size)
        _, t2d_V = build_draft_vocab(counts_V, draft_vocab_size, [tokenizer.eos_token_id])
        eval_ids = [t for p in eval_paths for t in _reply_tokens(load_records(str(p)), tokenizer, template_kwargs)[0]]
        covered = sum(bool(t2d_V[t]) for t in eval_ids if t < vocab_size)
        report.update(draft_vocab_size=draft_vocab_size, eval_reply_tokens=len(eval_ids),
                      eval_coverage=covered / max(len(eval_ids), 1))
    return report


def _reply_tokens(records: list, tokenizer, template_kwargs: dict | None = None,
                  ) -> tuple[list[int], list[int], set[str], Counter]:
    """-> (reply token ids of every record, replies per chat record, normalized first user turns,
    skipped counts by reason). Text and token records count every token as a reply token."""
    from specheads.data.chat import TemplateError, tokenize_conversation
    from specheads.data.records import Conversation, normalize_record

    ids, replies, firsts, skipped = [], [], set(), Counter()
    for record in records:
        document, reason = normalize_record(record)
        if isinstance(document, Conversation):
            try:
                chat = tokenize_conversation(tokenizer, document, template_kwargs)
            except TemplateError as err:
                skipped[str(err)] += 1
                continue
            ids += [t for tokens, mask in chat.sequences for t, keep in zip(tokens, mask) if keep]
            messages = document.to_list()
            replies.append(sum(m["role"] == "assistant" for m in messages))
            first_user = next((m["content"] for m in messages if m["role"] == "user"), None)
            if first_user is not None:
                firsts.add(normalize(first_user))
        elif isinstance(document, str):
            ids += tokenizer(document, add_special_tokens=False)["input_ids"]
        elif isinstance(document, list):
            ids += document
        else:
            skipped[reason or "not a record"] += 1
    return ids, replies, firsts, skipped


def format_report(report: dict) -> str:
    lines = [f"conversations {report['conversations']}, replies {report['replies']}, reply tokens "
             f"{report['reply_tokens']}, distinct first prompts {report['distinct_first_prompts']}",
             "conversations by replies: " + ", ".join(f"{n}: {c}" for n, c in
                                                      report["conversations_by_replies"].items())]
    if report["skipped"]:
        lines.append("skipped: " + ", ".join(f"{r}: {c}" for r, c in sorted(report["skipped"].items())))
    if "eval_coverage" in report:
        lines.append(f"draft vocab of {report['draft_vocab_size']} covers {report['eval_coverage']:.1%} of "
                     f"{report['eval_reply_tokens']} evaluation reply tokens")
    return "\n".join(lines)
