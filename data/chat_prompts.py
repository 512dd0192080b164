"""Chat prompts for distilling heads of an instruction-tuned target, built locally (no hub).

    specheads data prompts --output prompts.jsonl [--num N] [--seed S] [--follow-up-fraction F]
    (in a recipe) data.source: embedded:chat   # prompts + the target's replies, generated once and cached

Heads learn to predict the target's own replies, so the prompts only have to make the
target talk the way it does for real users: many kinds of request, on many subjects. They
are built here from task templates x subjects, written for this project, across the kinds
of request chat benchmarks cover (writing, role-play, reasoning, math, coding, extraction,
STEM, humanities, everyday advice), with random numbers for the arithmetic. A fraction get a
follow-up turn ("Give me an example.") so that the heads also see second replies, which
condition on a first one. `specheads data regenerate` turns each record into a
conversation with the target's own replies.

Records are `{"id": "p00042", "category": "...", "turns": ["...", ...]}` (MT-bench's
shape). `self_distilled_chat` (the recipe source `embedded:chat`) builds them and has the
target reply, once per target and settings, into the specheads cache: resumable (data
regenerate's progress file) and lock-guarded, so several ranks or runs generate once.

They are disjoint from MT-bench and Spec-Bench, the evaluation sets: no template or
subject was taken from them, and tests/data/test_chat_prompts.py checks that no evaluation
prompt (or its first 60 characters) appears among them.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

EMBEDDED_CHAT = "embedded:chat"
CHAT_DATA_VERSION = 2  # bump when the prompts or their generation change: cached replies are rebuilt

SUBJECTS = [
    "bees", "volcanoes", "the water cycle", "compound interest", "sourdough bread", "public libraries",
    "electric cars", "coral reefs", "the printing press", "chess openings", "urban gardening", "jazz",
    "the Roman aqueducts", "black holes", "vaccines", "recycling plastic", "remote work", "sleep",
    "meditation", "marathon training", "the stock market", "solar panels", "tea ceremonies", "origami",
    "the Silk Road", "photosynthesis", "plate tectonics", "the immune system", "bicycles", "lighthouses",
    "board games", "learning a second language", "minimalism", "the moon landing", "rainforests",
    "climate change", "3D printing", "coffee", "honey", "octopuses", "the Renaissance", "impressionist painting",
    "classical music", "video game design", "budget travel", "camping", "first aid", "time management",
    "public speaking", "job interviews", "saving for retirement", "composting", "bird migration", "glaciers",
    "the internet", "encryption", "open-source software", "databases", "machine learning", "robots",
    "the human heart", "DNA", "antibiotics", "nutrition labels", "vegetarian cooking", "baking cookies",
    "dog training", "cats", "houseplants", "the Great Wall of China", "ancient Egypt", "the Industrial Revolution",
    "democracy", "libraries of the future", "museums", "poetry", "science fiction", "detective stories",
    "friendship", "moving to a new city", "a rainy afternoon", "the ocean", "mountains", "deserts", "trains",
    "airports", "bridges", "skyscrapers", "wind energy", "nuclear power", "batteries", "smartphones",
    "social media", "online privacy", "password managers", "spreadsheets", "personal budgeting", "negotiation",
    "team sports", "yoga", "the Olympic Games", "photography", "film editing", "podcasts", "knitting",
    "woodworking", "pottery", "the periodic table", "magnets", "rainbows", "earthquakes", "hurricanes",
    "wolves", "elephants", "penguins", "mushrooms", "maple syrup", "chocolate", "spices", "street food",
    "a small bookshop", "a community festival", "a lost umbrella", "an old clock", "a lighthouse keeper",
]

TASKS = {
    "writing": [
        "Write a short poem about {s}.",
        "Write a four-sentence story that involves {s}.",
        "Write a friendly email inviting a colleague to a talk about {s}.",
        "Write a catchy slogan and a one-paragraph advertisement for a product related to {s}.",
        "Write a short diary entry from someone who just discovered {s}.",
        "Draft an opening paragraph for a blog post about {s}.",
        "Write a haiku about {s}.",
        "Write a limerick about {s}.",
    ],
    "roleplay": [
        "Pretend you are a tour guide. Introduce a group of visitors to {s}.",
        "You are a grandparent telling a child about {s}. What do you say?",
        "Act as a radio host and give a one-minute segment on {s}.",
        "Imagine you are a teacher on the first day of a unit about {s}. Greet your class.",
    ],
    "reasoning": [
        "What are the pros and cons of {s}?",
        "Give three arguments for and three against investing public money in {s}.",
        "What could go wrong when someone first tries {s}, and how can they avoid it?",
        "Compare {s} with {t}: how are they alike and how do they differ?",
        "If {s} disappeared tomorrow, what would change in everyday life?",
    ],
    "stem": [
        "Explain {s} to a ten-year-old.",
        "How does {s} work? Keep it under 150 words.",
        "What is the science behind {s}?",
        "Describe {s} in three short paragraphs for a curious adult.",
        "What are common misconceptions about {s}?",
    ],
    "humanities": [
        "Summarize the history of {s} in a few sentences.",
        "Why does {s} matter to society?",
        "How has {s} changed over the last hundred years?",
        "What can {s} teach us about human nature?",
    ],
    "advice": [
        "Give me five practical tips for getting started with {s}.",
        "I want to learn about {s} in a month. Make me a simple weekly plan.",
        "What questions should a beginner ask before getting into {s}?",
        "Recommend a weekend activity related to {s} and explain why it is fun.",
    ],
    "extraction": [
        "List five keywords someone should know about {s}, with a one-line definition each.",
        "Turn this note into a bulleted checklist: 'read about {s}, buy a notebook, ask a friend, practise daily'.",
        "Give a JSON object with the fields name, category and one_fact for {s}.",
    ],
}

MATH = [
    "What is {a} multiplied by {b}? Show your working.",
    "A shop sells pens at {a} cents each. How much do {b} pens cost in dollars?",
    "Solve for x: {a}x + {b} = {c}.",
    "A train travels {a} kilometres in {b} hours. What is its average speed?",
    "What is {a} percent of {c}?",
    "I save {a} dollars every week. How many weeks until I have {c} dollars?",
    "A rectangle is {a} cm wide and {b} cm long. What are its area and perimeter?",
]

CODING = [
    "Write a Python function that {task}.",
    "Explain, step by step, how you would write a program that {task}.",
    "Write a JavaScript function that {task}, with a short comment.",
    "What is a simple way to test a function that {task}?",
]
CODING_TASKS = [
    "reverses a string", "counts the vowels in a sentence", "checks whether a number is prime",
    "returns the largest item of a list", "removes duplicates from a list while keeping order",
    "converts Celsius to Fahrenheit", "sums the digits of an integer", "checks if a word is a palindrome",
    "merges two sorted lists", "counts how often each word appears in a text", "computes a factorial",
    "finds the second smallest number in a list", "capitalizes the first letter of every word",
    "validates a simple email address", "flattens a nested list", "computes the average of a list of numbers",
]

FOLLOW_UPS = [
    "Can you give me a concrete example?", "Make that shorter, please.", "Now explain it as a bulleted list.",
    "Why is that?", "What would you add for an expert reader?", "Can you say that more simply?",
    "Thanks! What is one common mistake to avoid?", "Rewrite your answer in a more formal tone.",
    "Could you summarize that in one sentence?", "What should I read next to learn more?",
]


def build_prompts(num: int, seed: int = 0, follow_up_fraction: float = 0.5) -> list[dict]:
    """`num` distinct prompt records (module doc), deterministic for a seed."""
    if num < 1 or not 0 <= follow_up_fraction <= 1:
        raise ValueError(f"need num >= 1 and follow_up_fraction in [0, 1], got {num} and {follow_up_fraction}")
    rng = random.Random(seed)
    records, seen = [], set()
    kinds = list(TASKS) + ["math", "coding"]
    for _ in range(num * 20):  # the template x subject space is far larger than any num asked for
        if len(records) == num:
            break
        kind = rng.choice(kinds)
        text = _one_prompt(kind, rng)
        if text in seen:
            continue
        seen.add(text)
        turns = [text] + ([rng.choice(FOLLOW_UPS)] if rng.random() < follow_up_fraction else [])
        records.append({"id": f"p{len(records):05d}", "category": kind, "turns": turns})
    if len(records) < num:
        raise ValueError(f"only {len(records)} distinct prompts could be built, {num} were asked for")
    return records


def _one_prompt(kind: str, rng: random.Random) -> str:
    if kind == "math":
        a, b = rng.randint(2, 99), rng.randint(2, 60)
        return rng.choice(MATH).format(a=a, b=b, c=rng.randint(a + b, 2000))
    if kind == "coding":
        return rng.choice(CODING).format(task=rng.choice(CODING_TASKS))
    subject, other = rng.sample(SUBJECTS, 2)
    return rng.choice(TASKS[kind]).format(s=subject, t=other)


def write_prompts(output: str | Path, num: int, seed: int = 0, follow_up_fraction: float = 0.5) -> Path:
    """Write build_prompts(...) as JSON lines, atomically."""
    from specheads.data.regenerate import atomic_write_text

    records = build_prompts(num, seed, follow_up_fraction)
    atomic_write_text(Path(output), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return Path(output)


def self_distilled_chat(target_path: str, num_prompts: int, max_new_tokens: int, *, batch_size: int = 96,
                        seed: int = 0, dtype: str = "auto", cache_dir: str | Path | None = None, log=print) -> Path:
    """The `embedded:chat` data of a target: `num_prompts` prompts (build_prompts) with the
    target's own greedy replies (data/regenerate.py, in `dtype`: "auto" is the device's fast
    dtype), as OpenAI-messages JSON lines in the specheads cache; generated on first use,
    resumed if interrupted, then reused."""
    from specheads.data.regenerate import _target_fingerprint, regenerate, write_json_atomic
    from specheads.data.tiny_target import default_cache_dir
    from specheads.heads.target import resolve_dtype
    from filelock import FileLock

    resolved = str(resolve_dtype(dtype)).removeprefix("torch.")
    settings = {"version": CHAT_DATA_VERSION, "target": _target_fingerprint(target_path), "num": num_prompts,
                "max_new_tokens": max_new_tokens, "seed": seed, "dtype": resolved}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    directory = Path(cache_dir or default_cache_dir()) / "chat" / f"{Path(target_path).name}-{key}"
    replies, done = directory / "replies.jsonl", directory / "done.json"
    directory.mkdir(parents=True, exist_ok=True)
    with FileLock(directory.with_name(directory.name + ".lock")):
        if not done.exists():
            prompts = directory / "prompts.jsonl"
            if not prompts.exists():
                write_prompts(prompts, num_prompts, seed=seed)
            log(f"{EMBEDDED_CHAT}: the target replies to {num_prompts} prompts (once; cached in {directory})")
            progress = regenerate(target_path, str(prompts), str(replies), batch_size=batch_size,
                                  max_new_tokens=max_new_tokens, dtype=resolved, log=log)
            write_json_atomic(done, {**settings, "summary": progress.summary()})
    return replies
