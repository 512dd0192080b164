"""The reply store's format and its validation on open (heads/artefacts/reply_store.py).

The builder's suffix array against sorting the whole suffixes; a store's sequences are exactly
mark + reply + SEPARATOR, read back from its token array; the manifest's counts. Opening checks
every entry: the linear order check accepts exactly the sorted suffix array of random small
stores (repeats, the same reply twice, marks) and refuses every other permutation; corruptions
at random entries in the middle of a 200k-token store (an id far out of the vocabulary, an id
just past it, two suffix-array entries swapped, a repeated entry, an entry on a separator, a
separator overwritten by a token, a manifest whose max_token_id lies) are each refused with one
line naming the file, the entry and the problem. `check_fits` refuses a store whose ids the
target's vocabulary lacks. A version-1 store (bare replies) still opens.
"""

from __future__ import annotations

import json
import re
import shutil
import struct

import numpy as np
import pytest

from specheads.heads.artefacts.reply_store import (HEADER_BYTES, MANIFEST_NAME, SEPARATOR, SUFFIX_ARRAY_NAME,
                                                   TOKEN_DTYPE, TOKENS_NAME, ReplyStore, StoreError, write_store)
from specheads.heads.artefacts.suffix_search import SearchSettings, suffix_array
from specheads.heads.target.adapter import TargetIdentity

VOCAB = 256
IDENTITY = TargetIdentity("LlamaForCausalLM", "llama", 64, VOCAB, 2, "tiny")
TOKENIZER = {"name_or_path": "tiny", "fingerprint": "f" * 64, "vocab_size": VOCAB}
BIG_STORE_TOKENS = 200_000


def build(directory, replies, marks=None, tokenizer=TOKENIZER, **kwargs) -> ReplyStore:
    write_store(directory, replies, target=IDENTITY, tokenizer=tokenizer, marks=marks, **kwargs)
    return ReplyStore(directory)


def random_replies(rng, num: int, vocab: int, max_len: int = 30) -> list[list[int]]:
    return [rng.integers(0, vocab, rng.integers(1, max_len)).tolist() for _ in range(num)]


def stored_sequences(store: ReplyStore) -> list[list[int]]:
    """The token array cut at its separators."""
    tokens = store._token_array.astype(np.int64).tolist()
    sequences, current = [], []
    for token in tokens:
        if token == SEPARATOR:
            sequences.append(current)
            current = []
        else:
            current.append(token)
    assert not current, "the token array ends inside a sequence"
    return sequences


def sorted_suffixes(tokens: list[int]) -> list[int]:
    """Brute force: the non-separator positions sorted by their whole suffix."""
    return sorted((p for p, token in enumerate(tokens) if token != SEPARATOR), key=lambda p: tokens[p:])


def open_error(directory) -> str:
    with pytest.raises(StoreError) as caught:
        ReplyStore(directory)
    message = str(caught.value)
    assert "\n" not in message
    return message


# -- the format -----------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [2, 7])
def test_suffix_array_sorts_the_suffixes(vocab):
    rng = np.random.default_rng(vocab)
    for size in (1, 2, 9, 200):
        tokens = rng.integers(0, vocab, size).astype(np.uint32)
        assert suffix_array(tokens).tolist() == sorted(range(size), key=lambda i: tokens[i:].tolist())


def test_a_store_states_its_size_and_its_target(tmp_path):
    rng = np.random.default_rng(0)
    replies = random_replies(rng, 50, 9)
    marks = [reply[:3] for reply in random_replies(rng, 50, 9)]
    store = build(tmp_path / "s", replies, marks, mark_tokens=4)
    manifest = store.manifest
    num_reply, num_mark = sum(map(len, replies)), sum(map(len, marks))
    assert (manifest.format_version, manifest.num_sequences, manifest.mark_tokens) == (2, 50, 4)
    assert (manifest.num_reply_tokens, manifest.num_mark_tokens) == (num_reply, num_mark)
    assert manifest.num_tokens == store.num_tokens == num_reply + num_mark  # the suffix array's entries
    assert manifest.max_token_id == store.max_token_id == max(max(s) for s in replies + marks if s)
    sizes = {name: (tmp_path / "s" / name).stat().st_size for name in (TOKENS_NAME, SUFFIX_ARRAY_NAME)}
    assert manifest.files == sizes and manifest.index_bytes == sum(sizes.values())
    assert manifest.index_bytes == 2 * HEADER_BYTES + 8 * manifest.num_tokens + 4 * 50  # 8 bytes a token
    assert manifest.target == IDENTITY and manifest.tokenizer["fingerprint"] == "f" * 64
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temp files left behind"


def test_each_sequence_is_its_mark_then_its_reply(tmp_path):
    rng = np.random.default_rng(1)
    replies = random_replies(rng, 40, 6) + [[]]
    marks = [rng.integers(0, 6, rng.integers(0, 5)).tolist() for _ in replies]
    store = build(tmp_path / "s", replies, marks, mark_tokens=4)
    # the empty reply is left out with its mark
    assert stored_sequences(store) == [mark + reply for mark, reply in zip(marks, replies) if reply]
    assert store.manifest.num_sequences == 40
    tokens = store._token_array.astype(np.int64).tolist()
    assert store._suffix_array.tolist() == sorted_suffixes(tokens)  # the marks' positions are entries too
    assert stored_sequences(build(tmp_path / "bare", replies)) == [reply for reply in replies if reply]
    assert build(tmp_path / "bare", replies).manifest.mark_tokens == 0


def test_a_context_ending_in_a_mark_proposes_the_reply_s_start(tmp_path):
    header = [7, 8, 9]  # a template's assistant header
    replies = [[1, 2, 3, 4], [1, 2, 3, 5], [6, 6]]
    store = build(tmp_path / "s", replies, [[5] + header, [4] + header, [2] + header])
    settings = SearchSettings(num_tokens=3, max_match=8)
    found = store.propose([0, 0] + header, settings)
    assert (found.tokens, found.match) == ([1, 2, 3], 3)
    found = build(tmp_path / "bare", replies).propose([0, 0] + header, settings)
    assert (found.tokens, found.match) == ([], 0)


def test_bad_marks_are_refused(tmp_path):
    with pytest.raises(StoreError, match="1 marks for 2 replies"):
        write_store(tmp_path / "s", [[1], [2]], target=IDENTITY, tokenizer=TOKENIZER, marks=[[1]])
    with pytest.raises(StoreError, match="a mark of 3 tokens is longer than mark_tokens=2"):
        write_store(tmp_path / "s", [[1]], target=IDENTITY, tokenizer=TOKENIZER, marks=[[1, 2, 3]], mark_tokens=2)
    with pytest.raises(StoreError, match=f"token id {VOCAB} is not a vocabulary id"):
        write_store(tmp_path / "s", [[1]], target=IDENTITY, tokenizer=TOKENIZER, marks=[[VOCAB]])
    assert not (tmp_path / "s").exists()


def test_a_missing_store_is_refused(tmp_path):
    with pytest.raises(StoreError, match="not a reply store .*specheads data store"):
        ReplyStore(tmp_path / "nothing")
    with pytest.raises(StoreError, match="at least one non-empty reply"):
        write_store(tmp_path / "s", [[], []], target=IDENTITY, tokenizer=TOKENIZER)
    with pytest.raises(StoreError, match="not a vocabulary id"):
        write_store(tmp_path / "s", [[1, -2]], target=IDENTITY, tokenizer=TOKENIZER)


def test_a_version_1_store_still_opens(tmp_path):
    replies = random_replies(np.random.default_rng(2), 30, 5)
    build(tmp_path / "s", replies)
    path = tmp_path / "s" / MANIFEST_NAME
    raw = json.loads(path.read_text())
    for name in ("mark_tokens", "num_mark_tokens", "num_reply_tokens", "max_token_id"):
        del raw[name]  # what version 1 wrote
    path.write_text(json.dumps({**raw, "format_version": 1}))
    store = ReplyStore(tmp_path / "s")
    manifest = store.manifest
    assert (manifest.format_version, manifest.mark_tokens, manifest.num_mark_tokens) == (1, 0, 0)
    assert manifest.num_reply_tokens == manifest.num_tokens and manifest.max_token_id is None
    assert store.max_token_id == max(map(max, replies)) and stored_sequences(store) == replies
    path.write_text(json.dumps({**raw, "format_version": 3}))
    assert "format_version=3; this specheads reads versions 1, 2" in open_error(tmp_path / "s")


def corrupt(directory, name: str, change) -> None:
    path = directory / name
    path.write_bytes(change(path.read_bytes()))


@pytest.mark.parametrize("name, change, message", [
    (TOKENS_NAME, lambda data: data[:-4], "corrupt: tokens.bin is"),
    (SUFFIX_ARRAY_NAME, lambda data: data + b"\0\0\0\0", "corrupt: suffix_array.bin is"),
    (TOKENS_NAME, lambda data: b"NOTMAGIC" + data[8:], "magic"),
    (SUFFIX_ARRAY_NAME, lambda data: data[:8] + struct.pack("<Q", 3) + data[16:], "entry count"),
    (SUFFIX_ARRAY_NAME, lambda data: data[:16] + data[20:24] + data[16:20] + data[24:],
     "suffix_array.bin entry 0: out of order"),
    (SUFFIX_ARRAY_NAME, lambda data: data[:16] + struct.pack("<i", 10 ** 6) + data[20:],
     "suffix_array.bin entry 0: position 1000000 is outside tokens.bin's"),
    (TOKENS_NAME, lambda data: data[:-4] + b"\0\0\0\1",
     "tokens.bin entry .*: the last entry is token 1, not a separator"),
    (TOKENS_NAME, lambda data: data[:16] + b"\xff" * 4 + data[20:], "tokens.bin entry 0: a separator first"),
    (MANIFEST_NAME, lambda data: data.replace(b'"format_version": 2', b'"format_version": 9'), "format_version=9"),
    (MANIFEST_NAME, lambda data: data.replace(b"specheads-reply-store", b"other"), "not a reply-store manifest"),
    (MANIFEST_NAME, lambda data: data[:20], "not readable JSON"),
    (MANIFEST_NAME, lambda data: data.replace(b'"num_mark_tokens": 0', b'"num_mark_tokens": "0"'),
     "malformed manifest .*num_mark_tokens='0' is not an int"),
    (MANIFEST_NAME, lambda data: data.replace(b'"num_mark_tokens": 0', b'"num_mark_tokens": 2'),
     r"malformed manifest \(num_mark_tokens 2 \+ num_reply_tokens"),
])
def test_a_corrupt_store_is_refused_with_one_line(tmp_path, name, change, message):
    build(tmp_path / "s", random_replies(np.random.default_rng(4), 30, 6))
    corrupt(tmp_path / "s", name, change)
    assert re.search(message, open_error(tmp_path / "s"))


# -- the order check against brute force ----------------------------------------------------------


def test_the_order_check_accepts_exactly_the_sorted_suffix_array(tmp_path):
    """Random small stores (few ids: many repeats; the same reply twice; marks): the builder's
    array is the brute-force order, and of every adjacent swap and random permutations only that
    one passes; a refusal names an entry whose suffix truly sorts after the next one's."""
    rng = np.random.default_rng(5)
    num_refused = 0
    for _ in range(40):
        vocab = int(rng.integers(1, 4))
        replies = random_replies(rng, int(rng.integers(1, 6)), vocab, max_len=6)
        replies.append(list(replies[0]))
        marks = [rng.integers(0, vocab, rng.integers(0, 3)).tolist() for _ in replies]
        store = build(tmp_path / "s", replies, marks)
        tokens = store._token_array.astype(np.int64).tolist()
        truth = sorted_suffixes(tokens)
        assert store._suffix_array.tolist() == truth
        swaps = [truth[:k] + [truth[k + 1], truth[k]] + truth[k + 2:] for k in range(len(truth) - 1)]
        for order in swaps + [rng.permutation(truth).tolist() for _ in range(8)]:
            store._suffix_array = np.array(order, dtype="<i4")  # what __init__ checks, as it mapped it
            if order == truth:
                store._check_contents()
                continue
            with pytest.raises(StoreError, match="suffix_array.bin entry") as caught:
                store._check_contents()
            entry = int(re.search(r"suffix_array.bin entry (\d+): out of order", str(caught.value)).group(1))
            assert tokens[order[entry]:] > tokens[order[entry + 1]:], (order, entry)
            num_refused += 1
    assert num_refused > 300


# -- corruptions in the middle of a large store ---------------------------------------------------


@pytest.fixture(scope="module")
def big_store(tmp_path_factory):
    """A 200k-token store (random replies and marks), built once; each test corrupts a copy."""
    rng = np.random.default_rng(6)
    replies, marks, total = [], [], 0
    while total < BIG_STORE_TOKENS:
        replies.append(rng.integers(0, VOCAB, rng.integers(1, 200)))
        marks.append(rng.integers(0, VOCAB, 8))
        total += replies[-1].size + 8
    directory = tmp_path_factory.mktemp("big") / "s"
    build(directory, replies, marks)
    return directory


def copied(big_store, tmp_path):
    shutil.copytree(big_store, tmp_path / "s")
    return tmp_path / "s"


def read_array(path, dtype) -> np.ndarray:
    return np.frombuffer(path.read_bytes(), dtype=dtype, offset=HEADER_BYTES).copy()


def write_array(path, values: np.ndarray) -> None:
    path.write_bytes(path.read_bytes()[:HEADER_BYTES] + values.tobytes())


def middle(rng, candidates: np.ndarray) -> int:
    """A random one of the candidates in the middle half of the store."""
    inside = candidates[(candidates > candidates.max() // 4) & (candidates < 3 * (candidates.max() // 4))]
    return int(rng.choice(inside))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("value", [0x7FFFFFF0, VOCAB, VOCAB + 1000])
def test_an_id_outside_the_vocabulary_is_refused(big_store, tmp_path, seed, value):
    directory = copied(big_store, tmp_path)
    tokens = read_array(directory / TOKENS_NAME, TOKEN_DTYPE)
    entry = middle(np.random.default_rng(seed), np.flatnonzero(tokens != SEPARATOR))
    tokens[entry] = value
    write_array(directory / TOKENS_NAME, tokens)
    assert (f"tokens.bin entry {entry}: token id {value} is not below the vocabulary size {VOCAB}"
            in open_error(directory))


def test_a_manifest_whose_max_token_id_lies_is_refused(big_store, tmp_path):
    directory = copied(big_store, tmp_path)
    path = directory / MANIFEST_NAME
    raw = json.loads(path.read_text())
    largest = raw["max_token_id"]
    for lie in (largest - 1, largest + 1):
        path.write_text(json.dumps({**raw, "max_token_id": lie}))
        assert f"the largest token id is {largest}, store.json says max_token_id {lie}" in open_error(directory)


@pytest.mark.parametrize("seed", range(3))
def test_two_swapped_suffix_array_entries_are_refused(big_store, tmp_path, seed):
    directory = copied(big_store, tmp_path)
    positions = read_array(directory / SUFFIX_ARRAY_NAME, "<i4")
    rng = np.random.default_rng(seed)
    first = middle(rng, np.arange(positions.size))
    second = first + 1 if seed == 0 else middle(rng, np.arange(first + 1, positions.size))  # neighbours, then apart
    positions[[first, second]] = positions[[second, first]]
    write_array(directory / SUFFIX_ARRAY_NAME, positions)
    # the only entries whose suffix sorts after the next one's: the first moved down, or the one before the second
    assert re.search(f"suffix_array.bin entry ({first}|{second - 1}): out of order: the suffix at \\d+ sorts after "
                     f"the one at \\d+ \\(entry ({first + 1}|{second})\\)", open_error(directory))


def test_a_repeated_suffix_array_entry_is_refused(big_store, tmp_path):
    directory = copied(big_store, tmp_path)
    positions = read_array(directory / SUFFIX_ARRAY_NAME, "<i4")
    rng = np.random.default_rng(7)
    first = middle(rng, np.arange(positions.size))
    second = middle(rng, np.arange(first + 1, positions.size))
    positions[second] = positions[first]
    write_array(directory / SUFFIX_ARRAY_NAME, positions)
    message = open_error(directory)
    assert re.search(f"suffix_array.bin entry ({first}|{second}): repeats position {positions[first]} "
                     f"\\(entry ({first}|{second}) holds it too\\)", message), message


def test_a_suffix_array_entry_on_a_separator_is_refused(big_store, tmp_path):
    directory = copied(big_store, tmp_path)
    tokens = read_array(directory / TOKENS_NAME, TOKEN_DTYPE)
    positions = read_array(directory / SUFFIX_ARRAY_NAME, "<i4")
    rng = np.random.default_rng(8)
    entry, separator = middle(rng, np.arange(positions.size)), middle(rng, np.flatnonzero(tokens == SEPARATOR))
    positions[entry] = separator
    write_array(directory / SUFFIX_ARRAY_NAME, positions)
    assert (f"suffix_array.bin entry {entry}: points at a separator (tokens.bin entry {separator})"
            in open_error(directory))


def test_a_separator_overwritten_is_refused(big_store, tmp_path):
    """A token where a separator was (two sequences run together), and a separator where a token was."""
    directory = copied(big_store, tmp_path)
    pristine = read_array(directory / TOKENS_NAME, TOKEN_DTYPE)
    rng = np.random.default_rng(9)
    tokens = pristine.copy()
    separator = middle(rng, np.flatnonzero(tokens == SEPARATOR))
    tokens[separator] = 17
    write_array(directory / TOKENS_NAME, tokens)
    assert re.search(f"tokens.bin entry {separator}: token 17 has no suffix_array.bin entry \\(the store has "
                     f"\\d+ separators, its manifest says num_sequences \\d+\\)", open_error(directory))
    tokens = pristine.copy()
    apart = (tokens != SEPARATOR) & (np.roll(tokens, 1) != SEPARATOR) & (np.roll(tokens, -1) != SEPARATOR)
    token = middle(rng, np.flatnonzero(apart))  # not next to a separator: no sequence is left empty
    tokens[token] = SEPARATOR
    write_array(directory / TOKENS_NAME, tokens)
    assert re.search(f"suffix_array.bin entry \\d+: points at a separator \\(tokens.bin entry {token}\\)",
                     open_error(directory))


def test_a_store_with_ids_the_target_lacks_does_not_fit(tmp_path):
    store = build(tmp_path / "s", [[1, 2, 400], [3]], tokenizer=dict(TOKENIZER, vocab_size=512))
    assert store.max_token_id == 400  # the tokenizer's vocabulary holds it: the store opens
    with pytest.raises(StoreError, match="token ids: the store's largest is 400, the target's vocab_size is 256"):
        store.check_fits(IDENTITY)
    build(tmp_path / "s", [[1, 2, 255], [3]], tokenizer=dict(TOKENIZER, vocab_size=512)).check_fits(IDENTITY)
