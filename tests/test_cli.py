"""The `specheads` command line's shared conventions, checked on every subcommand: each prints
its own --help with its defaults and exits 0; options are never abbreviated; bad input is one
line on stderr that names it, exit status 2, before any model loads (specheads/errors.py);
every --target goes through the one resolver that knows the embedded names, and every
--device through the one that knows "auto" (specheads/runner.py); a renamed option's old
spelling still works with one warning (specheads/options.py)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest
import torch

from specheads import __version__
from specheads.cli import build_parser, main
from specheads.errors import EXIT_USER_ERROR, UserError

from conftest import make_byte_bpe_tokenizer, make_tiny_model

SUBCOMMANDS = ["train", "recipes", "generate", "demo", "bench", "tune", "serve", "export", "data", "data prompts",
               "data report", "data regenerate", "data cache", "llama-cpp", "llama-cpp build"]

# (argv, what the one-line message must name); {tmp} is the test's tmp_path. Each fails on a
# flag or file checked before any model loads, on a machine without CUDA (no_cuda).
USER_ERRORS = [
    (["train", "--profile", "cpu", "{tmp}/absent.yaml"], "absent.yaml"),  # a leading option reaches train too
    (["train", "no-such-recipe"], "nor a shipped recipe's name"),
    (["recipes", "no-such-recipe"], "tiny-medusa"),
    (["generate", "--target", "{tmp}/t", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["generate", "--target", "{tmp}/t", "--prompt", "x", "--device", "cuda"], "--device cuda: torch sees no CUDA"),
    (["generate", "--target", "{tmp}/t", "--prompt", "x", "--device", "gpu0"], "--device 'gpu0' is not a device"),
    (["serve", "--target", "{tmp}/t", "--device", "cuda:1"], "--device cuda:1"),
    (["demo", "--target", "embedded:tiny", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["demo", "--target", "embedded:tiny", "--recipe", "{tmp}/absent.yaml"], "--recipe"),
    (["demo", "--target", "embedded:smollm2", "--recipe", "tiny-eagle3"], "'embedded:tiny'"),
    (["bench", "--target", "{tmp}/t", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["bench", "--target", "{tmp}/t", "--device", "cuda"], "--device cuda"),
    (["tune", "--target", "{tmp}/t", "--heads", "{tmp}/h", "--budget-s", "0"], "--budget-s"),
    (["serve", "--target", "{tmp}/t", "--port", "70000"], "--port"),
    (["export", "--output", "{tmp}/out"], "HEADS_DIR"),
    (["data", "cache", "--target", "{tmp}/t", "--input", "{tmp}/d.jsonl", "--taps", "2,five", "--output", "{tmp}/c"],
     "--taps"),
]

# Every command whose run resolves --device, with the rest of a valid command line.
DEVICE_COMMANDS = [
    ["generate", "--target", "{tmp}/t", "--prompt", "x"],
    ["serve", "--target", "{tmp}/t"],
    ["bench", "--target", "{tmp}/t"],
    ["tune", "--target", "{tmp}/t", "--heads", "{tmp}/h"],
    ["demo", "--target", "embedded:tiny", "--workdir", "{tmp}/demo"],
    ["data", "regenerate", "--target", "{tmp}/t", "--input", "{tmp}/i.jsonl", "--output", "{tmp}/o.jsonl"],
    ["data", "cache", "--target", "{tmp}/t", "--input", "{tmp}/d.jsonl", "--taps", "2", "--output", "{tmp}/c"],
    ["data", "prompts", "--output", "{tmp}/p.jsonl", "--self-instruct", "--target", "{tmp}/t"],
]
GRAPH_COMMANDS = {"generate", "serve", "bench", "tune", "demo", "regenerate"}

# (command line, the old spelling in it, the new option's dest, the value it gets, the new spelling)
DEPRECATED = [
    (["generate", "--target", "t", "--prompt", "x", "--lookup", "3"], "--lookup", "lookup_num_tokens", 3,
     "--lookup-num-tokens"),
    (["serve", "--target", "t", "--lookup", "0"], "--lookup", "lookup_num_tokens", 0, "--lookup-num-tokens"),
    (["generate", "--target", "t", "--prompt", "x", "--json"], "--json", "output_json", "-", "--output-json -"),
    (["bench", "--target", "t", "--json", "r.json"], "--json", "output_json", "r.json", "--output-json PATH"),
    (["tune", "--target", "t", "--heads", "h", "--json", "r.json"], "--json", "output_json", "r.json",
     "--output-json PATH"),
    (["export", "h", "--format", "eagle3", "--out", "o"], "--out", "output", "o", "--output"),
    (["data", "cache", "--target", "t", "--data", "d", "--taps", "2", "--output", "o"], "--data", "input", "d",
     "--input"),
    (["data", "cache", "--target", "t", "--input", "d", "--taps", "2", "--out", "o"], "--out", "output", "o",
     "--output"),
    (["serve", "--target", "t", "--cuda-graphs"], "--cuda-graphs", "cuda_graphs", True, "--enforce-eager"),
    (["data", "report", "--input", "r", "--eval", "e.jsonl"], "--eval", "eval_replies", ["e.jsonl"],
     "--eval-replies"),
]

def fill(argv: list[str], tmp_path) -> list[str]:
    return [arg.format(tmp=tmp_path) for arg in argv]


@pytest.fixture
def no_model_loads(monkeypatch):
    """Every target load (TargetAdapter.from_pretrained included) goes through heads.target.load_target."""
    import specheads.heads.target.adapter

    def refuse(*args, **kwargs):
        raise AssertionError("a user error must be reported before any model loads")

    monkeypatch.setattr(specheads.heads.target.adapter, "load_target", refuse)


def gpus(monkeypatch, count: int) -> None:
    """What torch reports about CUDA: `count` devices (0: none)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.fixture
def no_cuda(monkeypatch):
    gpus(monkeypatch, 0)


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_prints_its_own_help(command, capsys):
    with pytest.raises(SystemExit) as exited:
        main([*command.split(), "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: specheads {command} ")


def parsers(parser: argparse.ArgumentParser, name: str = "specheads"):
    """(name, parser) for `parser` and every subcommand's parser under it."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from parsers(sub, f"{name} {sub_name}")


def test_every_help_shows_every_default():
    """Each option with a default (not None, False or empty) shows it in its command's --help,
    or its help text already says what the default is."""
    checked = 0
    for name, parser in parsers(build_parser()):
        help_text = " ".join(parser.format_help().split())
        for action in parser._actions:
            default = action.default
            if (not action.option_strings or action.help == argparse.SUPPRESS or default is None or default is False
                    or default == [] or default == argparse.SUPPRESS):
                continue
            assert action.help, f"{name} {action.option_strings[0]} has no help"
            shown = f"(default: {default})" in help_text or "default" in action.help
            assert shown, f"{name} --help does not show the default of {action.option_strings[0]} ({default!r})"
            checked += 1
    assert checked > 40


def test_version(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.strip() == f"specheads {__version__}"


def test_options_are_never_abbreviated(capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["generate", "--target", "t", "--prompt", "x", "--max-new", "5"])
    assert exited.value.code == 2 and "unrecognized arguments: --max-new" in capsys.readouterr().err


@pytest.mark.parametrize("argv, named", USER_ERRORS, ids=[" ".join(argv[:2]) for argv, _ in USER_ERRORS])
def test_user_errors_exit_2_with_one_line_naming_the_input(argv, named, tmp_path, capsys, no_model_loads, no_cuda):
    assert main(fill(argv, tmp_path)) == EXIT_USER_ERROR == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"specheads {argv[0]}") and ": error: " in err[0] and named in err[0], err


@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "x"],
    ["bench"],
    ["data", "cache", "--input", "{tmp}/d.jsonl", "--taps", "2", "--output", "{tmp}/c"],
    ["export", "--import", "{tmp}/foreign", "--output", "{tmp}/out"],
], ids=["generate", "bench", "data cache", "export --import"])
def test_every_target_goes_through_the_embedded_name_resolver(argv, tmp_path, capsys, no_model_loads):
    argv = fill(argv, tmp_path) + ["--target", "embedded:nonesuch"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "unknown embedded target 'embedded:nonesuch'" in err and "embedded:tiny" in err


# ---------------------------------------------------------------------------- the device


def test_auto_is_cuda_when_torch_sees_a_gpu_else_the_cpu(monkeypatch):
    from specheads.runner import resolve_device

    gpus(monkeypatch, 2)
    assert resolve_device("auto") == "cuda" and resolve_device("cuda:1") == "cuda:1" and resolve_device("cpu") == "cpu"
    with pytest.raises(UserError, match=r"--device cuda:2: torch sees 2 CUDA device\(s\), cuda:0 to cuda:1"):
        resolve_device("cuda:2")
    gpus(monkeypatch, 0)
    assert resolve_device("auto") == "cpu"
    with pytest.raises(UserError, match="--device cuda: torch sees no CUDA device"):
        resolve_device("cuda")


def test_cuda_graphs_are_on_by_default_on_cuda_only():
    from specheads.runner import resolve_cuda_graphs

    assert resolve_cuda_graphs("cuda") is True and resolve_cuda_graphs("cuda:1") is True
    assert resolve_cuda_graphs("cpu") is False
    assert resolve_cuda_graphs("cuda", False) is False  # --enforce-eager
    with pytest.raises(UserError, match="CUDA graphs need a CUDA device"):
        resolve_cuda_graphs("cpu", True)


@pytest.mark.parametrize("argv", DEVICE_COMMANDS, ids=[" ".join(argv[:2]) for argv in DEVICE_COMMANDS])
def test_every_command_defaults_to_auto_and_graphs_follow_the_device(argv, tmp_path, monkeypatch):
    """Parsed and resolved as each command's run does (options.apply_device_options)."""
    from specheads.options import apply_device_options

    parser = build_parser()
    graphs = argv[0] in GRAPH_COMMANDS or argv[1] in GRAPH_COMMANDS
    for count, device in ((1, "cuda"), (0, "cpu")):
        gpus(monkeypatch, count)
        args = parser.parse_args(fill(argv, tmp_path))
        assert args.device == "auto"
        apply_device_options(args)
        assert args.device == device
        assert getattr(args, "cuda_graphs", False) is (graphs and device == "cuda")
    if graphs:
        gpus(monkeypatch, 1)
        args = parser.parse_args(fill(argv, tmp_path) + ["--enforce-eager"])
        apply_device_options(args)
        assert args.device == "cuda" and args.cuda_graphs is False


@pytest.mark.parametrize("argv", DEVICE_COMMANDS, ids=[" ".join(argv[:2]) for argv in DEVICE_COMMANDS])
def test_every_command_resolves_its_device_before_any_model_loads(argv, tmp_path, monkeypatch, capsys,
                                                                   no_model_loads):
    """Each command's run goes through runner.resolve_device: a CUDA device torch does not
    have fails in one line, naming it, before anything loads."""
    gpus(monkeypatch, 1)
    (tmp_path / "h").mkdir()
    assert main(fill(argv, tmp_path) + ["--device", "cuda:3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device cuda:3: torch sees 1 CUDA device(s)" in err[0], err
    assert not (tmp_path / "demo").exists()


# ---------------------------------------------------------------------------- names


@pytest.mark.parametrize("argv, old, dest, value, new", DEPRECATED,
                         ids=[f"{argv[0]} {old}" for argv, old, *_ in DEPRECATED])
def test_old_spellings_still_work_with_one_warning_and_stay_out_of_help(argv, old, dest, value, new, capsys):
    parser = build_parser()
    args = parser.parse_args(argv)
    assert getattr(args, dest) == value
    prog = "specheads " + " ".join(argv[:2] if argv[0] == "data" else argv[:1])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{prog}: warning: {old} is deprecated; ") and new in err[0], err
    assert not re.search(rf"{re.escape(old)}(?![\w-])", dict(parsers(parser))[prog].format_help())


def test_a_renamed_required_option_is_required_under_either_name_and_once(capsys):
    parser = build_parser()
    for argv in (["data", "cache", "--target", "t", "--taps", "2", "--output", "o"],
                 ["data", "cache", "--target", "t", "--input", "d", "--data", "d", "--taps", "2", "--output", "o"]):
        with pytest.raises(SystemExit) as exited:
            parser.parse_args(argv)
        assert exited.value.code == 2
    assert "--input" in capsys.readouterr().err


def test_deprecated_cuda_graphs_on_a_cpu_fails_in_one_error_line(tmp_path, capsys, no_model_loads, no_cuda):
    assert main(["serve", "--target", str(tmp_path / "t"), "--cuda-graphs"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "deprecated" in err[0] and "CUDA graphs need a CUDA device" in err[1], err


@pytest.fixture(scope="module")
def generate_target(tmp_path_factory):
    target = make_tiny_model("llama", tmp_path_factory.mktemp("generate") / "target", vocab_size=512)
    make_byte_bpe_tokenizer(target, ["def f(x):\n    return x + 1\n", "the cat sat on the mat\n"])
    return target


def test_generate_output_json_to_a_file_or_stdout(generate_target, tmp_path, capsys):
    argv = ["generate", "--target", str(generate_target), "--prompt", "def f(x):", "--max-new-tokens", "4",
            "--dtype", "float32"]
    assert main([*argv, "--output-json", str(tmp_path / "r.json")]) == 0
    streamed = capsys.readouterr().out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["num_tokens"] == 4 and streamed.startswith("def f(x):" + report["text"])
    assert main([*argv, "--output-json", "-"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and json.loads(printed[0]) == {**report, "tokens_per_s": json.loads(printed[0])[
        "tokens_per_s"]}


# ---------------------------------------------------------------------------- recipes and train


def test_shipped_recipes_by_name_from_anywhere(tmp_path, monkeypatch, capsys):
    from specheads.train import resolve_recipe, shipped_recipes

    monkeypatch.chdir(tmp_path)  # no clone here: the names come from the installed package
    shipped = shipped_recipes()
    assert {"tiny-medusa", "eagle3-llama-3.1-8b-instruct"} <= set(shipped)
    for name in ("tiny-medusa", "tiny-medusa.yaml", "recipes/tiny-medusa.yaml"):  # the recipes' own comments' path
        assert resolve_recipe(name) == shipped["tiny-medusa"]
    (tmp_path / "tiny-medusa").write_text("target:\n  name_or_path: embedded:tiny\n")
    assert resolve_recipe("tiny-medusa").resolve() == tmp_path / "tiny-medusa"  # a file that exists wins
    assert main(["recipes"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in shipped) and "meta-llama/Llama-3.1-8B-Instruct" in listed
    assert main(["recipes", "tiny-eagle3"]) == 0
    assert capsys.readouterr().out == shipped["tiny-eagle3"].read_text()
    assert main(["train", "eagle3-llama-3.1-8b-instruct", "--dry-run"]) == 0
    assert "dry run of" in capsys.readouterr().out


def test_train_on_several_gpus_stops_with_the_deepspeed_command(tmp_path, monkeypatch, capsys):
    """Not under a launcher, on 4 GPUs: no training starts; the printed command is one that
    DeepSpeed's own launcher parses into 4 GPUs running this module with the same arguments."""
    import shlex

    from deepspeed.launcher.runner import parse_args

    from specheads.train import LAUNCHER_ENV, multi_gpu_command

    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    gpus(monkeypatch, 4)
    output_dir = tmp_path / "run"
    argv = ["tiny-medusa", "--set", f"train.output_dir={output_dir}", "--set", "train.steps=1"]
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "this machine has 4 GPUs" in err[0] and "CUDA_VISIBLE_DEVICES=0" in err[0], err
    command = err[0].split("`")[1]
    assert command == multi_gpu_command(argv, 4)
    words = shlex.split(command)
    launched = parse_args(words[1:])
    assert words[0] == "deepspeed" and launched.num_gpus == 4 and launched.module
    assert [launched.user_script, *launched.user_args] == ["specheads.train", *argv]
    assert not output_dir.exists()
    assert multi_gpu_command(argv, 1) is None  # one GPU: nothing to choose
    monkeypatch.setenv("LOCAL_RANK", "0")  # a rank the launcher started
    assert multi_gpu_command(argv, 4) is None


# ---------------------------------------------------------------------------- demo


def test_demo_refuses_a_workdir_it_did_not_make(tmp_path, capsys, no_model_loads):
    workdir = tmp_path / "mine"
    workdir.mkdir()
    (workdir / "notes.txt").write_text("keep me")
    for extra in ([], ["--retrain"]):
        assert main(["demo", "--target", "embedded:tiny", "--workdir", str(workdir), *extra]) == 2
        err = capsys.readouterr().err
        assert "was not made by specheads demo" in err and ".specheads-demo.json" in err
    assert [p.name for p in workdir.iterdir()] == ["notes.txt"]


def test_demo_retrain_deletes_only_what_the_demo_wrote(tmp_path):
    from specheads.demo import MARKER, DemoWorkdir

    workdir = DemoWorkdir(tmp_path / "demo")
    workdir.output("distill.jsonl").write_text("{}\n")
    (workdir.output("medusa") / "heads").mkdir(parents=True)
    (tmp_path / "demo" / "notes.txt").write_text("the user's")  # written later, by someone else
    with pytest.raises(UserError, match="not written by specheads demo"):
        workdir.output("notes.txt")
    again = DemoWorkdir(tmp_path / "demo")  # the next run reads what the first one wrote
    assert again.outputs == ["distill.jsonl", "medusa"]
    again.clear()
    assert sorted(p.name for p in (tmp_path / "demo").iterdir()) == [MARKER, "notes.txt"]
    assert DemoWorkdir(tmp_path / "demo").outputs == []


def test_demo_recipe_replaces_the_demos_recipe_of_its_kind():
    from specheads.demo import REAL_RUN_DIR, demo_recipes
    from specheads.train import shipped_recipes

    shipped = shipped_recipes()

    def recipes(target, recipe):
        args = argparse.Namespace(target=target, recipe=recipe, overrides=[])
        return {kind: (path.name, run) for kind, (path, run) in demo_recipes(args).items()}

    assert recipes("embedded:smollm2", None) == {"eagle3": ("smollm2-135m-eagle3.yaml", REAL_RUN_DIR)}
    assert recipes("embedded:smollm2", "smollm2-135m-medusa") == {
        "medusa": ("smollm2-135m-medusa.yaml", "smollm2-135m-medusa")}
    assert recipes("embedded:tiny", None) == {"medusa": ("tiny-medusa.yaml", "medusa"),
                                              "eagle3": ("tiny-eagle3.yaml", "eagle3")}
    assert recipes("embedded:tiny", "tiny-eagle3") == recipes("embedded:tiny", None)  # its own: same run dirs
    assert recipes("embedded:smollm2", "smollm2-135m-eagle3") == recipes("embedded:smollm2", None)
    assert recipes("embedded:tiny", str(shipped["tiny-medusa-lora"])) == {
        "medusa": ("tiny-medusa-lora.yaml", "tiny-medusa-lora"), "eagle3": ("tiny-eagle3.yaml", "eagle3")}


def test_cli_modules_take_user_error_from_errors_not_from_cli():
    """specheads/errors.py imports nothing, so no CLI module needs specheads.cli (which imports them)."""
    code = ("import sys, specheads.serve_cli, specheads.bench_cli, specheads.data_cli, specheads.demo, "
            "specheads.train; print('specheads.cli' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
