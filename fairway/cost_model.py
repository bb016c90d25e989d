"""Calibrated time and KV-memory model of one vLLM-style engine replica.

Every Fairway decision prices requests in seconds: the queue policies rank by the estimated
prefill time P_r, the router sums queued prefill work Q_j per replica, and the simulator advances
its clock one engine step at a time. All three read this one model, so the simulator and the live
path agree on what a request costs. For one engine step whose batch holds prefill chunks i (n_i
new tokens on c_i tokens already in the request's KV) and decoding requests j (one token each on
a context of ctx_j tokens)::

    T     = sum n_i + #decodes                                 tokens through the linear layers
    gpu   = max(b * T, W / BW)                                 linear layers: FLOP- or weight-bound
          + max(c * sum n_i c_i + d * sum n_i^2, e * c_bar)    prefill attention: FLOPs or KV read
          + max(c, e) * sum ctx_j                              decode attention (memory-bound)
    step  = overhead + max(floor, gpu)

with ``c_bar = sum n_i c_i / sum n_i``. The terms come from the JSON profiles shipped in
``fairway/profiles`` (the default ones model vLLM with CUDA graphs, the ``-eager`` variants the
calibration's eager-PyTorch regime); ``bench/calibrate.py`` fits and writes them offline.
Derivation and fit errors: ``docs/cost-model.md``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_PROFILE = "h200-llama3-8b"
EAGER_SUFFIX = "-eager"


# --------------------------------------------------------------------------------------------
# Profile
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CostProfile:
    """Everything the cost model needs about one (model, GPU, engine mode), in base units.

    Invariants (checked): shape and memory facts are positive integers; the bandwidth is
    positive; every time term is finite and >= 0, which is what makes ``prefill_time`` monotone
    and positive.

    Model shape:
        num_layers, hidden_size, num_kv_heads, head_dim, vocab_size: the decoder's shape.
        num_params: all parameters, embeddings and LM head included.
        dtype_bytes: bytes per weight and per KV element (2 for bf16).
    Hardware:
        gpu_memory_bytes: memory visible to the engine process.
        mem_bandwidth_bytes_per_s: sustained DRAM traffic, reads and writes counted alike (the
            calibration's ``copy_GBps_rw``); a read-only stream gets the same rate.
        activation_reserve_bytes: memory vLLM keeps out of the KV cache besides the weights.
    Step terms (seconds):
        step_overhead_s: host time per step that is not overlapped with GPU work (added).
        launch_floor_s: host launch time that overlaps GPU work: a step takes at least this.
        linear_s_per_token (b): compute time of the linear layers per token in the step.
        attn_s_per_token_ctx (c): attention compute per (new token, earlier token) pair.
        attn_s_per_token_sq (d): attention compute per n_i^2 of a chunk (its causal self-part).
        ctx_read_s_per_token (e): attention time per cached token when reading the cached KV
            bounds it (a short chunk on a long context, and every decode).
    """

    name: str
    model: str
    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_params: int
    dtype_bytes: int
    gpu_memory_bytes: int
    mem_bandwidth_bytes_per_s: float
    activation_reserve_bytes: int
    step_overhead_s: float
    launch_floor_s: float
    linear_s_per_token: float
    attn_s_per_token_ctx: float
    attn_s_per_token_sq: float
    ctx_read_s_per_token: float

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a cost profile needs a name")
        for f in (
            "num_layers",
            "hidden_size",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
            "num_params",
            "dtype_bytes",
            "gpu_memory_bytes",
        ):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{f} must be a positive integer, got {v!r}")
        if (
            isinstance(self.activation_reserve_bytes, bool)
            or not isinstance(self.activation_reserve_bytes, int)
            or self.activation_reserve_bytes < 0
        ):
            raise ValueError("activation_reserve_bytes must be a non-negative integer")
        if not (
            math.isfinite(self.mem_bandwidth_bytes_per_s) and self.mem_bandwidth_bytes_per_s > 0
        ):
            raise ValueError("mem_bandwidth_bytes_per_s must be positive")
        for f in (
            "step_overhead_s",
            "launch_floor_s",
            "linear_s_per_token",
            "attn_s_per_token_ctx",
            "attn_s_per_token_sq",
            "ctx_read_s_per_token",
        ):
            v = getattr(self, f)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{f} must be a finite number >= 0, got {v!r}")

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer: 2 * layers * kv_heads * head_dim * dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights occupy in GPU memory: every parameter at ``dtype_bytes``."""
        return self.num_params * self.dtype_bytes

    @property
    def streamed_weight_bytes(self) -> int:
        """Bytes of weights read by every forward pass.

        All of them except the input embedding table, of which a step gathers only its tokens'
        rows (the models here have an untied LM head, which is read in full).
        """
        return (self.num_params - self.vocab_size * self.hidden_size) * self.dtype_bytes

    @property
    def weight_read_s(self) -> float:
        """Seconds to stream the weights once at ``mem_bandwidth_bytes_per_s``."""
        return self.streamed_weight_bytes / self.mem_bandwidth_bytes_per_s

    def to_dict(self) -> dict[str, Any]:
        """Field values as a plain dict (the shipped JSON's ``profile`` object)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostProfile:
        """Build from a dict with exactly the dataclass's fields (unknown keys are an error)."""
        names = {f.name for f in fields(cls)}
        extra = set(data) - names
        missing = names - set(data)
        if extra or missing:
            raise ValueError(
                f"cost profile fields: unknown {sorted(extra)}, missing {sorted(missing)}"
            )
        return cls(**dict(data))


def profiles_dir() -> Path:
    """The folder of shipped profile files (``fairway/profiles``)."""
    return Path(__file__).resolve().parent / "profiles"


def _read_profile_file(path: Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as fh:
        data = json.load(fh)
    if not isinstance(data, dict) or "profile" not in data:
        raise ValueError(f"{path} is not a cost profile file (no 'profile' object)")
    return data


def available_profiles() -> list[str]:
    """Names ``CostModel.from_profile`` accepts, sorted.

    One per JSON file shipped in ``fairway/profiles`` (the file's stem), plus ``<stem>-eager``
    when the file carries the eager-regime terms. Reads the directory on each call (no cache).
    """
    names: list[str] = []
    for path in sorted(profiles_dir().glob("*.json")):
        data = _read_profile_file(path)
        names.append(path.stem)
        if "eager" in data:
            names.append(path.stem + EAGER_SUFFIX)
    return sorted(names)


def load_profile(name: str = DEFAULT_PROFILE) -> CostProfile:
    """The named shipped profile; ``ValueError`` naming the known ones if there is none."""
    known = available_profiles()
    if name not in known:
        raise ValueError(f"unknown cost profile {name!r}; known: {', '.join(known)}")
    eager = name.endswith(EAGER_SUFFIX) and name not in _stems()
    stem = name[: -len(EAGER_SUFFIX)] if eager else name
    data = _read_profile_file(profiles_dir() / f"{stem}.json")
    profile = CostProfile.from_dict(data["profile"])
    if profile.name != stem:
        raise ValueError(f"profile file {stem}.json names itself {profile.name!r}")
    if eager:
        profile = replace(profile, name=name, **data["eager"])
    return profile


def _stems() -> set[str]:
    return {p.stem for p in profiles_dir().glob("*.json")}


# --------------------------------------------------------------------------------------------
# Cost model
# --------------------------------------------------------------------------------------------


class CostModel:
    """Step time, prefill time and KV capacity of one engine replica under one profile.

    The hot paths (``step_time``, ``prefill_time``, ``prefill_time_array``) read the profile's
    terms from slots copied at construction, so each call is a handful of float operations.
    """

    __slots__ = ("profile", "_oh", "_floor", "_b", "_c", "_d", "_e", "_dec", "_wr")

    def __init__(self, profile: CostProfile) -> None:
        self.profile = profile
        self._oh = float(profile.step_overhead_s)
        self._floor = float(profile.launch_floor_s)
        self._b = float(profile.linear_s_per_token)
        self._c = float(profile.attn_s_per_token_ctx)
        self._d = float(profile.attn_s_per_token_sq)
        self._e = float(profile.ctx_read_s_per_token)
        # max(c*x, e*x) == max(c, e)*x exactly for x >= 0 (rounding is monotone).
        self._dec = max(self._c, self._e)
        self._wr = float(profile.weight_read_s)

    @classmethod
    def from_profile(cls, name: str = DEFAULT_PROFILE) -> CostModel:
        """The model for a shipped profile, e.g. ``"h200-llama3-8b"`` (default) or ``"h200-14b"``.

        Raises ``ValueError("unknown cost profile 'X'; known: a, b")`` for any other name.
        """
        return cls(load_profile(name))

    @property
    def name(self) -> str:
        """The profile's name."""
        return self.profile.name

    def __repr__(self) -> str:
        return f"CostModel({self.profile.name!r})"

    def prefill_time(self, new_tokens: int, cached_tokens: int) -> float:
        """Seconds for one request alone in a step to prefill ``new_tokens`` on ``cached_tokens``.

        Includes the step overhead. ``new_tokens`` below 1 counts as 1: vLLM recomputes at least
        the last prompt token (a full prefix hit is capped at prompt length - 1) to get logits.
        Always > 0 and non-decreasing in both arguments. Equal to
        ``step_time(n, n*c, n*n, 0, 0)`` by construction. O(1).
        """
        if new_tokens < 0 or cached_tokens < 0:
            raise ValueError("token counts must be >= 0")
        n = new_tokens if new_tokens >= 1 else 1
        return self.step_time(n, n * cached_tokens, n * n, 0, 0)

    def chunked_prefill_time(self, new_tokens: int, cached_tokens: int, chunk_tokens: int,
                             decode_seqs: int = 0, decode_ctx_tokens: int = 0) -> float:
        """Seconds to prefill ``new_tokens`` on ``cached_tokens`` the way a chunked-prefill engine
        runs it: one step per chunk of at most ``chunk_tokens`` (the engine's per-step token
        budget, or its per-request cap), each chunk on the context the earlier ones computed,
        beside ``decode_seqs`` decodes over ``decode_ctx_tokens`` context in every step (0:
        alone).

        Why: every step pays its overhead, its weight read and its decodes, and a chunk's
        attention over the context before it costs more per token pair than attention within
        one pass, so a prompt of many chunks takes longer than one step of it (about 1.3x at
        191k tokens in 8,192-token chunks under the default profile, alone). ``chunk_tokens``
        <= 0, or a prompt that fits one chunk: exactly ``step_time`` of the whole prompt (alone,
        ``prefill_time``). O(new_tokens / chunk_tokens).
        """
        if new_tokens < 0 or cached_tokens < 0:
            raise ValueError("token counts must be >= 0")
        n = new_tokens if new_tokens >= 1 else 1
        if chunk_tokens <= 0 or n <= chunk_tokens:
            return self.step_time(n, n * cached_tokens, n * n, decode_seqs, decode_ctx_tokens)
        total, done = 0.0, 0
        while done < n:
            k = min(chunk_tokens, n - done)
            total += self.step_time(k, k * (cached_tokens + done), k * k, decode_seqs, decode_ctx_tokens)
            done += k
        return total

    def prefill_time_array(self, new_tokens: np.ndarray, cached_tokens: np.ndarray) -> np.ndarray:
        """``prefill_time`` over arrays (broadcast), bit-identical values, float64.

        Why: the policies re-price the whole waiting queue at every decision. O(len) in about
        ten vectorised numpy operations; inputs are assumed >= 0 (not checked, for speed).
        """
        n = np.maximum(np.asarray(new_tokens, dtype=np.float64), 1.0)
        c = np.asarray(cached_tokens, dtype=np.float64)
        gemm = np.maximum(self._b * n, self._wr)
        attn = np.maximum(self._c * (n * c) + self._d * (n * n), self._e * c)
        return self._oh + np.maximum(self._floor, gemm + attn)

    def least_ttft_array(self, prompt_tokens: np.ndarray, max_cached_tokens: np.ndarray,
                         max_chunk_tokens: int) -> np.ndarray:
        """A lower bound on each request's TTFT under any router and any schedule: its prompt's
        prefill from arrival to first token, with no wait, at most ``max_cached_tokens`` of its
        ``prompt_tokens`` cached, in chunks of at most ``max_chunk_tokens`` (the engine's token
        budget), and no other work in its steps (docs/cost-model.md, "The TTFT floor", states the
        argument; every term of ``step_time`` only grows with the batch around a chunk).

        With x tokens computed (x in [a, P], a = max(1, P - max_cached): a request may cache less
        than the most, and the attention term is not monotone in x), in k >= ceil(a / chunk)
        steps: k * overhead + max(k * weight_read + q(x), b * x + q(x)), q(x) = A x^2 + c P x,
        A = d - c + min(0, c - 2d) / 2 (the chunks' attention on each other, at its least); each
        minimum over x is at an endpoint (A <= 0: concave) or at a (A > 0: increasing for x > 0).
        The launch floor is left out (it only raises a step). O(len), vectorised."""
        if max_chunk_tokens < 1:
            raise ValueError("max_chunk_tokens must be >= 1")
        p = np.asarray(prompt_tokens, dtype=np.float64)
        a = np.maximum(1.0, p - np.asarray(max_cached_tokens, dtype=np.float64))
        c, d = self._c, self._d
        big_a = d - c + min(0.0, c - 2.0 * d) / 2.0

        def q(x: np.ndarray, lin: np.ndarray) -> np.ndarray:
            return big_a * x * x + lin * x

        lin_q, lin_h = c * p, self._b + c * p
        if big_a <= 0.0:
            q_min, h_min = np.minimum(q(a, lin_q), q(p, lin_q)), np.minimum(q(a, lin_h), q(p, lin_h))
        else:
            q_min, h_min = q(a, lin_q), q(a, lin_h)
        k = np.ceil(a / max_chunk_tokens)
        return k * self._oh + np.maximum(k * self._wr + q_min, h_min)

    def step_time(
        self,
        prefill_tokens: int,
        prefill_ctx_tokens: int,
        prefill_sq_tokens: int,
        decode_seqs: int,
        decode_ctx_tokens: int,
    ) -> float:
        """Seconds of one engine step (continuous batching, chunked prefill mixed with decode).

        Arguments are batch aggregates: ``prefill_tokens = sum n_i``, ``prefill_ctx_tokens =
        sum n_i*c_i``, ``prefill_sq_tokens = sum n_i**2`` over the prefill chunks;
        ``decode_seqs`` requests decode one token each over ``decode_ctx_tokens`` context tokens
        in all. The cached KV read of the chunks is priced at the token-weighted mean context
        ``sum n_i*c_i / sum n_i``: exact for one chunk, a lower bound for several.

        An empty step (no tokens) costs 0.0. Pure float arithmetic, O(1): the simulator calls
        this once per simulated step.
        """
        tokens = prefill_tokens + decode_seqs
        if tokens <= 0:
            return 0.0
        gpu = self._b * tokens
        if gpu < self._wr:
            gpu = self._wr
        if prefill_tokens > 0:
            attn = self._c * prefill_ctx_tokens + self._d * prefill_sq_tokens
            read = self._e * (prefill_ctx_tokens / prefill_tokens)
            gpu += attn if attn > read else read
        if decode_ctx_tokens > 0:
            gpu += self._dec * decode_ctx_tokens
        return self._oh + (gpu if gpu > self._floor else self._floor)

    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache per token: 2 (K and V) * layers * kv_heads * head_dim * dtype bytes."""
        return self.profile.kv_bytes_per_token

    def default_kv_blocks(self, block_size: int = 16, gpu_memory_utilization: float = 0.9) -> int:
        """KV blocks that fit, as vLLM derives them.

        ``floor((utilization * GPU memory - weight bytes - activation reserve) /
        (block_size * kv_bytes_per_token))``. The reserve stands for vLLM's profiled activation
        peak plus non-torch memory (see docs/cost-model.md). ``ValueError`` if nothing fits.
        """
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        p = self.profile
        free = (
            int(gpu_memory_utilization * p.gpu_memory_bytes)
            - p.weight_bytes
            - p.activation_reserve_bytes
        )
        blocks = free // (block_size * p.kv_bytes_per_token) if free > 0 else 0
        if blocks <= 0:
            raise ValueError(
                f"no memory left for KV blocks in profile {p.name!r} at "
                f"gpu_memory_utilization={gpu_memory_utilization}"
            )
        return int(blocks)


def link_bandwidth(bytes_per_s: Any) -> float:
    """``bytes_per_s`` checked as a host-to-GPU link bandwidth (``host_link_bytes_per_s``): a finite
    number > 0, not a boolean; ``ValueError`` otherwise."""
    if isinstance(bytes_per_s, bool) or not isinstance(bytes_per_s, int | float) \
            or not (math.isfinite(bytes_per_s) and bytes_per_s > 0):
        raise ValueError(f"host_link_bytes_per_s must be a finite number > 0, got {bytes_per_s!r}")
    return float(bytes_per_s)


def reload_s_per_token(cost: Any, link_bytes_per_s: Any) -> float:
    """Seconds to copy one token's KV from the host tier over a link of ``link_bytes_per_s``
    (checked by ``link_bandwidth``): the engine model's reload time and the router's price of a
    host hit, one formula. ``cost``: anything with ``kv_bytes_per_token()``."""
    return cost.kv_bytes_per_token() / link_bandwidth(link_bytes_per_s)
