"""``fairway/protocol.py``'s ``Engine``: the required members are enforced, the optional ones have
their defaults in the base, and the registry builds only its subclasses."""

from __future__ import annotations

import pytest

from fairway.protocol import Engine, EngineStats
from replicas.engines import EngineError, engine_class, make_engine


class MinimalEngine(Engine):
    """Only what the base requires."""

    block_size = 16
    max_num_batched_tokens = 64
    max_num_seqs = 2
    max_model_len = 256

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    async def generate(self, call):
        yield  # pragma: no cover - never called here

    def stats(self) -> EngineStats:
        return EngineStats(running=0, prefilling=0, pending_prefill_tokens=0, kv_blocks_total=1, kv_blocks_free=1)

    def can_fit(self, prompt_tokens, block_hashes) -> bool:
        return True

    def cached_prefix_blocks(self, block_hashes) -> int:
        return 0

    def cached_hashes(self) -> list[int]:
        return []

    def set_cache_listener(self, on_stored, on_removed) -> None: ...


class NotAnEngine:
    block_size = 16


def test_the_optional_members_have_their_defaults_in_the_base():
    e = MinimalEngine()
    assert e.healthy is True and e.preemptions == 0 and e.on_step is None and e.time_scale == 1.0
    assert e.timing() is None
    assert e.set_fault(stall=True, slowdown=2.0) is False  # applies none
    assert e.host_only_hashes() == []
    assert e.set_tier_listener(lambda events: None) is None


def test_a_required_member_left_out_fails_at_construction():
    class NoCachedHashes(MinimalEngine):
        cached_hashes = Engine.cached_hashes

    with pytest.raises(TypeError, match="cached_hashes"):
        NoCachedHashes()


def test_the_shipped_engines_override_what_they_have():
    sim = make_engine("sim", kv_blocks=64, host_kv_blocks=8)
    assert isinstance(sim, Engine) and sim.set_fault(slowdown=2.0) is True and sim.slowdown == 2.0
    assert sim.timing()["pacing"] == "deadline" and sim.healthy is False  # not started
    vllm = make_engine("vllm", model="m")
    assert isinstance(vllm, Engine) and vllm.set_fault(stall=True) is False and vllm.timing() is None


def test_the_registry_builds_only_engine_subclasses():
    assert engine_class(f"{__name__}:MinimalEngine") is MinimalEngine
    with pytest.raises(EngineError, match="not a Engine subclass"):
        engine_class(f"{__name__}:NotAnEngine")


def test_replica_errors_keep_their_fields_across_pickling():
    """Ray pickles a replica's exception to the ingress: the retry hint and the refusing replica
    (the ingress tries an Overloaded request once more elsewhere) must survive it."""
    import pickle

    from fairway.protocol import EngineFailed, Overloaded, UnsupportedParameter

    e = pickle.loads(pickle.dumps(Overloaded("replica r0 queue is full", retry_after_s=2.0, replica="r0")))
    assert (type(e), e.message, e.retry_after_s, e.replica) == (Overloaded, "replica r0 queue is full", 2.0, "r0")
    f = pickle.loads(pickle.dumps(EngineFailed("down", retry_after_s=1.0)))
    assert (type(f), f.message, f.retry_after_s) == (EngineFailed, "down", 1.0)
    u = pickle.loads(pickle.dumps(UnsupportedParameter("no logprobs", param="logprobs")))
    assert (type(u), u.message, u.retry_after_s, u.param) == (UnsupportedParameter, "no logprobs", None, "logprobs")
