"""bench/gpu_steps.py's decoder on a CPU (torch needed; CI runs these in scripts/test_vllm.sh's
.venv-vllm, which has torch): the packed grouped-query attention is exact, and a measurement of the
tiny shape writes one timed line per grid point."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed here (scripts/test_vllm.sh runs these)")

from bench.gpu_steps import TINY, Decoder, StepSpec, measure  # noqa: E402

F = torch.nn.functional


def _expand(kv: Any, group: int) -> Any:
    return kv.repeat_interleave(group, dim=1)


@pytest.fixture(scope="module")
def dec() -> Decoder:
    return Decoder(TINY, "cpu")


def test_packed_decode_attention_equals_per_head_attention(dec: Decoder) -> None:
    g = torch.Generator().manual_seed(1)
    d, s, hd = 3, 10, TINY.head_dim
    q = torch.randn(d, TINY.heads, hd, generator=g)
    k = torch.randn(d, TINY.kv_heads, s, hd, generator=g)
    v = torch.randn(d, TINY.kv_heads, s, hd, generator=g)
    group = TINY.heads // TINY.kv_heads
    ref = F.scaled_dot_product_attention(q[:, :, None, :], _expand(k, group), _expand(v, group))[:, :, 0]
    torch.testing.assert_close(dec.attention_cached(q, k, v), ref)


def test_packed_chunk_attention_over_the_cache_equals_per_head_attention(dec: Decoder) -> None:
    g = torch.Generator().manual_seed(2)
    n, s, hd = 5, 12, TINY.head_dim
    q = torch.randn(n, TINY.heads, hd, generator=g)
    k = torch.randn(1, TINY.kv_heads, s, hd, generator=g)
    v = torch.randn(1, TINY.kv_heads, s, hd, generator=g)
    group = TINY.heads // TINY.kv_heads
    ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None], _expand(k, group), _expand(v, group))
    torch.testing.assert_close(dec.attention_cached(q, k, v), ref[0].transpose(0, 1))


def test_causal_self_attention_equals_per_head_causal_attention(dec: Decoder) -> None:
    g = torch.Generator().manual_seed(3)
    n, hd = 6, TINY.head_dim
    q = torch.randn(n, TINY.heads, hd, generator=g)
    k = torch.randn(n, TINY.kv_heads, hd, generator=g)
    v = torch.randn(n, TINY.kv_heads, hd, generator=g)
    group = TINY.heads // TINY.kv_heads
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], _expand(k.transpose(0, 1)[None], group),
        _expand(v.transpose(0, 1)[None], group), is_causal=True)
    torch.testing.assert_close(dec.attention_causal(q, k, v), ref[0].transpose(0, 1))
    # and it is causal: the first token's output ignores every later key
    k2 = k.clone()
    k2[1:] += 1.0
    torch.testing.assert_close(dec.attention_causal(q, k2, v)[0], dec.attention_causal(q, k, v)[0])


def test_tiny_measurement_writes_one_timed_line_per_step(tmp_path: Path) -> None:
    grid = [StepSpec("gemms", decodes=4), StepSpec("decode", decodes=2, decode_ctx=8),
            StepSpec("prefill", chunks=((4, 16),)),
            StepSpec("mixed", chunks=((4, 0), (2, 8)), decodes=3, decode_ctx=8)]
    out = tmp_path / "steps.jsonl"
    assert measure("tiny", out, "cpu", reps=2, grid=grid) == 4
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["header"] and lines[0]["shape"]["hidden"] == TINY.hidden
    assert [(p["kind"], p["decodes"]) for p in lines[1:]] == [("gemms", 4), ("decode", 2), ("prefill", 0),
                                                              ("mixed", 3)]
    assert all("error" not in p and p["s"] > 0 and len(p["runs"]) == 2 for p in lines[1:])


def test_a_step_returns_logits_for_each_chunk_end_and_decode(dec: Decoder) -> None:
    with torch.no_grad():
        logits = dec.step(StepSpec("mixed", chunks=((4, 0), (2, 8)), decodes=3, decode_ctx=8))()
    assert tuple(logits.shape) == (2 + 3, TINY.vocab)
    assert torch.isfinite(logits.float()).all()


def test_the_fused_decoder_computes_what_the_unfused_one_does() -> None:
    """The compiled elementwise functions are traced whole (fullgraph, dynamic shapes) and give the
    same logits; the cheap 'aot_eager' backend traces as Inductor does without generating code."""
    spec = StepSpec("mixed", chunks=((4, 0), (3, 8)), decodes=2, decode_ctx=8)
    outs = []
    for fuse in (False, True):
        d = Decoder(TINY, "cpu", seed=5, fuse=fuse, compile_backend="aot_eager")
        torch.manual_seed(0)
        with torch.no_grad():
            outs.append(d.step(spec)())
    torch.testing.assert_close(outs[1], outs[0])
