"""What a llama.cpp export's files are called and the llama-server flags that draft with them,
defined once below the three modules that name them: the heads directory (heads_dir.py), its
model card (model_card.py, whose serve commands use them) and the exporter
(export_llama_cpp.py, which writes the files). Importing this module imports nothing else.
"""

from __future__ import annotations

import os

DRAFT_NAME, TARGET_NAME, INFO_NAME = "heads.gguf", "target.gguf", "llama_cpp_export.json"
EAGLE3_SPEC_TYPE = "draft-eagle3"  # llama-server's --spec-type for an EAGLE-3 heads GGUF
# The draft that serve commands recommend (the export's, the model card's): the best of eleven
# llama-server settings with GPU-trained heads on 2 cores (docs/results/2026-11-26-llama-cpp.md);
# the bench's defaults stay llama.cpp's own
SERVE_DRAFT_MAX, SERVE_DRAFT_P_MIN = 8, 0.8


def draft_args(heads_gguf: str | os.PathLike, draft_max: int, draft_p_min: float = 0.0) -> list[str]:
    """llama-server's flags to draft with an EAGLE-3 heads GGUF: up to draft_max tokens a step,
    and (draft_p_min > 0) only while the draft's top probability is at least draft_p_min."""
    check_draft(draft_max, draft_p_min)
    args = ["-md", str(heads_gguf), "--spec-type", EAGLE3_SPEC_TYPE, "--spec-draft-n-max", str(draft_max)]
    return args + (["--spec-draft-p-min", f"{draft_p_min:g}"] if draft_p_min > 0 else [])


def check_draft(draft_max: int, draft_p_min: float) -> None:
    """A one-line error for a draft length or probability floor llama-server cannot take."""
    if draft_max < 1:
        raise ValueError(f"--llama-cpp-draft-max (llama-server's --spec-draft-n-max) must be >= 1, got {draft_max}")
    if not 0.0 <= draft_p_min <= 1.0:
        raise ValueError(f"--llama-cpp-draft-p-min (llama-server's --spec-draft-p-min) must be in [0, 1], "
                         f"got {draft_p_min}")
