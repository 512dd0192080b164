"""Writing files and directories atomically: the one module that does it.

Everything specheads publishes (heads directories, exports, checkpoints, the feature cache,
cached targets and chat data, progress files, bench reports) is written here, so a reader,
or a run killed half way, sees either the old thing or the whole new one:

    write_bytes(path, data) / write_text(path, text) / write_json(path, obj)
        a file: temp file beside it, fsync, rename over it;
    with temp_path(path) as tmp: torch.save(obj, tmp)
        the same for writers that want a file name (torch.save, safetensors' save_file);
    with staged_dir(final) as tmp: ...
        a directory: staged beside `final`, moved into place whole (replacing any old one);
    build_once(final, build)
        a cache entry (under default_cache_dir()): built once under a file lock by
        `build(staging)`, however many processes ask at the same time.

Temporary names start with "." and sit beside their target (a rename is atomic only within
one filesystem). mkstemp/mkdtemp's private modes are widened to what open()/mkdir() would
give (publish_modes), so a serving container or a teammate can read what was written.
This module is in heads/, the layer every part may import, and imports nothing of ours.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from filelock import FileLock


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def publish_modes(path: str | os.PathLike) -> None:
    """Give `path` (a file, or a directory and everything under it) the modes an ordinary
    open()/mkdir() would: mkstemp/mkdtemp make 0600/0700, which would leave a heads directory
    or a cache entry unreadable to the other users (a serving container, a teammate) who read it."""
    mask = _umask()
    path = Path(path)
    for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
        item.chmod((0o777 if item.is_dir() else 0o666) & ~mask)


def fsync(path: str | os.PathLike) -> None:
    """Flush a file's, or a directory's entries', data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def temp_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a temporary file name beside `path` for a writer that takes a name; a clean exit
    fsyncs it and renames it over `path`, an error removes it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        tmp.chmod(0o666 & ~_umask())
        fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write a file via temp file + fsync + rename, so it is either old or whole."""
    with temp_path(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    write_bytes(path, text.encode())


def write_json(path: str | os.PathLike, obj, indent: int = 2, **dumps_kwargs) -> None:
    """`obj` as JSON (and a final newline), atomically."""
    write_text(path, json.dumps(obj, indent=indent, **dumps_kwargs) + "\n")


def replace_dir(tmp_dir: str | os.PathLike, final_dir: str | os.PathLike) -> None:
    """Move a fully written `tmp_dir` to `final_dir`, replacing any previous directory (moved
    aside first, then deleted: there is no atomic rename over a non-empty directory)."""
    tmp_dir, final_dir = Path(tmp_dir), Path(final_dir)
    if not final_dir.exists():
        os.replace(tmp_dir, final_dir)
        return
    trash = Path(tempfile.mkdtemp(dir=final_dir.parent, prefix=f".{final_dir.name}.old-"))
    os.replace(final_dir, trash / "old")
    os.replace(tmp_dir, final_dir)
    shutil.rmtree(trash, ignore_errors=True)


@contextlib.contextmanager
def staged_dir(final_dir: str | os.PathLike) -> Iterator[Path]:
    """Write a directory atomically: yields an empty staging directory beside final_dir; a
    clean exit moves it into place (replacing any previous one), an error removes it."""
    final_dir = Path(final_dir)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final_dir.parent, prefix=f".{final_dir.name}.tmp-"))
    try:
        yield tmp
        publish_modes(tmp)
        replace_dir(tmp, final_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def default_cache_dir() -> Path:
    """Where cache entries live: SPECHEADS_CACHE, else $XDG_CACHE_HOME/specheads, else
    ~/.cache/specheads."""
    if os.environ.get("SPECHEADS_CACHE"):
        return Path(os.environ["SPECHEADS_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "specheads"
    return Path.home() / ".cache" / "specheads"


def build_once(final: str | os.PathLike, build: Callable[[Path], object], force: bool = False) -> Path:
    """`final`, made by `build(staging)` unless it exists (or `force`): under a file lock beside
    it, so concurrent callers build once and the rest wait and reuse it; staged_dir puts it
    in place whole, or removes the staging directory on any failure."""
    final = Path(final)
    if final.is_dir() and not force:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(final.with_name(final.name + ".lock")):
        if final.is_dir() and not force:  # another process built it while we waited
            return final
        with staged_dir(final) as staging:
            build(staging)
    return final
