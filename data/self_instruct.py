"""Self-instruct: the target writes user prompts itself, one per kind, subject and instruction.

    specheads data prompts --output prompts.jsonl --self-instruct --target T [--self-instruct-fraction F]
    (in Python) self_distilled_chat(..., self_instruct_fraction=F)

Template prompts (data/chat_prompts.py) are regular; prompts the target writes are phrased
the way the target (and the users it was tuned on) phrase requests. For each kind of
request (KIND_STYLES) and a subject of that kind, the target is asked, through its chat
template, "Write one question a user might ask an assistant about X, in the style of a
<kind>"; its reply (the serving engine's batched decoding, data/regenerate.py's
target_continuations), first line only, is a candidate. Greedy replies give one candidate
per kind x subject x instruction (3753 in all), which caps what a seed can add; at a
temperature above 0 each is sampled with its own seed and the plan may repeat
instructions, so more data means more prompts. Candidates then pass
`filter_candidates`: length bounds, English-looking, ends like a question or request, not an
evaluation prompt (MT-bench, shipped in prompts/, plus any files given) nor one's first
60 characters, and distinct after normalize() from every prompt kept so far. Every rejected
candidate is counted by reason, and the counts are returned and printed.

`mixed_prompts` puts the two together: a share of the records from self-instruct, the rest
from the templates, num distinct first turns in all, deterministic for a target and seed.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from pathlib import Path

from specheads.data.chat_prompts import build_prompts, follow_ups, normalize
from specheads.data.chat_text import CODE_TASKS, EVERYDAY_TOPICS, HUMANITIES_TOPICS, STEM_TOPICS, WRITING_SUBJECTS

INSTRUCTIONS = [
    "Write one question a user might ask an assistant about {subject}, in the style of {style}. "
    "Reply with the question only.",
    "Write one request that someone could send to an AI assistant about {subject}. It should be {style}. "
    "Write only the request itself.",
    "What is one thing a user might ask a chatbot about {subject}? Make it {style}. "
    "Answer with the user's message in quotes.",
]
KIND_STYLES = {  # kind -> (the style the instruction names, the subjects it is asked about)
    "writing": ("a creative writing request", WRITING_SUBJECTS + EVERYDAY_TOPICS),
    "roleplay": ("a role-play request", EVERYDAY_TOPICS + HUMANITIES_TOPICS),
    "reasoning": ("a question that needs careful reasoning", EVERYDAY_TOPICS + STEM_TOPICS),
    "math": ("a short math problem", EVERYDAY_TOPICS),
    "math_reasoning": ("a math word problem with numbers", EVERYDAY_TOPICS),
    "coding": ("a programming task", [f"a function that {task}" for task in CODE_TASKS] + STEM_TOPICS),
    "extraction": ("a request to pull facts out of a short text", EVERYDAY_TOPICS + HUMANITIES_TOPICS),
    "stem": ("a science or technology question", STEM_TOPICS),
    "humanities": ("a history, art or philosophy question", HUMANITIES_TOPICS),
    "translation": ("a request to translate a sentence", EVERYDAY_TOPICS),
    "summarization": ("a request to summarize an article", HUMANITIES_TOPICS + STEM_TOPICS),
    "qa": ("a short factual question", STEM_TOPICS + HUMANITIES_TOPICS),
    "advice": ("a request for practical advice", EVERYDAY_TOPICS),
}
SELF_INSTRUCT = "self-instruct/"  # category prefix of the prompts the target wrote
MIN_CHARS, MAX_CHARS, MIN_WORDS = 15, 400, 4
TOP_P = 0.95  # sampled self-instruct: the tail of a small model's distribution is mostly noise
REQUEST_WORDS = {"write", "explain", "describe", "give", "list", "tell", "summarize", "summarise", "translate",
                 "compare", "create", "suggest", "help", "show", "make", "calculate", "solve", "find", "imagine",
                 "pretend", "act", "draft", "compose", "recommend", "provide", "outline", "design", "plan",
                 "extract", "identify", "discuss", "analyze", "analyse", "please", "can", "could", "would", "i"}
PREFIX = re.compile(r"^\s*(?:(?:\d+[.)]|[-*])\s*)?(?:(?:user\s+)?(?:question|request|q)\s*:\s*)?", re.IGNORECASE)
QUOTED = re.compile(r"[\"“]([^\"“”]{%d,})[\"”]?" % 15)  # a quoted message, maybe unterminated (cut off)
# the last two rows: phrases that sampled answers (a temperature above 0) leaked past the others
ASSISTANT_VOICE = ("i'm here to", "i am here to", "i'm ready to", "i'm happy to", "i'm thrilled", "i'd be happy",
                   "i'll do my best", "what a wonderful", "what a great", "here's a", "here is a", "as an ai",
                   "how can i help", "how can i assist",
                   "i'm an ai", "i am an ai", "i'm a chatbot", "i am a chatbot", "as a chatbot", "i'm sorry for",
                   "i'm sorry, but", "what a fantastic")
ECHO_PHRASES = ("user might ask", "ask an assistant about", "ask a chatbot about", "send to an ai assistant")
REJECT_REASONS = ("empty", "too short", "too long", "not English", "echoes the instruction", "assistant voice", "not a question or request",
                  "evaluation prompt", "duplicate", "over the self-instruct share")


def evaluation_turns(paths: list[str | Path] = ()) -> list[str]:
    """Every turn of the evaluation prompts: MT-bench (shipped in prompts/) and `paths`
    (question.jsonl files, e.g. Spec-Bench's)."""
    from specheads.prompts import mt_bench_path

    shipped = mt_bench_path()
    turns = []
    for path in [shipped, *map(Path, paths)]:
        turns += [t for line in path.read_text().splitlines() if line.strip() for t in json.loads(line)["turns"]]
    return turns


def clean(reply: str) -> str:
    """A generated reply -> the candidate prompt: the first quoted message of its first non-empty
    line if it has one ('A user might ask: "..."'), else that line without list markers, a
    'Question:' label or wrapping quotes."""
    line = next((part for part in reply.strip().splitlines() if part.strip()), "")
    quoted = QUOTED.search(line)
    text = quoted.group(1) if quoted else PREFIX.sub("", line)
    return text.strip().strip("\"'“”").strip()


def reject_reason(text: str, eval_texts: set[str], eval_heads: set[str], seen: set[str]) -> str | None:
    """Why a candidate is rejected (one of REJECT_REASONS), or None to keep it. eval_texts /
    eval_heads: normalized evaluation turns and their first 60 characters; seen: normalized prompts kept."""
    if not text.strip():
        return "empty"
    if len(text) < MIN_CHARS or len(text.split()) < MIN_WORDS:
        return "too short"
    if len(text) > MAX_CHARS:
        return "too long"
    letters = [c for c in text if c.isalpha()]
    if not letters or sum(c.isascii() for c in letters) < 0.95 * len(letters) or len(letters) < 0.6 * len(text):
        return "not English"
    lower = text.lower().replace("’", "'")
    if any(phrase in lower for phrase in ECHO_PHRASES):
        return "echoes the instruction"
    if any(phrase in lower for phrase in ASSISTANT_VOICE):
        return "assistant voice"
    first_word = normalize(text).split(" ")[0]
    if not (text.rstrip().endswith("?") or (text.rstrip()[-1] in ".!" and first_word in REQUEST_WORDS)):
        return "not a question or request"
    key = normalize(text)
    if key in eval_texts or key[:60] in eval_heads or text.lower()[:60] in eval_heads:
        return "evaluation prompt"
    if key in seen:
        return "duplicate"
    return None


def filter_candidates(candidates: list[tuple[str, str]], eval_turns: list[str],
                      seen: set[str] = frozenset()) -> tuple[list[tuple[str, str]], Counter]:
    """(kind, text) candidates -> (kept, rejected counts by reason). `seen`: normalized prompts
    that already exist (the template prompts); kept ones are added as they pass."""
    eval_texts = {normalize(t) for t in eval_turns}
    eval_heads = {t[:60] for t in eval_texts} | {t.lower()[:60] for t in eval_turns}
    seen, kept, rejected = set(seen), [], Counter()
    for kind, text in candidates:
        reason = reject_reason(text, eval_texts, eval_heads, seen)
        if reason:
            rejected[reason] += 1
            continue
        seen.add(normalize(text))
        kept.append((kind, text))
    return kept, rejected


def plan(num: int, seed: int, *, repeat: bool = False) -> list[tuple[str, str]]:
    """num (kind, instruction) pairs drawn without replacement from kinds x subjects x INSTRUCTIONS,
    at most the whole space; with `repeat` (sampled answers differ), past the space's size
    another pass over it, in another order, and so on until num."""
    space = [(kind, instruction.format(subject=subject, style=style))
             for kind, (style, subjects) in KIND_STYLES.items() for subject in subjects for instruction in INSTRUCTIONS]
    rng = random.Random(seed)
    drawn = rng.sample(space, min(num, len(space)))
    while repeat and len(drawn) < num:
        drawn += rng.sample(space, min(num - len(drawn), len(space)))
    return drawn


def generate_candidates(target_path: str, instructions: list[tuple[str, str]], *, max_new_tokens: int = 64,
                        batch_size: int = 64, dtype: str = "auto", device: str = "cpu", temperature: float = 0.0,
                        seed: int = 0, trust_remote_code: bool = False) -> list[tuple[str, str]]:
    """The target's answer to each (kind, instruction), cleaned: -> (kind, candidate) pairs.
    Greedy at temperature 0; above it, sampled (top-p TOP_P), the i-th answer with its own
    seed drawn from `seed`, so a seed gives the same candidates on a rerun. On a CUDA device
    the decode steps replay CUDA graphs, as `data regenerate` does there."""
    from specheads.data.chat import ensure_chat_template, generation_prompt_ids
    from specheads.data.regenerate import load_generation_target, target_continuations
    from specheads.data.text import load_tokenizer

    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2:
        raise ValueError(f"self-instruct temperature must be a number in [0, 2] (0 = greedy), got {temperature!r}")
    tokenizer = load_tokenizer(target_path, trust_remote_code)
    ensure_chat_template(tokenizer)
    target = load_generation_target(target_path, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    prompts = [generation_prompt_ids(tokenizer, [{"role": "user", "content": text}]) for _, text in instructions]
    rng = random.Random(f"self-instruct sampling {seed}")
    seeds = [rng.getrandbits(63) for _ in prompts] if temperature > 0 else None
    replies = target_continuations(target, tokenizer, prompts, max_new_tokens, batch_size, temperature=temperature,
                                   top_p=TOP_P, seeds=seeds,
                                   cuda_graphs="capture" if target.device.type == "cuda" else None)
    return [(kind, clean(tokenizer.decode(ids, skip_special_tokens=True)))
            for (kind, _), ids in zip(instructions, replies)]


def mixed_prompts(num: int, target_path: str, *, self_instruct_fraction: float = 0.5, seed: int = 0,
                  follow_up_fraction: float = 0.5, third_turn_fraction: float = 0.5, eval_paths=(),
                  temperature: float = 0.0, log=print, **generation) -> tuple[list[dict], Counter]:
    """num records (chat_prompts' shape), about self_instruct_fraction of them written by the target
    (as many as pass the filter, at most that share), the rest from the templates; -> (records,
    rejected counts). temperature: generate_candidates' (0, greedy: at most one candidate per
    kind x subject x instruction, so the share is capped: SmolLM2 gave 989 where 6000 prompts
    asked for 1200; above 0 the plan repeats them and every answer is drawn anew).
    generation: generate_candidates' other keyword arguments."""
    if not 0 <= self_instruct_fraction <= 1:
        raise ValueError(f"self_instruct_fraction must be in [0, 1], got {self_instruct_fraction}")
    wanted = round(num * self_instruct_fraction)
    templates = build_prompts(num, seed, follow_up_fraction, third_turn_fraction)
    # About a third of a small target's answers pass the filter (SmolLM2-135M), hence 4x as many asked.
    candidates = generate_candidates(target_path, plan(4 * wanted, seed, repeat=temperature > 0),
                                     temperature=temperature, seed=seed, **generation) if wanted else []
    kept, rejected = filter_candidates(candidates, evaluation_turns(eval_paths),
                                       {normalize(r["turns"][0]) for r in templates})
    if len(kept) > wanted:
        rejected["over the self-instruct share"] += len(kept) - wanted
        kept = kept[:wanted]
    rng = random.Random(seed + 1)
    firsts = [(SELF_INSTRUCT + kind, text) for kind, text in kept] + [(r["category"], r["turns"][0])
                                                                        for r in templates]
    firsts = firsts[:num]
    rng.shuffle(firsts)
    records = [{"id": f"p{i:05d}", "category": category, "turns": [text] + follow_ups(
                category.removeprefix(SELF_INSTRUCT), rng, follow_up_fraction, third_turn_fraction)}
               for i, (category, text) in enumerate(firsts)]
    log(f"self-instruct: {len(kept)} of {len(candidates)} generated prompts kept ({wanted} wanted), "
        f"{num - len(kept)} from templates; rejected: {format_rejects(rejected)}")
    return records, rejected


def format_rejects(rejected: Counter, reasons: tuple[str, ...] = REJECT_REASONS) -> str:
    return ", ".join(f"{reason} {rejected[reason]}" for reason in reasons if rejected[reason]) or "none"
