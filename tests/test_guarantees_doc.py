"""docs/guarantees.md names, for each invariant, code and tests that exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "guarantees.md"


def invariants(text: str) -> dict[str, str]:
    """Each invariant's paragraph (``I1`` ... ), up to the next invariant or heading."""
    section = text.split("## Invariants", 1)[1].split("\n## ", 1)[0]
    parts = re.split(r"^\*\*(I\d+)\.", section, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def functions_in(path: str) -> set[str]:
    source = REPO / path
    assert source.is_file(), path
    return {
        node.name
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8")))
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    }


def test_every_test_the_guarantees_name_exists() -> None:
    text = DOC.read_text(encoding="utf-8")
    named = re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?`", text)
    assert len(named) > 20
    for path, name in named:
        functions = functions_in(path)
        if name:
            assert name in functions, f"{path}::{name} is no test function"


def test_every_invariant_names_test_functions_not_files() -> None:
    """A whole file says nothing of which of its tests checks the invariant: each invariant's
    ``Tests:`` names test functions (``tests/file.py::test_name``), each of which exists."""
    found = invariants(DOC.read_text(encoding="utf-8"))
    assert len(found) >= 18 and list(found) == [f"I{n}" for n in range(1, len(found) + 1)]
    for number, paragraph in found.items():
        assert paragraph.count("\nTests: ") == 1, f"{number} names no tests (or names them twice)"
        tests = paragraph.split("\nTests: ", 1)[1]
        named = re.findall(r"`([^`]*)`", tests)
        assert named, f"{number}: its Tests: names nothing"
        for item in named:
            match = re.fullmatch(r"(tests/[\w/]+\.py)::(test_\w+)", item)
            assert match, f"{number} names `{item}`, not a test function (file.py::test_name)"
            path, name = match.groups()
            assert name in functions_in(path), f"{number}: {path}::{name} is no test function"


def test_every_module_the_guarantees_name_exists() -> None:
    text = DOC.read_text(encoding="utf-8")
    modules = re.findall(r"`((?:stores|loaders|ops|sources|images)/[\w/]+\.py|records\.py)`", text)
    assert modules
    for module in modules:
        assert (REPO / "fastdata" / module).is_file(), module
    assert len(re.findall(r"^\*\*I\d+\.", text, flags=re.M)) >= 10
