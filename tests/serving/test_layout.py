"""serving/'s parts import one way: server -> decode -> kernels (serving/__init__.py).

Every import statement in serving/ is read from the source (lazy imports inside functions
included), so a back edge fails here even when it is never executed by another test.
"""

import ast
from pathlib import Path

import pytest

from conftest import REPO

SERVING = REPO / "serving"
# part -> the serving parts it must not import
FORBIDDEN = {"kernels": {"decode", "server"}, "decode": {"server"}, "server": set()}


def imported_serving_parts(path: Path) -> set[tuple[str, int]]:
    """(serving part, line) of every import of specheads.serving.<part> in one file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["specheads", "serving"] and len(parts) > 2:
                found.add((parts[2], node.lineno))
    return found


def test_every_serving_module_lives_in_a_part():
    assert sorted(p.name for p in SERVING.glob("*.py")) == ["__init__.py"]
    assert {p.name for p in SERVING.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(FORBIDDEN)


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_imports_go_one_way(part):
    back_edges = [f"{path.relative_to(SERVING)}:{line} imports serving.{other}"
                  for path in sorted((SERVING / part).glob("*.py"))
                  for other, line in imported_serving_parts(path) if other in FORBIDDEN[part]]
    assert not back_edges, back_edges


def test_the_checker_sees_lazy_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from specheads.serving.server.app import create_app\n")
    assert imported_serving_parts(module) == {("server", 2)}
