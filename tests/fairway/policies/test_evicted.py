"""``EvictedBlocks``: a bounded memory, oldest forgotten first, and the deepest remembered block."""

import pytest

from fairway.policies.evicted import EvictedBlocks


def test_the_oldest_is_forgotten_and_a_repeat_becomes_the_newest():
    m = EvictedBlocks(3)
    m.add([1, 2, 3])
    m.add([1])  # 1 is the newest now
    m.add([4])  # 2, the oldest, goes
    assert m.oldest_first() == [3, 1, 4] and 2 not in m and len(m) == 3
    with pytest.raises(ValueError, match="capacity"):
        EvictedBlocks(0)


def test_deepest_is_one_past_the_deepest_remembered_block_past_start():
    m = EvictedBlocks(8)
    m.add([12, 15])  # two earlier prompts' last blocks: one ended at block 2, one at block 5
    prompt = [10, 11, 12, 13, 14, 15, 16]
    assert m.deepest(prompt, 0) == 6  # the deeper one, not the first found
    assert m.deepest(prompt, 6) == 6  # nothing remembered past the start: the start
    assert m.deepest([20, 21, 22], 1) == 1  # disjoint
    assert m.deepest(prompt[:4], 3) == 3 and m.deepest(prompt[:4], 0) == 3
