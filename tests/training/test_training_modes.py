"""Training modes are parts, not `if`s (issue 25): the count of mode branches in training/.

A mode branch is an `if` statement, a conditional expression, a `while` or a comprehension `if`
whose test chooses a training mode: the head kind (Medusa, EAGLE-3, EAGLE-1/2), LoRA joint
training, the feature cache, ZeRO-3. Recipe validation (config.py, recipe_models.py) is left
out: it refuses combinations, it does not run a mode. Parameter-name filters (`"lora_" in name`)
are not modes either.

Count them (any directory, e.g. an older commit's `git archive REV training | tar -x -C /tmp/old`):

    python tests/training/test_training_modes.py [DIR] [-v]
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

TRAINING = Path(__file__).resolve().parents[2] / "training"
MODES = {
    "head kind": r"EAGLE_KINDS|\bkind\b|Eagle3Head|MedusaHeads|truncated|\beagle\b|\bregress\b",
    "lora": r"\blora\b|peft_model|\bjoint\b|checkpoint_names|adapter_weights|\badapter\b",
    "feature cache": r"feature_cache|\bcache\b|AUTO_CACHE",
    "zero-3": r"zero_stage|\bstage\b\s*[<>=!]|partitioned|target_engine|\bds_(id|tensor)\b",
}
NOT_MODES = r'"lora_" (not )?in|set\(live\)'
VALIDATION = ("config.py", "recipe_models.py")
# The count at the last change of training/; a new mode belongs in a head kind
# (training/head_kinds.py) or a feature source (training/features.py), not in another `if`.
MAX_BRANCHES = 18


def mode_branches(source: str) -> list[tuple[str, int, str]]:
    """-> (mode, line, test text) of every mode branch in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            tests = [node.test]
        elif isinstance(node, ast.comprehension):
            tests = list(node.ifs)
        else:
            continue
        for test in tests:
            text = ast.get_source_segment(source, test)
            mode = next((name for name, pattern in MODES.items() if re.search(pattern, text)), None)
            if mode is not None and not re.search(NOT_MODES, text):
                found.append((mode, test.lineno, text))
    return sorted(found, key=lambda branch: branch[1])


def count(directory: Path) -> dict[str, list[tuple[str, int, str]]]:
    """file name -> its mode branches, for every training module with at least one."""
    counts = {}
    for path in sorted(directory.glob("*.py")):
        if path.name not in VALIDATION:
            branches = mode_branches(path.read_text())
            if branches:
                counts[path.name] = branches
    return counts


def test_the_counter_sees_each_way_of_asking():
    source = ("if spec.kind in EAGLE_KINDS: pass\n"
              "x = a if isinstance(h, Eagle3Head) else b\n"
              "if recipe.lora is not None: pass\n"
              "if recipe.data.feature_cache is not None: pass\n"
              "if train.zero_stage == 3: pass\n"
              "names = [n for n in names if \"lora_\" in n]\n")
    assert [mode for mode, _, _ in mode_branches(source)] == ["head kind", "head kind", "lora", "feature cache",
                                                                "zero-3"]


def test_the_step_the_head_kinds_and_the_feature_sources_ask_no_mode():
    """Each mode is one object chosen once (trainer.py); the parts that use them never ask which."""
    for name in ("steps.py", "head_kinds.py", "features.py", "cached.py", "lora.py", "calibrate.py", "losses.py",
                 "progress.py", "tracking.py"):
        assert mode_branches((TRAINING / name).read_text()) == [], name


def test_training_adds_no_mode_branches():
    counts = count(TRAINING)
    total = sum(len(branches) for branches in counts.values())
    where = ", ".join(f"{name} {len(branches)}" for name, branches in counts.items())
    assert total <= MAX_BRANCHES, (f"training/ has {total} mode branches ({where}), more than {MAX_BRANCHES}: put "
                                   "the new mode in a head kind or a feature source")


if __name__ == "__main__":
    directory = Path(next((arg for arg in sys.argv[1:] if arg != "-v"), TRAINING))
    counts = count(directory)
    totals = {mode: 0 for mode in MODES}
    for name, branches in counts.items():
        print(f"{name}: {len(branches)}")
        for mode, line, text in sorted(branches) if "-v" in sys.argv else ():
            print(f"    {mode}: L{line} {text}")
        for mode, _, _ in branches:
            totals[mode] += 1
    print(", ".join(f"{mode} {n}" for mode, n in totals.items()),
          f"| total {sum(totals.values())} in {len(counts)} files")
