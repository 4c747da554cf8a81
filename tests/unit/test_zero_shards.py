"""ZeRO-1/2 slices as rectangles of the local parameter (parallel/data_parallel/zero_shards.py):
hand-computed cases, and for many shapes and ranges the rectangles tile the flat range in
order (each a contiguous run of it)."""
import itertools
import math

import torch

from parallel.data_parallel.zero_shards import flat_blocks


def test_hand_computed_rectangles():
    assert flat_blocks((3, 4), 4, 10) == [((1, 0), (1, 4)), ((2, 0), (1, 2))]
    assert flat_blocks((3, 4), 2, 11) == [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 3))]
    assert flat_blocks((3, 4), 0, 12) == [((0, 0), (3, 4))]
    assert flat_blocks((2, 3, 4), 5, 19) == [((0, 1, 1), (1, 1, 3)), ((0, 2, 0), (1, 1, 4)),
                                            ((1, 0, 0), (1, 1, 4)), ((1, 1, 0), (1, 1, 3))]
    assert flat_blocks((7,), 3, 5) == [((3,), (2,))]
    assert flat_blocks((3, 4), 6, 6) == []
    assert flat_blocks((), 0, 1) == [((), ())]          # a 0-dim parameter: its one element


def test_rectangles_tile_every_range_in_flat_order():
    for shape in [(5,), (3, 4), (2, 3, 4), (4, 1, 3), (2, 2, 2, 3)]:
        n = math.prod(shape)
        ids = torch.arange(n).view(shape)
        for start, stop in itertools.combinations(range(n + 1), 2):
            got = torch.cat([ids[tuple(slice(o, o + s) for o, s in zip(offs, sizes))].reshape(-1)
                             for offs, sizes in flat_blocks(shape, start, stop)])
            assert torch.equal(got, torch.arange(start, stop)), (shape, start, stop)
