"""A reply store: the target's own replies as token ids, with a suffix array over them.

Format, search and validation live here, in heads/, because both the builder (data/reply_store.py,
`specheads data store`) and the drafter (serving/decode/store.py) use them. A store is a
directory, written whole (heads/atomic.py `staged_dir`):

    store.json          manifest: format name and version, the target's identity (what a heads
                        directory records: heads/target/adapter.py `TargetIdentity`), the tokenizer's
                        fingerprint, num_sequences, num_tokens, the files' sizes and index_bytes
    tokens.bin          HEADER, then every reply's token ids followed by SEPARATOR, as big-endian
                        uint32: byte order is token order, so comparing two byte strings
                        compares the token sequences they hold
    suffix_array.bin    HEADER, then the position (in tokens.bin's tokens) of every reply token,
                        sorted by the suffix that starts there; little-endian int32 (int64 from
                        2**31 positions on)

HEADER is 16 bytes: an 8-byte magic naming the file and the count of entries that follow
(uint64, little-endian). A store takes 8 bytes per token plus 4 per reply (int32 positions).

Both files are memory-mapped read-only, so every process that opens the same store (the
server's workers) shares one copy in the page cache, and a store larger than memory is paged in
as it is read. A corrupt store (a size that disagrees with its manifest, a bad magic, an unknown
format version, a suffix array out of order) and a store built for another target or tokenizer
are refused with one line naming what is wrong.

The search (`ReplyStore.index`, `propose`): heads/artefacts/suffix_search.py, which also
searches the replies a server learns and each request's prompt (serving/decode/store.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import struct
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from specheads.heads import atomic
from specheads.heads.artefacts.suffix_search import (SEPARATOR, Proposal, SearchSettings, Searcher, SuffixIndex,
                                                      suffix_array)
from specheads.heads.target.adapter import TargetIdentity

FORMAT_NAME = "specheads-reply-store"
FORMAT_VERSION = 1
MANIFEST_NAME = "store.json"
TOKENS_NAME = "tokens.bin"
SUFFIX_ARRAY_NAME = "suffix_array.bin"
TOKENS_MAGIC = b"SHRSTOK1"
SUFFIX_ARRAY_MAGIC = b"SHRSSUF1"
HEADER_BYTES = 16
TOKEN_DTYPE = np.dtype(">u4")
NUM_ORDER_CHECKS = 64  # adjacent suffix-array pairs checked for order when a store is opened
# The target's identity fields a store must share with the target it drafts for (its path may differ).
IDENTITY_FIELDS = ("architecture", "model_type", "hidden_size", "vocab_size", "num_layers")


class StoreError(ValueError):
    """A reply store that cannot be used: corrupt, or built for another target or tokenizer."""


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's vocabulary (every token and its id, added tokens included):
    two tokenizers with the same fingerprint turn text into the same ids."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


@dataclass(frozen=True)
class StoreManifest:
    format: str
    format_version: int
    target: TargetIdentity
    tokenizer: dict  # {"name_or_path", "fingerprint": tokenizer_fingerprint, "vocab_size"}
    num_sequences: int  # replies
    num_tokens: int  # reply tokens (separators not counted)
    suffix_array_dtype: str  # "<i4" | "<i8"
    files: dict  # file name -> size in bytes
    index_bytes: int  # the files together
    source: dict  # what the builder read (input, records used and skipped)

    def to_dict(self) -> dict:
        return asdict(self)


def write_store(directory: str | os.PathLike, replies: Iterable[Sequence[int]], *, target: TargetIdentity,
                tokenizer: dict, source: dict | None = None) -> StoreManifest:
    """Write a store of `replies` (each a sequence of token ids) into `directory`, whole
    (replacing any store there). tokenizer: {"name_or_path", "fingerprint", "vocab_size"}."""
    arrays = [np.asarray(reply, dtype=np.int64) for reply in replies]
    arrays = [reply for reply in arrays if reply.size]
    if not arrays:
        raise StoreError("a reply store needs at least one non-empty reply")
    every_id = np.concatenate(arrays)
    if every_id.min() < 0 or every_id.max() >= SEPARATOR:
        bad = int(every_id.min() if every_id.min() < 0 else every_id.max())
        raise StoreError(f"token id {bad} is not a vocabulary id (expected 0 <= id < {SEPARATOR})")
    ends = np.cumsum([reply.size + 1 for reply in arrays]) - 1  # each reply's separator
    tokens = np.insert(every_id, ends - np.arange(len(arrays)), SEPARATOR).astype(np.uint32)
    order = suffix_array(tokens)
    positions = order[tokens[order] != SEPARATOR]  # reply tokens only: a match never starts on a separator
    sa_dtype = np.dtype("<i4") if tokens.shape[0] < 2 ** 31 else np.dtype("<i8")
    sizes = {TOKENS_NAME: HEADER_BYTES + 4 * int(tokens.shape[0]),
             SUFFIX_ARRAY_NAME: HEADER_BYTES + sa_dtype.itemsize * int(positions.shape[0])}
    manifest = StoreManifest(format=FORMAT_NAME, format_version=FORMAT_VERSION, target=target,
                             tokenizer=dict(tokenizer), num_sequences=len(arrays), num_tokens=int(positions.shape[0]),
                             suffix_array_dtype=sa_dtype.str, files=sizes, index_bytes=sum(sizes.values()),
                             source=dict(source or {}))
    with atomic.staged_dir(directory) as staging:
        _write_array(staging / TOKENS_NAME, TOKENS_MAGIC, tokens.astype(TOKEN_DTYPE))
        _write_array(staging / SUFFIX_ARRAY_NAME, SUFFIX_ARRAY_MAGIC, positions.astype(sa_dtype))
        (staging / MANIFEST_NAME).write_text(json.dumps(manifest.to_dict(), indent=2) + "\n")
    return manifest


def _write_array(path: Path, magic: bytes, values: np.ndarray) -> None:
    with open(path, "wb") as handle:
        handle.write(magic + struct.pack("<Q", int(values.shape[0])))
        values.tofile(handle)


def read_manifest(directory: str | os.PathLike) -> StoreManifest:
    """The manifest of the store in `directory`; StoreError when it is missing or not one."""
    path = Path(directory).expanduser() / MANIFEST_NAME
    if not path.is_file():
        raise StoreError(f"{str(directory)!r} is not a reply store (no {MANIFEST_NAME}); build one with "
                         "`specheads data store --input REPLIES.jsonl --target T --output DIR`")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise StoreError(f"{path}: not readable JSON ({err})") from err
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        found = raw.get("format") if isinstance(raw, dict) else None
        raise StoreError(f"{path} is not a reply-store manifest (format={found!r}, expected {FORMAT_NAME!r})")
    if raw.get("format_version") != FORMAT_VERSION:
        raise StoreError(f"{path} has format_version={raw.get('format_version')!r}; this specheads reads version "
                         f"{FORMAT_VERSION}: rebuild the store with `specheads data store`")
    try:
        return StoreManifest(**{**raw, "target": TargetIdentity(**raw["target"])})
    except (TypeError, KeyError) as err:
        raise StoreError(f"{path}: malformed manifest ({err})") from err


class ReplyStore:
    """A store opened read-only (module doc). `propose` is safe to call from several threads."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory).expanduser()
        self.manifest = manifest = read_manifest(self.directory)
        if manifest.suffix_array_dtype not in ("<i4", "<i8"):
            raise StoreError(f"{self.directory / MANIFEST_NAME}: suffix_array_dtype must be '<i4' or '<i8', "
                             f"got {manifest.suffix_array_dtype!r}")
        self._tokens = self._map(TOKENS_NAME, TOKENS_MAGIC, 4)
        self._positions = self._map(SUFFIX_ARRAY_NAME, SUFFIX_ARRAY_MAGIC,
                                    np.dtype(manifest.suffix_array_dtype).itemsize)
        self.num_tokens = manifest.num_tokens
        # the suffix array as a sequence of Python ints for bisect
        view = memoryview(self._positions)[HEADER_BYTES:]
        self.suffixes = view.cast("i" if manifest.suffix_array_dtype == "<i4" else "q") \
            if sys.byteorder == "little" else np.frombuffer(view, dtype=manifest.suffix_array_dtype)
        # the same bytes as arrays, for reading many continuations at once
        self._suffix_array = np.frombuffer(self._positions, dtype=manifest.suffix_array_dtype, offset=HEADER_BYTES)
        self._token_array = np.frombuffer(self._tokens, dtype=TOKEN_DTYPE, offset=HEADER_BYTES)
        self._last = int(self._token_array.shape[0]) - 1
        self._check_contents()

    def _map(self, name: str, magic: bytes, itemsize: int) -> mmap.mmap:
        path = self.directory / name
        expected = self.manifest.files.get(name)
        count = self.manifest.num_tokens + self.manifest.num_sequences if name == TOKENS_NAME \
            else self.manifest.num_tokens
        if not path.is_file():
            raise StoreError(f"reply store {str(self.directory)!r} has no {name}")
        size = path.stat().st_size
        if size != expected or size != HEADER_BYTES + itemsize * count:
            raise StoreError(f"reply store {str(self.directory)!r} is corrupt: {name} is {size} bytes, its manifest "
                             f"says {expected} ({count} entries of {itemsize} bytes + a {HEADER_BYTES}-byte header)")
        with open(path, "rb") as handle:
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        if mapped[:8] != magic or struct.unpack_from("<Q", mapped, 8)[0] != count:
            raise StoreError(f"reply store {str(self.directory)!r} is corrupt: {name} does not start with its magic "
                             f"{magic!r} and entry count {count}")
        return mapped

    def _check_contents(self) -> None:
        """Cheap checks that catch a damaged file: the last token is a separator; suffix-array
        entries spread over it are positions of reply tokens, in order."""
        num_entries = self.num_tokens + self.manifest.num_sequences
        if int(self._token_array[num_entries - 1]) != SEPARATOR:
            raise StoreError(f"reply store {str(self.directory)!r} is corrupt: {TOKENS_NAME} does not end a reply")
        step = max(1, (self.num_tokens - 1) // NUM_ORDER_CHECKS)
        for index in range(0, self.num_tokens - 1, step):
            left, right = self.suffixes[index], self.suffixes[index + 1]
            in_range = 0 <= left < num_entries and 0 <= right < num_entries
            if not in_range or int(self._token_array[left]) == SEPARATOR or \
                    self._token_array[left:left + 64].tolist() > self._token_array[right:right + 64].tolist():
                raise StoreError(f"reply store {str(self.directory)!r} is corrupt: {SUFFIX_ARRAY_NAME} is out of "
                                 f"order at entry {index}")

    def check_fits(self, target: TargetIdentity, fingerprint: str | None = None) -> None:
        """StoreError naming both sides when this store was built for another target (its
        identity but the path) or, given the tokenizer's fingerprint, another tokenizer."""
        mine = self.manifest.target
        problems = [f"{name}: store {getattr(mine, name)!r}, target {getattr(target, name)!r}"
                    for name in IDENTITY_FIELDS if getattr(mine, name) != getattr(target, name)]
        if fingerprint is not None and fingerprint != self.manifest.tokenizer.get("fingerprint"):
            problems.append(f"tokenizer: the store's ({self.manifest.tokenizer.get('name_or_path')!r}) has another "
                            "vocabulary than the target's")
        if problems:
            raise StoreError(f"reply store {str(self.directory)!r} (built for {mine.name_or_path!r}) does not fit the "
                             f"target {target.name_or_path!r}: {'; '.join(problems)}; build one for this target with "
                             "`specheads data store --target T`")

    # --- the search (heads/artefacts/suffix_search.py) ----------------------------------------

    @functools.cached_property
    def index(self) -> SuffixIndex:
        """The store's files as one SuffixIndex (the mapped arrays: no copy)."""
        return SuffixIndex(self._token_array, self._suffix_array)

    def propose(self, context: Sequence[int], settings: SearchSettings = SearchSettings()) -> Proposal:
        """The store's proposal for `context` (suffix_search.py's rule, this store alone)."""
        return Searcher([[self.index]], settings).propose(context)
