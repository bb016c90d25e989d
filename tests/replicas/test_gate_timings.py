"""Where a replica's share of the TTFT goes: the gate exports the hop from the ingress to it
(``dispatch``) and the engine's prefill (``prefill``) beside its queue wait and TTFT."""

from __future__ import annotations

import asyncio
import time

import pytest

from observability.stats import FairwayStats
from tests.replicas.test_gate import call, consume, make_gate, settle

pytestmark = pytest.mark.asyncio


async def test_the_gate_exports_the_dispatch_hop_and_the_prefill():
    gate, engine, _ = make_gate("fcfs")
    gate.stats = FairwayStats(level="replica", component="r0", policy="fcfs")
    c = call("a", 40)
    c.arrival_s = time.time() - 5.0  # the ingress sent it 5 s ago
    out: list = []
    task = asyncio.create_task(consume(gate, c, out))
    await settle()
    engine.release("a")
    await task
    hists = gate.stats.snapshot()["histograms"]
    (dispatch,) = hists["dispatch"]
    assert dispatch["count"] == 1 and 5.0 <= dispatch["sum"] < 60.0
    (prefill,) = hists["prefill"]
    (ttft,) = hists["ttft"]
    assert prefill["count"] == 1 and prefill["labels"] == {"lane": "", "replica": "r0"}
    assert prefill["sum"] <= ttft["sum"] - dispatch["sum"]  # the prefill is the last part of the TTFT
