"""The documentation is checked against the code: README.md and every page under docs/.

- Every `specheads ...` command (also `python -m specheads ...`, `python -m specheads.train ...`
  and `deepspeed ... --module specheads.train ...`), in fenced code blocks and in inline code, is
  parsed by the real parser (`specheads.cli.build_parser()`), so a renamed or removed option, a
  deprecated spelling or a bad subcommand fails here.
  Rules:
  - a command is a *synopsis* when it holds `[`, `...` or an alternative written `a|b`; a
    synopsis is not parsed whole, but its subcommand path and every option it names must exist
    (and not be a deprecated spelling);
  - placeholders are arguments: a value written in capitals (`RECIPE`, `N`, `ORG/NAME`) or in
    angle brackets (`<dir>`, without spaces) may fail its option's type or choices;
  - inline code names a command as prose does, so an inline command may leave out required
    arguments (`specheads tune`); a command in a code block is a whole command line and may not;
  - shell around a command is cut off: a trailing `# comment`, pipes, `&&`, `;` and
    redirections; `VAR=value` assignments before the command word are skipped.
- Every `from specheads... import name` in a ```python block names a module that exists and a
  name defined at its top level.
- Every relative link (and image) points to a file that exists, and a `#fragment` to a heading
  of that page (GitHub's anchor rule).
- No page names run directories of ours that are not in the repository (`runs/...` is allowed
  only for what a shipped recipe or `specheads demo` writes), "not committed" files, work
  sessions, or the development machines' conditions.
"""

from __future__ import annotations

import argparse
import ast
import re
import shlex
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

from conftest import REPO

from specheads.cli import build_parser
from specheads.options import _DeprecatedAlias

DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
PLACEHOLDER = re.compile(r"^(<[^<>\s]+>|[A-Z][A-Z0-9_./:-]*)$")
SHELL_BREAKS = {"|", "||", "&&", ";", "&", ">", ">>", "2>", "2>&1", "<", "1>"}


class Command(NamedTuple):
    page: str
    line: int
    text: str
    inline: bool


class DocError(Exception):
    """A parser error, raised instead of argparse's exit."""


# ---------------------------------------------------------------------------- reading pages

def code_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """(first line number, language, lines) of every fenced code block."""
    blocks, lines, index = [], text.splitlines(), 0
    while index < len(lines):
        opened = FENCE.match(lines[index])
        if not opened:
            index += 1
            continue
        fence, language, body, start = opened.group(2), opened.group(3), [], index + 1
        index += 1
        while index < len(lines) and not lines[index].strip().startswith(fence[0] * len(fence)):
            body.append(lines[index])
            index += 1
        blocks.append((start + 1, language, body))
        index += 1
    return blocks


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    out, inside, fence = [], False, ""
    for number, line in enumerate(text.splitlines(), start=1):
        opened = FENCE.match(line)
        if inside:
            if line.strip().startswith(fence):
                inside = False
            continue
        if opened:
            inside, fence = True, opened.group(2)
            continue
        out.append((number, line))
    return out


def logical_lines(lines: list[str], first: int) -> list[tuple[int, str]]:
    """Shell lines with their `\\` continuations joined."""
    joined, current, start = [], "", first
    for offset, line in enumerate(lines):
        if not current:
            start = first + offset
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        joined.append((start, current + line))
        current = ""
    if current:
        joined.append((start, current))
    return joined


def specheads_argv(command: str) -> list[list[str]]:
    """The argv (after `specheads`) of every specheads command in one shell line."""
    try:
        tokens = shlex.split(command, comments=True)
    except ValueError as error:
        raise DocError(f"not a shell line ({error}): {command}") from None
    segments, current = [], []
    for token in tokens:
        if token in SHELL_BREAKS:
            segments.append(current)
            current = []
        else:
            current.append(token)
    segments.append(current)
    found = []
    for words in segments:
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            words = words[1:]  # VAR=value before the command
        if not words:
            continue
        if words[0] == "specheads":
            found.append(words[1:])
        elif words[0] in ("python", "python3") and words[1:3] == ["-m", "specheads"]:
            found.append(words[3:])
        elif words[0] in ("python", "python3") and words[1:3] == ["-m", "specheads.train"]:
            found.append(["train", *words[3:]])
        elif words[0] == "deepspeed" and "specheads.train" in words:
            module = words.index("specheads.train")
            if words[module - 1] == "--module":
                found.append(["train", *words[module + 1:]])
    return found


def is_command(text: str) -> bool:
    return bool(re.match(r"^(\w+=\S+\s+)*(specheads\s|python3? -m specheads(\.train)?\s|deepspeed\s.*"
                         r"--module specheads\.train)", text.strip()))


def commands_in(page: Path) -> list[Command]:
    text, name = page.read_text(), page.relative_to(REPO).as_posix()
    found = []
    for first, language, body in code_blocks(text):
        if language not in ("", "bash", "sh", "shell", "console"):
            continue
        found += [Command(name, number, line, False) for number, line in logical_lines(body, first)
                  if is_command(line)]
    for number, line in prose_lines(text):
        for span in INLINE.findall(line):
            span = span.replace("\\|", "|")
            if is_command(span):
                found.append(Command(name, number, span, True))
    return found


# ---------------------------------------------------------------------------- the parser

def _raise(message: str):
    raise DocError(message)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def strict_parser() -> argparse.ArgumentParser:
    """build_parser(), every (sub)parser raising DocError instead of exiting."""
    root = build_parser()
    todo = [root]
    while todo:
        parser = todo.pop()
        parser.error = _raise
        todo += list(_subparsers(parser).values())
    return root


def resolve(root: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The subcommand parser argv names and the tokens after the subcommand words."""
    parser, rest = root, list(argv)
    while rest:
        children = _subparsers(parser)
        word = rest[0].strip("[]")
        if not children or word not in children:
            break
        parser, rest = children[word], rest[1:]
    return parser, rest


def option_names(parser: argparse.ArgumentParser) -> tuple[set[str], set[str]]:
    """(current option strings, deprecated spellings) of one parser."""
    current, deprecated = set(), set()
    for action in parser._actions:
        (deprecated if isinstance(action, _DeprecatedAlias) else current).update(action.option_strings)
    return current, deprecated


def check_options(parser: argparse.ArgumentParser, tokens: list[str], synopsis: bool) -> list[str]:
    """Problems with the options a command names: a deprecated spelling; in a synopsis, which is
    not parsed, also an option the parser does not have. (A token with a space in it is a quoted
    value, never an option.)"""
    current, deprecated = option_names(parser)
    problems = []
    for token in (token for token in tokens if not re.search(r"\s", token)):
        for word in re.split(r"[\[\]|]", token) if synopsis else [token]:
            name = word.split("=", 1)[0]
            if not name.startswith("-") or name in ("-", "--") or re.match(r"^-\d", name):
                continue
            if name in deprecated:
                problems.append(f"{name} is a deprecated spelling")
            elif synopsis and name not in current:
                problems.append(f"{name} is not an option of `{parser.prog}`")
    return problems


def is_synopsis(text: str) -> bool:
    return "[" in text or "..." in text or bool(re.search(r"\S\|\S", text))


def tolerated(message: str, inline: bool) -> bool:
    """A parser error that the rules above allow."""
    if inline and ("the following arguments are required" in message or re.search(r"one of the arguments .* is "
                                                                                   r"required", message)):
        return True
    bad_value = re.search(r"invalid (?:\w+ value|choice): '([^']*)'", message)
    return bool(bad_value and PLACEHOLDER.match(bad_value.group(1)))


def problems_of(command: Command, root: argparse.ArgumentParser) -> list[str]:
    try:
        argvs = specheads_argv(command.text)
    except DocError as error:
        return [str(error)]
    problems = []
    for argv in argvs:
        parser, rest = resolve(root, argv)
        synopsis = is_synopsis(command.text) or bool({"-h", "--help", "--version"} & set(argv))
        problems += check_options(parser, rest, synopsis)
        if synopsis or problems:
            continue
        try:
            root.parse_args(argv)
        except DocError as error:
            if not tolerated(str(error), command.inline):
                problems.append(str(error))
    return problems


ALL_COMMANDS = [command for page in DOCS for command in commands_in(page)]


def test_the_docs_hold_commands():
    pages = {command.page for command in ALL_COMMANDS}
    assert {"README.md", "docs/cli.md"} <= pages
    assert len(ALL_COMMANDS) > 50


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=lambda c: f"{c.page}:{c.line}")
def test_every_documented_command_parses(command):
    problems = problems_of(command, strict_parser())
    assert not problems, f"{command.page}:{command.line}: `{command.text}`: {'; '.join(problems)}"


def test_the_checker_fails_what_it_should():
    root = strict_parser()

    def check(text: str, inline: bool = False) -> list[str]:
        return problems_of(Command("page", 1, text, inline), root)

    assert check("specheads serve --target T --heads H --lookup-num-tokens 8") == []
    assert check("specheads train RECIPE --set train.steps=10 --dry-run") == []
    assert check("deepspeed --num_gpus 8 --module specheads.train RECIPE --set data.source=regen.jsonl") == []
    assert check("specheads export <dir> --format eagle3 --output OUT") == []
    assert check("specheads tune --heads H", inline=True) == []  # prose: required --target left out
    assert check("specheads tune --heads H")  # a code block's command line must be whole
    assert check("specheads serve --target T --lookup 8") == ["--lookup is a deprecated spelling"]
    assert check("specheads serve --target T --no-such-flag")
    assert check("specheads serve --target T --port eighty")  # not a placeholder: a bad value
    assert check("specheads serve --target T --port PORT") == []  # a placeholder
    assert check("specheads bench --target T [--heads H ...] [--nope N]") == [
        "--nope is not an option of `specheads bench`"]
    assert check("specheads export H --format eagle3|medusa --out DIR") == ["--out is a deprecated spelling"]
    assert check("CUDA_VISIBLE_DEVICES=0 specheads train RECIPE && specheads serve --target T # comment") == []
    assert check("specheads data nope --x 1")
    assert specheads_argv("specheads bench --target T --output-json - | jq .methods") == [
        ["bench", "--target", "T", "--output-json", "-"]]


# ---------------------------------------------------------------------------- Python examples

PACKAGE_DIRS = {"specheads": REPO / "specheads", "specheads.heads": REPO / "heads",
                "specheads.training": REPO / "training", "specheads.serving": REPO / "serving",
                "specheads.data": REPO / "data", "specheads.recipes": REPO / "recipes", "specheads.prompts": REPO / "prompts",
                "specheads.bench": REPO / "bench"}


def module_file(module: str) -> Path | None:
    for package in sorted(PACKAGE_DIRS, key=len, reverse=True):
        if module == package or module.startswith(package + "."):
            base = PACKAGE_DIRS[package].joinpath(*module[len(package):].strip(".").split(".") if module != package
                                                   else [])
            for candidate in (base.with_suffix(".py") if module != package else None, base / "__init__.py"):
                if candidate is not None and candidate.is_file():
                    return candidate
    return None


def top_level_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
            if isinstance(node.value, ast.Dict) and any(getattr(t, "id", "") == "_EXPORTS" for t in targets):
                names |= {key.value for key in node.value.keys if isinstance(key, ast.Constant)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


PYTHON_IMPORTS = [(page.relative_to(REPO).as_posix(), first, node.module, alias.name)
                  for page in DOCS for first, language, body in code_blocks(page.read_text()) if language == "python"
                  for node in ast.walk(ast.parse("\n".join(body))) if isinstance(node, ast.ImportFrom)
                  and (node.module or "").startswith("specheads") for alias in node.names]


def test_python_examples_import_what_exists():
    assert PYTHON_IMPORTS, "README.md's Python API example is gone"
    for page, line, module, name in PYTHON_IMPORTS:
        path = module_file(module)
        assert path is not None, f"{page}:{line}: no module {module}"
        assert name in top_level_names(path) or module_file(f"{module}.{name}"), \
            f"{page}:{line}: {module} has no {name}"


# ---------------------------------------------------------------------------- links

def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lower case, punctuation but - and _ dropped,
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[`*]", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(page.read_text()):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def links_in(page: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in prose_lines(page.read_text()):
        found += [(number, target) for target in LINK.findall(INLINE.sub("", line))]
    return found


def test_every_relative_link_resolves():
    broken = []
    for page in DOCS:
        for number, target in links_in(page):
            if SCHEME.match(target):
                continue
            path_part, _, fragment = target.partition("#")
            destination = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(REPO)}:{number}: {target}"
            if not destination.exists():
                broken.append(f"{where}: no such file")
            elif fragment and destination.suffix == ".md" and fragment not in anchors(destination):
                broken.append(f"{where}: no heading #{fragment} in {destination.relative_to(REPO)}")
    assert not broken, "\n".join(broken)


def test_the_link_checker_reads_links_and_anchors(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Serve the heads: vLLM, `SGLang`\n\n## Results\n\n## Results\n\n"
                    "[a](docs/cli.md#serve) ![b](x.png \"t\") `[not](a-link.md)` [c](https://x.org/y)\n")
    assert anchors(page) == {"serve-the-heads-vllm-sglang", "results", "results-1"}
    assert [target for _, target in links_in(page)] == ["docs/cli.md#serve", "x.png", "https://x.org/y"]


# ---------------------------------------------------------------------------- what pages may not say

def written_run_dirs() -> set[str]:
    """What shipped code writes under runs/: each shipped recipe's train.output_dir, and the demo's
    default --workdir."""
    dirs = {"runs/demo"}
    for recipe in (REPO / "recipes").glob("*.yaml"):
        output_dir = ((yaml.safe_load(recipe.read_text()) or {}).get("train") or {}).get("output_dir")
        if output_dir:
            dirs.add(output_dir.rstrip("/"))
    return dirs


FORBIDDEN = [(re.compile(r"\bsessions? \d+", re.I), "a work session"),
             (re.compile(r"not committed", re.I), "a file that is not in the repository"),
             (re.compile(r"\b(this|the|a) slow VM\b|\bthis VM\b|these (2|two) cores|our development machines?",
                         re.I), "the development machines' conditions")]


def test_pages_name_only_what_users_have():
    allowed = written_run_dirs()
    found = []
    for page in DOCS:
        for number, line in enumerate(page.read_text().splitlines(), start=1):
            where = f"{page.relative_to(REPO)}:{number}"
            found += [f"{where}: {why}: {pattern.search(line).group(0)!r}" for pattern, why in FORBIDDEN
                      if pattern.search(line)]
            for path in re.findall(r"(?<![\w/.-])runs/[\w.*-]+", line):
                if path not in allowed:
                    found.append(f"{where}: {path} is not written by a shipped recipe or the demo")
    assert not found, "\n".join(found)


# ---------------------------------------------------------------------------- the reference is whole

CLI_REFERENCE = REPO / "docs" / "cli.md"


def command_paths(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every runnable command: path (("data", "regenerate")) -> its parser."""
    children = _subparsers(parser)
    if not children:
        return {path: parser}
    found = {}
    for name, child in children.items():
        found.update(command_paths(child, path + (name,)))
    return found


def sections(page: Path) -> dict[str, str]:
    """Heading text -> the text under it, up to the next heading of any level."""
    out, heading, lines = {}, None, []
    for _, line in prose_lines(page.read_text()) + [(0, "# end")]:
        match = re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if match:
            if heading is not None:
                out[heading] = "\n".join(lines)
            heading, lines = match.group(1), []
        else:
            lines.append(line)
    return out


def test_the_cli_reference_names_every_command_and_option():
    """docs/cli.md has a section `specheads PATH` for every command, naming each of its options
    in inline code, and its table of deprecated spellings names every old spelling."""
    page = sections(CLI_REFERENCE)
    missing = []
    deprecated_table = page["Deprecated spellings"]
    for path, parser in command_paths(build_parser()).items():
        heading = f"`specheads {' '.join(path)}`"
        if heading not in page:
            missing.append(f"no section {heading}")
            continue
        current, deprecated = option_names(parser)
        for option in sorted(current - {"-h", "--help", "--local_rank", "--local-rank"}):
            if not re.search(r"`" + re.escape(option) + r"[`\s=]", page[heading]):
                missing.append(f"{heading} does not name {option}")
        missing += [f"the deprecated spellings do not name {old} ({heading})" for old in sorted(deprecated)
                    if f"`{old}" not in deprecated_table]
    assert not missing, "\n".join(missing)


def test_commands_sit_in_fenced_blocks():
    """An indented code block is not read by the checks above: a command must be fenced (```)."""
    unfenced = [f"{page.relative_to(REPO)}:{number}" for page in DOCS for number, line in prose_lines(page.read_text())
                if re.match(r"^( {4,}|\t)", line) and is_command(line)]
    assert not unfenced, f"commands in indented code blocks (fence them): {unfenced}"
