"""Our EAGLE-3 export through vLLM's format library, `speculators`, and back to the same drafts.

speculators 0.9.0 pins transformers <= 5.19 (specheads runs a newer one), so it runs in a
separate venv: SPECHEADS_SPECULATORS_PYTHON names its python, else the test builds one in
the pytest cache with pip (needs PyPI once; see speculators_venv). tests/heads/speculators_roundtrip.py
runs there: it converts our export with speculators' converter, loads the result with
speculators' Eagle3DraftModel on CPU and drafts from hidden states this test saves. The
test checks the converted names, weights and config, and that its drafts equal our
Eagle3Head's (token ids exact, fp32 logits to 1e-5). Slow: about 15 s with a ready venv,
35 s when it builds one.

Shape legend: J draft steps, T rows, H hidden, Vd draft vocab.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_tiny_model
from specheads.heads.artefacts import export_eagle3
from specheads.heads.artefacts.export import export_heads
from specheads.heads.artefacts.heads_dir import build_heads, eagle_heads_config, save_heads
from specheads.heads.target.adapter import TargetAdapter

SPECULATORS = "speculators==0.9.0"
SPECULATORS_TRANSFORMERS = "transformers<=5.19"  # speculators 0.9.0's own pin
ROUNDTRIP_SCRIPT = Path(__file__).with_name("speculators_roundtrip.py")
NUM_TARGET_LAYERS = 4  # taps [1, 2, 3]: distinct EAGLE-3 ids (speculators refuses repeated ones)
DRAFT_VOCAB, NUM_STEPS = 96, 3
SEQ = 128  # speculators' flex-attention mask grows by whole 128-row blocks per draft step


def speculators_venv(request, tmp_path_factory) -> str:
    """The python of a venv with speculators: SPECHEADS_SPECULATORS_PYTHON, else one built in
    the pytest cache (reused by later runs).

    The venv sees the system site-packages so it keeps this torch (pinned, so pip never
    fetches another one). speculators requires torchvision and torchaudio but never imports
    them; PyPI's builds of them need CUDA torch libraries, and transformers imports an
    installed torchvision and fails on a CPU torch, so they are removed again.
    """
    if os.environ.get("SPECHEADS_SPECULATORS_PYTHON"):
        return os.environ["SPECHEADS_SPECULATORS_PYTHON"]
    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    cache_dir = cache.mkdir("speculators-0.9.0-venv") if cache else tmp_path_factory.mktemp("speculators-venv")
    python, ready = cache_dir / "bin" / "python", cache_dir / "specheads-ready"
    if ready.is_file():
        return str(python)
    torch_pin = "torch==" + torch.__version__.split("+")[0]
    steps = [[sys.executable, "-m", "venv", "--system-site-packages", "--clear", str(cache_dir)],
             [str(python), "-m", "pip", "install", "-q", SPECULATORS, SPECULATORS_TRANSFORMERS, torch_pin],
             [str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio"]]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            pytest.fail(f"building the speculators venv failed at {' '.join(step)}:\n{done.stderr[-4000:]}\n"
                        "set SPECHEADS_SPECULATORS_PYTHON to a python with speculators installed")
    ready.write_text(SPECULATORS + "\n")
    return str(python)


def make_eagle3_heads(target: TargetAdapter, directory: Path):
    """A randomly initialised EAGLE-3 head over a random draft vocab, saved to `directory`."""
    config = eagle_heads_config(target, num_steps=NUM_STEPS, draft_vocab_size=DRAFT_VOCAB)
    heads = build_heads(config)
    torch.manual_seed(3)
    with torch.no_grad():
        for param in heads.parameters():  # norms around 1, matrices spread like a trained head's
            param.normal_(mean=1.0 if param.dim() == 1 else 0.0, std=0.3)
    draft_to_target = torch.sort(torch.randperm(target.vocab_size)[:DRAFT_VOCAB]).values
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[draft_to_target] = True
    heads.set_draft_vocab(draft_to_target - torch.arange(DRAFT_VOCAB), t2d)
    save_heads(directory, heads.eval(), config)
    return heads, config


@pytest.mark.slow
def test_speculators_converts_our_eagle3_export_and_drafts_what_we_draft(tmp_path, tmp_path_factory, request):
    python = speculators_venv(request, tmp_path_factory)
    target_dir = make_tiny_model("llama", tmp_path / "target", num_layers=NUM_TARGET_LAYERS)
    target = TargetAdapter.from_pretrained(str(target_dir))
    heads, config = make_eagle3_heads(target, tmp_path / "heads")
    export_heads(tmp_path / "heads", "eagle3", tmp_path / "eagle3")

    # Row t pairs the taps at token t with token t+1 (the next token's embedding).
    torch.manual_seed(4)
    ids = torch.randint(0, target.vocab_size, (1, SEQ + 1))
    with torch.no_grad():
        taps_BTnH = torch.cat(target(ids[:, :-1], config.tap_layers).taps, dim=-1)
    next_ids_BT = ids[:, 1:]
    save_file({"hidden_states": taps_BTnH.contiguous(), "input_ids": next_ids_BT.contiguous(),
               "position_ids": torch.arange(SEQ)[None], "num_steps": torch.tensor(NUM_STEPS)},
              str(tmp_path / "inputs.safetensors"))
    done = subprocess.run([python, str(ROUNDTRIP_SCRIPT), str(tmp_path / "eagle3"), str(target_dir),
                           str(tmp_path / "inputs.safetensors"), str(tmp_path / "speculators")],
                          capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
    report = json.loads((tmp_path / "speculators" / "report.json").read_text())
    assert report["speculators"] == SPECULATORS.split("==")[1]
    assert report["converter_warnings"] == []  # it loads with strict=False: misses would only be logged

    # The converted checkpoint: our tensors under vLLM's names, our config fields and taps.
    exported = json.loads((tmp_path / "eagle3" / "config.json").read_text())
    converted = report["converted_config"]
    layer = converted["transformer_layer_config"]
    assert converted["speculators_model_type"] == "eagle3"
    assert converted["eagle_aux_hidden_state_layer_ids"] == exported["eagle_aux_hidden_state_layer_ids"] \
        == export_eagle3.taps_to_vllm_ids(config.tap_layers, NUM_TARGET_LAYERS)
    assert (converted["draft_vocab_size"], converted["norm_before_residual"]) == (DRAFT_VOCAB, False)
    assert converted["speculators_config"]["verifier"]["name_or_path"] == str(target_dir)
    assert {key: layer[key] for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                                        "num_key_value_heads", "vocab_size", "rms_norm_eps", "num_hidden_layers",
                                        "max_position_embeddings", "hidden_act")} == \
        {key: exported[key] for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                                        "num_key_value_heads", "vocab_size", "rms_norm_eps", "num_hidden_layers",
                                        "max_position_embeddings", "hidden_act")}
    assert layer["rope_parameters"]["rope_theta"] == exported["rope_theta"]
    ours = load_file(str(tmp_path / "eagle3" / "model.safetensors"))
    theirs = load_file(str(tmp_path / "speculators" / "converted" / "model.safetensors"))
    assert sorted(theirs) == sorted(name.replace("midlayer.", "layers.0.") for name in ours)
    for name, tensor in ours.items():
        assert torch.equal(theirs[name.replace("midlayer.", "layers.0.")], tensor), name

    # Its drafts from the same hidden states: step j at row t reads token t+1+j, so the last
    # j rows read past the block (token 0 there, a zero embedding here) and are not compared.
    drafts = load_file(str(tmp_path / "speculators" / "drafts.safetensors"))
    with torch.no_grad():
        logits_JBTV, _ = heads(taps_BTnH, target.embeddings()(next_ids_BT), num_steps=NUM_STEPS)
    assert torch.equal(drafts["d2t"], heads.d2t)
    assert drafts["logits"].shape == logits_JBTV.shape == (NUM_STEPS, 1, SEQ, DRAFT_VOCAB)
    for step in range(NUM_STEPS):
        rows = slice(0, SEQ - step)
        ours_BTV, theirs_BTV = logits_JBTV[step, :, rows], drafts["logits"][step, :, rows]
        torch.testing.assert_close(theirs_BTV, ours_BTV, rtol=1e-5, atol=1e-5)
        their_ids_BT = drafts["draft_ids"][step, :, rows]  # draft vocab ids; target id = id + d2t[id]
        assert torch.equal(their_ids_BT, ours_BTV.argmax(-1))
        assert torch.equal(their_ids_BT + drafts["d2t"][their_ids_BT], heads.draft_to_target()[ours_BTV.argmax(-1)])
