"""Building blocks for synthetic request content: token ids, lengths, popularity, hashing memo.

- Token ids are uniform over a Llama-3-sized vocabulary (128,256), uint32. Random ids make two
  independently drawn 16-token blocks collide with probability ~1e-82, so equal block hashes
  mean content that the workload shared on purpose.
- A *shared segment* (system prompt, document, tool preamble) is a pure function of
  ``(content seed, segment key)``: its tokens come from its own generator, so they do not depend
  on which request first used it, and ``SegmentMemo`` hashes it once per workload.
- Lengths are drawn from small, documented distributions. Lengths may be bounded (a context
  window is finite); only arrival gaps are never clipped.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np

from fairway.hashing import HashState
from fairway.request import WorkloadError

VOCAB_SIZE = 128_256  # Llama 3 tokenizer


def random_tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` token ids drawn uniformly from the vocabulary. O(n)."""
    return rng.integers(0, VOCAB_SIZE, size=int(n), dtype=np.uint32)


def segment_rng(content_seed: int, *key: int) -> np.random.Generator:
    """The generator of one shared segment, a pure function of the seed and the key."""
    return np.random.default_rng([int(content_seed), *(int(k) for k in key)])


@dataclass(frozen=True, slots=True)
class LogNormalLen:
    """Token lengths ``round(median * exp(sigma * N(0,1)))`` bounded to ``[lo, hi]``.

    Mean before bounding is ``median * exp(sigma**2 / 2)``. Heavy-tailed like real prompt and
    output lengths, which are roughly log-normal in public traces.
    """

    median: float
    sigma: float
    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not (self.median > 0 and self.sigma >= 0 and 1 <= self.lo <= self.hi):
            raise WorkloadError(f"bad length distribution {self!r}")

    def sample(self, rng: np.random.Generator, size: int | None = None) -> np.ndarray:
        x = np.rint(self.median * np.exp(self.sigma * rng.standard_normal(size)))
        return np.clip(x, self.lo, self.hi).astype(np.int64)

    def one(self, rng: np.random.Generator) -> int:
        return int(self.sample(rng))


@dataclass(frozen=True, slots=True)
class UniformLen:
    """Token lengths uniform on the integers ``[lo, hi]``."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not 1 <= self.lo <= self.hi:
            raise WorkloadError(f"bad length distribution {self!r}")

    def sample(self, rng: np.random.Generator, size: int | None = None) -> np.ndarray:
        return rng.integers(self.lo, self.hi + 1, size=size, dtype=np.int64)

    def one(self, rng: np.random.Generator) -> int:
        return int(self.sample(rng))


class ZipfChoice:
    """Finite Zipf popularity: item ``k`` (0-based rank) is drawn with probability
    proportional to ``(k + 1) ** -s``. Sampling is O(log n) per draw (CDF search)."""

    def __init__(self, n: int, s: float) -> None:
        if n < 1 or s < 0:
            raise WorkloadError(f"Zipf needs n >= 1 and s >= 0, got n={n}, s={s}")
        w = np.arange(1, n + 1, dtype=np.float64) ** -float(s)
        cdf = np.cumsum(w)
        cdf /= cdf[-1]
        cdf[-1] = 1.0
        self.n = n
        self.s = s
        self._cdf = cdf

    @property
    def probabilities(self) -> np.ndarray:
        return np.diff(self._cdf, prepend=0.0)

    def sample(self, rng: np.random.Generator, size: int | None = None) -> np.ndarray:
        return np.searchsorted(self._cdf, rng.random(size), side="right").astype(np.int64)


class SegmentMemo:
    """Hash states memoised by segment path, so each shared segment is hashed once.

    A path is a tuple of segment keys, e.g. ``("sys", ("doc", 17))``; the state of a path is the
    state of its parent path extended by the last segment's tokens. Why: thousands of requests
    share a few long segments; hashing each request from scratch would be O(total tokens), this
    is O(distinct segment tokens + unique tokens).

    Complexity: the first ``get`` of a path hashes its new segments, O(their tokens); later calls
    are one dict probe. Callers must ``copy()`` a returned state before extending it. With
    ``keep_tokens`` the memo also keeps each path's token ids (memory: O(distinct tokens)).
    """

    def __init__(
        self,
        block_size: int,
        tokens_of: Callable[[Hashable], np.ndarray],
        keep_tokens: bool = False,
    ) -> None:
        self._tokens_of = tokens_of
        self._keep = keep_tokens
        empty = np.empty(0, dtype=np.uint32)
        self._states: dict[tuple, tuple[HashState, np.ndarray | None]] = {
            (): (HashState.start(block_size), empty if keep_tokens else None)
        }

    def get(self, path: tuple) -> tuple[HashState, np.ndarray | None]:
        hit = self._states.get(path)
        if hit is not None:
            return hit
        parent, parent_tokens = self.get(path[:-1])
        seg = self._tokens_of(path[-1])
        state = parent.copy()
        state.extend(seg)
        tokens = None
        if self._keep and parent_tokens is not None:
            tokens = np.concatenate([parent_tokens, seg])
        self._states[path] = (state, tokens)
        return state, tokens


def extend_request(
    prefix: HashState,
    prefix_tokens: np.ndarray | None,
    unique_prompt: np.ndarray,
    output: np.ndarray,
    keep_tokens: bool,
) -> tuple[tuple[int, ...], np.ndarray | None]:
    """Block hashes of ``prefix + unique_prompt + output`` and, if kept, the prompt token ids.

    O(prefix blocks) to copy the memoised prefix plus O(new tokens) to hash the rest.
    """
    state = prefix.copy()
    state.extend(unique_prompt)
    state.extend(output)
    tokens = None
    if keep_tokens:
        base = prefix_tokens if prefix_tokens is not None else np.empty(0, dtype=np.uint32)
        tokens = np.concatenate([base, unique_prompt])
    return tuple(state.hashes), tokens
