"""Calibrated time and KV-memory model of one vLLM-style engine replica.

Why: every Fairway decision prices requests in seconds. The queue policies rank by the estimated
prefill time P_r, the router sums queued prefill work Q_j per replica, and the simulator advances
its clock by one engine step at a time. All three read this one model, so the simulator and the
live path agree on what a request costs.

The model (derivation, fit and errors in ``docs/cost-model.md``), for one engine step whose batch
holds prefill chunks i (n_i new tokens on c_i tokens already in the request's KV) and decoding
requests j (one token each on a context of ctx_j tokens)::

    T     = sum n_i + #decodes                                 tokens through the linear layers
    gpu   = max(b * T, W / BW)                                 linear layers: FLOP- or weight-bound
          + max(c * sum n_i c_i + d * sum n_i^2, e * c_bar)    prefill attention: FLOPs or KV read
          + max(c, e) * sum ctx_j                              decode attention (memory-bound)
    step  = overhead + max(floor, gpu)

``c_bar = sum n_i c_i / sum n_i`` (exact for one chunk). ``b, c, d`` are fitted to the H200
calibration; ``W`` is the bytes of weights streamed per step, ``BW`` the measured copy bandwidth.
Two families of profiles share those fitted terms:

- ``h200-llama3-8b`` / ``h200-14b`` (default): vLLM with CUDA graphs. ``overhead`` is a
  documented host-side constant per step (2 ms), ``floor`` is 0 and ``e = KV bytes per token / BW``
  (FlashAttention with split-KV reads the cached KV once, at bandwidth).
- ``...-eager``: the calibration's own eager-PyTorch regime, for checking the fit. ``overhead``
  is 0, ``floor`` is the measured launch floor (host launches overlap GPU work, hence the max)
  and ``e`` the fitted low-occupancy cost of attending a short chunk to a long cached context.

Refit the shipped profiles from the calibration (and print the error table) with::

    python -m fairway.cost_model fit --calibration ../shared/calibration/h200_prefill.json \\
        --out fairway/profiles
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_PROFILE = "h200-llama3-8b"
EAGER_SUFFIX = "-eager"

#: Host time per engine step that CUDA graphs do not remove and vLLM v1 does not hide behind the
#: GPU: scheduling, input preparation, sampling, output processing. See docs/cost-model.md.
DEFAULT_STEP_OVERHEAD_S = 2.0e-3
#: H200 memory visible to one process (the driver shows ~140.4 GiB; ~139 GiB is usable).
H200_GPU_MEMORY_BYTES = 139 * 2**30
#: vLLM's default token budget per step; its profiling forward pass sizes the activation peak.
PROFILE_RUN_TOKENS = 8192
#: vLLM's default ``max_num_seqs``; its sampler warm-up holds fp32 logits for this many rows.
PROFILE_RUN_SEQS = 256
#: CUDA context, cuBLAS/NCCL workspaces and CUDA-graph pools outside the activation peak.
FIXED_RESERVE_BYTES = 2**30

_PROFILE_FILE_VERSION = 1
#: Calibration model key -> shipped profile name (immutable pairs, not a mutable registry).
_PROFILE_NAMES: tuple[tuple[str, str], ...] = (
    ("llama-3.1-8b", "h200-llama3-8b"),
    ("qwen2.5-14b-like", "h200-14b"),
)


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


def _profiles_dir() -> Path:
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
    for path in sorted(_profiles_dir().glob("*.json")):
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
    data = _read_profile_file(_profiles_dir() / f"{stem}.json")
    profile = CostProfile.from_dict(data["profile"])
    if profile.name != stem:
        raise ValueError(f"profile file {stem}.json names itself {profile.name!r}")
    if eager:
        profile = replace(profile, name=name, **data["eager"])
    return profile


def _stems() -> set[str]:
    return {p.stem for p in _profiles_dir().glob("*.json")}


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


# --------------------------------------------------------------------------------------------
# Fitting (offline: ``python -m fairway.cost_model fit``)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FitSettings:
    """How points are classified for the fit (documented in docs/cost-model.md).

    floor_max_new / floor_max_cached: points with N and C at or below these measure the eager
        launch floor only; the floor is their median.
    above_floor_ratio: a point is "above the floor" when its time is at least this multiple of
        the floor, so the launch floor cannot be what it measures.
    memory_bound_max_new: chunks of at most this many new tokens may be bound by reading their
        cached KV rather than by attention FLOPs; the fit tries both regimes for them.
    """

    floor_max_new: int = 128
    floor_max_cached: int = 8192
    above_floor_ratio: float = 1.5
    memory_bound_max_new: int = 512


@dataclass(frozen=True, slots=True)
class ErrorStats:
    """Relative error |model/measured - 1| over a set of calibration points."""

    points: int
    mean: float
    max: float

    @classmethod
    def of(cls, predicted: np.ndarray, measured: np.ndarray) -> ErrorStats:
        if measured.size == 0:
            return cls(0, 0.0, 0.0)
        r = np.abs(predicted / measured - 1.0)
        return cls(int(r.size), float(r.mean()), float(r.max()))


@dataclass(frozen=True, slots=True)
class FittedProfile:
    """One fitted model: the shipped default profile, its eager variant and the error table."""

    profile: CostProfile
    eager: dict[str, float]
    errors: dict[str, ErrorStats]
    calibration_fit: dict[str, float]

    def to_json_obj(self, source: Mapping[str, Any]) -> dict[str, Any]:
        """The profile file's content: deterministic (no timestamps), so a refit diffs clean."""
        return {
            "version": _PROFILE_FILE_VERSION,
            "profile": self.profile.to_dict(),
            "eager": dict(self.eager),
            "source": dict(source),
            "fit_error": {k: asdict(v) for k, v in self.errors.items()},
            "calibration_fit_error": dict(self.calibration_fit),
        }


def _grid(model: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    g = model["grid"]
    n = np.array([p["N"] for p in g], dtype=np.float64)
    c = np.array([p["C"] for p in g], dtype=np.float64)
    t = np.array([p["s"] for p in g], dtype=np.float64)
    return n, c, t


def _wls(
    n: np.ndarray, c: np.ndarray, t: np.ndarray, attn_mem: np.ndarray, weight_read_s: float
) -> np.ndarray:
    """Least squares of relative error for one regime assignment; returns (b, c, d, e).

    ``attn_mem`` marks points whose attention is bound by the cached-KV read (e*C) rather than
    FLOPs (c*N*C + d*N^2). The linear-layer regime (b*N vs the weight read) is iterated to a
    fixed point. O(points) per iteration, at most 20 iterations.
    """
    gemm_mem = np.zeros(n.shape, dtype=bool)
    coef = np.zeros(4)
    w = 1.0 / t
    for _ in range(20):
        x = np.stack(
            [
                np.where(gemm_mem, 0.0, n),
                np.where(attn_mem, 0.0, n * c),
                np.where(attn_mem, 0.0, n * n),
                np.where(attn_mem, c, 0.0),
            ],
            axis=1,
        )
        y = t - np.where(gemm_mem, weight_read_s, 0.0)
        coef, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
        nxt = coef[0] * n < weight_read_s
        if np.array_equal(nxt, gemm_mem):
            break
        gemm_mem = nxt
    return coef


def _gpu_time(
    n: np.ndarray, c: np.ndarray, b: float, cc: float, d: float, e: float, wr: float
) -> np.ndarray:
    return np.maximum(b * n, wr) + np.maximum(cc * n * c + d * n * n, e * c)


def fit_model(
    key: str,
    model: Mapping[str, Any],
    bandwidth_bytes_per_s: float,
    *,
    name: str,
    step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S,
    gpu_memory_bytes: int = H200_GPU_MEMORY_BYTES,
    dtype_bytes: int = 2,
    settings: FitSettings | None = None,
) -> FittedProfile:
    """Fit one calibration model (one shape's grid) into a default and an eager profile.

    1. floor F = median time of the floor points (N <= 128, C <= 8192);
    2. fit set S = points with time >= 1.5 F;
    3. for every assignment of the attention regime to the points of S with N <= 512, weighted
       least squares (weights 1/t, i.e. relative error) of t = max(bN, W/BW) + [cNC + dN^2 | eC];
       keep the assignment with the least squared relative error (first on ties).
    Exhaustive over at most 2^12 assignments; the shipped grids have 3-4 candidate points.
    """
    s = settings or FitSettings()
    shape = model["shape"]
    hidden = int(shape["hidden_size"])
    heads = int(shape["num_attention_heads"])
    if hidden % heads:
        raise ValueError(f"{key}: hidden_size {hidden} not divisible by {heads} heads")
    inter = int(shape["intermediate_size"])
    vocab = int(shape["vocab_size"])
    base = CostProfile(
        name=name,
        model=key,
        num_layers=int(shape["num_hidden_layers"]),
        hidden_size=hidden,
        num_kv_heads=int(shape["num_key_value_heads"]),
        head_dim=hidden // heads,
        vocab_size=vocab,
        num_params=int(round(float(model["params_b"]) * 1e9)),
        dtype_bytes=dtype_bytes,
        gpu_memory_bytes=int(gpu_memory_bytes),
        mem_bandwidth_bytes_per_s=float(bandwidth_bytes_per_s),
        activation_reserve_bytes=activation_reserve_bytes(hidden, inter, vocab, dtype_bytes),
        step_overhead_s=float(step_overhead_s),
        launch_floor_s=0.0,
        linear_s_per_token=0.0,
        attn_s_per_token_ctx=0.0,
        attn_s_per_token_sq=0.0,
        ctx_read_s_per_token=0.0,
    )
    wr = base.weight_read_s
    kv_read = base.kv_bytes_per_token / base.mem_bandwidth_bytes_per_s

    n, c, t = _grid(model)
    floor_pts = (n <= s.floor_max_new) & (c <= s.floor_max_cached)
    if not floor_pts.any():
        raise ValueError(
            f"{key}: no floor points (N <= {s.floor_max_new}, C <= {s.floor_max_cached})"
        )
    floor = float(np.median(t[floor_pts]))
    above = t >= s.above_floor_ratio * floor
    if above.sum() < 4:
        raise ValueError(f"{key}: only {int(above.sum())} points above the floor; need 4")
    cand = np.flatnonzero(above & (n <= s.memory_bound_max_new) & (c > 0))
    if cand.size > 12:
        raise ValueError(f"{key}: {cand.size} memory-bound candidates; at most 12 supported")
    ns, cs, ts = n[above], c[above], t[above]
    cand_s = np.searchsorted(np.flatnonzero(above), cand)
    best: tuple[float, np.ndarray] | None = None
    for assign in itertools.product((False, True), repeat=int(cand.size)):
        attn_mem = np.zeros(ns.shape, dtype=bool)
        attn_mem[cand_s] = assign
        coef = _wls(ns, cs, ts, attn_mem, wr)
        b, cc, d, e = (float(v) for v in coef)
        if min(b, cc, d, e) < 0:
            continue
        pred = _gpu_time(ns, cs, b, cc, d, e, wr)
        sse = float(np.sum((pred / ts - 1.0) ** 2))
        if best is None or sse < best[0]:
            best = (sse, coef)
    if best is None:
        raise ValueError(f"{key}: every regime assignment gave a negative coefficient")
    b, cc, d, e_fit = (float(v) for v in best[1])
    e_eager = max(e_fit, kv_read)  # reading the cached KV can never beat the bandwidth

    profile = replace(
        base,
        linear_s_per_token=b,
        attn_s_per_token_ctx=cc,
        attn_s_per_token_sq=d,
        ctx_read_s_per_token=kv_read,
    )
    eager = {"step_overhead_s": 0.0, "launch_floor_s": floor, "ctx_read_s_per_token": e_eager}

    eager_model = CostModel(replace(profile, name=name + EAGER_SUFFIX, **eager))
    graph_model = CostModel(profile)
    pe = eager_model.prefill_time_array(n, c)
    pg = graph_model.prefill_time_array(n, c)
    large = above & (n > s.memory_bound_max_new)
    errors = {
        "eager_full_grid": ErrorStats.of(pe, t),
        "eager_above_floor": ErrorStats.of(pe[above], t[above]),
        "default_above_floor_large_n": ErrorStats.of(pg[large], t[large]),
        "default_above_floor": ErrorStats.of(pg[above], t[above]),
        "default_full_grid": ErrorStats.of(pg, t),
    }
    given = model.get("fit", {})
    calibration_fit = {k: float(given[k]) for k in ("mean_rel_err", "max_rel_err") if k in given}
    return FittedProfile(profile, eager, errors, calibration_fit)


def activation_reserve_bytes(hidden: int, intermediate: int, vocab: int, dtype_bytes: int) -> int:
    """Memory vLLM keeps out of the KV cache besides the weights (an estimate, in bytes).

    Its profiling forward pass of ``PROFILE_RUN_TOKENS`` tokens peaks in the MLP (gate and up
    projections, activation output, plus a few hidden-size buffers: (3*I + 4*H) * dtype bytes a
    token); its sampler warm-up holds fp32 logits and probabilities for ``PROFILE_RUN_SEQS`` rows;
    ``FIXED_RESERVE_BYTES`` covers the CUDA context, library workspaces and CUDA-graph pools.
    """
    act = PROFILE_RUN_TOKENS * (3 * intermediate + 4 * hidden) * dtype_bytes
    sampler = PROFILE_RUN_SEQS * vocab * 4 * 2
    return act + sampler + FIXED_RESERVE_BYTES


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def profile_name_for(model_key: str, device: str) -> str:
    """The shipped name of a calibration model's profile (``h200-llama3-8b``, ``h200-14b``)."""
    for key, name in _PROFILE_NAMES:
        if key == model_key:
            return name
    dev = _slug(device).removeprefix("nvidia-")
    return f"{dev}-{_slug(model_key)}"


def fit_calibration(
    calibration: Mapping[str, Any],
    *,
    step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S,
    gpu_memory_bytes: int = H200_GPU_MEMORY_BYTES,
    settings: FitSettings | None = None,
) -> dict[str, FittedProfile]:
    """Fit every model of a calibration file's content; keys are profile names."""
    bw = float(calibration["copy_GBps_rw"]) * 1e9
    device = str(calibration.get("device", "gpu"))
    out: dict[str, FittedProfile] = {}
    for key, model in calibration["models"].items():
        name = profile_name_for(key, device)
        out[name] = fit_model(
            key,
            model,
            bw,
            name=name,
            step_overhead_s=step_overhead_s,
            gpu_memory_bytes=gpu_memory_bytes,
            settings=settings,
        )
    return out


def _source(calibration: Mapping[str, Any], raw: bytes, model_key: str) -> dict[str, Any]:
    return {
        "calibration": "shared/calibration/h200_prefill.json",
        "calibration_sha256": hashlib.sha256(raw).hexdigest(),
        "device": calibration.get("device"),
        "torch": calibration.get("torch"),
        "model": model_key,
        "copy_GBps_rw": calibration.get("copy_GBps_rw"),
    }


def error_table(fitted: Mapping[str, FittedProfile]) -> str:
    """The fit error table printed by ``fit`` (relative errors, percent)."""
    rows = [
        ("calibration's own fit, full grid", None),
        ("eager profile, full grid", "eager_full_grid"),
        ("eager profile, above the floor", "eager_above_floor"),
        ("default profile, above floor, N > 512", "default_above_floor_large_n"),
        ("default profile, above the floor", "default_above_floor"),
        ("default profile, full grid", "default_full_grid"),
    ]
    lines = []
    head = f"{'profile':<16} {'set':<40} {'pts':>4} {'mean':>7} {'max':>7}"
    lines.append(head)
    lines.append("-" * len(head))
    for pname, fp in fitted.items():
        for label, key in rows:
            if key is None:
                if not fp.calibration_fit:
                    continue
                npts = "-"
                mean = fp.calibration_fit.get("mean_rel_err", float("nan"))
                mx = fp.calibration_fit.get("max_rel_err", float("nan"))
            else:
                st = fp.errors[key]
                npts, mean, mx = str(st.points), st.mean, st.max
            lines.append(f"{pname:<16} {label:<40} {npts:>4} {mean:>6.1%} {mx:>6.1%}")
    return "\n".join(lines)


def point_table(fitted: Mapping[str, FittedProfile], calibration: Mapping[str, Any]) -> str:
    """Per-point measured vs modelled times (milliseconds) for every fitted profile."""
    lines = []
    for pname, fp in fitted.items():
        n, c, t = _grid(calibration["models"][fp.profile.model])
        pg = CostModel(fp.profile).prefill_time_array(n, c)
        pe = CostModel(
            replace(fp.profile, name=pname + EAGER_SUFFIX, **fp.eager)
        ).prefill_time_array(n, c)
        lines.append(f"{pname}: N, C, measured ms, eager ms (err), default ms (err)")
        for i in range(t.size):
            lines.append(
                f"  {int(n[i]):6d} {int(c[i]):6d} {t[i] * 1e3:9.2f} "
                f"{pe[i] * 1e3:9.2f} ({pe[i] / t[i] - 1:+6.1%}) "
                f"{pg[i] * 1e3:9.2f} ({pg[i] / t[i] - 1:+6.1%})"
            )
    return "\n".join(lines)


def write_profiles(calibration_path: Path, out_dir: Path) -> dict[str, FittedProfile]:
    """Fit ``calibration_path`` and write ``<profile>.json`` files into ``out_dir``."""
    raw = calibration_path.read_bytes()
    calibration = json.loads(raw)
    fitted = fit_calibration(calibration)
    out_dir.mkdir(parents=True, exist_ok=True)
    for pname, fp in fitted.items():
        obj = fp.to_json_obj(_source(calibration, raw, fp.profile.model))
        text = json.dumps(obj, indent=1) + "\n"
        (out_dir / f"{pname}.json").write_text(text, encoding="utf-8")
    return fitted


def _default_calibration_path() -> Path:
    return Path(__file__).resolve().parents[2] / "shared" / "calibration" / "h200_prefill.json"


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``fit`` regenerates the shipped profiles; ``show`` prints a profile's derived facts."""
    ap = argparse.ArgumentParser(
        prog="python -m fairway.cost_model", description=__doc__.split("\n")[0]
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    fp = sub.add_parser("fit", help="refit profiles from a calibration file and print the errors")
    fp.add_argument("--calibration", type=Path, default=_default_calibration_path())
    fp.add_argument("--out", type=Path, default=_profiles_dir())
    fp.add_argument("--points", action="store_true", help="also print every grid point")
    sp = sub.add_parser("show", help="print a shipped profile's derived numbers")
    sp.add_argument("name", nargs="?", default=DEFAULT_PROFILE)
    args = ap.parse_args(argv)

    if args.cmd == "fit":
        if not args.calibration.is_file():
            print(f"calibration file not found: {args.calibration}", file=sys.stderr)
            return 2
        fitted = write_profiles(args.calibration, args.out)
        print(error_table(fitted))
        if args.points:
            print()
            print(point_table(fitted, json.loads(args.calibration.read_bytes())))
        for pname in fitted:
            print(f"wrote {args.out / (pname + '.json')}")
        return 0

    m = CostModel.from_profile(args.name)
    p = m.profile
    print(f"profile               {p.name} ({p.model})")
    print(f"kv bytes / token      {m.kv_bytes_per_token()}")
    gib = 2.0**30
    print(f"weights               {p.weight_bytes / gib:.2f} GiB")
    print(f"streamed weights      {p.streamed_weight_bytes / gib:.2f} GiB a step")
    print(f"weight read / step    {p.weight_read_s * 1e3:.3f} ms")
    print(f"default kv blocks     {m.default_kv_blocks()} (16 tokens each, util 0.9)")
    for nn, cc in ((1, 0), (32, 0), (512, 0), (2048, 0), (8192, 0), (512, 32768), (8192, 32768)):
        print(f"prefill N={nn:<5d} C={cc:<6d} {m.prefill_time(nn, cc) * 1e3:9.3f} ms")
    for dseq, ctx in ((1, 2048), (64, 64 * 4096), (256, 256 * 2048)):
        dt = m.step_time(0, 0, 0, dseq, ctx)
        print(f"decode {dseq:>3d} seqs ctx={ctx:<7d} {dt * 1e3:9.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
