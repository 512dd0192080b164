"""`data regenerate --server`: replies made by real `specheads serve` processes on a tiny target.

Three servers of one tiny Llama (fp32, the exact mode, so every server gives the same greedy
replies whatever it batches them with) start once for the module. The reference is one
healthy server's output; a run over two servers, one killed mid-run, must equal it line for
line; a run whose only server is killed stops at the first record that failed every retry,
and a rerun on another server resumes there, writing nothing twice.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import make_tiny_model
from test_server_support import make_tokenizer

MODEL = "tiny"
MAX_MODEL_LEN = 256
TOPICS = ["the cat sat on the mat", "def f(x): return x + 1", "import os", "print the working directory",
          "what is a list?", "sort these numbers", "tell me about the sea", "one more thing"]
LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 60)  # longer than MAX_MODEL_LEN tokens


def records() -> list[dict]:
    """Chat records (one or two assistant turns, two shapes), user-turn records (one to three
    turns), a record without a reply (skipped) and one too long for the servers' context."""
    out = []
    for i in range(36):
        a, b = TOPICS[i % len(TOPICS)], TOPICS[(i * 3 + 1) % len(TOPICS)]
        if i % 3 == 0:
            out.append({"messages": [{"role": "user", "content": a}, {"role": "assistant", "content": "old"},
                                     {"role": "user", "content": b}, {"role": "assistant", "content": "older"}]})
        elif i % 3 == 1:
            out.append({"conversations": [{"from": "human", "value": f"{a} {i}"}, {"from": "gpt", "value": "x"}]})
        else:
            out.append({"turns": [a, b, f"and {i}?"][:1 + i % 4]})
    out[5] = {"messages": [{"role": "user", "content": "no reply here"}]}
    out[9] = {"messages": [{"role": "user", "content": LONG}, {"role": "assistant", "content": "x"}]}
    return out


def start_server(target_dir: Path) -> tuple[subprocess.Popen, str]:
    from specheads.bench.support import free_port

    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "specheads", "serve", "--target", str(target_dir), "--port", str(port),
         "--served-model-name", MODEL, "--dtype", "float32", "--torch-threads", "1", "--max-concurrency", "4",
         "--max-model-len", str(MAX_MODEL_LEN), "--graceful-timeout", "1", "--log-level", "error"],
        env=dict(os.environ, TOKENIZERS_PARALLELISM="false"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return process, f"http://127.0.0.1:{port}"


def wait_ready(process: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stdout.read().decode()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not become healthy")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Three `specheads serve` processes of one tiny target: -> {"a": url, "b": ..., "c": ...}, with
    the processes under "processes"."""
    target_dir = make_tiny_model("llama", tmp_path_factory.mktemp("served") / "target", vocab_size=512)
    make_tokenizer(target_dir)
    started = {name: start_server(target_dir) for name in "abc"}
    try:
        for process, url in started.values():
            wait_ready(process, url)
        yield {**{name: url for name, (_, url) in started.items()},
               "processes": {name: process for name, (process, _) in started.items()}}
    finally:
        for process, _ in started.values():
            if process.poll() is None:
                process.kill()
            process.wait(30)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("regenerate-server") / "in.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records()))
    return path


def cli(argv: list[str]) -> int:
    from specheads import data_cli

    parser = argparse.ArgumentParser(prog="specheads")
    data_cli.add_parser(parser.add_subparsers(dest="command"))
    return data_cli.run(parser.parse_args(["data", "regenerate", *argv]))


def ask(url: str, messages: list[dict], max_tokens: int) -> str:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"].strip()


def run_cli(argv: list[str]) -> tuple[int, str]:
    """-> (the exit status, the last line printed on stdout)."""
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        status = cli(argv)
    return status, stdout.getvalue().strip().splitlines()[-1]


@pytest.fixture(scope="module")
def reference_run(servers, source, tmp_path_factory) -> tuple[bytes, str]:
    """One healthy server's output and summary line, through the command line (the model name
    from /v1/models)."""
    output = tmp_path_factory.mktemp("reference") / "out.jsonl"
    status, summary = run_cli(["--server", servers["a"] + "/v1", "--input", str(source), "--output", str(output),
                               "--batch-size", "4", "--max-new-tokens", "12"])
    assert status == 0, summary
    return output.read_bytes(), summary


@pytest.fixture(scope="module")
def reference(reference_run) -> bytes:
    return reference_run[0]


def lines_of(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.decode().splitlines()]


def test_one_server_writes_every_record_in_order_with_the_conversation_so_far(servers, reference_run):
    reference, out = reference_run
    lines = lines_of(reference)
    assert [line["index"] for line in lines] == [i for i in range(36) if i not in (5, 9)]
    assert "36/36 records done, 34 written" in out
    rejects_file = Path(out.rsplit("refused records and why: ", 1)[1])
    rejects = [json.loads(line) for line in rejects_file.read_text().splitlines()]
    assert [(r["index"], r["turn"], r["status"]) for r in rejects] == [(9, 1, 400)]
    assert "maximum context length" in rejects[0]["reason"]
    assert "skipped 2 ('messages' has no assistant turn: 1, longer than the server's context: 1)" in out
    num_turns = re.search(r"(\d+) assistant turns generated", out)[1]  # one request each
    assert f"; server requests: {num_turns} ok, 0 retried (http://127.0.0.1:" in out
    assert "; records refused: 1; records failed: 0; refused records and why: " in out
    source = records()
    by_index = {line["index"]: line["messages"] for line in lines}
    # A chat record: each assistant turn is the reply to the ORIGINAL turns before it.
    chat = by_index[0]
    assert [m["content"] for m in chat if m["role"] == "user"] == [source[0]["messages"][0]["content"],
                                                                   source[0]["messages"][2]["content"]]
    for turn in (1, 3):
        assert chat[turn]["content"] == ask(servers["a"], source[0]["messages"][:turn], 12)
    # A user-turn record: each reply is conditioned on the server's own earlier replies.
    conversation = by_index[2]
    assert len(conversation) == 2 * len(source[2]["turns"]) >= 4
    for turn in range(1, len(conversation), 2):
        assert conversation[turn]["content"] == ask(servers["a"], conversation[:turn], 12)


def test_two_servers_one_killed_mid_run_give_the_same_output(servers, source, reference, tmp_path):
    from specheads.data.reply_progress import progress_path
    from specheads.data.remote_replies import regenerate_with_servers

    output = tmp_path / "out.jsonl"
    result = {}

    def run():
        result["run"] = regenerate_with_servers([servers["a"], servers["b"]], str(source), str(output),
                                                max_new_tokens=12, batch_size=4, concurrency=4, backoff_s=0.2,
                                                log=lambda _: None, progress_bar=False)

    thread = threading.Thread(target=run)
    thread.start()
    written_at_kill = None
    while thread.is_alive():
        written = json.loads(progress_path(output).read_text())["next_record"] if progress_path(output).exists() else 0
        if written >= 8:
            servers["processes"]["b"].kill()
            written_at_kill = written
            break
        time.sleep(0.005)
    thread.join(120)
    assert written_at_kill is not None and written_at_kill < 36  # killed mid-run
    assert output.read_bytes() == reference
    requests = result["run"].requests
    a, b = requests.servers
    assert not requests.failed_records and a.num_ok > 0 and b.num_ok > 0
    assert b.num_errors >= 1 and requests.num_retried >= 1 and a.num_errors == 0


def test_a_run_whose_server_dies_stops_at_the_failed_record_and_a_rerun_resumes(servers, source, reference,
                                                                                tmp_path):
    from specheads.data.reply_progress import progress_path
    from specheads.data.remote_replies import regenerate_with_servers

    output = tmp_path / "out.jsonl"
    result = {}

    def run():
        result["run"] = regenerate_with_servers([servers["c"]], str(source), str(output), max_new_tokens=12,
                                                batch_size=4, concurrency=2, retry_minutes=0.02, backoff_s=0.05,
                                                log=lambda _: None, progress_bar=False)

    thread = threading.Thread(target=run)
    thread.start()
    while thread.is_alive():
        if progress_path(output).exists() and json.loads(progress_path(output).read_text())["next_record"] >= 4:
            servers["processes"]["c"].kill()
            break
        time.sleep(0.005)
    thread.join(120)
    run = result["run"]
    assert run.requests.failed_records, "the server was killed after the run ended"
    first = min(run.requests.failed_records)
    assert run.progress.next_record == first < 36
    assert f"a rerun resumes at record {first}" in run.summary() and servers["c"] in run.summary()
    part = output.read_bytes()
    assert reference.startswith(part)  # whole lines, in order, nothing after the failed record
    with open(output, "ab") as f:  # and a crash in the middle of writing the next batch
        f.write(b'{"index": 99, "mess')
    again = regenerate_with_servers([servers["a"]], str(source), str(output), max_new_tokens=12, batch_size=4,
                                    log=lambda _: None, progress_bar=False)
    assert output.read_bytes() == reference  # nothing written twice, nothing lost
    assert again.progress.next_record == 36 and again.progress.num_written == 34


def test_an_unreachable_server_fails_with_one_line_naming_it(tmp_path, source, capsys):
    from specheads.bench.support import free_port

    url = f"http://127.0.0.1:{free_port()}"
    output = tmp_path / "out.jsonl"
    assert cli(["--server", url, "--input", str(source), "--output", str(output)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # not the progress bars
    assert len(errors) == 1 and "no --server answered" in errors[0] and url in errors[0]
    assert not output.exists()


def test_regenerate_options_that_belong_to_the_other_path_are_refused(tmp_path, source, capsys):
    output = str(tmp_path / "out.jsonl")
    assert cli(["--target", "t", "--input", str(source), "--output", output, "--temperature", "0.7"]) == 2
    assert "--temperature apply to --server only" in capsys.readouterr().err
    assert cli(["--server", "http://127.0.0.1:1", "--input", str(source), "--output", output,
                "--dtype", "float32"]) == 2
    assert "--dtype do not apply with --server" in capsys.readouterr().err
    assert cli(["--input", str(source), "--output", output]) == 2
    assert "give --target" in capsys.readouterr().err
    assert cli(["--server", "ftp://host", "--input", str(source), "--output", output]) == 2
    assert "expected an http:// or https:// URL" in capsys.readouterr().err
    assert cli(["--server", "http://127.0.0.1:1", "--input", str(source), "--output", output,
                "--temperature", "0.5", "--top-p", "0"]) == 2
    assert "--top-p must be in (0, 1]" in capsys.readouterr().err


def test_a_servers_reply_keeps_its_reasoning_under_either_name():
    from specheads.data.openai_wire import reply_of, server_url, wire_message

    def body(**message):
        return {"choices": [{"message": {"role": "assistant", **message}}], "usage": {"completion_tokens": 7}}

    expected = {"role": "assistant", "content": "Four.", "reasoning_content": "Two and two."}
    assert reply_of(body(content=" Four.\n", reasoning_content="Two and two.\n")) == (expected, 7)
    assert reply_of(body(content="Four.", reasoning="Two and two.")) == (expected, 7)  # vLLM >= 0.11
    assert reply_of(body(content="<think>\nTwo and two.\n</think>\n\nFour."))[0] == expected  # no reasoning parser
    assert reply_of(body(content=None, reasoning_content="cut short"))[0] == {
        "role": "assistant", "content": "", "reasoning_content": "cut short"}
    assert wire_message(expected) == {**expected, "reasoning": "Two and two."}
    assert server_url("http://gpu0:8000/v1/") == server_url("http://gpu0:8000") == "http://gpu0:8000"


def test_sampled_requests_get_their_own_reproducible_seeds():
    from specheads.data.remote_replies import Sampling

    greedy = Sampling()
    assert greedy.request_fields(3, 1) == {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                                           "repetition_penalty": 1.0, "presence_penalty": 0.0,
                                           "frequency_penalty": 0.0}
    assert greedy.as_progress() == {}
    sampled = Sampling(temperature=0.7, top_p=0.9, seed=1)
    fields = sampled.request_fields(3, 1)
    assert fields["temperature"] == 0.7 and fields["top_p"] == 0.9 and fields["top_k"] == -1  # off: -1, never 0
    assert fields["seed"] == Sampling(temperature=0.7, top_p=0.9, seed=1).request_fields(3, 1)["seed"]
    assert len({sampled.request_fields(r, t)["seed"] for r in range(20) for t in range(3)}) == 60
    assert Sampling(temperature=1.0, top_k=5).request_fields(0, 0)["top_k"] == 5
    assert "seed" not in Sampling(temperature=1.0).request_fields(0, 0)


# ---------------------------------------------------------------------------- against a server that fills fields

FILLING = {"repetition_penalty": 1.8, "top_k": 20, "temperature": 0.7, "top_p": 0.8}  # Qwen3-like, a strong penalty


@pytest.fixture(scope="module")
def filling(tmp_path_factory):
    """(a vLLM-like server whose target's generation_config.json carries FILLING, the target's
    directory, a small input): tests/data/vllm_like_server.py, in this process."""
    from transformers import GenerationConfig

    from vllm_like_server import VllmLikeServer

    target_dir = make_tiny_model("llama", tmp_path_factory.mktemp("filling") / "target", vocab_size=512)
    make_tokenizer(target_dir)
    config = GenerationConfig.from_pretrained(target_dir)
    config.update(do_sample=True, **FILLING)
    config.save_pretrained(target_dir)
    source = target_dir.parent / "in.jsonl"
    small = [records()[i] for i in (0, 1, 2, 3, 4, 6, 8)]
    source.write_text("".join(json.dumps(record) + "\n" for record in small))
    with VllmLikeServer(target_dir) as server:
        yield server, target_dir, source


def quiet(**kwargs) -> dict:
    return dict(log=lambda _: None, progress_bar=False, max_new_tokens=10, batch_size=4, **kwargs)


def test_replies_through_a_server_that_fills_omitted_fields_are_the_targets_own(filling, tmp_path):
    from specheads.data.openai_wire import NEUTRAL_SAMPLING
    from specheads.data.regenerate import regenerate
    from specheads.data.remote_replies import regenerate_with_servers

    server, target_dir, source = filling
    own = tmp_path / "own.jsonl"  # the target's own greedy replies: the local engine, fp32
    regenerate(str(target_dir), str(source), str(own), dtype="float32", **quiet())
    served = tmp_path / "served.jsonl"
    server.bodies.clear()
    regenerate_with_servers([server.url], str(source), str(served), **quiet())
    assert served.read_bytes() == own.read_bytes()
    assert server.bodies and all(body.items() >= {**NEUTRAL_SAMPLING, "temperature": 0.0}.items()
                                 for body in server.bodies)
    # the check can fail: left to the server, the fields change the replies
    asked = server.bodies[:4]
    old_way = [server.reply({"model": server.name, "messages": body["messages"], "max_tokens": 10, "temperature": 0})
               for body in asked]
    neutral = [server.reply(body) for body in asked]
    assert any(a[1]["choices"][0]["message"] != b[1]["choices"][0]["message"] for a, b in zip(old_way, neutral))


def test_a_refused_record_goes_to_the_rejects_file_and_the_run_goes_on(filling, tmp_path):
    from specheads.data.reply_progress import rejects_path
    from specheads.data.remote_replies import regenerate_with_servers

    server, _, source = filling
    output = tmp_path / "out.jsonl"
    refused_text = records()[1]["conversations"][0]["value"]  # the input's second record
    server.refuse = {refused_text: (400, "the chat template raised: roles must alternate")}
    try:
        run = regenerate_with_servers([server.url], str(source), str(output), **quiet())
    finally:
        server.refuse = {}
    assert [line["index"] for line in lines_of(output.read_bytes())] == [0, 2, 3, 4, 5, 6]
    assert [json.loads(line) for line in rejects_path(output).read_text().splitlines()] == [
        {"index": 1, "turn": 1, "status": 400, "reason": "the chat template raised: roles must alternate"}]
    assert run.progress.skipped == {"refused by the server (HTTP 400)": 1} and run.requests.num_refused == 1
    assert run.summary().endswith(f"records refused: 1; records failed: 0; refused records and why: "
                                  f"{rejects_path(output)}")


def test_a_run_whose_every_request_is_refused_stops_in_one_line(filling, tmp_path, capsys):
    server, _, source = filling
    many = tmp_path / "many.jsonl"
    many.write_text("".join(json.dumps({"turns": [f"question {i}"]}) + "\n" for i in range(12)))
    server.refuse = {"question": (400, "unknown field 'min_p'")}
    try:
        status = cli(["--server", server.url, "--input", str(many), "--output", str(tmp_path / "out.jsonl")])
    finally:
        server.refuse = {}
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # not the progress bars
    assert status == 2 and len(errors) == 1 and errors[0].startswith("specheads data regenerate: error: server ")
    assert "unknown field 'min_p'" in errors[0] and "were all refused and none answered" in errors[0]


def test_retries_outlast_a_restart_of_the_only_server(filling, tmp_path):
    from specheads.data.remote_replies import regenerate_with_servers

    server, _, source = filling
    output = tmp_path / "out.jsonl"
    failures = iter(range(6))  # the first 6 chat requests find the server restarting (503)
    reply = server.reply

    def restarting(body):
        return (503, {"error": {"message": "restarting"}}) if next(failures, None) is not None else reply(body)

    server.reply = restarting
    try:
        run = regenerate_with_servers([server.url], str(source), str(output), backoff_s=0.02, retry_minutes=0.5,
                                      **quiet())
    finally:
        server.reply = reply
    # every 503 was served and the run still wrote every record. (The client's count of retries was
    # once 5 for these 6 under a full suite's load; the count is not what this test is about.)
    assert next(failures, None) is None and run.requests.num_retried >= 1
    assert not run.requests.failed_records and run.progress.next_record == 7
    # a server that stays down past the budget: the run stops at the first record, for the next run
    server.reply = lambda body: (503, {"error": {"message": "restarting"}})
    started = time.monotonic()
    try:
        run = regenerate_with_servers([server.url], str(source), str(tmp_path / "down.jsonl"), backoff_s=0.02,
                                      retry_minutes=0.01, **quiet())
    finally:
        server.reply = reply
    assert 0.6 <= time.monotonic() - started < 60  # the budget, not 10 minutes
    assert min(run.requests.failed_records) == 0 == run.progress.next_record
    assert "HTTP 503: restarting" in run.summary()


def test_backoff_doubles_with_jitter_and_honours_retry_after():
    import random

    from specheads.data.remote_replies import MAX_BACKOFF_S, backoff_delay

    rng = random.Random(0)
    delays = [backoff_delay(3, 1.0, rng) for _ in range(200)]  # 4 s, half of it jitter
    assert 2.0 <= min(delays) < 2.2 and 3.8 < max(delays) <= 4.0 and len(set(delays)) == 200
    assert all(MAX_BACKOFF_S / 2 <= backoff_delay(30, 1.0, rng) <= MAX_BACKOFF_S for _ in range(20))
    assert backoff_delay(1, 1.0, rng, retry_after=7.0) == 7.0


def test_a_resume_against_another_model_is_refused_in_one_line(filling, tmp_path, capsys):
    from specheads.data.regenerate import regenerate
    from specheads.data.remote_replies import regenerate_with_servers

    server, target_dir, source = filling
    output = tmp_path / "out.jsonl"
    regenerate_with_servers([server.url], str(source), str(output), max_batches=1, **quiet())
    name, root = server.name, server.root

    def resume_as(**identity) -> int:
        """The CLI's resume of `output` while the server reports `identity` (root, name)."""
        kept = {key: getattr(server, key) for key in identity}
        vars(server).update(identity)
        try:
            return cli(["--server", server.url, "--input", str(source), "--output", str(output), "--batch-size", "4",
                        "--max-new-tokens", "10"])
        finally:
            vars(server).update(kept)

    assert resume_as(root="/models/Qwen3-8B") == 2
    err = capsys.readouterr().err
    assert len([line for line in err.splitlines() if "error" in line]) == 1
    assert f"holds replies of target {root!r} served as {name!r}, but this run's come from target " \
           f"'/models/Qwen3-8B' served as {name!r}" in err
    assert resume_as(name="tiny-renamed") == 2
    assert "served as 'tiny-renamed'" in capsys.readouterr().err
    # the same target made locally resumes it (one target, whoever decodes it)
    progress = regenerate(str(target_dir), str(source), str(output), dtype="float32", **quiet())
    assert progress.next_record == 7 and progress.target == root
