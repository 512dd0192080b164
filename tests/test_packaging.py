"""Installs where users are: triton (Linux wheels only) is a dependency on Linux alone, and the
CPU path imports and decodes without it, so `pip install` works on macOS and Windows.

Without triton is checked as it is there: a fresh interpreter in which importing triton fails
as it does when it is not installed (a finder ahead of every other on sys.meta_path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib

from packaging.requirements import Requirement

from conftest import REPO

NO_TRITON = """
import importlib.abc, importlib, json, pkgutil, sys

class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoTriton())
import torch
from transformers import AutoModelForCausalLM
from specheads.runner import load_decoder
from specheads.serving.decode.generate import generate
from specheads.serving.server import app  # the server too

failed = {}
for package in ("specheads", "specheads.heads", "specheads.heads.target", "specheads.heads.artefacts",
                "specheads.serving.decode", "specheads.serving.kernels", "specheads.serving.server", "specheads.data"):
    for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
        if info.name == "__main__":
            continue
        try:
            importlib.import_module(f"{package}.{info.name}")
        except ImportError as err:
            failed[f"{package}.{info.name}"] = str(err)
target, heads = sys.argv[1], sys.argv[2]
decoder, tokenizer = load_decoder(target, heads, dtype="float32", device="cpu", progress=False)
ids = tokenizer("the cat sat on the mat", add_special_tokens=False)["input_ids"]
ours = generate(decoder, ids, 12).tokens
model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
hf = model.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
import os
from specheads.serving.kernels.tree_attention import tree_attention
os.environ["TRITON_INTERPRET"] = "1"  # the kernel asked for: a one-line error naming triton, not a traceback
q = torch.zeros(1, 1, 2, 4)
try:
    tree_attention(q, q, q, 0, torch.ones(2, 2, dtype=torch.bool), impl="triton")
    triton_error = None
except ValueError as err:
    triton_error = str(err)
print(json.dumps({"triton_error": triton_error, "failed": failed, "same_as_hf": ours == hf, "drafted": decoder.speculates,
                  "triton_imported": "triton" in sys.modules}))
"""


def test_triton_is_a_dependency_on_linux_only():
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    triton = next(Requirement(d) for d in dependencies if Requirement(d).name == "triton")
    assert triton.marker is not None
    assert triton.marker.evaluate({"sys_platform": "linux", "platform_system": "Linux"})
    for system, platform in (("Darwin", "darwin"), ("Windows", "win32")):
        assert not triton.marker.evaluate({"sys_platform": platform, "platform_system": system})


def test_the_cpu_path_imports_and_decodes_without_triton(tmp_path):
    from test_server_support import build_tiny_setup

    target_dir, heads_dir = build_tiny_setup(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", NO_TRITON, str(target_dir), str(heads_dir)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    # only the Triton kernel's own modules need triton (imported lazily, on a GPU or under TRITON_INTERPRET)
    assert sorted(report["failed"]) == ["specheads.serving.kernels.custom_op",
                                        "specheads.serving.kernels.triton_kernel"]
    assert report == {**report, "same_as_hf": True, "drafted": True, "triton_imported": False}
    assert report["triton_error"].startswith("impl='triton' needs triton (No module named 'triton'")
