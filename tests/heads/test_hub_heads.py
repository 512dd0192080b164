"""Heads by Hugging Face Hub id (heads/artefacts/heads_dir.py resolve_heads_dir): every reader of a heads
directory takes `org/name`, resolved through huggingface_hub's snapshot_download and its cache.

Nothing touches the network: the tests build a Hub cache in the layout huggingface_hub writes
(models--ORG--NAME/blobs, snapshots/REV -> blobs, refs/main) and point HF_HUB_CACHE at it, with
HF_HUB_OFFLINE=1. huggingface_hub reads both when it is imported, so the commands run in a fresh
Python process."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from specheads.heads.artefacts.export import export_heads
from specheads.heads.artefacts.heads_dir import load_heads, read_heads_config, resolve_heads_dir

from test_export import make_medusa_dir

REPO_ID, EXPORT_ID, MISSING_ID = "specheads-test/tiny-medusa", "specheads-test/tiny-medusa-vllm", "specheads-test/gone"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def put_in_hub_cache(cache: Path, repo_id: str, source: Path) -> Path:
    """Store `source`'s files as huggingface_hub stores a download of `repo_id` at REVISION."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


def run_python(code: str, cache: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


LOAD_AND_EXPORT = """
import json, sys
import torch
from specheads.cli import main
from specheads.heads.artefacts.export import import_heads
from specheads.heads.artefacts.heads_dir import load_heads, read_tuning
original, out = sys.argv[1], sys.argv[2]

def same(a, b):
    a, b = a.state_dict(), b.state_dict()
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

hub, hub_config = load_heads("{repo}")
reference, _ = load_heads(original)
report = {{"same_as_original": same(hub, reference), "kind": hub_config.kind, "tuning": read_tuning("{repo}"),
          "export_rc": main(["export", "{repo}", "--format", "vllm-medusa", "--output", out + "/vllm"])}}
imported = import_heads("{export}", out + "/imported")
report["imported_same"] = same(load_heads(imported)[0], reference)
print(json.dumps(report))
""".format(repo=REPO_ID, export=EXPORT_ID)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """(Hub cache, the heads it holds) with a heads directory and a vLLM Medusa export in it."""
    tmp = tmp_path_factory.mktemp("hub")
    make_medusa_dir(tmp / "heads")
    (tmp / "heads" / "tuning.json").write_text('{"winner": "chain-3"}\n')
    export_heads(tmp / "heads", "vllm-medusa", tmp / "export")
    put_in_hub_cache(tmp / "cache", REPO_ID, tmp / "heads")
    put_in_hub_cache(tmp / "cache", EXPORT_ID, tmp / "export")
    return tmp / "cache", tmp / "heads"


def test_commands_load_and_export_heads_by_hub_id_from_the_cache(hub, tmp_path):
    cache, heads = hub
    result = run_python(LOAD_AND_EXPORT, cache, tmp_path, str(heads), str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"same_as_original": True, "kind": "medusa", "tuning": {"winner": "chain-3"}, "export_rc": 0,
                      "imported_same": True}
    exported = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    assert torch.equal(exported["lm_heads.0.weight"], load_file(str(heads / "model.safetensors"))["lm_head_weight"][0])
    assert (tmp_path / "vllm" / "README.md").is_file()


def test_a_local_directory_wins_over_a_hub_id(hub, tmp_path):
    cache, _ = hub
    make_medusa_dir(tmp_path / REPO_ID, draft_vocab=40)  # ./specheads-test/tiny-medusa: other heads, same name
    code = (f"from specheads.heads.artefacts.heads_dir import read_heads_config, resolve_heads_dir\n"
            f"print(resolve_heads_dir('{REPO_ID}'), read_heads_config('{REPO_ID}').draft_vocab_size)")
    result = run_python(code, cache, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [REPO_ID, "40"]
    result = run_python(code, cache, tmp_path / REPO_ID)  # elsewhere, the same name is the Hub's
    assert result.returncode == 0, result.stderr[-3000:]
    resolved, draft_vocab = result.stdout.split()
    assert resolved == str(cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / REVISION)
    assert draft_vocab == "None"


def test_a_missing_hub_id_is_one_line_naming_it_and_what_was_tried(hub, tmp_path):
    cache, _ = hub
    result = run_python("import sys; from specheads.cli import main; sys.exit(main(sys.argv[1:]))", cache, tmp_path,
                        "export", MISSING_ID, "--format", "medusa", "--output", str(tmp_path / "out"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    line = lines[0]
    assert line.startswith(f"specheads export: error: heads {MISSING_ID!r}: no local directory of that name")
    assert f"the Hub cache ({cache}) has no snapshot of the Hub repo {MISSING_ID!r}" in line
    assert "offline (HF_HUB_OFFLINE is set)" in line


def test_names_that_are_no_hub_id_stay_local_paths(tmp_path):
    assert resolve_heads_dir(tmp_path / "nowhere") == tmp_path / "nowhere"
    assert resolve_heads_dir("runs/demo/heads") == Path("runs/demo/heads")  # two slashes: a path, never an id
    with pytest.raises(FileNotFoundError, match="'runs/demo/heads' does not exist; pass a directory written by"):
        read_heads_config("runs/demo/heads")
    with pytest.raises(FileNotFoundError, match="not a Hub repo id either"):
        resolve_heads_dir("org/bad name")


# ---------------------------------------------------------------------------- in this process

@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hub cache that huggingface_hub (and transformers through it) reads in this
    process: both read constants.HF_HUB_CACHE at each call; HF_HUB_OFFLINE=1 (tests/conftest.py)."""
    from huggingface_hub import constants

    assert constants.is_offline_mode()
    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_serve_takes_heads_by_hub_id(hub_cache, monkeypatch, tmp_path):
    """`specheads serve --heads ORG/NAME` (README, "Share heads on the Hub"): the command line
    accepts the id and the server's loader loads those heads from the Hub cache."""
    import specheads.serving.server.server as server_module
    from specheads.cli import main
    from test_server_support import build_tiny_setup

    target_dir, heads_dir = build_tiny_setup(tmp_path)
    put_in_hub_cache(hub_cache, REPO_ID, heads_dir)
    served = {}

    def serve(config, loader, **kwargs):  # the server's model load, without listening
        served["decoder"], _ = loader()
        return SimpleNamespace(status="ready", error=None)

    monkeypatch.setattr(server_module, "serve", serve)
    assert main(["serve", "--target", str(target_dir), "--heads", REPO_ID, "--dtype", "float32",
                 "--device", "cpu"]) == 0
    heads = served["decoder"].drafter.heads
    reference, _ = load_heads(heads_dir)
    assert heads is not None and all(torch.equal(a, b) for a, b in zip(heads.state_dict().values(),
                                                                       reference.state_dict().values()))


def test_the_llama_cpp_export_takes_a_hub_target_id(hub_cache, tmp_path, capsys):
    """The quick start's heads record a Hub target id; llama.cpp's converter reads the target's
    files, so the export hands it the id's snapshot in the Hub cache."""
    from conftest import make_byte_bpe_tokenizer, make_tiny_model
    from specheads.cli import main
    from specheads.heads.artefacts.heads_dir import CONFIG_NAME
    from test_export_llama_cpp import NUM_LAYERS, TEXTS, write_eagle3_heads

    target_dir = make_tiny_model("llama", tmp_path / "target", vocab_size=300, num_layers=NUM_LAYERS)
    make_byte_bpe_tokenizer(target_dir, TEXTS)
    snapshot = put_in_hub_cache(hub_cache, TARGET_ID, target_dir)
    write_eagle3_heads(tmp_path / "heads", target_dir)
    config = json.loads((tmp_path / "heads" / CONFIG_NAME).read_text())
    config["target"]["name_or_path"] = TARGET_ID  # as heads trained on meta-llama/... record it
    (tmp_path / "heads" / CONFIG_NAME).write_text(json.dumps(config))
    converter_dir = fake_converter(tmp_path / "llama.cpp")
    assert main(["export", str(tmp_path / "heads"), "--format", "llama.cpp", "--output", str(tmp_path / "gguf"),
                 "--llama-cpp", str(converter_dir), "--no-target"]) == 0, capsys.readouterr().err
    calls = [json.loads(line) for line in (converter_dir / "calls.jsonl").read_text().splitlines()]
    assert [call["target_model_dir"] for call in calls] == [str(snapshot)]
    assert (tmp_path / "gguf" / "heads.gguf").is_file()
    capsys.readouterr()
    assert main(["export", str(tmp_path / "heads"), "--format", "llama.cpp", "--output", str(tmp_path / "gguf2"),
                 "--llama-cpp", str(converter_dir), "--no-target", "--target", MISSING_ID]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"target {MISSING_ID!r}: no local directory of that name" in err


TARGET_ID = "specheads-test/tiny-target"
FAKE_CONVERTER = '''\
"""convert_hf_to_gguf.py's command line, recorded; writes what check_draft_gguf reads."""
import json, sys
from pathlib import Path
import gguf
args = sys.argv[1:]
model_dir, out = Path(args[0]), args[args.index("--outfile") + 1]
target = args[args.index("--target-model-dir") + 1] if "--target-model-dir" in args else None
assert target is None or Path(target, "tokenizer.json").is_file(), "the converter reads the target's files"
with open(Path(__file__).with_name("calls.jsonl"), "a") as log:
    log.write(json.dumps({"model_dir": str(model_dir), "target_model_dir": target}) + "\\n")
writer = gguf.GGUFWriter(out, "eagle3")
writer.add_array("eagle3.target_layers", json.loads((model_dir / "config.json").read_text())[
    "eagle_aux_hidden_state_layer_ids"])
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_tensors_to_file()
writer.close()
'''


def fake_converter(directory: Path) -> Path:
    from test_export_llama_cpp import fake_llama_cpp

    fake_llama_cpp(directory)
    (directory / "convert_hf_to_gguf.py").write_text(FAKE_CONVERTER)
    return directory


@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "hi"], ["serve"], ["bench"], ["data", "regenerate", "--input", "IN", "--output", "OUT"],
    ["data", "cache", "--input", "IN", "--taps", "1", "--output", "OUT"]], ids=lambda argv: " ".join(argv[:2]))
def test_a_bad_hub_target_is_one_line_within_seconds_offline(hub_cache, tmp_path, capsys, argv):
    import time

    from specheads.cli import main

    source = tmp_path / "in.jsonl"
    source.write_text('{"turns": ["hi"]}\n')
    argv = [str(source) if a == "IN" else str(tmp_path / "out") if a == "OUT" else a for a in argv]
    started = time.monotonic()
    assert main([*argv, "--target", MISSING_ID, "--device", "cpu"]) == 2
    assert time.monotonic() - started < 5
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert f"target {MISSING_ID!r}: no local directory of that name, and the Hub cache ({hub_cache}) has no " \
           "snapshot" in err and "offline (HF_HUB_OFFLINE is set)" in err


def test_a_hub_target_that_does_not_load_is_one_line(hub_cache, tmp_path, capsys):
    """Its config.json is in the Hub cache (so the name checks pass) but not its weights: the
    load itself fails, as transformers does offline (an OSError), in one line, exit 2."""
    from conftest import make_tiny_model
    from specheads.cli import main

    full = make_tiny_model("llama", tmp_path / "full")
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "config.json").write_bytes((full / "config.json").read_bytes())
    put_in_hub_cache(hub_cache, TARGET_ID, tmp_path / "config-only")
    capsys.readouterr()
    assert main(["generate", "--target", TARGET_ID, "--prompt", "hi", "--device", "cpu"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("specheads generate: error: ") and TARGET_ID in errors[0], errors
