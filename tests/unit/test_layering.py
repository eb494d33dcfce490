"""The dependency direction: cli -> dflash -> libraries; inside dflash the layer table of docs/ARCHITECTURE.md,
read from that page, and no import circles between modules.

Every import counts: module level, inside functions (lazy) and under TYPE_CHECKING, since each of them is a
dependency a reader has to follow and a circle of lazy imports is still a knot.
"""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIB = ROOT / "dflash"
LIB_FILES = sorted(LIB.rglob("*.py"))


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(p): p for p in LIB_FILES}


def _imported_names(path: pathlib.Path) -> set[str]:
    """Absolute names of everything `path` imports (relative imports resolved); `from X import y` gives X.y
    when y is a module of dflash (importing a submodule by name), else X."""
    me = _module_name(path).split(".")
    package = me if path.name == "__init__.py" else me[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[:len(package) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            for a in node.names:
                names.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
    return names


def _dflash_modules_imported(path: pathlib.Path) -> set[str]:
    """The dflash modules (files) that `path` imports, itself excluded."""
    out = set()
    for name in _imported_names(path):
        if name == "dflash" or name.startswith("dflash."):
            while name not in MODULES:  # a class or function imported from a module: its module
                name = name.rpartition(".")[0]
            out.add(name)
    out.discard(_module_name(path))
    return out


def _unit(module: str) -> str:
    """The layer-table unit of a dflash module: its package (cache, train, ...) or top-level file (errors, ...)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "dflash"


def _layer_table() -> list[tuple[set[str], set[str]]]:
    """(units of the row, units it may import) per row of docs/ARCHITECTURE.md's table, lowest row first."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("Package", "---") or not cells[0].startswith("`"):
            continue

        def names(cell):
            return {n.rstrip("/").removesuffix(".py") for n in re.findall(r"`([^`]+)`", cell)}
        rows.append((names(cells[0]), names(cells[2])))
    return rows


TABLE = _layer_table()


def _allowed(unit: str) -> set[str]:
    rules = TABLE[0][0]
    for i, (row, may) in enumerate(TABLE):
        if unit in row:
            return may if i == 0 else may | rules | row
    raise AssertionError(f"dflash/{unit} is in no row of docs/ARCHITECTURE.md's layer table: add it")


def test_layer_table_is_read():
    assert len(TABLE) >= 10, TABLE
    assert {"errors", "durable"} <= TABLE[0][0] and TABLE[0][1] == {"errors"}
    listed = set().union(*(row for row, _ in TABLE))
    units = {_unit(m) for m in MODULES} - {"dflash"}
    assert units <= listed, f"not in the layer table: {sorted(units - listed)}"
    lower = set()
    for row, may in TABLE:  # each row may import only rows below it: the table itself points down
        assert may <= lower | TABLE[0][0], f"{row} may import {sorted(may - lower)}, which is not below it"
        lower |= row


@pytest.mark.parametrize("path", LIB_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_library_never_imports_cli_or_click(path):
    bad = {n for n in _imported_names(path) if n.split(".")[0] in {"cli", "click"}}
    assert not bad, f"{path} imports {bad}"


@pytest.mark.parametrize("path", LIB_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_library_layers_point_down(path):
    module = _module_name(path)
    unit = _unit(module)
    imported = {_unit(m) for m in _dflash_modules_imported(path)} - {unit}
    if unit == "dflash":  # dflash/__init__.py: the package marker imports nothing of its own
        assert not imported, f"dflash/__init__.py imports {imported}"
        return
    bad = imported - _allowed(unit)
    assert not bad, (f"{module} imports {sorted(bad)}, which docs/ARCHITECTURE.md's layer table does not put "
                     f"below dflash/{unit}: move the shared piece down (or into its own module)")


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_circle_finder_finds_circles():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set(), "c": {"b"}}) == []


def test_no_import_circles_between_modules():
    graph = {m: _dflash_modules_imported(p) for m, p in MODULES.items()}
    circles = _circles(graph)
    assert not circles, f"import circles in dflash/: {circles}"
