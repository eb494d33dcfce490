"""layout_tiles: the flex-attention tile lists computed from a BlockLayout's structure. Pinned against the
predicate itself: every tile holding a visible pair is visited, every tile marked full is wholly visible,
and a compiled flex attention that skips the unlisted tiles gives the dense path's output."""

import warnings

import pytest
import torch

from dflash.drafter.attention import BlockLayout, dense_block_attention, dense_mask, flex_block_mask, layout_tiles
from dflash.train.objective import packed_layout


def random_layout(g: torch.Generator, *, num_seqs: int, block_size: int, max_len: int = 300,
                  max_anchors: int = 40) -> BlockLayout:
    lengths = torch.randint(2, max_len, (num_seqs,), generator=g)
    anchors = []
    for n in lengths.tolist():
        k = int(torch.randint(1, max_anchors, (1,), generator=g))
        anchors.append(torch.sort(torch.randperm(n - 1, generator=g)[:k])[0])  # 0 included: no context seen
    return packed_layout(lengths=lengths, anchors=anchors, block_size=block_size)


def eval_layout(first: int, last: int, block_size: int) -> BlockLayout:
    """The evaluator's layout: one sequence, anchors first..last-1, context rows 0..last-2."""
    anchors = torch.arange(first, last)
    C = last - 1
    return BlockLayout(ctx_seq_C=torch.zeros(C, dtype=torch.long), ctx_pos_C=torch.arange(C),
                       block_seq_J=torch.zeros(anchors.numel(), dtype=torch.long), anchor_J=anchors,
                       block_size=block_size)


def tile_map(num, idx, nk: int) -> torch.Tensor:
    out = torch.zeros(num.shape[-1], nk, dtype=torch.bool)
    for t in range(num.shape[-1]):
        out[t, idx[0, 0, t, :num[0, 0, t]].long()] = True
    return out


def true_tiles(layout: BlockLayout, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tiles holding a visible pair, tiles wholly inside [Q, K] and wholly visible) from the dense mask."""
    m = dense_mask(layout)
    Q, K = m.shape
    nq, nk = -(-Q // tile), -(-K // tile)
    padded = torch.zeros(nq * tile, nk * tile, dtype=torch.bool)
    padded[:Q, :K] = m
    inside = torch.zeros_like(padded)
    inside[:Q, :K] = True
    as_tiles = lambda x: x.view(nq, tile, nk, tile).permute(0, 2, 1, 3).flatten(2)  # noqa: E731
    return as_tiles(padded).any(-1), as_tiles(padded).all(-1) & as_tiles(inside).all(-1)


def check_tiles(layout: BlockLayout, tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """layout_tiles' partial and full maps, checked against the dense predicate; returns them and the true maps."""
    t = layout_tiles(layout, tile=tile)
    nk = t["kv_indices"].shape[-1]
    partial = tile_map(t["kv_num_blocks"], t["kv_indices"], nk)
    full = tile_map(t["full_kv_num_blocks"], t["full_kv_indices"], nk)
    visible, wholly = true_tiles(layout, tile)
    assert not (partial & full).any()
    assert (visible <= (partial | full)).all(), "a tile with a visible pair is skipped"
    assert (full <= wholly).all(), "a tile marked full holds a masked pair"
    return partial, full, visible, wholly


CASES = [(seed, b, tile) for seed in range(12) for b, tile in ((3, 16), (4, 32), (5, 16), (16, 16), (16, 128))]


@pytest.mark.parametrize("seed,block_size,tile", CASES)
def test_tiles_cover_every_visible_pair_and_full_tiles_are_wholly_visible(seed, block_size, tile):
    g = torch.Generator().manual_seed(seed)
    layout = random_layout(g, num_seqs=int(torch.randint(1, 8, (1,), generator=g)), block_size=block_size)
    partial, full, visible, wholly = check_tiles(layout, tile)
    # tight: at most one extra tile per query tile (the context hull of a tile spanning two sequences)
    assert int((partial | full).sum()) <= int(visible.sum()) + visible.shape[0]
    assert int(full.sum()) == int(wholly.sum())  # sorted packed blocks: every wholly visible tile is found


@pytest.mark.parametrize("first,last,block_size,tile", [(1, 60, 4, 16), (0, 40, 16, 16), (5, 300, 16, 128)])
def test_tiles_of_the_evaluator_layout(first, last, block_size, tile):
    check_tiles(eval_layout(first, last, block_size), tile)


def test_tiles_when_context_starts_past_position_0_or_ends_before_the_anchor():
    # seq 0: context positions 7..46 (a window), anchors beyond its end too; seq 1: positions 0..29, anchors
    # up to 60 (context truncated). Full tiles must stay inside what each block really sees.
    ctx_seq = torch.cat([torch.zeros(40, dtype=torch.long), torch.ones(30, dtype=torch.long)])
    ctx_pos = torch.cat([torch.arange(7, 47), torch.arange(30)])
    anchors = torch.cat([torch.tensor([3, 7, 20, 46, 47, 60]), torch.tensor([0, 10, 29, 30, 45, 60])])
    block_seq = torch.cat([torch.zeros(6, dtype=torch.long), torch.ones(6, dtype=torch.long)])
    for tile in (4, 8, 16):
        layout = BlockLayout(ctx_seq_C=ctx_seq, ctx_pos_C=ctx_pos, block_seq_J=block_seq, anchor_J=anchors,
                             block_size=4)
        _, full, _, _ = check_tiles(layout, tile)
        assert full.any()  # the windowed sequence still gets full tiles


def test_compiled_flex_with_layout_tiles_equals_dense_on_cpu():
    # Uncompiled flex attention ignores the tile lists (it applies mask_mod to every pair); compiled, it visits
    # only the listed tiles and skips mask_mod on full ones, so this checks the lists themselves. (dynamic=False:
    # torch 2.13's CPU flex template fails to compile this mask_mod with dynamic shapes.)
    from torch.nn.attention.flex_attention import flex_attention

    fa = torch.compile(flex_attention, dynamic=False)
    g = torch.Generator().manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for num_seqs, block_size in ((5, 4), (3, 16)):
            layout = random_layout(g, num_seqs=num_seqs, block_size=block_size, max_len=200, max_anchors=30)
            Q, K = layout.num_blocks * block_size, layout.num_ctx + layout.num_blocks * block_size
            q, k, v = (torch.randn(2, n, 16, generator=g) for n in (Q, K, K))
            flex = fa(q[None], k[None], v[None], block_mask=flex_block_mask(layout, tile=16))[0]
            dense = dense_block_attention(q, k, v, layout, chunk_tokens=64)
            torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-5)


def _cuda_flex_matches_dense(seed: int, *, num_seqs: int, heads: int, kv_heads: int, head_dim: int):
    """Compiled flex attention (the drafter's call, 128-tiles) against the dense path on a random CUDA layout,
    output and q/k/v gradients; returns the flex output and the inputs."""
    from dflash.drafter.attention import flex_block_attention

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(seed)
    layout = random_layout(g, num_seqs=num_seqs, block_size=16, max_len=400, max_anchors=60).to(dev)
    Q, K = layout.num_blocks * 16, layout.num_ctx + layout.num_blocks * 16
    q = torch.randn(heads, Q, head_dim, generator=g).to(dev).requires_grad_()
    k, v = (torch.randn(kv_heads, K, head_dim, generator=g).to(dev).requires_grad_() for _ in range(2))
    outs = []
    for flex in (True, False):
        o = (flex_block_attention(q, k, v, flex_block_mask(layout), compiled=True) if flex
             else dense_block_attention(q, k, v, layout, chunk_tokens=1024))
        outs.append((o.detach(), torch.autograd.grad(o.pow(2).sum(), (q, k, v))))
    (flex, flex_grads), (dense, dense_grads) = outs
    torch.testing.assert_close(flex, dense, rtol=2e-3, atol=2e-3)
    for a, b in zip(flex_grads, dense_grads):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
    return flex, layout, (q, k, v)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_flex_with_layout_tiles_equals_dense_on_cuda_forward_and_backward():
    # Many 128-tiles (the trainer's size), sequences straddling tiles, anchor 0 (no context) included.
    _cuda_flex_matches_dense(5, num_seqs=9, heads=4, kv_heads=4, head_dim=64)


def test_flex_with_kv_repeated_to_the_query_heads_equals_dense(monkeypatch):
    # the expansion flex_expands_kv picks on CUDA, forced on CPU (eager flex, forward only: CPU flex has no
    # backward; the gradients are checked on CUDA below): query head i must read KV head i // group, as the GQA
    # kernel and the dense path do
    import dflash.drafter.attention as att

    monkeypatch.setattr(att, "flex_expands_kv", lambda *a, **k: True)
    g = torch.Generator().manual_seed(7)
    layout = random_layout(g, num_seqs=3, block_size=4, max_len=60, max_anchors=8)
    Q, K = layout.num_blocks * 4, layout.num_ctx + layout.num_blocks * 4
    q = torch.randn(6, Q, 8, generator=g)
    k, v = (torch.randn(2, K, 8, generator=g) for _ in range(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex = att.flex_block_attention(q, k, v, flex_block_mask(layout, tile=16), compiled=False)
    torch.testing.assert_close(flex, dense_block_attention(q, k, v, layout, chunk_tokens=1024), rtol=1e-4, atol=1e-5)
    monkeypatch.setattr(att, "flex_expands_kv", lambda *a, **k: False)  # and the GQA call gives the same
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(att.flex_block_attention(q, k, v, flex_block_mask(layout, tile=16), compiled=False),
                                   flex, rtol=1e-5, atol=1e-6)


def test_flex_repeats_kv_only_for_a_backward_on_cuda_at_large_heads():
    # measured: forward + backward 6.35 vs 8.20 ms at 128-dim heads, the forward alone slower, 64-dim heads
    # neutral (results/flex_tiles_expand_kv_h200.json)
    from dflash.drafter.attention import flex_expands_kv

    assert flex_expands_kv(128, "cuda", backward=True)
    assert flex_expands_kv(256, "cuda", backward=True)
    assert not flex_expands_kv(128, "cuda", backward=False)
    assert not flex_expands_kv(64, "cuda", backward=True)
    assert not flex_expands_kv(128, "cpu", backward=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_flex_at_grouped_128_dim_heads_equals_dense_on_cuda():
    # the 27B drafter's head size with a KV group of 4: the training call repeats K and V (the repeat's backward
    # sums a KV head's gradient over its group), the no-grad call uses flex's GQA; both give the dense output
    from dflash.drafter.attention import flex_block_attention

    flex, layout, (q, k, v) = _cuda_flex_matches_dense(11, num_seqs=5, heads=8, kv_heads=2, head_dim=128)
    with torch.no_grad():
        gqa = flex_block_attention(q, k, v, flex_block_mask(layout), compiled=True)
    torch.testing.assert_close(gqa, flex, rtol=2e-3, atol=2e-3)


def test_flex_kernel_options_small_heads_on_cuda_only():
    # 64 x 64 forward tiles for heads of <= 64 dims on CUDA (measured 2.9x on the H200, flex_tiles_h200.json);
    # the 27B drafter's 256-dim heads would not fit them in shared memory, and CPU flex takes no tile options.
    from dflash.drafter.attention import flex_kernel_options

    assert flex_kernel_options(64, "cuda") == {"BLOCK_M": 64, "BLOCK_N": 64}
    assert flex_kernel_options(32, "cuda") == {"BLOCK_M": 64, "BLOCK_N": 64}
    assert flex_kernel_options(128, "cuda") is None
    assert flex_kernel_options(256, "cuda") is None
    assert flex_kernel_options(64, "cpu") is None
    opts = flex_kernel_options(64, "cuda")
    opts["BLOCK_M"] = 16  # a caller's copy: the rule itself is not changed
    assert flex_kernel_options(64, "cuda")["BLOCK_M"] == 64
