"""Load test for `specheads serve`: TTFT, inter-token latency and throughput at several client
concurrencies, with speculation on and off (the per-request `speculate` switch, one server).

    python -m specheads.bench.tools.serve_load --target embedded:tiny --heads runs/demo/heads \\
        [--concurrency 1,4,16] [--requests 16] [--max-tokens 64] [--torch-threads 1] [--lookup-num-tokens N] [--output-json OUT.json]
    python -m specheads.bench.tools.serve_load --url http://127.0.0.1:8000 --model NAME ...   # a running server

Without --url the script starts `specheads serve` as a subprocess on a free port (so the
server's engine does not share a GIL with the clients) and stops it at the end.

Each client runs its requests one after another (streaming /v1/completions, greedy,
`ignore_eos` so every request makes exactly --max-tokens tokens) over the shipped prompt
set. Measured per request, on the client: TTFT = request sent -> first non-empty text
chunk; ITL = (last chunk - first chunk) / (completion tokens - 1), the mean gap between
tokens (chunks carry several tokens when speculation accepts drafts, so per-chunk gaps
would overstate it). tokens/s = all completion tokens / wall time of the run. alpha and tau
come from the server's /metrics counters, differenced around each level (tau counts
speculative verify steps only: a request that fell back to plain decoding adds none).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import httpx

from specheads.bench.support import free_port, metric_samples
from specheads.serving.decode.stats import alpha_tau


def _percentile(values: list[float], q: float) -> float:
    """bench.harness.percentile with q in 0..1; NaN for no values (the table prints it)."""
    from specheads.bench.harness import percentile

    value = percentile(values, 100 * q)
    return float("nan") if value is None else value


async def _one_request(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    start = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {"error": f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            now = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(choice.get("text") for choice in chunk["choices"]):
                first = now if first is None else first
                last = now
    if first is None:
        return {"error": "no text arrived"}
    return {"ttft": first - start, "itl": (last - first) / (tokens - 1) if tokens > 1 else None, "tokens": tokens}


async def run_level(url: str, model: str, prompts: list[str], concurrency: int, requests: int, max_tokens: int,
                    speculate: bool, api_key: str | None) -> dict:
    """`concurrency` clients share `requests` requests; -> the summary row."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    results: list[dict] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            body = {"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True, "speculate": speculate,
                    "stream_options": {"include_usage": True}}
            results.append(await _one_request(client, url, body))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, headers=headers, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] * 1e3 for r in ok]
    itl = [r["itl"] * 1e3 for r in ok if r["itl"] is not None]
    return {"speculate": speculate, "concurrency": concurrency, "requests": len(results),
            "errors": len(results) - len(ok), "ttft_p50_ms": _percentile(ttft, 0.5),
            "ttft_p90_ms": _percentile(ttft, 0.9), "itl_p50_ms": _percentile(itl, 0.5),
            "itl_p90_ms": _percentile(itl, 0.9), "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
            "wall_s": wall, "itl_mean_ms": statistics.fmean(itl) if itl else float("nan")}


SPEC_COUNTERS = ("specheads_spec_decode_num_drafts_total", "specheads_spec_decode_num_draft_tokens_total",
                 "specheads_spec_decode_num_accepted_tokens_total")


def scrape_spec_counters(url: str, api_key: str | None) -> dict[str, float]:
    """The server's speculative-decoding counters (to difference around one level)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text = httpx.get(url + "/metrics", headers=headers, timeout=30).text
    return {name: value for name, labels, value in metric_samples(text) if name in SPEC_COUNTERS}


def add_acceptance(row: dict, before: dict[str, float], after: dict[str, float]) -> dict:
    drafts, drafted, accepted = (after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_COUNTERS)
    row["alpha"], row["tau"] = alpha_tau(int(accepted), int(drafted), int(drafts)) if drafted else (None, None)
    return row


def start_server(args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "specheads", "serve", "--target", args.target, "--port", str(port),
               "--max-concurrency", str(args.max_concurrency), "--max-queue", str(max(64, args.requests)),
               "--log-level", "warning"]
    if args.heads:
        command += ["--heads", args.heads]
    if args.torch_threads is not None:
        command += ["--torch-threads", str(args.torch_threads)]
    if args.lookup_num_tokens is not None:
        command += ["--lookup-num-tokens", str(args.lookup_num_tokens)]
    process = subprocess.Popen(command, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"`specheads serve` exited with status {process.returncode} during startup")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.terminate()
    raise TimeoutError("the server did not become healthy within 600 s")


def format_table(rows: list[dict]) -> str:
    lines = ["| speculation | clients | requests | errors | TTFT p50 ms | TTFT p90 ms | ITL p50 ms | ITL p90 ms "
             "| tokens/s | alpha | tau |", "|---|---|---|---|---|---|---|---|---|---|---|"]

    def opt(value) -> str:
        return "-" if value is None else f"{value:.2f}"

    for r in rows:
        lines.append(f"| {'on' if r['speculate'] else 'off'} | {r['concurrency']} | {r['requests']} | {r['errors']} "
                     f"| {r['ttft_p50_ms']:.1f} | {r['ttft_p90_ms']:.1f} | {r['itl_p50_ms']:.2f} "
                     f"| {r['itl_p90_ms']:.2f} | {r['tokens_per_s']:.1f} | {opt(r.get('alpha'))} | {opt(r.get('tau'))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="serve_load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="embedded:tiny")
    parser.add_argument("--heads", default=None)
    parser.add_argument("--url", default=None, help="use a running server instead of starting one")
    parser.add_argument("--model", default=None, help="the served model name (default: --target)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts")
    parser.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=16, help="the started server's batch size")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="the started server's torch threads (1 avoids OpenMP oversubscription on a busy machine)")
    parser.add_argument("--lookup-num-tokens", type=int, default=None, metavar="N",
                        help="the started server's --lookup-num-tokens (default: what the heads directory stores; "
                             "0: off)")
    parser.add_argument("--output-json", default=None, metavar="PATH", help="write the rows here")
    args = parser.parse_args(argv)
    try:
        levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--concurrency expects comma-separated integers like 1,4,16, got {args.concurrency!r}")
    if not levels or min(levels) < 1 or args.requests < 1 or args.max_tokens < 2:
        parser.error("--concurrency values and --requests must be >= 1, --max-tokens >= 2")
    from specheads.bench.prompts import WARMUP_NEW_TOKENS, load_prompts

    prompts = [p.text for p in load_prompts()]
    process = None
    url = args.url
    if url is None:
        process, url = start_server(args)
    try:
        model = args.model or args.target
        asyncio.run(run_level(url, model, prompts, 1, 2, WARMUP_NEW_TOKENS, True, args.api_key))  # warm-up
        rows = []
        for speculate in (True, False):
            for concurrency in levels:
                before = scrape_spec_counters(url, args.api_key)
                row = asyncio.run(run_level(url, model, prompts, concurrency, max(args.requests, concurrency),
                                            args.max_tokens, speculate, args.api_key))
                rows.append(add_acceptance(row, before, scrape_spec_counters(url, args.api_key)))
                print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(60)
    print(format_table(rows))
    if args.output_json:
        from specheads.heads import atomic

        atomic.write_json(args.output_json, {"schema": "specheads.serve_load/1", "max_tokens": args.max_tokens, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
