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
    assert "skipped 2 ('messages' has no assistant turn: 1, longer than the server's context: 1)" in out
    num_turns = re.search(r"(\d+) assistant turns generated", out)[1]  # one request each
    assert f"; server requests: {num_turns} ok, 0 retried (http://127.0.0.1:" in out
    assert out.endswith("; records failed: 0")
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
    from specheads.data.regenerate import progress_path
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
    from specheads.data.regenerate import progress_path
    from specheads.data.remote_replies import regenerate_with_servers

    output = tmp_path / "out.jsonl"
    result = {}

    def run():
        result["run"] = regenerate_with_servers([servers["c"]], str(source), str(output), max_new_tokens=12,
                                                batch_size=4, concurrency=2, max_retries=2, backoff_s=0.05,
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
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no --server answered" in err and url in err
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
    assert greedy.request_fields(3, 1) == {"temperature": 0.0} and greedy.as_progress() == {}
    sampled = Sampling(temperature=0.7, top_p=0.9, seed=1)
    fields = sampled.request_fields(3, 1)
    assert fields["temperature"] == 0.7 and fields["top_p"] == 0.9 and "top_k" not in fields
    assert fields["seed"] == Sampling(temperature=0.7, top_p=0.9, seed=1).request_fields(3, 1)["seed"]
    assert len({sampled.request_fields(r, t)["seed"] for r in range(20) for t in range(3)}) == 60
    assert Sampling(temperature=1.0, top_k=5).request_fields(0, 0)["top_k"] == 5
    assert "seed" not in Sampling(temperature=1.0).request_fields(0, 0)
