"""specheads: self-speculative decoding heads for Hugging Face causal LMs.

The public Python API is re-exported here lazily, so `import specheads` stays fast and
never pulls in deepspeed, wandb, datasets or fastapi.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "TargetAdapter": "specheads.heads.target.adapter",
    "load_target": "specheads.heads.target.adapter",
    "MedusaHeads": "specheads.heads.medusa",
    "HeadsConfig": "specheads.heads.artefacts.heads_dir",
    "save_heads": "specheads.heads.artefacts.heads_dir",
    "load_heads": "specheads.heads.artefacts.heads_dir",
    "DraftTree": "specheads.serving.decode.trees",
    "SpeculativeDecoder": "specheads.serving.decode.config",
    "generate": "specheads.serving.decode.generate",
    "stream": "specheads.serving.decode.generate",
    "build_tiny_target": "specheads.data.tiny_target",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'specheads' has no attribute {name!r}")
