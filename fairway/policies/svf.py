"""Smallest volume first (SVF) and its one-bit variant (docs/design.md, SVF and Sorted-F): baselines
(``PUBLISHED_BASELINES``), published schedulers rebuilt.

A request's *volume* is the KV memory it occupies integrated over its life, in token-steps.
While it decodes its k-th token it holds its context plus the tokens generated so far, so with
``u`` prompt tokens it newly claims and ``o`` output tokens::

    V = sum_{k=1..o} (u + k) = o * u + o * (o + 1) / 2

``u = L - (1 - cached_weight) * c``: by default (``cached_weight = 0``) the cached prefix is not
charged, because those blocks are already resident and shared, so a hit makes a request
cheaper in memory exactly as it does in compute; ``cached_weight = 1`` is the cache-blind
form (the whole context). Admitting the smallest volume first frees memory soonest per request
served, which is the quantity a KV-bound engine rations.

``o`` is an estimate. ``svf`` takes the host's output hint (``QueuedRequest.output_tokens``: the
true length in the simulator, ``max_tokens`` at the replica gate, an upper bound there) and
``default_output_tokens`` when the hint is 0. ``svf-1bit`` sees one bit of it:
long = hint > ``long_above``, and each class is priced at a representative length.

Cost: one extra float column; ``select`` is one vectorised pass, O(n), like every baseline.
"""

from __future__ import annotations

import numpy as np

from fairway.clock import Clock
from fairway.cost_model import CostModel
from fairway.policies.base import QueuedRequest, QueuePolicy, grow_column

# The shipped synthetic workloads draw outputs from a log-normal with median 128 tokens and
# sigma 0.6 (rag, mixed; agentic: 150, 0.7). The defaults below come from that distribution.
DEFAULT_OUTPUT_TOKENS = 128.0  # its median: the estimate when a request carries no hint
LONG_ABOVE = 128  # split at the median: the one bit then carries the most information
SHORT_OUTPUT_TOKENS = 84.0  # E[o | o <= median] = m * exp(s^2/2) * 2 * Phi(-s), m=128, s=0.6
LONG_OUTPUT_TOKENS = 222.0  # E[o | o > median]  = m * exp(s^2/2) * 2 * Phi(s)


class SVF(QueuePolicy):
    """Smallest volume first: key = o * (L - (1 - w) * c) + o * (o + 1) / 2, smallest first,
    with o the output hint (``default_output_tokens`` if the hint is 0) and w the
    ``cached_weight``. Ties go to the smaller seq. No aging: a large volume can starve."""

    name = "svf"

    def __init__(
        self,
        clock: Clock,
        cost: CostModel,
        block_size: int = 16,
        default_output_tokens: float = DEFAULT_OUTPUT_TOKENS,
        cached_weight: float = 0.0,
    ) -> None:
        super().__init__(clock, cost, block_size)
        if default_output_tokens <= 0:
            raise ValueError("default_output_tokens must be > 0")
        if not 0.0 <= cached_weight <= 1.0:
            raise ValueError("cached_weight must be in [0, 1]")
        self.default_output_tokens = float(default_output_tokens)
        self.cached_weight = float(cached_weight)
        self.out_est = np.zeros(len(self.active))

    def _grow_extra(self, n: int) -> None:
        self.out_est = grow_column(self.out_est, n)

    def _estimate(self, hint: int) -> float:
        """Output tokens the volume is priced at, from the host's hint (0 = unknown)."""
        return float(hint) if hint > 0 else self.default_output_tokens

    def _on_add(self, slot: int, req: QueuedRequest) -> None:
        self.out_est[slot] = self._estimate(req.output_tokens)

    def volume(self, rid: int) -> float:
        """The volume ``rid`` is ranked by now (token-steps)."""
        s = self._slot_of[rid]
        return float(self._volumes(slice(s, s + 1))[0])

    def _volumes(self, sl: slice) -> np.ndarray:
        o = self.out_est[sl]
        u = self.prompt[sl] - (1.0 - self.cached_weight) * self.cached[sl]
        return o * u + 0.5 * o * (o + 1.0)

    def _choose(self, now: float) -> int:
        return self._argmin(self._volumes(slice(0, self._hi)))


class SVF1Bit(SVF):
    """SVF from one bit of output length: long = hint > ``long_above``; a long request is priced
    at ``long_output_tokens``, a short one at ``short_output_tokens`` (the class means), one with
    no hint at ``default_output_tokens``. Within a class the order is by uncached prompt."""

    name = "svf-1bit"

    def __init__(
        self,
        clock: Clock,
        cost: CostModel,
        block_size: int = 16,
        long_above: int = LONG_ABOVE,
        short_output_tokens: float = SHORT_OUTPUT_TOKENS,
        long_output_tokens: float = LONG_OUTPUT_TOKENS,
        default_output_tokens: float = DEFAULT_OUTPUT_TOKENS,
        cached_weight: float = 0.0,
    ) -> None:
        super().__init__(clock, cost, block_size, default_output_tokens, cached_weight)
        if long_above < 1:
            raise ValueError("long_above must be >= 1")
        if not 0 < short_output_tokens <= long_output_tokens:
            raise ValueError("need 0 < short_output_tokens <= long_output_tokens")
        self.long_above = int(long_above)
        self.short_output_tokens = float(short_output_tokens)
        self.long_output_tokens = float(long_output_tokens)

    def _estimate(self, hint: int) -> float:
        if hint <= 0:
            return self.default_output_tokens
        return self.long_output_tokens if hint > self.long_above else self.short_output_tokens
