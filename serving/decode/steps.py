"""Tree speculative decoding for one sequence: the decoder, its state and step functions.

    prefill -> repeat: draft -> verify -> accept -> commit

`SpeculativeDecoder` holds the target, the drafter and the tree; its `generate`/`stream`
run one request through serving/decode/engine.py's `BatchEngine` (the loop, batching and the
fallback live there; serving/decode/scheduler.py schedules many requests). The module-level
`prefill`/`verify`/`accept`/`commit` are the same steps for one sequence, used to drive or
inspect a decode step by step.

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

The target's cache is a `TreeStaticCache` (serving/decode/cache.py) in dynamic-shape mode,
allocated once with max_cache_len = P + max_new_tokens + T (one row per sequence): verify
writes the T nodes after the S committed positions, commit gathers the accepted ones in
place. No step reallocates a buffer.

Sampling (`generate(..., sampling=SamplingParams(...))`, temperature > 0): verify keeps the
tree's logits and accept is `serving.decode.sampling.accept_tree_sampling` (recursive rejection
sampling against the heads' deterministic top-k candidates, draft_probs=None), so the output
follows the target's processed distribution exactly; the final (bonus or recovered) token is
the next root. `acceptance="typical"` is Medusa-2's lossy rule, reported as lossless=False.

Controls: `stop_token_sequences` end the output right after the first occurrence of any of
them (finish_reason "stop"); `stream(...)` yields the new tokens of each step.

Lossless: every emitted token is the target's argmax given exactly the tokens before it,
so the output equals the target's own greedy decoding (up to fp ties, see the tests).

Without heads the tree is the root alone and the same loop is plain greedy decoding, one
token per step: the "speculation off" baseline.

N-gram lookup (`lookup=LookupConfig(...)`, serving/decode/lookup.py; greedy and sampled): a
chain copied from the context's last n-gram match is verified alone (a long match, the
heads' draft skipped) or as one more branch beside the heads' tree; it also works without
heads (plain prompt-lookup decoding in this engine).

Results and counts (`GenerationResult`, `DecodeStats`, alpha and tau): serving/decode/stats.py.

Shape legend: P prompt tokens, S committed positions, T tree nodes, L leaves,
D max depth, H hidden, V vocab, A accepted nodes (root included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specheads.heads.target import TargetAdapter
from specheads.serving.decode.eagle import Eagle3Drafter, MedusaDrafter
from specheads.serving.decode.sampling import SamplingParams
from specheads.serving.decode.cache import TreeStaticCache
from specheads.serving.decode.stats import GenerationResult
from specheads.serving.decode.trees import DraftTree

# Cache capacity past the prompt when `prefill` is called without one (generate always passes
# P + max_new_tokens + T, which covers every verify step).
DEFAULT_CACHE_HEADROOM = 256


@dataclass
class DecodeState:
    cache: object  # TreeStaticCache holding S committed positions
    prefix_len: int  # S
    root: torch.Tensor  # [1] long, next token, not yet in the cache
    hidden: torch.Tensor  # [A, nH] drafter taps at positions S-A..S-1 (Medusa: nH = H, final hidden)
    next_tokens: torch.Tensor  # [A] long, the token after each of those positions (ends with root)
    draft_cache: object | None = None  # the EAGLE drafter's head cache over committed positions
    root_logits: torch.Tensor | None = None  # [1, V] the target's logits that chose root (after prefill only)


@dataclass
class Verification:
    target_tokens: torch.Tensor  # [T] long, target argmax after each node
    hidden: torch.Tensor  # [T, nH] drafter taps at each node
    logits: torch.Tensor | None = None  # [T, V] target logits after each node (sampling reads them)


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
        self.packed_tree_mask = None  # [T, W] int32, packed on first use by the tree attention path

    def packed(self) -> torch.Tensor:
        """The tree mask packed for the tree-attention kernel, once per plan (every layer reads it)."""
        if self.packed_tree_mask is None:
            from specheads.serving.kernels.tree_attention import pack_tree_mask

            self.packed_tree_mask = pack_tree_mask(self.tree_mask)
        return self.packed_tree_mask


def prefill(target: TargetAdapter, input_ids_1P: torch.Tensor, tap_layers: list[int],
            max_cache_len: int | None = None, cache: TreeStaticCache | None = None) -> DecodeState:
    """Run the prompt into the cache; -> the state with the greedy root (and its logits).

    cache: a TreeStaticCache whose active row(s) take the prompt (the engine passes its own,
    set to the new sequence's row); default a fresh one sized max_cache_len, which must
    cover the longest context plus one tree (default P + DEFAULT_CACHE_HEADROOM). The
    buffers are allocated once and never reallocated; verify writes into them and commit
    gathers in place.
    """
    prompt_len = int(input_ids_1P.shape[1])
    if cache is None:
        cache = TreeStaticCache(target.config, max_cache_len=max_cache_len or prompt_len + DEFAULT_CACHE_HEADROOM)
    out = target(input_ids_1P, tap_layers, past_key_values=cache, use_cache=True, logits_to_keep=1)
    cache.commit()
    logits_1V = out.logits[:, -1]
    root = logits_1V.argmax(dim=-1)  # [1]
    return DecodeState(cache=cache, prefix_len=prompt_len, root=root,
                       hidden=torch.cat(out.taps, dim=-1)[0], next_tokens=torch.cat([input_ids_1P[0, 1:], root]),
                       root_logits=logits_1V)


def verify(target: TargetAdapter, plan: TreePlan, state: DecodeState, tree_tokens_1T: torch.Tensor,
           tap_layers: list[int]) -> Verification:
    """One sequence's verify forward through the model's own attention (a 4-D bool mask)."""
    mask = None if plan.is_chain else state.cache.attention_mask(plan.tree_mask)
    position_ids = (plan.position_offsets + state.prefix_len)[None]  # [1, T]
    out = target(tree_tokens_1T, tap_layers, attention_mask=mask, position_ids=position_ids,
                 past_key_values=state.cache, use_cache=True)
    logits_TV = out.logits[0]
    return Verification(target_tokens=logits_TV.argmax(dim=-1), hidden=torch.cat(out.taps, dim=-1)[0],
                        logits=logits_TV)


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
           tree_tokens_T: torch.Tensor, root: torch.Tensor | None = None) -> DecodeState:
    """Keep the accepted nodes in the cache; root [1]: the next root (default the target's
    argmax at the last accepted node, the greedy bonus token)."""
    state.cache.commit(acceptance.nodes)
    last = acceptance.nodes[-1:]
    if root is None:
        root = verification.target_tokens[last]  # [1] the bonus token
    return DecodeState(cache=state.cache, prefix_len=state.prefix_len + int(acceptance.nodes.shape[0]),
                       root=root, hidden=verification.hidden[acceptance.nodes],
                       next_tokens=torch.cat([tree_tokens_T[acceptance.nodes[1:]], root]),
                       draft_cache=state.draft_cache)


def _ends_with_stop(tokens: list[int], stop_sequences: list[list[int]]) -> bool:
    for stop in stop_sequences:
        if len(tokens) >= len(stop) and tokens[len(tokens) - len(stop):] == stop:
            return True
    return False


def emit(out_tokens: list[int], new_tokens: list[int], max_new_tokens: int, eos_ids: frozenset[int],
         stop_sequences: list[list[int]] | None = None) -> str | None:
    """Append tokens up to EOS or a stop sequence (included) or the length limit; return the finish reason."""
    for token in new_tokens:
        out_tokens.append(token)
        if token in eos_ids or (stop_sequences and _ends_with_stop(out_tokens, stop_sequences)):
            return "stop"
        if len(out_tokens) >= max_new_tokens:
            return "length"
    return None


DEFAULT_EAGLE_DEPTH = 4


def is_eagle(heads: nn.Module | None) -> bool:
    return heads is not None and hasattr(heads, "draft_to_target")


def _default_eagle_taps(heads: nn.Module, target: TargetAdapter) -> list[int]:
    from specheads.heads.eagle3 import default_tap_layers

    return default_tap_layers(target.num_layers) if heads.num_taps > 1 else [target.num_layers]


class SpeculativeDecoder:
    """Medusa or EAGLE drafting (picked by the heads' kind), greedy or sampled verification.

    The decode loop itself is serving/decode/engine.py's BatchEngine; `generate`/`stream` run one
    request through an engine of one row, serving/decode/scheduler.py's BatchSession runs many.

    tap_layers: the target layers an EAGLE head reads (HeadsConfig.tap_layers); default the
    trainer's default taps. Medusa always reads the final hidden state.

    attn_impl: "sdpa" (default) verifies with a 4-D bool mask through the model's own
    attention; "tree" switches the target model to the registered tree attention
    (register_tree_attention(); SDPA whenever no tree is passed, so prefill is unchanged) and
    verify passes tree_mask= (packed) and prefix_len= instead of the mask.
    tree_attention_impl: "torch" | "triton" | None (triton on CUDA or under TRITON_INTERPRET=1).

    tree: a static DraftTree, or (EAGLE heads) a serving.decode.dynamic.DynamicTreeConfig: an
    EAGLE-2 tree drafted anew every step (with AdaEDL early stopping when it sets
    entropy_threshold). entropy_threshold (Medusa, static tree): per step, drop the depths
    from the first head whose AdaEDL acceptance bound falls below it.

    fallback: when speculation does not pay for a request, it finishes with plain decoding
    (serving/decode/fallback.py FallbackPolicy); None keeps speculating whatever it measures.
    """

    def __init__(self, target: TargetAdapter, heads: nn.Module | None = None, tree=None,
                 tap_layers: list[int] | None = None, attn_impl: str = "sdpa",
                 tree_attention_impl: str | None = None, fallback="default", entropy_threshold: float | None = None,
                 lookup=None):
        from specheads.serving.decode.dynamic import DepthTruncatedTrees, DynamicEagleDrafter, DynamicTreeConfig
        from specheads.serving.decode.fallback import FallbackPolicy, StepCosts
        from specheads.serving.decode.lookup import LookupConfig

        if lookup is not None and not isinstance(lookup, LookupConfig):
            raise ValueError(f"lookup must be None or a serving.decode.lookup.LookupConfig, got {lookup!r}")

        dynamic = tree if isinstance(tree, DynamicTreeConfig) else None
        if dynamic is not None:
            if not is_eagle(heads):
                raise ValueError("a dynamic tree (DynamicTreeConfig) needs EAGLE heads; Medusa heads use a "
                                 "static DraftTree (optionally with entropy_threshold)")
            tree = DraftTree.chain(dynamic.depth)  # the static stand-in: its depth, for stats and checks

        if attn_impl not in ("sdpa", "tree"):
            raise ValueError(f"attn_impl must be 'sdpa' or 'tree', got {attn_impl!r}")
        if tree_attention_impl not in (None, "torch", "triton"):
            raise ValueError(f"tree_attention_impl must be None, 'torch' or 'triton', got {tree_attention_impl!r}")
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
                self.drafter = DynamicEagleDrafter(heads, target.embeddings(), self.tap_layers, dynamic) \
                    if dynamic is not None else Eagle3Drafter(heads, tree, target.embeddings(), self.tap_layers)
            else:
                self.drafter = MedusaDrafter(heads, tree)
        self.is_medusa = isinstance(self.drafter, MedusaDrafter)
        self.dynamic = dynamic
        self.plan = TreePlan(tree, target.device)
        # The largest tree a step verifies (sizes the cache) and the deepest one (sizes the stats).
        self.max_tree_nodes = dynamic.num_nodes + 1 if dynamic is not None else tree.num_nodes
        self.lookup = lookup
        self._lookup_trees: dict = {}  # (base tree's rank paths, chain length) -> (tree, plan)
        if lookup is not None:
            self.max_tree_nodes += lookup.num_tokens
        self.max_depth = tree.max_depth
        if entropy_threshold is not None and not (self.is_medusa and 0 <= entropy_threshold <= 1):
            raise ValueError(f"entropy_threshold must be in [0, 1] and needs Medusa heads with a static tree "
                             f"(EAGLE heads set it in their DynamicTreeConfig), got {entropy_threshold!r}")
        self.entropy_threshold = entropy_threshold
        self.cut_trees = None
        if entropy_threshold is not None:
            self.cut_trees = DepthTruncatedTrees(tree)
            self.cut_plans = {cut: TreePlan(self.cut_trees.tree(cut), target.device)
                              for cut in range(1, tree.max_depth + 2)}
        self.plain_tree = DraftTree.chain(0)
        self.plain_plan = TreePlan(self.plain_tree, target.device)  # speculation off
        self.fallback = FallbackPolicy() if fallback == "default" else fallback
        self.step_costs = StepCosts()  # measured step seconds, shared by this decoder's requests
        self.attn_impl = attn_impl
        self.tree_attention_impl = tree_attention_impl
        if attn_impl == "tree":
            from specheads.serving.kernels.tree_attention import register_tree_attention

            name = register_tree_attention()
            if getattr(target.model.config, "_attn_implementation", None) != name:
                target.model.set_attn_implementation(name)

    @property
    def speculates(self) -> bool:
        """Whether requests draft at all (heads, n-gram lookup, or both), unless they opt out."""
        return self.drafter is not None or self.lookup is not None

    # --- drafting (called by the engine) ----------------------------------------------------

    def draft(self, state: DecodeState) -> torch.Tensor:
        """One sequence's tree tokens [1, T] for the step functions (static trees; the root
        alone without heads). The engine drafts through draft_one / draft_medusa."""
        if self.drafter is None:
            return state.root[:, None]
        if self.is_medusa:
            return self.drafter.draft(state.hidden[-1:], state.root)
        return self.draft_one(state)[0][None]

    def draft_one(self, state: DecodeState) -> tuple[torch.Tensor, DraftTree, TreePlan]:
        """An EAGLE sequence's draft: (tokens [T], tree, plan); a dynamic tree is new every step."""
        if self.dynamic is not None:
            tokens_T, tree = self.drafter.draft(state)
            return tokens_T, tree, TreePlan(tree, self.target.device)
        return self.drafter.draft(state)[0], self.tree, self.plan

    def draft_medusa(self, hidden_BH: torch.Tensor, roots_B: torch.Tensor) -> list[tuple[torch.Tensor, DraftTree, TreePlan]]:
        """B Medusa sequences drafted in one head call: [(tokens [T_b], tree, plan)] * B. With
        entropy_threshold each sequence's tree is cut at its first uncertain head's depth."""
        from specheads.serving.decode.dynamic import entropy_cut_depth

        tokens_BT, logits_DBV = self.drafter.draft_with_logits(hidden_BH, roots_B)
        if self.cut_trees is None:
            return [(tokens_BT[b], self.tree, self.plan) for b in range(tokens_BT.shape[0])]
        drafts = []
        for b in range(tokens_BT.shape[0]):
            cut = entropy_cut_depth(logits_DBV[:, b], self.entropy_threshold)
            cut = min(cut, self.tree.max_depth + 1)
            drafts.append((tokens_BT[b, :self.cut_trees.num_nodes(cut)], self.cut_trees.tree(cut), self.cut_plans[cut]))
        return drafts

    def with_lookup(self, tokens_T: torch.Tensor, tree: DraftTree, chain: list[int]) -> tuple[torch.Tensor, DraftTree, TreePlan]:
        """A draft plus an n-gram lookup chain under its root: (tokens, tree, plan)."""
        from specheads.serving.decode.lookup import with_lookup_chain

        key = (tree.rank_paths, len(chain))
        cached = self._lookup_trees.get(key)
        if cached is None:
            if len(self._lookup_trees) >= 1024:  # dynamic trees make new shapes every step
                self._lookup_trees.clear()
            combined = with_lookup_chain(tree, len(chain))
            cached = self._lookup_trees[key] = (combined, TreePlan(combined, self.target.device))
        chain_T = torch.tensor(chain, dtype=torch.long, device=tokens_T.device)
        return torch.cat([tokens_T, chain_T]), cached[0], cached[1]

    def tree_kwargs(self, packed_mask: torch.Tensor, prefix_len) -> dict:
        """Forward kwargs that route a verify through the tree-attention function."""
        kwargs = {"tree_mask": packed_mask, "prefix_len": prefix_len}
        if self.tree_attention_impl is not None:
            kwargs["tree_attention_impl"] = self.tree_attention_impl
        return kwargs

    # --- one request ----------------------------------------------------------------------

    def stream(self, input_ids: list[int] | torch.Tensor, max_new_tokens: int,
               eos_token_id: int | list[int] | None = None, *, sampling: SamplingParams | None = None,
               stop_token_sequences: list[list[int]] | None = None,
               acceptance: str = "rejection", speculate: bool = True) -> "DecodeStream":
        """Like generate, but an iterator of token deltas (list[int]: the prefill's first token,
        then one list per verify step); `.result` holds the GenerationResult once exhausted."""
        from specheads.serving.decode.engine import BatchEngine, SequenceRequest

        request = SequenceRequest(input_ids, max_new_tokens, eos_token_id, sampling, stop_token_sequences,
                                  speculate, acceptance)
        if isinstance(max_new_tokens, int) and max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        prompt_len = int(torch.as_tensor(input_ids).reshape(-1).shape[0])
        engine = BatchEngine(self, max_batch_size=1,
                             max_cache_len=prompt_len + int(max_new_tokens) + self.max_tree_nodes)
        return DecodeStream(engine, engine.check(request))

    def generate(self, input_ids: list[int] | torch.Tensor, max_new_tokens: int,
                 eos_token_id: int | list[int] | None = None, *, sampling: SamplingParams | None = None,
                 stop_token_sequences: list[list[int]] | None = None,
                 acceptance: str = "rejection", speculate: bool = True) -> GenerationResult:
        """Decode up to max_new_tokens new tokens.

        sampling: None or temperature 0 = greedy (the target's own greedy output); otherwise
        lossless tree rejection sampling (serving.decode.sampling) with the heads' top-k candidates,
        seeded by sampling.seed. acceptance="typical" (sampling only) is Medusa-2's lossy rule;
        the result then has lossless=False. stop_token_sequences: the output ends right after
        the first occurrence of any of them (finish_reason "stop"). speculate=False: plain
        decoding (one target token per step), the heads unused.
        """
        stream = self.stream(input_ids, max_new_tokens, eos_token_id, sampling=sampling,
                             stop_token_sequences=stop_token_sequences, acceptance=acceptance,
                             speculate=speculate)
        for _ in stream:
            pass
        return stream.result


class DecodeStream:
    """Iterator of token deltas (list[int]): the prefill's first token, then one list per
    verify step. `result` is the GenerationResult once exhausted (or closed)."""

    def __init__(self, engine, seq):
        self._engine, self._seq = engine, seq
        self._started = False
        self.result: GenerationResult | None = None

    def __iter__(self):
        return self

    def __next__(self) -> list[int]:
        if self.result is not None:
            raise StopIteration
        seq = self._seq
        if not self._started:
            self._started = True
            return self._engine.add(seq)
        if seq.finish_reason is not None:
            self.result = seq.result()
            raise StopIteration
        tokens = self._engine.step()[seq.seq_id]
        if seq.error is not None:  # the engine ended it alone; a caller of one sequence gets the error itself
            self.result = seq.result()
            raise seq.error
        return tokens

    def close(self) -> GenerationResult:
        """Stop decoding now; -> the result so far (finish_reason "stop" unless it had already
        finished), with the decoder's own stats. A caller that cut the output (a stop string
        in the text) replaces the tokens."""
        if self.result is None:
            self.result = self._seq.close()
        return self.result
