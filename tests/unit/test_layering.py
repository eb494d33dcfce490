"""The dependency direction of DESIGN.md: cli -> dflash; nothing in dflash imports cli or click."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# package -> packages of dflash it must not import
FORBIDDEN = {
    "cache": {"data", "target", "extract", "drafter", "train", "eval", "sweep"},
    "data": {"cache", "target", "extract", "drafter", "train", "eval", "sweep"},
    "drafter": {"cache", "data", "target", "extract", "train", "eval", "sweep"},
    "target": {"cache", "extract", "drafter", "train", "eval", "sweep"},
    "extract": {"drafter", "train", "eval", "sweep"},
    # train -> eval: the training driver evaluates held-out tau (dflash.eval.heldout); eval never imports train
    "train": {"extract", "sweep"},
    "eval": {"extract", "train", "sweep"},
    # serve-check replays an eval cache on a server and reads dflash eval; it trains nothing
    "serve": {"extract", "train", "sweep"},
}


def _imports(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


LIB_FILES = sorted((ROOT / "dflash").rglob("*.py"))


@pytest.mark.parametrize("path", LIB_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_library_never_imports_cli_or_click(path):
    bad = {n for n in _imports(path) if n.split(".")[0] in {"cli", "click"}}
    assert not bad, f"{path} imports {bad}"


@pytest.mark.parametrize("path", LIB_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_library_layers_point_down(path):
    pkg = path.relative_to(ROOT / "dflash").parts[0]
    forbidden = FORBIDDEN.get(pkg, set())
    bad = {n for n in _imports(path) if n.startswith("dflash.") and n.split(".")[1] in forbidden}
    assert not bad, f"dflash.{pkg} must not import {bad}"
