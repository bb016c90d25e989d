"""Tests of the calibrated cost model (fairway/cost_model.py), its fitter (bench/calibrate.py)
and the shipped profiles (docs/cost-model.md)."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.calibrate import DEFAULT_STEP_OVERHEAD_S, FitSettings, fit_calibration
from fairway.cost_model import CostModel, CostProfile, available_profiles, load_profile

REPO = Path(__file__).resolve().parents[2]
CALIBRATION = Path(__file__).resolve().parents[3] / "shared" / "calibration" / "h200_prefill.json"
needs_calibration = pytest.mark.skipif(
    not CALIBRATION.is_file(),
    reason=f"calibration data not found at {CALIBRATION} (the shared/ folder beside the repo)",
)

ALL = ["h200-14b", "h200-14b-eager", "h200-14b-graphs", "h200-llama3-8b", "h200-llama3-8b-eager",
       "h200-llama3-8b-graphs"]
DEFAULTS = ["h200-llama3-8b", "h200-14b"]
MODEL_OF = {"llama-3.1-8b": "h200-llama3-8b", "qwen2.5-14b-like": "h200-14b"}

# Stated fit bounds (docs/cost-model.md, "Fit error"): max relative error of the eager profile
# on calibration points above the launch floor, and of the default profile on the above-floor
# points with N > 512 (where neither the eager floor nor the eager low-occupancy term applies).
EAGER_ABOVE_FLOOR_MAX_REL_ERR = 0.16
DEFAULT_LARGE_N_MAX_REL_ERR = 0.15
EAGER_FULL_GRID_MEAN_REL_ERR = 0.12

GRID_N = [0, 1, 2, 15, 16, 31, 32, 100, 127, 128, 135, 136, 255, 512, 513, 2048, 8191, 8192, 32768]
GRID_C = [0, 1, 16, 512, 2048, 8192, 32768, 131072]


@pytest.fixture(scope="module")
def calibration() -> dict:
    if not CALIBRATION.is_file():
        pytest.skip(f"calibration data not found at {CALIBRATION}")
    return json.loads(CALIBRATION.read_text())


def test_available_profiles_lists_shipped_and_eager_variants() -> None:
    assert available_profiles() == ALL


@pytest.mark.parametrize("name", ALL)
def test_profiles_load(name: str) -> None:
    m = CostModel.from_profile(name)
    assert m.name == name
    assert m.profile.name == name
    assert isinstance(m.profile, CostProfile)


def test_default_profile_is_llama3_8b() -> None:
    assert CostModel.from_profile().name == "h200-llama3-8b"


def test_unknown_profile_error_text() -> None:
    with pytest.raises(ValueError) as exc:
        CostModel.from_profile("a100-nope")
    assert str(exc.value) == (
        "unknown cost profile 'a100-nope'; known: "
        "h200-14b, h200-14b-eager, h200-14b-graphs, h200-llama3-8b, h200-llama3-8b-eager, "
        "h200-llama3-8b-graphs"
    )


def test_path_like_names_are_unknown() -> None:
    with pytest.raises(ValueError, match="unknown cost profile '../h200-14b'"):
        load_profile("../h200-14b")


def test_profile_is_frozen_and_slotted() -> None:
    p = load_profile("h200-llama3-8b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.step_overhead_s = 1.0  # type: ignore[misc]
    assert not hasattr(p, "__dict__")


def test_profile_rejects_negative_terms() -> None:
    p = load_profile("h200-llama3-8b")
    with pytest.raises(ValueError, match="attn_s_per_token_sq"):
        dataclasses.replace(p, attn_s_per_token_sq=-1e-12)
    with pytest.raises(ValueError, match="num_layers"):
        dataclasses.replace(p, num_layers=0)


def test_default_and_eager_profiles_share_the_fitted_terms() -> None:
    g, e = load_profile("h200-llama3-8b"), load_profile("h200-llama3-8b-eager")
    for f in ("linear_s_per_token", "attn_s_per_token_ctx", "attn_s_per_token_sq"):
        assert getattr(g, f) == getattr(e, f)
    assert g.step_overhead_s == DEFAULT_STEP_OVERHEAD_S and g.launch_floor_s == 0.0
    assert e.step_overhead_s == 0.0 and 0.02 < e.launch_floor_s < 0.035
    # default reads the cached KV at bandwidth; eager's low-occupancy term is far slower
    assert g.ctx_read_s_per_token == g.kv_bytes_per_token / g.mem_bandwidth_bytes_per_s
    assert e.ctx_read_s_per_token > 10 * g.ctx_read_s_per_token


def test_kv_bytes_per_token() -> None:
    assert CostModel.from_profile("h200-llama3-8b").kv_bytes_per_token() == 131072
    assert CostModel.from_profile("h200-14b").kv_bytes_per_token() == 2 * 48 * 8 * 128 * 2


def test_default_kv_blocks_formula() -> None:
    m = CostModel.from_profile("h200-llama3-8b")
    p = m.profile
    assert p.weight_bytes == 8030261248 * 2
    free = int(0.9 * 139 * 2**30) - p.weight_bytes - p.activation_reserve_bytes
    assert m.default_kv_blocks() == free // (16 * 131072)
    assert 50_000 < m.default_kv_blocks() < 60_000  # ~0.9M tokens of KV on an H200
    assert m.default_kv_blocks(32) == free // (32 * 131072)
    assert m.default_kv_blocks(16, 0.5) < m.default_kv_blocks(16, 0.9)
    with pytest.raises(ValueError, match="no memory left"):
        m.default_kv_blocks(16, 0.1)
    with pytest.raises(ValueError):
        m.default_kv_blocks(0)
    with pytest.raises(ValueError):
        m.default_kv_blocks(16, 1.5)


@pytest.mark.parametrize("name", ALL)
def test_prefill_time_positive_and_monotone(name: str) -> None:
    m = CostModel.from_profile(name)
    t = np.array([[m.prefill_time(n, c) for c in GRID_C] for n in GRID_N])
    assert (t > 0).all()
    assert (np.diff(t, axis=0) >= 0).all(), "not monotone in new tokens"
    assert (np.diff(t, axis=1) >= 0).all(), "not monotone in cached tokens"
    assert t[-1, -1] > t[0, 0]


@pytest.mark.parametrize("name", ALL)
def test_prefill_time_array_equals_scalar_exactly(name: str) -> None:
    m = CostModel.from_profile(name)
    rng = np.random.default_rng(7)
    n = np.concatenate([np.repeat(GRID_N, len(GRID_C)), rng.integers(0, 40_000, 500)])
    c = np.concatenate([np.tile(GRID_C, len(GRID_N)), rng.integers(0, 200_000, 500)])
    arr = m.prefill_time_array(n, c)
    assert arr.dtype == np.float64 and arr.shape == n.shape
    scalar = np.array([m.prefill_time(int(a), int(b)) for a, b in zip(n, c, strict=True)])
    assert np.array_equal(arr, scalar)


@pytest.mark.parametrize("name", ALL)
def test_step_time_of_one_prefill_equals_prefill_time(name: str) -> None:
    m = CostModel.from_profile(name)
    for n in GRID_N[1:]:
        for c in GRID_C:
            assert m.step_time(n, n * c, n * n, 0, 0) == m.prefill_time(n, c)


def test_prefill_of_zero_new_tokens_costs_one_token() -> None:
    m = CostModel.from_profile()
    assert m.prefill_time(0, 4096) == m.prefill_time(1, 4096)
    with pytest.raises(ValueError):
        m.prefill_time(-1, 0)


def test_chunked_prefill_is_one_step_per_chunk_on_the_context_before_it() -> None:
    m = CostModel.from_profile()
    # 20,000 new tokens on 1,000 cached in 8,192-token steps: 8,192 on 1,000, 8,192 on 9,192,
    # then 3,616 on 17,384, each beside 4 decodes over 2,000 context tokens
    steps = [m.step_time(k, k * c, k * k, 4, 2000) for k, c in ((8192, 1000), (8192, 9192), (3616, 17384))]
    assert m.chunked_prefill_time(20000, 1000, 8192, 4, 2000) == sum(steps)
    assert m.chunked_prefill_time(20000, 1000, 8192) == sum(m.step_time(k, k * c, k * k, 0, 0) for k, c in (
        (8192, 1000), (8192, 9192), (3616, 17384)))
    # a prompt that fits one chunk, or no chunking: one pass, exactly
    for n, chunk in ((8192, 8192), (500, 8192), (20000, 0)):
        assert m.chunked_prefill_time(n, 300, chunk) == m.prefill_time(n, 300)
    assert m.chunked_prefill_time(0, 300, 8192) == m.prefill_time(1, 300)
    # the engine's many steps take longer than one pass of the whole prompt (the router's old price)
    assert m.chunked_prefill_time(191374, 0, 8192) / m.prefill_time(191374, 0) == pytest.approx(1.30, abs=0.02)
    with pytest.raises(ValueError):
        m.chunked_prefill_time(-1, 0, 8192)


def test_empty_step_costs_nothing() -> None:
    assert CostModel.from_profile().step_time(0, 0, 0, 0, 0) == 0.0


@pytest.mark.parametrize("name", DEFAULTS)
def test_decode_step_matches_bandwidth_formula(name: str) -> None:
    m = CostModel.from_profile(name)
    p = m.profile
    bw = p.mem_bandwidth_bytes_per_s
    kv = p.kv_bytes_per_token
    # below the linear layers' ridge point, decode streams weights + the KV of every context
    ridge = p.weight_read_s / p.linear_s_per_token
    assert 100 < ridge < 200
    for seqs, ctx in [(1, 0), (1, 1000), (8, 8 * 4096), (64, 64 * 8192), (100, 3_000_000)]:
        assert seqs < ridge
        expected = p.step_overhead_s + (p.streamed_weight_bytes + kv * ctx) / bw
        assert m.step_time(0, 0, 0, seqs, ctx) == pytest.approx(expected, rel=1e-12)
    # the 8B case by hand: 15.01 GB of streamed weights at 3.83 TB/s is 3.92 ms
    if name == "h200-llama3-8b":
        assert p.streamed_weight_bytes == (8030261248 - 128256 * 4096) * 2
        assert bw == pytest.approx(3829.3761988684914e9)
        assert p.weight_read_s == pytest.approx(3.920e-3, abs=1e-6)
    # above the ridge the linear layers are compute-bound
    big = 512
    assert m.step_time(0, 0, 0, big, 0) == pytest.approx(
        p.step_overhead_s + big * p.linear_s_per_token, rel=1e-12
    )


def test_mixed_step_shares_weights_and_overhead_but_adds_attention() -> None:
    m = CostModel.from_profile()
    pre = m.step_time(2048, 2048 * 4096, 2048 * 2048, 0, 0)
    dec = m.step_time(0, 0, 0, 64, 64 * 4096)
    mixed = m.step_time(2048, 2048 * 4096, 2048 * 2048, 64, 64 * 4096)
    assert max(pre, dec) < mixed < pre + dec
    # exact composition: the decode tokens join the linear layers, their KV read is added
    p = m.profile
    expected = pre + 64 * p.linear_s_per_token + p.ctx_read_s_per_token * 64 * 4096
    assert mixed == pytest.approx(expected, rel=1e-12)


def test_eager_profile_floor_hides_small_steps() -> None:
    m = CostModel.from_profile("h200-llama3-8b-eager")
    floor = m.profile.launch_floor_s
    assert m.prefill_time(32, 0) == floor
    assert m.prefill_time(512, 0) == floor
    assert m.prefill_time(8192, 0) > 5 * floor


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(0, 100_000),
    c=st.integers(0, 1_000_000),
    dn=st.integers(0, 5_000),
    dc=st.integers(0, 50_000),
    name=st.sampled_from(ALL),
)
def test_prefill_properties(n: int, c: int, dn: int, dc: int, name: str) -> None:
    m = CostModel.from_profile(name)
    t = m.prefill_time(n, c)
    assert t > 0 and math.isfinite(t)
    assert m.prefill_time(n + dn, c) >= t
    assert m.prefill_time(n, c + dc) >= t
    nn = max(n, 1)
    assert m.step_time(nn, nn * c, nn * nn, 0, 0) == t
    assert m.prefill_time_array(np.array([n]), np.array([c]))[0] == t


# ---- against the calibration ---------------------------------------------------------------


def _points(calibration: dict, key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    g = calibration["models"][key]["grid"]
    return (
        np.array([p["N"] for p in g]),
        np.array([p["C"] for p in g]),
        np.array([p["s"] for p in g]),
    )


def _above_floor(n: np.ndarray, c: np.ndarray, t: np.ndarray) -> np.ndarray:
    s = FitSettings()
    floor = np.median(t[(n <= s.floor_max_new) & (c <= s.floor_max_cached)])
    return t >= s.above_floor_ratio * floor


@needs_calibration
@pytest.mark.parametrize("key", sorted(MODEL_OF))
def test_fit_within_stated_error_of_calibration(calibration: dict, key: str) -> None:
    n, c, t = _points(calibration, key)
    above = _above_floor(n, c, t)
    assert 10 <= above.sum() <= 13

    eager = CostModel.from_profile(MODEL_OF[key] + "-eager").prefill_time_array(n, c)
    rel = np.abs(eager / t - 1)
    assert rel[above].max() <= EAGER_ABOVE_FLOOR_MAX_REL_ERR
    assert rel.mean() <= EAGER_FULL_GRID_MEAN_REL_ERR
    # better than the calibration file's own first fit (mean 16-18%, max 55-58%)
    given_fit = calibration["models"][key]["fit"]
    assert rel.mean() < given_fit["mean_rel_err"] and rel.max() < given_fit["max_rel_err"]

    large = above & (n > FitSettings().memory_bound_max_new)
    assert large.sum() == 8
    default = CostModel.from_profile(MODEL_OF[key]).prefill_time_array(n, c)
    assert np.abs(default[large] / t[large] - 1).max() <= DEFAULT_LARGE_N_MAX_REL_ERR


@needs_calibration
def test_calibration_throughput_facts_hold(calibration: dict) -> None:
    # the calibration's throughput: ~32k tokens/s at C=0 and ~9.5k tokens/s at C=32k for large
    # 8B prefills
    m = CostModel.from_profile("h200-llama3-8b-eager")
    assert 8192 / m.prefill_time(8192, 0) == pytest.approx(32_000, rel=0.15)
    assert 8192 / m.prefill_time(8192, 32768) == pytest.approx(9_500, rel=0.1)


@needs_calibration
def test_refit_reproduces_shipped_profiles(calibration: dict) -> None:
    fitted = fit_calibration(calibration)
    assert sorted(fitted) == sorted(DEFAULTS)
    for name, fp in fitted.items():
        shipped = json.loads((REPO / "fairway" / "profiles" / f"{name}.json").read_text())
        for field, value in fp.profile.to_dict().items():
            if isinstance(value, float):
                assert shipped["profile"][field] == pytest.approx(value, rel=1e-9, abs=0.0), field
            else:
                assert shipped["profile"][field] == value, field
        for field, value in fp.eager.items():
            assert shipped["eager"][field] == pytest.approx(value, rel=1e-9, abs=0.0), field


@needs_calibration
def test_fit_cli_writes_profiles_and_prints_error_table(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.calibrate",
            "fit",
            "--calibration",
            str(CALIBRATION),
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "eager profile, above the floor" in out
    assert "default profile, above floor, N > 512" in out
    for name in DEFAULTS:
        new = json.loads((tmp_path / f"{name}.json").read_text())
        shipped = json.loads((REPO / "fairway" / "profiles" / f"{name}.json").read_text())
        assert new["source"] == shipped["source"]
        for field, value in shipped["profile"].items():
            if isinstance(value, float):
                assert new["profile"][field] == pytest.approx(value, rel=1e-9, abs=0.0), field
            else:
                assert new["profile"][field] == value, field
