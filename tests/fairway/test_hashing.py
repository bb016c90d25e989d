"""Chained block hashes: partial blocks, salts, chaining, incremental hashing, prefix lookup."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fairway.hashing import HashState, block_hashes, expand_trace_block, longest_cached_prefix


def test_partial_last_block_is_not_hashed():
    assert len(block_hashes(range(47))) == 2
    assert len(block_hashes(range(48))) == 3
    assert block_hashes(range(15)) == []
    assert block_hashes(range(47))[:2] == block_hashes(range(48))[:2]


def test_chaining_names_the_whole_prefix():
    a = block_hashes(list(range(16)) + [7] * 16)
    b = block_hashes(list(range(1, 17)) + [7] * 16)
    assert a[1] != b[1]  # same second block, different first block


def test_salt_isolates_tenants():
    toks = list(range(64))
    plain, t1, t1b, t2 = (block_hashes(toks, salt=s) for s in (None, "t1", "t1", "t2"))
    assert t1 == t1b
    assert not set(t1) & set(t2) and not set(t1) & set(plain)


def test_block_size_is_configurable():
    assert len(block_hashes(range(100), block_size=32)) == 3


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.lists(st.integers(1, 40), max_size=8))
def test_incremental_equals_one_shot(tokens, cuts):
    state = HashState.start()
    i = 0
    for c in cuts:
        state.extend(tokens[i : i + c])
        i += c
    state.extend(tokens[i:])
    assert state.hashes == block_hashes(tokens)
    assert state.n_tokens == len(tokens)


def test_longest_cached_prefix_stops_at_first_miss():
    hs = block_hashes(np.arange(160))
    cached = {hs[0], hs[1], hs[3]}
    assert longest_cached_prefix(hs, cached) == 2
    assert longest_cached_prefix(hs, cached.__contains__) == 2
    assert longest_cached_prefix(hs, set()) == 0


def test_trace_block_expansion_chains():
    a = expand_trace_block(1, 46, 32)
    b = expand_trace_block(1, 46, 32)
    c = expand_trace_block(2, 46, 32)
    assert a == b and len(a) == 32 and len(set(a)) == 32
    assert not set(a) & set(c)  # a different parent gives different blocks


def test_trace_block_expansion_is_the_documented_chain():
    """Each sub-block hashes (trace id as 8 little-endian bytes, sub-block index as 4) seeded by
    the previous hash: the definition the trace replays' hashes depend on, for short expansions
    and for ones past the precomputed index table."""
    import xxhash

    def chain(parent: int, tid: int, n: int) -> list[int]:
        out = []
        for j in range(n):
            parent = xxhash.xxh3_64_intdigest(tid.to_bytes(8, "little") + j.to_bytes(4, "little"), seed=parent)
            out.append(parent)
        return out

    for n in (1, 32, 64, 65, 200):
        assert expand_trace_block(7, 12345, n) == chain(7, 12345, n)
    assert expand_trace_block(7, 12345, 0) == []
