"""The ``vllm`` engine: the hash-space cache estimate (always), and the adapter on real vLLM (CPU).

The estimate tests need nothing but this repo. The vLLM tests run only where ``vllm`` imports and
the tiny model exists (``scripts/vllm_cpu_setup.sh`` makes both), i.e. from ``.venv-vllm``:

    .venv-vllm/bin/python -m pytest tests/replicas/engines/test_vllm_engine.py

They start one engine for the module (~30 s on 2 cores) and run one scenario against it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from fairway.clock import MonotonicClock
from fairway.cost_model import CostModel
from fairway.hashing import block_hashes
from fairway.policies import make_policy
from fairway.protocol import EngineFailed, GenerateCall, RequestTooLarge, UnsupportedParameter
from replicas.engines import EngineError, engine_class, make_engine
from replicas.engines.cache_estimate import CacheEstimate
from replicas.engines.kv_events import KvEventMirror
from replicas.gate import AdmissionGate

ROOT = Path(__file__).resolve().parents[3]
TINY_MODEL = ROOT / "deploy" / "models" / "fairway-tiny-llama"


class Events:
    def __init__(self) -> None:
        self.stored: list[int] = []
        self.removed: list[int] = []

    def attach(self, est: CacheEstimate) -> Events:
        est.set_listener(self.stored.extend, self.removed.extend)
        return self


def assert_prefix_closed(est: CacheEstimate) -> None:
    """Every held block's parent is held and more recently touched (so the oldest is a leaf)."""
    pos = {h: i for i, h in enumerate(est.blocks())}
    for h, parent in est._lru.items():
        if parent is not None:
            assert parent in pos, f"block {h} held without its parent {parent}"
            assert pos[parent] > pos[h], f"parent {parent} older than its child {h}"


# -- the estimate, without vLLM ----------------------------------------------------------------


def test_lru_eviction_order_tail_first():
    est = CacheEstimate(capacity_blocks=6, block_size=16)
    ev = Events().attach(est)
    est.observe([1, 2, 3, 4], 64, 0)
    assert est.blocks() == [4, 3, 2, 1]  # the head is the most recent
    assert ev.stored == [1, 2, 3, 4] and ev.removed == []
    upd = est.observe([1, 2, 5, 6], 64, 32)  # shares 2 blocks, and the engine said so
    assert upd.predicted_blocks == 2 and upd.reported_blocks == 2
    assert est.blocks() == [4, 3, 6, 5, 2, 1]
    assert upd.stored == [5, 6] and upd.removed == []
    upd = est.observe([7, 8], 32, 0)  # 8 blocks > 6: the two oldest age out, tail first
    assert est.blocks() == [6, 5, 2, 1, 8, 7]
    assert upd.removed == [4, 3] and upd.stored == [7, 8]
    assert ev.removed == [4, 3] and ev.stored == [1, 2, 3, 4, 5, 6, 7, 8]
    est.touch([1, 2, 5])  # a request finished: its held prefix becomes the most recent
    assert est.blocks() == [6, 8, 7, 5, 2, 1]
    upd = est.observe([9], 16, 0)
    assert upd.removed == [6] and est.blocks() == [8, 7, 5, 2, 1, 9]
    assert_prefix_closed(est)


def test_whole_engine_blocks_only():
    est = CacheEstimate(capacity_blocks=100, block_size=16, engine_block_size=128)
    assert est.stored_blocks(300) == 16 and est.max_hit_blocks(300) == 16
    assert est.stored_blocks(256) == 16 and est.max_hit_blocks(256) == 8  # the last token is computed
    assert est.stored_blocks(127) == 0 and est.max_hit_blocks(129) == 8
    hashes = list(range(100, 118))  # 300 tokens -> 18 of our blocks
    upd = est.observe(hashes, 300, 0)
    assert upd.stored == hashes[:16] and len(est) == 16
    assert est.cached_prefix_blocks(hashes) == 16
    # An identical 300-token prompt: the prediction is capped like the engine's hit.
    assert est.predicted_hit_blocks(hashes, 300) == 16
    assert est.predicted_hit_blocks(hashes[:16], 256) == 8


def test_report_shorter_than_predicted_drops_the_stale_subtree():
    est = CacheEstimate(capacity_blocks=100, block_size=16)
    ev = Events().attach(est)
    est.observe([1, 2, 3, 4], 64, 0)
    est.observe([1, 2, 3, 9], 64, 48)
    assert est.blocks() == [4, 9, 3, 2, 1]
    # The engine hit only 1 block of [1, 2, 3, 4, 10]: it had evicted block 2, hence (tail-first
    # eviction) all below it. The other branch (9) goes; this request's own blocks were just
    # recomputed and stay; 10 is new.
    upd = est.observe([1, 2, 3, 4, 10], 80, 16)
    assert upd.predicted_blocks == 4 and upd.reported_blocks == 1
    assert upd.removed == [9] and upd.stored == [10]
    assert est.blocks() == [10, 4, 3, 2, 1]
    assert ev.removed == [9]
    assert_prefix_closed(est)


def test_stale_report_on_a_deep_tree_and_unknown_reports():
    est = CacheEstimate(capacity_blocks=100, block_size=16)
    est.observe([1, 2, 3], 48, 0)
    est.observe([1, 2, 4, 5], 64, 32)
    est.observe([1, 6], 32, 16)
    # Hit 0 on a prompt [1, 7]: block 1 was gone, so everything was; only this prompt remains.
    upd = est.observe([1, 7], 32, 0)
    assert sorted(upd.removed) == [2, 3, 4, 5, 6] and upd.stored == [7]
    assert est.blocks() == [7, 1]
    upd = est.observe([1, 7, 8], 48, None)  # no report: store, never drop
    assert upd.removed == [] and upd.stored == [8] and upd.reported_blocks is None
    assert est.clear() == [8, 7, 1] and len(est) == 0


def test_chain_longer_than_capacity_keeps_its_head_and_nets_events():
    est = CacheEstimate(capacity_blocks=3, block_size=16)
    ev = Events().attach(est)
    upd = est.observe([1, 2, 3, 4, 5], 80, 0)
    assert est.blocks() == [3, 2, 1]
    assert upd.stored == [1, 2, 3] and upd.removed == []  # 4, 5 came and went in one call
    assert ev.stored == [1, 2, 3] and ev.removed == []
    assert est.set_capacity(2) == [3] and ev.removed == [3]


def test_random_traffic_keeps_invariants():
    rng = random.Random(7)
    est = CacheEstimate(capacity_blocks=40, block_size=16, engine_block_size=32)
    docs = [[rng.randrange(5, 4096) for _ in range(rng.randrange(16, 200))] for _ in range(6)]
    for _ in range(300):
        toks = rng.choice(docs)[: rng.randrange(16, 200)] + [rng.randrange(5, 4096) for _ in range(rng.randrange(40))]
        hs = block_hashes(toks)
        pred = est.predicted_hit_blocks(hs, len(toks))
        # reports: unknown, as predicted, or one engine block short (a stale estimate)
        report = rng.choice([None, pred * 16, max(0, pred * 16 - 32)])
        est.observe(hs, len(toks), report)
        assert len(est) <= est.capacity_blocks
        assert_prefix_closed(est)
        # its whole engine blocks are held now (maybe more, from a longer prompt seen before)
        assert est.cached_prefix_blocks(hs) >= min(est.stored_blocks(len(toks)), len(hs))


def test_events_replay_equals_estimate():
    rng = random.Random(3)
    est = CacheEstimate(capacity_blocks=25, block_size=16, engine_block_size=64)
    mirror: set[int] = set()
    est.set_listener(mirror.update, mirror.difference_update)
    base = [rng.randrange(5, 4096) for _ in range(400)]
    for _ in range(200):
        toks = base[: rng.randrange(16, 400)] + [rng.randrange(5, 4096) for _ in range(rng.randrange(0, 100))]
        hs = block_hashes(toks)
        hit = est.predicted_hit_blocks(hs, len(toks))
        est.observe(hs, len(toks), 64 * (hit * 16 // 64 // rng.choice([1, 1, 2])))
        assert mirror == set(est.blocks())


# -- the KV-event mirror, without vLLM ----------------------------------------------------------


@dataclass
class BlockStored:  # vLLM's event shapes (the mirror reads them by class name and field)
    block_hashes: list
    parent_block_hash: object
    token_ids: list
    block_size: int
    extra_keys: list | None = None
    lora_name: str | None = None
    medium: str | None = "GPU"
    group_idx: int | None = 0


@dataclass
class BlockRemoved:
    block_hashes: list
    medium: str | None = "GPU"
    group_idx: int | None = 0


class AllBlocksCleared:
    pass


def _stored(vhs: list, parent, toks: list[int], vbs: int, salt: str | None = None) -> BlockStored:
    return BlockStored(vhs, parent, toks, vbs, extra_keys=[(salt,)] + [None] * (len(vhs) - 1) if salt else None)


def test_kv_event_mirror_rebuilds_our_hashes():
    rng = random.Random(5)
    toks = [rng.randrange(5, 4096) for _ in range(256)]
    m = KvEventMirror(block_size=16, engine_block_size=64)
    mirror: set[int] = set()
    m.set_listener(mirror.update, mirror.difference_update)
    ours = block_hashes(toks)
    # two vLLM blocks of 64 tokens, then two more chained to the second: our 16 hashes, exactly
    st, rm = m.apply([_stored(["v0", "v1"], None, toks[:128], 64)])
    assert st == ours[:8] and rm == [] and m.cached_prefix_blocks(ours) == 8
    m.apply([_stored(["v2", "v3"], "v1", toks[128:], 64)])
    assert m.blocks() == ours and mirror == set(ours) and m.engine_blocks == 4
    assert m.predicted_hit_blocks(ours, 256) == 12  # the last token is always computed
    # re-announced (vLLM reports reused blocks as stored again): no double count
    assert m.apply([_stored(["v0"], None, toks[:64], 64)]) == ([], [])
    # a removed vLLM block removes the hashes it completed; its children's stay until removed
    st, rm = m.apply([BlockRemoved(["v1"])])
    assert rm == ours[4:8] and m.cached_prefix_blocks(ours) == 4
    # a tenant's salt (extra keys of the first block) gives the salted chain
    m.apply([_stored(["s0"], None, toks[:64], 64, salt="tenant-x")])
    assert m.cached_prefix_blocks(block_hashes(toks, salt="tenant-x")) == 4
    # unknown parent: skipped and counted; other media and KV groups: ignored
    m.apply([_stored(["w"], "nope", toks[:64], 64), BlockRemoved(["v0"], medium="CPU"),
             BlockRemoved(["v0"], group_idx=1)])
    assert m.orphans == 1 and m.cached_prefix_blocks(ours) == 4
    before = set(m.blocks())
    assert before == set(ours[:4] + ours[8:] + block_hashes(toks, salt="tenant-x")[:4]) == mirror
    st, rm = m.apply([AllBlocksCleared()])
    assert st == [] and set(rm) == before and len(m) == 0 and mirror == set()


def test_kv_event_mirror_unaligned_blocks_and_net_events():
    rng = random.Random(6)
    toks = [rng.randrange(5, 4096) for _ in range(120)]
    m = KvEventMirror(block_size=16, engine_block_size=24)  # our blocks straddle vLLM's
    m.apply([_stored([f"v{i}" for i in range(5)], None, toks, 24)])
    assert m.blocks() == block_hashes(toks)  # 7 of ours in 5 x 24 tokens
    # stored and removed in one batch: no event either way
    m2 = KvEventMirror(block_size=16, engine_block_size=32)
    seen: list = []
    m2.set_listener(lambda h: seen.append(("+", list(h))), lambda h: seen.append(("-", list(h))))
    assert m2.apply([_stored(["a"], None, toks[:32], 32), BlockRemoved(["a"])]) == ([], [])
    assert seen == [] and len(m2) == 0


def test_kv_event_mirror_follows_cpu_copies_and_reports_host_only_hashes():
    """vLLM's CPU offloading (``medium="CPU"``, the same vLLM hash as the GPU block): a block
    evicted from the GPU with a CPU copy stays cached and becomes host-only (a tier event, no KV
    removal); stored on the GPU again it is not; its CPU copy removed, it leaves the cache."""
    rng = random.Random(7)
    toks = [rng.randrange(5, 4096) for _ in range(128)]
    ours = block_hashes(toks)  # 8 of ours in 4 vLLM blocks of 32 tokens: v<i> completes ours[2i:2i+2]
    m = KvEventMirror(block_size=16, engine_block_size=32)
    seen: list = []  # the listeners' calls in order: KV events, then the batch's tier events
    m.set_listener(lambda h: seen.append(("+", list(h))), lambda h: seen.append(("-", list(h))))
    m.set_tier_listener(lambda ev: seen.append(("tier", list(ev))))

    def cpu(vh, parent, lo=None, hi=None, **kw):
        return BlockStored([vh], parent, toks[lo:hi] if lo is not None else [], 32, medium="CPU", **kw)

    def batch(*events):
        seen.clear()
        m.apply(list(events))
        return list(seen)

    assert batch(_stored(["v0", "v1", "v2", "v3"], None, toks, 32)) == [("+", ours)]
    assert batch(cpu("v2", "v1", 64, 96), cpu("v3", "v2", 96, 128)) == []  # offloaded: still on the GPU
    assert m.host_only() == []
    # evicted from the GPU, kept on CPU: host-only, still cached in our hashes
    assert batch(BlockRemoved(["v3", "v2"])) == [("tier", [(True, ours[i]) for i in (6, 7, 4, 5)])]
    assert sorted(m.host_only()) == sorted(ours[4:]) and m.cached_prefix_blocks(ours) == 8
    # v2 reloaded onto the GPU (vLLM stores it there again): not host-only
    assert batch(_stored(["v2"], "v1", toks[64:96], 32)) == [("tier", [(False, ours[4]), (False, ours[5])])]
    # v3's CPU copy dropped: it leaves the cache (KV removal first, then the tier event)
    assert batch(BlockRemoved(["v3"], medium="CPU")) == [("-", ours[6:8]), ("tier", [(False, ours[6]),
                                                                                   (False, ours[7])])]
    assert batch(BlockRemoved(["v2"], medium="CPU")) == []  # v2 is on the GPU too: nothing changes
    # the GPU copy evicted before its CPU copy is reported, in one batch (the connector's events
    # follow the scheduler's): netted, no KV event, host-only; the CPU event needs no tokens
    assert batch(BlockRemoved(["v1"]), cpu("v1", "v0")) == [("tier", [(True, ours[2]), (True, ours[3])])]
    assert m.cached_prefix_blocks(ours) == 6 and sorted(m.host_only()) == sorted(ours[2:4])
    # a CPU copy of a block the mirror no longer has: rebuilt from its tokens, else an orphan
    assert batch(cpu("gone", "v0")) == [] and m.orphans == 1
    # vLLM's offloading placeholder (block_size 0, no tokens): known blocks only, never a bogus chain
    assert batch(BlockStored(["gone"], None, [], 0, medium="CPU")) == [] and m.orphans == 2
    assert "gone" not in m._blocks
    # another vLLM block completing the same hashes as v2 (other extra keys), CPU only: v2's
    # GPU copy keeps them on the GPU; v2 evicted (no CPU copy), they become host-only, not removed
    assert batch(cpu("v2b", "v1", 64, 96)) == []
    assert batch(BlockRemoved(["v2"])) == [("tier", [(True, ours[4]), (True, ours[5])])]
    assert sorted(m.host_only()) == sorted(ours[2:6])
    # other media (a disk tier) and KV groups are ignored
    assert batch(BlockRemoved(["v1"], medium="STORAGE"), BlockRemoved(["v1"], medium="CPU", group_idx=1)) == []
    # a cleared cache: every hash removed, the host-only ones no longer host-only
    out = batch(AllBlocksCleared())
    assert out[0][0] == "-" and sorted(out[0][1]) == sorted(ours[:6])
    assert out[1][0] == "tier" and sorted(out[1][1]) == sorted((False, h) for h in ours[2:6])
    assert len(m) == 0 and m.host_only() == [] and m.engine_blocks == 0


def test_kv_event_mirror_reads_vllms_own_cpu_events_through_msgpack():
    """The same on vLLM's event classes, decoded as the subscriber decodes them (needs vLLM)."""
    kv = pytest.importorskip("vllm.distributed.kv_events")
    import msgspec

    toks = list(range(200, 264))
    ours = block_hashes(toks)

    def st(vhs, parent, t, medium="GPU"):
        return kv.BlockStored(block_hashes=vhs, parent_block_hash=parent, token_ids=t, block_size=16, lora_id=None,
                              medium=medium, lora_name=None)

    def wire(*events):
        return msgspec.msgpack.Decoder(type=kv.KVEventBatch).decode(
            msgspec.msgpack.encode(kv.KVEventBatch(ts=0.0, events=list(events)))).events

    m = KvEventMirror(16, 16)
    tier: list = []
    m.set_tier_listener(tier.extend)
    assert m.apply(wire(st([1, 2, 3, 4], None, toks), st([3], 2, toks[32:48], kv.MEDIUM_CPU),
                        st([4], 3, toks[48:], kv.MEDIUM_CPU), kv.BlockRemoved(block_hashes=[4, 3], medium="GPU"))) \
        == (ours, [])
    assert tier == [(True, ours[3]), (True, ours[2])] and sorted(m.host_only()) == sorted(ours[2:])
    tier.clear()
    assert m.apply(wire(kv.BlockRemoved(block_hashes=[4], medium=kv.MEDIUM_CPU))) == ([], [ours[3]])
    assert tier == [(False, ours[3])] and len(m) == 3


def test_kv_event_mirror_without_cpu_events_reports_no_tier_event():
    rng = random.Random(8)
    toks = [rng.randrange(5, 4096) for _ in range(128)]
    m = KvEventMirror(block_size=16, engine_block_size=32)
    tier: list = []
    m.set_tier_listener(tier.extend)
    m.apply([_stored(["a", "b"], None, toks[:64], 32), BlockRemoved(["b"]), _stored(["c"], "a", toks[64:96], 32)])
    m.apply([BlockRemoved(["a", "c"]), AllBlocksCleared()])
    assert tier == [] and m.host_only() == [] and not m._offload and m._stash == {}


# -- the registry and the adapter's own checks, without vLLM -----------------------------------


def test_registry_resolves_lazily():
    had_vllm = "vllm" in sys.modules
    cls = engine_class("vllm")
    assert cls.__name__ == "VllmEngine"
    assert ("vllm" in sys.modules) == had_vllm  # resolving the class imports no vLLM
    eng = make_engine("vllm", model="some/model", max_model_len=1024)
    assert eng.block_size == 16 and eng.max_model_len == 1024
    with pytest.raises(EngineError, match="unknown engine"):
        make_engine("nope")
    with pytest.raises(EngineError, match="bad options"):
        make_engine("vllm", model="m", bogus=1)
    with pytest.raises(EngineError, match="cannot import"):
        engine_class("replicas.engines.nothing_here:Engine")


def test_a_model_path_that_is_not_there_is_refused_where_the_config_is_checked(tmp_path):
    """A model or tokenizer that is neither on disk nor shaped like a hub id (namespace/name) is
    a wrong path: refused when the engine is built (the config's edge), not after vLLM starts."""
    for name in ("meta-llama/Llama-3.1-8B-Instruct", "gpt2", str(tmp_path)):
        make_engine("vllm", model=name, tokenizer=name)
    for bad in ("deploy/models/nope", str(tmp_path / "missing"), "./nope"):
        with pytest.raises(ValueError, match="is not a local path"):
            make_engine("vllm", model=bad)
        with pytest.raises(ValueError, match="tokenizer .* is not a local path"):
            make_engine("vllm", model="m", tokenizer=bad)


def test_engine_args_and_checks_before_start():
    eng = make_engine(
        "vllm", model="m", tokenizer="t", max_model_len=1000, kv_cache_space_gb=0.5, engine_args={"max_num_seqs": 3}
    )
    cpu = eng.build_engine_args(is_cpu=True)
    assert cpu["enable_prefix_caching"] is True and cpu["kv_cache_memory_bytes"] == 1 << 29
    assert cpu["max_num_seqs"] == 3 and cpu["tokenizer"] == "t" and "gpu_memory_utilization" not in cpu
    gpu = make_engine("vllm", model="m", gpu_memory_utilization=0.8).build_engine_args(is_cpu=False)
    # vLLM's long-prefill cap passes through, and the gate's first-step hold reads it here
    capped = make_engine("vllm", model="m", engine_args={"long_prefill_token_threshold": 512})
    assert capped.long_prefill_token_threshold == 512 and eng.long_prefill_token_threshold == 0
    assert capped.build_engine_args(is_cpu=False)["long_prefill_token_threshold"] == 512
    assert gpu["gpu_memory_utilization"] == 0.8 and "kv_cache_memory_bytes" not in gpu
    assert "kv_events_config" not in cpu
    ev = make_engine("vllm", model="m", kv_events=True).build_engine_args(is_cpu=True)["kv_events_config"]
    assert ev["enable_kv_cache_events"] and ev["endpoint"].startswith("ipc://") and ev["replay_endpoint"]
    call = GenerateCall("r", [5] * 995, (), 10, time.time())
    eng._check(call)  # its length is the gate's check; its KV need is the engine's
    eng._kv_total = 62  # 1005 tokens need 63 blocks of 16
    with pytest.raises(RequestTooLarge, match="more KV blocks"):
        eng._check(call)

    async def gen():
        async for _ in eng.generate(call):
            pass

    with pytest.raises(EngineFailed, match="not started"):
        asyncio.run(gen())
    assert eng.cached_prefix_blocks([1, 2]) == 0 and eng.can_fit(10, []) is False
    # the host tier: nothing before start; a mirror set up later gets the tier listener
    tier: list = []
    ev_eng = make_engine("vllm", model="m", kv_events=True, engine_args={"kv_offloading_size": 4})
    ev_eng.set_tier_listener(tier.extend)
    assert ev_eng.host_only_hashes() == [] and eng.host_only_hashes() == []
    assert ev_eng.build_engine_args(is_cpu=False)["kv_offloading_size"] == 4  # passed to vLLM as is
    ev_eng._estimate = KvEventMirror(16, 16)  # what start() builds with kv_events
    ev_eng.set_tier_listener(tier.extend)  # forwarded to the mirror
    toks = list(range(100, 132))
    ev_eng._estimate.apply([_stored(["a", "b"], None, toks, 16), BlockStored(["b"], "a", toks[16:], 16, medium="CPU"),
                            BlockRemoved(["b"])])
    assert tier == [(True, block_hashes(toks)[1])] and ev_eng.host_only_hashes() == block_hashes(toks)[1:]


def test_the_calls_sampling_parameters_reach_vllms_sampling_params():
    """seed, top_p, the penalties, logit_bias, allowed_token_ids and bad_words go to vLLM's
    SamplingParams as the call has them (vLLM honours each natively); a value SamplingParams
    rejects is a 400 (UnsupportedParameter). vLLM itself is faked: its SamplingParams records its arguments."""
    seen: list[dict] = []

    class Params:
        def __init__(self, **kw):
            if kw.get("top_p", 1.0) <= 0:
                raise ValueError("top_p must be in (0, 1]")
            seen.append(kw)

    @dataclass
    class Out:
        token_ids: list
        finish_reason: str = "length"

    @dataclass
    class ReqOut:
        outputs: list
        finished: bool = True
        num_cached_tokens: int = 0

    class LLM:
        def generate(self, prompt, params, rid):
            async def stream():
                yield ReqOut([Out([7, 8])])
            return stream()

    eng = make_engine("vllm", model="m", max_model_len=1024)
    eng._llm, eng._estimate = LLM(), CacheEstimate(1000, 16, 16)
    eng._sampling, eng._client_errors, eng._kv_total = (Params, None), (LookupError,), 1000
    call = GenerateCall("r", [5] * 40, tuple(block_hashes([5] * 40)), 2, time.time(), seed=11, top_p=0.9,
                        top_k=4, min_p=0.05, frequency_penalty=0.5, presence_penalty=-0.5, repetition_penalty=1.1,
                        logit_bias={42: 3.0}, min_tokens=2, stop_token_ids=(9, 10), allowed_token_ids=(7, 8),
                        bad_words=("no",))

    async def run(c: GenerateCall) -> list[int]:
        return [t async for out in eng.generate(c) for t in out.token_ids]

    assert asyncio.run(run(call)) == [7, 8]
    want = {"seed": 11, "top_p": 0.9, "top_k": 4, "min_p": 0.05,
            "frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 1.1,
            "logit_bias": {42: 3.0}, "min_tokens": 2, "stop_token_ids": [9, 10], "allowed_token_ids": [7, 8],
            "bad_words": ["no"]}
    assert {k: seen[-1][k] for k in want} == want
    call.top_p = 0.0
    with pytest.raises(UnsupportedParameter, match="vLLM refused the sampling parameters: top_p"):
        asyncio.run(run(call))
    # an output constraint (response_format) goes as vLLM's StructuredOutputsParams
    call.top_p, call.structured_output = 1.0, {"json": {"type": "object"}}
    with pytest.raises(UnsupportedParameter, match="no structured outputs") as refused:
        asyncio.run(run(call))  # a vLLM without them: refused by name
    assert refused.value.param == "response_format"
    call.structured_output_param = "tool_choice"  # a forced tool call's JSON: its refusal names tool_choice
    with pytest.raises(UnsupportedParameter, match="no structured outputs") as refused:
        asyncio.run(run(call))
    assert refused.value.param == "tool_choice"
    eng._structured = lambda **kw: ("structured", kw)
    assert asyncio.run(run(call)) == [7, 8]
    assert seen[-1]["structured_outputs"] == ("structured", {"json": {"type": "object"}})


def test_vllms_per_step_logprobs_become_each_tokens_logprob_and_its_top_alternatives_by_rank():
    """vLLM lists the sampled token and the top k, each with its rank; the entry is the sampled
    token's log probability and the k most likely by rank (the sampled one among them only when
    it ranks there); -inf is floored, and a token vLLM gave nothing for is listed at the floor."""
    from replicas.engines.vllm_engine import MIN_LOGPROB, step_logprobs, token_logprob

    @dataclass
    class Lp:
        logprob: float
        rank: int | None

    step = {7: Lp(-2.5, 3), 4: Lp(-0.1, 1), 9: Lp(-1.0, 2)}
    assert token_logprob(7, step, 2) == (-2.5, ((4, -0.1), (9, -1.0)))
    assert token_logprob(4, step, 0) == (-0.1, ())
    assert token_logprob(5, {5: Lp(float("-inf"), 1)}, 1) == (MIN_LOGPROB, ((5, MIN_LOGPROB),))
    assert step_logprobs([7, 4, 8], [step, None], 1) == [(-2.5, ((4, -0.1),)), (MIN_LOGPROB, ()), (MIN_LOGPROB, ())]


def test_with_tiers_each_call_goes_with_its_class_tier_as_vllms_priority():
    """The strictest configured tier is vLLM's priority 0 (the scheduler's strict tier), the others
    count up from it; a call without a class is the default class's. vLLM itself is faked."""
    from fairway.policies.classes import ClassesConfig

    seen: list = []

    class LLM:
        def generate(self, prompt, params, rid, priority=None):
            seen.append(priority)

            async def stream():
                yield type("R", (), {"outputs": [], "finished": True, "num_cached_tokens": 0})()
            return stream()

    tiers = ClassesConfig.parse("chat:tier=1:objective=1,agents:tier=1:objective=2,bulk:tier=3:objective=30")
    eng = make_engine("vllm", model="m", max_model_len=1024, tiers=tiers)
    assert eng.build_engine_args(is_cpu=True)["scheduling_policy"] == "priority"
    assert "scheduling_policy" not in make_engine("vllm", model="m").build_engine_args(is_cpu=True)
    eng._llm, eng._estimate = LLM(), CacheEstimate(1000, 16, 16)
    eng._sampling, eng._client_errors, eng._kv_total = (lambda **kw: kw, None), (LookupError,), 1000

    async def run(klass: str) -> None:
        c = GenerateCall("r", [5] * 40, tuple(block_hashes([5] * 40)), 2, time.time(), priority_class=klass)
        async for _ in eng.generate(c):
            pass

    for klass in ("chat", "agents", "bulk", ""):
        asyncio.run(run(klass))
    assert seen == [0, 0, 2, 2]  # "" is the default class, the last configured
    with pytest.raises(ValueError, match="unknown class 'gold'; valid: chat, agents, bulk"):
        asyncio.run(run("gold"))
    with pytest.raises(ValueError, match="tiers needs at least one request class"):
        make_engine("vllm", model="m", tiers=ClassesConfig.parse(""))


# -- the adapter on vLLM (CPU) -----------------------------------------------------------------


def _vllm_skip_reason() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed here (run scripts/vllm_cpu_setup.sh, then use .venv-vllm/bin/python)"
    if not (TINY_MODEL / "config.json").exists():
        return f"tiny model missing: {TINY_MODEL} (run scripts/vllm_cpu_setup.sh)"
    return None


needs_vllm = pytest.mark.skipif(_vllm_skip_reason() is not None, reason=str(_vllm_skip_reason()))


@needs_vllm
def test_an_unknown_vllm_engine_argument_fails_where_the_config_is_checked():
    from replicas.engines import EngineError, validated_engine

    with pytest.raises(EngineError, match="'kv_offloading_sise' is not a vLLM engine argument .*'kv_offloading_size'"):
        validated_engine("vllm", {"model": "m", "engine_args": {"kv_offloading_sise": 4}})
    validated_engine("vllm", {"model": "m", "engine_args": {"kv_offloading_size": 4}})  # a real one passes


MAX_MODEL_LEN = 4096
PREFIX = 2100  # shared tokens: 16 whole CPU blocks (2,048 tokens) can hit


def _vllm_or_skip() -> None:
    """Offline, and vLLM importable here, or the scenario is skipped (``needs_vllm`` only finds it installed)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: cannot run here
        pytest.skip(f"vllm does not import: {e}")


def _call(rid: str, ids: list[int], max_tokens: int, salt: str | None = None) -> GenerateCall:
    return GenerateCall(rid, ids, tuple(block_hashes(ids, salt=salt)), max_tokens, time.time(), cache_salt=salt)


async def _collect(eng, call: GenerateCall) -> dict:
    t0 = time.perf_counter()
    outs = []
    ttft = None
    async for out in eng.generate(call):
        if ttft is None:
            ttft = time.perf_counter() - t0
        outs.append(out)
    return {"outs": outs, "ttft": ttft, "tokens": sum(len(o.token_ids) for o in outs), "last": outs[-1]}


async def _scenario() -> dict:
    _vllm_or_skip()
    res: dict = {}
    eng = make_engine(
        "vllm",
        model=str(TINY_MODEL),
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        enforce_eager=True,
        kv_cache_space_gb=0.25,
        dtype="bfloat16",
    )
    events = {"stored": [], "removed": []}
    eng.set_cache_listener(events["stored"].extend, events["removed"].extend)
    t0 = time.perf_counter()
    await eng.start()
    res["startup_s"] = time.perf_counter() - t0
    try:
        res["idle_stats"] = eng.stats()
        rng = random.Random(0)
        prefix = [rng.randrange(5, 4096) for _ in range(PREFIX)]
        a_ids = prefix + [rng.randrange(5, 4096) for _ in range(50)]
        b_ids = prefix + [rng.randrange(5, 4096) for _ in range(70)]
        res["a"] = await _collect(eng, _call("a", a_ids, 12))
        res["after_a_blocks"] = eng.cached_prefix_blocks(block_hashes(a_ids))
        res["b_predicted"] = eng.cache_estimate.predicted_hit_blocks(block_hashes(b_ids), len(b_ids))
        res["b"] = await _collect(eng, _call("b", b_ids, 7))
        res["b_hashes_held"] = eng.cached_prefix_blocks(block_hashes(b_ids))
        res["events"] = {k: list(v) for k, v in events.items()}
        # Another tenant (cache_salt) with the same prefix: no hit, in vLLM and in the estimate.
        s_ids = prefix + [rng.randrange(5, 4096) for _ in range(30)]
        res["salted"] = [(await _collect(eng, _call(f"s{i}", s_ids, 2, "tenant-x")))["last"] for i in range(2)]
        res["feedback"] = list(eng.feedback)
        res["vllm_block_size"] = eng.vllm_block_size

        # Stats while a request streams, then cancellation aborts it inside vLLM.
        c_ids = [rng.randrange(5, 4096) for _ in range(300)]
        gen = eng.generate(_call("c", c_ids, 2000))
        first = await gen.__anext__()
        res["mid_stats"] = eng.stats()
        res["mid_source"] = eng.kv_stats_source
        res["first_chunk"] = first
        await gen.aclose()
        for _ in range(50):
            await asyncio.sleep(0.05)
            if eng._llm.get_num_unfinished_requests() == 0:
                break
        res["after_cancel_unfinished"] = eng._llm.get_num_unfinished_requests()
        res["aborted"] = eng.aborted
        res["after_cancel_stats"] = eng.stats()

        # Too large: vLLM's own 4xx (a token id out of the vocab) becomes RequestTooLarge.
        try:
            await _collect(eng, _call("f", [7, 10**6, 8], 2))
            res["bad_token"] = None
        except Exception as e:  # noqa: BLE001 - the test inspects the type
            res["bad_token"] = e
        res["ok_after_errors"] = await _collect(eng, _call("g", [9] * 40, 3))
        # Log probabilities, greedy: the sampled token is each step's most likely
        call = _call("lp", [rng.randrange(5, 4096) for _ in range(30)], 5)
        call.logprobs = 2
        res["logprobs"] = await _collect(eng, call)
        # The prompt's log probabilities (echo with logprobs): vLLM computes the whole prompt, so
        # its report of 0 cached tokens must not make the estimate forget the cached prefix
        p_ids = prefix + [rng.randrange(5, 4096) for _ in range(20)]
        before = eng.cache_estimate.predicted_hit_blocks(block_hashes(p_ids), len(p_ids))
        call = _call("plp", p_ids, 1)
        call.logprobs, call.prompt_logprobs = 1, 1
        res["prompt_logprobs"] = {"out": await _collect(eng, call), "n": len(p_ids), "ids": p_ids, "before": before,
                                  "after": eng.cache_estimate.predicted_hit_blocks(block_hashes(p_ids), len(p_ids))}
        # Output constrained to a JSON schema (OpenAI's response_format, vLLM's structured outputs):
        # the tiny model's random weights still answer only what the schema allows, then stop
        # and vLLM's own structured_outputs kinds, which the ingress passes as they come
        for name, constraint in (("json", {"json": {"type": "string", "enum": ["yes", "no"]}}),
                                 ("bad_schema", {"json": {"type": "bogus"}}),
                                 ("choice", {"choice": ["red", "green"]}), ("regex", {"regex": "[0-9]{3}"})):
            call = _call(name, [rng.randrange(5, 4096) for _ in range(30)], 24)
            call.ignore_eos, call.structured_output = False, constraint
            try:
                res[name] = await _collect(eng, call)
            except Exception as e:  # noqa: BLE001 - the test inspects the type
                res[name] = e
        # Stop token ids stop vLLM too, and min_tokens keeps them (and the end of sequence) away
        # before that many tokens: greedy, the same prompt, a token the free answer has early
        m_ids = [rng.randrange(5, 4096) for _ in range(30)]
        call = _call("free", m_ids, 16)
        call.ignore_eos = False
        free = [t for o in (await _collect(eng, call))["outs"] for t in o.token_ids]
        at = next(i for i in range(1, len(free)) if free[i] not in free[:i])
        call = _call("stopped", m_ids, 16)
        call.ignore_eos, call.stop_token_ids = False, (free[at],)
        stopped = await _collect(eng, call)
        call = _call("min", m_ids, 16)
        call.ignore_eos, call.stop_token_ids, call.min_tokens = False, (free[at],), min(at + 3, 16)
        res["min_tokens"] = {"free": free, "at": at, "stopped": stopped, "min": await _collect(eng, call)}
        # allowed_token_ids and bad_words reach vLLM's sampler: greedy, the same prompt as "free"
        call = _call("allowed", m_ids, 16)
        call.allowed_token_ids = (free[at], 300, 301)
        allowed = [t for o in (await _collect(eng, call))["outs"] for t in o.token_ids]
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(TINY_MODEL)
        word_at = next(i for i, t in enumerate(free) if t not in tok.all_special_ids and tok.decode([t]).strip()
                       and [t] in (tok.encode(tok.decode([t]).lstrip(), add_special_tokens=False),
                                   tok.encode(" " + tok.decode([t]).lstrip(), add_special_tokens=False)))
        call = _call("bad", m_ids, 16)
        call.bad_words = (tok.decode([free[word_at]]),)
        res["constraints"] = {"allowed": allowed, "free": free,
                              "word_at": word_at, "bad": [t for o in (await _collect(eng, call))["outs"]
                                                          for t in o.token_ids]}
        res["can_fit_small"] = eng.can_fit(100, [])
        res["end_stats"] = eng.stats()
        # Too long for the context: the gate in front refuses it before vLLM sees it.
        clock = MonotonicClock()
        gate = AdmissionGate(eng, make_policy("fcfs", clock=clock, cost=CostModel.from_profile()), clock)
        for name, call in {"too_long": _call("d", [7] * MAX_MODEL_LEN, 1),
                           "too_long_with_output": _call("e", [7] * (MAX_MODEL_LEN - 10), 20)}.items():
            try:
                async for _ in gate.submit(call):
                    pass
                res[name] = None
            except Exception as e:  # noqa: BLE001 - the test inspects the type
                res[name] = e
        # Fairway's memory guard at a gate over vLLM: the view follows vLLM's free blocks and the
        # gate's own admissions (its prompt held while it runs, wanted for the horizon after)
        guard = AdmissionGate(eng, make_policy("fairway", clock=clock, cost=CostModel.from_profile(),
                                               memory_guard=True, guard_loss=0.0), clock)
        view = guard.memory
        h_ids = prefix + [rng.randrange(5, 4096) for _ in range(40)]
        held_while_running = []
        async for _ in guard.submit(_call("h", h_ids, 3)):
            held_while_running.append(view.n_held)
        res["guard"] = {"held_while_running": held_while_running, "held_after": view.n_held,
                        "wanted_after": view.n_wanted, "blocks": len(block_hashes(h_ids)),
                        "spare": view.spare_blocks(), "free": eng.stats().kv_blocks_free}
    finally:
        await eng.shutdown()
    return res


@pytest.fixture(scope="module")
def scenario() -> dict:
    return asyncio.run(_scenario())


@needs_vllm
def test_vllm_outputs_and_startup(scenario):
    assert scenario["startup_s"] < 300
    for key, n in (("a", 12), ("b", 7), ("ok_after_errors", 3)):
        r = scenario[key]
        assert r["tokens"] == n, key  # ignore_eos: exactly max_tokens
        assert r["last"].finished and r["last"].finish_reason == "length"
        assert all(not o.finished for o in r["outs"][:-1])


@needs_vllm
def test_vllm_prefix_hit_reported_and_estimated(scenario):
    vbs = scenario["vllm_block_size"]
    a, b = scenario["a"]["last"], scenario["b"]["last"]
    assert a.cached_tokens == 0
    assert b.cached_tokens > 0 and b.cached_tokens == (PREFIX // vbs) * vbs
    # The hash-space estimate predicted exactly what vLLM reported, in whole vLLM blocks.
    assert scenario["b_predicted"] * 16 == b.cached_tokens
    fb = scenario["feedback"]
    assert [(f.predicted_cached, f.reported_cached) for f in fb[:2]] == [(0, 0), (b.cached_tokens, b.cached_tokens)]
    assert scenario["after_a_blocks"] == (PREFIX + 50) // vbs * vbs // 16
    assert scenario["b_hashes_held"] == (PREFIX + 70) // vbs * vbs // 16
    s1, s2 = scenario["salted"]
    assert s1.cached_tokens == 0 and s2.cached_tokens == (PREFIX // vbs) * vbs
    assert [(f.predicted_cached, f.reported_cached) for f in fb[2:4]] == [(0, 0), (s2.cached_tokens,) * 2]
    ev = scenario["events"]
    assert len(ev["stored"]) == scenario["after_a_blocks"] + (scenario["b_hashes_held"] - b.cached_tokens // 16)
    assert ev["removed"] == []


@needs_vllm
def test_vllm_stats_and_cancellation(scenario):
    idle = scenario["idle_stats"]
    assert idle.kv_blocks_total > 0 and idle.kv_blocks_free == idle.kv_blocks_total and idle.running == 0
    mid = scenario["mid_stats"]
    assert mid.running == 1 and mid.prefilling == 0 and mid.pending_prefill_tokens == 0
    assert 0 <= mid.kv_blocks_free < mid.kv_blocks_total
    assert scenario["mid_source"] in ("scheduler_stats", "estimate")
    assert scenario["first_chunk"].cached_tokens == 0
    assert scenario["after_cancel_unfinished"] == 0 and scenario["aborted"] == 1
    end = scenario["after_cancel_stats"]
    assert end.running == 0 and end.prefilling == 0 and end.kv_blocks_free == end.kv_blocks_total
    assert scenario["can_fit_small"] is True


@needs_vllm
def test_vllm_memory_guard_view_follows_the_engine(scenario):
    g = scenario["guard"]
    assert g["held_while_running"] and set(g["held_while_running"]) == {g["blocks"]}
    assert g["held_after"] == 0 and g["wanted_after"] == g["blocks"]  # a next turn may continue it
    assert g["spare"] == g["free"] - g["blocks"] and g["free"] > g["blocks"]


@needs_vllm
def test_vllm_log_probabilities_one_per_token_the_greedy_pick_first(scenario):
    r = scenario["logprobs"]
    ids = [t for o in r["outs"] for t in o.token_ids]
    lps = [x for o in r["outs"] for x in o.logprobs]
    assert len(ids) == len(lps) == 5
    for lp, top in lps:  # temperature 0: a most likely token (the tiny model's near-uniform weights tie often)
        assert len(top) == 2 and lp <= 0 and top[0][1] == lp >= top[1][1]


@needs_vllm
def test_vllm_prompt_log_probabilities_on_the_first_output_and_the_estimate_kept(scenario):
    r = scenario["prompt_logprobs"]
    first = r["out"]["outs"][0]
    plp = first.prompt_logprobs
    assert len(plp) == r["n"] and plp[0] is None and all(e[0] <= 0 and len(e[1]) == 1 for e in plp[1:])
    # each prompt token's rank as vLLM reports it (vLLM's prompt_logprobs): 1 where it is the most likely
    ids = r["ids"]
    assert all(e[2] >= 1 for e in plp[1:])
    assert all(e[2] == 1 for t, e in zip(ids[1:], plp[1:], strict=True) if e[1][0][0] == t)
    assert any(e[2] > 1 for e in plp[1:])  # random prompt ids on a model: most are not its first pick
    assert all(o.prompt_logprobs is None for o in r["out"]["outs"][1:])
    assert first.cached_tokens == 0  # vLLM read no cached block for it
    assert r["before"] > 0 and r["after"] >= r["before"]  # the prefix is still predicted cached


@needs_vllm
def test_vllm_constrains_the_output_to_a_json_schema(scenario):
    """A call's ``structured_output`` reaches vLLM's structured outputs: the answer is one of the
    schema's values and ends there ("stop"); a schema vLLM cannot compile is a 400."""
    from transformers import AutoTokenizer

    r = scenario["json"]
    ids = [t for o in r["outs"] for t in o.token_ids]
    assert json.loads(AutoTokenizer.from_pretrained(TINY_MODEL).decode(ids, skip_special_tokens=True)) in ("yes", "no")
    assert r["last"].finish_reason == "stop"
    assert getattr(scenario["bad_schema"], "status", None) == 400, repr(scenario["bad_schema"])
    assert "bogus" in str(scenario["bad_schema"])


@needs_vllm
def test_vllm_constrains_the_output_to_a_choice_or_a_regex(scenario):
    """vLLM's ``structured_outputs`` kinds beyond JSON reach it as they come: the answer is one of
    the choices, or matches the regular expression, and ends there."""
    import re

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY_MODEL)
    for name, ok in (("choice", lambda t: t in ("red", "green")), ("regex", lambda t: re.fullmatch("[0-9]{3}", t))):
        r = scenario[name]
        text = tok.decode([t for o in r["outs"] for t in o.token_ids], skip_special_tokens=True)
        assert ok(text) and r["last"].finish_reason == "stop", (name, text)


@needs_vllm
def test_vllm_stops_at_stop_token_ids_and_not_before_min_tokens(scenario):
    m = scenario["min_tokens"]
    stop = m["free"][m["at"]]
    stopped = [t for o in m["stopped"]["outs"] for t in o.token_ids]
    assert stopped == m["free"][: m["at"] + 1] and m["stopped"]["last"].finish_reason == "stop"
    held = [t for o in m["min"]["outs"] for t in o.token_ids]
    bar = min(m["at"] + 3, 16)
    assert len(held) >= bar and stop not in held[:bar], (held, stop)


@needs_vllm
def test_vllm_samples_only_the_allowed_token_ids_and_never_a_bad_word(scenario):
    """vLLM's allowed_token_ids and bad_words, passed through: greedy, the answer draws only from
    the allowed ids, and with a word of the free answer banned, that token never comes, the answer
    before it unchanged."""
    c = scenario["constraints"]
    allowed_ids = (c["free"][scenario["min_tokens"]["at"]], 300, 301)
    assert c["allowed"] and set(c["allowed"]) <= set(allowed_ids)
    banned = c["free"][c["word_at"]]
    assert len(c["bad"]) == 16 and banned not in c["bad"], c
    assert c["bad"][: c["word_at"]] == c["free"][: c["word_at"]], c


@needs_vllm
def test_vllm_too_large(scenario):
    assert isinstance(scenario["too_long"], RequestTooLarge)
    assert isinstance(scenario["too_long_with_output"], RequestTooLarge)
    assert isinstance(scenario["bad_token"], RequestTooLarge), repr(scenario["bad_token"])
    assert scenario["too_long"].status == 400


# -- the exact prefix view from vLLM's KV events (CPU) -------------------------------------------

EVENTS_KV_GB = 0.01  # ~10k tokens = 81 vLLM blocks: a few 3k-token prompts force evictions


async def _settled(eng) -> None:
    """Wait until the KV-event subscriber has been quiet for 0.3 s (events arrive a step late)."""
    sub, last, quiet = eng.kv_events_subscriber, -1, 0
    while quiet < 3:
        await asyncio.sleep(0.1)
        quiet, last = (quiet + 1, last) if sub.batches == last else (0, sub.batches)


async def _events_scenario() -> dict:
    _vllm_or_skip()
    eng = make_engine("vllm", model=str(TINY_MODEL), max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
                      max_num_batched_tokens=2048, enforce_eager=True, kv_cache_space_gb=EVENTS_KV_GB,
                      dtype="bfloat16", kv_events=True)
    listened: set[int] = set()
    removed: list[int] = []
    eng.set_cache_listener(listened.update, lambda hs: (removed.extend(hs), listened.difference_update(hs)))
    await eng.start()
    res: dict = {"kv_blocks_total": eng.stats().kv_blocks_total, "vllm_block_size": eng.vllm_block_size}
    try:
        rng = random.Random(1)
        prefix = [rng.randrange(5, 4096) for _ in range(PREFIX)]
        calls = [_call("a", prefix + [rng.randrange(5, 4096) for _ in range(50)], 4),
                 _call("b", prefix + [rng.randrange(5, 4096) for _ in range(70)], 4)]
        salted = prefix + [rng.randrange(5, 4096) for _ in range(30)]
        calls += [_call("s1", salted, 2, "tenant-x"), _call("s2", salted, 2, "tenant-x")]
        # distinct 3k-token prompts: more than the cache holds, so vLLM evicts (BlockRemoved)
        calls += [_call(f"f{i}", [rng.randrange(5, 4096) for _ in range(3000)], 2) for i in range(4)]
        calls += [_call("a2", calls[0].prompt_token_ids, 2), _call("f3again", calls[7].prompt_token_ids, 2)]
        res["held_after_a"] = None
        for call in calls:
            await _collect(eng, call)
            await _settled(eng)
            if call.request_id == "a":
                res["held_after_a"] = eng.cached_prefix_blocks(call.block_hashes)
        res["feedback"] = [(f.request_id.split("#")[0], f.predicted_cached, f.reported_cached) for f in eng.feedback]
        res["mirror"] = set(eng.cache_estimate.blocks())
        res["listened"] = set(listened)
        res["removed"] = len(removed)
        sub = eng.kv_events_subscriber
        res["sub"] = {"running": sub.running, "gaps": sub.gaps, "errors": sub.errors,
                      "orphans": eng.cache_estimate.orphans}
    finally:
        await eng.shutdown()
    return res


@pytest.fixture(scope="module")
def events_scenario() -> dict:
    return asyncio.run(_events_scenario())


@needs_vllm
def test_vllm_kv_events_exact_view(events_scenario):
    r = events_scenario
    vbs = r["vllm_block_size"]
    assert r["sub"] == {"running": True, "gaps": 0, "errors": 0, "orphans": 0}
    assert r["held_after_a"] == (PREFIX + 50 + 4) // vbs * vbs // 16  # prompt + output, whole vLLM blocks
    fb = {rid: (pred, rep) for rid, pred, rep in r["feedback"]}
    # the view predicted every hit vLLM then reported, exactly, evictions included
    assert all(pred == rep for pred, rep in fb.values()), r["feedback"]
    assert fb["a"] == (0, 0) and fb["b"][1] == PREFIX // vbs * vbs
    assert fb["s1"] == (0, 0) and fb["s2"][1] == PREFIX // vbs * vbs
    assert fb["f3again"][1] == 3000 // vbs * vbs and fb["a2"][1] < PREFIX // vbs * vbs  # a's prefix was evicted
    assert r["removed"] > 0 and r["listened"] == r["mirror"]
    assert len(r["mirror"]) <= r["kv_blocks_total"]


def test_cluster_args_resolve_engine_paths_against_the_repo(tmp_path, monkeypatch):
    from cluster.config import ClusterArgs

    monkeypatch.chdir(tmp_path)  # a replica's cwd need not be the repo
    a = ClusterArgs(engine="vllm", engine_args={"model": "deploy/models/fairway-tiny", "tokenizer": "org/hub-name"})
    ea = a.replica_args().engine_args
    assert ea["model"] == str(ROOT / "deploy" / "models" / "fairway-tiny")
    assert ea["tokenizer"] == "org/hub-name"  # not a local path: left for the hub


# -- strict tiers on vLLM (CPU): the scheduler that pauses lower tiers' prefill ----------------

TIER_CHUNK = 128  # vLLM's step budget: one CPU block of prefill per step
TIER_BATCH_PROMPT = 63 * TIER_CHUNK  # 63 steps of prefill


async def _tiers_scenario() -> dict:
    """One engine with two classes (``interactive`` tier 0, ``batch`` tier 1). Twice, a long prompt
    starts prefilling in 128-token chunks and then, once vLLM has stored its first blocks (the KV
    events say so), a short prompt arrives: first a ``batch`` prompt and an ``interactive`` one,
    then, as the control, two ``interactive`` ones (one tier, so nothing pauses)."""
    _vllm_or_skip()
    from fairway.policies.classes import ClassesConfig

    tiers = ClassesConfig.parse("interactive:tier=0:objective=1,batch:tier=1:objective=30")
    eng = make_engine("vllm", model=str(TINY_MODEL), max_model_len=TIER_BATCH_PROMPT + 64, max_num_seqs=4,
                      max_num_batched_tokens=TIER_CHUNK, enforce_eager=True, kv_cache_space_gb=0.25,
                      dtype="bfloat16", kv_events=True, tiers=tiers)
    await eng.start()
    sched = eng._llm.vllm_config.scheduler_config
    res: dict = {"scheduler_cls": sched.scheduler_cls.__name__, "async": bool(sched.async_scheduling),
                 "policy": str(sched.policy)}
    rng = random.Random(2)
    try:
        for run, (long_class, short_class) in enumerate((("batch", "interactive"), ("interactive", "interactive"))):
            order: list[str] = []
            long_call = _call(f"long{run}", [rng.randrange(5, 4096) for _ in range(TIER_BATCH_PROMPT)], 2)
            short_call = _call(f"short{run}", [rng.randrange(5, 4096) for _ in range(200)], 2)
            long_call.priority_class, short_call.priority_class = long_class, short_class

            async def one(name: str, call: GenerateCall, order: list[str] = order) -> None:
                async for _ in eng.generate(call):
                    if name not in order:
                        order.append(name)

            long_task = asyncio.create_task(one("long", long_call))
            deadline = time.monotonic() + 60
            while not eng.cached_prefix_blocks(long_call.block_hashes) and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            started = eng.cached_prefix_blocks(long_call.block_hashes)
            await one("short", short_call)
            await long_task
            res[run] = {"order": order, "long_blocks_at_short": started,
                        "long_blocks": len(long_call.block_hashes)}
    finally:
        await eng.shutdown()
    return res


@pytest.fixture(scope="module")
def tiers_scenario() -> dict:
    return asyncio.run(_tiers_scenario())


@needs_vllm
def test_vllm_strict_tiers_an_interactive_prompt_is_not_prefilled_behind_a_running_batch_prompt(tiers_scenario):
    r = tiers_scenario
    # the class that matches vLLM's async scheduling setting (off with vLLM's CPU executor)
    assert r["scheduler_cls"] == ("AsyncStrictTierScheduler" if r["async"] else "StrictTierScheduler")
    assert "PRIORITY" in r["policy"].upper()
    for run in (0, 1):  # the short prompt arrived while the long one was being prefilled
        assert 0 < r[run]["long_blocks_at_short"] < r[run]["long_blocks"], r[run]
    assert r[0]["order"] == ["short", "long"]  # batch prefill paused: the interactive prompt went first
    assert r[1]["order"] == ["long", "short"]  # one tier: vLLM runs the running prefill first


def _strict_scheduler(num_blocks: int, async_scheduling: bool = False):
    """vLLM's own scheduler (the synchronous one, or the async one vLLM uses on GPU) with the
    strict-tier rule, on the tiny model's config: 128-token steps, ``num_blocks`` KV blocks of 128
    tokens, no prefix caching (the rule does not read it)."""
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from replicas.engines.vllm_tiers import strict_tier_scheduler

    cfg = EngineArgs(model=str(TINY_MODEL), max_model_len=4096, max_num_batched_tokens=TIER_CHUNK, max_num_seqs=4,
                     enable_prefix_caching=False, scheduling_policy="priority", enforce_eager=True,
                     async_scheduling=False).create_engine_config()
    cfg.cache_config.num_gpu_blocks = num_blocks
    bs = cfg.cache_config.block_size
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=16, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    cls = strict_tier_scheduler(async_scheduling)
    outputs = StructuredOutputManager(cfg)
    return cls(vllm_config=cfg, kv_cache_config=kv, structured_output_manager=outputs, block_size=bs)


def _request(rid: str, tokens: int, priority: int, arrival: float):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    ids = [5 + (i * 7 + int(arrival * 13)) % 4000 for i in range(tokens)]
    return Request(rid, ids, SamplingParams(max_tokens=2), None, arrival_time=arrival, priority=priority)


def _steps(sched, n: int, arrivals: dict[int, list]) -> list[dict[str, int]]:
    """``n`` calls of ``schedule`` (no model runs, so a prompt once computed waits for its first
    token): each step's scheduled tokens per request; ``arrivals[k]`` are added before step k."""
    out = []
    for k in range(n):
        for r in arrivals.get(k, []):
            sched.add_request(r)
        out.append(dict(sched.schedule().num_scheduled_tokens))
    return out


@needs_vllm
@pytest.mark.parametrize("int_priority, async_scheduling, want", [
    # tier 0 arrives while a tier-1 prompt is mid-prefill: the tier-1 chunks stop, and the tier-1
    # request waiting behind it is not admitted into the interactive prompt's last, short step
    (0, False, [{"batch": 128}] * 2 + [{"int": 128}] * 2 + [{"int": 44}] + [{"batch": 128}] * 6 + [{"batch2": 128}]),
    # the control, everything in one tier: vLLM's order, the running prefill first
    (1, False, [{"batch": 128}] * 8 + [{"int": 128}] * 2 + [{"int": 44, "batch2": 84}, {"batch2": 128}]),
    # vLLM's async scheduler (its default on GPU) decodes a computed prompt without waiting for the
    # model (one token a step, not shown): the same prefill order, less those tokens of budget
    (0, True, [{"batch": 128}] * 2 + [{"int": 128}] * 2 + [{"int": 44}] + [{"batch": 128}] * 6 + [{"batch2": 126}]),
    (1, True, [{"batch": 128}] * 8 + [{"int": 127}] * 2 + [{"int": 46, "batch2": 81}, {"batch2": 126}]),
], ids=["tiers-sync", "one-tier-sync", "tiers-async", "one-tier-async"])
def test_vllm_strict_tier_scheduler_orders_the_prefill_steps(int_priority, async_scheduling, want):
    sched = _strict_scheduler(num_blocks=40, async_scheduling=async_scheduling)
    reqs = {0: [_request("batch", 1024, 1, 0.0)], 2: [_request("int", 300, int_priority, 1.0),
                                                      _request("batch2", 400, 1, 2.0)]}
    prompt = {r.request_id: r.num_prompt_tokens for rs in reqs.values() for r in rs}
    done = dict.fromkeys(prompt, 0)
    prefill = []  # each step's prompt tokens per request (decode tokens left out)
    for step in _steps(sched, 12, reqs):
        row = {}
        for rid, n in step.items():
            k = min(n, prompt[rid] - done[rid])
            done[rid] += n
            if k > 0:
                row[rid] = k
        prefill.append(row)
    assert prefill == want
    assert sched.strict_steps == (3 if int_priority == 0 else 0)


@needs_vllm
def test_vllm_strict_tier_scheduler_lets_lower_tiers_run_when_the_strict_tier_cannot_start():
    """A tier-0 prompt that does not fit the KV memory the tier-1 prefill holds would wait forever if
    the rule paused that prefill for good: a strict step that scheduled no tier-0 prefill is followed
    by a step without the rule (9 blocks of 128 tokens; after 7 chunks 2 are free, the prompt needs 3)."""
    sched = _strict_scheduler(num_blocks=9)
    got = _steps(sched, 10, {0: [_request("batch", 1024, 1, 0.0)], 7: [_request("int", 300, 0, 1.0)]})
    assert got == [{"batch": 128}] * 7 + [{}, {"batch": 128}, {}]


@needs_vllm
def test_vllm_strict_tier_scheduler_refuses_a_vllm_without_its_hooks(monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler

    from replicas.engines.vllm_tiers import StrictTierScheduler, strict_tier_scheduler

    assert strict_tier_scheduler(False) is StrictTierScheduler
    monkeypatch.delattr(Scheduler, "_handle_blocked_waiting_request")
    with pytest.raises(RuntimeError, match="lacks Scheduler._handle_blocked_waiting_request; turn strict tiers off"):
        strict_tier_scheduler(False)
