"""The small local corpus for the embedded target: the running interpreter's stdlib sources.

Nothing is downloaded. Files are taken in sorted order and split into train and held-out
by a hash of their relative path, so the split is stable across runs and machines with
the same Python version.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
                 "lib2to3", "ensurepip", "turtledemo"}


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: Path | None = None) -> list[Path]:
    """All .py files of the standard library, minus tests and vendored packages, sorted."""
    root = root or stdlib_dir()
    files = [p for p in root.rglob("*.py")
             if not EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])]
    if not files:
        raise FileNotFoundError(f"no Python sources found under {root}; the embedded corpus needs the "
                                "standard library's .py files (some slim images strip them)")
    return sorted(files)


def is_heldout(relative_path: str, heldout_fraction: float) -> bool:
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < heldout_fraction


def split_sources(heldout_fraction: float = 0.05, root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(train files, held-out files), split by a hash of each file's path under the stdlib."""
    root = root or stdlib_dir()
    train, heldout = [], []
    for path in stdlib_sources(root):
        (heldout if is_heldout(str(path.relative_to(root)), heldout_fraction) else train).append(path)
    return train, heldout


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def stdlib_texts(split: str = "train", heldout_fraction: float = 0.05) -> list[str]:
    """The corpus as a list of documents (one per source file)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    train, heldout = split_sources(heldout_fraction)
    return [read_text(p) for p in (train if split == "train" else heldout)]
