"""The frozen-target adapter: the only way any part of specheads reaches the target LM.

It loads a decoder-only Hugging Face causal LM (hub id or local path) through
`AutoModelForCausalLM`, freezes it, and runs one forward pass that returns the logits
plus the hidden states of chosen layers. Masks, positions and the KV cache are passed in
as arguments; nothing is stashed on the model.

Shape legend: B batch, T query tokens, S cached tokens, H hidden size, V vocab size.

Layer-id convention for taps: tap `i` is `hidden_states[i]` of transformers' output,
i.e. the *input* of decoder layer `i` (tap 0 is the token embeddings). Tap
`num_layers` is the final hidden state after the last norm, which is what the lm_head
consumes (transformers ties `hidden_states[-1]` to `last_hidden_state`).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
AUTO = "auto"  # the device's fast dtype (heads/target/cpu_decoder.auto_dtype)


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu", config=None) -> torch.dtype:
    """A dtype name (DTYPES, or "auto": the fast dtype of `device`) -> torch.dtype. config: the
    model's config when it loads for inference (heads/target/cpu_decoder.auto_dtype; see
    `inference_dtype`)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == AUTO:
        from specheads.heads.target.cpu_decoder import auto_dtype

        return auto_dtype(device, config)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be {AUTO!r} or one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def inference_dtype(name_or_path: str | os.PathLike, dtype: str | torch.dtype = AUTO,
                    device: str | torch.device = "cpu", trust_remote_code: bool = False) -> torch.dtype:
    """The dtype a target loaded for inference (`TargetAdapter.from_pretrained` with
    pack_weights) runs in: `resolve_dtype` with its config, read without its weights. Every
    cache of the target's outputs keys on this."""
    config = None
    if dtype == AUTO and torch.device(device).type == "cpu":
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(name_or_path), trust_remote_code=trust_remote_code)
    return resolve_dtype(dtype, device, config)


@dataclass(frozen=True)
class TargetIdentity:
    """What a heads directory records about the target it was trained on."""

    architecture: str  # e.g. "LlamaForCausalLM"
    model_type: str  # e.g. "llama"
    hidden_size: int
    vocab_size: int
    num_layers: int
    name_or_path: str

    @classmethod
    def from_config(cls, config, name_or_path: str = "", architecture: str | None = None) -> "TargetIdentity":
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        archs = getattr(config, "architectures", None) or [architecture or type(config).__name__]
        return cls(
            architecture=archs[0],
            model_type=config.model_type,
            hidden_size=text_config.hidden_size,
            vocab_size=text_config.vocab_size,
            num_layers=text_config.num_hidden_layers,
            name_or_path=str(name_or_path or getattr(config, "_name_or_path", "")),
        )


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [B, T, V]
    taps: list[torch.Tensor]  # each [B, T, H], in the order of the requested tap layers
    past_key_values: object | None = None


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def check_target_exists(name_or_path: str) -> None:
    """Fail early, with a clear message, for a local path that is not there.

    A string that looks like a hub id (`org/name`) and is not a local directory is left to
    `from_pretrained`, which resolves it from the hub cache or the hub.
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        if path.is_dir() and not (path / "config.json").exists():
            raise FileNotFoundError(
                f"target directory {str(path)!r} has no config.json; expected a directory written "
                "by save_pretrained (config.json + weights) or a hub id like 'org/model'")
        return
    if _looks_like_hub_id(name_or_path):
        return
    raise FileNotFoundError(
        f"target {name_or_path!r} does not exist: expected a local model directory with "
        "config.json (from save_pretrained) or a hub id like 'meta-llama/Llama-3.1-8B-Instruct'")


def load_target(name_or_path: str | os.PathLike, dtype: str | torch.dtype = "float32",
                device: str | torch.device = "cpu", trust_remote_code: bool = False,
                attn_implementation: str | None = "sdpa", inference: bool = False) -> nn.Module:
    """Load a causal LM, frozen and in eval mode (dtype "auto": the device's fast dtype, for
    inference when `inference`: `inference_dtype`)."""
    from transformers import AutoModelForCausalLM

    name_or_path = str(name_or_path)
    check_target_exists(name_or_path)
    resolved = inference_dtype(name_or_path, dtype, device, trust_remote_code) if inference \
        else resolve_dtype(dtype, device)
    kwargs = {"dtype": resolved, "trust_remote_code": trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    model.to(device)
    return freeze(model)


GPU_DECODER_ENV = "SPECHEADS_GPU_DECODER"
GPU_DECODER_MODES = ("compile", "max-autotune", "eager", "off")


def gpu_decoder_mode(gpu_decoder: str | None, pack_weights: bool | str, device: torch.device) -> str:
    """The GPU decoder's mode for a TargetAdapter (its docstring), "off" for none."""
    if gpu_decoder is None:
        if not pack_weights or device.type != "cuda":
            return "off"
        gpu_decoder, source = os.environ.get(GPU_DECODER_ENV, "compile"), GPU_DECODER_ENV
    else:
        source = "gpu_decoder"
    if gpu_decoder not in GPU_DECODER_MODES:
        raise ValueError(f"{source} must be one of {GPU_DECODER_MODES}, got {gpu_decoder!r}")
    return gpu_decoder


def freeze(model: nn.Module) -> nn.Module:
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return model


class TargetAdapter:
    """A frozen causal LM plus the few things heads need from it.

    pack_weights: lay the linear weights out for inference once, for the device at hand. On
    a CPU (heads/target/cpu_layout.py): "auto" packs where it pays (oneDNN, fp32 or bf16), True
    always (a CPU model; tests), False never (training: the packed op has no autograd). On a
    CUDA GPU, "auto" or True builds the GPU decoder (heads/target/gpu_decoder.py) in the mode
    `gpu_decoder` names.

    gpu_decoder: None (default) builds it where pack_weights asks for an inference layout and
    the model is on a CUDA device, in the mode the SPECHEADS_GPU_DECODER environment variable
    names (default "compile"; "off" runs the model's own forward); a mode ("compile",
    "max-autotune", "eager") builds it on any device (how the CPU tests run it), "off" never.
    """

    def __init__(self, model: nn.Module, name_or_path: str = "", pack_weights: bool | str = False,
                 gpu_decoder: str | None = None):
        self.model = model
        self.config = model.config
        self.text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.identity = TargetIdentity.from_config(model.config, name_or_path, type(model).__name__)
        self.packed = None  # heads/target/cpu_layout.PackedWeights once packed
        if pack_weights not in (False, True, AUTO):
            raise ValueError(f"pack_weights must be True, False or {AUTO!r}, got {pack_weights!r}")
        if pack_weights:
            from specheads.heads.target.cpu_layout import pack_linears, packing_pays

            if pack_weights is True or packing_pays(self.dtype, self.device):
                self.packed = pack_linears(model)
        self.fused = None  # heads/target/cpu_decoder.FusedDecoder where the packed model has one
        if self.packed is not None:
            from specheads.heads.target.cpu_decoder import FusedDecoder

            self.fused = FusedDecoder.build(model, self.packed)
        self.gpu = None  # heads/target/gpu_decoder.GpuDecoder where one is asked for and the model has one
        mode = gpu_decoder_mode(gpu_decoder, pack_weights, self.device)
        if mode != "off":
            if self.packed is not None:
                raise ValueError(f"gpu_decoder={gpu_decoder!r} needs an unpacked target; pass pack_weights=False")
            from specheads.heads.target.gpu_decoder import GpuDecoder

            self.gpu = GpuDecoder.build(model, mode)

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, pack_weights: bool | str = False,
                        gpu_decoder: str | None = None, **kwargs) -> "TargetAdapter":
        return cls(load_target(name_or_path, inference=bool(pack_weights), **kwargs), str(name_or_path),
                   pack_weights=pack_weights, gpu_decoder=gpu_decoder)

    @property
    def layout(self) -> str:
        """How the linear weights run: "packed" (oneDNN, heads/target/cpu_layout.py), "fused-<mode>"
        (the GPU decoder, heads/target/gpu_decoder.py) or "plain"."""
        if self.packed is not None:
            return "packed"
        return f"fused-{self.gpu.mode}" if self.gpu is not None else "plain"

    def plain_weights(self):
        """A context in which the model runs its own forward with its original `nn.Linear`s
        (as transformers loaded it): the baseline a user would run. A no-op when nothing is
        packed and no GPU decoder is built."""
        if self.packed is not None:
            return self.packed.plain()
        return self._gpu_off() if self.gpu is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def _gpu_off(self):
        self.gpu.active = False
        try:
            yield
        finally:
            self.gpu.active = True

    @property
    def num_layers(self) -> int:
        return self.identity.num_layers

    @property
    def hidden_size(self) -> int:
        return self.identity.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.identity.vocab_size

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def embeddings(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    def check_taps(self, tap_layers: list[int]) -> None:
        for tap in tap_layers:
            if not 0 <= tap <= self.num_layers:
                raise ValueError(f"tap layer {tap} is out of range: the target has {self.num_layers} "
                                 f"layers, so taps must be in [0, {self.num_layers}]")

    def forward(self, input_ids: torch.Tensor, tap_layers: list[int], *,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool = False,
                logits_to_keep: int | torch.Tensor = 0, **attention_kwargs) -> TargetOutput:
        """One target forward pass.

        input_ids [B, T]; attention_mask either 2-D [B, S+T] padding mask or a prepared 4-D
        mask [B, 1, T, S+T] (bool, True = attend); position_ids [B, T]. attention_kwargs are
        passed through to the model, which hands them to its attention function (e.g. the
        tree attention's tree_mask= / prefix_len=, see serving/kernels/tree_attention.py).
        """
        if self.fused is not None and self.packed.active and not self.fused.hooked():
            logits, taps, cache = self.fused.forward(
                input_ids, tap_layers, attention_mask=attention_mask, position_ids=position_ids,
                past_key_values=past_key_values, use_cache=use_cache, logits_to_keep=logits_to_keep,
                **attention_kwargs)
            return TargetOutput(logits=logits, taps=taps, past_key_values=cache)
        if self.gpu is not None and self.gpu.active and not self.gpu.hooked():
            logits, taps, cache = self.gpu.forward(
                input_ids, tap_layers, attention_mask=attention_mask, position_ids=position_ids,
                past_key_values=past_key_values, use_cache=use_cache, logits_to_keep=logits_to_keep,
                **attention_kwargs)
            return TargetOutput(logits=logits, taps=taps, past_key_values=cache)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            output_hidden_states=list(tap_layers) if tap_layers else False,
            logits_to_keep=logits_to_keep,
            return_dict=True,
            **attention_kwargs,
        )
        taps = [out.hidden_states[t] for t in tap_layers] if tap_layers else []
        return TargetOutput(logits=out.logits, taps=taps, past_key_values=out.past_key_values)

    __call__ = forward
