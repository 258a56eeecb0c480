"""docs/guarantees.md names, for each invariant, code and tests that exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "guarantees.md"


def test_every_test_the_guarantees_name_exists() -> None:
    text = DOC.read_text(encoding="utf-8")
    named = re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?`", text)
    assert len(named) > 20
    for path, name in named:
        source = REPO / path
        assert source.is_file(), path
        if name:
            functions = {
                node.name
                for node in ast.walk(ast.parse(source.read_text(encoding="utf-8")))
                if isinstance(node, ast.FunctionDef)
            }
            assert name in functions, f"{path}::{name}"


def test_every_module_the_guarantees_name_exists() -> None:
    text = DOC.read_text(encoding="utf-8")
    modules = re.findall(r"`((?:stores|loaders|ops|sources|images)/[\w/]+\.py|records\.py)`", text)
    assert modules
    for module in modules:
        assert (REPO / "fastdata" / module).is_file(), module
    assert len(re.findall(r"^\*\*I\d+\.", text, flags=re.M)) >= 10
