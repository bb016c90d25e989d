"""Chained block hashes of token ids, as vLLM's prefix cache keys its KV blocks.

h_0 = xxh3_64(tokens of block 0, seed=salt_seed); h_i = xxh3_64(tokens of block i, seed=h_{i-1}).

- A block is ``block_size`` consecutive token ids (default 16, vLLM's). A partial last block
  is never hashed: it cannot be shared.
- Chaining makes a block's hash name its whole prefix, so equal hashes mean equal prefixes and a
  longest-prefix lookup is a walk of dict probes that stops at the first miss.
- The tenant salt is folded into the first block's seed, so two tenants never share a hit.

Complexity: hashing is O(tokens); ``longest_cached_prefix`` is O(matched blocks + 1) probes.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

DEFAULT_BLOCK_SIZE = 16
_ROOT_SEED = 0x9E3779B97F4A7C15  # seed of the first block when there is no salt


def salt_seed(salt: str | bytes | None) -> int:
    """The 64-bit seed of a chain's first block: a hash of the tenant salt, or the root seed."""
    if salt is None or salt == "" or salt == b"":
        return _ROOT_SEED
    data = salt.encode() if isinstance(salt, str) else salt
    return xxhash.xxh3_64_intdigest(data, seed=_ROOT_SEED) ^ 0xA5A5A5A5A5A5A5A5


def _as_u32(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError("token ids must be a flat sequence")
    if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
        raise ValueError("token ids must fit in 32 bits")
    return arr.astype(np.uint32, copy=False)


def block_hashes(
    tokens: Sequence[int] | np.ndarray,
    block_size: int = DEFAULT_BLOCK_SIZE,
    salt: str | bytes | None = None,
) -> list[int]:
    """Chained hashes of every full block of ``tokens``. O(len(tokens))."""
    state = HashState.start(block_size, salt)
    return state.extend(tokens)


@dataclass(slots=True)
class HashState:
    """Incremental chained hashing: feed token runs, get the hashes of blocks that became full.

    Why: prompts are built from shared segments (system prompt, documents, a session's growing
    context); hashing them incrementally and memoising states by segment prefix hashes each
    shared token once. Complexity: O(tokens fed).
    """

    block_size: int
    parent: int
    pending: np.ndarray
    hashes: list[int]

    @classmethod
    def start(cls, block_size: int = DEFAULT_BLOCK_SIZE, salt: str | bytes | None = None) -> HashState:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        return cls(block_size, salt_seed(salt), np.empty(0, dtype=np.uint32), [])

    def copy(self) -> HashState:
        return HashState(self.block_size, self.parent, self.pending, list(self.hashes))

    def extend(self, tokens: Sequence[int] | np.ndarray) -> list[int]:
        """Append tokens; return the hashes of the blocks completed by them (also kept in .hashes)."""
        arr = _as_u32(tokens)
        if self.pending.size:
            arr = np.concatenate([self.pending, arr])
        bs = self.block_size
        n_full = arr.size // bs
        new: list[int] = []
        parent = self.parent
        data = arr[: n_full * bs].tobytes()
        step = bs * 4
        h = xxhash.xxh3_64_intdigest
        for i in range(n_full):
            parent = h(data[i * step : (i + 1) * step], seed=parent)
            new.append(parent)
        self.parent = parent
        self.pending = arr[n_full * bs :].copy()
        self.hashes.extend(new)
        return new

    @property
    def n_tokens(self) -> int:
        return len(self.hashes) * self.block_size + int(self.pending.size)


def expand_trace_block(parent: int, trace_block_id: int, n_sub: int) -> list[int]:
    """Engine-block hashes for one block of a trace that names content by id only.

    Mooncake traces give one id per 512-token block and no tokens. We chain ``n_sub`` engine
    blocks whose content stand-in is (trace id, sub-block index), so equal trace prefixes give
    equal engine hashes and the chain property holds. O(n_sub).
    """
    out: list[int] = []
    h = xxhash.xxh3_64_intdigest
    tid = trace_block_id.to_bytes(8, "little")
    subs = _SUB_BYTES[:n_sub] if n_sub <= len(_SUB_BYTES) else [j.to_bytes(4, "little") for j in range(n_sub)]
    for sub in subs:
        parent = h(tid + sub, seed=parent)
        out.append(parent)
    return out


# The sub-block indices' bytes for expand_trace_block (a constant table: 512-token trace blocks
# of 16-token engine blocks are 32 sub-blocks; longer expansions build their own).
_SUB_BYTES = tuple(j.to_bytes(4, "little") for j in range(64))


def longest_cached_prefix(
    hashes: Sequence[int], cached: Container[int] | Callable[[int], bool]
) -> int:
    """Number of leading blocks found in ``cached``; stops at the first miss. O(matched + 1)."""
    probe = cached if callable(cached) else cached.__contains__
    n = 0
    for h in hashes:
        if not probe(h):
            break
        n += 1
    return n
