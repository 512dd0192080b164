"""A Llama-family decoder layer in two C calls around its attention (heads/target/cpu_gemm.py's
kernel library, its `attention_in` and `attention_out` entry points): what
heads/target/cpu_decoder.py runs for each layer of a bf16 forward where that kernel runs the
linear layers (`FusedDecoder.layer_halves`)."""

from __future__ import annotations

import ctypes
import functools

import torch

from specheads.heads.target.cpu_gemm import TOKEN_TILE, PackedBf16Linear, _library, _Plan


class _LayerPlan(ctypes.Structure):
    _fields_ = [("qkv", _Plan), ("o", _Plan), ("gate_up", _Plan), ("down", _Plan), ("input_norm", ctypes.c_void_p),
                ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("hidden", ctypes.c_int64), ("q_heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64), ("eps", ctypes.c_float)]


@functools.cache
def _calls():
    """The library's two layer entry points, typed (the library is built: a PackedBf16Linear exists)."""
    library = _library()
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    library.attention_in.restype = library.attention_out.restype = None
    library.attention_in.argtypes = [ctypes.POINTER(_LayerPlan), pointer, i64, i64, pointer, pointer, i64, i64,
                                     pointer, pointer, pointer, ctypes.c_int]
    library.attention_out.argtypes = [ctypes.POINTER(_LayerPlan), pointer, pointer, i64, pointer, pointer, pointer,
                                      pointer, pointer, ctypes.c_int]
    return library.attention_in, library.attention_out


class LayerScratch:
    """One forward's scratch for every `PackedBf16Layer` call of it (tokens = batch x new tokens):
    the normed input, the attention block's output, the MLP's activation and the fp32 token tiles."""

    def __init__(self, tokens: int, hidden: int, intermediate: int, widest: int):
        self.tokens = tokens
        self.normed = torch.empty(tokens, hidden, dtype=torch.bfloat16)
        self.mid = torch.empty(tokens, hidden, dtype=torch.bfloat16)
        self.act = torch.empty(tokens, intermediate, dtype=torch.bfloat16)
        self.wide = torch.empty(-(-tokens // TOKEN_TILE) * (widest + 1) * TOKEN_TILE, dtype=torch.float32)


class PackedBf16Layer:
    """A Llama-family decoder layer in two C calls around its attention, each one parallel region
    (heads/target/cpu_decoder.py calls them; the cache update and attention stay between them):
    `attention_in` (RMSNorm, q/k/v, Qwen3's q/k norms, RoPE) and `attention_out` (o + residual,
    RMSNorm, SiLU(gate) * up, down + residual). The same kernels and roundings as the four
    `PackedBf16Linear` ops and heads/target/cpu_kernels.py's elementwise ops run one by one, so
    the outputs are those ops', bit for bit; what goes is the Python and the thread start-ups
    between them (about 8 calls a layer)."""

    def __init__(self, qkv: PackedBf16Linear, o: PackedBf16Linear, gate_up: PackedBf16Linear,
                 down: PackedBf16Linear, input_norm: torch.Tensor, post_norm: torch.Tensor,
                 q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, num_q_heads: int, num_kv_heads: int,
                 head_dim: int, eps: float):
        norms = [n if n is None else n.detach().contiguous() for n in (input_norm, post_norm, q_norm, k_norm)]
        if any(n is not None and n.dtype != torch.bfloat16 for n in norms):
            raise ValueError("PackedBf16Layer's norm weights must be bf16, got "
                             f"{[None if n is None else n.dtype for n in norms]}")
        self.ops, self.norms = (qkv, o, gate_up, down), norms  # held: the plan points into them
        self.hidden, self.intermediate = o.out_features, gate_up.out_features
        self.qkv_width = qkv.out_features
        self.widest = max(op.in_features for op in self.ops)
        self.plan = _LayerPlan(qkv.plan, o.plan, gate_up.plan, down.plan,
                               *[None if n is None else n.data_ptr() for n in norms],
                               self.hidden, num_q_heads, num_kv_heads, head_dim, self.intermediate, eps)
        self._plan_ref = ctypes.byref(self.plan)
        self._in, self._out = _calls()

    def scratch(self, tokens: int) -> LayerScratch:
        return LayerScratch(tokens, self.hidden, self.intermediate, self.widest)

    def attention_in(self, hidden_BTH: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor,
                     scratch: LayerScratch) -> torch.Tensor:
        """hidden [B, T, H] contiguous bf16, cos/sin [B, T, D] bf16 (unit stride in D; any batch
        stride) -> qkv [B, T, (Hq + 2 Hkv) D], q and k rotated."""
        batch, num_new, _ = hidden_BTH.shape
        qkv = hidden_BTH.new_empty(batch, num_new, self.qkv_width)
        self._in(self._plan_ref, hidden_BTH.data_ptr(), batch * num_new, num_new, cos_BTD.data_ptr(),
                 sin_BTD.data_ptr(), cos_BTD.stride(0), cos_BTD.stride(1), scratch.normed.data_ptr(),
                 scratch.wide.data_ptr(), qkv.data_ptr(), torch.get_num_threads())
        return qkv

    def attention_out(self, attn_BTX: torch.Tensor, hidden_BTH: torch.Tensor, scratch: LayerScratch) -> torch.Tensor:
        """attn [B, T, Hq D] contiguous bf16 (the attention's output), hidden [B, T, H] (the layer's
        input) -> the layer's output [B, T, H]."""
        out = hidden_BTH.new_empty(hidden_BTH.shape)
        self._out(self._plan_ref, attn_BTX.data_ptr(), hidden_BTH.data_ptr(), scratch.tokens, scratch.mid.data_ptr(),
                  scratch.normed.data_ptr(), scratch.act.data_ptr(), scratch.wide.data_ptr(), out.data_ptr(),
                  torch.get_num_threads())
        return out
