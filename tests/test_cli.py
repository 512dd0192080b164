"""The `specheads` command line's shared conventions, checked on every subcommand: each prints
its own --help and exits 0; bad input is one line on stderr that names it, exit status 2,
before any model loads (specheads/errors.py); every --target goes through the one resolver
that knows the embedded names (specheads/runner.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specheads.cli import main
from specheads.errors import EXIT_USER_ERROR

SUBCOMMANDS = ["train", "generate", "demo", "bench", "tune", "serve", "export", "data"]

# (argv, what the one-line message must name); {tmp} is the test's tmp_path. Each fails on a
# flag or file checked before any model loads.
USER_ERRORS = [
    (["train", "--profile", "cpu", "{tmp}/absent.yaml"], "absent.yaml"),  # a leading option reaches train too
    (["generate", "--target", "{tmp}/t", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["generate", "--target", "{tmp}/t", "--prompt", "x", "--cuda-graphs"], "--cuda-graphs needs --device cuda"),
    (["serve", "--target", "{tmp}/t", "--cuda-graphs"], "--cuda-graphs needs --device cuda"),
    (["demo", "--target", "embedded:tiny", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["demo", "--target", "embedded:tiny", "--recipe", "{tmp}/absent.yaml"], "--recipe"),
    (["bench", "--target", "{tmp}/t", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["bench", "--target", "{tmp}/t", "--cuda-graphs"], "--cuda-graphs needs --device cuda"),
    (["tune", "--target", "{tmp}/t", "--heads", "{tmp}/h", "--budget-s", "0"], "--budget-s"),
    (["serve", "--target", "{tmp}/t", "--port", "70000"], "--port"),
    (["export", "--out", "{tmp}/out"], "HEADS_DIR"),
    (["data", "cache", "--target", "{tmp}/t", "--data", "{tmp}/d.jsonl", "--taps", "2,five", "--out", "{tmp}/c"],
     "--taps"),
]


@pytest.fixture
def no_model_loads(monkeypatch):
    """Every target load (TargetAdapter.from_pretrained included) goes through heads.target.load_target."""
    import specheads.heads.target

    def refuse(*args, **kwargs):
        raise AssertionError("a user error must be reported before any model loads")

    monkeypatch.setattr(specheads.heads.target, "load_target", refuse)


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_prints_its_own_help(command, capsys):
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: specheads {command} ")


@pytest.mark.parametrize("argv, named", USER_ERRORS, ids=[" ".join(argv[:2]) for argv, _ in USER_ERRORS])
def test_user_errors_exit_2_with_one_line_naming_the_input(argv, named, tmp_path, capsys, no_model_loads):
    assert main([arg.format(tmp=tmp_path) for arg in argv]) == EXIT_USER_ERROR == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"specheads {argv[0]}") and ": error: " in err[0] and named in err[0], err


@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "x"],
    ["bench"],
    ["data", "cache", "--data", "{tmp}/d.jsonl", "--taps", "2", "--out", "{tmp}/c"],
    ["export", "--import", "{tmp}/foreign", "--out", "{tmp}/out"],
], ids=["generate", "bench", "data cache", "export --import"])
def test_every_target_goes_through_the_embedded_name_resolver(argv, tmp_path, capsys, no_model_loads):
    argv = [arg.format(tmp=tmp_path) for arg in argv] + ["--target", "embedded:nonesuch"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "unknown embedded target 'embedded:nonesuch'" in err and "embedded:tiny" in err


def test_cli_modules_take_user_error_from_errors_not_from_cli():
    """specheads/errors.py imports nothing, so no CLI module needs specheads.cli (which imports them)."""
    code = ("import sys, specheads.serve_cli, specheads.bench_cli, specheads.data_cli, specheads.demo, "
            "specheads.train; print('specheads.cli' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
