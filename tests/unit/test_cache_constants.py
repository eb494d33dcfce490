"""Cache format constants are read from dflash.cache, never re-derived (issue 18): no folder or file name of
the cache spelled out in a path outside dflash/cache, and no default pulled out of a signature by inspect."""

from __future__ import annotations

import ast
import pathlib

import pytest

from dflash.cache import commit as cm
from dflash.cache.format import DEFAULT_CHUNK_BYTES, STORED_ITEMSIZE, STORED_NUMPY_DTYPE, hidden_chunk_tokens

ROOT = pathlib.Path(__file__).resolve().parents[2]
NAMES = {cm.SHARDS, cm.COMMITS, cm.STAGING, cm.TOKENIZED, cm.MANIFEST, cm.LOCK}
# dflash/generate has an output format of its own (its shards/ and _staging/ are not the cache's).
FILES = sorted(p for p in [*(ROOT / "dflash").rglob("*.py"), *(ROOT / "cli").glob("*.py"),
                           *(ROOT / "benchmarks" / f"bench_{b}.py" for b in ("extract", "cache", "tokenize"))]
               if "cache" not in p.relative_to(ROOT).parts[:2] and "generate" not in p.relative_to(ROOT).parts[:2])


def _path_literals(tree: ast.AST) -> list[tuple[int, str]]:
    """String constants used as parts of a path: os.path.join(...) arguments and operands of `/`."""
    found = []
    for node in ast.walk(tree):
        parts = []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join":
            parts = node.args
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            parts = [node.left, node.right]
        found += [(p.lineno, p.value) for p in parts if isinstance(p, ast.Constant) and p.value in NAMES]
    return found


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_cache_names_come_from_dflash_cache(path):
    tree = ast.parse(path.read_text())
    bad = _path_literals(tree)
    assert not bad, f"{path.relative_to(ROOT)} spells cache names {bad}: import them from dflash.cache.commit"
    inspects = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "signature"
                and "CacheWriter" in ast.unparse(n.value.value if isinstance(n.value, ast.Attribute) else n.value)]
    assert not inspects, f"{path.relative_to(ROOT)}: inspect.signature(CacheWriter...) at lines {inspects}"


def test_exported_widths_match_the_dtypes():
    import numpy as np

    assert {k: np.dtype(v).itemsize for k, v in STORED_NUMPY_DTYPE.items()} == STORED_ITEMSIZE
    from dflash.cache import CacheWriter

    assert CacheWriter.__init__.__kwdefaults__["chunk_bytes"] == DEFAULT_CHUNK_BYTES
    assert hidden_chunk_tokens(hidden_size=5120, storage="bf16") == 32  # DESIGN: 27B bf16 chunks of 32 tokens
