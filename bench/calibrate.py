"""Fit the cost model's profiles to a calibration grid, and the CLI that writes them.

Offline tool, not needed at run time: it reads ``../shared/calibration/h200_prefill.json``
(measured prefill times of one request on an H200 over a grid of new and cached tokens), fits
the step terms of ``fairway.cost_model.CostModel`` by weighted least squares of the relative
error, writes the shipped ``fairway/profiles/*.json`` and prints the fit's error table. It lives
outside the core so that the router, policies and simulator load fitted numbers, never a fitter.
Method and errors: ``docs/cost-model.md``. Refit the shipped profiles with::

    python -m bench.calibrate fit --calibration ../shared/calibration/h200_prefill.json \\
        --out fairway/profiles

``python -m bench.calibrate show NAME`` prints a shipped profile's derived numbers.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from fairway.cost_model import (
    DEFAULT_PROFILE,
    EAGER_SUFFIX,
    CostModel,
    CostProfile,
    profiles_dir,
)

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
        prog="python -m bench.calibrate", description=__doc__.split("\n")[0]
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    fp = sub.add_parser("fit", help="refit profiles from a calibration file and print the errors")
    fp.add_argument("--calibration", type=Path, default=_default_calibration_path())
    fp.add_argument("--out", type=Path, default=profiles_dir())
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
