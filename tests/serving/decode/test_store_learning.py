"""A store that learns as it serves (serving/decode/learned_store.py, serving/decode/store.py).

Unit level: a learned reply is searchable at once, marked by its prompt's tail; memory stays
within the capacity, the oldest replies leaving first; segments stay few; merges on their own
thread lose nothing that is added meanwhile. Engine level, on the
tiny random Llama: a prompt served again is drafted from the first reply (whole runs accepted,
its opening included), greedy output still the target's own; a sequence that fails is not
learned; the bench gives each method its own learned replies and reports a second pass apart.
"""

from __future__ import annotations

import torch

from specheads.bench.harness import make_methods, run_methods
from specheads.bench.prompts import EncodedPrompt
from specheads.heads.artefacts.suffix_search import SearchSettings, Searcher
from specheads.heads.target.adapter import TargetAdapter
from specheads.serving.decode.config import SpeculativeDecoder
from specheads.serving.decode.learned_store import LearnedStore
from specheads.serving.decode.sequence import SequenceRequest
from specheads.serving.decode.store import StoreConfig, StoreDrafter
from specheads.bench_cli import repeat_passes

from test_batch import hf_greedy, run_session

NUM_NEW = 30


def search(store: LearnedStore, context: list[int]) -> list[int]:
    segments, _ = store.segments()
    return Searcher([list(segments)], SearchSettings(num_tokens=8, min_probability=0.0)).propose(context).tokens


def test_a_learned_reply_is_searched_at_once_from_its_prompt_s_tail():
    store = LearnedStore(capacity=10_000, mark_tokens=3)
    store.add([1, 2, 3, 4, 5], [10, 11, 12, 13])
    assert store.num_replies == 1 and store.num_tokens == 3 + 4 + 1  # mark, reply, separator
    assert search(store, [9, 3, 4, 5]) == [10, 11, 12]  # a new request whose prompt ends alike: its opening
    assert search(store, [4, 5, 10, 11]) == [12, 13]
    store.clear()
    assert search(store, [4, 5, 10, 11]) == [] and store.num_tokens == 0


def test_memory_is_bounded_and_the_oldest_leave_first():
    store = LearnedStore(capacity=400, mark_tokens=0)
    for k in range(200):
        store.add([], [1000 + k, 2000 + k, 3000 + k])  # 4 tokens each with the separator
        assert store.num_tokens <= 400
        store.flush()  # the merges run on their own thread
        assert len(store.segments()[0]) <= 12  # O(log) segments
    assert search(store, [1199, 2199]) == [3199]  # the newest are there
    assert search(store, [1000, 2000]) == []  # the oldest left
    kept = [k for k in range(200) if search(store, [1000 + k, 2000 + k])]
    assert kept == list(range(kept[0], 200)) and len(kept) >= 300 // 4  # a suffix of the history, most of it


def test_replies_added_while_merges_run_are_all_kept():
    store = LearnedStore(capacity=1 << 20, mark_tokens=0)
    for k in range(300):
        store.add([], list(range(10_000 + 50 * k, 10_050 + 50 * k)))  # distinct replies of 50 tokens
    store.flush()
    assert store.num_tokens == 300 * 51 and len(store.segments()[0]) <= 12
    for k in (0, 150, 299):
        assert search(store, [10_000 + 50 * k, 10_001 + 50 * k]) == [10_002 + 50 * k, 10_003 + 50 * k]


def test_a_long_reply_keeps_its_last_tokens():
    store = LearnedStore(capacity=8, mark_tokens=2)
    store.add([1, 2], list(range(100, 120)))
    assert store.num_tokens == 8 and search(store, [114, 115]) == [116, 117]


def served(decoder, prompts, lengths):
    return run_session(decoder, [SequenceRequest(p, n) for p, n in zip(prompts, lengths)])


def test_a_prompt_served_again_drafts_from_its_first_reply(tiny_llama_dir):
    target = TargetAdapter.from_pretrained(tiny_llama_dir)
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, target.vocab_size, (9,), generator=generator).tolist() for _ in range(3)]
    references = [hf_greedy(target, prompt, NUM_NEW) for prompt in prompts]
    drafter = StoreDrafter(None, StoreConfig(learn_tokens=4096, mark_tokens=4, prompt=False))
    decoder = SpeculativeDecoder(target, store=drafter, fallback=None)
    tokens, first, _ = served(decoder, prompts, [NUM_NEW] * 3)
    assert tokens == references
    assert drafter.learned.num_replies == 3
    tokens, again, _ = served(decoder, prompts, [NUM_NEW] * 3)
    assert tokens == references  # drafts never change the output
    for before, after in zip(first, again):
        # the whole reply, its opening included, comes from the store: 10-token chains from step 1
        assert after.stats.store_accepted >= NUM_NEW - 5, after.stats
        assert after.stats.steps <= 4 < before.stats.steps


def test_a_failed_sequence_is_not_learned(tiny_llama_dir, monkeypatch):
    target = TargetAdapter.from_pretrained(tiny_llama_dir)
    drafter = StoreDrafter(None, StoreConfig(learn_tokens=4096))
    decoder = SpeculativeDecoder(target, store=drafter, fallback=None)
    original = StoreDrafter.propose

    def faulty(self, seq):
        if seq.prompt == [5, 6, 7, 8]:
            raise RuntimeError("injected store fault")
        return original(self, seq)

    monkeypatch.setattr(StoreDrafter, "propose", faulty)
    _, results, _ = served(decoder, [[5, 6, 7, 8], [9, 10, 11, 12]], [8, 8])
    assert [r.finish_reason for r in results] == ["error", "length"]
    assert drafter.learned.num_replies == 1


def test_the_bench_gives_each_method_its_own_learned_replies(tiny_llama_dir):
    target = TargetAdapter.from_pretrained(tiny_llama_dir)
    store = StoreDrafter(None, StoreConfig(learn_tokens=4096))
    prompts = repeat_passes([EncodedPrompt(i, "chat", [3 + i, 40, 41, 42, 43]) for i in range(2)], 2)
    assert [p.category for p in prompts] == ["chat", "chat", "chat (pass 2)", "chat (pass 2)"]
    methods = make_methods(target, store=store, lookup_num_tokens=0, prompt_lookup_num_tokens=0)
    stores = [m.decoder.store for m in methods if m.decoder is not None and m.decoder.store is not None]
    assert len(stores) == 1 and stores[0].learned is not store.learned
    runs = run_methods(methods, prompts, 12, warmup=True)
    store_runs = runs[next(m.name for m in methods if m.kind == "engine-store")]
    assert [run.tokens for run in store_runs] == [run.tokens for run in runs["hf-greedy"]]
    assert store_runs[0].store_accepted == 0  # nothing learned yet: the warm-up's reply was forgotten
    assert store_runs[2].store_accepted >= 8 and store_runs[3].store_accepted >= 8  # pass 2 drafts from pass 1
    assert store.learned.num_replies == 0  # the drafter given to the bench learned nothing itself
