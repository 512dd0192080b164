"""Plain-text training data: records -> token ids -> packed fixed-length blocks -> sampler.

Sources (`DataConfig.source`):
  - "embedded:stdlib": the interpreter's standard-library sources (data/corpus.py), whose
    held-out split is the default evaluation data;
  - a local .jsonl / .json / .parquet file, read with `datasets.load_dataset`;
  - any other string: a `datasets` dataset name (its "train" split).

A record is a ShareGPT `conversations` list, an OpenAI `messages` list, text in
`text_field`, or token ids in an `input_ids` list (pre-tokenized data needs no tokenizer);
the shape is detected per record (data/records.py). Conversations are rendered with the
tokenizer's chat template (or a documented fallback) and get a loss mask on assistant
tokens only (data/chat.py): one sequence per conversation, or one per reply where the
template rewrites earlier turns (turn by turn, counted in the report), with the template
kwargs of `thinking` (data/chat.py); text and token-id documents are all loss. A sequence
longer than seq_len is cut to seq_len tokens when `truncate` is on (counted in the report),
else skipped as "longer than seq_len" (a reply's sequence of a turn-by-turn conversation is
counted among `skipped_turns` while the conversation keeps others). Records without usable
content are counted by reason and reported, never silently dropped. Sequences are joined
with EOS (loss on it for text, not for conversations, whose template ends each reply) and
cut into blocks [N, T]; only the last block can be padded, and its padding has loss mask 0.

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

from specheads.data.chat import TemplateError, ensure_chat_template, thinking_kwargs, tokenize_conversation
from specheads.data.records import Conversation, normalize_record

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
    num_tokens: int = 0  # tokens with loss
    num_blocks: int = 0
    num_conversations: int = 0
    num_truncated: int = 0  # conversation sequences cut to seq_len
    chat_template: str | None = None  # "tokenizer" | "fallback" when conversations were rendered
    num_turn_by_turn: int = 0  # conversations trained turn by turn (data/chat.py) ...
    num_turn_sequences: int = 0  # ... in this many sequences, one per reply
    skipped_turns: dict[str, int] = field(default_factory=dict)  # their replies' sequences left out, by reason
    num_reasoning_left_out: int = 0  # replies whose reasoning is not trained on (thinking off, or not rendered)

    def summary(self) -> str:
        text = (f"{self.source}: {self.num_documents}/{self.num_records} records used, "
                f"{self.num_tokens} tokens in {self.num_blocks} blocks")
        if self.num_conversations:
            text += f"; {self.num_conversations} conversations ({self.chat_template} chat template"
            text += f", {self.num_truncated} truncated to seq_len)" if self.num_truncated else ")"
        if self.num_turn_by_turn:
            text += (f"; {self.num_turn_by_turn} of them rendered turn by turn, as {self.num_turn_sequences} "
                     "sequences (one per reply: the chat template rewrites earlier turns)")
        if self.skipped_turns:
            reasons = ", ".join(f"{reason}: {count}" for reason, count in sorted(self.skipped_turns.items()))
            text += f"; {sum(self.skipped_turns.values())} replies left out ({reasons})"
        if self.num_reasoning_left_out:
            text += (f"; reasoning of {self.num_reasoning_left_out} replies not trained on (thinking off, "
                     "or the template does not render it)")
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
    path = check_source(source)
    if path is None:
        return _load_dataset(source, source)
    if path.stat().st_size == 0:
        return []
    return _load_dataset(source, LOCAL_FORMATS[path.suffix.lower()], data_files=str(path))


def check_source(source: str) -> Path | None:
    """A data source that names a local file must be one of a format we read (a DataError
    otherwise, in one line): checked before any model loads. -> its path, or None for a
    `datasets` name (or embedded:stdlib), which only loading can check."""
    if source == EMBEDDED_STDLIB:
        return None
    path = Path(source).expanduser()
    suffix = path.suffix.lower()
    if not (path.exists() or suffix in LOCAL_FORMATS or source.startswith((".", "/", "~"))):
        return None
    if not path.is_file():
        raise DataError(f"data source {source!r} does not exist (expected a local "
                        f"{'/'.join(LOCAL_FORMATS)} file, {EMBEDDED_STDLIB}, or a datasets name)")
    if suffix not in LOCAL_FORMATS:
        raise DataError(f"data source {source!r}: unsupported file type {suffix or '(none)'!r}; "
                        f"expected one of {sorted(LOCAL_FORMATS)}")
    return path


def _load_dataset(source: str, name: str, **kwargs) -> list[dict]:
    import datasets

    try:
        dataset = datasets.load_dataset(name, split="train", **kwargs)
    except Exception as err:  # datasets raises many types; the message is what matters
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"cannot load data source {source!r}: {first_line}") from err
    return list(dataset)


def extract_documents(records: list, text_field: str) -> tuple[list, Counter]:
    """-> documents (str, list[int] or Conversation) and skipped-record counts by reason."""
    documents, skipped = [], Counter()
    for record in records:
        document, reason = normalize_record(record, text_field)
        if reason is None:
            documents.append(document)
        else:
            skipped[reason] += 1
    return documents, skipped


# ---------------------------------------------------------------------------- tokens

def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as err:
        raise DataError(f"cannot load a tokenizer from {path!r} ({type(err).__name__}); set data.tokenizer "
                        "to a tokenizer path, or give records pre-tokenized `input_ids`") from err


@dataclass
class Tokenized:
    token_ids: list[list[int]]  # one list per sequence (a document, or one reply of a turn-by-turn conversation)
    loss_masks: list[list[bool] | None]  # per sequence; None = every token has loss
    tokenizer: object | None
    skipped: Counter  # documents dropped at tokenization, by reason
    num_documents: int = 0  # documents kept
    num_conversations: int = 0
    num_truncated: int = 0
    chat_template: str | None = None
    num_turn_by_turn: int = 0
    num_turn_sequences: int = 0
    skipped_turns: Counter = field(default_factory=Counter)
    num_reasoning_left_out: int = 0


def tokenize_documents(documents: list, tokenizer_path: str | None, trust_remote_code: bool = False,
                       seq_len: int | None = None, truncate: bool = True, tokenizer=None,
                       thinking: str = "default") -> Tokenized:
    """Token ids (+ assistant loss masks for conversations) per document, or per reply of a
    conversation trained turn by turn.

    The tokenizer is loaded only when some document is text or a conversation. A
    conversation the template cannot split into assistant replies, or (with truncate off)
    one longer than seq_len, is dropped and counted in `skipped`.
    """
    out = Tokenized([], [], tokenizer, Counter())
    if all(isinstance(doc, list) for doc in documents):
        out.token_ids, out.loss_masks = list(documents), [None] * len(documents)
        out.num_documents = len(documents)
        return out
    if out.tokenizer is None:
        if tokenizer_path is None:
            raise DataError("text records need a tokenizer: set data.tokenizer")
        out.tokenizer = load_tokenizer(tokenizer_path, trust_remote_code)
    text_ids = _tokenize_texts(out.tokenizer, [doc for doc in documents if isinstance(doc, str)])
    template_kwargs: dict = {}
    if any(isinstance(doc, Conversation) for doc in documents):
        if not getattr(out.tokenizer, "is_fast", False):
            raise DataError("chat records need a fast tokenizer (assistant spans are found from character "
                            f"offsets); {type(out.tokenizer).__name__} is not one")
        out.chat_template = ensure_chat_template(out.tokenizer)
        try:
            template_kwargs = thinking_kwargs(out.tokenizer, thinking)
        except ValueError as err:  # a thinking mode the template has no switch for
            raise DataError(str(err)) from err
    for doc in documents:
        if isinstance(doc, Conversation):
            _add_conversation(out, doc, seq_len, truncate, template_kwargs)
            continue
        out.token_ids.append(next(text_ids) if isinstance(doc, str) else doc)
        out.loss_masks.append(None)
        out.num_documents += 1
    return out


def _tokenize_texts(tokenizer, texts: list[str]):
    for start in range(0, len(texts), TOKENIZE_CHUNK):
        yield from tokenizer(texts[start:start + TOKENIZE_CHUNK], add_special_tokens=False, verbose=False)["input_ids"]


def _add_conversation(out: Tokenized, conversation: Conversation, seq_len: int | None, truncate: bool,
                      template_kwargs: dict) -> None:
    try:
        chat = tokenize_conversation(out.tokenizer, conversation, template_kwargs)
    except TemplateError as err:
        out.skipped[str(err)] += 1
        return
    except Exception as err:  # a template may raise anything (jinja errors, raise_exception)
        out.skipped[f"chat template error ({type(err).__name__})"] += 1
        return
    kept, reasons, num_truncated = [], Counter(), 0
    for ids, mask in chat.sequences:
        if seq_len is not None and len(ids) > seq_len:
            if not truncate:
                reasons["longer than seq_len"] += 1
                continue
            ids, mask = ids[:seq_len], mask[:seq_len]
            if not any(mask):
                reasons["no assistant token within seq_len"] += 1
                continue
            num_truncated += 1
        kept.append((ids, mask))
    if not kept:
        out.skipped[next(iter(reasons))] += 1
        return
    out.skipped_turns.update(reasons)
    out.num_truncated += num_truncated
    out.num_documents += 1
    out.num_conversations += 1
    out.num_reasoning_left_out += chat.num_reasoning_left_out
    if chat.turn_by_turn:
        out.num_turn_by_turn += 1
        out.num_turn_sequences += len(kept)
    for ids, mask in kept:
        out.token_ids.append(ids)
        out.loss_masks.append(mask)


def pack_blocks(documents: list[list[int]], seq_len: int, eos_id: int | None, pad_id: int,
                loss_masks: list[list[bool] | None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Documents joined by EOS, cut into [N, T] blocks; the ragged tail is padded (mask 0).

    loss_masks: per document, None (all tokens have loss, and so has its EOS separator) or
    a per-token mask (a conversation: its EOS separator has no loss).
    """
    loss_masks = loss_masks if loss_masks is not None else [None] * len(documents)
    stream: list[int] = []
    stream_mask: list[bool] = []
    for doc, doc_mask in zip(documents, loss_masks):
        stream.extend(doc)
        stream_mask.extend([True] * len(doc) if doc_mask is None else doc_mask)
        if eos_id is not None:
            stream.append(eos_id)
            stream_mask.append(doc_mask is None)
    num_blocks = -(-len(stream) // seq_len)
    ids = torch.full((num_blocks * seq_len,), pad_id, dtype=torch.long)  # [N*T]
    mask = torch.zeros(num_blocks * seq_len, dtype=torch.bool)  # [N*T]
    ids[:len(stream)] = torch.tensor(stream, dtype=torch.long)
    mask[:len(stream)] = torch.tensor(stream_mask, dtype=torch.bool)
    return ids.view(num_blocks, seq_len), mask.view(num_blocks, seq_len)


# ---------------------------------------------------------------------------- pipeline

def _empty(source: str, num_records: int, skipped: Counter, text_field: str) -> DataError:
    reasons = ", ".join(f"{reason}: {count}" for reason, count in sorted(skipped.items()))
    return DataError(f"data source {source!r} is empty: {num_records} records, none with text in {text_field!r}, "
                     f"token ids in 'input_ids', or a usable 'conversations'/'messages' chat"
                     + (f" (skipped {reasons})" if reasons else ""))


def _special_ids(tokenizer, eos_token_id: int | None) -> tuple[int | None, int]:
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    eos = eos if eos is not None else eos_token_id
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    return eos, pad if pad is not None else (eos if eos is not None else 0)


def build_blocks(source: str, records: list, text_field: str, seq_len: int, tokenizer_path: str | None,
                 eos_token_id: int | None = None, vocab_size: int | None = None,
                 trust_remote_code: bool = False, truncate: bool = True, tokenizer=None,
                 thinking: str = "default") -> PackedBlocks:
    """Records -> PackedBlocks; fails with a DataError naming `source` when nothing is usable.
    thinking: the chat template's thinking mode (data/chat.py's THINKING_MODES)."""
    documents, skipped = extract_documents(records, text_field)
    if not documents:
        raise _empty(source, len(records), skipped, text_field)
    tokenized = tokenize_documents(documents, tokenizer_path, trust_remote_code, seq_len, truncate, tokenizer, thinking)
    skipped.update(tokenized.skipped)
    if not tokenized.token_ids:
        raise _empty(source, len(records), skipped, text_field)
    report = DataReport(source=source, num_records=len(records), num_documents=tokenized.num_documents,
                        skipped=dict(skipped), num_conversations=tokenized.num_conversations,
                        num_truncated=tokenized.num_truncated, chat_template=tokenized.chat_template,
                        num_turn_by_turn=tokenized.num_turn_by_turn,
                        num_turn_sequences=tokenized.num_turn_sequences, skipped_turns=dict(tokenized.skipped_turns),
                        num_reasoning_left_out=tokenized.num_reasoning_left_out)
    eos, pad = _special_ids(tokenized.tokenizer, eos_token_id)
    input_ids, loss_mask = pack_blocks(tokenized.token_ids, seq_len, eos, pad, tokenized.loss_masks)
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
        train_records, eval_records = shuffled_records(records, seed), shuffled_records(load_records(data.eval_source), seed)
    elif data.source == EMBEDDED_STDLIB:
        train_records, eval_records = shuffled_records(records, seed), shuffled_records(load_records(data.source, "heldout"), seed)
    else:
        train_records, eval_records = split_records(records, data.eval_fraction, seed)
    return train_and_eval_blocks(data, data.source, train_records, data.eval_source or f"{data.source} (held-out)",
                                 eval_records, tokenizer_path, eos_token_id, vocab_size, trust_remote_code)


def train_and_eval_blocks(data, train_name: str, train_records: list, eval_name: str, eval_records: list,
                          tokenizer_path: str | None, eos_token_id: int | None, vocab_size: int | None,
                          trust_remote_code: bool) -> tuple[PackedBlocks, PackedBlocks]:
    """Shuffled or split records -> (train blocks, held-out blocks): data.max_records applied to
    each side, an empty held-out side refused."""
    if data.max_records is not None:
        train_records, eval_records = train_records[:data.max_records], eval_records[:data.max_records]
    build = dict(text_field=data.text_field, seq_len=data.seq_len, tokenizer_path=data.tokenizer or tokenizer_path,
                 eos_token_id=eos_token_id, vocab_size=vocab_size, trust_remote_code=trust_remote_code,
                 truncate=data.truncate, thinking=data.thinking)
    train = build_blocks(train_name, train_records, **build)
    if not eval_records:
        raise DataError(f"evaluation data {eval_name!r} is empty: no records to calibrate the heads on")
    return train, build_blocks(eval_name, eval_records, **build)


def shuffled_records(records: list, seed: int) -> list:
    """A seeded shuffle (a copy): the same seed gives the same order."""
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
