"""``replicas/faults.py``: a fault file reaches an engine through ``Engine.set_fault``; an engine
that applies none (the base's default) ignores it."""

from __future__ import annotations

from replicas.engines import make_engine
from replicas.faults import FaultFile, write_faults
from tests.fairway.test_protocol import MinimalEngine


def test_a_fault_file_reaches_the_engines_that_apply_faults(tmp_path):
    path = tmp_path / "faults.json"
    write_faults(path, {"r0": {"slowdown": 3}, "*": {"stall": True}})
    sim = make_engine("sim", kv_blocks=64)
    assert FaultFile(str(path), "r0", sim).check() == {"slowdown": 3}
    assert sim.slowdown == 3.0
    other = MinimalEngine()
    assert FaultFile(str(path), "r1", other).check() == {"stall": True}  # read, and ignored by the engine
    write_faults(path, {})
    f = FaultFile(str(path), "r0", sim)
    assert f.check() == {} and sim.slowdown == 1.0 and f.check() is None  # unchanged file: nothing new
