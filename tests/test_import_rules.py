"""The import rules of docs/architecture.md, read from that page and checked against the source:
the "may import" table and the "Never" rules.

The table's `folder` and `may import` columns are parsed from the page itself, so the page and
this check cannot drift apart: change a rule there and the code is checked against the new rule.
Every import in every part (heads/, data/, training/, serving/, recipes/, specheads/, bench/)
is read with `ast`, lazy imports inside functions included, and so are the imports hidden in
strings (`importlib.import_module("specheads.x")`, `resources.files("specheads.x")`, which
import that package too). A rule broken by code that no other test runs still fails here.
Inside serving/, the one-way order server -> decode -> kernels is tests/serving/test_layout.py's.
The parts are not imported (no torch): the checks read their files; only the face's
__init__, which imports importlib alone, is imported for its list of lazy re-exports.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest

from conftest import REPO

ARCHITECTURE = REPO / "docs" / "architecture.md"
TABLE_HEADER = ("folder", "owns", "may import")


def read_may_import(page: Path = ARCHITECTURE) -> dict[str, str]:
    """The parts table of docs/architecture.md: folder ("heads/") -> its "may import" cell, as
    written. What the words mean to the checker (the page says it too):
    - a part's name: that part. A dotted name (`specheads.runner`): that one module of the face.
      Any other name is a third-party package; the ones named anywhere in the column are the
      governed ones (GOVERNED), and a part may import those it names plus those of every part
      it may import (data may import torch because it may import heads). Packages the table
      never names (numpy, tqdm, the standard library) are not governed by it.
    - "everything, lazily": any part and package, but only inside a function, so that importing
      the face imports none of them.
    - "(...)" says what the import is for; the checker drops it.
    - tests/ is not checked: tests import the parts they test; its "-" says no part imports it."""
    rows, in_table = {}, False
    for line in page.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is not None and tuple(cells) == TABLE_HEADER:
            in_table = True
        elif in_table and cells is None:
            break
        elif in_table and not set(line) <= set("|-: "):
            assert len(cells) == len(TABLE_HEADER), f"{page.name}: a parts table row needs 3 cells: {line}"
            rows[cells[0].strip("`")] = cells[2]
    assert rows, f"{page.name} has no table with the header | folder | owns | may import |"
    return rows


MAY_IMPORT = read_may_import()
# bench/step_costs.py imports specheads.runner (the shared target loader) to time the same
# target that `specheads bench` loads: allowed, as the table's bench/ row says.

# docs/architecture.md, "Never:", one rule a line, word for word (test_the_page_states_every_rule).
# The last one, "Importing `specheads` must stay fast", is test_importing_specheads_stays_fast;
# the others are NEVER.


class Never(NamedTuple):
    rule: str  # the page's words
    applies_to: Callable[[str], bool]  # the importing module's dotted name
    forbidden: tuple[str, ...]  # module prefixes: "specheads.data" forbids specheads.data.*


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


NEVER = (
    Never("`heads` imports `training`, `serving` or `data`",
          lambda module: _within(module, "specheads.heads"),
          ("specheads.training", "specheads.serving", "specheads.data")),
    Never("`serving` imports `training`, `data`, deepspeed, wandb or datasets",
          lambda module: _within(module, "specheads.serving"),
          ("specheads.training", "specheads.data", "deepspeed", "wandb", "datasets")),
    Never("anything but `serving/` imports fastapi",
          lambda module: not _within(module, "specheads.serving"),
          ("fastapi",)),
    # The app is serving/server/ (the FastAPI app and what serves it).
    Never("kernels import the app",
          lambda module: _within(module, "specheads.serving.kernels"),
          ("specheads.serving.server",)),
)
FAST_IMPORT_RULE = "Importing `specheads` must stay fast (no deepspeed/wandb/fastapi at import)"
SLOW_AT_IMPORT = ("deepspeed", "wandb", "fastapi")  # "no deepspeed/wandb/fastapi at import"

PARTS = tuple(folder.rstrip("/") for folder in MAY_IMPORT if folder != "tests/")
FACE = "specheads"


def module_name(path: Path) -> str:
    """The dotted name pyproject's package-dir gives a file: heads/x.py -> specheads.heads.x."""
    folder, *rest = path.relative_to(REPO).with_suffix("").parts
    names = [FACE] + ([] if folder == FACE else [folder]) + rest
    return ".".join(names[:-1] if names[-1] == "__init__" else names)


def part_of(module: str) -> str | None:
    """The part a dotted name lives in (its folder's name), or None for a third-party name."""
    names = module.split(".")
    if names[0] != FACE:
        return None
    return names[1] if len(names) > 1 and names[1] in PARTS else FACE


class Import(NamedTuple):
    line: int
    module: str  # absolute dotted name of what is imported
    lazy: bool  # inside a function body: runs when called, not when the module is imported


def _with_laziness(node: ast.AST, lazy: bool = False):
    for child in ast.iter_child_nodes(node):
        yield child, lazy
        yield from _with_laziness(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))


def _dotted(base: str, name: str, known_modules: set[str]) -> str:
    """`from base import name`: base.name when that is a module, else base."""
    return f"{base}.{name}" if f"{base}.{name}" in known_modules else base


def imports_in(source: str, module: str, is_package: bool, known_modules: set[str]) -> list[Import]:
    """Every import in one module's source: statements (relative ones resolved, lazy ones
    included) and import_module/files/__import__ calls on a literal specheads name."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node, lazy in _with_laziness(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [Import(node.lineno, alias.name, lazy) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            found += [Import(node.lineno, _dotted(base, alias.name, known_modules), lazy) for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            called = getattr(node.func, "attr", getattr(node.func, "id", None))
            target = node.args[0].value
            if called in ("import_module", "files", "__import__") and isinstance(target, str) \
                    and part_of(target) is not None:
                found.append(Import(node.lineno, target, lazy))
    return list(dict.fromkeys(found))  # `from m import a, b` is one import of m


def source_files() -> dict[str, Path]:
    """module name -> file, for every .py file of every part."""
    return {module_name(path): path for part in PARTS for path in sorted((REPO / part).rglob("*.py"))}


def _words(may_import: str) -> list[str]:
    """A "may import" cell as names: "heads (the target), `specheads.runner`" -> [heads, specheads.runner]."""
    words = (word.strip(" `") for word in re.sub(r"\(.*?\)", "", may_import).split(","))
    return [word for word in words if word not in ("", "-")]


# The third-party packages the table names; a part imports one only where the table lets it.
GOVERNED = {word for cell in MAY_IMPORT.values() for word in _words(cell)
            if word not in PARTS and word not in ("everything", "lazily") and part_of(word) is None}


def allowed(part: str) -> tuple[set[str], set[str], bool]:
    """-> (parts and face modules, governed packages, lazily only) that `part` may import,
    read from MAY_IMPORT's words."""
    words = _words(MAY_IMPORT[f"{part}/"])
    if words == ["everything", "lazily"]:
        return set(PARTS), set(GOVERNED), True
    modules = {word for word in words if word in PARTS or part_of(word) is not None}
    packages = set(words) - modules
    for other in modules & set(PARTS):
        packages |= allowed(other)[1]
    return modules, packages, False


def rule_breaks(module: str, imports: list[Import]) -> list[tuple[str, int, str]]:
    """-> (imported module, line, what it breaks) for every import of `module` that breaks the
    table or a Never rule."""
    part = part_of(module)
    may_modules, may_packages, lazily_only = allowed(part)
    row = f"table: {part}/ may import {MAY_IMPORT[f'{part}/']}"
    breaks = []
    for imp in imports:
        target, top = part_of(imp.module), imp.module.split(".")[0]
        if target == part or (target is None and top not in GOVERNED):
            pass  # its own modules, the standard library, packages the table does not name
        elif not (top in may_packages if target is None else
                  target in may_modules or any(_within(imp.module, may) for may in may_modules)):
            breaks.append((imp.module, imp.line, row))
        elif lazily_only and not imp.lazy:
            breaks.append((imp.module, imp.line, f"{row} (at module level)"))
        breaks += [(imp.module, imp.line, f"Never: {never.rule}") for never in NEVER
                   if never.applies_to(module) and any(_within(imp.module, bad) for bad in never.forbidden)]
    return breaks


def all_imports() -> dict[str, list[Import]]:
    files = source_files()
    return {module: imports_in(path.read_text(), module, path.name == "__init__.py", set(files))
            for module, path in files.items()}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules that import one another, directly or through others (each group of more than
    one module whose members all reach one another: Tarjan's strongly connected components)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(start: str) -> None:  # iterative, so a long chain of imports needs no deep recursion
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    circles.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def test_no_modules_import_each_other():
    """An import circle (heads_dir -> model_card -> export_llama_cpp -> heads_dir, say) means
    no module of it can be read, tested or moved without the others; lazy imports count."""
    imports = all_imports()
    graph = {module: {imp.module for imp in found if imp.module in imports and imp.module != module}
             for module, found in imports.items()}
    assert import_circles(graph) == []
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_part_imports_only_what_design_allows():
    files = source_files()
    found = [f"{files[module].relative_to(REPO).as_posix()}:{line} imports {imported}: breaks {rule}"
             for module, imports in all_imports().items() for imported, line, rule in rule_breaks(module, imports)]
    assert not found, "\n".join(found)


# docs/architecture.md, "Inside heads/ and bench/": each part's sub-folders and their rank. A
# module imports its own sub-folder and those of lower rank (the part's root files are rank 0):
# in heads/, artefacts -> target -> the heads; in bench/, gpu/ and tools/ -> the bench.
SUB_FOLDERS = {"heads": {"target": 1, "artefacts": 2}, "bench": {"gpu": 1, "tools": 1}}


def sub_folder(module: str) -> str:
    """The sub-folder of heads/ or bench/ a dotted name lives in; "" for the part's root files."""
    names = module.split(".")
    return names[2] if len(names) > 3 and names[2] in SUB_FOLDERS.get(names[1], {}) else ""


def sub_folder_breaks(module: str, imports: list[Import]) -> list[str]:
    part = part_of(module)
    rank = SUB_FOLDERS.get(part, {})
    own = sub_folder(module)
    return [f"{imp.line} imports {imp.module}" for imp in imports if part_of(imp.module) == part
            and sub_folder(imp.module) != own and rank.get(sub_folder(imp.module), 0) >= rank.get(own, 0)]


def test_sub_folders_import_one_way():
    files = source_files()
    for part, folders in SUB_FOLDERS.items():
        assert {path.parent.name for path in (REPO / part).glob("*/__init__.py")} == set(folders), part
    found = [f"{files[module].relative_to(REPO).as_posix()}:{where}" for module, imports in all_imports().items()
             for where in sub_folder_breaks(module, imports)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("source, module, breaks", [
    ("from specheads.heads.artefacts.heads_dir import load_heads\n", "specheads.heads.target.adapter", True),
    ("from specheads.heads.artefacts.heads_dir import load_heads\n", "specheads.heads.eagle3", True),
    ("from specheads.heads.target.adapter import TargetAdapter\n", "specheads.heads.artefacts.export", False),
    ("from specheads.heads import atomic\n", "specheads.heads.target.gguf", False),
    ("def f():\n    from specheads.bench.tools.serve_load import main\n", "specheads.bench.gpu.suite", True),
    ("from specheads.bench.gpu.suite import main\n", "specheads.bench.harness", True),
    ("from specheads.bench.harness import run_bench\n", "specheads.bench.tools.learning_curve", False),
])
def test_the_sub_folder_checker(source, module, breaks):
    imports = imports_in(source, module, False, set(source_files()))
    assert bool(sub_folder_breaks(module, imports)) == breaks


def test_importing_specheads_stays_fast():
    """What `import specheads` runs (module-level imports, followed through the project's
    modules) reaches none of deepspeed, wandb, fastapi; nor do the public API's lazy
    re-exports (specheads._EXPORTS), which `specheads.generate` and friends import."""
    import specheads  # the face alone: its __init__ imports only importlib

    imports = all_imports()
    for start in [FACE, *sorted(set(specheads._EXPORTS.values()))]:
        slow = sorted(_slow_imports_reached(start, imports))
        assert not slow, f"importing {start} runs {slow}: breaks {FAST_IMPORT_RULE}"


def _slow_imports_reached(start: str, imports: dict[str, list[Import]]) -> set[tuple[str, str]]:
    """(module that imports it, the slow package) for every slow package reached by importing
    `start`: importing a.b.c runs a, a.b and a.b.c, and each one's module-level imports."""
    seen, todo, slow = set(), [start], set()
    while todo:
        names = todo.pop().split(".")
        for module in (".".join(names[:end]) for end in range(1, len(names) + 1)):
            if module in seen or module not in imports:
                continue
            seen.add(module)
            for imp in imports[module]:
                if imp.lazy:
                    continue
                if imp.module.split(".")[0] in SLOW_AT_IMPORT:
                    slow.add((module, imp.module))
                todo.append(imp.module)
    return slow


def test_the_table_is_read_as_design_means():
    assert GOVERNED == {"torch", "transformers", "peft", "safetensors", "datasets", "deepspeed", "wandb",
                        "triton", "fastapi"}
    assert allowed("data") == ({"heads", "specheads.serving.decode", "prompts"},
                               {"torch", "transformers", "peft", "safetensors", "datasets"}, False)
    assert allowed("bench")[0] == {"heads", "serving", "prompts", "specheads.runner"}
    assert allowed("recipes") == (set(), set(), False)
    assert allowed("specheads")[2]
    assert module_name(REPO / "serving" / "decode" / "__init__.py") == "specheads.serving.decode"
    assert module_name(REPO / "specheads" / "runner.py") == "specheads.runner"
    assert part_of("specheads.runner") == "specheads" and part_of("specheads.bench.tune") == "bench"


def _breaks_in(source: str, module: str) -> list[tuple[str, int, str]]:
    known = {"specheads.serving.server", "specheads.serving.server.app", "specheads.runner"}
    return rule_breaks(module, imports_in(source, module, False, known))


def test_the_checker_fails_a_forbidden_import():
    source = ("import torch\n"
              "def load():\n"
              "    from ..training import trainer\n"
              "    importlib.import_module('specheads.data.text')\n")
    assert _breaks_in(source, "specheads.heads.example") == [
        ("specheads.training", 3, "table: heads/ may import torch, transformers, peft, safetensors"),
        ("specheads.training", 3, "Never: `heads` imports `training`, `serving` or `data`"),
        ("specheads.data.text", 4, "table: heads/ may import torch, transformers, peft, safetensors"),
        ("specheads.data.text", 4, "Never: `heads` imports `training`, `serving` or `data`"),
    ]


DATA_ROW = f"table: data/ may import {MAY_IMPORT['data/']}"


@pytest.mark.parametrize("source, module, rule", [
    ("import wandb\n", "specheads.serving.decode.engine",
     "Never: `serving` imports `training`, `data`, deepspeed, wandb or datasets"),
    ("def f():\n    import fastapi\n", "specheads.bench.harness", "Never: anything but `serving/` imports fastapi"),
    ("from specheads.serving import server\n", "specheads.serving.kernels.native", "Never: kernels import the app"),
    ("import deepspeed\n", "specheads.data.text", DATA_ROW),
    # a dotted name allows that module alone, not its part's other modules or packages
    ("from specheads.serving.server import app\n", "specheads.data.regenerate", DATA_ROW),
    ("import triton\n", "specheads.data.regenerate", DATA_ROW),
    ("from specheads.bench import harness\n", "specheads.data.self_instruct", DATA_ROW),
    ("from specheads.serving.decode import config\n", "specheads.cli",
     "table: specheads/ may import everything, lazily (at module level)"),
    ("from specheads.errors import UserError\n", "specheads.bench.step_costs",
     "table: bench/ may import heads, serving, prompts, `specheads.runner` (the shared loader)"),
])
def test_the_checker_fails_each_rule(source, module, rule):
    assert rule in [broken for _, _, broken in _breaks_in(source, module)]


def test_the_checker_passes_allowed_imports():
    assert _breaks_in("from specheads.runner import load_target\nimport triton\n", "specheads.bench.step_costs") == []
    assert _breaks_in("def f():\n    import deepspeed\n    from specheads.training import trainer\n",
                      "specheads.train") == []
    assert _breaks_in("from . import trees\nimport transformers\n", "specheads.serving.decode.engine") == []


def test_the_page_states_every_rule():
    """The page's "Never:" list holds exactly the rules checked here."""
    text = ARCHITECTURE.read_text()
    never_list = text.split("\nNever:\n", 1)[1].lstrip("\n").split("\n\n", 1)[0]
    stated = [line[2:].strip() for line in never_list.splitlines() if line.startswith("- ")]
    assert stated == [never.rule for never in NEVER] + [FAST_IMPORT_RULE]


def test_the_table_reader_reads_what_the_page_says(tmp_path):
    page = tmp_path / "architecture.md"
    page.write_text("# x\n\n| folder | owns | may import |\n|---|---|---|\n"
                    "| `heads/` | the adapter | torch, transformers |\n"
                    "| `bench/` | benches | heads, `specheads.runner` (the loader) |\n\nAfter the table.\n"
                    "| a | b |\n")
    assert read_may_import(page) == {"heads/": "torch, transformers",
                                     "bench/": "heads, `specheads.runner` (the loader)"}
    page.write_text("| folder | may import |\n|---|---|\n| `heads/` | torch |\n")
    with pytest.raises(AssertionError, match="no table"):
        read_may_import(page)


def test_pyproject_packages_every_folder_of_the_parts():
    """pyproject's `packages` is the list of every folder of a part that holds an __init__.py, so a
    new or moved sub-package is installed (an editable install of the checkout would hide a
    missing one; a wheel or a fresh clone would not)."""
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {module_name(init) for part in PARTS for init in (REPO / part).rglob("__init__.py")}
    assert set(setuptools["packages"]) == folders
    assert {name: REPO / folder for name, folder in setuptools["package-dir"].items()} == \
        {FACE if part == FACE else f"{FACE}.{part}": REPO / part for part in PARTS}
