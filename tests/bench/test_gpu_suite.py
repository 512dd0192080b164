"""The GPU suite (bench/gpu/suite.py) in --tiny CPU mode, so it cannot rot between the rare
runs on a GPU.

The suite runs in a subprocess as the device machine would run it: the packages that
machine lacks (deepspeed, fastapi, uvicorn, pydantic, wandb, datasets, gguf) are hidden from
every import, as if not installed. Every section must finish with no error and produce its
fields (the compiled forward's rows, the floors' bytes, the peaked targets' decided share,
the profile's groups, the GEMM comparison, the goals), greedy decoding must be lossless with
everything on and the interpreted kernel must match its reference; the JSON and markdown must
hold every section. The goals' verdicts and the profile's kernel groups are checked on
known inputs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from specheads.bench.gpu import steps as gpu_steps, suite as gpu_suite

MISSING_ON_DEVICE = ("deepspeed", "fastapi", "uvicorn", "pydantic", "wandb", "datasets", "gguf")

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
    proc = run_hidden("specheads.bench.gpu.suite", "--output", str(out), "--device", "cpu", "--tiny",
                      "--compile-cache", str(out / "compile_cache.bin"), timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "gpu_suite.json").read_text())
    return report, (out / "gpu_suite.md").read_text(), proc.stdout


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



@pytest.mark.slow  # the suite end to end on a CPU: minutes; -m slow runs it
def test_every_section_runs_without_error(suite_run):
    report, _, stdout = suite_run
    assert list(report["sections"]) == list(gpu_suite.SECTIONS)
    for name, record in report["sections"].items():
        assert record["ok"] and "error" not in record and "skipped" not in record, f"{name}: {record.get('traceback')}"
        assert record["result"]["rows"], name
    meta = report["meta"]
    assert meta["tiny"] and meta["triton_interpret"] == "1" and meta["gpu_decoder"] == "compile"
    assert meta["torch"] and meta["triton"] and meta["device_name"].startswith("cpu")
    assert meta["command"].startswith("python -m specheads.bench.gpu.suite") and "--tiny" in meta["command"]
    assert meta["compile_cache"] == "none"  # nothing to load on a first run
    assert stdout.count("[gpu_suite] goal ") == len(report["goals"])


@pytest.mark.slow  # the suite end to end on a CPU: minutes; -m slow runs it
def test_step_times_compare_both_forwards_beside_their_bytes(suite_run):
    result = suite_run[0]["sections"]["step_time"]["result"]
    tiny = gpu_suite.TINY
    (model_name, _, context), = tiny["step_models"]
    sizes = {1: (1, *tiny["verify_trees"])}
    sizes |= {batch: (1, tiny["verify_trees"][0]) for batch in tiny["step_batches"][1:]}
    assert {(row["forward"], row["B"], row["T"]) for row in result["rows"]} == \
        {(forward, batch, size) for forward in ("hf", "compiled") for batch in sizes for size in sizes[batch]}
    for row in result["rows"]:
        assert row["model"] == model_name and row["context"] == context and row["ms"] > 0 and row["eager_ms"] > 0
        assert row["weight_bytes"] > 0 and row["kv_bytes"] > 0 and "floor_ms" not in row  # no HBM rate on a CPU
        assert row["ratio_to_decode"] == 1.0 if row["T"] == 1 else row["ratio_to_decode"] > 0
    # K/V bytes grow with rows and keys: batch 2 reads twice batch 1's at the same T.
    kv = {(row["B"], row["T"]): row["kv_bytes"] for row in result["rows"]}
    assert kv[2, 1] == 2 * kv[1, 1] and kv[1, tiny["verify_trees"][0]] > kv[1, 1]
    assert result["compile_s"][model_name] > 0  # the compiled forward compiled in this process


@pytest.mark.slow  # the suite end to end on a CPU: minutes; -m slow runs it
def test_end_to_end_on_peaked_targets(suite_run):
    result = suite_run[0]["sections"]["end_to_end"]["result"]
    rows, tiny = result["rows"], gpu_suite.TINY
    assert {row["batch"] for row in rows} == set(tiny["e2e_batches"]) and result["denominator"] == "engine-plain+graphs"
    at_one = {row["method"] for row in rows if row["batch"] == 1}
    assert at_one == {"hf-greedy", "engine-plain+graphs", "engine-oracle+graphs", "engine-eagle3-random+graphs",
                      "engine-plain+graphs/hf-forward", "engine-oracle+graphs/hf-forward"}
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["speedup"] > 0 and row["vs_hf"] > 0
        assert row["prefill_ms_per_prompt"] > 0  # timed apart from the decode steps
        assert row["floor_tokens_per_s"] is None and row["floor_fraction"] is None  # no HBM rate on a CPU
        assert row["strict_syncs"] is False  # sync debug mode is a GPU's
        assert row["identical_to_hf"] == 1.0 and row["num_not_near_tie"] == 0  # peaked: nothing near a tie
        if "oracle" in row["method"]:
            assert row["tau"] > 1.5
        if row["method"] == "engine-plain+graphs":
            assert row["speedup"] == 1.0
    summary = result["models"]["tiny"]
    assert summary["decided_share"] >= 0.95 and summary["tolerance"] > 0 and summary["positions"] > 0
    assert summary["verify_cost"] > 0 and summary["verify_nodes"] == 11 and 0 < summary["layer_scale"] <= 0.05
    assert summary["tries"][-1]["decided_share"] == summary["decided_share"]


@pytest.mark.slow  # the suite end to end on a CPU: minutes; -m slow runs it
def test_lossless_with_everything_on(suite_run):
    result = suite_run[0]["sections"]["lossless"]["result"]
    assert result["lossless"] is True
    fp32 = {row["decoder"]: row for row in result["rows"] if row["dtype"] == "float32"}
    assert len(fp32) == len(result["bf16_match_rate"]) and all(all(r["identical_per_prompt"]) for r in fp32.values())
    assert all(0.0 <= rate <= 1.0 for rate in result["bf16_match_rate"].values())
    for name in ("medusa-oracle+kernel", "medusa-oracle+kernel+graphs", "medusa-oracle+kernel+graphs+compiled"):
        assert fp32[name]["tau"] > 1.5, name  # multi-token paths really verified
    assert {"plain+kernel+graphs+compiled", "eagle3-random+kernel+graphs+compiled", "plain+graphs"} <= set(fp32)


@pytest.mark.slow  # the suite end to end on a CPU: minutes; -m slow runs it
def test_kernel_sections(suite_run):
    sections = {name: record["result"] for name, record in suite_run[0]["sections"].items()}
    parity = sections["parity"]
    assert parity["all_passed"] and {row["dtype"] for row in parity["rows"]} == {"float32", "bfloat16", "float16"}
    speed = sections["kernel_speed"]["rows"]
    assert {row["impl"] for row in speed} >= {"triton_tree_kernel", "sdpa_bool_mask"}
    assert all(row["ms"] > 0 and "error" not in row for row in speed)


@pytest.mark.slow  # the suite end to end on a CPU: minutes; -m slow runs it
def test_lossless_runs_first_and_the_new_sections_report(suite_run):
    report = suite_run[0]
    assert list(report["sections"])[0] == "lossless"
    blocks = report["sections"]["block_sizes"]["result"]
    assert blocks["triton"] and blocks["sm"] == 90
    if "error" not in blocks["rows"][0]:  # triton here can compile for NVIDIA (else the row says why not)
        assert {row["kernel"] for row in blocks["rows"]} == {"split", "merge"}
        assert blocks["fits"] is True and all(row["problems"] == [] for row in blocks["rows"])
    trained = report["sections"]["trained_heads"]["result"]
    assert {row["method"] for row in trained["rows"]} == {"engine-plain+graphs", "engine-eagle3-trained+graphs"}
    assert trained["speedup"] > 0 and trained["near_ties_only"] in (True, False)
    for row in trained["rows"]:
        assert row["tokens_per_s"] > 0 and row["prefill_ms_per_prompt"] > 0 and 0 <= row["identical_to_hf"] <= 1


@pytest.mark.slow  # the suite end to end on a CPU: minutes; -m slow runs it
def test_profile_gemm_and_autotune_sections(suite_run):
    sections = {name: record["result"] for name, record in suite_run[0]["sections"].items()}
    profile = sections["profile"]
    assert {row["forward"] for row in profile["rows"]} == {"hf", "compiled"} == set(profile["totals"])
    assert {row["group"] for row in profile["rows"]} <= {group for group, _ in gpu_steps.KERNEL_GROUPS}
    for forward, total in profile["totals"].items():
        shares = [row["share"] for row in profile["rows"] if row["forward"] == forward]
        assert total["kernel_ms_per_step"] > 0 and total["kernels_per_step"] > 0
        assert sum(shares) == pytest.approx(1.0)
    assert profile["top_kernels"] and all(row["us_per_step"] > 0 for row in profile["top_kernels"])
    # The compiled forward runs fewer ops per step than the model's own.
    assert profile["totals"]["compiled"]["kernels_per_step"] < profile["totals"]["hf"]["kernels_per_step"]
    gemm = sections["gemm"]["rows"]
    assert {(row["gemm"], row["M"]) for row in gemm} == \
        {(name, rows) for name in ("qkv", "o", "gate_up", "down", "lm_head") for rows in gpu_suite.TINY["gemm_rows"]}
    assert all(row["cublas_ms"] > 0 and row["inductor_ms"] > 0 and row["faster"] in ("cublas", "inductor")
               for row in gemm)
    autotune = sections["autotune_step"]
    assert {row["forward"] for row in autotune["rows"]} == {"compiled", "autotuned"} == set(autotune["compile_s"])


@pytest.mark.slow  # the suite end to end on a CPU: minutes; -m slow runs it
def test_report_leads_with_the_goals(suite_run):
    report, markdown, _ = suite_run
    assert markdown.index("## goals") < markdown.index("| section | ok |")
    assert report["meta"]["command"] in markdown
    for name in gpu_suite.SECTIONS:
        assert f"## {name}" in markdown and f"| {name} | yes |" in markdown
    names = [goal["goal"] for goal in report["goals"]]
    assert len(names) == 8 + 6 and all(goal.keys() == {"goal", "value", "target", "met"} for goal in report["goals"])
    met = {goal["goal"]: goal["met"] for goal in report["goals"]}
    assert met["fp32 greedy lossless, everything on"] is True
    assert met["tiny: peaked target, positions decided beyond bf16 rounding"] is True
    assert met["tiny: bf16 differences not at a near-tie"] is True
    assert met["tiny: plain decode step (compiled, graphed), share of the weight-read floor"] is None  # no HBM rate
    assert met["warm engine steps: no sync but the declared read (sync debug mode 'error')"] is None  # a GPU's check


def _report(step_rows, kernel_rows, e2e_rows, summary, lossless=True) -> dict:
    section = lambda result: {"ok": True, "result": result, "seconds": 1.0}
    return {"sections": {"step_time": section({"rows": step_rows}), "kernel_speed": section({"rows": kernel_rows}),
                         "end_to_end": section({"rows": e2e_rows, "models": {"m": summary}}),
                         "lossless": section({"rows": [], "lossless": lossless})}}


def test_goals_compare_each_figure_with_its_target():
    ctx = gpu_suite.make_context(torch.device("cpu"), tiny=False, step_models=(("m", {}, 4096),), e2e_models={"m": {}})
    steps = [dict(model="m", forward="compiled", B=1, T=1, ms=4.0, floor_fraction=0.8, ratio_to_decode=1.0),
             dict(model="m", forward="compiled", B=1, T=64, ms=4.8, ratio_to_decode=1.2),
             dict(model="m", forward="hf", B=1, T=1, ms=7.0, floor_fraction=0.45, ratio_to_decode=1.0)]
    kernels = [dict(impl="triton_tree_kernel", S=8192, T=1, pct_peak_hbm=70.0),
               dict(impl="triton_tree_kernel", S=8192, T=16, pct_peak_hbm=55.0),
               dict(impl="triton_tree_kernel", S=8192, T=64, pct_peak_hbm=10.0),  # T > 16: not a goal
               dict(impl="triton_tree_kernel", S=1024, T=1, pct_peak_hbm=20.0)]  # not the goal's S
    engine = lambda batch, method, speedup, identical=1.0, bad=0: dict(
        model="m", batch=batch, method=method, speedup=speedup, tau=4.0 if "oracle" in method else 0.0,
        identical_to_hf=identical, num_not_near_tie=bad)
    e2e = [engine(1, "hf-greedy", 0.2, 0.0, 3), engine(1, "engine-plain+graphs", 1.0),
           engine(1, "engine-oracle+graphs", 2.6), engine(8, "engine-oracle+graphs", 1.4, 0.75, 1),
           engine(32, "engine-oracle+graphs", 1.1)]
    report = _report(steps, kernels, e2e, dict(decided_share=0.99, verify_cost=1.25))
    found = {goal["goal"]: goal for goal in gpu_suite.goals(report, ctx)}
    assert found["m: plain decode step (compiled, graphed), share of the weight-read floor"]["met"] is True
    assert found["m: verify at T=64 in decode steps"]["met"] is False
    kernel = found["tree kernel at S=8192, T <= 16, % of HBM (least)"]
    assert kernel["value"] == 55.0 and kernel["met"] is False
    batch1 = found["m: oracle heads, batch 1, vs plain decoding with graphs"]
    assert batch1["met"] is True and batch1["target"].endswith("= 2.56")  # 0.8 x 4.0 / 1.25
    assert found["m: oracle heads, batch 8, vs plain decoding with graphs"]["met"] is False
    assert found["m: oracle heads, batch 32, vs plain decoding with graphs"]["met"] is True
    identical = found["m: bf16 prompts identical to HF greedy (every engine and batch)"]
    assert identical["value"] == pytest.approx((1 + 1 + 0.75 + 1) / 4)  # HF's own row not counted
    assert identical["met"] is False
    assert found["m: bf16 differences not at a near-tie"]["value"] == 1
    assert found["fp32 greedy lossless, everything on"]["met"] is True
    for row in e2e:  # every engine's warm steps ran under sync debug mode "error", and the section finished
        row["strict_syncs"] = row["method"] != "hf-greedy"
    report["sections"]["block_sizes"] = {"ok": True, "result": {"rows": [], "fits": False, "triton": "3.6.0"}}
    report["sections"]["trained_heads"] = {"ok": True, "result": {"rows": [], "speedup": 1.31, "near_ties_only": True}}
    found = {goal["goal"]: goal for goal in gpu_suite.goals(report, ctx)}
    assert found["warm engine steps: no sync but the declared read (sync debug mode 'error')"]["met"] is True
    assert found["tree kernel block sizes fit on this machine's Triton 3.6.0"]["met"] is False
    assert found["trained EAGLE-3 heads, batch 1, vs plain decoding with graphs"]["met"] is True
    assert found["trained EAGLE-3 heads, bf16: every difference from HF bf16 greedy at an fp32 near-tie"]["met"]
    missing = gpu_suite.goals({"sections": {}}, ctx)  # nothing measured: nothing met, nothing failed
    assert all(goal["met"] in (None, False) and goal["value"] in (None, False) for goal in missing)


@pytest.mark.parametrize("name, group", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1", "gemm"),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT", "gemm"),
    ("void gemv2T_kernel_val<int, int, __nv_bfloat16, float, float, 128, 16, 4, 4, false>", "gemm"),
    ("triton_tem_fused_mm_0", "gemm"),
    ("_tree_attn_split_kernel", "attention"),
    ("flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4>>", "attention"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm_rotary_elementwise"),
    ("triton_poi_fused_cat_mul_1", "norm_rotary_elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<MulFunctor>>",
     "norm_rotary_elementwise"),
    ("void at::native::index_elementwise_kernel<128, 4>", "copies"),
    ("void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>", "copies"),
    ("Memcpy DtoD (Device -> Device)", "copies"),
])
def test_kernel_groups(name, group):
    assert gpu_steps.kernel_group(name) == group


def test_a_budget_skips_the_sections_left(tmp_path):
    proc = run_hidden("specheads.bench.gpu.suite", "--output", str(tmp_path), "--device", "cpu", "--budget-s", "0",
                      "--sections", "profile,gemm", timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert list(report["sections"]) == ["profile", "gemm"]
    assert all(record["ok"] and "budget" in record["skipped"] for record in report["sections"].values())
    assert "over the 0 s budget" in (tmp_path / "gpu_suite.md").read_text()


def test_peak_bandwidth_by_device_name():
    assert gpu_suite.peak_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert gpu_suite.peak_bandwidth("NVIDIA H200") == 4.8e12
    assert gpu_suite.peak_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert gpu_suite.peak_bandwidth("NVIDIA A10G") is None


def test_verify_call_runs_the_tree_it_builds():
    """The step sections' verify forward attends through the tree kernel with the tree it drew:
    the same logits as the explicit 4-D tree mask, in both rows of a static cache of unequal
    lengths (a forward that dropped the tree arguments would run a causal chain instead)."""
    from specheads.bench.gpu.models import prefilled_cache, random_llama, verify_call
    from specheads.bench.gpu.kernels import random_tree_mask
    from specheads.heads.target.adapter import TargetAdapter

    tree = random_tree_mask(8, torch.Generator().manual_seed(8))
    assert not torch.equal(tree, torch.ones(8, 8, dtype=torch.bool).tril())  # not a chain
    target = TargetAdapter(random_llama(gpu_suite.LLAMA_TINY, torch.device("cpu"), torch.float32))
    cache = prefilled_cache(target, 2, 12, 9)
    cache.set_rows(1, 2)
    cache.truncate_row(1, 7)
    cache.set_rows(0, 2)
    with torch.inference_mode():
        through_kernel = verify_call(target, cache, 8, "tree")()
        through_mask = verify_call(target, cache, 8, "sdpa")()
    torch.testing.assert_close(through_kernel, through_mask, atol=1e-4, rtol=1e-4)


def test_the_device_run_script_runs_the_suite(tmp_path):
    """bench/gpu/run.sh as the device runs it, from a repository root without carried wheels:
    the package comes from its links, the suite's options pass through, the report lands in OUT."""
    repo, out, bin_dir = tmp_path / "repo", tmp_path / "out", tmp_path / "bin"
    for folder in (repo, out, bin_dir):
        folder.mkdir()
    for part in ("specheads", "heads", "training", "serving", "data", "recipes", "bench"):
        (repo / part).symlink_to(gpu_suite.Path(gpu_suite.__file__).resolve().parents[2] / part)
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # a link would lose the venv
    (bin_dir / "python3").chmod(0o755)
    env = dict(os.environ, OUT=str(out), WORK=str(tmp_path / "work"), PATH=f"{bin_dir}:{os.environ['PATH']}",
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH="")
    proc = subprocess.run(["bash", str(repo / "bench" / "gpu" / "run.sh"), "--device", "cpu", "--sections", "gemm"],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert f"from {tmp_path / 'work' / 'pkg'}" in proc.stdout  # the linked package, not an installed one
    report = json.loads((out / "gpu_suite.json").read_text())
    assert list(report["sections"]) == ["gemm"] and report["sections"]["gemm"]["ok"]
    assert "--budget-s 400" in report["meta"]["command"] and (out / "gpu_run.log").exists()
