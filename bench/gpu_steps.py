"""Time whole engine steps of a Llama-shaped decoder on a GPU, and compare them with the cost model.

Why: ``CostModel.step_time`` prices decode batches and mixed steps (prefill chunks plus decodes)
with terms fitted to one-request eager prefills (``bench/calibrate.py``). Its decode term, its
sum-of-phases rule for mixed steps and its small-chunk regime had never been measured. This tool
times them the way a CUDA-graph engine runs them: each step is captured once in a CUDA graph and
replayed, so no per-kernel launch cost is left, only GPU time.

The decoder has the shape's real weights (random bf16, one set per layer), RMSNorm, rotary
embedding, fused QKV and gate/up GEMMs, and a last-token LM head; ``--fuse`` compiles the
elementwise work between them with torch.compile, as vLLM does. Attention is PyTorch SDPA with
the FlashAttention backend forced on CUDA:
- a prefill chunk of N new tokens on C cached ones attends to its cache without a mask and to its
  own N tokens causally (two kernels whose FLOPs equal one causal-offset kernel that skips the
  masked half, as vLLM's FlashAttention does; the two outputs are added, which is exact in cost,
  not in value);
- the cached part and decodes read K/V with the query heads of one KV group packed as rows (the
  grouped-query layout vLLM's decode kernels use), so the cache is read once per KV head.
KV caches are dense per sequence rather than paged: the same bytes as vLLM's paged blocks.

What it does not measure: vLLM's host work per step (scheduling, input preparation, sampling,
output processing), which the profile's ``step_overhead_s`` stands for. The comparison therefore
subtracts that overhead from the model.

    python bench/gpu_steps.py measure --fuse --out steps.jsonl    # on the GPU machine: torch only
    python -m bench.gpu_steps compare --steps bench/data/h200_steps_fused.jsonl
    python -m bench.gpu_steps fit        # the '-graphs' profiles from the shipped fused steps

Results and method: docs/cost-model.md, "Whole steps on an H200".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

# torch is imported where the decoder is built, and fairway/bench.calibrate where a profile is
# priced or fitted: ``measure`` runs on a GPU machine's image with torch and numpy alone.


@dataclass(frozen=True, slots=True)
class Shape:
    """A Llama-style decoder's dimensions (``head_dim = hidden // heads``)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    inter: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


#: Llama-3.1-8B, the default profile's model (``fairway/profiles/h200-llama3-8b.json``).
LLAMA_8B = Shape(hidden=4096, layers=32, heads=32, kv_heads=8, inter=14336, vocab=128256)
#: The 14B shape of the calibration (``fairway/profiles/h200-14b.json``).
QWEN_14B = Shape(hidden=5120, layers=48, heads=40, kv_heads=8, inter=13824, vocab=152064)
#: A few-kilobyte decoder for checking the code on a CPU.
TINY = Shape(hidden=64, layers=2, heads=4, kv_heads=2, inter=128, vocab=256)
SHAPES = {"llama-3.1-8b": LLAMA_8B, "qwen2.5-14b-like": QWEN_14B, "tiny": TINY}
#: The measured files shipped with the repository.
_DATA = Path(__file__).resolve().parent / "data"
#: Decode batches whose KV would pass this many bytes are left out of the grid (an H200 holds
#: 139 GiB: weights, this and the activations must fit).
KV_BUDGET_BYTES = 70e9
#: The shipped cost profile of each measured shape.
PROFILE_OF_SHAPE = {"llama-3.1-8b": "h200-llama3-8b", "qwen2.5-14b-like": "h200-14b"}


@dataclass(frozen=True, slots=True)
class StepSpec:
    """One engine step: prefill chunks ``(new N, cached C)`` plus ``decodes`` sequences decoding one
    token each on ``decode_ctx`` cached tokens."""

    kind: str
    chunks: tuple[tuple[int, int], ...] = ()
    decodes: int = 0
    decode_ctx: int = 0

    @property
    def gemms_only(self) -> bool:
        """Kind ``gemms``: only the linear layers of ``decodes`` tokens (no norm, rotary,
        attention or elementwise kernels): how fast the weights stream on their own."""
        return self.kind == "gemms"

    @property
    def tokens(self) -> int:
        return sum(n for n, _ in self.chunks) + self.decodes


def default_grid(max_decode_kv_tokens: int = 524_288) -> list[StepSpec]:
    """The measured grid: pure decode, one-chunk prefill (the calibration's grid, now with graphs
    and causal skipping), mixed steps and multi-chunk steps. Decode batches whose cache would pass
    ``max_decode_kv_tokens`` tokens are left out (memory)."""
    grid: list[StepSpec] = [StepSpec("gemms", decodes=t) for t in (1, 16, 64, 256, 512, 2048)]
    for d in (1, 4, 16, 64, 256):
        for ctx in (512, 2048, 8192):
            if d * ctx <= max_decode_kv_tokens:
                grid.append(StepSpec("decode", decodes=d, decode_ctx=ctx))
    for n in (16, 128, 512, 2048, 8192):
        for c in (0, 2048, 8192, 32768):
            grid.append(StepSpec("prefill", chunks=((n, c),)))
    for chunk in ((512, 0), (2048, 0), (512, 8192), (2048, 8192)):
        for d in (16, 128):
            grid.append(StepSpec("mixed", chunks=(chunk,), decodes=d, decode_ctx=2048))
    grid.append(StepSpec("multi", chunks=((128, 8192),) * 4))
    grid.append(StepSpec("multi", chunks=((2048, 0),) * 4))
    grid.append(StepSpec("multi", chunks=((64, 2048),) * 8, decodes=64, decode_ctx=2048))
    return grid


# --------------------------------------------------------------------------------------------
# Measurement (torch is imported here only, so ``compare`` and the tests run without it)
# --------------------------------------------------------------------------------------------


class Decoder:
    """Random-weight Llama decoder that runs one engine step over prepared caches.

    ``step(spec)`` returns a closure doing the whole forward pass of that step with every tensor
    allocated up front, so it can be captured in a CUDA graph. Memory: weights plus, per layer,
    ``2 * kv_heads * head_dim`` values for every cached token of the step.
    """

    def __init__(self, shape: Shape, device: str, seed: int = 0, fuse: bool = False,
                 compile_backend: str = "inductor") -> None:
        import torch

        self.torch = torch
        self.fuse = fuse
        # The elementwise work between the GEMMs and the attention, in three functions. With
        # ``fuse`` each is compiled by torch.compile (Inductor, dynamic shapes) into a few fused
        # kernels, as vLLM compiles its model; without, each op is its own kernel.
        fns = (self._add_rms_eager, self._rms, self._qkv_rope_eager, self._silu_mul_eager)
        if fuse:
            fns = tuple(torch.compile(f, dynamic=True, fullgraph=True, backend=compile_backend) for f in fns)
        self._add_rms, self._norm, self._qkv_rope, self._silu_mul = fns
        self.shape = shape
        self.device = device
        self.dtype = torch.bfloat16
        gen = torch.Generator(device=device).manual_seed(seed)
        self._gen = gen
        hd, kv, nh = shape.head_dim, shape.kv_heads, shape.heads

        def w(*size: int) -> Any:
            t = torch.empty(size, device=device, dtype=self.dtype)
            return t.normal_(0.0, 0.02, generator=gen)

        def ones() -> Any:
            return torch.ones(shape.hidden, device=device, dtype=self.dtype)

        # Weights as [out, in], applied with F.linear, as nn.Linear (and so vLLM and HF) store them.
        self.embed = w(shape.vocab, shape.hidden)
        self.layers = [
            {
                "n1": ones(), "qkv": w((nh + 2 * kv) * hd, shape.hidden), "o": w(shape.hidden, nh * hd),
                "n2": ones(), "gu": w(2 * shape.inter, shape.hidden), "down": w(shape.hidden, shape.inter),
            }
            for _ in range(shape.layers)
        ]
        self.norm = ones()
        self.lm_head = w(shape.vocab, shape.hidden)

    def _rms(self, x: Any, weight: Any) -> Any:
        xf = x.float()
        return (xf * self.torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * weight

    def _add_rms_eager(self, x: Any, delta: Any, weight: Any) -> tuple[Any, Any]:
        y = x + delta
        return y, self._rms(y, weight)

    def _qkv_rope_eager(self, qkv: Any, cos: Any, sin: Any) -> tuple[Any, Any, Any]:
        sh = self.shape
        nh, kvh, hd, t = sh.heads, sh.kv_heads, sh.head_dim, qkv.shape[0]
        q = qkv[:, : nh * hd].view(t, nh, hd)
        k = qkv[:, nh * hd: (nh + kvh) * hd].view(t, kvh, hd)
        v = qkv[:, (nh + kvh) * hd:].view(t, kvh, hd)
        return self._rope(q, cos, sin), self._rope(k, cos, sin), v

    def _silu_mul_eager(self, gu: Any) -> Any:
        gate, up = gu.chunk(2, dim=-1)
        return self.torch.nn.functional.silu(gate) * up

    def _rope(self, x: Any, cos: Any, sin: Any) -> Any:
        # x [T, heads, hd]; cos/sin [T, 1, hd/2]
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return self.torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def attention_cached(self, q: Any, k: Any, v: Any) -> Any:
        """Unmasked attention of ``q`` [T, heads, hd] over ``k``/``v`` [B, kv, S, hd] with the
        query heads of each KV group packed as rows; ``T`` must be ``B * rows`` (rows per
        sequence). Returns [T, heads, hd]. Exact: without a mask, rows are independent."""
        torch = self.torch
        b, kv, _, hd = k.shape
        t, nh, _ = q.shape
        rows, group = t // b, nh // kv
        qp = q.view(b, rows, kv, group, hd).permute(0, 2, 3, 1, 4).reshape(b, kv, group * rows, hd)
        o = torch.nn.functional.scaled_dot_product_attention(qp, k, v)
        return o.reshape(b, kv, group, rows, hd).permute(0, 3, 1, 2, 4).reshape(t, nh, hd)

    def attention_causal(self, q: Any, k: Any, v: Any) -> Any:
        """Causal attention of ``q`` [N, heads, hd] over its own ``k``/``v`` [N, kv, hd]."""
        torch = self.torch
        group = q.shape[1] // k.shape[1]
        n, kv, hd = k.shape
        # Each KV head repeated for its query group (expand + reshape: no host sync, graph-safe).
        kx = k[:, :, None, :].expand(n, kv, group, hd).reshape(n, kv * group, hd)
        vx = v[:, :, None, :].expand(n, kv, group, hd).reshape(n, kv * group, hd)
        kx, vx = kx.transpose(0, 1).unsqueeze(0), vx.transpose(0, 1).unsqueeze(0)
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), kx, vx, is_causal=True)
        return o[0].transpose(0, 1)

    def step(self, spec: StepSpec) -> Any:
        """Allocate inputs and caches for ``spec`` and return the forward closure."""
        torch, sh = self.torch, self.shape
        dev, dt, hd, kvh, nh = self.device, self.dtype, sh.head_dim, sh.kv_heads, sh.heads
        tokens = spec.tokens
        ids = torch.randint(0, sh.vocab, (tokens,), device=dev, generator=self._gen)
        pos = torch.cat(
            [torch.arange(c, c + n, device=dev) for n, c in spec.chunks]
            + [torch.full((spec.decodes,), spec.decode_ctx, device=dev)]
        ).float()
        inv = 1.0 / (10000.0 ** (torch.arange(0, hd // 2, device=dev).float() / (hd // 2)))
        ang = pos[:, None] * inv[None, :]
        cos, sin = ang.cos().to(dt)[:, None, :], ang.sin().to(dt)[:, None, :]

        def cache(b: int, s: int) -> Any:
            return torch.empty((b, kvh, s, hd), device=dev, dtype=dt).normal_(generator=self._gen)

        caches = [
            {
                "chunks": [(cache(1, c), cache(1, c)) if c else None for _, c in spec.chunks],
                "dec": (cache(spec.decodes, spec.decode_ctx + 1), cache(spec.decodes, spec.decode_ctx + 1))
                if spec.decodes else None,
            }
            for _ in range(sh.layers)
        ]
        last = []
        off = 0
        for n, _ in spec.chunks:
            off += n
            last.append(off - 1)
        last += list(range(off, off + spec.decodes))
        last_idx = torch.tensor(last, device=dev)

        lin = torch.nn.functional.linear
        if spec.gemms_only:
            def gemms() -> Any:
                x = self.embed[ids]
                for layer in self.layers:
                    qkv = lin(x, layer["qkv"])
                    x = lin(qkv[:, : nh * hd], layer["o"])
                    x = lin(lin(x, layer["gu"])[:, : sh.inter], layer["down"])
                return lin(x, self.lm_head)
            return gemms

        def forward() -> Any:
            x = self.embed[ids]
            h = self._norm(x, self.layers[0]["n1"])
            for i, (layer, cl) in enumerate(zip(self.layers, caches, strict=True)):
                q, k, v = self._qkv_rope(lin(h, layer["qkv"]), cos, sin)
                outs = []
                o0 = 0
                for (n, c), kv_c in zip(spec.chunks, cl["chunks"], strict=True):
                    qs = q[o0: o0 + n]
                    o = self.attention_causal(qs, k[o0: o0 + n], v[o0: o0 + n])
                    if c:
                        o = o + self.attention_cached(qs, kv_c[0], kv_c[1])
                    outs.append(o)
                    o0 += n
                if spec.decodes:
                    kd, vd = cl["dec"]
                    kd[:, :, spec.decode_ctx] = k[o0:]
                    vd[:, :, spec.decode_ctx] = v[o0:]
                    outs.append(self.attention_cached(q[o0:], kd, vd))
                att = torch.cat(outs) if len(outs) > 1 else outs[0]
                x, h = self._add_rms(x, lin(att.reshape(tokens, nh * hd), layer["o"]), layer["n2"])
                y = lin(self._silu_mul(lin(h, layer["gu"])), layer["down"])
                if i + 1 < len(self.layers):
                    x, h = self._add_rms(x, y, self.layers[i + 1]["n1"])
                else:
                    x = x + y
            return lin(self._norm(x[last_idx], self.norm), self.lm_head)

        return forward


def _time_step(dec: Decoder, spec: StepSpec, graphs: bool, reps: int) -> list[float]:
    """Seconds per step, ``reps`` timed runs after warm-up (CUDA events on a GPU)."""
    torch = dec.torch
    fwd = dec.step(spec)
    if dec.device == "cpu":
        with torch.no_grad():
            fwd()
            out = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fwd()
                out.append(time.perf_counter() - t0)
        return out
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run() -> Any:
        with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return fwd()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    call = run
    if graphs:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        call = g.replay
        call()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        call()
        e1.record()
        e1.synchronize()
        out.append(e0.elapsed_time(e1) / 1e3)
    return out


def _copy_gbps(torch: Any, device: str, gib: int = 4) -> float:
    """Device-to-device copy bandwidth, bytes read plus written, as the calibration counts it."""
    n = gib * 2**30
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
    del a, b
    return 2 * n / statistics.median(times) / 1e9


def measure(shape_name: str, out: Path, device: str, reps: int, grid: Iterable[StepSpec],
            eager_kinds: Sequence[str] = ("prefill",), fuse: bool = False) -> int:
    """Measure ``grid`` and append one JSON line per point to ``out`` (a header line first).

    Each point is timed with CUDA graphs; points whose kind is in ``eager_kinds`` are also timed
    without (the calibration's eager regime, for a cross-check). Lines are flushed as they are
    measured, so a run cut short keeps what it did. Returns the number of points measured.
    """
    import torch

    shape = SHAPES[shape_name]
    dec = Decoder(shape, device, fuse=fuse)
    header: dict[str, Any] = {
        "header": True, "shape_name": shape_name, "shape": asdict(shape), "device": device,
        "torch": torch.__version__, "reps": reps, "fused": fuse,
    }
    if device != "cpu":
        header["gpu"] = torch.cuda.get_device_name()
        header["copy_GBps_rw"] = _copy_gbps(torch, device)
    count = 0
    with out.open("w", encoding="utf-8") as fh:
        fh.write(json.dumps(header) + "\n")
        fh.flush()
        for spec in grid:
            modes = [True] if device != "cpu" else [False]
            if device != "cpu" and spec.kind in eager_kinds:
                modes.append(False)
            for graphs in modes:
                t0 = time.perf_counter()
                rec: dict[str, Any] = {"kind": spec.kind, "chunks": [list(c) for c in spec.chunks],
                                       "decodes": spec.decodes, "decode_ctx": spec.decode_ctx,
                                       "graphs": graphs}
                try:
                    runs = _time_step(dec, spec, graphs=graphs, reps=reps)
                except Exception as exc:  # noqa: BLE001 - one failed point must not end the run
                    rec.update(error=f"{type(exc).__name__}: {exc}"[:500], s=None)
                else:
                    rec.update(s=statistics.median(runs), runs=runs)
                rec["wall_s"] = round(time.perf_counter() - t0, 3)
                fh.write(json.dumps(rec) + "\n")
                fh.flush()
                print(json.dumps({k: rec[k] for k in ("kind", "chunks", "decodes", "decode_ctx",
                                                      "graphs", "s")}), flush=True)
                count += 1
            if device != "cpu":
                torch.cuda.empty_cache()
    return count


# --------------------------------------------------------------------------------------------
# Comparison with the cost model
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Comparison:
    """One measured step against the model's GPU time (``step_time`` less ``step_overhead_s``).

    ``max_rule_s``: for steps with both prefill chunks and decodes, the GPU time if the two phases
    overlapped completely (the max of each alone) instead of adding up.
    """

    kind: str
    chunks: tuple[tuple[int, int], ...]
    decodes: int
    decode_ctx: int
    measured_s: float
    model_s: float
    max_rule_s: float | None = None

    @property
    def ratio(self) -> float:
        return self.model_s / self.measured_s


def read_steps(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The header and the point records of a ``measure`` output file."""
    header: dict[str, Any] = {}
    points: list[dict[str, Any]] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("header"):
            header = rec
        else:
            points.append(rec)
    return header, points


def compare(points: Sequence[dict[str, Any]], profile: str = "h200-llama3-8b",
            graphs: bool = True) -> list[Comparison]:
    """The measured points (CUDA-graph ones by default) against ``profile``'s GPU time: its step
    time less the host overhead per step that every shipped profile adds (2 ms; a GPU trace does not
    see it)."""
    from bench.calibrate import DEFAULT_STEP_OVERHEAD_S
    from fairway.cost_model import CostModel

    m = CostModel.from_profile(profile)

    def gpu(chunks: Sequence[Sequence[int]], d: int, ctx: int) -> float:
        return price(m, chunks, d, ctx) - DEFAULT_STEP_OVERHEAD_S

    out = []
    for p in points:
        if bool(p["graphs"]) != graphs or p.get("s") is None:
            continue
        chunks = tuple((int(a), int(b)) for a, b in p["chunks"])
        d, ctx = int(p["decodes"]), int(p["decode_ctx"])
        both = None
        if chunks and d:
            both = max(gpu(chunks, 0, 0), gpu((), d, ctx))
        out.append(Comparison(p["kind"], chunks, d, ctx, float(p["s"]), gpu(chunks, d, ctx), both))
    return out


def comparison_table(rows: Sequence[Comparison]) -> str:
    """Markdown table: each point's measured and modelled GPU ms and their ratio."""
    lines = ["| kind | prefill chunks (N, C) | decodes x ctx | measured ms | model ms | model/measured |"
             " max-rule ms |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ch = ", ".join(f"({n}, {c})" for n, c in r.chunks) if r.chunks else "-"
        if len(set(r.chunks)) == 1 and len(r.chunks) > 1:
            ch = f"{len(r.chunks)} x ({r.chunks[0][0]}, {r.chunks[0][1]})"
        dx = f"{r.decodes} x {r.decode_ctx}" if r.decodes else "-"
        mx = f"{r.max_rule_s * 1e3:.2f}" if r.max_rule_s is not None else ""
        lines.append(f"| {r.kind} | {ch} | {dx} | {r.measured_s * 1e3:.2f} | {r.model_s * 1e3:.2f} "
                     f"| {r.ratio:.2f} | {mx} |")
    return "\n".join(lines)


def summary(rows: Sequence[Comparison]) -> dict[str, dict[str, float]]:
    """Per kind: points, median and range of model/measured."""
    out: dict[str, dict[str, float]] = {}
    for kind in sorted({r.kind for r in rows}):
        ratios = [r.ratio for r in rows if r.kind == kind]
        out[kind] = {"points": len(ratios), "median": statistics.median(ratios),
                     "min": min(ratios), "max": max(ratios)}
    return out


#: Profile terms ``fit_profile`` fits to whole steps, in the order of its least-squares columns.
FIT_TERMS = ("step_overhead_s", "linear_s_per_token", "attn_s_per_token_ctx",
             "attn_s_per_token_sq", "ctx_read_s_per_token")
#: Name suffix of a profile fitted to whole CUDA-graph steps.
GRAPHS_SUFFIX = "-graphs"


def _aggregates(chunks: Sequence[Sequence[int]], decodes: int, decode_ctx: int) -> tuple[int, int, int, int, int]:
    """(tokens, prefill tokens, sum n*c, sum n^2, decode context) of a step: what
    ``CostModel.step_time`` takes."""
    n = sum(int(a) for a, _ in chunks)
    return (n + decodes, n, sum(int(a) * int(b) for a, b in chunks), sum(int(a) ** 2 for a, _ in chunks),
            decodes * decode_ctx)


def price(m: Any, chunks: Sequence[Sequence[int]], decodes: int, decode_ctx: int) -> float:
    """``m.step_time`` (a ``CostModel``) of a step of prefill ``chunks`` ``(N, C)`` and ``decodes``
    sequences on ``decode_ctx`` tokens each."""
    _, n, s1, s2, x = _aggregates(chunks, decodes, decode_ctx)
    return m.step_time(n, s1, s2, decodes, x)


def fit_profile(points: Sequence[dict[str, Any]], base: Any,
                host_s: float | None = None) -> tuple[Any, dict[str, float]]:
    """``base`` (a ``CostProfile``) with ``FIT_TERMS`` refitted to whole measured steps.

    The GPU time is modelled by ``CostModel.step_time`` itself: ``K + max(b*T, W) + max(c*S1 +
    d*S2, e*S1/P) + e*X`` with the launch floor at 0 and ``W`` (the weight read) kept from
    ``base``; the profile's ``step_overhead_s`` is then ``K`` plus ``host_s``, the host work per
    step that a GPU measurement cannot see (default: the shipped profiles' 2 ms). Each
    point's regimes (weight- or GEMM-bound; attention by FLOPs or by the cached-KV read) are
    fixed from the current terms, the five terms are solved by least squares of the relative
    error, and this repeats until the regimes stop changing (at most 20 rounds). The ``gemms``
    points are left out (they are not whole steps). Returns the profile and its error on the fitted
    points (``points``, ``mean``, ``max`` of |model/measured - 1|). O(points) per round.
    """
    from bench.calibrate import DEFAULT_STEP_OVERHEAD_S, ErrorStats
    from fairway.cost_model import CostModel

    rows = [p for p in points if p.get("s") is not None and p["graphs"] and p["kind"] != "gemms"]
    agg = np.array([_aggregates(p["chunks"], int(p["decodes"]), int(p["decode_ctx"])) for p in rows],
                   dtype=np.float64)
    t = np.array([float(p["s"]) for p in rows], dtype=np.float64)
    tok, pre, s1, s2, x = agg.T
    cbar = np.divide(s1, pre, out=np.zeros_like(s1), where=pre > 0)  # mean cached context of the chunks
    w = base.weight_read_s
    terms = np.array([getattr(base, f) for f in FIT_TERMS], dtype=np.float64)
    prev = None
    for _ in range(20):
        k_, b_, c_, d_, e_ = terms
        gemm = b_ * tok > w
        flops = (c_ * s1 + d_ * s2) >= e_ * cbar
        state = (gemm.tobytes(), flops.tobytes())
        if state == prev:
            break
        prev = state
        # columns: K, b, c, d, e ; the constant W moves to the left side where weight-bound
        cols = np.stack([
            np.ones_like(t),
            np.where(gemm, tok, 0.0),
            np.where(flops & (pre > 0), s1, 0.0),
            np.where(flops & (pre > 0), s2, 0.0),
            np.where(~flops & (pre > 0), cbar, 0.0) + x,
        ], axis=1)
        rhs = t - np.where(gemm, 0.0, w)
        sol, *_ = np.linalg.lstsq(cols / t[:, None], rhs / t, rcond=None)
        terms = np.maximum(sol, 0.0)
    host = DEFAULT_STEP_OVERHEAD_S if host_s is None else host_s
    gpu_only = replace(base, name=base.name + GRAPHS_SUFFIX, launch_floor_s=0.0,
                       **{f: float(v) for f, v in zip(FIT_TERMS, terms, strict=True)})
    fitted = replace(gpu_only, step_overhead_s=gpu_only.step_overhead_s + host)
    m = CostModel(gpu_only)
    pred = np.array([price(m, r["chunks"], int(r["decodes"]), int(r["decode_ctx"])) for r in rows])
    return fitted, asdict(ErrorStats.of(pred, t))


def write_graphs_profile(steps: Path, out_dir: Path) -> tuple[Path, dict[str, float]]:
    """Fit ``steps`` (a ``measure`` file) onto its shape's shipped profile and write
    ``<profile>-graphs.json`` into ``out_dir``. Deterministic output (no timestamps)."""
    from fairway.cost_model import load_profile

    header, points = read_steps(steps)
    base_name = PROFILE_OF_SHAPE[header["shape_name"]]
    profile, err = fit_profile(points, load_profile(base_name))
    obj = {
        "version": 1,
        "profile": profile.to_dict(),
        "source": {
            "steps": f"bench/data/{steps.name}",
            "steps_sha256": hashlib.sha256(steps.read_bytes()).hexdigest(),
            "device": header.get("gpu", header.get("device")),
            "torch": header.get("torch"),
            "base_profile": base_name,
            "method": "bench/gpu_steps.py fit: whole steps in CUDA graphs"
                      + (", elementwise work fused by torch.compile" if header.get("fused") else
                         ", unfused PyTorch kernels")
                      + "; step_overhead_s = fitted GPU constant + 2 ms host overhead",
        },
        "fit_error": err,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{profile.name}.json"
    path.write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")
    return path, err


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``measure`` times the grid (needs torch; a GPU for real figures); ``compare`` prints a
    measured file against a profile."""
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_steps", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    mp = sub.add_parser("measure", help="time the step grid and write JSON lines")
    mp.add_argument("--out", type=Path, required=True)
    mp.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    mp.add_argument("--device", default="cuda")
    mp.add_argument("--reps", type=int, default=7)
    mp.add_argument("--kinds", default="gemms,decode,prefill,mixed,multi",
                    help="comma-separated kinds of the grid to measure")
    mp.add_argument("--fuse", action="store_true",
                    help="compile the elementwise work with torch.compile (fused kernels, as vLLM)")
    mp.add_argument("--no-eager", action="store_true", help="time CUDA-graph steps only")
    fp = sub.add_parser("fit", help="fit a '-graphs' profile to a measured steps file")
    fp.add_argument("--steps", type=Path, nargs="+",
                    default=[_DATA / "h200_steps_fused.jsonl", _DATA / "h200_14b_steps_fused.jsonl"])
    fp.add_argument("--out", type=Path, default=None, help="folder (default fairway/profiles)")
    cp = sub.add_parser("compare", help="print measured steps against a cost profile")
    cp.add_argument("--steps", type=Path, default=_DATA / "h200_steps_fused.jsonl")
    cp.add_argument("--profile", default=None,
                    help="cost profile to compare with (default: the measured shape's own)")
    cp.add_argument("--eager", action="store_true", help="compare the eager points instead")
    args = ap.parse_args(argv)
    if args.cmd == "measure":
        kinds = set(args.kinds.split(","))
        shape = SHAPES[args.shape]
        kv_bytes = 2 * shape.layers * shape.kv_heads * shape.head_dim * 2  # bf16 K and V, all layers
        grid = [s for s in default_grid(int(KV_BUDGET_BYTES // kv_bytes)) if s.kind in kinds]
        if args.shape == "tiny":
            grid = [StepSpec(s.kind, tuple((max(1, n // 64), c // 64) for n, c in s.chunks),
                             s.decodes, s.decode_ctx // 64) for s in grid]
        n = measure(args.shape, args.out, args.device, args.reps, grid,
                    eager_kinds=() if args.no_eager else ("prefill",), fuse=args.fuse)
        print(f"measured {n} points into {args.out}")
        return 0
    if args.cmd == "fit":
        from fairway.cost_model import profiles_dir

        for steps in args.steps:
            path, err = write_graphs_profile(steps, args.out or profiles_dir())
            print(f"wrote {path}: {err['points']} steps, |model/measured - 1| mean "
                  f"{err['mean']:.3f} max {err['max']:.3f}")
        return 0
    if not args.steps.is_file():
        print(f"steps file not found: {args.steps}", file=sys.stderr)
        return 2
    header, points = read_steps(args.steps)
    profile = args.profile or PROFILE_OF_SHAPE.get(header.get("shape_name", ""), "h200-llama3-8b")
    rows = compare(points, profile, graphs=not args.eager)
    print(f"# {header.get('gpu', header.get('device'))}, torch {header.get('torch')}, "
          f"copy {header.get('copy_GBps_rw', float('nan')):.0f} GB/s (rw); profile {profile}")
    print(comparison_table(rows))
    print()
    for kind, s in summary(rows).items():
        print(f"{kind:8s} points {s['points']:3.0f}  model/measured median {s['median']:.2f} "
              f"range {s['min']:.2f}-{s['max']:.2f}")
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    raise SystemExit(main())
