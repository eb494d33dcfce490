"""split_rows: how a read task's contiguous run of rows is cut into parts fetched side by side."""

from hypothesis import given
from hypothesis import strategies as st

from dflash.cache.shardfile import split_rows


def test_a_run_within_the_piece_is_one_request():
    assert split_rows(37, 1537, 2048, 64) == [(37, 1537)]
    assert split_rows(0, 5000, None, 64) == [(0, 5000)]


def test_a_long_run_becomes_near_equal_whole_chunk_parts():
    # 6,400 rows (a 32 MB run of 5,120-byte rows), 8 MiB pieces = 1,638 rows -> 1,600 in chunks of 64: four parts
    assert split_rows(0, 6400, 1600, 64) == [(0, 1600), (1600, 3200), (3200, 4800), (4800, 6400)]
    # ragged ends: the first and last chunks are partial, inner cuts still on the chunk grid
    assert split_rows(10, 250, 128, 32) == [(10, 128), (128, 250)]


def test_chunks_larger_than_the_piece_are_never_cut():
    assert split_rows(5, 300, 50, 100) == [(5, 100), (100, 200), (200, 300)]


@given(start=st.integers(0, 5000), n=st.integers(1, 20000), align=st.integers(1, 300), k=st.integers(1, 40))
def test_parts_cover_the_run_on_the_grid_each_within_the_piece(start, n, align, k):
    piece = k * align  # the reader's pieces are whole chunks
    stop = start + n
    parts = split_rows(start, stop, piece, align)
    assert parts[0][0] == start and parts[-1][1] == stop
    assert all(a < b for a, b in parts) and all(p[1] == q[0] for p, q in zip(parts, parts[1:]))
    assert all(b % align == 0 for _, b in parts[:-1])
    assert all(b - a <= piece for a, b in parts)
    # the fewest parts of whole cells: one fewer would need a part of more than k cells
    cells = len(range((start // align + 1) * align, stop, align)) + 1
    assert len(parts) == (1 if n <= piece else -(-cells // k))
    sizes = [b - a for a, b in parts]
    if len(parts) > 2:  # near-equal: the inner parts differ by at most a chunk
        assert max(sizes[1:-1]) - min(sizes[1:-1]) <= align
