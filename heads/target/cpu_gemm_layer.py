"""A Llama-family decoder layer in two C calls around its attention (heads/target/cpu_gemm.py's
kernel library, its `attention_in` and `attention_out` entry points): what
heads/target/cpu_decoder.py runs for each layer of a bf16 forward where that kernel runs the
linear layers (`FusedDecoder.layer_halves`), and what an EAGLE-3 head's layers run when drafting
in bf16 there (`PackedHeadLayer`, swapped in by heads/target/cpu_layout.py `packed_for_inference`).
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F
from torch import nn

from specheads.heads.target import cpu_attention
from specheads.heads.target.cpu_gemm import TOKEN_TILE, PackedBf16Linear, _library, _Plan


class _LayerPlan(ctypes.Structure):
    _fields_ = [("qkv", _Plan), ("o", _Plan), ("gate_up", _Plan), ("down", _Plan), ("input_norm", ctypes.c_void_p),
                ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("hidden", ctypes.c_int64), ("q_heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64), ("eps", ctypes.c_float),
                ("second_norm", ctypes.c_void_p)]


@functools.cache
def _calls():
    """The library's two layer entry points, typed (the library is built: a PackedBf16Linear exists)."""
    library = _library()
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    library.attention_in.restype = library.attention_out.restype = None
    library.attention_in.argtypes = [ctypes.POINTER(_LayerPlan), pointer, pointer, i64, i64, pointer, pointer, i64,
                                     i64, pointer, pointer, pointer, ctypes.c_int]
    library.attention_out.argtypes = [ctypes.POINTER(_LayerPlan), pointer, pointer, i64, pointer, pointer, pointer,
                                      pointer, pointer, ctypes.c_int]
    return library.attention_in, library.attention_out


class LayerScratch:
    """One forward's scratch for every `PackedBf16Layer` call of it (tokens = batch x new tokens):
    the normed input, the attention block's output, the MLP's activation and the fp32 token tiles."""

    def __init__(self, tokens: int, hidden: int, intermediate: int, widest: int):
        self.tokens = tokens
        self.normed = torch.empty(tokens, widest, dtype=torch.bfloat16)
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
    between them (about 8 calls a layer).

    second_norm: EAGLE-3's first head layer, whose q/k/v read [input_norm(x) ; second_norm(second)]
    (qkv's in_features twice the hidden size; `attention_in` then takes `second`)."""

    def __init__(self, qkv: PackedBf16Linear, o: PackedBf16Linear, gate_up: PackedBf16Linear,
                 down: PackedBf16Linear, input_norm: torch.Tensor, post_norm: torch.Tensor,
                 q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, num_q_heads: int, num_kv_heads: int,
                 head_dim: int, eps: float, second_norm: torch.Tensor | None = None):
        hidden = o.out_features
        if qkv.in_features != hidden * (1 if second_norm is None else 2):
            raise ValueError(f"PackedBf16Layer: q/k/v read {qkv.in_features} features; the hidden size is {hidden}, "
                             f"so {hidden} (one input) or {2 * hidden} (with a second input and its norm)")
        norms = [n if n is None else n.detach().contiguous()
                 for n in (input_norm, post_norm, q_norm, k_norm, second_norm)]
        if any(n is not None and n.dtype != torch.bfloat16 for n in norms):
            raise ValueError("PackedBf16Layer's norm weights must be bf16, got "
                             f"{[None if n is None else n.dtype for n in norms]}")
        self.ops, self.norms = (qkv, o, gate_up, down), norms  # held: the plan points into them
        self.hidden, self.intermediate = hidden, gate_up.out_features
        self.qkv_width = qkv.out_features
        self.widest = max(op.in_features for op in self.ops)
        pointers = [None if n is None else n.data_ptr() for n in norms]
        self.plan = _LayerPlan(qkv.plan, o.plan, gate_up.plan, down.plan, *pointers[:4],
                               self.hidden, num_q_heads, num_kv_heads, head_dim, self.intermediate, eps, pointers[4])
        self._plan_ref = ctypes.byref(self.plan)
        self._in, self._out = _calls()

    def scratch(self, tokens: int) -> LayerScratch:
        return LayerScratch(tokens, self.hidden, self.intermediate, self.widest)

    def attention_in(self, hidden_BTH: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor,
                     scratch: LayerScratch, second_BTH: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [B, T, H] contiguous bf16 (and second, so, with a second norm), cos/sin [B, T, D]
        bf16 (unit stride in D; any batch stride) -> qkv [B, T, (Hq + 2 Hkv) D], q and k rotated."""
        batch, num_new, _ = hidden_BTH.shape
        if (second_BTH is None) != (self.norms[4] is None):
            raise ValueError("PackedBf16Layer.attention_in takes a second input exactly when the layer has a second "
                             "norm")
        qkv = hidden_BTH.new_empty(batch, num_new, self.qkv_width)
        second = None if second_BTH is None else second_BTH.data_ptr()
        self._in(self._plan_ref, hidden_BTH.data_ptr(), second, batch * num_new, num_new, cos_BTD.data_ptr(),
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


class PackedHeadLayer(nn.Module):
    """An EAGLE-3 head layer (heads/eagle3.py `MidLayer`, or a further `DecoderLayer`) in bf16,
    for drafting: its norms and linear layers in the two `PackedBf16Layer` calls, its rotary
    embedding, key/value write and attention as the module runs them. The same inputs and outputs
    as the layer it replaces, whose parameters it reads (not copied; packed once, at build)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.first = hasattr(layer, "hidden_norm")  # MidLayer: attention over [embedding ; feature]
        for name, child in layer.named_children():  # the layer's parameters under their names, shared
            self.add_module(name, child)
        attn, mlp = layer.self_attn, layer.mlp
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.layer = PackedBf16Layer(
            PackedBf16Linear([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
            PackedBf16Linear([attn.o_proj.weight], epilogue="residual"),
            PackedBf16Linear([mlp.gate_proj.weight, mlp.up_proj.weight], epilogue="glu"),
            PackedBf16Linear([mlp.down_proj.weight], epilogue="residual"),
            layer.input_layernorm.weight, layer.post_attention_layernorm.weight, None, None,
            self.num_heads, self.num_kv_heads, self.head_dim, layer.input_layernorm.eps,
            second_norm=layer.hidden_norm.weight if self.first else None)

    def forward(self, *args):
        """MidLayer's (embeds, feature, position_ids, past_kv, mask) or DecoderLayer's (h,
        position_ids, past_kv, mask) -> (h [B, T, H], this call's (k, v) [B, Hkv, T, D])."""
        if self.first:
            embeds_BTH, residual_BTH, position_ids_BT, past_kv, mask_B1TS = args
            inputs = (embeds_BTH.contiguous(), residual_BTH.contiguous())
        else:
            residual_BTH, position_ids_BT, past_kv, mask_B1TS = args
            inputs = (residual_BTH.contiguous(), None)
        batch, seq, _ = residual_BTH.shape
        freqs_BTd = position_ids_BT.float()[..., None] * self.self_attn.inv_freq
        emb_BTD = torch.cat([freqs_BTd, freqs_BTd], dim=-1).expand(batch, seq, -1)
        cos_BTD, sin_BTD = emb_BTD.cos().to(torch.bfloat16), emb_BTD.sin().to(torch.bfloat16)
        scratch = self.layer.scratch(batch * seq)
        qkv = self.layer.attention_in(inputs[0], cos_BTD, sin_BTD, scratch, inputs[1])
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q = qkv[..., :q_size].view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = qkv[..., q_size:q_size + kv_size].view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = qkv[..., q_size + kv_size:].view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if past_kv is None:
            keys, values = k, v
        elif isinstance(past_kv, tuple):
            keys, values = torch.cat([past_kv[0], k], 2), torch.cat([past_kv[1], v], 2)
        else:
            keys, values = past_kv.update(k, v)
        if cpu_attention.supports(q, keys, values) and mask_B1TS is not None and mask_B1TS.dtype is torch.bool \
                and mask_B1TS.shape[0] == batch:
            # the ragged kernel: 2 drafted tokens over 300 keys, SDPA with a mask about 100 us, this under a quarter
            out = cpu_attention.grouped_attention(q, keys, values, mask_B1TS, self.head_dim ** -0.5)
            out = out.reshape(batch, seq, q_size)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask_B1TS,
                                                 enable_gqa=self.num_heads != self.num_kv_heads)
            out = out.transpose(1, 2).reshape(batch, seq, q_size).contiguous()
        return self.layer.attention_out(out, inputs[1] if self.first else inputs[0], scratch), (k, v)
