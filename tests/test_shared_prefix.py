"""shared_prefix.tiles: which decode rows share a prompt's pages, from the step's page table (CPU, no Triton: the
kernel that reads the tiles is checked against the reference under the interpreter in test_fast_engine.py, and on a
GPU there against teacher forcing)."""

from __future__ import annotations

import numpy as np
import pytest

from agentopd.engines.fast.attention import PAGE
from agentopd.engines.fast.shared_prefix import tiles


def _table(groups, width=48, seed=0):
    """Rows of families: groups = [(shared pages, [row contexts])]; each row's own pages after the shared ones,
    rows shuffled. Returns the table, the contexts and each row's family."""
    rng = np.random.default_rng(seed)
    pages = iter(rng.permutation(np.arange(1, 10_000)))
    rows, ctx, family = [], [], []
    for f, (shared, lens) in enumerate(groups):
        common = [next(pages) for _ in range(shared)]
        for c in lens:
            own = [next(pages) for _ in range(-(-c // PAGE) - shared)]
            rows.append(common + own)
            ctx.append(c)
            family.append(f)
    order = rng.permutation(len(rows))
    table = np.zeros((len(rows), width), dtype=np.int32)
    for i, r in enumerate(order):
        table[i, : len(rows[r])] = rows[r]
    return table, [ctx[r] for r in order], [family[r] for r in order]


def test_a_tasks_samples_become_one_tile_each_and_start_after_the_prompt():
    groups = [(24, [400 + 30 * i for i in range(8)]) for _ in range(4)]  # 4 tasks x 8 samples, 384-token prompts
    table, ctx, family = _table(groups)
    start, rows, lens = tiles(table, ctx, rows=8)
    assert rows.shape == (4, 8) and lens.tolist() == [384] * 4
    assert sorted({family[r] for r in tile} == {family[tile[0]]} for tile in rows.tolist()) == [True] * 4
    assert start.tolist() == [384] * 32
    for tile in rows.tolist():  # the pages the tile shares are the same in every row of it
        assert (table[tile, :24] == table[tile[0], :24]).all()


def test_tiles_hold_at_most_rows_and_a_family_larger_than_that_is_cut():
    table, ctx, _ = _table([(6, [200] * 12)])
    start, rows, lens = tiles(table, ctx, rows=8)
    assert sorted((r >= 0).sum() for r in rows) == [4, 8] and lens.tolist() == [96, 96]
    assert sorted(np.concatenate([r[r >= 0] for r in rows]).tolist()) == list(range(12))


def test_prompts_with_a_common_start_share_only_what_they_share():
    """Two tasks whose prompts open with the same 2 pages (a system prompt) and then differ: a tile per task at its
    own prompt's length, not one tile at the common start's."""
    table, ctx, family = _table([(6, [150] * 4), (6, [160] * 4)])
    first = table[[f == 0 for f in family]][0, :2]
    table[[f == 1 for f in family], :2] = first  # task 1's prompt opens with task 0's first 2 pages
    start, rows, lens = tiles(table, ctx, rows=8)
    assert lens.tolist() == [96, 96] and sorted(len({family[r] for r in t if r >= 0}) for t in rows) == [1, 1]


def test_the_newest_tokens_page_and_stale_columns_are_never_shared():
    # two rows share 4 pages, but the second's context ends inside its 4th page: only 3 are done being written
    table = np.zeros((2, 8), dtype=np.int32)
    table[0, :6] = [5, 6, 7, 8, 9, 10]
    table[1, :4] = [5, 6, 7, 8]
    table[1, 4:6] = [9, 10]  # stale: a previous sequence's pages in this row's table (only 4 are its own)
    start, rows, lens = tiles(table, [90, 3 * PAGE + 1], rows=8, min_tokens=16)
    assert lens.tolist() == [3 * PAGE] and start.tolist() == [48, 48]


@pytest.mark.parametrize("case", ["short", "alone", "one_row"])
def test_nothing_worth_a_tile(case):
    if case == "short":  # 3 shared pages (48 tokens) < one 64-token block of the kernel's loop
        table, ctx, _ = _table([(3, [100] * 4)])
    elif case == "alone":  # every row its own prompt
        table, ctx, _ = _table([(6, [120]) for _ in range(5)])
    else:
        table, ctx, _ = _table([(6, [120])])
    start, rows, lens = tiles(table, ctx, rows=8)
    assert not start.any() and rows.shape == (0, 8) and lens.shape == (0,)
