"""Run inside a venv with `speculators` (vLLM's format library) installed; started by
tests/heads/test_speculators.py, never imported by the suite (speculators 0.9.0 pins
transformers <= 5.19, older than specheads uses).

    python tests/heads/speculators_roundtrip.py EAGLE3_DIR VERIFIER_DIR INPUTS OUT_DIR

1. Converts EAGLE3_DIR (what `export_heads(..., "eagle3", ...)` writes) with speculators'
   converter, `speculators.convert.convert_model(algorithm="eagle3")` (Eagle3Converter),
   passing the tap ids and norm_before_residual from its config.json: the converter does
   not read them from the checkpoint, only from its arguments.
2. Loads the converted checkpoint with speculators' model class, Eagle3DraftModel, on CPU;
   it takes its token embeddings from VERIFIER_DIR, a local target model directory.
3. Runs the model's own forward (its training-time-test unroll, the default flex attention)
   on INPUTS (safetensors: hidden_states [1, T, 3H], the target taps concatenated in the
   tap order; input_ids [1, T], the next tokens; position_ids [1, T]; num_steps []) and
   catches each step's lm_head output.

Writes OUT_DIR/converted (the speculators checkpoint), OUT_DIR/drafts.safetensors
(logits [J, 1, T, Vd] fp32; draft_ids [J, 1, T], draft-vocab ids, as the model returns them;
d2t [Vd]) and OUT_DIR/report.json (versions, the converter's warnings, whether
from_pretrained loaded the verifier's embeddings by itself, the converted config).

Shape legend: J draft steps, T rows, H hidden, Vd draft vocab.
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version
from pathlib import Path

import torch
from loguru import logger
from safetensors.torch import load_file, save_file


def convert(eagle3_dir: Path, verifier_dir: Path, out_dir: Path) -> list[str]:
    """-> the converter's warnings (it loads the weights with strict=False and only logs misses)."""
    from speculators.convert import convert_model

    exported = json.loads((eagle3_dir / "config.json").read_text())
    warnings: list[str] = []
    sink = logger.add(lambda message: warnings.append(str(message).strip()), level="WARNING")
    try:
        convert_model(model=str(eagle3_dir), verifier=str(verifier_dir), algorithm="eagle3",
                      output_path=str(out_dir), validate_device="cpu",
                      eagle_aux_hidden_state_layer_ids=exported["eagle_aux_hidden_state_layer_ids"],
                      norm_before_residual=exported["norm_before_residual"])
    finally:
        logger.remove(sink)
    return warnings


def load_draft_model(converted_dir: Path, verifier_dir: Path):
    """-> (Eagle3DraftModel, whether from_pretrained alone gave it the verifier's embeddings)."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.utils.loading import load_model_layers

    model = Eagle3DraftModel.from_pretrained(str(converted_dir)).eval()
    # The converted checkpoint has no embed_tokens.weight (the engines use the target's).
    # speculators 0.9.0 takes the verifier's only if embed_tokens is still NaN, but under
    # transformers 5.x from_pretrained materialises that missing, `_is_hf_initialized` weight
    # with torch.empty_like and never initialises it, so the verifier's embeddings are loaded
    # only when that memory happens to hold a NaN. Record it, then load them for sure.
    verifier = load_model_layers(["embed_tokens.weight"], str(verifier_dir))["embed_tokens.weight"]
    loaded_by_itself = torch.equal(model.embed_tokens.weight, verifier.to(model.embed_tokens.weight.dtype))
    model._load_verifier_weights(overwrite_embed_tokens=True)
    unloaded = [name for name, param in model.named_parameters() if param.isnan().any()]
    if unloaded:  # the class fills what it expects to be loaded with NaN
        raise RuntimeError(f"parameters left unloaded (NaN) after from_pretrained: {unloaded}")
    return model, loaded_by_itself


def draft(model, inputs: dict[str, torch.Tensor], num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (logits [J, 1, T, Vd], draft ids [J, 1, T]) from Eagle3DraftModel.forward."""
    step_logits: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: step_logits.append(out.detach()))
    try:
        with torch.no_grad():
            draft_ids = model(hidden_states=inputs["hidden_states"], input_ids=inputs["input_ids"],
                              document_ids=torch.zeros_like(inputs["input_ids"]),
                              position_ids=inputs["position_ids"], ttt_steps=num_steps)
    finally:
        hook.remove()
    return torch.stack(step_logits).float(), torch.stack(draft_ids)


def main(eagle3_dir: str, verifier_dir: str, inputs_path: str, out_dir: str) -> None:
    out = Path(out_dir)
    inputs = load_file(inputs_path)
    warnings = convert(Path(eagle3_dir), Path(verifier_dir), out / "converted")
    model, embeddings_loaded_by_itself = load_draft_model(out / "converted", Path(verifier_dir))
    logits, draft_ids = draft(model, inputs, int(inputs["num_steps"]))
    save_file({"logits": logits.contiguous(), "draft_ids": draft_ids.contiguous(), "d2t": model.d2t.contiguous()},
              str(out / "drafts.safetensors"))
    report = {name: version(name) for name in ("speculators", "transformers", "torch")}
    report.update(converter_warnings=warnings, embeddings_loaded_by_from_pretrained=embeddings_loaded_by_itself,
                  converted_config=json.loads((out / "converted" / "config.json").read_text()))
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    main(*sys.argv[1:])
