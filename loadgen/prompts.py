"""Token ids for a ``RequestSpec``, so that a real server sees the prefixes the workload defines.

A spec carries chained hashes of 16-token blocks, not token ids (traces have none). We derive
ids deterministically:

- full prompt block ``i`` -> ``block_size`` ids from ``block_hashes[i]`` alone. Chained hashes
  name their whole prefix, so equal hashes give identical id prefixes and the server's prefix
  cache sees exactly the sharing the workload defines; different hashes give different ids.
- the partial last block (``prompt_tokens % block_size`` ids) -> from the rid (never shared).
- ids lie in ``[FIRST_ID, vocab_size)``: the low ids that tokenizers reserve for special
  tokens (BOS, EOS, padding) are never sent.

The mixing function is SplitMix64's finaliser over ``(hash, position)``: vectorised, ~1 µs per
block, so a 20k-token prompt costs well under a millisecond.

Follow-up turns (``SessionContexts``): a follow-up's prompt extends the previous turn's prompt
and output. The hash-derived ids of the previous output are not what the server generated, so
with them the server could not reuse the KV of the previous output. When the server returns the
generated ids, we remember ``prompt ids + output ids`` per session and the next turn of that
session starts with them (the rest comes from its own hashes), as real agent traffic does.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from fairway.hashing import DEFAULT_BLOCK_SIZE
from fairway.request import RequestSpec

FIRST_ID = 16  # ids below this are left to special tokens
DEFAULT_VOCAB_SIZE = 4096

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_TAIL_DOMAIN = np.uint64(0xD6E8FEB86659FD93)  # separates rid-derived tails from block hashes


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, elementwise on a uint64 array (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def _ids(seeds: np.ndarray, n: int, vocab_size: int) -> np.ndarray:
    """``n`` ids per seed, shape ``(len(seeds) * n,)``, int64 in ``[FIRST_ID, vocab_size)``."""
    pos = (np.arange(1, n + 1, dtype=np.uint64) * _GOLDEN)[None, :]
    x = _mix(_mix(seeds.astype(np.uint64)[:, None]) ^ pos)
    span = np.uint64(vocab_size - FIRST_ID)
    return (x % span).astype(np.int64).reshape(-1) + FIRST_ID


def block_token_ids(hashes: tuple[int, ...] | list[int], block_size: int, vocab_size: int) -> np.ndarray:
    """``block_size`` ids per block hash, concatenated. O(len(hashes) * block_size), vectorised."""
    if not hashes:
        return np.empty(0, dtype=np.int64)
    return _ids(np.asarray(hashes, dtype=np.uint64), block_size, vocab_size)


def tail_token_ids(rid: int, n: int, vocab_size: int) -> np.ndarray:
    """The ``n`` ids of a request's partial last block, from its rid."""
    if n <= 0:
        return np.empty(0, dtype=np.int64)
    seed = np.array([rid], dtype=np.uint64) ^ _TAIL_DOMAIN
    return _ids(seed, n, vocab_size)


@dataclass(frozen=True, slots=True)
class PromptBuilder:
    """Spec -> prompt token ids (see the module docstring). ``vocab_size`` must exceed the
    server's smallest vocabulary bound we rely on: every id is ``< vocab_size``."""

    vocab_size: int = DEFAULT_VOCAB_SIZE
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        if self.vocab_size < 2 * FIRST_ID:
            raise ValueError(f"vocab_size must be >= {2 * FIRST_ID}, got {self.vocab_size}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    def token_ids(self, spec: RequestSpec, prefix: np.ndarray | None = None) -> np.ndarray:
        """``spec.prompt_tokens`` ids: ``prefix`` (truncated to the prompt) first, then the
        hash-derived ids of the remaining positions. O(prompt_tokens)."""
        bs = self.block_size
        full = spec.prompt_tokens // bs
        if len(spec.block_hashes) < full:
            raise ValueError(
                f"rid {spec.rid}: {len(spec.block_hashes)} block hashes cannot cover "
                f"{spec.prompt_tokens} prompt tokens of {bs}-token blocks"
            )
        ids = np.concatenate([
            block_token_ids(spec.block_hashes[:full], bs, self.vocab_size),
            tail_token_ids(spec.rid, spec.prompt_tokens - full * bs, self.vocab_size),
        ])
        if prefix is not None and len(prefix):
            k = min(len(prefix), spec.prompt_tokens)
            ids[:k] = prefix[:k]
        return ids


@dataclass(slots=True)
class _Context:
    block_hashes: tuple[int, ...]
    ids: np.ndarray


@dataclass(slots=True)
class SessionContexts:
    """The last completed turn's real ``prompt + output`` ids per session, for the next turn.

    ``remember`` after a turn completes with the server's output ids; ``prefix_for`` (which
    forgets the entry) when the session's next turn is sent. A stored context is used only if
    the new spec's block hashes start with the stored turn's hashes (the workload says the new
    prompt extends it) and it fits in the new prompt. Memory is bounded by ``max_tokens``: the
    least recently stored sessions are dropped first (their next turns fall back to
    hash-derived ids). O(1) per call plus the copy of the ids.
    """

    max_tokens: int = 32_000_000
    _by_session: OrderedDict[int, _Context] = field(default_factory=OrderedDict)
    _tokens: int = 0

    def __len__(self) -> int:
        return len(self._by_session)

    @property
    def tokens(self) -> int:
        return self._tokens

    def remember(self, spec: RequestSpec, prompt_ids: np.ndarray, output_ids: np.ndarray) -> None:
        if spec.session < 0:
            return
        self._drop(spec.session)
        ids = np.concatenate([np.asarray(prompt_ids, dtype=np.int64), np.asarray(output_ids, dtype=np.int64)])
        self._by_session[spec.session] = _Context(spec.block_hashes, ids)
        self._tokens += ids.size
        while self._tokens > self.max_tokens and self._by_session:
            self._drop(next(iter(self._by_session)))

    def prefix_for(self, spec: RequestSpec) -> np.ndarray | None:
        if spec.session < 0:
            return None
        ctx = self._by_session.get(spec.session)
        if ctx is None:
            return None
        n = len(ctx.block_hashes)
        if spec.block_hashes[:n] != ctx.block_hashes or ctx.ids.size > spec.prompt_tokens:
            return None  # not an extension of the stored turn: keep it for its real follow-up
        self._drop(spec.session)
        return ctx.ids

    def _drop(self, session: int) -> None:
        ctx = self._by_session.pop(session, None)
        if ctx is not None:
            self._tokens -= ctx.ids.size
