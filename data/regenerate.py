"""Self-distillation data: rewrite every assistant turn with the target itself.

    specheads data regenerate --target T --input FILE --output FILE [--batch-size N] [--max-new-tokens N]

Heads learn to predict the target, so training on the target's own replies (rather than
on another model's) raises acceptance. For each conversation and each assistant turn i,
the target generates a replacement conditioned on the original turns before i, rendered
with the chat template (the tokenizer's, or data/chat.py's fallback) and its generation
prompt. Conditioning on the original turns (not on earlier regenerated replies) makes every
turn independent, so all turns of a batch of conversations are generated together.

Decoding is greedy by default (deterministic), left-padded and batched; generation stops
at the target's EOS ids (its generation_config's, which for chat models include the
end-of-turn token, plus the tokenizer's EOS). A generation that comes out empty keeps the
original reply and is counted. Records that are not valid chats are skipped and counted by
reason (data/records.py); every valid input record gives exactly one output line,
`{"index": i, "messages": [...]}` in OpenAI shape.

Resumable: output lines are appended one batch of conversations at a time (flushed and
fsynced), then OUTPUT.progress.json is replaced atomically with the next input record and
the output's byte length. A rerun truncates the output to that length (dropping a partial
trailing line or a batch written after the last progress update) and continues, so an
interrupted run never duplicates or loses a record.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specheads.data.chat import ensure_chat_template, generation_prompt_ids
from specheads.data.records import Conversation, normalize_record
from specheads.data.text import DataError, load_records, load_tokenizer

PROGRESS_SUFFIX = ".progress.json"


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
    skipped: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        text = (f"{self.next_record}/{self.num_input_records} records done, {self.num_written} written, "
                f"{self.num_turns} assistant turns regenerated ({self.num_empty_kept} empty, original kept)")
        if self.skipped:
            reasons = ", ".join(f"{reason}: {count}" for reason, count in sorted(self.skipped.items()))
            text += f"; skipped {sum(self.skipped.values())} ({reasons})"
        return text


def progress_path(output: Path) -> Path:
    return output.with_name(output.name + PROGRESS_SUFFIX)


def write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _start(input_path: str, output: Path, num_records: int, max_new_tokens: int) -> Progress:
    """Fresh progress, or the saved one with the output cut back to its last whole batch."""
    saved = progress_path(output)
    if not saved.exists():
        if output.exists() and output.stat().st_size > 0:
            raise DataError(f"output {str(output)!r} exists without {saved.name}; it was not written by "
                            "`specheads data regenerate` (or its progress was deleted): remove it or choose "
                            "another --output")
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_bytes(b"")
        progress = Progress(str(Path(input_path).resolve()), num_records, max_new_tokens)
        write_json_atomic(saved, asdict(progress))
        return progress
    progress = Progress(**json.loads(saved.read_text()))
    if (progress.input, progress.num_input_records, progress.max_new_tokens) != (
            str(Path(input_path).resolve()), num_records, max_new_tokens):
        raise DataError(f"{saved} belongs to another run (input {progress.input!r}, {progress.num_input_records} "
                        f"records, max_new_tokens {progress.max_new_tokens}); choose another --output")
    size = output.stat().st_size if output.exists() else 0
    if size < progress.output_bytes:
        raise DataError(f"output {str(output)!r} is shorter than its progress file says ({size} < "
                        f"{progress.output_bytes} bytes); it was modified, start again with a new --output")
    output.touch()
    os.truncate(output, progress.output_bytes)  # drop a partial line or an unrecorded batch
    return progress


def _stop_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


@torch.no_grad()
def generate_replies(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch_size: int) -> list[str]:
    """Greedy replies to token-id prompts, batch_size at a time with left padding."""
    stop_ids = _stop_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    device = next(model.parameters()).device
    replies = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        width = max(len(p) for p in chunk)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk], device=device)  # [b, L]
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad_id, eos_token_id=stop_ids)  # [b, L + new]
        for row in out[:, width:].tolist():
            cut = next((i for i, t in enumerate(row) if t in stop_ids), len(row))
            replies.append(tokenizer.decode(row[:cut], skip_special_tokens=True).strip())
    return replies


def _regenerate_batch(model, tokenizer, records: list, first_index: int, progress: Progress,
                      max_new_tokens: int, batch_size: int) -> list[str]:
    """-> output lines for the valid records of one batch; counts skips into `progress`."""
    conversations, prompts, slots = [], [], []  # slots[k] = (conversation, turn) prompt k replaces
    skipped = Counter(progress.skipped)
    for offset, record in enumerate(records):
        document, reason = normalize_record(record)
        if not isinstance(document, Conversation):
            skipped[reason or "not a chat record"] += 1
            continue
        messages = document.to_list()
        conversations.append((first_index + offset, messages))
        for turn, message in enumerate(messages):
            if message["role"] == "assistant":
                prompts.append(generation_prompt_ids(tokenizer, messages[:turn]))
                slots.append((len(conversations) - 1, turn))
    replies = generate_replies(model, tokenizer, prompts, max_new_tokens, batch_size) if prompts else []
    regenerated = [[dict(m) for m in messages] for _, messages in conversations]
    for (conv, turn), reply in zip(slots, replies):
        if reply:
            regenerated[conv][turn]["content"] = reply
        else:
            progress.num_empty_kept += 1
    progress.num_turns += len(replies)
    progress.skipped = dict(skipped)
    return [json.dumps({"index": index, "messages": messages}, ensure_ascii=False) + "\n"
            for (index, _), messages in zip(conversations, regenerated)]


def regenerate(target: str, input_path: str, output_path: str, *, tokenizer_path: str | None = None,
               batch_size: int = 8, max_new_tokens: int = 256, dtype: str = "float32", device: str = "cpu",
               trust_remote_code: bool = False, max_batches: int | None = None, log=print) -> Progress:
    """Regenerate `input_path` into `output_path`, resuming a previous run; -> the progress so far.

    max_batches stops after that many batches (a later call continues).
    """
    from specheads.heads.target import load_target

    if batch_size < 1 or max_new_tokens < 1:
        raise DataError(f"batch size and max new tokens must be >= 1, got {batch_size} and {max_new_tokens}")
    records = load_records(input_path)
    output = Path(output_path)
    progress = _start(input_path, output, len(records), max_new_tokens)
    if progress.next_record >= len(records):
        log(f"regenerate: {output} is complete: {progress.summary()}")
        return progress
    if progress.next_record:
        log(f"regenerate: resuming at record {progress.next_record}")
    tokenizer = load_tokenizer(tokenizer_path or target, trust_remote_code)
    ensure_chat_template(tokenizer)
    model = load_target(target, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    num_batches = 0
    while progress.next_record < len(records) and (max_batches is None or num_batches < max_batches):
        batch = records[progress.next_record:progress.next_record + batch_size]
        lines = _regenerate_batch(model, tokenizer, batch, progress.next_record, progress, max_new_tokens, batch_size)
        with open(output, "ab") as f:
            f.write("".join(lines).encode())
            f.flush()
            os.fsync(f.fileno())
            progress.output_bytes = f.tell()
        progress.next_record += len(batch)
        progress.num_written += len(lines)
        write_json_atomic(progress_path(output), asdict(progress))
        num_batches += 1
        log(f"regenerate: {progress.summary()}")
    return progress
