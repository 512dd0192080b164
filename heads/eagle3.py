"""EAGLE-3 draft head (and the EAGLE-1/2 variant): one decoder layer (or a few) over the
target's features and the next token's embedding.

A row of the head at position t reads the feature f_t and the embedding of token x_{t+1}
and predicts token x_{t+2}. Its output (pre-norm) hidden state is the feature the next
draft step reads at the same position, so the head can be unrolled: step j at position t
predicts x_{t+2+j} (the training-time test, training/losses.py; tree drafting,
serving/decode/eagle.py).

    kind "eagle3": f_t = fc([tap_low; tap_mid; tap_high])       fc.weight [H, 3H]
    kind "eagle":  f_t = the single tap (the final hidden state)  no fc (EAGLE-1/2)

The layer (EAGLE-3's "midlayer"): q/k/v read [input_layernorm(embed) ; hidden_norm(f)]
(2H wide), the residual stream is f, then post_attention_layernorm + SwiGLU MLP. A head of
num_layers > 1 adds plain pre-norm Llama layers after it (`layers.1`, `layers.2`, ...: q/k/v
read input_layernorm(h), H wide), as vLLM's multi-layer EAGLE-3 drafts do; the last layer's
output h is the head's output feature. Logits
are lm_head(norm(h)) over the draft vocab; draft id i is target id i + d2t[i], and t2d
marks the target ids that have a draft id. Parameter and buffer names are the EAGLE-3
checkpoint layout that vLLM and SGLang load, so export is near-identity. The token
embedding is the target's (frozen) and is passed in; it is not a parameter here.

The head is pure: no cache is kept on the module. Callers pass the keys/values of the
rows a query may attend to (`past_kv`, every layer's stacked on a leading axis) and a
boolean mask, and get the new rows' keys and values back, stacked the same way.

Shape legend: B batch, T query rows, S past key rows, H hidden, nH number of taps x H,
Hq query heads, Hkv key/value heads, D head dim, Vd draft vocab, J unrolled steps,
L decoder layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, rope_theta: float, input_size: int):
        super().__init__()
        if hidden_size % num_heads or num_heads % num_kv_heads:
            raise ValueError(f"hidden_size {hidden_size} must be divisible by num_attention_heads {num_heads}, "
                             f"which must be divisible by num_kv_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.q_proj = nn.Linear(input_size, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(input_size, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(input_size, num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)
        # Computed here, never loaded: a plain fp32 tensor, not a buffer, so no loader can leave
        # it uninitialised (see docs/architecture.md, "Pitfalls"), no dtype cast rounds it, and it is not part
        # of any state dict or checkpoint. It moves with the module (`_apply`), so forward() reads it
        # where the weights are: no copy per call.
        self.inv_freq = 1.0 / (rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))

    def _apply(self, fn, recurse=True):
        """Module.to / cuda / cpu / half ...: inv_freq follows the weights' device, in fp32."""
        module = super()._apply(fn, recurse)
        self.inv_freq = self.inv_freq.to(fn(torch.empty(0)).device)
        return module

    def forward(self, x_BTI, position_ids_BT, past_kv, mask_B1TS):
        batch, seq = x_BTI.shape[:2]
        q = self.q_proj(x_BTI).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x_BTI).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x_BTI).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        # RoPE on q and k [B, Hq|Hkv, T, D]: x * cos + rotate_half(x) * sin
        freqs_BTd = position_ids_BT.float()[..., None] * self.inv_freq  # [B, T, D/2]
        emb_B1TD = torch.cat([freqs_BTd, freqs_BTd], dim=-1)[:, None]
        cos, sin = emb_B1TD.cos().to(q.dtype), emb_B1TD.sin().to(q.dtype)
        half = self.head_dim // 2
        q, k = (x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin for x in (q, k))
        if past_kv is None:
            keys, values = k, v
        elif isinstance(past_kv, tuple):
            keys, values = torch.cat([past_kv[0], k], 2), torch.cat([past_kv[1], v], 2)
        else:  # a cache that stores this call's keys and values and returns what to attend to (serving's)
            keys, values = past_kv.update(k, v)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask_B1TS,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        out = out.transpose(1, 2).reshape(batch, seq, -1)
        return self.o_proj(out), (k, v)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """EAGLE-3's first layer: attention over [embedding ; feature], residual stream the feature."""

    def __init__(self, hidden_size, num_heads, num_kv_heads, intermediate_size, rope_theta, eps):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.hidden_norm = RMSNorm(hidden_size, eps)
        self.self_attn = Attention(hidden_size, num_heads, num_kv_heads, rope_theta, input_size=2 * hidden_size)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = MLP(hidden_size, intermediate_size)

    def forward(self, embeds_BTH, feature_BTH, position_ids_BT, past_kv, mask_B1TS):
        x_BT2H = torch.cat([self.input_layernorm(embeds_BTH), self.hidden_norm(feature_BTH)], dim=-1)
        attn, new_kv = self.self_attn(x_BT2H, position_ids_BT, past_kv, mask_B1TS)
        h = feature_BTH + attn  # attention added to the residual stream, then the SwiGLU MLP
        return h + self.mlp(self.post_attention_layernorm(h)), new_kv


class DecoderLayer(nn.Module):
    """A further layer of a multi-layer head: a plain pre-norm Llama layer over h."""

    def __init__(self, hidden_size, num_heads, num_kv_heads, intermediate_size, rope_theta, eps):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = Attention(hidden_size, num_heads, num_kv_heads, rope_theta, input_size=hidden_size)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = MLP(hidden_size, intermediate_size)

    def forward(self, h_BTH, position_ids_BT, past_kv, mask_B1TS):
        attn, new_kv = self.self_attn(self.input_layernorm(h_BTH), position_ids_BT, past_kv, mask_B1TS)
        h = h_BTH + attn  # as MidLayer's, over h alone
        return h + self.mlp(self.post_attention_layernorm(h)), new_kv


def next_token_embeddings(embeddings: nn.Module, input_ids_BT: torch.Tensor) -> torch.Tensor:
    """-> [B, T, H]: row t is the (target) embedding of token t+1, zeros after the block's end."""
    embeds_BTH = embeddings(input_ids_BT)
    return F.pad(embeds_BTH[:, 1:], (0, 0, 0, 1))


def default_tap_layers(num_layers: int) -> list[int]:
    """EAGLE-3's taps: inputs of layers 2, N//2, N-3; for targets under 6 layers, evenly spread
    inputs of layers 1, N//2, N-1 (all clamped to real layer inputs [0, N-1])."""
    if num_layers >= 6:
        taps = [2, num_layers // 2, num_layers - 3]
    else:
        taps = [1, num_layers // 2, num_layers - 1]
    return sorted(min(max(t, 0), num_layers - 1) for t in taps)


class Eagle3Head(nn.Module):
    """An EAGLE-3 (or EAGLE-1/2 with num_taps=1) draft head; pure (see the module docstring)."""

    def __init__(self, hidden_size: int, vocab_size: int, draft_vocab_size: int, num_attention_heads: int,
                 num_kv_heads: int, intermediate_size: int, num_taps: int = 3, rope_theta: float = 10000.0,
                 rms_norm_eps: float = 1e-6, num_layers: int = 1):
        super().__init__()
        if not 1 <= draft_vocab_size <= vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {vocab_size}], got {draft_vocab_size}")
        if num_layers < 1:
            raise ValueError(f"an EAGLE head needs num_layers >= 1, got {num_layers}")
        self.hidden_size, self.vocab_size, self.draft_vocab_size = hidden_size, vocab_size, draft_vocab_size
        self.num_taps = num_taps
        # EAGLE-1/2 (one tap) reads the tap as it is; EAGLE-3 fuses its taps with fc.
        self.fc = nn.Linear(num_taps * hidden_size, hidden_size, bias=False) if num_taps > 1 else None
        self.midlayer = MidLayer(hidden_size, num_attention_heads, num_kv_heads, intermediate_size,
                                 rope_theta, rms_norm_eps)
        # Named "1", "2", ...: state-dict keys layers.1.*, as vLLM names a multi-layer draft's layers.
        self.layers = nn.ModuleDict({str(i): DecoderLayer(hidden_size, num_attention_heads, num_kv_heads,
                                                          intermediate_size, rope_theta, rms_norm_eps)
                                     for i in range(1, num_layers)})
        self.num_layers = num_layers
        self.norm = RMSNorm(hidden_size, rms_norm_eps)
        self.lm_head = nn.Linear(hidden_size, draft_vocab_size, bias=False)
        # Identity map until set_draft_vocab: draft id i is target id i.
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[:draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    @torch.no_grad()
    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target(self) -> torch.Tensor:
        """[Vd] long: the target id of every draft id."""
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    @torch.no_grad()
    def init_lm_head_from(self, target_lm_head: nn.Module) -> None:
        """Start from the target's lm_head rows of the draft vocab."""
        weight = target_lm_head.weight
        if tuple(weight.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(f"target lm_head has shape {tuple(weight.shape)}, the head needs "
                             f"({self.vocab_size}, {self.hidden_size})")
        self.lm_head.weight.copy_(weight[self.draft_to_target().to(weight.device)].to(self.lm_head.weight.dtype))

    init_lm_heads_from = init_lm_head_from  # the trainer's name for every head kind

    def fuse(self, taps_BTnH: torch.Tensor) -> torch.Tensor:
        """Concatenated taps [B, T, nH] -> step-0 feature [B, T, H]."""
        return self.fc(taps_BTnH) if self.fc is not None else taps_BTnH

    def step(self, embeds_BTH, feature_BTH, position_ids_BT, past_kv=None, mask_B1TS=None):
        """One pass through the layers -> (output feature [B, T, H], this call's (k, v), each
        [L, B, Hkv, T, D]).

        past_kv: (keys, values) [L, B, Hkv, S, D] the rows may also attend to, mask [B, 1, T, S+T]
        bool (True = attend); or a cache whose `layers` each take this call's keys and values
        (`update(k, v) -> (keys, values)` to attend to, as serving/decode/eagle.py `HeadWrite`'s), mask
        [B, 1, T, its keys]. Without a mask the T rows attend causally to each other only.
        """
        if mask_B1TS is None:
            if past_kv is not None:
                raise ValueError("past_kv needs an explicit mask")
            seq = embeds_BTH.shape[1]
            mask_B1TS = torch.ones(seq, seq, dtype=torch.bool, device=embeds_BTH.device).tril()[None, None]
        if past_kv is None:
            pasts = [None] * self.num_layers
        else:
            pasts = list(zip(*past_kv)) if isinstance(past_kv, tuple) else past_kv.layers
        h, first_kv = self.midlayer(embeds_BTH, feature_BTH, position_ids_BT, pasts[0], mask_B1TS)
        new_kv = [first_kv]
        for layer, past in zip(self.layers.values(), pasts[1:]):
            h, kv = layer(h, position_ids_BT, past, mask_B1TS)
            new_kv.append(kv)
        keys, values = zip(*new_kv)
        return h, (torch.stack(keys), torch.stack(values))

    def logits(self, feature_BTH: torch.Tensor) -> torch.Tensor:
        """-> draft-vocab logits [B, T, Vd]."""
        return self.lm_head(self.norm(feature_BTH))

    def forward(self, taps_BTnH: torch.Tensor, next_embeds_BTH: torch.Tensor, num_steps: int = 1):
        """Unrolled training-time test over whole blocks.

        next_embeds[:, t] is the embedding of token x_{t+1}. Step j at position t reads
        x_{t+1+j} (zeros past the block end) and its own step j-1 output at t, sits at position
        t+j, and attends to step 0's rows <= t plus rows t of steps 1..j (EAGLE-3's diagonal
        mask). -> logits [J, B, T, Vd], features [J, B, T, H].
        """
        batch, seq, _ = next_embeds_BTH.shape
        device = next_embeds_BTH.device
        positions_BT = torch.arange(seq, device=device).expand(batch, seq)
        causal_TT = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
        diagonal_TT = torch.eye(seq, dtype=torch.bool, device=device)
        feature = self.fuse(taps_BTnH)
        keys, values, all_logits, features = None, None, [], []
        for j in range(num_steps):
            embeds = F.pad(next_embeds_BTH[:, j:], (0, 0, 0, j))  # [B, T, H] token x_{t+1+j}
            mask_TS = torch.cat([causal_TT] + [diagonal_TT] * j, dim=1)  # [T, (j+1)T]
            past = None if keys is None else (keys, values)
            feature, (k, v) = self.step(embeds, feature, positions_BT + j, past, mask_TS[None, None])
            keys = k if keys is None else torch.cat([keys, k], -2)
            values = v if values is None else torch.cat([values, v], -2)
            features.append(feature)
            all_logits.append(self.logits(feature))
        return torch.stack(all_logits), torch.stack(features)
