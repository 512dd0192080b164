"""Training data with `datasets` split expressions (data.split, data.eval_split).

`data.split` (default "train") and `data.eval_split` name splits in `datasets.load_dataset`'s
syntax (`train`, `train[:1%]`, `validation`, `train[1000:2000]`), for a datasets name or a
local .jsonl/.json/.parquet file (a local file is one split, `train`, which slicing can
divide: split `train[:90%]`, eval_split `train[90%:]`).

Held-out data: `eval_split` if set (of `eval_source` when given, else of `source`); else the
rules of data/text.py (eval_source, the stdlib's held-out part, the last eval_fraction).
With the defaults (split "train", no eval_split) this is exactly data.text.load_text_data.

The records then go through data/text.py unchanged (records -> token ids -> packed blocks).
"""

from __future__ import annotations

from pathlib import Path

from specheads.data.text import (EMBEDDED_STDLIB, LOCAL_FORMATS, DataError, PackedBlocks, extract_documents,
                                 load_records, load_text_data, shuffled_records, split_records,
                                 train_and_eval_blocks)


def load_split_records(source: str, split: str) -> list:
    """Records of `split` of a datasets name or a local data file, via datasets.load_dataset."""
    if source == EMBEDDED_STDLIB:
        raise DataError(f"data.split {split!r}: {EMBEDDED_STDLIB} is not a datasets source and has its own "
                        "train/held-out parts; use a datasets name or a local .jsonl/.json/.parquet file, or "
                        "leave data.split at 'train' and data.eval_split unset")
    import datasets

    path = Path(source).expanduser()
    if path.suffix.lower() in LOCAL_FORMATS or path.exists():
        load_records(source)  # the same checks (exists, file type) and messages as an unsplit source
        name, kwargs = LOCAL_FORMATS[path.suffix.lower()], {"data_files": str(path)}
    else:
        name, kwargs = source, {}
    try:
        dataset = datasets.load_dataset(name, split=split, **kwargs)
    except Exception as err:  # datasets raises many types (bad split, unknown name); the message matters
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"cannot load split {split!r} of data source {source!r}: {first_line}") from err
    return list(dataset)


def load_training_data(data, tokenizer_path: str | None, seed: int, eos_token_id: int | None = None,
                       vocab_size: int | None = None, trust_remote_code: bool = False,
                       ) -> tuple[PackedBlocks, PackedBlocks]:
    """DataConfig -> (train blocks, held-out blocks), honouring data.split and data.eval_split."""
    if data.split == "train" and data.eval_split is None:
        return load_text_data(data, tokenizer_path, seed, eos_token_id, vocab_size, trust_remote_code)
    records = load_split_records(data.source, data.split)
    documents, skipped = extract_documents(records, data.text_field)
    if not documents:
        raise DataError(f"data source {data.source!r} split {data.split!r} has no usable records "
                        f"({len(records)} records; skipped {dict(skipped)})")
    if data.eval_split is not None:
        eval_from = data.eval_source or data.source
        train_records, eval_records = shuffled_records(records, seed), shuffled_records(
            load_split_records(eval_from, data.eval_split), seed)
        eval_name = f"{eval_from} [{data.eval_split}]"
    elif data.eval_source is not None:
        train_records, eval_records = shuffled_records(records, seed), shuffled_records(load_records(data.eval_source), seed)
        eval_name = data.eval_source
    else:
        train_records, eval_records = split_records(records, data.eval_fraction, seed)
        eval_name = f"{data.source} [{data.split}] (held-out)"
    return train_and_eval_blocks(data, f"{data.source} [{data.split}]", train_records, eval_name, eval_records,
                                 tokenizer_path, eos_token_id, vocab_size, trust_remote_code)
