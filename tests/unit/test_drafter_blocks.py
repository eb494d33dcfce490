"""dflash.drafter.blocks.block_input_ids pins the DFlash block input [x_a, MASK x (B-1)], and is the only place
in dflash/ that builds it (training, tau, live and held-out evaluation call it)."""

import ast
import pathlib

import torch

from dflash.drafter.blocks import block_input_ids

ROOT = pathlib.Path(__file__).parents[2]


def test_rows_are_anchor_then_masks():
    ids = block_input_ids(torch.tensor([5, 7, 9], dtype=torch.int32), block_size=4, mask_token_id=99)
    assert ids.dtype == torch.int64 and ids.shape == (3, 4)
    assert ids.tolist() == [[5, 99, 99, 99], [7, 99, 99, 99], [9, 99, 99, 99]]


def test_one_block_leading_shapes_and_block_of_one():
    assert block_input_ids(torch.tensor(3), block_size=3, mask_token_id=0).tolist() == [3, 0, 0]
    grid = block_input_ids(torch.arange(6).view(2, 3), block_size=2, mask_token_id=-1)
    assert grid.shape == (2, 3, 2) and grid[..., 0].tolist() == [[0, 1, 2], [3, 4, 5]] and (grid[..., 1] == -1).all()
    assert block_input_ids(torch.tensor([4, 2]), block_size=1, mask_token_id=8).tolist() == [[4], [2]]
    assert block_input_ids(torch.empty(0, dtype=torch.long), block_size=4, mask_token_id=1).shape == (0, 4)


def test_training_blocks_use_it():
    from dflash.train.objective import build_packed_blocks

    ids_T = torch.tensor([10, 11, 12, 13, 20, 21, 22])
    blocks = build_packed_blocks(ids_T, torch.ones(7), torch.tensor([0, 2, 1]), lengths=[4, 3],
                                 blocks_per_sample=[2, 1], block_size=3, mask_token_id=50)
    assert blocks.block_ids_JB.tolist() == [[10, 50, 50], [12, 50, 50], [21, 50, 50]]
    assert torch.equal(blocks.block_ids_JB, block_input_ids(torch.tensor([10, 12, 21]), block_size=3,
                                                            mask_token_id=50))


def _full_with_mask(tree: ast.AST) -> list[int]:
    """Lines of torch.full(...) calls that name a mask token id: a block input built by hand."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "full":
            if "mask_token" in ast.unparse(node) or "mask_id" in ast.unparse(node):
                lines.append(node.lineno)
    return lines


def test_no_other_module_builds_the_block_input():
    found = {}
    for path in sorted((ROOT / "dflash").rglob("*.py")):
        if path.name == "blocks.py" and path.parent.name == "drafter":
            continue
        # the exported stand-alone modeling file may not import dflash: it restates the rule, and
        # tests/unit/test_drafter_remote_code.py holds its forward and drafts equal to dflash's
        if path.name == "modeling_dflash.py" and path.parent.name == "drafter":
            continue
        lines = _full_with_mask(ast.parse(path.read_text()))
        if lines:
            found[str(path.relative_to(ROOT))] = lines
    assert found == {}, f"build the block input with dflash.drafter.blocks.block_input_ids: {found}"
