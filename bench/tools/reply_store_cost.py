"""What a reply store (heads/artefacts/reply_store.py) costs at a real data size: build time, bytes per
token, and one step's search per sequence.

    python -m specheads.bench.tools.reply_store_cost [--tokens 4000000] [--vocab 49152] [--queries 2000]
                                               [--max-occurrences 16,64,256] [--output-json PATH]

The store is synthetic but shaped like chat replies: each reply strings together phrases from
a bank (chosen by a Zipf law, so a few openings and idioms recur often and most rarely) with
random tokens between them. The contexts searched are cut from replies made the same way but
not stored, so matches are partial as they are at serving time. Per step and sequence the
drafter runs one search (heads/artefacts/suffix_search.py, the serving defaults: num_tokens 10,
max_match 16, min_match 2, min_probability 0.1); the table gives its time per call (mean, p50,
p99) for each max_occurrences, native and (on a tenth of the contexts) the Python rule, after
one pass that pages the store in, as a served store is.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from specheads.heads.artefacts.reply_store import ReplyStore, write_store
from specheads.heads.artefacts.suffix_search import SearchSettings, Searcher
from specheads.heads.target.adapter import TargetIdentity

NUM_TOKENS, MAX_MATCH, MIN_MATCH = 10, 16, 2


def synthetic_replies(num_tokens: int, vocab: int, seed: int) -> list[np.ndarray]:
    """Replies of about 200 tokens, num_tokens in all: Zipf-chosen phrases of a 5,000-phrase
    bank and random tokens between them."""
    bank_rng, rng = np.random.default_rng(0), np.random.default_rng(seed)  # one bank whatever the seed
    bank = [bank_rng.integers(0, vocab, bank_rng.integers(3, 25)) for _ in range(5000)]
    replies, total = [], 0
    while total < num_tokens:
        pieces, length = [], int(rng.integers(50, 350))
        while sum(piece.size for piece in pieces) < length:
            pieces.append(bank[min(int(rng.zipf(1.3)) - 1, len(bank) - 1)])
            pieces.append(rng.integers(0, vocab, int(rng.integers(0, 6))))
        reply = np.concatenate(pieces)[:length]
        replies.append(reply)
        total += reply.size
    return replies


def measure(num_tokens: int, vocab: int, num_queries: int, occurrences: list[int]) -> dict:
    replies = synthetic_replies(num_tokens, vocab, seed=0)
    held_out = synthetic_replies(num_queries * 40, vocab, seed=1)
    identity = TargetIdentity("LlamaForCausalLM", "llama", 576, vocab, 30, "synthetic")
    with tempfile.TemporaryDirectory() as root:
        start = time.perf_counter()
        manifest = write_store(Path(root) / "store", replies, target=identity, tokenizer={"fingerprint": "-"})
        build_s = time.perf_counter() - start
        start = time.perf_counter()
        store = ReplyStore(Path(root) / "store")
        open_ms = 1000 * (time.perf_counter() - start)
        rng = np.random.default_rng(2)
        contexts = []
        for _ in range(num_queries):
            reply = held_out[int(rng.integers(len(held_out)))]
            end = int(rng.integers(1, reply.size + 1))
            contexts.append(reply[max(0, end - MAX_MATCH):end].tolist())
        rows = []
        for cap in occurrences:
            for native in (True, False):
                searcher = Searcher([[store.index]], SearchSettings(num_tokens=NUM_TOKENS, max_match=MAX_MATCH,
                                                                    min_match=MIN_MATCH, max_occurrences=cap),
                                    native=native)
                rows.append(dict(_time(searcher, contexts if native else contexts[::10]), max_occurrences=cap,
                                 search="native" if searcher.library is not None else "python"))
    return {"num_tokens": manifest.num_tokens, "num_sequences": manifest.num_sequences, "vocab": vocab,
            "index_bytes": manifest.index_bytes, "bytes_per_token": manifest.index_bytes / manifest.num_tokens,
            "build_s": build_s, "open_ms": open_ms, "num_queries": num_queries, "search": rows}


def _time(searcher: Searcher, contexts: list[list[int]]) -> dict:
    for context in contexts:  # page the store in, as serving has
        searcher.propose(context)
    times, lengths = [], []
    for context in contexts:
        start = time.perf_counter()
        chain = searcher.propose(context).tokens
        times.append(time.perf_counter() - start)
        lengths.append(len(chain))
    micro = 1e6 * np.array(times)
    return {"mean_us": float(micro.mean()), "p50_us": float(np.percentile(micro, 50)),
            "p99_us": float(np.percentile(micro, 99)), "mean_chain": float(np.mean(lengths)),
            "proposed": float(np.mean([n > 0 for n in lengths]))}


def format_report(report: dict) -> str:
    lines = [f"reply store: {report['num_tokens'] / 1e6:.2f} M tokens in {report['num_sequences']} replies "
             f"(vocab {report['vocab']}): {report['index_bytes'] / 2 ** 20:.1f} MiB "
             f"({report['bytes_per_token']:.2f} bytes/token, {report['bytes_per_token']:.2f} MB per million tokens), "
             f"built in {report['build_s']:.1f} s, opened in {report['open_ms']:.2f} ms", "",
             f"one propose per sequence and step (num_tokens {NUM_TOKENS}, max_match {MAX_MATCH}, min_match "
             f"{MIN_MATCH}), {report['num_queries']} contexts:", "",
             "| max_occurrences | search | mean us | p50 us | p99 us | contexts with a chain | mean chain |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for row in report["search"]:
        lines.append(f"| {row['max_occurrences']} | {row['search']} | {row['mean_us']:.0f} | {row['p50_us']:.0f} | {row['p99_us']:.0f} "
                     f"| {100 * row['proposed']:.0f}% | {row['mean_chain']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4_000_000, help="reply tokens in the synthetic store")
    parser.add_argument("--vocab", type=int, default=49152, help="vocabulary size (SmolLM2's by default)")
    parser.add_argument("--queries", type=int, default=2000, help="contexts searched")
    parser.add_argument("--max-occurrences", default="16,64,256", help="comma-separated caps to measure")
    parser.add_argument("--output-json", metavar="PATH", help="also write the report as JSON")
    args = parser.parse_args(argv)
    report = measure(args.tokens, args.vocab, args.queries, [int(v) for v in args.max_occurrences.split(",")])
    print(format_report(report))
    if args.output_json:
        from specheads.heads import atomic

        atomic.write_json(args.output_json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
