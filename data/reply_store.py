"""Building a reply store (heads/artefacts/reply_store.py) from chat records: `specheads data store`.

    specheads data store --input REPLIES.jsonl --target T --output DIR [--tokenizer PATH]
                         [--thinking default|on|off] [--mark-tokens 8]

The store holds what the target says: the assistant replies of chat records (the output of
`specheads data regenerate`, whose replies are the target's own), tokenized with the target's
tokenizer exactly as training sees them (data/text.py `tokenize_documents`: the chat template,
assistant-only loss masks). Each maximal run of assistant tokens (one reply, through its
end-of-turn marker) becomes one sequence of the store, after its mark: the mark_tokens tokens
before it in the tokenized conversation (the tail of its prompt: the template's assistant
header, and for a later turn the end of the turn before; fewer where the conversation starts
closer), so that a context ending in a prompt drafts the opening of a reply. Records that are
not chats (text, pre-tokenized ids) hold no replies and are counted as skipped, as are chats the
template cannot split; nothing is left out silently.

The manifest records the target's identity (config only: no weights are loaded) and its
tokenizer's fingerprint, so serving refuses the store for another target or tokenizer.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from specheads.data.records import Conversation
from specheads.data.text import DataError, extract_documents, load_records, load_tokenizer, tokenize_documents
from specheads.heads.artefacts.reply_store import MARK_TOKENS, StoreManifest, tokenizer_fingerprint, write_store

NOT_A_CHAT = "not a chat record (a store holds assistant replies only)"


@dataclass
class StoreReport:
    input: str
    num_records: int = 0
    num_conversations: int = 0  # chats whose replies went into the store
    num_replies: int = 0
    num_tokens: int = 0  # reply tokens
    num_mark_tokens: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # records left out, by reason
    seconds: float = 0.0

    def summary(self, manifest: StoreManifest | None = None) -> str:
        text = (f"{self.input}: {self.num_conversations}/{self.num_records} records, {self.num_replies} replies, "
                f"{self.num_tokens} tokens")
        if self.num_mark_tokens:
            text += f" (+ {self.num_mark_tokens} mark tokens)"
        if manifest is not None:
            text += f"; index {manifest.index_bytes / 2 ** 20:.1f} MiB"
        if self.skipped:
            reasons = ", ".join(f"{reason}: {count}" for reason, count in sorted(self.skipped.items()))
            text += f"; skipped {sum(self.skipped.values())} ({reasons})"
        return text + f"; {self.seconds:.1f} s"


def reply_spans(loss_mask: list[bool] | None) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of tokens with loss (the assistant's replies) of one sequence."""
    if loss_mask is None:
        return []
    spans, start = [], None
    for index, is_reply in enumerate(loss_mask):
        if is_reply and start is None:
            start = index
        elif not is_reply and start is not None:
            spans.append((start, index))
            start = None
    return spans + [(start, len(loss_mask))] if start is not None else spans


def marked_replies(token_ids: list[int], loss_mask: list[bool] | None,
                   mark_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(mark, reply) for each reply of one sequence: the reply's tokens and the up to
    mark_tokens tokens before it."""
    return [(list(token_ids[max(0, start - mark_tokens):start]), list(token_ids[start:end]))
            for start, end in reply_spans(loss_mask)]


def build_store(input_path: str, target: str, output: str, *, tokenizer_path: str | None = None,
                thinking: str = "default", trust_remote_code: bool = False,
                mark_tokens: int = MARK_TOKENS) -> tuple[StoreManifest, StoreReport]:
    """Read the chat records of `input_path`, tokenize their replies with `target`'s tokenizer
    (or tokenizer_path's) and write the store into `output`, each reply after its mark of up to
    mark_tokens tokens (0: none) -> (its manifest, the report).
    target: a resolved target path or hub id (its config gives the identity)."""
    from specheads.heads.artefacts.export import resolve_target

    if isinstance(mark_tokens, bool) or not isinstance(mark_tokens, int) or mark_tokens < 0:
        raise DataError(f"--mark-tokens must be an int >= 0, got {mark_tokens!r}")
    start = time.perf_counter()
    identity = resolve_target(target)
    records = load_records(input_path)
    report = StoreReport(input=str(input_path), num_records=len(records))
    documents, skipped = extract_documents(records, "text")
    chats = [doc for doc in documents if isinstance(doc, Conversation)]
    skipped[NOT_A_CHAT] += len(documents) - len(chats)
    if not chats:
        raise DataError(f"{input_path}: no chat records with assistant replies (of {len(records)} records: "
                        f"{dict(skipped)}); a store is built from `specheads data regenerate` output")
    tokenizer = load_tokenizer(tokenizer_path or target, trust_remote_code)
    tokenized = tokenize_documents(chats, None, tokenizer=tokenizer, thinking=thinking)
    skipped.update(tokenized.skipped)
    pairs = [pair for ids, mask in zip(tokenized.token_ids, tokenized.loss_masks)
             for pair in marked_replies(ids, mask, mark_tokens)]
    marks, replies = [mark for mark, _ in pairs], [reply for _, reply in pairs]
    report.num_conversations = tokenized.num_conversations
    report.num_replies = len(replies)
    report.num_tokens = sum(len(reply) for reply in replies)
    report.num_mark_tokens = sum(len(mark) for mark in marks)
    report.skipped = {reason: count for reason, count in Counter(skipped).items() if count}
    if not replies:
        raise DataError(f"{input_path}: the chat records hold no assistant tokens ({report.summary()})")
    manifest = write_store(output, replies, marks=marks, mark_tokens=mark_tokens, target=identity,
                           tokenizer={"name_or_path": str(tokenizer_path or target),
                                      "fingerprint": tokenizer_fingerprint(tokenizer), "vocab_size": len(tokenizer)},
                           source={"input": str(input_path), "num_records": report.num_records,
                                   "num_conversations": report.num_conversations, "skipped": report.skipped,
                                   "thinking": thinking})
    report.seconds = time.perf_counter() - start
    return manifest, report
