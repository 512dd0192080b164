"""bench/llama_cpp.py: llama.cpp rows in the bench. The default suite checks the pieces around
llama-server (finding it, reading its counters, one-line errors) with fakes; the slow test builds
llama.cpp from the pinned sdist (or reuses the cached build), converts a tiny target and its
EAGLE-3 heads and runs llama-server on 127.0.0.1, plain and drafting."""

import json
import stat

import pytest

from specheads.bench.harness import PromptRun, summarise
from specheads.bench.llama_cpp import complete, find_server, format_llama_cpp, spec_counters
from specheads.heads.artefacts.export_llama_cpp import LlamaCppError

METRICS = """\
# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated
llamacpp:tokens_predicted_total {predicted}
llamacpp:spec_decode_num_draft_tokens_total {drafted}
llamacpp:spec_decode_num_accepted_tokens_total {accepted}
llamacpp:spec_decode_num_drafts_total {steps}
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} {pos0}
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="1"}} {pos1}
"""


class FakeResponse:
    def __init__(self, status_code=200, text="", body=None):
        self.status_code, self.text, self.body = status_code, text, body

    def json(self):
        return self.body


class FakeServer:
    """/metrics counters that one /completion advances, as llama-server's do."""

    def __init__(self):
        self.counters = dict(predicted=0, drafted=10, accepted=4, steps=5, pos0=3, pos1=1)

    def get(self, path):
        assert path == "/metrics"
        return FakeResponse(text=METRICS.format(**self.counters))

    def post(self, path, json):
        assert path == "/completion" and json["temperature"] == 0.0 and json["top_k"] == 1
        assert json["cache_prompt"] is False and json["return_tokens"] is True
        self.counters.update(drafted=16, accepted=9, steps=8, pos0=6, pos1=3)  # +6 drafted, +5 accepted, 3 steps
        return FakeResponse(body={"tokens": [7, 8, 9, 10, 11, 12, 13, 14, 15],
                                  "timings": {"prompt_ms": 5.0, "predicted_n": 9}})


def test_complete_reads_tokens_and_the_counters_it_advanced():
    server = FakeServer()
    assert spec_counters(server) == {"draft_tokens": 10, "accepted_tokens": 4, "drafts": 5, "pos0": 3, "pos1": 1}
    run = complete(server, [1, 2, 3], 9)
    assert run.tokens == [7, 8, 9, 10, 11, 12, 13, 14, 15]
    assert (run.drafted_tokens, run.accepted_tokens, run.speculative_steps) == (6, 5, 3)
    assert run.accepted_per_position == [3, 2]
    assert run.steps == 9 - 1 - 5  # the prefill's token, then accepted + 1 per step
    summary = summarise([run], [True], None)
    assert summary["alpha"] == pytest.approx(5 / 6) and summary["tau"] == pytest.approx((5 + 3) / 3)
    assert summary["acceptance_by_depth"] == [1.0, pytest.approx(2 / 3)]


def fake_binary(directory, usage: str):
    directory.mkdir(parents=True, exist_ok=True)
    server = directory / "llama-server"
    server.write_text(f"#!/bin/sh\necho '{usage}'\n")
    server.chmod(server.stat().st_mode | stat.S_IXUSR)
    return server


def test_find_server_where_builds_put_it_and_refuses_old_ones(tmp_path):
    with pytest.raises(LlamaCppError, match="does not exist"):
        find_server(tmp_path / "missing")
    with pytest.raises(LlamaCppError, match="no llama-server"):
        find_server(tmp_path)
    fake_binary(tmp_path / "old" / "build" / "bin", "--spec-type none,ngram-simple")
    with pytest.raises(LlamaCppError, match="too old"):
        find_server(tmp_path / "old")
    server = fake_binary(tmp_path / "new" / "bin", "--spec-type none,draft-simple,draft-eagle3")
    assert find_server(tmp_path / "new") == server


def test_bench_cli_fails_in_one_line_before_loading_anything(tmp_path, capsys):
    from specheads.cli import main

    assert main(["bench", "--target", "embedded:tiny", "--llama-cpp", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "does not exist" in err and "specheads llama-cpp build" in err


def test_draft_flags_and_extra_server_flags():
    from specheads.bench.llama_cpp import draft_args, server_args

    assert draft_args("h.gguf", 3) == ["-md", "h.gguf", "--spec-type", "draft-eagle3", "--spec-draft-n-max", "3"]
    assert draft_args("h.gguf", 8, 0.75)[-2:] == ["--spec-draft-p-min", "0.75"]
    with pytest.raises(ValueError, match="--llama-cpp-draft-max .* must be >= 1, got 0"):
        draft_args("h.gguf", 0)
    with pytest.raises(ValueError, match=r"--llama-cpp-draft-p-min .* must be in \[0, 1\], got 1.5"):
        draft_args("h.gguf", 3, 1.5)
    assert server_args(None) == [] and server_args("--poll 0 --cache-type-k q8_0") == ["--poll", "0", "--cache-type-k",
                                                                                       "q8_0"]
    with pytest.raises(ValueError, match="may not set --port, -t: the bench sets it per row"):
        server_args("-t 4 --poll 0 --port 9")
    with pytest.raises(ValueError, match="may not set --spec-draft-p-min"):
        server_args("--spec-draft-p-min=0.5")
    with pytest.raises(ValueError, match="does not parse as shell words"):
        server_args('--alias "unclosed')


@pytest.mark.parametrize("flags, message", [
    (["--llama-cpp-args", "--model other.gguf"], "--llama-cpp-args may not set --model"),
    (["--llama-cpp-draft-p-min", "-0.1"], "--llama-cpp-draft-p-min (llama-server's --spec-draft-p-min) must be in"),
    (["--llama-cpp-draft-max", "0"], "--llama-cpp-draft-max (llama-server's --spec-draft-n-max) must be >= 1")])
def test_bench_cli_refuses_bad_llama_cpp_flags_before_loading_anything(tmp_path, capsys, flags, message):
    from specheads.cli import main

    fake_binary(tmp_path / "bin", "--spec-type none,draft-eagle3")
    assert main(["bench", "--target", "embedded:tiny", "--llama-cpp", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err


def test_format_names_identity_against_llama_cpp_plain():
    run = PromptRun(tokens=[1, 2, 3], seconds=0.1, events=[(0.01, 1), (0.1, 2)], drafted_tokens=0)
    section = {"config": {"outtype": "f32", "threads": 2},
               "methods": [{"name": "llama.cpp-plain", "overall": summarise([run], [True], [run])},
                           {"name": "llama.cpp-heads[3]", "overall": summarise([run], [False], [run])}]}
    table = format_llama_cpp(section)
    assert "identical to llama.cpp-plain" in table
    assert "| llama.cpp-plain | 3 | 30.0 | 1.00x | - | - | - | yes |" in table
    assert "| 0/1 |" in table


def test_heads_that_differ_only_in_their_tree_share_one_row(tmp_path):
    from specheads.bench.llama_cpp import distinct_weights

    for name, weights in [("a", b"weights one"), ("a-chain3", b"weights one"), ("b", b"weights two"),
                          ("a-cal15", b"weights one")]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(weights)
    heads = [(name, str(tmp_path / name)) for name in ("a", "a-chain3", "b", "a-cal15")]
    assert distinct_weights(heads) == [("a", str(tmp_path / "a"), ["a-chain3", "a-cal15"]),
                                       ("b", str(tmp_path / "b"), [])]


# ---------------------------------------------------------------------------- llama.cpp itself

PROMPTS = [[5, 9, 17, 40, 41], [60, 12, 13, 30], [20, 21, 22], [33, 34, 35, 36, 37, 38], [50, 51]]


@pytest.mark.slow
def test_llama_server_drafts_with_our_heads(tmp_path):
    """Build (or reuse) llama.cpp, convert a tiny target + EAGLE-3 heads trained for 20 steps in
    F32, and decode a few prompts through llama-server plain and with --spec-type draft-eagle3:
    the outputs agree on most prompts and some drafts are accepted. Minutes (the build: ~5)."""
    from conftest import make_byte_bpe_tokenizer, make_tiny_model
    from test_eagle3 import write_eagle_recipe
    from test_training import markov_walks, write_jsonl

    from specheads.bench.llama_cpp import build_llama_cpp, draft_args, run_row
    from specheads.bench.prompts import EncodedPrompt
    from specheads.data.tiny_target import default_cache_dir
    from specheads.heads.artefacts.export_llama_cpp import export_llama_cpp, find_converter, pinned_source
    from specheads.train import main as train

    build = build_llama_cpp(default_cache_dir())
    server = find_server(build)
    target = make_tiny_model("llama", tmp_path / "target", vocab_size=300, num_layers=6)
    make_byte_bpe_tokenizer(target, ["def f(x):\n    return x + 1\n", "hello world"])
    walks = write_jsonl(tmp_path / "walks.jsonl", markov_walks())
    assert train([str(write_eagle_recipe(tmp_path, target, walks, tmp_path / "run", 20))]) == 0
    out = export_llama_cpp(tmp_path / "run" / "heads", tmp_path / "gguf", target_dir=target,
                           converter=find_converter(pinned_source(default_cache_dir())), outtype="f32",
                           pre_tokenizer="gpt-2")
    info = json.loads((out / "llama_cpp_export.json").read_text())
    assert info["llama_cpp_target_layers"] == info["tap_layers"]
    prompts = [EncodedPrompt(i, "walk", ids) for i, ids in enumerate(PROMPTS)]
    plain = run_row(server, out / "target.gguf", [], prompts, 24, 2, tmp_path, "plain")
    drafted = run_row(server, out / "target.gguf", draft_args(out / "heads.gguf", 3), prompts, 24, 2, tmp_path,
                      "eagle3")
    same = sum(a.tokens == b.tokens for a, b in zip(plain, drafted))
    assert same >= len(PROMPTS) - 1, [(a.tokens, b.tokens) for a, b in zip(plain, drafted)]
    assert all(run.drafted_tokens == 0 for run in plain)
    assert sum(run.drafted_tokens for run in drafted) > 0
    assert sum(run.accepted_tokens for run in drafted) > 0
