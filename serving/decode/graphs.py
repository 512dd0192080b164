"""CUDA graphs for the verify forward: on a GPU, one eager target forward costs 21-24 ms of
Python and kernel launches whatever the model's size (an H200 with SmolLM2's shape at 1k
context: 23.6 ms eager, 3.5 ms replayed; Llama-3.1-8B's shape at 4k: 23.9 against 9.9;
`python -m specheads.bench.gpu.suite --sections graphs`), so the engine captures the forward
once per shape and replays it every step.

`VerifyGraphs` owns one graph per (first row, rows, T) over the engine's static-shape
`TreeStaticCache` (serving/decode/cache.py: `update` returns the whole buffers and writes at
the device lengths, so no shape or host value changes between steps). Inside the graph
everything comes from device tensors: the tree tokens, position offsets and tree masks are
copied into the graph's own input buffers before each replay; positions and the attention
mask (or, with the tree-attention kernel, its prefix lengths with max_cache_len - T as the
bound) come from the cache's device lengths, which it updates in place. A shape is captured
the third time it is seen (the first two run the same forward eagerly: a draining batch
meets most row counts only a few times), after two eager warm-up runs on a side stream
(Triton's compile, cuBLAS's workspace); all graphs share one memory pool.

What replay skips and the engine does instead: the cache's host bookkeeping (its pending
count, set here) and its capacity check (BatchEngine.check sizes every request to the cache).
The engine pads every verify to a bucket of tree sizes (`bucket`) so that a few graphs cover
dynamic trees and lookup chains; padding nodes see only themselves and are never accepted.

`capture=False` runs exactly the same static-shape forward eagerly, with the same buffers and
masks: that is how the CPU tests check it (a CPU has nothing to capture).

Shape legend: n rows, T tree nodes (bucketed), V vocab, nH drafter tap width.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from specheads.serving.decode.cache import TreeStaticCache

WARMUP_RUNS = 2  # eager runs before a capture: the first compiles Triton kernels and sets up cuBLAS
CAPTURE_AFTER = 3  # a verify shape is captured the third time it is seen (VerifyGraphs.forward)


def bucket(num_nodes: int, max_nodes: int) -> int:
    """The tree size a verify of num_nodes is padded to: the next power of two, at most max_nodes
    (the largest tree the decoder drafts), so a few graphs serve every step."""
    if not 1 <= num_nodes <= max_nodes:
        raise ValueError(f"a verify of {num_nodes} nodes does not fit the decoder's largest tree ({max_nodes})")
    size = 1
    while size < num_nodes:
        size *= 2
    return min(size, max_nodes)


@contextlib.contextmanager
def declared_sync():
    """Where the decode step waits for the device on purpose: its one read
    (serving/decode/steps.py `DeviceStep.read`) and a graph's capture (a new shape: a cold
    event). torch.cuda's sync debug mode, if set, is off inside (the GPU suite sets it to
    "error" around warm steps, so that any other sync fails the run)."""
    if not torch.cuda.is_available():
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)


def capture(run, device: torch.device, pool=None, warmup_runs: int = WARMUP_RUNS):
    """Record `run()` (no arguments) as a CUDA graph after `warmup_runs` eager runs on a side
    stream -> (graph, run's outputs, which live in the graph's memory). The graph has been
    replayed once, so the outputs hold a real result."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup_runs):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = run()
    graph.replay()  # capture records without running
    return graph, outputs


@dataclass
class _Graph:
    tokens_nT: torch.Tensor
    offsets_nT: torch.Tensor
    tree_masks_nTT: torch.Tensor
    logits_nTV: torch.Tensor | None = None
    taps_nTH: torch.Tensor | None = None
    graph: object | None = None  # torch.cuda.CUDAGraph when captured
    seen: int = 0  # verifies of this shape so far


class VerifyGraphs:
    """The verify forward of one decoder over one static-shape cache, captured per shape.

    decoder: its target, tap layers and attention choice. cache: a TreeStaticCache built with
    static_shape=True. capture: record CUDA graphs (the target must be on a CUDA device);
    False runs the same static-shape forward eagerly."""

    def __init__(self, decoder, cache: TreeStaticCache, capture: bool):
        if not cache.static_shape:
            raise ValueError("CUDA-graph verify needs a TreeStaticCache built with static_shape=True")
        device = decoder.target.device
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need the target on a CUDA device, got {device}; "
                             "pass capture=False to run the static-shape forward eagerly")
        self.decoder, self.cache, self.capture, self.device = decoder, cache, capture, device
        self.graphs: dict[tuple[int, int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    @property
    def num_graphs(self) -> int:
        return len(self.graphs)

    def forward(self, tokens_nT: torch.Tensor, offsets_nT: torch.Tensor,
                tree_masks_nTT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Verify the cache's active rows -> (logits [n, T, V], taps [n, T, nH]). The logits
        live in the graph's buffer until the next replay of that shape; the taps are a copy
        (a decode state keeps them). A shape is captured the CAPTURE_AFTER-th time it is seen;
        before that it runs eagerly, the same static-shape forward: a batch that drains row by
        row (an offline job's end) meets each row count a few times only, and a capture costs
        about three eager forwards and a buffer of logits."""
        cache = self.cache
        num_rows, num_nodes = tokens_nT.shape
        key = (cache.lengths.start, num_rows, num_nodes)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = _Graph(tokens_nT.clone(), offsets_nT.clone(), tree_masks_nTT.clone())
        else:
            entry.tokens_nT.copy_(tokens_nT)
            entry.offsets_nT.copy_(offsets_nT)
            entry.tree_masks_nTT.copy_(tree_masks_nTT)
        entry.seen += 1
        if entry.graph is not None:
            entry.graph.replay()
            logits_nTV, taps_nTH = entry.logits_nTV, entry.taps_nTH
        elif self.capture and entry.seen >= CAPTURE_AFTER:
            # Warm-up writes the same pending entries the captured run will: the next commit keeps them.
            with declared_sync():
                entry.graph, (entry.logits_nTV, entry.taps_nTH) = capture(lambda: self._run(entry), self.device,
                                                                         self.pool)
            logits_nTV, taps_nTH = entry.logits_nTV, entry.taps_nTH
        else:
            logits_nTV, taps_nTH = self._run(entry)
        cache.lengths.num_pending = num_nodes  # what `update` would have recorded
        return logits_nTV, taps_nTH.clone()

    def _run(self, entry: _Graph) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward a graph records: every input a device tensor, every shape fixed."""
        decoder, cache = self.decoder, self.cache
        num_nodes = entry.tokens_nT.shape[1]
        if decoder.attn_impl == "tree":
            from specheads.serving.kernels.tree_attention import pack_tree_mask

            kwargs = {"tree_mask": pack_tree_mask(entry.tree_masks_nTT), "prefix_len": cache.lengths.active_device,
                      "max_prefix_len": cache.max_cache_len - num_nodes}
            if decoder.tree_attention_impl is not None:
                kwargs["tree_attention_impl"] = decoder.tree_attention_impl
        else:
            kwargs = {"attention_mask": cache.attention_mask(entry.tree_masks_nTT)}
        out = decoder.target(entry.tokens_nT, decoder.tap_layers, position_ids=cache.position_ids(entry.offsets_nT),
                             past_key_values=cache, use_cache=True, **kwargs)
        return out.logits, torch.cat(out.taps, dim=-1)

