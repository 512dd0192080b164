"""The Triton tree attention as one PyTorch operator, `torch.ops.specheads.tree_attention_`,
so that torch.compile keeps a forward that calls it in one graph.

On a GPU it is a `torch.library.triton_op`: dynamo records the operator (its fake
implementation gives the shapes), and AOTAutograd decomposes it into the two Triton kernels
(each launched through `torch.library.wrap_triton`), which inductor compiles and launches
in its own generated code: no graph break, no opaque fallback call. Under TRITON_INTERPRET=1
the kernels are interpreted functions that cannot be traced into a graph, so there it is a
plain `torch.library.custom_op` with the same schema and fake implementation: compiled
code calls it as one opaque operator.

It writes into `out` (any strides: the attention function hands a transposed [B, T, Hq, D]
buffer), so the eager path copies nothing. Imported lazily, with triton
(serving/kernels/tree_attention.py's triton path).

Shape legend: B batch, Hq query heads, Hkv KV heads, T tree nodes, S prefix keys, D head
dim, W = ceil(T / 32) mask words.
"""

from __future__ import annotations

import torch
from triton import knobs

from specheads.serving.kernels import triton_kernel

OP_NAME = "specheads::tree_attention_"


def _tree_attention_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed_mask: torch.Tensor,
                     prefix_lens: torch.Tensor | None, prefix_len: int, max_prefix_len: int, scale: float,
                     split_size: int | None, out: torch.Tensor) -> None:
    """q [B, Hq, T, D]; k, v [B, Hkv, >= max S+T, D]; packed_mask int32 [B|1, T, W];
    prefix_lens: S per sequence as an integer tensor [B] on q's device, or None when every
    sequence has S = prefix_len; max_prefix_len >= every S; out [B, Hq, T, D] <- result."""
    kernel_prefix_len = prefix_len if prefix_lens is None else prefix_lens
    wrap = (lambda kernel: kernel) if knobs.runtime.interpret else torch.library.wrap_triton
    triton_kernel.launch(q, k, v, packed_mask, kernel_prefix_len, max_prefix_len, scale, out, split_size, wrap=wrap)


if knobs.runtime.interpret:
    tree_attention_ = torch.library.custom_op(OP_NAME, _tree_attention_, mutates_args=("out",))
else:
    tree_attention_ = torch.library.triton_op(OP_NAME, _tree_attention_, mutates_args=("out",))


@tree_attention_.register_fake
def _tree_attention_fake(q, k, v, packed_mask, prefix_lens, prefix_len, max_prefix_len, scale, split_size, out):
    """Shapes only: the operator returns nothing and writes `out` in place."""
    return None
