"""The whole warm step compiles as one graph (serving/decode/steps.py `DeviceStep`,
`SpeculativeDecoder(compile_step=...)`): `torch.compile(fullgraph=True)` raises on any graph
break, so a step that compiles holds no host read, no Python branch on a tensor, no generator
and no call the compiler cannot follow, from the draft to the commit (the target's forward
included). Its tokens equal the eager step's in fp32, token for token.

Covered, on the tiny random Llama with the static-shape cache (cuda_graphs="eager"), a greedy
and a seeded sampled row (top-k) in one batch for a few steps: Medusa heads on a static tree
with n-gram lookup and the reply store; an EAGLE-3 head on a static tree; an EAGLE-2 dynamic
tree with lookup. The backend is "eager" (dynamo's graph capture, run by the
eager kernels): the proof is the capture, and inductor's C++ compile would take minutes on
two cores. Each decoder compiles one graph per step variant (which drafters draft, which
rules the rows sample with); the recompile limit is an error here, so a step that guarded on a
changing host value would fail instead of falling back to eager.
"""

from __future__ import annotations

import pytest
import torch

from specheads.heads.target.adapter import TargetAdapter
from specheads.serving.decode.config import SpeculativeDecoder
from specheads.serving.decode.engine import BatchEngine
from specheads.serving.decode.lookup import LookupConfig
from specheads.serving.decode.sampling import SamplingParams
from specheads.serving.decode.sequence import SequenceRequest
from specheads.serving.decode.store import StoreDrafter
from specheads.serving.decode.trees import DynamicTreeConfig

from test_device_step import TREE, eagle_head, every_token_prompt, every_token_store, medusa_heads

NUM_STEPS = 4


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return TargetAdapter.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def store(target, tmp_path_factory) -> StoreDrafter:
    return every_token_store(target, tmp_path_factory.mktemp("store") / "s", num_tokens=3)


DECODERS = {
    "medusa+lookup+store": lambda target, store: dict(heads=medusa_heads(target), tree=TREE, store=store,
                                                      lookup=LookupConfig(num_tokens=3, alone_at_ngram=None)),
    "eagle3-static": lambda target, store: dict(heads=eagle_head(target), tree=TREE),
    "eagle2-dynamic+lookup": lambda target, store: dict(
        heads=eagle_head(target), tree=DynamicTreeConfig(depth=3, top_k=2, num_nodes=5),
        lookup=LookupConfig(num_tokens=3, alone_at_ngram=None)),
}


def decode(decoder: SpeculativeDecoder) -> tuple[list[list[int]], list[int]]:
    """A greedy and a seeded sampled row decoded together for NUM_STEPS steps (none ends: one
    batch shape, so one step variant per drafter set) -> (each row's tokens, its steps that
    drafted)."""
    engine = BatchEngine(decoder, max_batch_size=2,
                         max_cache_len=decoder.target.vocab_size + 16 + 64 + decoder.max_tree_nodes)
    for seq_id, sampling in enumerate([None, SamplingParams(temperature=0.9, top_k=30, seed=3)]):
        prompt = every_token_prompt(decoder.target, seq_id, 4 * seq_id)  # every token: lookup matches
        engine.add(engine.check(SequenceRequest(prompt, 64, sampling=sampling), seq_id))
    for _ in range(NUM_STEPS):
        engine.step()
    return [seq.tokens for seq in engine.rows], [seq.stats.speculative_steps for seq in engine.rows]


@pytest.mark.parametrize("kind", sorted(DECODERS))
@torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)
def test_the_warm_step_compiles_whole_and_decodes_as_the_eager_step(target, store, kind):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager = decode(SpeculativeDecoder(target, **DECODERS[kind](target, store), fallback=None, cuda_graphs="eager"))
    compiled_decoder = SpeculativeDecoder(target, **DECODERS[kind](target, store), fallback=None,
                                          cuda_graphs="eager", compile_step="eager")
    compiled = decode(compiled_decoder)
    assert compiled == eager
    assert compiled[1] == [NUM_STEPS, NUM_STEPS]  # every step verified a drafted tree
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= 2, graphs  # one per step variant seen (whether the store had a chain), not one per step
