"""Tree attention: T tree-node queries over the S committed keys plus the T tree keys.

Node t sees every prefix key and the tree keys j with tree_mask[t, j] (itself and its
ancestors). This module owns:

- `pack_tree_mask` / `unpack_tree_mask`: the bool ancestor mask as int32 bit words
  (bit j % 32 of word j // 32 of row t), the form the kernel reads.
- `tree_attention_reference`: dense masked softmax in fp32, the PyTorch reference; and
  `tree_attention_flash_reference`, the same rounded where FlashAttention rounds 16-bit
  inputs, which the kernel's bf16/fp16 output is held to.
- `tree_attention(..., impl="triton" | "torch")`: the public entry point. The Triton path
  is the operator `torch.ops.specheads.tree_attention_` (serving/kernels/custom_op.py, so
  torch.compile keeps it in the graph) over the kernels of serving/kernels/triton_kernel.py
  (both imported lazily), which split the prefix across enough programs to fill the GPU,
  flash-decoding style, and merge the partials by log-sum-exp.
- `tree_attention_forward` + `register_tree_attention()`: a transformers attention function
  ("specheads_tree"). The tree reaches it as forward kwargs (`tree_mask=`, optional
  `prefix_len=`, `max_prefix_len=`, `tree_attention_impl=`), which transformers passes down
  to attention functions; without `tree_mask` it is plain SDPA, so one loaded model serves
  prefill, plain decode and tree verification.

Shape legend: B batch, Hq query heads, Hkv KV heads, T tree nodes, S prefix keys,
D head dim, W = ceil(T / 32) mask words.
"""

from __future__ import annotations

import math
import os

import torch

ATTN_IMPLEMENTATION = "specheads_tree"
BITS_PER_WORD = 32


def pack_tree_mask(tree_mask: torch.Tensor) -> torch.Tensor:
    """bool [..., T, T] -> int32 [..., T, W]; bit j % 32 of word j // 32 is tree_mask[..., j]."""
    if tree_mask.dtype != torch.bool:
        raise TypeError(f"tree_mask must be bool, got {tree_mask.dtype}")
    num_tree = tree_mask.shape[-1]
    num_words = max(1, math.ceil(num_tree / BITS_PER_WORD))
    padded = torch.zeros(*tree_mask.shape[:-1], num_words * BITS_PER_WORD, dtype=torch.int64,
                         device=tree_mask.device)
    padded[..., :num_tree] = tree_mask.to(torch.int64)
    weights = torch.bitwise_left_shift(torch.ones((), dtype=torch.int64, device=tree_mask.device),
                                       torch.arange(BITS_PER_WORD, device=tree_mask.device))  # [32]
    words = (padded.view(*tree_mask.shape[:-1], num_words, BITS_PER_WORD) * weights).sum(-1)
    # Two's complement wrap into int32 (bit 31 set -> negative), explicit rather than a cast.
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)
    return words.to(torch.int32)


def unpack_tree_mask(packed: torch.Tensor, num_tree: int) -> torch.Tensor:
    """int32 [..., T, W] -> bool [..., T, T], the inverse of `pack_tree_mask`."""
    bits = torch.arange(BITS_PER_WORD, device=packed.device, dtype=torch.int32)
    unpacked = (packed[..., None].bitwise_right_shift(bits) & 1).bool()  # [..., T, W, 32]
    return unpacked.flatten(-2)[..., :num_tree]


def _as_bool_mask(tree_mask: torch.Tensor, num_tree: int) -> torch.Tensor:
    return tree_mask if tree_mask.dtype == torch.bool else unpack_tree_mask(tree_mask, num_tree)


def _as_packed_mask(tree_mask: torch.Tensor) -> torch.Tensor:
    if tree_mask.dtype == torch.bool:
        return pack_tree_mask(tree_mask)
    if tree_mask.dtype != torch.int32:
        raise TypeError(f"a packed tree mask must be int32 (see pack_tree_mask), got {tree_mask.dtype}")
    return tree_mask


def _prefix_lens(prefix_len, batch: int, device) -> tuple[torch.Tensor, int]:
    """int | [B] ints | tensor [B] -> (long tensor [B] on device, max S as a host int)."""
    if isinstance(prefix_len, int):
        return torch.full((batch,), prefix_len, dtype=torch.long, device=device), prefix_len
    lens = torch.as_tensor(prefix_len, dtype=torch.long).to(device)
    if lens.dim() == 0:
        lens = lens.expand(batch)
    if lens.shape != (batch,):
        raise ValueError(f"prefix_len must be an int or hold one length per sequence ({batch}), "
                         f"got shape {tuple(lens.shape)}")
    if (lens < 0).any():
        raise ValueError(f"prefix_len must be >= 0, got {lens.tolist()}")
    return lens, int(lens.max())


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
                  tree_mask: torch.Tensor) -> None:
    """prefix_len here is the largest S."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"expected q [B, Hq, T, D], k = v [B, Hkv, S+T, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    batch, num_q_heads, num_tree, head_dim = q.shape
    if k.shape[0] != batch or k.shape[3] != head_dim or num_q_heads % k.shape[1]:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} (GQA needs Hq % Hkv == 0)")
    if prefix_len < 0 or k.shape[2] < prefix_len + num_tree:
        raise ValueError(f"k holds {k.shape[2]} keys, fewer than prefix_len + T = {prefix_len} + {num_tree}")
    last = num_tree if tree_mask.dtype == torch.bool else max(1, math.ceil(num_tree / BITS_PER_WORD))
    if tree_mask.dim() not in (2, 3) or tree_mask.shape[-2:] != (num_tree, last) or \
            (tree_mask.dim() == 3 and tree_mask.shape[0] not in (1, batch)):
        raise ValueError(f"tree_mask must be [T, T|W] or [B, T, T|W] with T = {num_tree}, "
                         f"got {tuple(tree_mask.shape)}")


def _dense_scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len, tree_mask: torch.Tensor,
                  scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 scaled scores [B, Hq, T, L] with -inf where a key is not seen, the values
    [B, Hq, L, D] in v's dtype); L = max S + T. The checks and the mask of both references."""
    batch, _, num_tree, _ = q.shape
    prefix_lens_B, max_prefix_len = _prefix_lens(prefix_len, batch, q.device)
    _check_shapes(q, k, v, max_prefix_len, tree_mask)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k.shape[1]
    num_keys = max_prefix_len + num_tree
    keys = k[:, :, :num_keys].float().repeat_interleave(group, dim=1)  # [B, Hq, L, D]
    values = v[:, :, :num_keys].repeat_interleave(group, dim=1)
    tree_BTT = _as_bool_mask(tree_mask, num_tree).to(q.device).expand(batch, num_tree, num_tree)
    cols_L = torch.arange(num_keys, device=q.device)
    tree_col_BL = cols_L[None] - prefix_lens_B[:, None]  # key -> tree node (valid in [0, T))
    in_tree_BL = (tree_col_BL >= 0) & (tree_col_BL < num_tree)
    tree_BTL = tree_BTT.gather(-1, tree_col_BL.clamp(0, num_tree - 1)[:, None].expand(batch, num_tree, num_keys))
    mask = ((cols_L[None] < prefix_lens_B[:, None])[:, None] | (in_tree_BL[:, None] & tree_BTL))[:, None]
    scores = (q.float() @ keys.transpose(-1, -2)) * scale  # products of 16-bit inputs are exact in fp32
    return scores.masked_fill(~mask, float("-inf")), values


def tree_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             prefix_len: int | list[int] | torch.Tensor, tree_mask: torch.Tensor,
                             scale: float | None = None) -> torch.Tensor:
    """Dense masked softmax in fp32. q [B, Hq, T, D]; k, v [B, Hkv, >= S+T, D]; prefix_len
    S (int, or one per sequence: keys S_b .. S_b+T-1 are sequence b's tree, later keys are
    ignored); tree_mask bool [T, T] / [B, T, T] or its packed int32 form.
    -> [B, Hq, T, D] in q's dtype."""
    scores, values = _dense_scores(q, k, v, prefix_len, tree_mask, scale)
    return (scores.softmax(dim=-1) @ values.float()).to(q.dtype)


def tree_attention_flash_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   prefix_len: int | list[int] | torch.Tensor, tree_mask: torch.Tensor,
                                   scale: float | None = None) -> torch.Tensor:
    """The reference rounded where FlashAttention rounds 16-bit inputs: scores in fp32, the
    scale applied in fp32, p = exp(s - row max) in fp32 with its row sum in fp32, p rounded
    to v's dtype for the PV product (accumulated in fp32), the division in fp32, one
    rounding of the output. Arguments as `tree_attention_reference`; for fp32 inputs the two
    agree. The kernel differs from it only where its blocks round p against a running max
    (within an ulp of the row's largest output; tests/serving/kernels)."""
    scores, values = _dense_scores(q, k, v, prefix_len, tree_mask, scale)
    p = torch.exp(scores - scores.amax(dim=-1, keepdim=True))  # [B, Hq, T, L] fp32
    return ((p.to(values.dtype).float() @ values.float()) / p.sum(dim=-1, keepdim=True)).to(q.dtype)


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   prefix_len: int | list[int] | torch.Tensor, tree_mask: torch.Tensor, scale: float | None = None,
                   impl: str = "triton", split_size: int | None = None, out: torch.Tensor | None = None,
                   max_prefix_len: int | None = None) -> torch.Tensor:
    """Tree attention; see the module docstring.

    q [B, Hq, T, D]; k, v [B, Hkv, >= S+T, D]; prefix_len S, an int or one per sequence
    ([B] list or integer tensor; a tensor costs one host sync for its max and its check, unless
    max_prefix_len gives a bound: then nothing syncs, so a CUDA graph can capture the call,
    and the caller guarantees 0 <= S <= max_prefix_len); tree_mask bool [T, T] /
    [B, T, T] or packed int32 [T, W] / [B, T, W]. fp32, bf16 or fp16 (fp32 accumulation).
    split_size (triton): the prefix is shared by ceil(max S / split_size) programs instead
    of the default rule's count (triton_kernel.prefix_splits), which depends on the shapes,
    the bound on S and the GPU only, so a graph captured at one bound stays valid.
    out: optional [B, Hq, T, D] destination of any strides (e.g. a transposed [B, T, Hq, D]).
    -> [B, Hq, T, D] in q's dtype (`out` when given).
    """
    if isinstance(prefix_len, (int, torch.SymInt)):  # read by the kernel as a number
        if max_prefix_len is not None and max_prefix_len < prefix_len:
            raise ValueError(f"max_prefix_len ({max_prefix_len}) is below prefix_len ({prefix_len})")
        kernel_prefix_len, max_prefix_len = prefix_len, prefix_len if max_prefix_len is None else max_prefix_len
    elif max_prefix_len is not None and isinstance(prefix_len, torch.Tensor) and prefix_len.dim() == 1:
        if prefix_len.dtype.is_floating_point or prefix_len.dtype == torch.bool:
            raise TypeError(f"prefix_len must hold integers, got {prefix_len.dtype}")
        kernel_prefix_len = prefix_len if prefix_len.device == q.device else prefix_len.to(q.device)  # no sync
    else:
        kernel_prefix_len, max_prefix_len = _prefix_lens(prefix_len, q.shape[0], q.device)
    _check_shapes(q, k, v, max_prefix_len, tree_mask)
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if impl == "torch":
        result = tree_attention_reference(q, k, v, prefix_len, tree_mask, scale)
        return result if out is None else out.copy_(result)
    if impl != "triton":
        raise ValueError(f"impl must be 'triton' or 'torch', got {impl!r}")
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("impl='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is "
                         "imported; use impl='torch' on the CPU")
    try:
        from specheads.serving.kernels.custom_op import tree_attention_
    except ModuleNotFoundError as err:  # triton is a dependency on Linux only (pyproject.toml)
        raise ValueError(f"impl='triton' needs triton ({err}; it has Linux wheels only); use impl='torch'") from err

    packed = _as_packed_mask(tree_mask)
    packed = packed if packed.device == q.device else packed.to(q.device)  # a caller's host mask: one upload
    packed = (packed[None] if packed.dim() == 2 else packed).contiguous()  # [B|1, T, W]
    per_sequence = isinstance(kernel_prefix_len, torch.Tensor)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    tree_attention_(q, k, v, packed, kernel_prefix_len.contiguous() if per_sequence else None,
                    0 if per_sequence else kernel_prefix_len, max_prefix_len, scale, split_size, out)
    return out


def _default_impl(query: torch.Tensor) -> str:
    return "triton" if query.is_cuda or os.environ.get("TRITON_INTERPRET") == "1" else "torch"


def tree_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           tree_mask: torch.Tensor | None = None,
                           prefix_len: int | list[int] | torch.Tensor | None = None,
                           tree_attention_impl: str | None = None, max_prefix_len: int | None = None,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function: query [B, Hq, T, D], key/value [B, Hkv, S+T, D]
    (cache already updated) -> ([B, T, Hq, D], None).

    With `tree_mask` the 4-D `attention_mask` is ignored: the tree mask (bool or packed; pack
    it once per step, not per layer) and prefix_len (default: key length - T, right for a
    DynamicCache; pass it with a preallocated cache) define visibility; max_prefix_len, a
    bound on a tensor prefix_len, spares the host sync (see `tree_attention`). Without it: SDPA.
    """
    if tree_mask is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if dropout:
        raise ValueError("tree attention is inference-only; dropout must be 0")
    batch, num_q_heads, num_tree, head_dim = query.shape
    prefix_len = key.shape[2] - num_tree if prefix_len is None else prefix_len
    out_BTHD = torch.empty(batch, num_tree, num_q_heads, head_dim, dtype=query.dtype, device=query.device)
    tree_attention(query, key, value, prefix_len, tree_mask, scale=scaling,
                   impl=tree_attention_impl or _default_impl(query), out=out_BTHD.transpose(1, 2),
                   max_prefix_len=max_prefix_len)
    return out_BTHD, None


def register_tree_attention() -> str:
    """Register "specheads_tree" with transformers (idempotent); returns the name to pass as
    `attn_implementation`. Masks are built as for SDPA, so the fallback path sees the same
    masks an "sdpa" model would."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, tree_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION


def use_tree_attention(model) -> None:
    """Make `model` attend through the tree attention (registered first). It behaves as SDPA
    whenever a forward passes no tree_mask, so the model's other users see no change."""
    name = register_tree_attention()
    if getattr(model.config, "_attn_implementation", None) != name:
        model.set_attn_implementation(name)
