"""The decode engine: greedy tree speculative decoding, batch size 1, PyTorch path.

    prefill -> repeat: draft -> verify -> accept -> commit

State between steps (`DecodeState`): the cache holds the S committed positions; `root` is
the next token, already chosen by the target but not yet in the cache; `hidden` holds the
drafter's target taps (concatenated) at the A positions committed by the last step (all
P prompt positions after prefill), `next_tokens` the token after each of them. Medusa
reads the final (post-norm) hidden state at position S-1, the one that chose `root`;
EAGLE heads read every new row (their own KV cache, `draft_cache`, covers the rest).

- draft: heads read `hidden` and fill the tree's T nodes (node 0 = root).
- verify: ONE target forward over the T nodes; node i sits at position S + depth(i) and
  attends to the S committed positions plus itself and its ancestors (4-D bool mask
  [1, 1, T, S+T]). Its logits are the target's prediction for the token after node i.
- accept: a drafted node is correct when its token equals the target's argmax at its
  parent. The longest root-to-leaf run of correct nodes is accepted; the target's argmax
  at the last accepted node is the bonus token, which becomes the next root.
- commit: the cache keeps the accepted nodes' KV entries (root first) and drops the rest.

Lossless: every emitted token is the target's argmax given exactly the tokens before it,
so the output equals the target's own greedy decoding (up to fp ties, see the tests).

Without heads the tree is the root alone and the same loop is plain greedy decoding, one
token per step: the "speculation off" baseline.

Metrics (DESIGN.md invariant 8): alpha = accepted draft tokens / drafted tokens, where a
step drafts `tree.max_depth` tokens (what one path can contribute, not the node count);
tau = tokens emitted per verify step = accepted draft tokens + 1 bonus.

Shape legend: P prompt tokens, S committed positions, T tree nodes, L leaves,
D max depth, H hidden, V vocab, A accepted nodes (root included).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from specheads.heads.target import TargetAdapter
from specheads.serving.drafting import Eagle3Drafter, MedusaDrafter
from specheads.serving.kv_cache import commit_path, new_cache
from specheads.serving.tree import DraftTree


@dataclass
class DecodeStats:
    steps: int = 0  # verify steps
    drafted_tokens: int = 0  # steps * tree.max_depth
    accepted_tokens: int = 0  # accepted draft tokens, counted before any stop truncation
    accepted_per_position: list[int] = field(default_factory=list)  # [D] steps that accepted depth d+1
    prefill_s: float = 0.0
    decode_s: float = 0.0
    num_new_tokens: int = 0  # tokens returned (after EOS / max_new_tokens truncation)

    @property
    def alpha(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tau(self) -> float:
        return (self.accepted_tokens + self.steps) / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        total_s = self.prefill_s + self.decode_s
        return self.num_new_tokens / total_s if total_s > 0 else 0.0

    def merge(self, other: "DecodeStats") -> "DecodeStats":
        """Sum of two runs' counts and times (for aggregating over prompts)."""
        depth = max(len(self.accepted_per_position), len(other.accepted_per_position))
        per_position = [0] * depth
        for counts in (self.accepted_per_position, other.accepted_per_position):
            for d, count in enumerate(counts):
                per_position[d] += count
        return DecodeStats(
            steps=self.steps + other.steps, drafted_tokens=self.drafted_tokens + other.drafted_tokens,
            accepted_tokens=self.accepted_tokens + other.accepted_tokens,
            accepted_per_position=per_position, prefill_s=self.prefill_s + other.prefill_s,
            decode_s=self.decode_s + other.decode_s, num_new_tokens=self.num_new_tokens + other.num_new_tokens)


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens only; ends with the EOS token when finish_reason == "stop"
    finish_reason: str  # "stop" | "length"
    stats: DecodeStats


@dataclass
class DecodeState:
    cache: object  # transformers DynamicCache holding S positions
    prefix_len: int  # S
    root: torch.Tensor  # [1] long, next token, not yet in the cache
    hidden: torch.Tensor  # [A, nH] drafter taps at positions S-A..S-1 (Medusa: nH = H, final hidden)
    next_tokens: torch.Tensor  # [A] long, the token after each of those positions (ends with root)
    draft_cache: object | None = None  # the EAGLE drafter's head cache over committed positions


@dataclass
class Verification:
    target_tokens: torch.Tensor  # [T] long, target argmax after each node
    hidden: torch.Tensor  # [T, nH] drafter taps at each node


@dataclass
class Acceptance:
    nodes: torch.Tensor  # [A] long, accepted node indices, root first
    emitted: list[int]  # accepted draft tokens + bonus token, in order (A tokens)


class TreePlan:
    """A tree's tensors on the target's device, prepared once per decoder."""

    def __init__(self, tree: DraftTree, device: torch.device):
        self.num_nodes = tree.num_nodes
        self.max_depth = tree.max_depth
        self.is_chain = tree.is_chain  # then the causal mask is the tree mask
        self.tree_mask = tree.tree_mask.to(device)  # [T, T]
        self.position_offsets = tree.position_offsets.to(device)  # [T]
        self.draft_parents = tree.parents[1:].to(device)  # [T-1]
        # Padding -1 in leaf_paths indexes the False appended to `match` in accept().
        self.leaf_paths = tree.leaf_paths.to(device)  # [L, D+1]
        self.false = torch.zeros(1, dtype=torch.bool, device=device)


def prefill(target: TargetAdapter, input_ids_1P: torch.Tensor, tap_layers: list[int]) -> DecodeState:
    cache = new_cache(target.config)
    out = target(input_ids_1P, tap_layers, past_key_values=cache, use_cache=True, logits_to_keep=1)
    root = out.logits[:, -1].argmax(dim=-1)  # [1]
    return DecodeState(cache=out.past_key_values, prefix_len=int(input_ids_1P.shape[1]), root=root,
                       hidden=torch.cat(out.taps, dim=-1)[0], next_tokens=torch.cat([input_ids_1P[0, 1:], root]))


def verify(target: TargetAdapter, plan: TreePlan, state: DecodeState, tree_tokens_1T: torch.Tensor,
           tap_layers: list[int]) -> Verification:
    prefix_len, num_nodes = state.prefix_len, plan.num_nodes
    mask = None
    if not plan.is_chain:
        mask = torch.ones(1, 1, num_nodes, prefix_len + num_nodes, dtype=torch.bool, device=plan.tree_mask.device)
        mask[0, 0, :, prefix_len:] = plan.tree_mask
    position_ids = (plan.position_offsets + prefix_len)[None]  # [1, T]
    out = target(tree_tokens_1T, tap_layers, attention_mask=mask, position_ids=position_ids,
                 past_key_values=state.cache, use_cache=True)
    return Verification(target_tokens=out.logits[0].argmax(dim=-1), hidden=torch.cat(out.taps, dim=-1)[0])


def accept(plan: TreePlan, tree_tokens_T: torch.Tensor, verification: Verification) -> Acceptance:
    target_tokens = verification.target_tokens
    match_T = torch.cat([plan.false.logical_not(), tree_tokens_T[1:] == target_tokens[plan.draft_parents]])
    match_ext = torch.cat([match_T, plan.false])  # [T+1]; index -1 (padding) -> False
    accepted_len_L = match_ext[plan.leaf_paths].cumprod(dim=1).sum(dim=1)  # root always matches
    best = int(accepted_len_L.argmax())
    nodes = plan.leaf_paths[best, :int(accepted_len_L[best])]
    emitted = torch.cat([tree_tokens_T[nodes[1:]], target_tokens[nodes[-1:]]]).tolist()
    return Acceptance(nodes=nodes, emitted=emitted)


def commit(state: DecodeState, verification: Verification, acceptance: Acceptance,
           tree_tokens_T: torch.Tensor) -> DecodeState:
    commit_path(state.cache, state.prefix_len, acceptance.nodes)
    last = acceptance.nodes[-1:]
    root = verification.target_tokens[last]  # [1] the bonus token
    return DecodeState(cache=state.cache, prefix_len=state.prefix_len + int(acceptance.nodes.shape[0]),
                       root=root, hidden=verification.hidden[acceptance.nodes],
                       next_tokens=torch.cat([tree_tokens_T[acceptance.nodes[1:]], root]),
                       draft_cache=state.draft_cache)


def emit(out_tokens: list[int], new_tokens: list[int], max_new_tokens: int, eos_ids: frozenset[int]) -> str | None:
    """Append tokens up to EOS (included) or the length limit; return the finish reason."""
    for token in new_tokens:
        out_tokens.append(token)
        if token in eos_ids:
            return "stop"
        if len(out_tokens) >= max_new_tokens:
            return "length"
    return None


def _as_prompt(input_ids, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be a non-empty list of ints or a [1, P] tensor, got shape {tuple(ids.shape)}")
    return ids


DEFAULT_EAGLE_DEPTH = 4


def is_eagle(heads: nn.Module | None) -> bool:
    return heads is not None and hasattr(heads, "draft_to_target")


def _default_eagle_taps(heads: nn.Module, target: TargetAdapter) -> list[int]:
    from specheads.heads.eagle3 import default_tap_layers

    return default_tap_layers(target.num_layers) if heads.num_taps > 1 else [target.num_layers]


class SpeculativeDecoder:
    """Medusa or EAGLE drafting (picked by the heads' kind), greedy verification.

    tap_layers: the target layers an EAGLE head reads (HeadsConfig.tap_layers); default the
    trainer's default taps. Medusa always reads the final hidden state.
    """

    def __init__(self, target: TargetAdapter, heads: nn.Module | None = None, tree: DraftTree | None = None,
                 tap_layers: list[int] | None = None):
        if heads is None and tree is not None and tree.max_depth > 0:
            raise ValueError("a tree with draft nodes needs heads; pass heads or leave tree unset")
        if tree is None:
            # EAGLE heads have no head count: without a tree they get a small default depth.
            tree = DraftTree.default(getattr(heads, "num_heads", DEFAULT_EAGLE_DEPTH)) if heads is not None \
                else DraftTree.chain(0)
        self.target = target
        self.tree = tree
        self.tap_layers = [target.num_layers]
        self.drafter = None
        if heads is not None and tree.max_depth > 0:
            if is_eagle(heads):
                self.tap_layers = list(tap_layers) if tap_layers else _default_eagle_taps(heads, target)
                target.check_taps(self.tap_layers)
                self.drafter = Eagle3Drafter(heads, tree, target.embeddings(), self.tap_layers)
            else:
                self.drafter = MedusaDrafter(heads, tree)
        self.plan = TreePlan(tree, target.device)

    def draft(self, state: DecodeState) -> torch.Tensor:
        """-> tree tokens [1, T]."""
        if self.drafter is None:
            return state.root[:, None]
        if isinstance(self.drafter, Eagle3Drafter):
            return self.drafter.draft(state)
        return self.drafter.draft(state.hidden[-1:], state.root)

    @torch.inference_mode()
    def generate(self, input_ids: list[int] | torch.Tensor, max_new_tokens: int,
                 eos_token_id: int | list[int] | None = None) -> GenerationResult:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        eos_ids = frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id or [])
        prompt_1P = _as_prompt(input_ids, self.target.device)
        stats = DecodeStats(accepted_per_position=[0] * self.plan.max_depth)
        start = time.perf_counter()
        state = prefill(self.target, prompt_1P, self.tap_layers)
        tokens: list[int] = []
        finish_reason = emit(tokens, state.root.tolist(), max_new_tokens, eos_ids)
        decode_start = time.perf_counter()
        stats.prefill_s = decode_start - start
        while finish_reason is None:
            tree_tokens_1T = self.draft(state)
            verification = verify(self.target, self.plan, state, tree_tokens_1T, self.tap_layers)
            acceptance = accept(self.plan, tree_tokens_1T[0], verification)
            num_accepted = len(acceptance.emitted) - 1
            stats.steps += 1
            stats.drafted_tokens += self.plan.max_depth
            stats.accepted_tokens += num_accepted
            for depth in range(num_accepted):
                stats.accepted_per_position[depth] += 1
            finish_reason = emit(tokens, acceptance.emitted, max_new_tokens, eos_ids)
            if finish_reason is None:
                state = commit(state, verification, acceptance, tree_tokens_1T[0])
        stats.decode_s = time.perf_counter() - decode_start
        stats.num_new_tokens = len(tokens)
        return GenerationResult(tokens=tokens, finish_reason=finish_reason, stats=stats)
