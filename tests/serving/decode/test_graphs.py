"""The CUDA-graph verify (serving/decode/graphs.py) on a CPU: cuda_graphs="eager" runs the
forward a graph records (static-shape cache, every input a device tensor, bucketed tree
sizes, the kernel with a bound instead of a host sync) and must stay lossless against HF
greedy, for Medusa, EAGLE dynamic trees with n-gram lookup, and a batch of unequal rows.
The capture itself needs a GPU: tests/bench/test_gpu.py and the GPU suite run it there.
"""

from __future__ import annotations

import pytest
import torch

from specheads.heads.eagle3 import Eagle3Head
from specheads.heads.target.adapter import TargetAdapter
from specheads.serving.decode.config import SpeculativeDecoder
from specheads.serving.decode.engine import BatchEngine
from specheads.serving.decode.sequence import SequenceRequest
from specheads.serving.decode.generate import generate
from specheads.serving.decode.graphs import VerifyGraphs, bucket
from specheads.serving.decode.lookup import LookupConfig
from specheads.serving.decode.scheduler import Scheduler
from specheads.serving.decode.stats import DecodeStats
from specheads.serving.decode.trees import DraftTree, DynamicTreeConfig
from test_decode_lossless import NUM_NEW, TREE_PATHS, build_cases


@pytest.fixture(scope="module")
def setup(tiny_llama_dir):
    target = TargetAdapter.from_pretrained(tiny_llama_dir)
    return target, build_cases(target, seed=99)[:6]


def corrupt(depth, position):  # rejections and rank-1 rescues, so accepted paths vary in length
    return "rank1" if (depth + position) % 3 == 0 else ("wrong" if (depth * position) % 5 == 4 else None)


@pytest.mark.parametrize("attn_impl", ["sdpa", pytest.param("tree", marks=pytest.mark.slow)])  # tree: 41 s
def test_static_verify_is_lossless_with_medusa(setup, tiny_llama_dir, attn_impl):
    target, cases = setup
    if attn_impl == "tree":  # its own model: the engine switches its attention
        target = TargetAdapter.from_pretrained(tiny_llama_dir)
    total = DecodeStats()
    for case in cases:
        decoder = SpeculativeDecoder(target, case.oracle(target, corrupt), DraftTree.from_paths(TREE_PATHS),
                                     attn_impl=attn_impl, fallback=None, cuda_graphs="eager")
        result = generate(decoder, case.prompt, NUM_NEW)
        assert result.tokens == case.reference
        total = total.merge(result.stats)
    assert total.tau > 1.5  # multi-token paths were verified and committed through the static forward


def test_static_verify_is_lossless_with_eagle_dynamic_trees_and_lookup(setup):
    target, cases = setup
    text = target.text_config
    torch.manual_seed(0)
    head = Eagle3Head(target.hidden_size, target.vocab_size, target.vocab_size, text.num_attention_heads,
                      text.num_key_value_heads, text.intermediate_size, num_taps=3).eval()
    decoder = SpeculativeDecoder(target, head, DynamicTreeConfig(depth=3, top_k=2, num_nodes=6), fallback=None,
                                 lookup=LookupConfig(num_tokens=4), cuda_graphs="eager")
    for case in cases:
        assert generate(decoder, case.prompt, NUM_NEW).tokens == case.reference


def test_a_batch_of_unequal_rows_shares_one_static_forward(setup):
    target, cases = setup
    oracle_cases = cases[:2]  # prompts of 1 and 8 tokens
    # One decoder, two prompts of different lengths decoded together: the mask and positions
    # come from each row's own device length. The oracle knows the first prompt only, so the
    # second row's drafts are mostly rejected: the rows accept different path lengths.
    tree = DraftTree.from_paths(TREE_PATHS)
    scheduler = Scheduler(SpeculativeDecoder(target, oracle_cases[0].oracle(target), tree, fallback=None,
                                             cuda_graphs="eager"), max_batch_size=2, max_cache_len=96)
    ids = [scheduler.add(SequenceRequest(case.prompt, NUM_NEW)) for case in oracle_cases]
    results = {}
    while scheduler.num_active:
        results.update({update.seq_id: update.result for update in scheduler.step() if update.finished})
    for seq_id, case in zip(ids, oracle_cases):
        assert results[seq_id].tokens == case.reference
    graphs = scheduler.engine.graphs
    assert isinstance(graphs, VerifyGraphs) and scheduler.engine.cache.static_shape
    # Every key is (first row, rows, a bucketed tree size): the 11-node tree (root + 10 paths)
    # is verified at 11 nodes, never padded past it.
    assert scheduler.engine.decoder.max_tree_nodes == 11
    assert graphs.num_graphs >= 1 and all(size in (1, 2, 4, 8, 11) for _, _, size in graphs.graphs)
    assert (0, 2, 11) in graphs.graphs  # both rows, the whole tree, in one forward


def test_rows_leaving_mid_decode_keep_the_others_lossless(setup):
    """A cancelled row moves the last row into its place (TreeStaticCache.move_row): the
    remaining rows' graphs read the moved lengths from the same device tensor."""
    target, cases = setup
    tree = DraftTree.from_paths(TREE_PATHS)
    scheduler = Scheduler(SpeculativeDecoder(target, cases[2].oracle(target, corrupt), tree, fallback=None,
                                             cuda_graphs="eager"), max_batch_size=3, max_cache_len=96)
    ids = [scheduler.add(SequenceRequest(case.prompt, NUM_NEW)) for case in cases[:3]]
    scheduler.step()
    scheduler.step()
    assert scheduler.cancel(ids[0]) is not None  # row 0 leaves; row 2 moves into it
    results = {}
    while scheduler.num_active:
        results.update({update.seq_id: update.result for update in scheduler.step() if update.finished})
    for seq_id, case in zip(ids[1:], cases[1:3]):
        assert results[seq_id].tokens == case.reference


def test_bucket_pads_to_powers_of_two_up_to_the_largest_tree():
    assert [bucket(n, 15) for n in (1, 2, 3, 5, 8, 9, 15)] == [1, 2, 4, 8, 8, 15, 15]
    assert bucket(16, 16) == 16
    with pytest.raises(ValueError, match="largest tree"):
        bucket(17, 16)
    with pytest.raises(ValueError, match="largest tree"):
        bucket(0, 16)


def test_bad_settings_are_refused(setup):
    target, _ = setup
    with pytest.raises(ValueError, match="'capture' or 'eager'"):
        SpeculativeDecoder(target, cuda_graphs="yes")
    with pytest.raises(ValueError, match="CUDA device"):
        SpeculativeDecoder(target, cuda_graphs="capture")
    engine = BatchEngine(SpeculativeDecoder(target), max_batch_size=1, max_cache_len=16)
    assert engine.graphs is None and not engine.cache.static_shape
    with pytest.raises(ValueError, match="static_shape=True"):
        VerifyGraphs(SpeculativeDecoder(target), engine.cache, capture=False)
