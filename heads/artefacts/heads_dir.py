"""The heads directory: the one artefact that joins training and serving.

    <dir>/config.json        HeadsConfig as JSON (kind, sizes, taps, target identity, tree)
    <dir>/model.safetensors  the head weights (EAGLE heads: the draft-vocab maps d2t/t2d
                             too; Medusa heads with a draft vocab: token_map)

    <dir>/README.md          the model card (heads/artefacts/model_card.py): Hub metadata, training data,
                             held-out acceptance, serve commands per runtime
    <dir>/tuning.json        `specheads tune`'s sweep, once tuned

Every reader takes a local directory, a Hugging Face Hub repo id (`org/name`) or the name of
heads that ship inside the package (SHIPPED_HEADS: `embedded:smollm2-eagle3`, the SmolLM2
recipe's heads, in heads/shipped/), resolved by `resolve_heads_dir` (a local path wins; a Hub id
goes through huggingface_hub's snapshot_download and its cache). Shipped and Hub heads are read,
never rewritten: `check_writable` says to copy them first.

Head kinds: "medusa" (heads/medusa.py); "eagle3" and its EAGLE-1/2 variant "eagle"
(heads/eagle3.py). For the EAGLE kinds `num_heads` is the number of draft depths the head
is trained and calibrated for (the training-time-test steps) and `num_layers` its decoder
layers (1, EAGLE-3's own; more are vLLM's multi-layer drafts, heads/eagle3.py).

Writes are atomic: the whole directory is written under a temporary name beside the
destination and renamed into place (heads/atomic.py), so a reader never sees a half-written
directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from specheads.heads import atomic
from specheads.heads.artefacts import model_card
from specheads.heads.artefacts.hub import hub_snapshot
from specheads.heads.target.adapter import TargetIdentity, _looks_like_hub_id

FORMAT_NAME = "specheads"
FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
TUNING_NAME = "tuning.json"
HUB_FILES = (CONFIG_NAME, WEIGHTS_NAME, TUNING_NAME, model_card.CARD_NAME)  # what a Hub id fetches
# Heads that ship inside the package, by the name every --heads takes -> their directory under
# heads/shipped/ (package data; the model card there says how they were trained and what they reach)
SHIPPED_HEADS = {"embedded:smollm2-eagle3": "smollm2-eagle3"}
SHIPPED_PREFIX = "embedded:"
HEAD_KINDS = ("medusa", "eagle3", "eagle")
EAGLE_KINDS = ("eagle3", "eagle")


@dataclass
class HeadsConfig:
    kind: str  # one of HEAD_KINDS
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_layers: int
    tap_layers: list[int]  # target layers the heads read (see heads/target/adapter.py for the convention)
    target: TargetIdentity
    tree: dict | None = None  # {"paths": [[rank, ...], ...], ...}; read by serving/decode/config.py parse_tree_field
    calibration: dict | None = None  # per-depth top-k accuracy measured after training
    # What training saw (training/trainer.py training_record): data source and split, tokens with
    # loss in it, steps and tokens per step, LoRA. None for heads imported or written before it.
    training: dict | None = None
    # EAGLE kinds only (None for Medusa):
    num_attention_heads: int | None = None
    num_kv_heads: int | None = None
    intermediate_size: int | None = None
    # EAGLE: the draft vocab (= vocab_size for "eagle"); Medusa: None (the full vocab) or its
    # token_map's size (heads/medusa.py).
    draft_vocab_size: int | None = None
    rope_theta: float | None = None
    rms_norm_eps: float | None = None
    max_position_embeddings: int | None = None  # the target's; EAGLE-3 exports write it
    dtype: str = "float32"
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "HeadsConfig":
        if raw.get("format") != FORMAT_NAME:
            raise ValueError(f"{source} is not a specheads heads config (format={raw.get('format')!r}, "
                             f"expected {FORMAT_NAME!r}); foreign layouts are read by `specheads export --import`")
        if raw.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{source} has format_version={raw.get('format_version')!r}; "
                             f"this specheads reads version {FORMAT_VERSION}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise ValueError(f"{source} has unknown keys {unknown}; known keys are {sorted(names)}")
        if raw.get("kind") not in HEAD_KINDS:
            raise ValueError(f"{source}: kind must be one of {list(HEAD_KINDS)}, got {raw.get('kind')!r}")
        if raw["kind"] in EAGLE_KINDS:
            missing = [name for name in EAGLE_FIELDS if raw.get(name) is None]
            if missing:
                raise ValueError(f"{source}: a {raw['kind']} head needs {missing}")
        values = dict(raw)
        values["target"] = TargetIdentity(**raw["target"])
        return cls(**values)

    def check_fits(self, target: TargetIdentity, source: str = "heads") -> None:
        """Raise a ValueError naming both values when these heads do not fit `target`."""
        problems = []
        for name in ("hidden_size", "vocab_size"):
            mine, theirs = getattr(self, name), getattr(target, name)
            if mine != theirs:
                problems.append(f"{name}: heads were trained for {mine}, the target has {theirs}")
        if self.target.model_type != target.model_type:
            problems.append(f"architecture: heads were trained for {self.target.architecture} "
                            f"(model_type {self.target.model_type!r}), the target is "
                            f"{target.architecture} (model_type {target.model_type!r})")
        if max(self.tap_layers, default=0) > target.num_layers:
            problems.append(f"tap layers {self.tap_layers} need at least {max(self.tap_layers)} "
                            f"layers, the target has {target.num_layers}")
        if problems:
            raise ValueError(f"{source} do not fit the target {target.name_or_path or target.architecture!r}: "
                             + "; ".join(problems))


EAGLE_FIELDS = ("num_attention_heads", "num_kv_heads", "intermediate_size", "draft_vocab_size", "rope_theta",
                "rms_norm_eps")


def eagle_heads_config(target, kind: str = "eagle3", *, num_steps: int, tap_layers: list[int] | None = None,
                       draft_vocab_size: int, num_attention_heads: int | None = None,
                       num_kv_heads: int | None = None, intermediate_size: int | None = None,
                       identity: TargetIdentity | None = None, num_layers: int = 1) -> HeadsConfig:
    """The HeadsConfig of an EAGLE head for `target` (a heads/target/adapter.py TargetAdapter): its
    attention and MLP sizes, rope and norm from the target's config unless given; EAGLE-3
    taps default to default_tap_layers, EAGLE-1/2 ("eagle") reads the final hidden state over
    the full vocab. num_steps: the draft depths it is trained and calibrated for."""
    from specheads.heads.eagle3 import default_tap_layers

    text = target.text_config
    if kind == "eagle":
        taps, draft_vocab_size = [target.num_layers], target.vocab_size
    else:
        taps = list(tap_layers) if tap_layers else default_tap_layers(target.num_layers)
        draft_vocab_size = min(draft_vocab_size, target.vocab_size)
    return HeadsConfig(
        kind=kind, hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_heads=num_steps,
        num_layers=num_layers, tap_layers=taps, target=identity or target.identity,
        num_attention_heads=num_attention_heads or text.num_attention_heads,
        num_kv_heads=num_kv_heads or getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
        intermediate_size=intermediate_size or text.intermediate_size, draft_vocab_size=draft_vocab_size,
        rope_theta=float(rope_theta(text)), rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
        max_position_embeddings=getattr(text, "max_position_embeddings", None))


def rope_theta(text_config) -> float:
    theta = getattr(text_config, "rope_theta", None)
    if theta is None:  # transformers 5 keeps it in rope_parameters
        theta = (getattr(text_config, "rope_parameters", None) or {}).get("rope_theta")
    return theta or 10000.0


def build_heads(config: HeadsConfig) -> nn.Module:
    if config.kind == "medusa":
        from specheads.heads.medusa import MedusaHeads

        return MedusaHeads(config.hidden_size, config.vocab_size, config.num_heads, config.num_layers,
                           config.draft_vocab_size)
    if config.kind in EAGLE_KINDS:
        from specheads.heads.eagle3 import Eagle3Head

        num_taps = len(config.tap_layers)
        if (config.kind == "eagle") != (num_taps == 1):
            raise ValueError(f"a {config.kind} head reads {'one tap' if config.kind == 'eagle' else 'several taps'}, "
                             f"got tap_layers={config.tap_layers}")
        return Eagle3Head(config.hidden_size, config.vocab_size, config.draft_vocab_size,
                          config.num_attention_heads, config.num_kv_heads, config.intermediate_size,
                          num_taps=num_taps, rope_theta=config.rope_theta, rms_norm_eps=config.rms_norm_eps,
                          num_layers=config.num_layers)
    raise ValueError(f"unknown head kind {config.kind!r}; expected one of {list(HEAD_KINDS)}")


def write_weights_dir(directory: str | os.PathLike, config: dict, state: dict[str, torch.Tensor],
                      weights_name: str = WEIGHTS_NAME, torch_twin: str | None = None,
                      card: HeadsConfig | None = None, layout: str = "specheads") -> Path:
    """config.json + one safetensors file (and, with `torch_twin`, the same tensors
    torch.save'd under that name) + with `card`, the model card of those heads in `layout`
    (heads/artefacts/model_card.py), written atomically (atomic.staged_dir)."""
    with atomic.staged_dir(directory) as tmp:
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
        save_file(tensors, str(tmp / weights_name), metadata={"format": "pt"})
        if torch_twin is not None:
            torch.save(tensors, tmp / torch_twin)
        atomic.write_text(tmp / CONFIG_NAME, json.dumps(config, indent=2) + "\n")
        if card is not None:
            model_card.write_card(tmp, card, layout, published=directory)
    return Path(directory)


def save_heads(directory: str | os.PathLike, heads: nn.Module, config: HeadsConfig) -> Path:
    """The heads directory: config, weights and model card."""
    return write_weights_dir(directory, config.to_dict(), heads.state_dict(), card=config)


def resolve_heads_dir(name_or_path: str | os.PathLike, files: tuple[str, ...] = HUB_FILES) -> Path:
    """Where the heads that `name_or_path` names are on disk: a local path as it is, a shipped
    name (`embedded:...`) as its package directory, a Hub repo id (`org/name`) as the snapshot of
    its `files` (heads/artefacts/hub.py: the Hub cache first, nothing asked under
    HF_HUB_OFFLINE=1). A name that is none of these fails with one line naming it and what was
    tried."""
    if is_shipped_name(name_or_path):
        return shipped_heads_dir(str(name_or_path))
    return hub_snapshot(name_or_path, files, "heads")


def is_shipped_name(name_or_path: str | os.PathLike) -> bool:
    """`embedded:NAME` that is not a local path (a local path wins, as over a Hub id)."""
    return str(name_or_path).startswith(SHIPPED_PREFIX) and not Path(name_or_path).expanduser().exists()


def shipped_heads_dir(name: str) -> Path:
    """The package directory of the shipped heads `name` (SHIPPED_HEADS)."""
    if name not in SHIPPED_HEADS:
        raise FileNotFoundError(f"heads {name!r}: specheads ships no heads of that name; it ships "
                                f"{', '.join(SHIPPED_HEADS)} (or pass a heads directory or a Hub repo id)")
    directory = Path(__file__).resolve().parent.parent / "shipped" / SHIPPED_HEADS[name]
    if not (directory / WEIGHTS_NAME).is_file():
        raise FileNotFoundError(f"heads {name!r} should be in {str(directory)!r}, which has no {WEIGHTS_NAME}: "
                                "this installation of specheads is incomplete (reinstall it)")
    return directory


def read_heads_config(directory: str | os.PathLike) -> HeadsConfig:
    """The HeadsConfig of a heads directory or Hub id (resolve_heads_dir)."""
    directory = resolve_heads_dir(directory)
    path = directory / CONFIG_NAME
    if not directory.exists():
        raise FileNotFoundError(f"heads directory {str(directory)!r} does not exist; pass a directory written by "
                                "`specheads train` or a Hub repo id (org/name)")
    if not path.is_file():
        raise FileNotFoundError(f"heads directory {str(directory)!r} has no {CONFIG_NAME}; expected a "
                                "directory written by `specheads train` (config.json + model.safetensors)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    return HeadsConfig.from_dict(raw, source=str(path))


def load_heads(directory: str | os.PathLike, target: TargetIdentity | None = None,
               device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> tuple[nn.Module, HeadsConfig]:
    """Load heads from a directory or Hub id (resolve_heads_dir); with `target`, first check
    they fit it (hidden, vocab, architecture)."""
    directory = resolve_heads_dir(directory)
    config = read_heads_config(directory)
    if target is not None:
        config.check_fits(target, source=f"heads at {str(directory)!r}")
    heads = build_heads(config)
    weights = directory / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"heads directory {str(directory)!r} has no {WEIGHTS_NAME}")
    state = load_file(str(weights))
    missing, unexpected = heads.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{weights} does not match a {config.kind} head of this config: "
                         f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    heads.to(device=device, dtype=dtype)
    heads.eval()
    return heads, config


def update_tree(directory: str | os.PathLike, tree: dict, tuning_report: dict | None = None) -> HeadsConfig:
    """Replace the heads directory's `tree` (config.json) and, with a report, write
    tuning.json beside it (`specheads tune`'s measured sweep), then its model card. Each file
    is replaced atomically; the report is written first, so a config's tree never points at a
    missing or older sweep. -> the updated config."""
    check_writable(directory)
    directory = Path(directory)
    config = read_heads_config(directory)
    if not isinstance(tree, dict) or not (tree.get("paths") or tree.get("dynamic")):
        raise ValueError(f"a heads tree needs 'paths' (a static tree) or 'dynamic' (a dynamic tree config), "
                         f"got {tree!r}")
    if tuning_report is not None:
        atomic.write_text(directory / TUNING_NAME, json.dumps(tuning_report, indent=2) + "\n")
    config.tree = dict(tree)
    atomic.write_text(directory / CONFIG_NAME, json.dumps(config.to_dict(), indent=2) + "\n")
    model_card.write_card(directory, config)
    return config


def check_writable(name_or_path: str | os.PathLike) -> None:
    """A one-line error when `name_or_path` is not a local heads directory that can be written
    back (a Hub id resolves into the read-only Hub cache). Call it before work whose result is
    stored in the directory."""
    if is_shipped_name(name_or_path):
        directory = shipped_heads_dir(str(name_or_path))
        raise ValueError(f"heads {str(name_or_path)!r} ship inside specheads and are not rewritten in place: copy "
                         f"them (`cp -r {directory} DIR`) and pass DIR")
    if not Path(name_or_path).expanduser().is_dir() and _looks_like_hub_id(str(name_or_path)):
        raise ValueError(f"heads {str(name_or_path)!r} is a Hub repo id; its files in the Hub cache are not ours to "
                         f"rewrite: download them (`hf download {name_or_path} --local-dir DIR`) and pass DIR")


def read_tuning(directory: str | os.PathLike) -> dict | None:
    """The sweep `specheads tune` stored in the heads directory, or None when never tuned."""
    path = resolve_heads_dir(directory) / TUNING_NAME
    return json.loads(path.read_text()) if path.is_file() else None
