"""llama.cpp as a peer in `specheads bench --llama-cpp DIR`, and its one-time build.

Rows (each decodes the bench's own prompt token ids, rendered with the target tokenizer's chat
template by bench/prompts.py, sent as ids to llama-server's /completion; greedy: temperature 0,
top_k 1; no prompt cache):
    llama.cpp-plain           the target converted to GGUF (f32 when the bench runs fp32, else bf16)
    llama.cpp-ngram           the same, with llama.cpp's n-gram speculation (--spec-type ngram-simple)
    llama.cpp-<heads>[N]      the same, drafting with our EAGLE-3 heads (heads/artefacts/export_llama_cpp.py,
                              --spec-type draft-eagle3 --spec-draft-n-max N); one row per distinct
                              weights (heads directories that differ only in their tree share it);
                              [N,p=P] with --spec-draft-p-min P: a step drafts while the draft's
                              top probability is >= P, up to N tokens, and none below it
Every row's server also gets `server_args` (the bench's --llama-cpp-args, say `--poll 0`), except
the flags the bench sets itself (OWN_FLAGS).
Each row: tok/s (new tokens / wall seconds of the HTTP request, prefill included, as the
harness times HF generate), speedup over the bench's hf-greedy on the same prompts, alpha/tau
(docs/architecture.md invariant 8) and acceptance by depth from the server's Prometheus counters
(spec_decode_num_*_total, read before and after each request), and whether each output
equals llama.cpp-plain's token for token. Identity is judged against llama.cpp's own plain
greedy, not HF's: a GGUF forward rounds differently from PyTorch's.

Each row runs its own llama-server on 127.0.0.1 (a free port, --threads as torch uses), one
row after another (never two servers computing at once: llama.cpp's threads spin), with a
warm-up request; the server is stopped (SIGTERM, then SIGKILL) when its row ends or fails.

`build_llama_cpp(cache)` (`specheads llama-cpp build`) builds llama-server, llama-bench and
llama-cli from the pinned llama.cpp source (heads/artefacts/export_llama_cpp.pinned_source) into
<cache>/llama.cpp/build-..., statically linked (the build directory is renamed into place),
once, about 5 minutes on 2 cores. Nothing else needs it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from specheads.bench.harness import PromptRun, summarise
from specheads.bench.support import metric_samples
from specheads.heads.artefacts.export_llama_cpp import LLAMA_CPP_PYTHON, LlamaCppError
from specheads.heads.artefacts.llama_cpp_serve import EAGLE3_SPEC_TYPE, draft_args

SERVER = "llama-server"
BUILD_TARGETS = ("llama-server", "llama-bench", "llama-cli")
BUILD_ENTRY = "llama.cpp/build-llama-cpp-python-0.3.36-static-native"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_OPENSSL=OFF")
NGRAM_SPEC_TYPE = "ngram-simple"
START_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 900.0
METRIC = "llamacpp:spec_decode_num_"  # + draft_tokens_total | accepted_tokens_total | drafts_total
# llama-server flags each row sets itself (llama_server, the rows' own), so --llama-cpp-args may not
OWN_FLAGS = frozenset({"-m", "--model", "--host", "--port", "-t", "--threads", "-np", "--parallel", "-c",
                       "--ctx-size", "--metrics", "--no-webui", "-md", "--model-draft", "--spec-draft-model",
                       "--spec-type", "--spec-draft-n-max", "--spec-draft-p-min", "--draft-p-min"})


def server_args(text: str | None) -> list[str]:
    """--llama-cpp-args' text -> extra llama-server flags, refusing those a row sets itself."""
    import shlex

    try:
        args = shlex.split(text or "")
    except ValueError as err:
        raise ValueError(f"--llama-cpp-args {text!r} does not parse as shell words: {err}") from err
    taken = sorted({arg.split("=", 1)[0] for arg in args} & OWN_FLAGS)
    if taken:
        raise ValueError(f"--llama-cpp-args may not set {', '.join(taken)}: the bench sets it per row (the model, "
                         "server, threads and drafting; for drafting use --llama-cpp-draft-max / "
                         "--llama-cpp-draft-p-min)")
    return args


def find_server(directory: str | os.PathLike) -> Path:
    """llama-server in DIR, DIR/bin or DIR/build/bin, checked to know --spec-type draft-eagle3."""
    start = Path(directory).expanduser()
    if not start.is_dir():
        raise LlamaCppError(f"--llama-cpp {str(directory)!r} does not exist; build llama.cpp with "
                            "`specheads llama-cpp build` (it prints the directory) or pass a built checkout")
    for candidate in (start, start / "bin", start / "build" / "bin"):
        server = candidate / SERVER
        if server.is_file() and os.access(server, os.X_OK):
            break
    else:
        raise LlamaCppError(f"no {SERVER} in {str(start)!r}, its bin/ or build/bin/; pass the directory that "
                            "holds the built llama.cpp binaries")
    try:
        usage = subprocess.run([str(server), "--help"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        raise LlamaCppError(f"{server} does not run ({err})") from err
    if EAGLE3_SPEC_TYPE not in usage:
        raise LlamaCppError(f"the llama.cpp at {str(server)!r} is too old: its --spec-type has no {EAGLE3_SPEC_TYPE}; "
                            f"build {LLAMA_CPP_PYTHON}'s with `specheads llama-cpp build`")
    return server


def build_llama_cpp(cache_dir: str | os.PathLike, jobs: int | None = None, progress: bool = True) -> Path:
    """The cached llama.cpp build (bin/ with BUILD_TARGETS), built from the pinned source once."""
    from specheads.heads.artefacts.export_llama_cpp import pinned_source
    from specheads.heads.atomic import build_once

    final = Path(cache_dir) / BUILD_ENTRY
    if not final.is_dir():
        source = pinned_source(cache_dir, progress=progress)
        for tool in ("cmake", "ninja"):
            if shutil.which(tool) is None:
                raise LlamaCppError(f"building llama.cpp needs {tool} on PATH (pip install cmake ninja)")
        build_once(final, lambda staging: _build_into(source, staging, jobs or os.cpu_count() or 1, progress))
    # build_once gives a cache entry plain files' modes (heads/atomic.py publish_modes): the binaries
    # need their execute bits back.
    for name in BUILD_TARGETS:
        binary = final / "bin" / name
        binary.chmod(binary.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return final


def _build_into(source: Path, directory: Path, jobs: int, progress: bool) -> None:
    build = directory / "build"
    steps = [["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja", *CMAKE_FLAGS],
             ["cmake", "--build", str(build), "-j", str(jobs), "--target", *BUILD_TARGETS]]
    start = time.perf_counter()
    for step, command in zip(("configuring", "compiling"), steps):
        _say(progress, f"llama.cpp: {step} ({' '.join(command[:3])} ...; about 5 min on 2 cores, once)")
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            tail = []
            for line in proc.stdout:
                tail = (tail + [line.rstrip()])[-20:]
                if progress and line.startswith("[") and "/" in line.split("]")[0]:
                    print(f"\rllama.cpp: {line.split(']')[0]}]", end="", file=sys.stderr, flush=True)
        if progress:
            print(file=sys.stderr)
        if proc.returncode != 0:
            raise LlamaCppError(f"llama.cpp {step} failed (exit {proc.returncode}): {tail[-1] if tail else ''}")
    (directory / "bin").mkdir()
    for name in BUILD_TARGETS:
        shutil.copy2(build / "bin" / name, directory / "bin" / name)
    shutil.rmtree(build)
    _say(progress, f"llama.cpp: built {', '.join(BUILD_TARGETS)} in {time.perf_counter() - start:.0f}s")


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)


@contextmanager
def llama_server(server: Path, model: Path, extra: list[str], threads: int, log_path: Path):
    """A llama-server on 127.0.0.1 serving `model`, up within START_TIMEOUT_S; stopped on exit."""
    import httpx

    from specheads.bench.support import free_port

    port = free_port()
    command = [str(server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "--threads", str(threads),
               "--parallel", "1", "--ctx-size", "4096", "--metrics", "--no-webui", *extra]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise LlamaCppError(f"llama-server exited ({proc.returncode}) at start: {_tail(log_path)}")
            try:
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise LlamaCppError(f"llama-server did not come up in {START_TIMEOUT_S:.0f}s: {_tail(log_path)}")
            time.sleep(0.2)
        with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:
            yield client
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tail(path: Path) -> str:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return " | ".join(lines[-3:])[:500]


def spec_counters(client) -> dict[str, float]:
    """The server's cumulative speculative counters: {"draft_tokens", "accepted_tokens", "drafts",
    "pos<i>"} (drafts: verify steps that drafted; pos<i>: accepted draft tokens at position i)."""
    return spec_counters_of(client.get("/metrics").text)


def spec_counters_of(text: str) -> dict[str, float]:
    """spec_counters from llama-server's /metrics text."""
    counters = {}
    for name, labels, value in metric_samples(text):
        if not name.startswith(METRIC):
            continue
        name = name[len(METRIC):].removesuffix("_total")
        if name.startswith("accepted_tokens_per_pos"):
            name = "pos" + labels["position"]
        counters[name] = value
    return counters


def complete(client, prompt_ids: list[int], max_new_tokens: int) -> PromptRun:
    """One greedy /completion of token ids, timed, with its draft counts."""
    before = spec_counters(client)
    start = time.perf_counter()
    response = client.post("/completion", json={"prompt": prompt_ids, "n_predict": max_new_tokens,
                                                "temperature": 0.0, "top_k": 1, "cache_prompt": False,
                                                "return_tokens": True, "stream": False})
    seconds = time.perf_counter() - start
    if response.status_code != 200:
        raise LlamaCppError(f"llama-server answered {response.status_code}: {response.text[:300]}")
    body = response.json()
    delta = {k: v - before.get(k, 0.0) for k, v in spec_counters(client).items()}
    tokens = list(body["tokens"])
    drafted, accepted = int(delta.get("draft_tokens", 0)), int(delta.get("accepted_tokens", 0))
    depth = sum(1 for k in delta if k.startswith("pos"))
    prefill_s = body["timings"]["prompt_ms"] / 1000
    return PromptRun(tokens=tokens, seconds=seconds,
                     events=[(prefill_s, 1), (seconds, len(tokens) - 1)] if len(tokens) > 1 else [(seconds, 1)],
                     steps=max(len(tokens) - 1 - accepted, 0), drafted_tokens=drafted, accepted_tokens=accepted,
                     accepted_per_position=[int(delta[f"pos{i}"]) for i in range(depth)],
                     speculative_steps=int(delta.get("drafts", 0)))


def run_row(server: Path, model: Path, extra: list[str], prompts, max_new_tokens: int, threads: int,
            log_dir: Path, name: str, log=None) -> list[PromptRun]:
    """Every prompt through one llama-server (after a short warm-up), in order."""
    from specheads.bench.prompts import WARMUP_NEW_TOKENS

    with llama_server(server, model, extra, threads, log_dir / f"{name}.log") as client:
        complete(client, prompts[0].input_ids, min(WARMUP_NEW_TOKENS, max_new_tokens))
        runs = []
        for i, prompt in enumerate(prompts):
            if log:
                log(f"bench: {name} prompt {i + 1}/{len(prompts)}")
            runs.append(complete(client, prompt.input_ids, max_new_tokens))
    return runs


def reference_runs(report: dict) -> list[PromptRun]:
    """hf-greedy's per-prompt token counts and seconds from a bench report (for speedups)."""
    reference = next(m for m in report["methods"] if m["name"] == report["reference"])
    return [PromptRun(tokens=[0] * p["num_tokens"], seconds=p["seconds"], events=[]) for p in reference["prompts"]]


def bench_llama_cpp(directory: str | os.PathLike, report: dict, prompts, max_new_tokens: int, *, target_dir: str,
                    heads: list[tuple[str, str]], converter: Path, outtype: str, draft_max: int = 3,
                    draft_p_min: float = 0.0, extra_args: list[str] = (), threads: int | None = None,
                    pre_tokenizer: str | None = None, log=None) -> dict:
    """The llama.cpp rows for `report` (a bench report on the same prompts): {"config", "methods"}.
    heads: [(label, EAGLE-3 heads directory)]; Medusa heads have no llama.cpp drafter.
    extra_args: more llama-server flags for every row (server_args)."""
    from specheads.heads.artefacts.export_llama_cpp import export_llama_cpp, run_converter

    server = find_server(directory)
    threads = threads or _torch_threads()
    rows: list[tuple[str, str, Path, list[str]]] = []
    with tempfile.TemporaryDirectory(prefix="specheads-llama-cpp-") as scratch:
        scratch = Path(scratch)
        target_gguf = run_converter(converter, Path(target_dir), scratch / "target.gguf", outtype,
                                    pre_tokenizer=pre_tokenizer)
        rows.append(("llama.cpp-plain", "llama.cpp-plain", target_gguf, [*extra_args]))
        rows.append(("llama.cpp-ngram", "llama.cpp-ngram", target_gguf,
                     ["--spec-type", NGRAM_SPEC_TYPE, *extra_args]))
        chain = f"{draft_max}" + (f",p={draft_p_min:g}" if draft_p_min > 0 else "")
        for label, heads_dir, same in distinct_weights(heads):
            if same and log is not None:
                log(f"llama.cpp: {', '.join(same)} hold the weights of {label}: one row for them all "
                    f"(llama.cpp drafts a {draft_max}-token chain whatever their tree)")
            out = export_llama_cpp(heads_dir, scratch / f"heads-{len(rows)}", target_dir=target_dir,
                                   converter=converter, outtype=outtype, pre_tokenizer=pre_tokenizer,
                                   with_target=False)
            rows.append((f"llama.cpp-{label}[{chain}]", "llama.cpp-eagle3", target_gguf,
                         [*draft_args(out / "heads.gguf", draft_max, draft_p_min), *extra_args]))
        runs = {name: run_row(server, model, extra, prompts, max_new_tokens, threads, scratch, name, log)
                for name, _, model, extra in rows}
    plain, reference = runs["llama.cpp-plain"], reference_runs(report)
    methods = []
    for name, kind, _, extra in rows:
        identical = [run.tokens == base.tokens for run, base in zip(runs[name], plain)]
        methods.append({"name": name, "kind": kind, "server_args": extra,
                        "overall": summarise(runs[name], identical, reference)})
    return {"config": {"server": str(server), "converter": str(converter), "outtype": outtype, "threads": threads,
                       "draft_max": draft_max, "draft_p_min": draft_p_min, "server_args": list(extra_args),
                       "identical_to": "llama.cpp-plain"}, "methods": methods}


def distinct_weights(heads: list[tuple[str, str]]) -> list[tuple[str, str, list[str]]]:
    """[(label, heads directory)] -> one (label, directory, the other labels) per distinct
    model.safetensors, in first-seen order. Heads directories that differ only in their tree
    (a calibrated copy, a tuned one, a chain) give llama.cpp the same draft GGUF, so their rows
    would time one thing several times."""
    from specheads.heads.artefacts.heads_dir import WEIGHTS_NAME, resolve_heads_dir

    groups: dict[str, tuple[str, str, list[str]]] = {}
    for label, directory in heads:
        digest = hashlib.sha256((resolve_heads_dir(directory) / WEIGHTS_NAME).read_bytes()).hexdigest()
        if digest in groups:
            groups[digest][2].append(label)
        else:
            groups[digest] = (label, directory, [])
    return list(groups.values())


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def format_llama_cpp(section: dict) -> str:
    """Markdown: one row per llama.cpp method (identical = equal to llama.cpp-plain's output)."""
    config = section["config"]
    lines = [f"### llama.cpp ({config['outtype']} GGUF, {config['threads']} threads; speedup over hf-greedy; "
             "identical to llama.cpp-plain)", "",
             "| method | tokens | tok/s | speedup | alpha | tau | acc. by depth | identical |",
             "|---|---:|---:|---:|---:|---:|---|---|"]
    for method in section["methods"]:
        s = method["overall"]
        depth = " ".join(f"{a:.2f}" for a in s["acceptance_by_depth"][:6]) or "-"
        same = "yes" if s["identical"] else f"{s['num_identical']}/{s['num_prompts']}"
        lines.append(f"| {method['name']} | {s['num_tokens']} | {s['tokens_per_s']:.1f} | "
                     f"{_fmt(s['speedup'], '.2f')}x | {_fmt(s['alpha'], '.3f')} | {_fmt(s['tau'], '.2f')} | "
                     f"{depth} | {same} |")
    return "\n".join(lines)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)
