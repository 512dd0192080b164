"""The trees `specheads tune` tries (bench/tune.py's module doc, "Settings swept"): static trees
from the heads' calibrated accuracy under node budgets and depth limits, dynamic EAGLE-2 trees,
AdaEDL twins, ranked by an estimated speed from the machine's step costs (or a prior)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

NODE_BUDGETS = (3, 4, 6, 8, 12, 16, 24, 32)
NODE_COST = 0.06  # prior: a draft node costs ~6% of a plain step on 2 CPU cores (17 nodes ~ 2 steps)
DEPTH_COST = 0.12  # prior: one sequential EAGLE draft level, in plain-step units
DYNAMIC_GRID = ({"top_k": 4, "num_nodes": 8}, {"top_k": 4, "num_nodes": 16}, {"top_k": 8, "num_nodes": 16},
                {"top_k": 8, "num_nodes": 32})
ADAEDL_THRESHOLD = 0.3  # a drafted node's acceptance bound below this stops its branch
ADAEDL_TWINS = 2  # settings that get an AdaEDL twin


@dataclass
class Setting:
    """One candidate tree: `tree` is what the decoder gets, `record` what config.json stores."""

    name: str
    kind: str  # "static" | "dynamic"
    tree: object  # DraftTree | DynamicTreeConfig
    record: dict  # {"paths": [...]} | {"dynamic": {...}}
    num_nodes: int  # draft nodes (root excluded); dynamic: the node budget
    max_depth: int
    estimate: float = 0.0  # prior speed estimate, plain-step units
    entropy_threshold: float | None = None  # Medusa's AdaEDL depth cut (a static tree); EAGLE's is in `tree`


def step_cost(num_nodes: int, depth: int, eagle: bool, costs=None) -> float:
    """A step drafting num_nodes draft nodes `depth` deep, in decode steps: measured
    (costs: a bench/step_costs.StepCostTable) or the prior."""
    if costs is not None:
        return costs.step_cost(num_nodes + 1, depth)
    return 1 + NODE_COST * num_nodes + (DEPTH_COST * depth if eagle else 0.0)


def static_settings(accuracy: list[list[float]], *, eagle: bool, depths: list[int] | None = None,
                    node_budgets: tuple[int, ...] = NODE_BUDGETS, costs=None) -> list[Setting]:
    """Chains and calibrated expansions per depth limit, deduplicated, each with its speed
    estimate from `costs` (bench/step_costs.StepCostTable; None: the prior)."""
    from specheads.heads.tree_paths import expand_paths, expected_accepted_draft_tokens
    from specheads.serving.decode.trees import DraftTree

    max_depth = len(accuracy)
    depths = depths or list(range(1, max_depth + 1))
    bad = [d for d in depths if not 1 <= d <= max_depth]
    if bad:
        raise ValueError(f"depth limits must be in 1..{max_depth} (the heads' draft depths), got {bad}")
    seen, settings = set(), []

    def add(name: str, paths: list[tuple[int, ...]]) -> None:
        key = tuple(sorted(paths))
        if key in seen:
            return
        seen.add(key)
        tree = DraftTree.from_paths(paths)
        depth = tree.max_depth
        settings.append(Setting(name, "static", tree, {"paths": [list(p) for p in key]}, len(paths), depth,
                                (1 + expected_accepted_draft_tokens(paths, accuracy))
                                / step_cost(len(paths), depth, eagle, costs)))

    for depth in depths:
        add(f"chain-{depth}", [(0,) * d for d in range(1, depth + 1)])
    for depth in depths:
        for budget in node_budgets:
            if budget > depth:
                paths = expand_paths(accuracy[:depth], budget)
                add(f"tree-d{depth}-n{len(paths)}", paths)
    return settings


def dynamic_settings(max_depth: int) -> list[Setting]:
    """Dynamic-tree (EAGLE-2) candidates for EAGLE heads: depth x DYNAMIC_GRID."""
    from specheads.serving.decode.trees import DynamicTreeConfig

    settings = []
    for depth in sorted({max(1, max_depth // 2), max_depth}):
        for grid in DYNAMIC_GRID:
            config = DynamicTreeConfig(depth=depth, top_k=grid["top_k"], num_nodes=grid["num_nodes"],
                                entropy_threshold=None)
            settings.append(Setting(f"dynamic-d{depth}-k{grid['top_k']}-n{grid['num_nodes']}", "dynamic", config,
                                    {"dynamic": dataclasses.asdict(config)}, grid["num_nodes"], depth))
    return settings


def adaedl_twins(settings: list[Setting], eagle: bool) -> list[Setting]:
    """The AdaEDL version of the ADAEDL_TWINS deepest dynamic trees (EAGLE: the threshold goes
    into the DynamicTreeConfig) or best-estimated static trees (Medusa: the decoder's
    entropy_threshold)."""
    twins = []
    if eagle:
        chosen = sorted((s for s in settings if s.kind == "dynamic"), key=lambda s: (-s.max_depth, -s.num_nodes))
    else:
        chosen = sorted((s for s in settings if s.kind == "static" and s.max_depth > 1), key=lambda s: -s.estimate)
    for setting in chosen[:ADAEDL_TWINS]:
        name = f"{setting.name}-adaedl{ADAEDL_THRESHOLD:g}"
        if eagle:
            config = dataclasses.replace(setting.tree, entropy_threshold=ADAEDL_THRESHOLD)
            twins.append(dataclasses.replace(setting, name=name, tree=config,
                                             record={"dynamic": dataclasses.asdict(config)}))
        else:
            twins.append(dataclasses.replace(setting, name=name, entropy_threshold=ADAEDL_THRESHOLD,
                                             record={**setting.record, "entropy_threshold": ADAEDL_THRESHOLD}))
    return twins


def candidate_settings(heads_config, *, max_settings: int = 16, depths: list[int] | None = None,
                       node_budgets: tuple[int, ...] = NODE_BUDGETS, costs=None) -> list[Setting]:
    """Every setting to measure for these heads (see the module docstring); costs: this
    machine's StepCostTable (None: the prior)."""
    from specheads.serving.decode.trees import prior_accuracy

    if max_settings < 1:
        raise ValueError(f"max_settings must be >= 1, got {max_settings}")
    eagle = heads_config.kind != "medusa"
    accuracy = (heads_config.calibration or {}).get("accuracy") or prior_accuracy(heads_config.num_heads)
    accuracy = accuracy[:heads_config.num_heads]
    static = static_settings(accuracy, eagle=eagle, depths=depths, node_budgets=node_budgets, costs=costs)
    static = sorted(static, key=lambda s: -s.estimate)[:max_settings]
    # Dynamic configs come on top of the static ones: the static sweep must not be cut short
    # for them.
    dynamic = dynamic_settings(len(accuracy)) if eagle else []
    return sorted(static, key=lambda s: (s.max_depth, s.num_nodes)) + dynamic + adaedl_twins(static + dynamic, eagle)
