"""Plain-text training data: records -> token ids -> packed fixed-length blocks -> sampler.

Sources (`DataConfig.source`):
  - "embedded:stdlib": the interpreter's standard-library sources (data/corpus.py), whose
    held-out split is the default evaluation data;
  - a local .jsonl / .json / .parquet file, read with `datasets.load_dataset`;
  - any other string: a `datasets` dataset name (its "train" split).

A record gives text in `text_field`, or token ids in an `input_ids` list (pre-tokenized
data needs no tokenizer). Records without usable text are counted by reason and reported,
never silently dropped. Documents are joined with EOS and cut into blocks [N, T]; only the
last block can be padded, and its padding has loss mask 0.

`BlockSampler` turns the blocks into one deterministic global stream (a seeded
permutation per epoch) that ranks read interleaved, so a run resumes at an exact sample
position and shards across DeepSpeed ranks without a DistributedSampler.

Shape legend: N blocks, T block length (seq_len).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

EMBEDDED_STDLIB = "embedded:stdlib"
LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
TOKENIZE_CHUNK = 256  # documents per tokenizer call


class DataError(ValueError):
    """Data that cannot be used; the message names the source."""


@dataclass
class DataReport:
    source: str
    num_records: int = 0
    num_documents: int = 0  # records that gave text or token ids
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count
    num_tokens: int = 0
    num_blocks: int = 0

    def summary(self) -> str:
        text = (f"{self.source}: {self.num_documents}/{self.num_records} records used, "
                f"{self.num_tokens} tokens in {self.num_blocks} blocks")
        if self.skipped:
            reasons = ", ".join(f"{reason}: {count}" for reason, count in sorted(self.skipped.items()))
            text += f"; skipped {sum(self.skipped.values())} ({reasons})"
        return text


@dataclass
class PackedBlocks:
    input_ids: torch.Tensor  # [N, T] int64
    loss_mask: torch.Tensor  # [N, T] bool, False only on the last block's padding
    report: DataReport

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> input_ids [b, T], loss_mask [b, T]"""
        index = torch.as_tensor(indices, dtype=torch.long)
        return self.input_ids[index], self.loss_mask[index]


# ---------------------------------------------------------------------------- records

def load_records(source: str, split: str = "train") -> list:
    """Raw records of `source`: strings for embedded:stdlib, dicts for datasets sources."""
    if source == EMBEDDED_STDLIB:
        from specheads.data.corpus import stdlib_texts

        return stdlib_texts("heldout" if split == "heldout" else "train")
    path = Path(source).expanduser()
    suffix = path.suffix.lower()
    if path.exists() or suffix in LOCAL_FORMATS or source.startswith((".", "/", "~")):
        if not path.is_file():
            raise DataError(f"data source {source!r} does not exist (expected a local "
                            f"{'/'.join(LOCAL_FORMATS)} file, {EMBEDDED_STDLIB}, or a datasets name)")
        if suffix not in LOCAL_FORMATS:
            raise DataError(f"data source {source!r}: unsupported file type {suffix or '(none)'!r}; "
                            f"expected one of {sorted(LOCAL_FORMATS)}")
        if path.stat().st_size == 0:
            return []
        return _load_dataset(source, LOCAL_FORMATS[suffix], data_files=str(path))
    return _load_dataset(source, source)


def _load_dataset(source: str, name: str, **kwargs) -> list[dict]:
    import datasets

    try:
        dataset = datasets.load_dataset(name, split="train", **kwargs)
    except Exception as err:  # datasets raises many types; the message is what matters
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"cannot load data source {source!r}: {first_line}") from err
    return list(dataset)


def extract_documents(records: list, text_field: str) -> tuple[list, Counter]:
    """-> documents (str or list[int]) and skipped-record counts by reason."""
    documents, skipped = [], Counter()
    for record in records:
        document, reason = _document(record, text_field)
        if reason is None:
            documents.append(document)
        else:
            skipped[reason] += 1
    return documents, skipped


def _document(record, text_field: str) -> tuple[str | list[int] | None, str | None]:
    """-> (document, None) or (None, why the record gives no document)."""
    if isinstance(record, str):
        return (record, None) if record.strip() else (None, "empty text")
    if not isinstance(record, dict):
        return None, f"not a mapping ({type(record).__name__})"
    text = record.get(text_field)
    if text is not None:
        if not isinstance(text, str):
            return None, f"{text_field!r} is not a string ({type(text).__name__})"
        return (text, None) if text.strip() else (None, f"empty {text_field!r}")
    token_ids = record.get("input_ids")
    if token_ids is not None:
        if not (isinstance(token_ids, list) and all(isinstance(t, int) and t >= 0 for t in token_ids)):
            return None, "input_ids is not a list of token ids"
        return (token_ids, None) if token_ids else (None, "empty input_ids")
    return None, f"missing field {text_field!r}"


# ---------------------------------------------------------------------------- tokens

def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as err:
        raise DataError(f"cannot load a tokenizer from {path!r} ({type(err).__name__}); set data.tokenizer "
                        "to a tokenizer path, or give records pre-tokenized `input_ids`") from err


def tokenize_documents(documents: list, tokenizer_path: str | None, trust_remote_code: bool = False,
                       ) -> tuple[list[list[int]], object | None]:
    """Token ids per document; the tokenizer is loaded only when some document is text."""
    if all(isinstance(doc, list) for doc in documents):
        return documents, None
    if tokenizer_path is None:
        raise DataError("text records need a tokenizer: set data.tokenizer")
    tokenizer = load_tokenizer(tokenizer_path, trust_remote_code)
    ids: list[list[int]] = [None] * len(documents)  # type: ignore[list-item]
    text_positions = [i for i, doc in enumerate(documents) if isinstance(doc, str)]
    for start in range(0, len(text_positions), TOKENIZE_CHUNK):
        chunk = text_positions[start:start + TOKENIZE_CHUNK]
        encoded = tokenizer([documents[i] for i in chunk], add_special_tokens=False, verbose=False)["input_ids"]
        for i, token_ids in zip(chunk, encoded):
            ids[i] = token_ids
    for i, doc in enumerate(documents):
        if ids[i] is None:
            ids[i] = doc
    return ids, tokenizer


def pack_blocks(documents: list[list[int]], seq_len: int, eos_id: int | None, pad_id: int,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Documents joined by EOS, cut into [N, T] blocks; the ragged tail is padded (mask 0)."""
    stream: list[int] = []
    for doc in documents:
        stream.extend(doc)
        if eos_id is not None:
            stream.append(eos_id)
    num_blocks = -(-len(stream) // seq_len)
    ids = torch.full((num_blocks * seq_len,), pad_id, dtype=torch.long)  # [N*T]
    mask = torch.zeros(num_blocks * seq_len, dtype=torch.bool)  # [N*T]
    ids[:len(stream)] = torch.tensor(stream, dtype=torch.long)
    mask[:len(stream)] = True
    return ids.view(num_blocks, seq_len), mask.view(num_blocks, seq_len)


# ---------------------------------------------------------------------------- pipeline

def _empty(source: str, num_records: int, skipped: Counter, text_field: str) -> DataError:
    reasons = ", ".join(f"{reason}: {count}" for reason, count in sorted(skipped.items()))
    return DataError(f"data source {source!r} is empty: {num_records} records, none with text in {text_field!r} "
                     f"or token ids in 'input_ids'" + (f" (skipped {reasons})" if reasons else ""))


def _special_ids(tokenizer, eos_token_id: int | None) -> tuple[int | None, int]:
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    eos = eos if eos is not None else eos_token_id
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    return eos, pad if pad is not None else (eos if eos is not None else 0)


def build_blocks(source: str, records: list, text_field: str, seq_len: int, tokenizer_path: str | None,
                 eos_token_id: int | None = None, vocab_size: int | None = None,
                 trust_remote_code: bool = False) -> PackedBlocks:
    """Records -> PackedBlocks; fails with a DataError naming `source` when nothing is usable."""
    documents, skipped = extract_documents(records, text_field)
    report = DataReport(source=source, num_records=len(records), num_documents=len(documents),
                        skipped=dict(skipped))
    if not documents:
        raise _empty(source, len(records), skipped, text_field)
    token_ids, tokenizer = tokenize_documents(documents, tokenizer_path, trust_remote_code)
    eos, pad = _special_ids(tokenizer, eos_token_id)
    input_ids, loss_mask = pack_blocks(token_ids, seq_len, eos, pad)
    if vocab_size is not None and int(input_ids.max()) >= vocab_size:
        raise DataError(f"data source {source!r} has token id {int(input_ids.max())}, but the target's vocab "
                        f"has {vocab_size} entries; the tokenizer or the pre-tokenized ids do not match the target")
    report.num_tokens = int(loss_mask.sum())
    report.num_blocks = input_ids.shape[0]
    return PackedBlocks(input_ids, loss_mask, report)


def split_records(records: list, fraction: float, seed: int) -> tuple[list, list]:
    """Seeded shuffle, then (train, held-out): the last `fraction` (at least one) is held out.

    With a single record there is nothing to hold out; both parts are that record.
    """
    records = list(records)
    random.Random(seed).shuffle(records)
    if len(records) < 2:
        return records, records
    num_eval = min(len(records) - 1, max(1, round(fraction * len(records))))
    return records[:-num_eval], records[-num_eval:]


def load_text_data(data, tokenizer_path: str | None, seed: int, eos_token_id: int | None = None,
                   vocab_size: int | None = None, trust_remote_code: bool = False) -> tuple[PackedBlocks, PackedBlocks]:
    """DataConfig -> (train blocks, held-out blocks); deterministic given `seed`."""
    records = load_records(data.source, "train")
    documents, skipped = extract_documents(records, data.text_field)
    if not documents:  # judged on the whole source, before any split
        raise _empty(data.source, len(records), skipped, data.text_field)
    if data.eval_source is not None:
        train_records, eval_records = _shuffled(records, seed), _shuffled(load_records(data.eval_source), seed)
    elif data.source == EMBEDDED_STDLIB:
        train_records, eval_records = _shuffled(records, seed), _shuffled(load_records(data.source, "heldout"), seed)
    else:
        train_records, eval_records = split_records(records, data.eval_fraction, seed)
    if data.max_records is not None:
        train_records, eval_records = train_records[:data.max_records], eval_records[:data.max_records]
    build = dict(text_field=data.text_field, seq_len=data.seq_len, tokenizer_path=data.tokenizer or tokenizer_path,
                 eos_token_id=eos_token_id, vocab_size=vocab_size, trust_remote_code=trust_remote_code)
    train = build_blocks(data.source, train_records, **build)
    eval_source = data.eval_source or (f"{data.source} (held-out)")
    if not eval_records:
        raise DataError(f"evaluation data {eval_source!r} is empty: no records to calibrate the heads on")
    return train, build_blocks(eval_source, eval_records, **build)


def _shuffled(records: list, seed: int) -> list:
    records = list(records)
    random.Random(seed).shuffle(records)
    return records


# ---------------------------------------------------------------------------- sampler

class BlockSampler:
    """A deterministic, resumable, rank-sharded stream of block indices.

    The global stream is epoch after epoch of a seeded permutation of range(num_blocks);
    `position` counts blocks consumed by all ranks together. One micro step consumes
    micro_batch_size * world_size blocks: rank r reads stream[position + r * micro_batch_size :
    position + (r + 1) * micro_batch_size]. Resuming at `position` replays nothing and skips
    nothing, for any rank.
    """

    def __init__(self, num_blocks: int, micro_batch_size: int, seed: int, rank: int = 0,
                 world_size: int = 1, position: int = 0):
        if num_blocks < 1:
            raise ValueError("a sampler needs at least one block")
        self.num_blocks = num_blocks
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.position = position
        self._epoch, self._perm = -1, None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.num_blocks, generator=generator)
        return self._perm

    def _stream(self, index: int) -> int:
        return int(self._permutation(index // self.num_blocks)[index % self.num_blocks])

    def next_indices(self) -> list[int]:
        """This rank's block indices for the next micro step; advances the global position."""
        start = self.position + self.rank * self.micro_batch_size
        indices = [self._stream(i) for i in range(start, start + self.micro_batch_size)]
        self.position += self.micro_batch_size * self.world_size
        return indices

    def state_dict(self) -> dict:
        return {"position": self.position, "num_blocks": self.num_blocks, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["num_blocks"] != self.num_blocks or state["seed"] != self.seed:
            raise DataError(f"the checkpoint was written for {state['num_blocks']} blocks with seed "
                            f"{state['seed']}, the data now has {self.num_blocks} blocks with seed {self.seed}; "
                            "the data or recipe changed since the checkpoint (use a new train.output_dir)")
        self.position = int(state["position"])
