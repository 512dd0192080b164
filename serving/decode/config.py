"""`SpeculativeDecoder`: validated, typed configuration of a decode (the target, its drafter
and tree, the attention used to verify, the fallback policy, n-gram lookup, the reply store). It runs
nothing and changes nothing on the target; serving/decode/engine.py's `BatchEngine` runs
requests with it, and serving/decode/generate.py's `generate`/`stream` run one.

What a heads directory asks serving for is read here too: `parse_tree_field` turns its
config's `tree` field (heads/artefacts/heads_dir.py `HeadsConfig.tree`, written by training's
calibration and `specheads tune`) into a `TreeSpec`, the decoder's tree, AdaEDL threshold,
n-gram lookup and reply store. (heads/ reads the rest of the config, but may not import serving's tree
types.)
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from torch import nn

from specheads.heads.eagle3 import Eagle3Head, default_tap_layers
from specheads.heads.target.adapter import TargetAdapter
from specheads.serving.decode.eagle import DynamicEagleDrafter, StaticEagleDrafter
from specheads.serving.decode.fallback import FallbackPolicy, StepCosts
from specheads.serving.decode.lookup import LookupConfig, NgramLookup
from specheads.serving.decode.medusa import MedusaDrafter
from specheads.serving.decode.store import StoreConfig, StoreDrafter
from specheads.serving.decode.trees import DEFAULT_NUM_DRAFT_NODES, DraftTree, DynamicTreeConfig

DEFAULT_EAGLE_DEPTH = 4  # EAGLE heads have no head count: without a tree they draft this deep


def is_eagle(heads: nn.Module | None) -> bool:
    return isinstance(heads, Eagle3Head)


class SpeculativeDecoder:
    """Medusa or EAGLE drafting (picked by the heads' kind), greedy or sampled verification.

    tree: a static `DraftTree`, or (EAGLE heads) a `DynamicTreeConfig`: an EAGLE-2 tree
    drafted anew every step (AdaEDL early stopping when it sets entropy_threshold). Default:
    `DraftTree.default` over the heads' depth. entropy_threshold (Medusa, static tree): per
    step, drop the depths from the first head whose AdaEDL acceptance bound falls below it.

    tap_layers: the target layers an EAGLE head reads (HeadsConfig.tap_layers); default the
    trainer's default taps. Medusa always reads the final hidden state.

    attn_impl: "sdpa" verifies with a 4-D bool mask through the model's own attention;
    "tree" through the registered tree attention (serving/kernels/tree_attention.py), which
    the engine installs on the target when it is built (SDPA whenever no tree is passed, so
    prefill and other users of the model are unchanged). tree_attention_impl: "torch" |
    "triton" | None (triton on CUDA or under TRITON_INTERPRET=1).

    fallback: when speculation does not pay for a request, it finishes with plain decoding
    (serving/decode/fallback.py); None keeps speculating whatever it measures. step_costs:
    the measured step costs it decides by, shared by this decoder's engines.

    lookup: n-gram lookup drafts from the context (serving/decode/lookup.py), with or without heads.
    store: drafts from the store of the target's own replies (serving/decode/store.py
    StoreDrafter over an opened store), with or without heads and lookup. Their chains are
    the decoder's `chain_sources`, in that order (lookup, then store). one_chain_per_row: a row
    drafts from the first chain source that proposes for it (lookup, else the store), not from
    both: on a CPU every verified node costs, and a second chain on the same row seldom pays for
    its nodes (SmolLM2 on MT-bench: heads + lookup + store 0.85x heads + lookup with both).
    None: on a CPU target only.

    cuda_graphs: None, or "capture": the engine's cache takes static shapes and every verify
    forward is a CUDA-graph replay, captured once per shape (serving/decode/graphs.py; the
    target must be on a CUDA device); "eager": the same static-shape verify run eagerly, on
    any device (how the CPU tests check what a graph records, and a way to rule the capture
    out when a GPU run disagrees).

    compile_step: None, or a torch.compile backend ("inductor"; "eager" or "aot_eager" in the
    CPU tests): the engine's whole warm step (draft, verify, accept, commit) is compiled as one
    graph per step variant (serving/decode/steps.py `DeviceStep`, `fullgraph=True`); it needs
    the static-shape cache, so cuda_graphs must be set.

    On a packed CPU target (heads/target/cpu_layout.py) the drafters run a copy of the heads whose
    linear layers are packed too (`packed_for_inference`, weights shared): build the decoder
    after the heads' weights are final.
    """

    def __init__(self, target: TargetAdapter, heads: nn.Module | None = None,
                 tree: DraftTree | DynamicTreeConfig | None = None, tap_layers: list[int] | None = None,
                 attn_impl: str = "sdpa", tree_attention_impl: str | None = None,
                 fallback: FallbackPolicy | None = FallbackPolicy(), entropy_threshold: float | None = None,
                 lookup: LookupConfig | None = None, step_costs: StepCosts | None = None,
                 cuda_graphs: str | None = None, store: StoreDrafter | None = None, compile_step: str | None = None,
                 one_chain_per_row: bool | None = None):
        if tree is not None and not isinstance(tree, (DraftTree, DynamicTreeConfig)):
            raise TypeError(f"tree must be a DraftTree, a DynamicTreeConfig or None, got {type(tree).__name__}")
        if lookup is not None and not isinstance(lookup, LookupConfig):
            raise ValueError(f"lookup must be None or a serving.decode.lookup.LookupConfig, got {lookup!r}")
        if store is not None and not isinstance(store, StoreDrafter):
            raise ValueError(f"store must be None or a serving.decode.store.StoreDrafter, got {store!r}")
        if store is not None and store.store is not None:
            store.store.check_fits(target.identity)
        if fallback is not None and not isinstance(fallback, FallbackPolicy):
            raise ValueError(f"fallback must be None or a serving.decode.fallback.FallbackPolicy, got {fallback!r}")
        if attn_impl not in ("sdpa", "tree"):
            raise ValueError(f"attn_impl must be 'sdpa' or 'tree', got {attn_impl!r}")
        if tree_attention_impl not in (None, "torch", "triton"):
            raise ValueError(f"tree_attention_impl must be None, 'torch' or 'triton', got {tree_attention_impl!r}")
        if cuda_graphs not in (None, "capture", "eager"):
            raise ValueError(f"cuda_graphs must be None, 'capture' or 'eager', got {cuda_graphs!r}")
        if cuda_graphs == "capture" and target.device.type != "cuda":
            raise ValueError(f"cuda_graphs='capture' needs the target on a CUDA device, got {target.device}; "
                             "cuda_graphs='eager' runs the same static-shape verify without capturing")
        if compile_step is not None and cuda_graphs is None:
            raise ValueError("compile_step needs the static-shape cache: set cuda_graphs ('eager' or 'capture')")
        if cuda_graphs is not None and target.packed is not None:
            raise ValueError("cuda_graphs needs an unpacked target (a packed CPU target runs its own fused forward); "
                             "load the target without CPU packing")
        dynamic = tree if isinstance(tree, DynamicTreeConfig) else None
        if dynamic is not None and not is_eagle(heads):
            raise ValueError("a dynamic tree (DynamicTreeConfig) needs EAGLE heads; Medusa heads use a "
                             "static DraftTree (optionally with entropy_threshold)")
        if heads is None and tree is not None and (dynamic is not None or tree.max_depth > 0):
            raise ValueError("a tree with draft nodes needs heads; pass heads or leave tree unset")
        if entropy_threshold is not None and not (heads is not None and not is_eagle(heads) and dynamic is None
                                                  and 0 <= entropy_threshold <= 1):
            raise ValueError(f"entropy_threshold must be in [0, 1] and needs Medusa heads with a static tree "
                             f"(EAGLE heads set it in their DynamicTreeConfig), got {entropy_threshold!r}")
        if tree is None:
            tree = DraftTree.default(getattr(heads, "num_heads", DEFAULT_EAGLE_DEPTH)) if heads is not None \
                else DraftTree.chain(0)
        if heads is not None and target.packed is not None:  # a CPU inference target: heads packed too
            from specheads.heads.target.cpu_layout import packed_for_inference

            heads = packed_for_inference(heads)
        self.target = target
        self.dynamic = dynamic
        self.tree = DraftTree.chain(dynamic.depth) if dynamic is not None else tree  # a dynamic tree's depth
        self.tap_layers = [target.num_layers]
        self.drafter = None
        if dynamic is not None or self.tree.max_depth > 0:
            if is_eagle(heads):
                self.tap_layers = list(tap_layers) if tap_layers else _default_eagle_taps(heads, target)
                target.check_taps(self.tap_layers)
                self.drafter = DynamicEagleDrafter(heads, target.embeddings(), dynamic) if dynamic is not None \
                    else StaticEagleDrafter(heads, target.embeddings(), self.tree)
            elif heads is not None:
                self.drafter = MedusaDrafter(heads, self.tree, target.device, entropy_threshold)
        self.entropy_threshold = entropy_threshold
        self.lookup = lookup
        self.store = store
        self.one_chain_per_row = target.device.type == "cpu" if one_chain_per_row is None else one_chain_per_row
        # The chain drafters, in the order their chains hang under the root (serving/decode/draft_batch.py).
        self.chain_sources = [source for source in (NgramLookup(lookup) if lookup is not None else None, store)
                              if source is not None]
        self.max_depth = self.tree.max_depth
        chain_tokens = [source.num_tokens for source in self.chain_sources]
        # The largest tree a step verifies (sizes the cache).
        self.max_tree_nodes = (self.drafter.num_nodes if self.drafter is not None else 1) + sum(chain_tokens)
        # The sampled accept's uniforms per row and step (serving/decode/accept.py accept_rejection):
        # the deepest and widest tree this decoder drafts, its chains included.
        widest = dynamic.top_k if dynamic is not None else self.tree.max_children
        self.uniform_shape = (max([self.max_depth] + chain_tokens), widest + len(chain_tokens))
        self.compile_step = compile_step
        self.fallback = fallback
        self.step_costs = step_costs if step_costs is not None else StepCosts()
        self.attn_impl = attn_impl
        self.tree_attention_impl = tree_attention_impl
        self.cuda_graphs = cuda_graphs

    @property
    def speculates(self) -> bool:
        """Whether requests draft at all (heads, chain sources, or both), unless they opt out."""
        return self.drafter is not None or bool(self.chain_sources)



def _default_eagle_taps(heads: nn.Module, target: TargetAdapter) -> list[int]:
    return default_tap_layers(target.num_layers) if heads.num_taps > 1 else [target.num_layers]


@dataclass(frozen=True)
class TreeSpec:
    """What a heads directory's `tree` field asks for: a static tree or an EAGLE-2 dynamic
    one, Medusa's AdaEDL depth-cut threshold, and the n-gram lookup and reply store tuned with
    it (store_path: the store's directory, as recorded). plain: `specheads tune` found that no
    tree beat plain decoding on its machine, so generate and serve decode plainly."""

    tree: DraftTree | DynamicTreeConfig
    entropy_threshold: float | None = None
    lookup: LookupConfig | None = None
    store: StoreConfig | None = None
    store_path: str | None = None
    plain: bool = False

    @classmethod
    def from_heads_config(cls, config) -> "TreeSpec":
        """What a HeadsConfig (heads/artefacts/heads_dir.py) records: parse_tree_field over its tree,
        head count and calibration."""
        return parse_tree_field(config.tree, config.num_heads, config.calibration)


def parse_tree_field(tree: dict | None, num_heads: int = 1, calibration: dict | None = None) -> TreeSpec:
    """The one parser of the heads config's `tree` field.

    {"dynamic": {...}}: an EAGLE-2 tree; {"paths": [...]} with an optional
    "entropy_threshold": that static tree; neither: the calibrated tree
    (calibration["accuracy"], DEFAULT_NUM_DRAFT_NODES nodes) or the prior guess
    (`DraftTree.default`). {"lookup": {...}} and {"store": {"path": DIR, ...}} (written by
    `specheads tune`) ride along."""
    field = tree or {}
    if not isinstance(field, dict):
        raise ValueError(f"the heads config's tree must be an object, got {tree!r}")
    lookup_spec = field.get("lookup")
    lookup = None
    if lookup_spec is not None:
        allowed = [f.name for f in fields(LookupConfig)]
        if not isinstance(lookup_spec, dict) or set(lookup_spec) - set(allowed):
            raise ValueError(f"the heads tree's 'lookup' must be an object with keys from {allowed}, got {lookup_spec!r}")
        lookup = LookupConfig(**lookup_spec)
    store, store_path = _store_spec(field.get("store"))
    plain = field.get("plain", False)
    if not isinstance(plain, bool):
        raise ValueError(f"the heads tree's 'plain' must be true or false, got {plain!r}")
    if "dynamic" in field:
        return TreeSpec(DynamicTreeConfig.from_dict(field), None, lookup, store, store_path, plain)
    if field.get("paths"):
        static = DraftTree.from_paths(field["paths"])
    else:
        accuracy = (calibration or {}).get("accuracy")
        static = DraftTree.from_calibration(accuracy[:num_heads], DEFAULT_NUM_DRAFT_NODES) if accuracy \
            else DraftTree.default(num_heads)
    return TreeSpec(static, field.get("entropy_threshold"), lookup, store, store_path, plain)


def _store_spec(spec: dict | None) -> tuple[StoreConfig | None, str | None]:
    """The tree field's "store": {"path": DIR, **StoreConfig fields} -> (config, path)."""
    if spec is None:
        return None, None
    if not isinstance(spec, dict) or not isinstance(spec.get("path"), str) or not spec["path"]:
        raise ValueError(f"the heads tree's 'store' must be an object with a 'path' (the store's directory) and keys "
                         f"from {[f.name for f in fields(StoreConfig)]}, got {spec!r}")
    settings = {key: value for key, value in spec.items() if key != "path"}
    return StoreConfig.from_dict(settings, "the heads tree's 'store'"), spec["path"]
