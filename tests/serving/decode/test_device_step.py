"""The decode step on the device: at most one device-to-host sync per step.

A GPU pipelines its work only while the host never waits for it. The engine's step (draft,
verify, accept, commit, record) is written so that the accepted tokens' copy to the host
(`Accepted.to_host`) is its only wait. On a CPU nothing waits, so the test counts the
operations that WOULD wait on a GPU, through a TorchDispatchMode (`.item()`, `int()`, `bool()`
on a tensor, nonzero, boolean-mask indexing, torch.equal, ...) and through the Python-level
copies that bypass the dispatcher on a CPU tensor (`.tolist()`, `.cpu()`, `.numpy()`).

Covered: Medusa static trees (with AdaEDL's depth cut), EAGLE-3 static trees, EAGLE-2 dynamic
trees, n-gram lookup alone and as a branch, the reply store alone and as a branch beside
lookup (serving/decode/store.py), batches of several sequences of unequal lengths,
greedy and sampled rows together, a row that asks for token logprobs, on the configuration a GPU runs (static-shape cache as for
CUDA graphs, tree attention); and on the SDPA path.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specheads.heads.eagle3 import Eagle3Head
from specheads.heads.artefacts.reply_store import ReplyStore, write_store
from specheads.heads.medusa import MedusaHeads
from specheads.heads.target.adapter import TargetAdapter
from specheads.serving.decode.config import SpeculativeDecoder
from specheads.serving.decode.engine import BatchEngine
from specheads.serving.decode.sequence import SequenceRequest
from specheads.serving.decode.lookup import LookupConfig
from specheads.serving.decode.sampling import SamplingParams
from specheads.serving.decode.store import StoreConfig, StoreDrafter
from specheads.serving.decode.trees import DraftTree, DynamicTreeConfig

SYNCING_OPS = {"_local_scalar_dense", "nonzero", "equal", "is_nonzero", "masked_select", "unique_dim",
               "_unique2", "unique_consecutive", "repeat_interleave"}
SYNCING_METHODS = ("tolist", "cpu", "numpy", "item")
TREE = DraftTree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])


class SyncCounter(TorchDispatchMode):
    """Counts the ops that read a device tensor back to the host."""

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNCING_OPS and not (name == "repeat_interleave" and isinstance(args[1] if len(args) > 1 else None,
                                                                                   int)):
            self.syncs.append(name)
        elif name in ("index", "index_put", "index_put_") and any(
                isinstance(index, torch.Tensor) and index.dtype == torch.bool for index in _indices(args)):
            self.syncs.append(f"{name} with a bool mask")
        return func(*args, **(kwargs or {}))


def _indices(args) -> list:
    return [index for index in (args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else [])]


def count_step_syncs(engine: BatchEngine, monkeypatch) -> list[list[str]]:
    """Run the engine to the end -> per step, the syncs it made."""
    per_step = []
    originals = {name: getattr(torch.Tensor, name) for name in SYNCING_METHODS}
    while any(seq.finish_reason is None for seq in engine.rows):
        counter = SyncCounter()
        for name, method in originals.items():
            def counted(self, *args, _name=name, _method=method, **kwargs):
                counter.syncs.append(f"Tensor.{_name}")
                return _method(self, *args, **kwargs)
            monkeypatch.setattr(torch.Tensor, name, counted)
        with counter:
            engine.step()
        for name, method in originals.items():
            monkeypatch.setattr(torch.Tensor, name, method)
        per_step.append(counter.syncs)
    return per_step


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return TargetAdapter.from_pretrained(tiny_llama_dir)


def eagle_head(target: TargetAdapter) -> Eagle3Head:
    text = target.text_config
    torch.manual_seed(0)
    return Eagle3Head(target.hidden_size, target.vocab_size, target.vocab_size, text.num_attention_heads,
                      text.num_key_value_heads, text.intermediate_size, num_taps=3).eval()


def medusa_heads(target: TargetAdapter) -> MedusaHeads:
    torch.manual_seed(0)
    return MedusaHeads(target.hidden_size, target.vocab_size, num_heads=3).eval()


@pytest.fixture(scope="module")
def store(target, tmp_path_factory) -> StoreDrafter:
    """A reply store in which every token is followed by others (a chain at every step)."""
    generator = torch.Generator().manual_seed(7)
    replies = [torch.randperm(target.vocab_size, generator=generator).tolist() * 2 for _ in range(3)]
    directory = tmp_path_factory.mktemp("store") / "s"
    write_store(directory, replies, target=target.identity, tokenizer={"fingerprint": "-"})
    return StoreDrafter(ReplyStore(directory), StoreConfig(num_tokens=4, min_match=1))


DRAFTERS = {
    "medusa": lambda target, store: dict(heads=medusa_heads(target), tree=TREE),
    "medusa-adaedl": lambda target, store: dict(heads=medusa_heads(target), tree=TREE, entropy_threshold=0.02),
    "eagle3-static": lambda target, store: dict(heads=eagle_head(target), tree=TREE),
    "eagle2-dynamic": lambda target, store: dict(heads=eagle_head(target),
                                                 tree=DynamicTreeConfig(depth=3, top_k=2, num_nodes=5,
                                                                        entropy_threshold=0.1)),
    "lookup-alone": lambda target, store: dict(lookup=LookupConfig(num_tokens=4)),
    "eagle3-lookup": lambda target, store: dict(heads=eagle_head(target), tree=TREE,
                                                lookup=LookupConfig(num_tokens=4, max_ngram=2, alone_at_ngram=None)),
    "store-alone": lambda target, store: dict(store=store),
    "medusa-lookup-store": lambda target, store: dict(heads=medusa_heads(target), tree=TREE, store=store,
                                                      lookup=LookupConfig(num_tokens=4, max_ngram=2,
                                                                          alone_at_ngram=None)),
}


def every_token_prompt(target: TargetAdapter, seed: int, extra: int) -> list[int]:
    """Every vocab token once (so a lookup chain matches at every step), then `extra` more."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(target.vocab_size, generator=generator).tolist()
    return order + order[:extra]


@pytest.mark.parametrize("kind, path", [(kind, path) for kind in sorted(DRAFTERS) for path in ("static", "dynamic")]
                         + [("eagle3-lookup", "static-kernel")])
def test_a_step_reads_the_device_once(target, store, kind, path, monkeypatch):
    """static: the cache and verify shapes a CUDA graph captures; static-kernel: with the tree
    attention kernel, as a GPU runs it (under the Triton interpreter here: slow, so one kind)."""
    decoder = SpeculativeDecoder(target, **DRAFTERS[kind](target, store), fallback=None,
                                 attn_impl="tree" if path == "static-kernel" else "sdpa",
                                 cuda_graphs=None if path == "dynamic" else "eager")
    engine = BatchEngine(decoder, max_batch_size=3, max_cache_len=target.vocab_size + 56)
    samplings = [None, SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.0, top_k=20, seed=2)]
    for seq_id, (extra, sampling) in enumerate(zip((9, 17, 0), samplings)):
        prompt = every_token_prompt(target, seq_id, extra)
        logprobs = 2 if seq_id == 1 else None  # a row's token logprobs travel in the same copy
        engine.add(engine.check(SequenceRequest(prompt, 8, sampling=sampling, logprobs=logprobs), seq_id))
    per_step = count_step_syncs(engine, monkeypatch)
    assert len(per_step) >= 3
    for step, syncs in enumerate(per_step):
        assert syncs == ["Tensor.tolist"], f"step {step} synced {syncs}"
    if "lookup" in kind:  # every step drafted every row's chain
        assert all(seq.stats.lookup_steps == seq.stats.steps for seq in engine.rows)
    if "store" in kind:  # and its store chain (where the lookup chain did not already hold it)
        assert all(seq.stats.store_steps > 0 for seq in engine.rows)
        assert kind != "store-alone" or all(seq.stats.store_steps == seq.stats.steps for seq in engine.rows)


def test_the_counter_sees_what_a_gpu_would_wait_for(monkeypatch):
    values = torch.arange(6)
    counter = SyncCounter()
    with counter:
        int(values[2]), bool(values[1] > 0), values.nonzero(), values[values > 2], torch.equal(values, values)
        values.repeat_interleave(2)  # an int count: the output size is known, no sync
    assert counter.syncs == ["_local_scalar_dense", "_local_scalar_dense", "nonzero", "index with a bool mask",
                             "equal"]
