"""A Llama-family target's forward for GPUs: fused projections and compiled elementwise work.

On a GPU a decode step is a weight read: Llama-3.1-8B in bf16 reads about 15 GB, 3.1 ms at an
H200's 4.8 TB/s. transformers' forward spends that step in some 1,500 kernels: q, k, v and
gate, up as separate GEMMs of one row each, and about 700 small kernels for RMSNorm, RoPE,
SiLU, residual adds and dtype copies. `GpuDecoder` runs the same computation with fewer,
larger kernels, in pure torch ops:

- q, k and v are one weight [(Hq + 2 Hkv) D, H] and one GEMM, and so are gate and up
  [2 I, H]. The model's own q_proj/k_proj/v_proj (gate_proj/up_proj) weights become views
  into the fused tensor, so memory holds one copy and the model's own forward still runs.
- Between two attention calls everything is one pure function of tensors (`layer_boundary`:
  o_proj, residual, RMSNorm, gate_up, SiLU-and-multiply, down, residual, the next layer's
  RMSNorm, its qkv GEMM, its q/k norms and RoPE). In the compiling modes, `torch.compile`
  (inductor, `fullgraph=True`, no graph breaks) compiles each function once per dtype and
  model shape and every layer calls the same compiled code with its own weights: the norms,
  RoPE, SiLU and residual adds become a few fused Triton kernels around the GEMMs, and
  what compiles is one layer's worth of graph whatever the model's depth. The token count is a
  dynamic dimension (`maybe_mark_dynamic`; one token gets its own static graph), so the
  engine's tree-size buckets and batch sizes reuse two compiled graphs per function.

What it keeps from transformers, as heads/target/cpu_decoder.py does, so that it computes what the
model computes: the mask (`create_causal_mask`), the rotary embedding module, the cache's
`update` (any `Cache`; the engine's static-shape TreeStaticCache included) and the attention
function the config names (`ALL_ATTENTION_FUNCTIONS`: SDPA, or the tree attention with the
caller's `tree_mask` / `prefix_len` / `max_prefix_len` passed through unchanged). Those run
between the compiled functions; inside a CUDA graph that the engine captures
(serving/decode/graphs.py) their Python costs nothing on replay, and the captured graph holds
the compiled kernels.

Numerics: fp32 outputs equal the model's own forward up to summation order (within 1e-5
relative). In bf16 inductor is told to round where the eager ops round
(`emulate_precision_casts`); the fused GEMMs may still sum in another order than three
separate ones, so bf16 outputs differ from the model's by bf16 rounding.

Which models: those heads/target/cpu_decoder.architecture_reason accepts (Llama, Mistral without a
sliding window, Qwen2 with its qkv biases, Qwen3 with its q/k norms), every projection a plain
`nn.Linear` with its weight on one device (not PEFT-wrapped, quantized or ZeRO-partitioned).
Anything else gets None from `build` with the reason, and the adapter runs the model's own
forward. Saving the model after building (`save_pretrained`) meets weights that share
memory: build the decoder for inference only.

Shape legend: B batch, T new tokens, N = B * T, H hidden, D head dim, Hq / Hkv query / KV
heads, Q = Hq * D, I intermediate, V vocab.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from specheads.heads.target.cpu_decoder import architecture_reason, forward_inputs, layer_linears

log = logging.getLogger("specheads.gpu_decoder")
MODES = ("compile", "max-autotune", "eager")  # how GpuDecoder runs its pure functions (`GpuDecoder.mode`)
# torch.compile modes: the engine captures its own CUDA graphs, so inductor must not.
COMPILE_MODES = {"compile": "default", "max-autotune": "max-autotune-no-cudagraphs"}
# Compiled graphs one function may hold: two per model shape and dtype (one token, and a
# dynamic token count); dynamo's default of 8 would silently fall back to eager past that.
RECOMPILE_LIMIT = 64


# --- the pure functions: weights in, tensors out; every layer calls the same ones -------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: weight * (x * rsqrt(mean(x^2) + eps)) rounded to x's dtype first."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate(x_NhD: torch.Tensor, cos_ND: torch.Tensor, sin_ND: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on one of q, k: x * cos + rotate_half(x) * sin."""
    half = x_NhD.shape[-1] // 2
    rotated = torch.cat([-x_NhD[..., half:], x_NhD[..., :half]], dim=-1)
    return x_NhD * cos_ND[:, None] + rotated * sin_ND[:, None]


def attention_inputs(hidden_NH: torch.Tensor, head: tuple, cos_ND: torch.Tensor, sin_ND: torch.Tensor,
                     dims: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's input norm, qkv GEMM, q/k norms and RoPE -> q [N, Hq, D], k, v [N, Hkv, D].
    head: (input norm [H], qkv [(Hq + 2 Hkv) D, H], qkv bias or None, q norm [D] or None,
    k norm or None); dims: (Hq, Hkv, D, eps)."""
    input_norm, qkv_weight, qkv_bias, q_norm, k_norm = head
    num_q_heads, num_kv_heads, head_dim, eps = dims
    num_tokens = hidden_NH.shape[0]
    qkv = nn.functional.linear(rms_norm(hidden_NH, input_norm, eps), qkv_weight, qkv_bias)
    q_NhD, k_NhD, v_NhD = qkv.view(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim).split(
        [num_q_heads, num_kv_heads, num_kv_heads], dim=1)
    if q_norm is not None:  # Qwen3: RMSNorm over each head before RoPE
        q_NhD, k_NhD = rms_norm(q_NhD, q_norm, eps), rms_norm(k_NhD, k_norm, eps)
    return rotate(q_NhD, cos_ND, sin_ND), rotate(k_NhD, cos_ND, sin_ND), v_NhD


def layer_output(attn_NQ: torch.Tensor, hidden_NH: torch.Tensor, tail: tuple, eps: float) -> torch.Tensor:
    """One layer after its attention: o_proj and residual, post norm, gate_up, SiLU x up, down
    and residual -> the layer's output [N, H]. tail: (o [H, Q], o bias, post norm [H],
    gate_up [2 I, H], gate_up bias, down [H, I], down bias); biases may be None."""
    o_weight, o_bias, post_norm, gate_up_weight, gate_up_bias, down_weight, down_bias = tail
    hidden_NH = hidden_NH + nn.functional.linear(attn_NQ, o_weight, o_bias)
    gate_up = nn.functional.linear(rms_norm(hidden_NH, post_norm, eps), gate_up_weight, gate_up_bias)
    gate, up = gate_up.chunk(2, dim=-1)
    return hidden_NH + nn.functional.linear(nn.functional.silu(gate) * up, down_weight, down_bias)


def layer_boundary(attn_NQ, hidden_NH, tail: tuple, next_head: tuple, cos_ND, sin_ND, dims: tuple):
    """Everything between layer i's attention and layer i + 1's: -> (layer i's output [N, H],
    layer i + 1's q, k, v). One function, so the residual add and the next RMSNorm fuse."""
    hidden_NH = layer_output(attn_NQ, hidden_NH, tail, dims[-1])
    return (hidden_NH, *attention_inputs(hidden_NH, next_head, cos_ND, sin_ND, dims))


def last_layer(attn_NQ, hidden_NH, tail: tuple, final_norm: torch.Tensor, eps: float):
    """The last layer after its attention, and the final norm -> (its output, the normed state)."""
    hidden_NH = layer_output(attn_NQ, hidden_NH, tail, eps)
    return hidden_NH, rms_norm(hidden_NH, final_norm, eps)


FUNCTIONS = {"attention_inputs": attention_inputs, "layer_boundary": layer_boundary, "last_layer": last_layer}


def allow_recompiles(limit: int = RECOMPILE_LIMIT) -> None:
    """Let dynamo keep `limit` graphs per function (never lowers the setting)."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):  # the same setting under its old name
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), limit))


@functools.cache
def compiled_functions(mode: str) -> dict:
    """FUNCTIONS compiled for `mode` (COMPILE_MODES), shared by every GpuDecoder in the process
    (dynamo keys its graphs on the inputs' shapes and dtypes, not on which model they come from)."""
    from torch._inductor import list_mode_options

    allow_recompiles()

    # The mode's settings, and rounding where the eager ops round (bf16 stays near the model's own).
    options = {**list_mode_options(COMPILE_MODES[mode]), "emulate_precision_casts": True}
    return {name: torch.compile(function, fullgraph=True, dynamic=False, options=options)
            for name, function in FUNCTIONS.items()}


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far (its own counter)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


# --- the decoder --------------------------------------------------------------------------------

@dataclass
class _Layer:
    attention: nn.Module  # the model's own attention module (the attention function's `module`)
    head: tuple  # attention_inputs' weights
    tail: tuple  # layer_output's weights


def _joined(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor `parts` are consecutive row blocks of (a decoder built earlier on the same
    model fused them), as one view; None if they are not."""
    first, offset = parts[0], parts[0].storage_offset()
    for part in parts:
        if not part.is_contiguous() or part.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() \
                or part.storage_offset() != offset:
            return None
        offset += part.numel()
    rows = sum(part.shape[0] for part in parts)
    return first.detach().new_empty(0).set_(first.untyped_storage(), first.storage_offset(),
                                            (rows, *first.shape[1:]), first.stride())


def _fuse_tensors(modules: list[nn.Linear], name: str) -> torch.Tensor:
    """The modules' `name` tensors (weight or bias) as one, each module's own becoming a view
    into it: one copy in memory, the model's own forward unchanged."""
    parts = [getattr(m, name).detach() for m in modules]
    fused = _joined(parts)
    if fused is None:
        fused = torch.cat(parts)
        for module, part in zip(modules, fused.split([p.shape[0] for p in parts])):
            setattr(module, name, nn.Parameter(part, requires_grad=False))
    return fused


def _fuse(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight [sum of out features, in features] (and bias) for several linear layers of one
    input, held once (`_fuse_tensors`)."""
    weight = _fuse_tensors(linears, "weight")
    if all(m.bias is None for m in linears):
        return weight, None
    if all(m.bias is not None for m in linears):
        return weight, _fuse_tensors(linears, "bias")
    return weight, torch.cat([m.bias.detach() if m.bias is not None else weight.new_zeros(m.out_features)
                              for m in linears])


def unsupported_reason(model: nn.Module) -> str | None:
    """Why `GpuDecoder` cannot run `model` (module docstring), or None when it can."""
    reason = architecture_reason(model)
    if reason is not None:
        return reason
    devices = {param.device for param in model.parameters()}
    if len(devices) != 1:
        return f"its parameters are on several devices ({sorted(map(str, devices))})"
    for index, layer in enumerate(model.model.layers[: model.config.num_hidden_layers]):
        for module in layer_linears(layer):
            if type(module) is not nn.Linear:
                return f"layer {index} has a {type(module).__name__}, not a plain nn.Linear (PEFT-wrapped or quantized)"
            if hasattr(module.weight, "ds_id") or module.weight.numel() == 0:
                return f"layer {index}'s weights are partitioned (DeepSpeed ZeRO-3)"
    return None


class GpuDecoder:
    """See the module docstring. Build with `GpuDecoder.build(model, mode)`; mode is one of
    MODES: "compile" (torch.compile, inductor's defaults: cuBLAS GEMMs), "max-autotune"
    (inductor also tries its Triton GEMMs for each shape: slower to compile) or "eager" (the
    same fused forward, uncompiled)."""

    def __init__(self, model: nn.Module, mode: str):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        config = model.config
        self.model, self.config, self.mode = model, config, mode
        self.num_layers = config.num_hidden_layers
        attention = model.model.layers[0].self_attn
        self.scaling = attention.scaling
        self.dims = (config.num_attention_heads, config.num_key_value_heads, attention.head_dim, config.rms_norm_eps)
        self.layers = []
        for layer in model.model.layers[: self.num_layers]:
            attn, mlp = layer.self_attn, layer.mlp
            qkv_weight, qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
            gate_up_weight, gate_up_bias = _fuse([mlp.gate_proj, mlp.up_proj])
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            head = (layer.input_layernorm.weight, qkv_weight, qkv_bias, None if q_norm is None else q_norm.weight,
                    None if k_norm is None else k_norm.weight)
            tail = (attn.o_proj.weight, attn.o_proj.bias, layer.post_attention_layernorm.weight, gate_up_weight,
                    gate_up_bias, mlp.down_proj.weight, mlp.down_proj.bias)
            self.layers.append(_Layer(attn, head, tail))
        self.norm = model.model.norm.weight
        self.embed_tokens, self.rotary_emb = model.model.embed_tokens, model.model.rotary_emb
        self.lm_head = model.lm_head
        self.functions = FUNCTIONS if mode == "eager" else compiled_functions(mode)
        self.active = True  # False: the adapter runs the model's own forward (TargetAdapter.plain_weights)
        self.compile_seconds = 0.0  # wall time of the forwards that compiled a graph (their compile time)
        self.compiles: list[dict] = []  # one entry per such forward: tokens, graphs compiled, seconds

    @classmethod
    def build(cls, model: nn.Module, mode: str = "compile") -> "GpuDecoder | None":
        """A fused forward for `model`, or None where `unsupported_reason` names one."""
        if unsupported_reason(model) is not None:
            return None
        return cls(model, mode)

    def hooked(self) -> bool:
        """Whether forward hooks are registered on the model itself (then the adapter runs the
        model's own forward, so that the hooks see every call)."""
        return bool(self.model._forward_hooks or self.model._forward_pre_hooks)

    def check_weights(self) -> None:
        """Fail clearly if the model's weights moved after the build (model.to(...) makes new
        tensors: the fused ones would be stale)."""
        attention = self.layers[0].attention
        qkv = self.layers[0].head[1]
        if attention.q_proj.weight.data_ptr() != qkv.data_ptr() or attention.q_proj.weight.dtype != qkv.dtype:
            raise RuntimeError("the target's weights changed after its GPU decoder was built (model.to(...)?); "
                               "build the TargetAdapter after moving the model to its device and dtype")

    def forward(self, input_ids: torch.Tensor, tap_layers: list[int], *, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values=None, use_cache: bool = False,
                logits_to_keep: int | torch.Tensor = 0, **attention_kwargs):
        """TargetAdapter.forward's contract -> (logits, taps, cache)."""
        if self.mode == "eager":
            return self._forward(input_ids, tap_layers, attention_mask, position_ids, past_key_values, use_cache,
                                 logits_to_keep, attention_kwargs)
        before, begin = graphs_compiled(), time.perf_counter()
        out = self._forward(input_ids, tap_layers, attention_mask, position_ids, past_key_values, use_cache,
                            logits_to_keep, attention_kwargs)
        if graphs_compiled() != before:  # rare: host work only then (a CUDA graph replay never gets here)
            seconds = time.perf_counter() - begin
            self.compile_seconds += seconds
            self.compiles.append(dict(tokens=int(input_ids.numel()), graphs=graphs_compiled() - before,
                                      seconds=seconds))
            log.info("compiled the forward for %d tokens (%d graphs) in %.1f s", input_ids.numel(),
                     self.compiles[-1]["graphs"], seconds)
        return out

    def _forward(self, input_ids, tap_layers, attention_mask, position_ids, cache, use_cache, logits_to_keep,
                 attention_kwargs):
        from transformers.modeling_utils import slice_logits_to_keep

        self.check_weights()
        batch, num_new = input_ids.shape
        num_tokens, (num_q_heads, num_kv_heads, head_dim, eps) = batch * num_new, self.dims
        hidden_BTH = self.embed_tokens(input_ids)
        cache, mask, cos_BTD, sin_BTD, attend = forward_inputs(self.config, self.rotary_emb, hidden_BTH,
                                                               attention_mask, position_ids, cache, use_cache)
        # Contiguous: an expanded row (stride 0) would be another graph's input layout.
        cos_ND = cos_BTD.expand(batch, -1, -1).reshape(num_tokens, head_dim).contiguous()
        sin_ND = sin_BTD.expand(batch, -1, -1).reshape(num_tokens, head_dim).contiguous()
        hidden_NH = hidden_BTH.reshape(num_tokens, -1)
        mark_dynamic = self.mode != "eager" and num_tokens > 1  # one graph for every token count > 1
        if mark_dynamic:  # (one token gets its own, static)
            for tensor in (hidden_NH, cos_ND, sin_ND):
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
        functions, wanted = self.functions, set(tap_layers)
        taps = {0: hidden_BTH} if 0 in wanted else {}
        q_NhD, k_NhD, v_NhD = functions["attention_inputs"](hidden_NH, self.layers[0].head, cos_ND, sin_ND, self.dims)
        for index, layer in enumerate(self.layers):
            q_BHTD = q_NhD.view(batch, num_new, num_q_heads, head_dim).transpose(1, 2)
            k_BHTD = k_NhD.view(batch, num_new, num_kv_heads, head_dim).transpose(1, 2)
            v_BHTD = v_NhD.view(batch, num_new, num_kv_heads, head_dim).transpose(1, 2)
            if cache is not None:
                k_BHTD, v_BHTD = cache.update(k_BHTD, v_BHTD, index)
            out_BTHD, _ = attend(layer.attention, q_BHTD, k_BHTD, v_BHTD, mask, dropout=0.0, scaling=self.scaling,
                                 **attention_kwargs)
            attn_NQ = out_BTHD.reshape(num_tokens, num_q_heads * head_dim)
            if mark_dynamic:
                torch._dynamo.maybe_mark_dynamic(attn_NQ, 0)
            if index + 1 < self.num_layers:
                hidden_NH, q_NhD, k_NhD, v_NhD = functions["layer_boundary"](
                    attn_NQ, hidden_NH, layer.tail, self.layers[index + 1].head, cos_ND, sin_ND, self.dims)
                if index + 1 in wanted:
                    taps[index + 1] = hidden_NH.view(batch, num_new, -1)
            else:
                hidden_NH, normed_NH = functions["last_layer"](attn_NQ, hidden_NH, layer.tail, self.norm, eps)
        taps[self.num_layers] = normed_BTH = normed_NH.view(batch, num_new, -1)
        logits = self.lm_head(slice_logits_to_keep(normed_BTH, logits_to_keep))
        return logits, [taps[t] for t in tap_layers], cache
