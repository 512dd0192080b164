"""The resume file of a regeneration and the in-order writer of its output (data/regenerate.py
makes the replies locally, data/remote_replies.py through servers; both write through this).

The output is appended in input order, a batch at a time, flushed and fsynced, and then
OUTPUT.progress.json is replaced atomically with the counts so far: a stopped run resumes
after its last whole batch (the output cut back to it), and only the run it belongs to (the
same input, reply length, thinking mode, sampling, target and served model) may resume it.
Records a server refused go to OUTPUT.rejects.jsonl the same way.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specheads.data.text import DataError
from specheads.heads import atomic

PROGRESS_SUFFIX, REJECTS_SUFFIX = ".progress.json", ".rejects.jsonl"


@dataclass
class Progress:
    input: str
    num_input_records: int
    max_new_tokens: int
    next_record: int = 0
    output_bytes: int = 0
    num_written: int = 0
    num_turns: int = 0
    num_empty_kept: int = 0  # generations that came out empty; the original reply was kept
    num_empty_ended: int = 0  # user-turn records: empty replies that ended their conversation early
    skipped: dict[str, int] = field(default_factory=dict)
    thinking: str = "default"  # the template's thinking mode the replies were generated in
    sampling: dict = field(default_factory=dict)  # sampled replies' settings ({}: greedy; data/remote_replies.py)
    target: str = ""  # the target the replies come from (a local --target, or a server's model root)
    served_model: str = ""  # the model name requested from servers ("": made locally)
    rejects_bytes: int = 0  # the rejects file's length after the last written batch

    def summary(self) -> str:
        text = (f"{self.next_record}/{self.num_input_records} records done, {self.num_written} written, "
                f"{self.num_turns} assistant turns generated ({self.num_empty_kept} empty, original kept; "
                f"{self.num_empty_ended} empty, conversation ended)")
        if self.skipped:
            reasons = ", ".join(f"{reason}: {count}" for reason, count in sorted(self.skipped.items()))
            text += f"; skipped {sum(self.skipped.values())} ({reasons})"
        return text


# Finished records are written (and fsynced) this many at a time: at 512 rows on a GPU a
# batch-sized write left up to 511 finished records unwritten (a stopped run there lost
# 1,340 finished replies, these and those behind unfinished records).
WRITE_EVERY = 64


def progress_path(output: Path) -> Path:
    return output.with_name(output.name + PROGRESS_SUFFIX)


def rejects_path(output: Path) -> Path:
    return output.with_name(output.name + REJECTS_SUFFIX)


def start_progress(input_path: str, output: Path, num_records: int, max_new_tokens: int, thinking: str,
                   sampling: dict | None = None, *, target: str = "", served_model: str = "") -> Progress:
    """Fresh progress, or the saved one with the output (and rejects file) cut back to its last
    whole batch; a saved one of another input, reply length, thinking mode, sampling, target or
    served model is refused (data/regenerate.py's module doc)."""
    sampling = sampling or {}
    saved = progress_path(output)
    if not saved.exists():
        if output.exists() and output.stat().st_size > 0:
            raise DataError(f"output {str(output)!r} exists without {saved.name}; it was not written by "
                            "`specheads data regenerate` (or its progress was deleted): remove it or choose "
                            "another --output")
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_bytes(b"")
        rejects_path(output).unlink(missing_ok=True)
        progress = Progress(str(Path(input_path).resolve()), num_records, max_new_tokens, thinking=thinking,
                            sampling=sampling, target=target, served_model=served_model)
        atomic.write_json(saved, asdict(progress))
        return progress
    progress = Progress(**json.loads(saved.read_text()))
    _check_same_model(saved, progress, target, served_model)
    if (progress.input, progress.num_input_records, progress.max_new_tokens, progress.thinking,
            progress.sampling) != (str(Path(input_path).resolve()), num_records, max_new_tokens, thinking, sampling):
        raise DataError(f"{saved} belongs to another run (input {progress.input!r}, {progress.num_input_records} "
                        f"records, max_new_tokens {progress.max_new_tokens}, thinking {progress.thinking!r}, "
                        f"sampling {progress.sampling or 'greedy'}); choose another --output")
    for path, length in ((output, progress.output_bytes), (rejects_path(output), progress.rejects_bytes)):
        size = path.stat().st_size if path.exists() else 0
        if size < length:
            raise DataError(f"{str(path)!r} is shorter than its progress file says ({size} < {length} bytes); it "
                            "was modified, start again with a new --output")
        if path == output or path.exists():
            path.touch()
            os.truncate(path, length)  # drop a partial line or an unrecorded batch
    return progress


def _check_same_model(saved: Path, progress: Progress, target: str, served_model: str) -> None:
    """A resume must ask the model that made the replies already written: the same target, and
    from servers the same served name (a local run and a server run of one target may resume
    each other)."""
    what = f"target {progress.target!r}" + (f" served as {progress.served_model!r}" if progress.served_model else "")
    now = f"target {target!r}" + (f" served as {served_model!r}" if served_model else "")
    if (progress.target and target and progress.target != target) or \
            (progress.served_model and served_model and progress.served_model != served_model):
        raise DataError(f"{saved} holds replies of {what}, but this run's come from {now}; resume with the same "
                        "model, or choose another --output")


class InOrderWriter:
    """Appends finished records' lines in input order: once the records from progress.next_record
    on are done, at least `every` of them (or the last ones) at a time, flushed and fsynced,
    then the progress file replaced atomically with their counts (the module doc's resume)."""

    def __init__(self, output: Path, progress: Progress, every: int):
        self.output, self.progress, self.every = output, progress, every
        self.done: dict = {}  # record index -> its finished job (data/regenerate.py RecordJob)

    def finished(self, job) -> None:
        self.done[job.index] = job
        if self._ready() >= self.every:
            self.write(self._ready())

    def flush(self) -> int:
        """Write the finished records that follow the written ones without a gap; -> how many
        finished records are left unwritten (behind one that never finished)."""
        if self._ready():
            self.write(self._ready())
        return len(self.done)

    def close(self) -> None:
        if self.flush():  # a record after a gap: never dropped silently
            raise RuntimeError(f"regenerate: records {sorted(self.done)[:5]}... finished but record "
                               f"{self.progress.next_record} never did; nothing after it was written")

    def _ready(self) -> int:
        """How many finished records follow progress.next_record without a gap."""
        ready = 0
        while self.progress.next_record + ready in self.done:
            ready += 1
        return ready

    def write(self, num_records: int) -> None:
        progress = self.progress
        jobs = [self.done.pop(progress.next_record + k) for k in range(num_records)]
        skipped = Counter(progress.skipped)
        for job in jobs:
            progress.num_turns += job.counts["num_turns"]
            progress.num_empty_kept += job.counts["num_empty_kept"]
            progress.num_empty_ended += job.counts["num_empty_ended"]
            if job.line is None:
                skipped[job.skip_reason] += 1
        progress.skipped = dict(skipped)
        lines = [job.line for job in jobs if job.line is not None]
        progress.output_bytes = _append(self.output, lines)
        rejected = [json.dumps({"index": job.index, **job.rejection}, ensure_ascii=False) + "\n"
                    for job in jobs if job.rejection is not None]
        if rejected:
            progress.rejects_bytes = _append(rejects_path(self.output), rejected)
        progress.next_record += num_records
        progress.num_written += len(lines)
        atomic.write_json(progress_path(self.output), asdict(progress))


def _append(path: Path, lines: list[str]) -> int:
    """Append lines, flushed and fsynced -> the file's length."""
    with open(path, "ab") as f:
        f.write("".join(lines).encode())
        f.flush()
        os.fsync(f.fileno())
        return f.tell()
