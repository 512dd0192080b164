"""The GPU suite (bench/gpu_suite.py) in --tiny CPU mode, so it cannot rot between the rare
runs on a GPU.

The suite runs in a subprocess as the device machine would run it: the packages that
machine lacks (deepspeed, fastapi, uvicorn, wandb, datasets, gguf) are hidden from every
import, as if not installed. Every section must finish with no error, greedy decoding must
be lossless and the interpreted kernel must match its reference; the JSON and markdown
must hold every section.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specheads.bench import gpu_suite

MISSING_ON_DEVICE = ("deepspeed", "fastapi", "uvicorn", "wandb", "datasets", "gguf")

# Hides MISSING_ON_DEVICE (argv[1], comma-separated) from the path finder, so importlib's
# find_spec returns None and an import raises ModuleNotFoundError, as without the package;
# then runs the rest of argv as `python -m ...` would.
LAUNCHER = """
import importlib.machinery, runpy, sys

HIDDEN = set(sys.argv.pop(1).split(","))
assert not HIDDEN & set(sys.modules), "already imported at start-up"


class HideMissing(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        return super().find_spec(name, path, target)


sys.meta_path[:] = [HideMissing if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
if sys.argv[1] == "-c":
    exec(sys.argv[2])
else:
    runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)
"""


def run_hidden(*args: str, timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-c", LAUNCHER, ",".join(MISSING_ON_DEVICE), *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def suite_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-suite")
    proc = run_hidden("specheads.bench.gpu_suite", "--out", str(out), "--device", "cpu", "--tiny", timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "gpu_suite.json").read_text())
    return report, (out / "gpu_suite.md").read_text()


def test_the_launcher_really_hides_the_missing_packages():
    check = ("import importlib, importlib.util\n"
             f"for name in {MISSING_ON_DEVICE!r}:\n"
             "    assert importlib.util.find_spec(name) is None, name\n"
             "    try:\n"
             "        importlib.import_module(name)\n"
             "    except ModuleNotFoundError:\n"
             "        continue\n"
             "    raise AssertionError(name)\n"
             "import torch, transformers, triton\n"
             "print('hidden')")
    proc = run_hidden("-c", check, timeout=300)
    assert proc.returncode == 0 and "hidden" in proc.stdout, proc.stderr[-4000:]


def test_every_section_runs_without_error(suite_run):
    report, _ = suite_run
    assert list(report["sections"]) == list(gpu_suite.SECTIONS)
    for name, record in report["sections"].items():
        assert record["ok"] and "error" not in record, f"{name}: {record.get('traceback')}"
        assert record["result"]["rows"], name
    meta = report["meta"]
    assert meta["tiny"] and meta["triton_interpret"] == "1"
    assert meta["torch"] and meta["triton"] and meta["device_name"].startswith("cpu")
    assert meta["command"].startswith("python -m specheads.bench.gpu_suite") and "--tiny" in meta["command"]


def test_figures(suite_run):
    sections = {name: record["result"] for name, record in suite_run[0]["sections"].items()}
    parity = sections["parity"]
    assert parity["all_passed"]
    assert {row["dtype"] for row in parity["rows"]} == {"float32", "bfloat16", "float16"}
    lossless = sections["lossless"]
    assert lossless["lossless"] is True
    fp32 = [row for row in lossless["rows"] if row["dtype"] == "float32"]
    assert len(fp32) == len(lossless["bf16_match_rate"]) and all(all(row["identical_per_prompt"]) for row in fp32)
    assert all(0.0 <= rate <= 1.0 for rate in lossless["bf16_match_rate"].values())
    assert next(row for row in fp32 if row["decoder"] == "medusa-oracle+kernel")["tau"] > 1.5
    # The static-shape verify that CUDA graphs capture (run eagerly on the CPU) is among the lossless rows.
    assert next(row for row in fp32 if row["decoder"] == "medusa-oracle+kernel+graphs")["tau"] > 1.5
    assert {"plain+graphs", "eagle3-random+kernel+graphs"} <= {row["decoder"] for row in fp32}
    speed = sections["kernel_speed"]["rows"]
    assert {row["impl"] for row in speed} >= {"triton_tree_kernel", "sdpa_bool_mask"}
    assert all(row["ms"] > 0 and "error" not in row for row in speed)
    verify = sections["verify_vs_decode"]["rows"]
    assert {(row["attention"], row["T"]) for row in verify} == \
        {(attn, t) for attn in ("sdpa", "tree") for t in (1, *gpu_suite.TINY["verify_trees"])}
    end_to_end = sections["end_to_end"]["rows"]
    assert {row["batch"] for row in end_to_end} == {1, gpu_suite.TINY["e2e_batch"]}
    oracle = [row for row in end_to_end if row["method"] == "engine-medusa-oracle"]
    assert len(oracle) == 2 and all(row["tau"] > 1.5 and row["tokens_per_s"] > 0 for row in oracle)
    graphed = [row for row in end_to_end if row["method"] == "engine-medusa-oracle+kernel+graphs"]
    assert [row["batch"] for row in graphed] == [1, gpu_suite.TINY["e2e_batch"]]
    assert all(row["tau"] > 1.5 and row["identical_to_hf"] == 1.0 for row in graphed)
    assert {row["model"] for row in end_to_end} == set(gpu_suite.TINY["e2e_models"])
    graphs = sections["graphs"]["rows"]
    trees = gpu_suite.TINY["verify_trees"]
    assert [(row["attention"], row["T"]) for row in graphs] == [("sdpa", t) for t in (1, *trees)] + \
        [("tree", t) for t in (1, *trees)]
    # On the CPU nothing is captured, and each row says why instead of giving a replay time.
    assert all(row["eager_ms"] > 0 and "graph_ms" not in row and "CUDA" in row["graph_error"] for row in graphs)


def test_markdown_holds_every_section(suite_run):
    report, markdown = suite_run
    assert report["meta"]["command"] in markdown
    for name in gpu_suite.SECTIONS:
        assert f"## {name}" in markdown and f"| {name} | yes |" in markdown


def test_peak_bandwidth_by_device_name():
    assert gpu_suite.peak_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert gpu_suite.peak_bandwidth("NVIDIA H200") == 4.8e12
    assert gpu_suite.peak_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert gpu_suite.peak_bandwidth("NVIDIA A10G") is None
