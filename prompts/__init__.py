"""The prompt files shipped with specheads, and where they are: the project's own bench set
(`default.jsonl`, 6 categories) and MT-bench's 80 questions (`mt_bench_question.jsonl`, an
evaluation set: never training data), both in Spec-Bench's question.jsonl format (README.md
here has their sources and licences).

The bottom floor for both parts that read them: the bench reads them as prompts
(bench/prompts.py), the data part keeps MT-bench's turns out of the training prompts
(data/self_instruct.py). It imports nothing of the project.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

DEFAULT_PROMPTS = "default.jsonl"
MT_BENCH_PROMPTS = "mt_bench_question.jsonl"


def default_prompts_path() -> Path:
    """The project's own bench prompts (6 categories)."""
    return Path(str(resources.files("specheads.prompts") / DEFAULT_PROMPTS))


def mt_bench_path() -> Path:
    """The 80 MT-bench questions."""
    return Path(str(resources.files("specheads.prompts") / MT_BENCH_PROMPTS))
