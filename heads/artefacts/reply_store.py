"""A reply store: the target's own replies as token ids, with a suffix array over them.

Format and validation live here (the search in heads/artefacts/suffix_search.py), in heads/,
because both the builder (data/reply_store.py, `specheads data store`) and the drafter
(serving/decode/store.py) use them. A store is a directory, written whole (heads/atomic.py `staged_dir`):

    store.json          manifest: format name and version, the target's identity (what a heads
                        directory records: heads/target/adapter.py `TargetIdentity`), the tokenizer's
                        fingerprint and vocab_size, num_sequences, num_tokens (the suffix array's
                        entries: num_mark_tokens + num_reply_tokens), mark_tokens (the longest a
                        mark may be), max_token_id, the files' sizes and index_bytes
    tokens.bin          HEADER, then every sequence's token ids followed by SEPARATOR, as big-endian
                        uint32: byte order is token order, so comparing two byte strings
                        compares the token sequences they hold
    suffix_array.bin    HEADER, then the position (in tokens.bin's tokens) of every token but the
                        separators, sorted by the whole suffix that starts there (SEPARATOR above
                        every id, a suffix that ends first before any it begins); little-endian
                        int32 (int64 from 2**31 positions on)

A sequence is a reply's mark, then the reply, then SEPARATOR. The mark is the tail of the reply's
prompt: the last mark_tokens tokens before the reply in its tokenized conversation (the chat
template's assistant header, and for a later turn the end of the turn before). The suffix array
covers the marks too, so a context that ends as a prompt ends matches a mark, and what follows
it is how replies start. Version 1 stores hold bare replies (no marks, no max_token_id); they
still open. HEADER is 16 bytes: an 8-byte magic naming the file and the count of entries that
follow (uint64, little-endian). A store takes 8 bytes per token plus 4 per sequence.

Both files are memory-mapped read-only, so every process that opens the same store (the
server's workers) shares one copy in the page cache, and a store larger than memory is paged in
as it is read. Opening checks every entry, vectorised, in time linear in the store: the sizes,
magics and counts against the manifest; the separators (the last entry is one, no sequence is
empty); every id below the vocabulary (the tokenizer's vocab_size, the target's where none is
recorded), the largest equal to max_token_id; the suffix array a permutation of exactly the
positions that are not separators (so there are num_sequences separators), and in order
(`ReplyStore._check_order`). A corrupt store, one of an unknown format version, and one built
for another target or tokenizer or holding ids the target's vocabulary lacks (`check_fits`) are
refused with one line naming the file, the entry and what is wrong.

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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from specheads.heads import atomic
from specheads.heads.artefacts.suffix_search import (SEPARATOR, Proposal, SearchSettings, Searcher, SuffixIndex,
                                                      separated, suffix_positions)
from specheads.heads.target.adapter import TargetIdentity

FORMAT_NAME = "specheads-reply-store"
FORMAT_VERSION = 2  # 2: each sequence is mark + reply, max_token_id recorded; 1: bare replies
READABLE_VERSIONS = (1, 2)
MANIFEST_NAME = "store.json"
TOKENS_NAME = "tokens.bin"
SUFFIX_ARRAY_NAME = "suffix_array.bin"
TOKENS_MAGIC = b"SHRSTOK1"
SUFFIX_ARRAY_MAGIC = b"SHRSSUF1"
HEADER_BYTES = 16
# a reply's mark by default, built or learned: a chat template's assistant header is a few tokens
# (ChatML's "<|im_start|>assistant\n": 3), and the end of the user's turn before it
MARK_TOKENS = 8
TOKEN_DTYPE = np.dtype(">u4")
# The target's identity fields a store must share with the target it drafts for (its path may differ).
IDENTITY_FIELDS = ("architecture", "model_type", "hidden_size", "vocab_size", "num_layers")
COUNT_FIELDS = ("num_sequences", "num_tokens", "mark_tokens", "num_mark_tokens", "num_reply_tokens", "index_bytes")


class StoreError(ValueError):
    """A reply store that cannot be used: corrupt, or built for another target or tokenizer."""


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's vocabulary (every token and its id, added tokens included):
    two tokenizers with the same fingerprint turn text into the same ids."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def vocabulary_bound(tokenizer: dict, target: TargetIdentity) -> int:
    """Every id a store holds is below this: the tokenizer's vocab_size, the target's where the
    tokenizer's is not recorded."""
    size = tokenizer.get("vocab_size")
    return target.vocab_size if size is None else size


@dataclass(frozen=True)
class StoreManifest:
    format: str
    format_version: int
    target: TargetIdentity
    tokenizer: dict  # {"name_or_path", "fingerprint": tokenizer_fingerprint, "vocab_size"}
    num_sequences: int  # mark + reply sequences
    num_tokens: int  # suffix-array entries: num_mark_tokens + num_reply_tokens (separators not counted)
    suffix_array_dtype: str  # "<i4" | "<i8"
    files: dict  # file name -> size in bytes
    index_bytes: int  # the files together
    source: dict  # what the builder read (input, records used and skipped)
    mark_tokens: int = 0  # the longest a sequence's mark may be (`data store --mark-tokens`); 0: no marks
    num_mark_tokens: int = 0
    num_reply_tokens: int = 0
    max_token_id: int | None = None  # the largest id held; None in a version-1 store (not recorded)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def vocab_size(self) -> int:
        return vocabulary_bound(self.tokenizer, self.target)


def write_store(directory: str | os.PathLike, replies: Iterable[Sequence[int]], *, target: TargetIdentity,
                tokenizer: dict, source: dict | None = None, marks: Sequence[Sequence[int]] | None = None,
                mark_tokens: int | None = None) -> StoreManifest:
    """Write a store of `replies` (each a sequence of token ids) into `directory`, whole
    (replacing any store there): one sequence per non-empty reply, its mark (module doc; marks:
    one list of ids per reply, None: none) then the reply then SEPARATOR. tokenizer:
    {"name_or_path", "fingerprint", "vocab_size"}; mark_tokens: the longest a mark may be
    (default: the longest given)."""
    replies = [np.asarray(reply, dtype=np.int64).reshape(-1) for reply in replies]
    if marks is None:
        marks = [np.zeros(0, dtype=np.int64)] * len(replies)
    else:
        marks = [np.asarray(mark, dtype=np.int64).reshape(-1) for mark in marks]
        if len(marks) != len(replies):
            raise StoreError(f"{len(marks)} marks for {len(replies)} replies: give one mark (maybe empty) per reply")
    kept = [(mark, reply) for mark, reply in zip(marks, replies) if reply.size]  # an empty reply goes with its mark
    if not kept:
        raise StoreError("a reply store needs at least one non-empty reply")
    longest_mark = max(mark.size for mark, _ in kept)
    mark_tokens = longest_mark if mark_tokens is None else mark_tokens
    if longest_mark > mark_tokens:
        raise StoreError(f"a mark of {longest_mark} tokens is longer than mark_tokens={mark_tokens}")
    body = np.concatenate([part for mark, reply in kept for part in (mark, reply)])  # every id, no separators
    vocab_size = vocabulary_bound(tokenizer, target)
    outside = (body < 0) | (body >= vocab_size)
    if outside.any():
        raise StoreError(f"token id {int(body[outside.argmax()])} is not a vocabulary id "
                         f"(expected 0 <= id < {vocab_size})")
    tokens = separated([np.concatenate(pair) for pair in kept])
    positions = suffix_positions(tokens)
    sa_dtype = np.dtype("<i4") if tokens.shape[0] < 2 ** 31 else np.dtype("<i8")
    sizes = {TOKENS_NAME: HEADER_BYTES + 4 * int(tokens.shape[0]),
             SUFFIX_ARRAY_NAME: HEADER_BYTES + sa_dtype.itemsize * int(positions.shape[0])}
    num_mark_tokens = sum(mark.size for mark, _ in kept)
    manifest = StoreManifest(format=FORMAT_NAME, format_version=FORMAT_VERSION, target=target,
                             tokenizer=dict(tokenizer), num_sequences=len(kept), num_tokens=int(positions.shape[0]),
                             suffix_array_dtype=sa_dtype.str, files=sizes, index_bytes=sum(sizes.values()),
                             source=dict(source or {}), mark_tokens=int(mark_tokens), num_mark_tokens=num_mark_tokens,
                             num_reply_tokens=int(body.size) - num_mark_tokens, max_token_id=int(body.max()))
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
    version = raw.get("format_version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise StoreError(f"{path} has format_version={version!r}; this specheads reads versions "
                         f"{', '.join(map(str, READABLE_VERSIONS))}: rebuild the store with `specheads data store`")
    if version == 1:  # bare replies: every entry is a reply token
        raw = {**raw, "num_reply_tokens": raw.get("num_tokens")}
    try:
        manifest = StoreManifest(**{**raw, "target": TargetIdentity(**raw["target"])})
    except (TypeError, KeyError) as err:
        raise StoreError(f"{path}: malformed manifest ({err})") from err
    _check_manifest(path, manifest)
    return manifest


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_manifest(path: Path, manifest: StoreManifest) -> None:
    """The manifest's own fields: counts are ints that add up, the vocabulary is a size."""
    problems = [f"{name}={getattr(manifest, name)!r} is not an int >= 0" for name in COUNT_FIELDS
                if not _is_count(getattr(manifest, name))]
    if not problems and manifest.num_mark_tokens + manifest.num_reply_tokens != manifest.num_tokens:
        problems.append(f"num_mark_tokens {manifest.num_mark_tokens} + num_reply_tokens "
                        f"{manifest.num_reply_tokens} != num_tokens {manifest.num_tokens}")
    if not problems and manifest.num_sequences < 1:
        problems.append("num_sequences is 0")
    if manifest.max_token_id is not None and not _is_count(manifest.max_token_id):
        problems.append(f"max_token_id={manifest.max_token_id!r} is not an int >= 0")
    if not isinstance(manifest.tokenizer, dict) or not isinstance(manifest.files, dict):
        problems.append("tokenizer and files must be objects")
    elif not _is_count(manifest.vocab_size) or manifest.vocab_size < 1:
        problems.append(f"vocab_size={manifest.vocab_size!r} is not an int >= 1")
    if manifest.suffix_array_dtype not in ("<i4", "<i8"):
        problems.append(f"suffix_array_dtype must be '<i4' or '<i8', got {manifest.suffix_array_dtype!r}")
    if problems:
        raise StoreError(f"{path}: malformed manifest ({'; '.join(problems)})")


def _suffix_before(tokens: np.ndarray, a: int, b: int) -> bool:
    """Whether the whole suffix at a sorts before the one at b (a != b), read in growing chunks."""
    width = 64
    while True:
        first, second = tokens[a:a + width], tokens[b:b + width]
        num = min(first.size, second.size)
        differ = np.flatnonzero(first[:num] != second[:num])
        if differ.size:
            return bool(first[differ[0]] < second[differ[0]])
        if num < width:  # one suffix ended: it sorts first
            return first.size < second.size
        a, b, width = a + width, b + width, 2 * width


def _out_of_order_entry(tokens: np.ndarray, positions: np.ndarray, rank: np.ndarray, flagged: int) -> int:
    """An entry whose suffix truly sorts after the next one's, given the first pair the order
    check flags. The check compares the suffixes that follow a pair by their own entries' order,
    so a flagged pair may be in order while the array misplaces those followers: then the array
    goes down somewhere between the followers' entries, and a binary search with direct
    comparisons finds where. O(log N) comparisons; only a corrupt store pays it. rank: each
    non-separator position's entry."""
    a, b = int(positions[flagged]), int(positions[flagged + 1])
    if not _suffix_before(tokens, a, b):
        return flagged
    while tokens[a + 1] == SEPARATOR:  # equal followers that are separators: compare what follows them
        a, b = a + 1, b + 1
    low, high = int(rank[b + 1]), int(rank[a + 1])  # suffix(positions[low]) sorts after suffix(positions[high])
    while high - low > 1:
        middle = (low + high) // 2
        if _suffix_before(tokens, int(positions[middle]), int(positions[low])):
            high = middle
        else:
            low = middle
    return low


class ReplyStore:
    """A store opened read-only (module doc). `propose` is safe to call from several threads."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory).expanduser()
        self.manifest = manifest = read_manifest(self.directory)
        self._tokens = self._map(TOKENS_NAME, TOKENS_MAGIC, 4)
        self._positions = self._map(SUFFIX_ARRAY_NAME, SUFFIX_ARRAY_MAGIC,
                                    np.dtype(manifest.suffix_array_dtype).itemsize)
        self.num_tokens = manifest.num_tokens
        # the mapped bytes as arrays (searched by heads/artefacts/suffix_search.py)
        self._suffix_array = np.frombuffer(self._positions, dtype=manifest.suffix_array_dtype, offset=HEADER_BYTES)
        self._token_array = np.frombuffer(self._tokens, dtype=TOKEN_DTYPE, offset=HEADER_BYTES)
        self.max_token_id = self._check_contents()

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

    def _corrupt(self, name: str, entry: int, problem: str) -> StoreError:
        return StoreError(f"reply store {str(self.directory)!r} is corrupt: {name} entry {int(entry)}: {problem}")

    def _check_contents(self) -> int:
        """Every entry of both files (module doc), vectorised -> the largest token id."""
        tokens = self._token_array.astype(np.uint32)  # [E] in native byte order (one copy)
        positions = self._suffix_array.astype(np.intp)  # [N]
        is_separator = tokens == SEPARATOR  # [E]
        largest = self._check_tokens(tokens, is_separator)
        leading, rank = self._check_permutation(tokens, positions)
        self._check_order(tokens, is_separator, positions, leading, rank)
        return largest

    def _check_tokens(self, tokens: np.ndarray, is_separator: np.ndarray) -> int:
        """The separators end non-empty sequences; every id is in the vocabulary; the manifest's
        max_token_id is the largest -> the largest."""
        last = tokens.shape[0] - 1
        if not is_separator[last]:
            raise self._corrupt(TOKENS_NAME, last, f"the last entry is token {int(tokens[last])}, not a separator")
        if is_separator[0]:
            raise self._corrupt(TOKENS_NAME, 0, "a separator first: an empty sequence")
        doubled = np.flatnonzero(is_separator[1:] & is_separator[:-1])
        if doubled.size:
            raise self._corrupt(TOKENS_NAME, doubled[0] + 1, "a separator right after another: an empty sequence")
        vocab_size = self.manifest.vocab_size
        outside = np.flatnonzero((tokens >= vocab_size) & ~is_separator)
        if outside.size:
            raise self._corrupt(TOKENS_NAME, outside[0], f"token id {int(tokens[outside[0]])} is not below the "
                                f"vocabulary size {vocab_size}")
        ids = np.where(is_separator, 0, tokens)  # [E]
        where = int(ids.argmax())
        recorded = self.manifest.max_token_id
        if recorded is not None and recorded != int(ids[where]):
            raise self._corrupt(TOKENS_NAME, where, f"the largest token id is {int(ids[where])}, {MANIFEST_NAME} "
                                f"says max_token_id {recorded}")
        return int(ids[where])

    def _check_permutation(self, tokens: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The suffix array holds every position that is not a separator exactly once -> ([N]
        each entry's first token, [E] rank: each such position's entry, -1 at separators)."""
        num_entries, num = tokens.shape[0], positions.shape[0]
        outside = np.flatnonzero((positions < 0) | (positions >= num_entries))
        if outside.size:
            raise self._corrupt(SUFFIX_ARRAY_NAME, outside[0], f"position {int(positions[outside[0]])} is outside "
                                f"{TOKENS_NAME}'s {num_entries} entries")
        leading = tokens[positions]  # [N]
        on_separator = np.flatnonzero(leading == SEPARATOR)
        if on_separator.size:
            raise self._corrupt(SUFFIX_ARRAY_NAME, on_separator[0], f"points at a separator ({TOKENS_NAME} entry "
                                f"{int(positions[on_separator[0]])})")
        index_dtype = np.int32 if 2 * num_entries < 2 ** 31 else np.int64  # the order check's keys reach 2N + 1
        rank = np.full(num_entries, -1, dtype=index_dtype)
        rank[positions] = np.arange(num, dtype=index_dtype)  # a repeated position keeps one of its entries
        if np.count_nonzero(rank >= 0) != num:
            entry = int(np.flatnonzero(rank[positions] != np.arange(num))[0])
            raise self._corrupt(SUFFIX_ARRAY_NAME, entry, f"repeats position {int(positions[entry])} (entry "
                                f"{int(rank[positions[entry]])} holds it too)")
        # N distinct non-separator positions; with E = N + num_sequences entries, a position left
        # out is a token where a separator belongs, and otherwise there are num_sequences separators
        missed = np.flatnonzero((rank < 0) & (tokens != SEPARATOR))
        if missed.size:
            num_separators = np.count_nonzero(tokens == SEPARATOR)
            raise self._corrupt(TOKENS_NAME, missed[0], f"token {int(tokens[missed[0]])} has no {SUFFIX_ARRAY_NAME} "
                                f"entry (the store has {num_separators} separators, its manifest says "
                                f"num_sequences {self.manifest.num_sequences})")
        return leading, rank

    def _check_order(self, tokens: np.ndarray, is_separator: np.ndarray, positions: np.ndarray, leading: np.ndarray,
                     rank: np.ndarray) -> None:
        """Every adjacent pair of the suffix array in order, in linear time (rank: turned into key).

        The builder sorts the whole suffixes of tokens.bin (separators included) and keeps those
        that do not start on a separator. key(p) gives every position's suffix a number in that
        same order: its rank for a non-separator; N for the last separator (its suffix is that
        separator alone, a prefix of every other separator's); N + 1 + rank[p + 1] for any other
        separator (its suffix is a separator then the next sequence's: after every suffix that
        starts on a token, ordered by what follows). So suffix(a) < suffix(b) exactly when
        tokens[a] < tokens[b], or they are equal and key(a + 1) < key(b + 1); by induction on the
        suffixes' lengths this holding for every adjacent pair makes the whole array sorted."""
        num = positions.shape[0]
        separators = np.flatnonzero(is_separator)  # [S]; the last is the last entry
        key = rank  # [E]: the non-separators keep their rank
        key[separators[:-1]] = num + 1 + rank[separators[:-1] + 1]
        key[separators[-1]] = num
        following = key[positions + 1]  # [N] stays inside: the last entry is a separator
        in_order = (leading[:-1] < leading[1:]) | ((leading[:-1] == leading[1:]) & (following[:-1] < following[1:]))
        if not in_order.all():
            entry = _out_of_order_entry(tokens, positions, key, int(in_order.argmin()))
            raise self._corrupt(SUFFIX_ARRAY_NAME, entry, f"out of order: the suffix at {int(positions[entry])} sorts "
                                f"after the one at {int(positions[entry + 1])} (entry {entry + 1})")

    def check_fits(self, target: TargetIdentity, fingerprint: str | None = None) -> None:
        """StoreError naming both sides when this store was built for another target (its
        identity but the path) or, given the tokenizer's fingerprint, another tokenizer, or holds
        an id the target's vocabulary lacks."""
        mine = self.manifest.target
        problems = [f"{name}: store {getattr(mine, name)!r}, target {getattr(target, name)!r}"
                    for name in IDENTITY_FIELDS if getattr(mine, name) != getattr(target, name)]
        if self.max_token_id >= target.vocab_size:
            problems.append(f"token ids: the store's largest is {self.max_token_id}, the target's vocab_size is "
                            f"{target.vocab_size}")
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
