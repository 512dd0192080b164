"""The decode step on the device: one read back to the host per step, and nothing uploaded.

A GPU pipelines its work only while the host never waits for it. The engine's step (draft,
verify, accept, commit, record) is written so that the accepted tokens' copy to the host
(`DeviceStep.read`) is its only wait, and so that it builds no tensor from host data: every
index, length and mask it needs lives on the device and is updated there. On a CPU nothing
waits and an upload is no copy at all, so the test counts what WOULD wait or copy on a GPU:
- reads (`SyncCounter`), through a TorchDispatchMode (`.item()`, `int()`, `bool()` on a
  tensor, nonzero, boolean-mask indexing, torch.equal, ...) and through the Python-level
  copies that bypass the dispatcher on a CPU tensor (`.tolist()`, `.cpu()`, `.numpy()`);
- uploads (`UploadCounter`): every tensor made from host data (`aten.lift_fresh`: torch.tensor
  or as_tensor of a list, a scalar or an array, from_numpy, indexing with a list, a Python
  number written at list indices), every copy from the CPU to another device (`_to_copy`,
  `copy_`), and every `.to(device)` / `.cuda()` made by the project's own code (on a CPU a
  same-device `.to` never reaches the dispatcher; on a GPU it is an upload when the tensor
  lives on the host). The store's chains are the step's one declared upload (their index is
  host memory: serving/decode/store.py); a step whose rows changed (a sequence left) moves
  rows without uploads too, so every step is counted.

Covered: Medusa static trees (with AdaEDL's depth cut), EAGLE-3 static trees, EAGLE-2 dynamic
trees, n-gram lookup alone and as a branch, the reply store alone and as a branch beside
lookup (serving/decode/store.py), batches of several sequences of unequal lengths,
greedy and sampled rows together, a row that asks for token logprobs, on the configuration a GPU runs (static-shape cache as for
CUDA graphs, tree attention); and on the SDPA path.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
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

HOST_DATA_OPS = {"lift_fresh", "lift_fresh_copy"}
DECLARED_UPLOADS = ("StoreDrafter.prepare",)  # the store's chains (serving/decode/store.py)
SYNCING_OPS = {"_local_scalar_dense", "nonzero", "equal", "is_nonzero", "masked_select", "unique_dim",
               "_unique2", "unique_consecutive", "repeat_interleave"}
SYNCING_METHODS = ("tolist", "cpu", "numpy", "item")
REPO = Path(__file__).resolve().parents[3]
PROJECT_ROOTS = tuple(os.path.realpath(REPO / part) + "/" for part in ("serving", "heads"))
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


class UploadCounter(TorchDispatchMode):
    """Records every tensor built from host data, and every copy from the CPU to another
    device, as "<innermost project function>: <what>" (module doc)."""

    def __init__(self):
        super().__init__()
        self.uploads: list[str] = []
        self.scalar_writes = 0  # inside `tensor[index] = <a Python number>` (HostMoves)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name, kwargs = func.overloadpacket.__name__, kwargs or {}
        if name in HOST_DATA_OPS and not self.scalar_writes:
            self.uploads.append(f"{project_function()}: {name}")
        elif name == "_to_copy" and "device" in kwargs and args[0].device.type == "cpu" \
                and torch.device(kwargs["device"]).type != "cpu":
            self.uploads.append(f"{project_function()}: _to_copy to {kwargs['device']}")
        elif name == "copy_" and args[1].device.type == "cpu" and args[0].device.type != "cpu":
            self.uploads.append(f"{project_function()}: copy_ to {args[0].device}")
        return func(*args, **kwargs)


class HostMoves(TorchFunctionMode):
    """Records every `.to(<a device>)` and `.cuda()` the project's own code makes (a CPU never
    dispatches a same-device `.to`, so UploadCounter cannot see them). And it tells the counter
    when a Python number is written into a tensor at plain indices: on a CPU that makes a host
    scalar tensor (lift_fresh) and copies it, but on a GPU torch makes the scalar on the device
    (a fill, no copy), so that is no upload; a list among the indices still is."""

    def __init__(self, counter: UploadCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        func = getattr(func, "original", func)  # count_step_syncs's wrapper has counted the call already
        if func in (torch.Tensor.to, torch.Tensor.cuda) and (func is torch.Tensor.cuda or any(
                isinstance(value, (torch.device, str, torch.Tensor)) for value in list(args[1:]) + list(kwargs.values()))):
            where = project_function(strict=True)
            if where is not None:
                self.counter.uploads.append(f"{where}: Tensor.{func.__name__}")
        if func is torch.Tensor.__setitem__ and isinstance(args[2], (bool, int, float)) and not any(
                isinstance(index, (list, np.ndarray)) for index in (args[1] if isinstance(args[1], tuple) else (args[1],))):
            self.counter.scalar_writes += 1
            try:
                return func(*args, **kwargs)
            finally:
                self.counter.scalar_writes -= 1
        return func(*args, **kwargs)


def project_function(strict: bool = False) -> str | None:
    """The innermost caller in the project's parts (serving/, heads/), as "file:qualname";
    strict: None when the innermost caller outside torch is not the project's."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = os.path.realpath(frame.f_code.co_filename)
        if filename.startswith(PROJECT_ROOTS):
            return f"{Path(filename).name}:{frame.f_code.co_qualname}"
        if strict and "/torch/" not in filename and "test_device_step" not in filename:
            return None
        frame = frame.f_back
    return "outside the project"


def _indices(args) -> list:
    return [index for index in (args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else [])]


def count_step_syncs(engine: BatchEngine, monkeypatch, retire: bool = False) -> tuple[list, list]:
    """Run the engine to the end -> per step, (the syncs it made, the uploads it made).
    retire: a finished sequence leaves the engine before the next step (its row is refilled)."""
    syncs, uploads = [], []
    originals = {name: getattr(torch.Tensor, name) for name in SYNCING_METHODS}
    while any(seq.finish_reason is None for seq in engine.rows):
        counter, upload_counter = SyncCounter(), UploadCounter()
        for name, method in originals.items():
            def counted(self, *args, _name=name, _method=method, **kwargs):
                counter.syncs.append(f"Tensor.{_name}")
                return _method(self, *args, **kwargs)
            counted.original = method  # what HostMoves runs (a torch function mode is handed this wrapper)
            monkeypatch.setattr(torch.Tensor, name, counted)
        with counter, upload_counter, HostMoves(upload_counter):
            engine.step()
            for seq in [seq for seq in engine.rows if seq.finish_reason is not None] if retire else []:
                engine.remove(seq)
        for name, method in originals.items():
            monkeypatch.setattr(torch.Tensor, name, method)
        syncs.append(counter.syncs)
        uploads.append([u for u in upload_counter.uploads if not u.split(":")[1].startswith(DECLARED_UPLOADS)])
    return syncs, uploads


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


def every_token_store(target, directory, num_tokens: int) -> StoreDrafter:
    """A reply store in which every token is followed by others (a chain at every step)."""
    generator = torch.Generator().manual_seed(7)
    replies = [torch.randperm(target.vocab_size, generator=generator).tolist() * 2 for _ in range(3)]
    write_store(directory, replies, target=target.identity, tokenizer={"fingerprint": "-"})
    return StoreDrafter(ReplyStore(directory), StoreConfig(num_tokens=num_tokens, min_match=1))


@pytest.fixture(scope="module")
def store(target, tmp_path_factory) -> StoreDrafter:
    return every_token_store(target, tmp_path_factory.mktemp("store") / "s", num_tokens=4)


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
                                                                          alone_at_ngram=None),
                                                      one_chain_per_row=False),  # both chains in one step
}


def every_token_prompt(target: TargetAdapter, seed: int, extra: int) -> list[int]:
    """Every vocab token once (so a lookup chain matches at every step), then `extra` more."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(target.vocab_size, generator=generator).tolist()
    return order + order[:extra]


@pytest.mark.parametrize("kind, path", [(kind, path) for kind in sorted(DRAFTERS) for path in ("static", "dynamic")]
                         + [pytest.param("eagle3-lookup", "static-kernel", marks=pytest.mark.slow)])  # 37 s
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
    per_step, uploads = count_step_syncs(engine, monkeypatch, retire=path == "dynamic")
    assert len(per_step) >= 3
    for step, (syncs, uploaded) in enumerate(zip(per_step, uploads)):
        assert syncs == ["Tensor.tolist"], f"step {step} synced {syncs}"
        assert uploaded == [], f"step {step} uploaded {uploaded}"
    if path != "dynamic" and "lookup" in kind:  # every step drafted every row's chain
        assert all(seq.stats.lookup_steps == seq.stats.steps for seq in engine.rows)
    if path != "dynamic" and "store" in kind:  # and its store chain
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


def test_the_upload_counter_sees_what_a_gpu_would_copy():
    """Each kind of upload, made from a function whose code sits in the project's serving/
    folder (compiled under that file name), is recorded with that function's name."""
    source = ("def uploads(x):\n"
              "    a = torch.tensor([1, 2])\n"  # from a list
              "    b = torch.as_tensor(np.arange(3))\n"  # from an array
              "    c = x[[0, 2]]\n"  # indexing with a list
              "    x[[0, 1]] = 5\n"  # indices from a list (and the number: written with them)
              "    d = x.to(x.device)\n"  # a .to(device): an upload where x lives on the host
              "    e = torch.ones(2).to('meta')\n"  # a copy from the CPU to another device
              "    x[2].fill_(7)\n"  # a fill with a scalar argument: no upload
              "    x[3] = 7\n"  # a Python number written at plain indices: on a GPU a fill too
              "    return torch.arange(4) + torch.full((4,), 3) + x\n")  # factories without host data
    namespace = {"torch": torch, "np": np}
    exec(compile(source, str(REPO / "serving" / "decode" / "upload_example.py"), "exec"), namespace)
    counter = UploadCounter()
    with counter, HostMoves(counter):
        namespace["uploads"](torch.zeros(4, dtype=torch.long))
    assert counter.uploads == ["upload_example.py:uploads: lift_fresh"] * 5 + [
        "upload_example.py:uploads: Tensor.to", "upload_example.py:uploads: Tensor.to",
        "upload_example.py:uploads: _to_copy to meta"]
