"""A Llama-family target's forward without transformers' per-module Python, for CPU inference.

On a CPU, a one-token decode step of SmolLM2-135M in bf16 (2 cores, through the engine) took
18.3 ms: 8 ms in its 211 linear layers, 4 ms in SDPA over the cache, and 6 ms in everything
else, some 90 small torch ops a layer (RMSNorm alone is seven, RoPE nine) and the
`nn.Module` calls, hooks and keyword plumbing around them. The linear layers already run
packed (heads/target/cpu_layout.py); the rest is overhead that a CPU pays per op, not per byte.
`FusedDecoder` runs the same computation with fewer, larger ops (the step: 10.3-10.8 ms;
docs/results/2026-11-26-cpu-forward.md has the figures):

- q, k and v are one packed linear layer, and so are gate and up (their weights concatenated
  once, at build, into oneDNN's layout; the separate packed copies are dropped, so memory
  stays one packed copy of the weights);
- for up to ROW_KERNEL_MAX_ROWS bf16 rows (a decode step, a small verify) on a CPU with
  AVX512-BF16, the linear layers run through heads/target/cpu_gemv.py instead, on the model's own
  row-major weights, with the residual sums and SiLU-and-multiply in their epilogues, the LM
  head included (SmolLM2's bf16 step, 2 cores: 18.3 ms where oneDNN's packed GEMMs made it
  26 ms; it streams the weights at the rate the cores read memory);
- RMSNorm, RoPE and SiLU-and-multiply are each one C call (heads/target/cpu_kernels.py builds them,
  as it builds heads/target/cpu_attention.py's ragged attention); where no C compiler is found,
  torch ops with transformers' own formulas;
- no module calls, hooks or output recorders: one Python loop over the layers, calling the
  packed GEMMs directly (a `PackedLinear` module call costs about 2 us more than its op).

What it keeps from transformers, so that it computes what the model computes: the mask
(`create_causal_mask` with the model's config, so 2-D padding masks, prepared 4-D masks and
caches behave as in the model's own forward), the rotary embedding module (RoPE scaling
types included), the cache's `update` (any transformers `Cache`; a cache that offers
`direct_writes`, the engine's TreeStaticCache, instead hands over its buffers once a forward,
and each layer writes its keys and values with one C call, 0.5 ms of SmolLM2's bf16 decode
step), and the attention function that the config names
(`ALL_ATTENTION_FUNCTIONS`: the grouped CPU attention, the tree attention, or SDPA), which
receives the caller's attention keyword arguments unchanged. Where that is the grouped CPU
attention, the layer halves run and the cache hands over its buffers, the attention kernel
reads q out of the layer's q/k/v rows and the keys where the cache holds them, its arguments
packed once a forward (`cpu_attention.AttentionCall`: another 0.8 ms of that step).

Which models: Llama, Mistral, Qwen2 and Qwen3 causal LMs (SmolLM2 is a Llama; Qwen3's q and k
norms are one more C call each, in place before RoPE) with SiLU MLPs and full attention in
every layer, with packed linear layers. Anything else (a sliding window,
another architecture, a PEFT-wrapped or quantized layer) returns None from `build` with the
reason, and the adapter runs the model's own forward; so does a model with forward hooks
registered on it (`hooked`), and a model inside `plain_weights()`.

Outputs equal the model's own forward up to rounding: in fp32 within 1e-5 relative (sums in
another order). In bf16 the elementwise kernels round where transformers' ops round (their
outputs equal transformers' on the tested inputs), but the fused GEMMs and the attention
kernel round differently, so the outputs differ by bf16 rounding; the tests hold them to no
worse than the model's own bf16 forward, both against its fp32 forward.

Taps follow transformers' `output_hidden_states` numbering: tap 0 is the embedding output,
tap i the output of layer i - 1, tap num_layers the final normed state.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
from torch import nn

from specheads.heads.target import cpu_attention, cpu_gemm, cpu_gemm_layer, cpu_gemv, cpu_kernels, cpu_layout
from specheads.heads.target.cpu_layout import PackedLinear, PackedWeights, pack_weight, packed_matmul

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32"}
# Rows x columns from which an elementwise kernel spreads over the OpenMP threads (below, the
# threads' start costs more than the work: one decode token is 576 or 1536 values).
PARALLEL_ELEMENTS = 32768
# Rows (batch x tokens) up to which a bf16 forward's linear layers run through heads/target/cpu_gemv.py
# instead of oneDNN: SmolLM2's 121 linears on cold weights, 2 cores, C against oneDNN (ms):
# 1 row 11.3 / 16.2, 4 rows 16.2 / 17.8, 8 rows 22.7 / 25.4, 16 rows 38.7 / 36.2.
ROW_KERNEL_MAX_ROWS = 8
# The bf16 kernels, the first available one wins: (module, the most rows it takes; None: any).
# AVX2's takes every forward, prefills included: oneDNN's bf16 is emulated on such a CPU.
ROW_KERNELS = {"avx512bf16": (cpu_gemv, "RowLinear", ROW_KERNEL_MAX_ROWS), "avx2": (cpu_gemm, "PackedBf16Linear", None)}

# The elementwise kernels (heads/target/cpu_kernels.py ELEMENTWISE), built for both dtypes.
SOURCE = (cpu_kernels.BF16_HELPERS + cpu_kernels.EXP_HELPERS + cpu_kernels.ELEMENTWISE + r"""
ELEMENTWISE(bf16, uint16_t, bf16_load, bf16_store, bf16_round)
ELEMENTWISE(f32, float, f32_load, f32_store, f32_round)
""").replace("PARALLEL)", f"{PARALLEL_ELEMENTS})")


_POINTER, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# The C kernels of SOURCE, each built once per dtype as <name>_<DTYPES suffix>.
SIGNATURES = {"rms_norm": [_POINTER, _POINTER, _I64, _I32, _F32, _POINTER],
              "head_rms_norm": [_POINTER, _POINTER, _I64, _I64, _I32, _I32, _F32],
              "rope": [_POINTER, _POINTER, _I64, _I64, _I32, _I32, _POINTER, _POINTER, _I64, _I64, _I32, _I32, _I32],
              "silu_mul": [_POINTER, _I64, _I32, _POINTER]}


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The elementwise kernels (heads/target/cpu_kernels.py), None where they cannot be built."""
    library = cpu_kernels.compile_library("cpu_decoder", SOURCE)
    if library is None:
        return None
    for suffix in DTYPES.values():
        for name, argtypes in SIGNATURES.items():
            function = getattr(library, f"{name}_{suffix}")
            function.restype, function.argtypes = None, argtypes
    return library


def _cat_bias(weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The bias of the linear layer over the concatenated weights (zeros where one has none)."""
    if all(b is None for b in biases):
        return None
    return torch.cat([b.detach() if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])


@dataclass
class _Kernels:
    """One dtype's C kernels (SIGNATURES)."""

    rms_norm: ctypes._CFuncPtr
    head_rms_norm: ctypes._CFuncPtr
    rope: ctypes._CFuncPtr
    silu_mul: ctypes._CFuncPtr

    @classmethod
    def find(cls, dtype: torch.dtype, device: torch.device) -> "_Kernels | None":
        """The kernels for a model in `dtype` on `device`, or None (torch ops)."""
        library = _library() if device.type == "cpu" and dtype in DTYPES else None
        if library is None:
            return None
        return cls(**{name: getattr(library, f"{name}_{DTYPES[dtype]}") for name in SIGNATURES})


class _PackedProjections:
    """One layer's linear layers through oneDNN's packed weights, for any number of rows: q, k
    and v as one GEMM, gate and up as one (their weights concatenated once, at build), o and
    down the model's own packed weights."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, silu_mul):
        qkv, gate_up = [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]
        self.qkv_weight = pack_weight(torch.cat([m.weight.detach() for m in qkv]))  # [(Hq + 2 Hkv) D, H]
        self.qkv_bias = _cat_bias([m.weight for m in qkv], [m.bias for m in qkv])
        self.gate_up_weight = pack_weight(torch.cat([m.weight.detach() for m in gate_up]))  # [2 I, H]
        self.gate_up_bias = _cat_bias([m.weight for m in gate_up], [m.bias for m in gate_up])
        self.o_proj, self.down_proj = attn.o_proj, mlp.down_proj  # PackedLinear
        self.silu_mul = silu_mul

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        return packed_matmul(x, self.qkv_weight, self.qkv_bias)

    def attention_out(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return packed_matmul(x, self.o_proj.packed_weight, self.o_proj.bias).add_(residual)

    def mlp_in(self, x: torch.Tensor) -> torch.Tensor:
        return self.silu_mul(packed_matmul(x, self.gate_up_weight, self.gate_up_bias))

    def mlp_out(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return packed_matmul(x, self.down_proj.packed_weight, self.down_proj.bias).add_(residual)


class _RowProjections:
    """The same four ops through a C kernel on the model's bf16 weights, SiLU-and-multiply and the
    residual sums in the ops' epilogues: heads/target/cpu_gemv.py's row kernel (AVX512-BF16, a
    few rows) or heads/target/cpu_gemm.py's packed kernel (AVX2 and FMA, any number of rows)."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, linear):
        qkv, gate_up = [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]
        self.qkv = linear([m.weight for m in qkv], _cat_bias([m.weight for m in qkv], [m.bias for m in qkv]))
        self.attention_out = linear([attn.o_proj.weight], attn.o_proj.bias, "residual")
        self.mlp_in = linear([m.weight for m in gate_up],
                             _cat_bias([m.weight for m in gate_up], [m.bias for m in gate_up]), "glu")
        self.mlp_out = linear([mlp.down_proj.weight], mlp.down_proj.bias, "residual")

    @staticmethod
    def kernel(model: nn.Module, layers: list[nn.Module]) -> str | None:
        """Which kernel takes this model's linear layers (ROW_KERNELS), or None: bf16 on a CPU
        where one is built (AVX512-BF16 first), row-major weights, bf16 biases (or none)."""
        linears = [model.lm_head] + [m for layer in layers for m in layer_linears(layer)]
        if not all(m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu" and m.weight.is_contiguous()
                   and (m.bias is None or m.bias.dtype == torch.bfloat16) for m in linears):
            return None
        return next((name for name, (module, _, _) in ROW_KERNELS.items() if module.available()), None)


@dataclass
class _Layer:
    attention: nn.Module  # the model's own attention module (the attention function's `module`)
    input_norm: torch.Tensor  # [H] RMSNorm weights
    post_norm: torch.Tensor
    packed: _PackedProjections | None  # None where the row kernel takes every forward
    rows: _RowProjections | None  # None where no kernel takes the model
    q_norm: torch.Tensor | None = None  # [D] Qwen3's per-head RMSNorm weights of q and k, applied before RoPE
    k_norm: torch.Tensor | None = None
    # the layer around its attention in two C calls (heads/target/cpu_gemm.py), where its kernel runs
    halves: cpu_gemm_layer.PackedBf16Layer | None = None


def architecture_reason(model: nn.Module) -> str | None:
    """Why a fused Llama-family forward (this module's, or heads/target/gpu_decoder.py's) cannot compute
    what `model` computes, or None when it can: the architecture, its MLP activation and its
    attention layers (every one full attention)."""
    return config_reason(model.config, type(model).__name__)


def config_reason(config, architecture: str | None = None) -> str | None:
    """`architecture_reason` from a model's config alone (before its weights load); architecture:
    the model class's name (default: the config's first `architectures` entry)."""
    name = architecture or next(iter(getattr(config, "architectures", None) or []), type(config).__name__)
    if name not in SUPPORTED_ARCHITECTURES:
        return f"{name} is not one of {', '.join(SUPPORTED_ARCHITECTURES)}"
    if getattr(config, "hidden_act", None) != "silu":
        return f"its MLP activation is {getattr(config, 'hidden_act', None)!r}, not 'silu'"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
        return "some layers use sliding-window attention"
    if name == "MistralForCausalLM" and getattr(config, "sliding_window", None) is not None:
        return "it uses sliding-window attention"
    return None


def auto_dtype(device: str | torch.device, config=None) -> torch.dtype:
    """The fast dtype of `device` (module docstring): bf16 on CUDA and on CPUs with native bf16.
    On another CPU, fp32, except for a model loaded for inference (config: its config) whose
    linear layers heads/target/cpu_gemm.py's kernel runs (a C compiler, AVX2 and FMA, an
    architecture this module fuses): bf16 weights, computed in fp32, half the
    bytes a token reads."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16
    if device.type != "cpu":
        return torch.float32
    if cpu_layout.cpu_has_native_bf16():
        return torch.bfloat16
    if config is not None and torch.backends.mkldnn.is_available():
        if config_reason(config) is None and cpu_gemm.available():
            return torch.bfloat16
    return torch.float32


def layer_linears(layer: nn.Module) -> list[nn.Module]:
    """One decoder layer's linear layers: q, k, v, o, gate, up, down."""
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]


def unsupported_reason(model: nn.Module, packed: PackedWeights | None) -> str | None:
    """Why `FusedDecoder` cannot run `model` (module docstring), or None when it can."""
    if type(model).__name__ not in SUPPORTED_ARCHITECTURES:
        return architecture_reason(model)
    if packed is None:
        return "its linear layers are not packed"
    reason = architecture_reason(model)
    if reason is not None:
        return reason
    layers = model.model.layers[: model.config.num_hidden_layers]
    for index, layer in enumerate(layers):
        if not all(isinstance(m, PackedLinear) or type(m) is nn.Linear for m in layer_linears(layer)):
            return f"layer {index} has a linear layer that is PEFT-wrapped or quantized"
    unpacked = any(type(m) is nn.Linear for layer in layers for m in layer_linears(layer))
    kernel = _RowProjections.kernel(model, layers)
    if unpacked and (kernel is None or ROW_KERNELS[kernel][2] is not None):
        return (f"oneDNN cannot lay out its {str(model.lm_head.weight.dtype).removeprefix('torch.')} weights on this CPU "
                "and no C kernel here takes every forward")
    return None


def forward_inputs(config, rotary_emb: nn.Module, hidden_BTH: torch.Tensor, attention_mask, position_ids, cache,
                   use_cache: bool):
    """What a fused forward (this one, heads/target/gpu_decoder.py's) takes from transformers, as
    the model's own forward does: -> (cache, mask, cos_1TD, sin_1TD, attention function). A new
    DynamicCache when use_cache and none is given; positions after the cache's length when none
    are given; the causal mask of the model's config; the rotary embedding; the attention
    function the config names."""
    from transformers.cache_utils import DynamicCache
    from transformers.masking_utils import create_causal_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if use_cache and cache is None:
        cache = DynamicCache(config=config)
    if position_ids is None:
        past = cache.get_seq_length() if cache is not None else 0
        position_ids = (torch.arange(hidden_BTH.shape[1], device=hidden_BTH.device) + past)[None]
    mask = create_causal_mask(config=config, inputs_embeds=hidden_BTH, attention_mask=attention_mask, cache=cache,
                              position_ids=position_ids)
    cos, sin = rotary_emb(hidden_BTH, position_ids=position_ids)
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, None)
    if attend is None:
        raise ValueError(f"attention implementation {config._attn_implementation!r} is not registered")
    return cache, mask, cos, sin, attend


class FusedDecoder:
    """See the module docstring. Build with `FusedDecoder.build(model, packed)`."""

    layer_halves = True  # with cpu_gemm's kernel, each layer in two C calls (False: op by op; tests)

    def __init__(self, model: nn.Module, packed: PackedWeights):
        config = model.config
        self.model = model
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.eps = config.rms_norm_eps
        attention = model.model.layers[0].self_attn
        self.head_dim = attention.head_dim
        self.num_q_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = attention.scaling
        self.intermediate_size = config.intermediate_size
        weight = model.lm_head.weight
        self.kernels = _Kernels.find(weight.dtype, weight.device)
        decoder_layers = model.model.layers[: self.num_layers]
        # The C kernel that runs bf16 linear layers here (ROW_KERNELS), and up to how many rows
        # (more go to oneDNN's packed GEMMs); None: oneDNN for every forward.
        self.row_kernel = _RowProjections.kernel(model, decoder_layers)
        if self.row_kernel is None and weight.dtype == torch.bfloat16:
            cpu_kernels.say_once("specheads: no bf16 kernel runs on this CPU (it needs AVX512-BF16, or AVX2 and FMA, "
                                 "and a C compiler): bf16 linear layers run through oneDNN")
        module, class_name, max_rows = ROW_KERNELS[self.row_kernel] if self.row_kernel else (None, None, 0)
        linear = getattr(module, class_name) if module is not None else None
        self.max_kernel_rows = max_rows
        self.layers = []
        fused = set()
        for layer in decoder_layers:
            attn, mlp = layer.self_attn, layer.mlp
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            self.layers.append(_Layer(attn, layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                                      None if max_rows is None else _PackedProjections(attn, mlp, self._silu_mul),
                                      _RowProjections(attn, mlp, linear) if linear is not None else None,
                                      q_norm.weight if q_norm is not None else None,
                                      k_norm.weight if k_norm is not None else None))
            fused.update(id(m) for m in [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj])
            if max_rows is None:  # the kernel takes every forward: o and down need no oneDNN copy either
                fused.update(id(m) for m in [attn.o_proj, mlp.down_proj])
        if self.layer_halves and self.row_kernel == "avx2" and self.kernels is not None:  # one C call each
            for layer in self.layers:
                rows = layer.rows
                layer.halves = cpu_gemm_layer.PackedBf16Layer(
                    rows.qkv, rows.attention_out, rows.mlp_in, rows.mlp_out, layer.input_norm, layer.post_norm,
                    layer.q_norm, layer.k_norm, self.num_q_heads, self.num_kv_heads, self.head_dim, self.eps)
        self.lm_head = model.lm_head
        self.lm_head_rows = linear([weight], model.lm_head.bias) if linear is not None else None
        if max_rows is None:
            fused.add(id(model.lm_head))
        # The separate packed copies of the fused layers go: the model's own forward (the
        # adapter's fallback, and `plain()`) runs those layers unpacked.
        packed.unpack(lambda module: id(module) in fused)
        self.lm_head = model.lm_head  # the plain layer again, where it was packed
        self.num_fused = len(fused)  # linear layers held fused
        self.norm = model.model.norm.weight
        self.embed_tokens = model.model.embed_tokens
        self.rotary_emb = model.model.rotary_emb

    @classmethod
    def build(cls, model: nn.Module, packed: PackedWeights | None) -> "FusedDecoder | None":
        """A fused forward for `model`, or None where `unsupported_reason` names one."""
        if unsupported_reason(model, packed) is not None:
            return None
        return cls(model, packed)

    def hooked(self) -> bool:
        """Whether forward hooks are registered on the model itself: then the adapter runs the
        model's own forward, so that the hooks see every call (hooks on submodules are not
        looked for: that would cost a walk over every module per call)."""
        return bool(self.model._forward_hooks or self.model._forward_pre_hooks)

    # --- the ops: one C call each where the kernels are built, transformers' torch ops otherwise ---

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        kernel = None if self.kernels is None else self.kernels.rms_norm
        if kernel is None or not x.is_contiguous() or weight.dtype != x.dtype:
            variance = x.float().pow(2).mean(-1, keepdim=True)  # transformers' LlamaRMSNorm
            return weight * (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype)
        out = torch.empty_like(x)
        kernel(x.data_ptr(), weight.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], self.eps, out.data_ptr())
        return out

    def _head_norms(self, qkv: torch.Tensor, layer: _Layer) -> None:
        """Qwen3's q_norm and k_norm, in place on the q and k parts of qkv [B, T, (Hq + 2 Hkv) D]."""
        kernel = None if self.kernels is None else self.kernels.head_rms_norm
        batch, num_new, _ = qkv.shape
        q_size = self.num_q_heads * self.head_dim
        parts = [(0, self.num_q_heads, layer.q_norm), (q_size, self.num_kv_heads, layer.k_norm)]
        for start, heads, weight in parts:
            if kernel is None or not qkv.is_contiguous() or weight.dtype != qkv.dtype:
                part = qkv[..., start:start + heads * self.head_dim].view(batch, num_new, heads, self.head_dim)
                part.copy_(self._rms_norm(part, weight))
                continue
            kernel(qkv[..., start:].data_ptr(), weight.data_ptr(), batch * num_new, qkv.shape[-1], heads,
                   self.head_dim, self.eps)

    def _rope(self, qkv: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor):
        """RoPE on the q and k parts of qkv [B, T, (Hq + 2 Hkv) D] -> (q, k) [B, heads, T, D]."""
        batch, num_new, _ = qkv.shape
        q_size, kv_size = self.num_q_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q_BTHD = qkv[..., :q_size].view(batch, num_new, self.num_q_heads, self.head_dim)
        k_BTHD = qkv[..., q_size:q_size + kv_size].view(batch, num_new, self.num_kv_heads, self.head_dim)
        kernel = None if self.kernels is None else self.kernels.rope
        if kernel is None or not qkv.is_contiguous() or cos_BTD.dtype != qkv.dtype or cos_BTD.stride(-1) != 1 \
                or cos_BTD.shape[-1] != self.head_dim or sin_BTD.stride() != cos_BTD.stride():
            from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

            return apply_rotary_pos_emb(q_BTHD.transpose(1, 2), k_BTHD.transpose(1, 2), cos_BTD, sin_BTD)
        kernel(q_BTHD.data_ptr(), k_BTHD.data_ptr(), qkv.stride(0), qkv.stride(1), self.num_q_heads,
               self.num_kv_heads, cos_BTD.data_ptr(), sin_BTD.data_ptr(), cos_BTD.stride(0), cos_BTD.stride(1),
               batch, num_new, self.head_dim)
        return q_BTHD.transpose(1, 2), k_BTHD.transpose(1, 2)

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        kernel = None if self.kernels is None else self.kernels.silu_mul
        if kernel is None or not gate_up.is_contiguous():
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            return nn.functional.silu(gate) * up
        out = gate_up.new_empty(*gate_up.shape[:-1], self.intermediate_size)
        kernel(gate_up.data_ptr(), out.numel() // self.intermediate_size, self.intermediate_size, out.data_ptr())
        return out

    # --- the forward --------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, tap_layers: list[int], *, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values=None, use_cache: bool = False,
                logits_to_keep: int | torch.Tensor = 0, **attention_kwargs):
        """TargetAdapter.forward's contract -> (logits, taps, cache)."""
        from transformers.modeling_utils import slice_logits_to_keep

        batch, num_new = input_ids.shape
        hidden = self.embed_tokens(input_ids)
        cache, mask, cos_BTD, sin_BTD, attend = forward_inputs(self.config, self.rotary_emb, hidden, attention_mask,
                                                               position_ids, past_key_values, use_cache)
        cos_BTD, sin_BTD = cos_BTD.expand(batch, -1, -1), sin_BTD.expand(batch, -1, -1)
        wanted = set(tap_layers)
        taps = {0: hidden} if 0 in wanted else {}
        q_size = self.num_q_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        limit = self.max_kernel_rows
        few_rows = limit is None or batch * num_new <= limit
        halves = self.layers[0].halves is not None and cos_BTD.dtype == torch.bfloat16 \
            and cos_BTD.stride(-1) == 1 and sin_BTD.stride() == cos_BTD.stride()
        scratch = self.layers[0].halves.scratch(batch * num_new) if halves else None
        # a cache that lets the forward write its keys and values (serving's TreeStaticCache): one
        # C call a layer instead of its `update`
        direct = getattr(cache, "direct_writes", None) if cpu_attention.available() else None
        writes = direct(num_new) if direct is not None else None
        write = cpu_attention.RowWriter(writes.rows, writes.starts) if writes is not None else None
        # the config's attention is the grouped CPU one and the layer halves run: each layer's
        # attention reads q from its q/k/v rows and the keys where the cache holds them, one C call
        # (where grouped_attention_forward would take the kernel path: a [B, 1, T, K] bool mask, or
        # none for one token)
        direct_attention = None
        if halves and writes is not None and attend is cpu_layout.grouped_attention_forward and not attention_kwargs \
                and (mask is None and num_new == 1 or mask is not None and mask.dtype is torch.bool
                     and mask.dim() == 4 and mask.shape[1] == 1):
            direct_attention = cpu_attention.AttentionCall.over_qkv(
                self.num_q_heads, num_new, self.layers[0].halves.qkv_width, writes.rows[0, 0], writes.rows[0, 1], mask,
                self.scaling)
        for index, layer in enumerate(self.layers):
            linears = layer.rows if few_rows and layer.rows is not None else layer.packed
            if halves:
                qkv = layer.halves.attention_in(hidden.contiguous(), cos_BTD, sin_BTD, scratch)
            else:
                qkv = linears.qkv(self._rms_norm(hidden, layer.input_norm))
                if layer.q_norm is not None:
                    self._head_norms(qkv, layer)
            if direct_attention is not None:  # q, k and v read where they are: no views, no wrappers
                write.from_qkv(index, qkv, q_size, q_size + kv_size)
                out_BTHD = direct_attention(qkv.data_ptr(), write.keys[index], write.values[index])
            else:
                if halves:  # q and k rotated in qkv
                    q_BHTD = qkv[..., :q_size].view(batch, num_new, self.num_q_heads, self.head_dim).transpose(1, 2)
                    k_BHTD = qkv[..., q_size:q_size + kv_size].view(batch, num_new, self.num_kv_heads,
                                                                    self.head_dim).transpose(1, 2)
                else:
                    q_BHTD, k_BHTD = self._rope(qkv, cos_BTD, sin_BTD)
                v_BHTD = qkv[..., q_size + kv_size:].view(batch, num_new, self.num_kv_heads,
                                                          self.head_dim).transpose(1, 2)
                if writes is not None:
                    write(index, k_BHTD, v_BHTD)
                    k_BHTD, v_BHTD = writes.rows[index].unbind(0)
                elif cache is not None:
                    k_BHTD, v_BHTD = cache.update(k_BHTD, v_BHTD, index)
                out_BTHD, _ = attend(layer.attention, q_BHTD, k_BHTD, v_BHTD, mask, dropout=0.0, scaling=self.scaling,
                                     **attention_kwargs)
            if halves:
                hidden = layer.halves.attention_out(out_BTHD.reshape(batch, num_new, q_size).contiguous(), hidden,
                                                    scratch)
            else:
                hidden = linears.attention_out(out_BTHD.reshape(batch, num_new, q_size), hidden)
                hidden = linears.mlp_out(linears.mlp_in(self._rms_norm(hidden, layer.post_norm)), hidden)
            if index + 1 in wanted and index + 1 < self.num_layers:
                taps[index + 1] = hidden
        hidden = self._rms_norm(hidden, self.norm)
        taps[self.num_layers] = hidden
        kept = slice_logits_to_keep(hidden, logits_to_keep)
        rows_head = self.lm_head_rows is not None and (limit is None or kept.shape[0] * kept.shape[1] <= limit)
        logits = self.lm_head_rows(kept) if rows_head else self.lm_head(kept)
        return logits, [taps[t] for t in tap_layers], cache
