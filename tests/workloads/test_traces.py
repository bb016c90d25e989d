"""Tests of the public block-id traces (docs/traces.md): the Qwen-Bailian reader and named traces
on small hand-made files, then each real trace's documented properties. A real trace that is not
in the traces folder (``workloads.traces.trace_dir()``) is skipped with the reason."""

from __future__ import annotations

import gzip
import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from fairway.hashing import expand_trace_block, salt_seed
from fairway.request import WorkloadError
from sim.hit_bounds import infinite_cache_hit_ratio
from workloads.registry import make_workload
from workloads.traces import (
    BAILIAN_BLOCK_TOKENS,
    KNOWN_TRACES,
    TRACE_DIR_ENV,
    BailianTraceWorkload,
    MooncakeTraceWorkload,
    read_bailian,
    read_mooncake,
    trace_dir,
)

BS = 16


# ---------------------------------------------------------------------------------- factories


def bailian_record(chat: int, parent: int, t: float, ids: list[int], *, n_in: int | None = None,
                   n_out: int = 4, turn: int = 1, kind: str = "text") -> dict:
    return {"chat_id": chat, "parent_chat_id": parent, "timestamp": t,
            "input_length": n_in if n_in is not None else BAILIAN_BLOCK_TOKENS * len(ids),
            "output_length": n_out, "type": kind, "turn": turn, "hash_ids": ids}


def write_jsonl(path: Path, records: list[dict]) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in records)
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def replay(path: Path | str, **kw) -> list:
    return list(make_workload(f"trace:{path}", rate=1.0, seed=0, **kw).initial())


# ------------------------------------------------------------------------ Qwen-Bailian reader


CONVERSATIONS = [  # in file order; times out of order on purpose
    bailian_record(10, -1, 5.0, [1, 2, 3]),
    bailian_record(11, 10, 9.0, [1, 2, 3, 4, 5], turn=2),
    bailian_record(20, -1, 1.0, [7, 8], kind="search"),
    bailian_record(12, 11, 12.5, [1, 2, 3, 4, 5, 6], turn=3),
    bailian_record(31, 30, 3.0, [9], turn=2, kind="file"),  # its parent 30 is before the window
    bailian_record(32, 31, 4.0, [9, 2], turn=3, kind="file"),
]


def test_bailian_sessions_follow_parent_links_in_order_of_first_arrival(tmp_path):
    rows = read_bailian(write_jsonl(tmp_path / "b.jsonl", CONVERSATIONS))
    # by time: chat 20 (t=1) opens session 0, the orphaned 31/32 (t=3) session 1, 10/11/12 session 2
    assert [r.session for r in rows] == [2, 2, 0, 2, 1, 1]
    assert [r.turn for r in rows] == [1, 2, 1, 3, 2, 3]
    assert [r.kind for r in rows] == ["text", "text", "search", "text", "file", "file"]
    assert [r.time_s for r in rows] == [5.0, 9.0, 1.0, 12.5, 3.0, 4.0]  # seconds, not ms


def test_bailian_replay_chains_ids_so_only_equal_prefixes_share_blocks(tmp_path):
    specs = replay(write_jsonl(tmp_path / "b.jsonl", CONVERSATIONS))
    assert [s.arrival_s for s in specs] == [1.0, 3.0, 4.0, 5.0, 9.0, 12.5]
    assert [s.session for s in specs] == [0, 1, 1, 2, 2, 2]
    assert [s.kind for s in specs] == ["search", "file", "file", "text", "text", "text"]
    first, second, third = specs[3], specs[4], specs[5]  # the turns of chats 10, 11, 12
    root = salt_seed(None)
    h1 = expand_trace_block(root, 1, 1)[0]
    assert first.block_hashes[0] == h1
    assert second.block_hashes[:3] == first.block_hashes[:3]
    assert third.block_hashes[:5] == second.block_hashes[:5]
    assert len(second.block_hashes) == 5  # 80 prompt tokens + 4 output tokens: 5 full blocks
    assert third.block_hashes[5] == expand_trace_block(second.block_hashes[4], 6, 1)[0]
    # id 2 follows id 9 in chat 32 and id 1 in chat 10: a different prefix, so a different block
    assert specs[2].block_hashes[1] != first.block_hashes[1]


def test_bailian_block_size_must_divide_16_and_ids_must_fit_the_prompt(tmp_path):
    path = write_jsonl(tmp_path / "b.jsonl", CONVERSATIONS)
    with pytest.raises(WorkloadError, match="must divide 16"):
        replay(path, block_size=32)
    assert len(replay(path, block_size=8)[3].block_hashes) == 2 * 3 + 0  # 3 ids -> 6 blocks of 8
    bad = write_jsonl(tmp_path / "long.jsonl", [bailian_record(1, -1, 0.0, [1, 2, 3], n_in=20)])
    with pytest.raises(WorkloadError, match=r"long\.jsonl:1: 3 hash_ids for input_length 20; expected at most 2"):
        read_bailian(bad)
    # fewer ids than blocks: the blocks past them get unique content
    short = write_jsonl(tmp_path / "short.jsonl", [bailian_record(1, -1, 0.0, [5], n_in=64, n_out=1),
                                                   bailian_record(2, -1, 1.0, [5], n_in=64, n_out=1)])
    a, b = replay(short)
    assert a.block_hashes[0] == b.block_hashes[0] and len(a.block_hashes) == 4
    assert set(a.block_hashes[1:]).isdisjoint(b.block_hashes[1:])


def test_jsonl_format_is_sniffed_and_gzip_is_read(tmp_path):
    gz = write_jsonl(tmp_path / "b.jsonl.gz", CONVERSATIONS)
    assert isinstance(make_workload(f"trace:{gz}", rate=1.0, seed=0), BailianTraceWorkload)
    moon = write_jsonl(tmp_path / "m.jsonl.gz", [{"timestamp": 0, "input_length": 600, "output_length": 2,
                                                  "hash_ids": [4, 5]}])
    w = make_workload(f"trace:{moon}", rate=1.0, seed=0)
    assert isinstance(w, MooncakeTraceWorkload)
    (spec,) = w.initial()
    assert spec.session == -1 and spec.kind == "trace" and len(spec.block_hashes) == 37  # 32 + 5


def test_named_traces_resolve_in_the_trace_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(TRACE_DIR_ENV, str(tmp_path))
    assert trace_dir() == tmp_path
    with pytest.raises(WorkloadError, match=r"trace 'bailian-a' not found: expected .*qwen_traceA_blksz_16\.jsonl"):
        make_workload("trace:bailian-a", rate=1.0, seed=0)
    write_jsonl(tmp_path / (KNOWN_TRACES["bailian-a"] + ".gz"), CONVERSATIONS)
    assert [s.session for s in replay("bailian-a")] == [0, 1, 1, 2, 2, 2]
    monkeypatch.delenv(TRACE_DIR_ENV)
    assert trace_dir() == Path(__file__).resolve().parents[3] / "shared" / "traces"


# ------------------------------------------------------------------------------- real traces


def real(name: str) -> Path:
    """The named trace's path, or a skip saying where it was looked for."""
    base = trace_dir() / KNOWN_TRACES[name]
    for cand in (base, base.with_name(base.name + ".gz")):
        if cand.exists():
            return cand
    pytest.skip(f"trace {name!r} not found at {base} (or .gz): docs/traces.md says how to fetch it")


def first_block_shared_share(rows) -> float:
    firsts = Counter(r.hash_ids[0] for r in rows if r.hash_ids)
    return sum(1 for r in rows if r.hash_ids and firsts[r.hash_ids[0]] > 1) / len(rows)


def test_real_mooncake_conversation_trace():
    rows = read_mooncake(real("mooncake-conversation"))
    assert len(rows) == 12_031  # FAST25-release/README.md
    assert np.mean([r.input_tokens for r in rows]) == pytest.approx(12_035, abs=1)
    assert np.mean([r.output_tokens for r in rows]) == pytest.approx(343, abs=1)
    assert 3_500 < max(r.time_s for r in rows) - min(r.time_s for r in rows) <= 3_600  # "one hour"
    assert first_block_shared_share(rows) == 1.0  # every request starts with the same 512 tokens
    assert {r.session for r in rows} == {-1}  # Mooncake names no sessions
    specs = replay("mooncake-conversation")
    assert infinite_cache_hit_ratio(specs, BS) == pytest.approx(0.3736, abs=5e-4)


def test_real_mooncake_toolagent_trace():
    rows = read_mooncake(real("mooncake-toolagent"))
    assert len(rows) == 23_608  # FAST25-release/README.md
    assert np.mean([r.input_tokens for r in rows]) == pytest.approx(8_596, abs=1)
    assert np.mean([r.output_tokens for r in rows]) == pytest.approx(182, abs=1)
    assert max(r.time_s for r in rows) - min(r.time_s for r in rows) <= 3_600  # "one hour"
    assert {r.session for r in rows} == {-1}


@pytest.mark.parametrize("name", ["bailian-a", "bailian-b"])
def test_real_bailian_trace(name):
    """What the upstream README and docs/qa-context-growth-pattern.md state: a two-hour window,
    four request types, turns linked by parent_chat_id, and a next turn's input holding its
    parent's input (so the parent's full blocks, all but the padded last one, prefix it)."""
    path = real(name)
    rows = read_bailian(path)
    assert max(r.time_s for r in rows) - min(r.time_s for r in rows) <= 2 * 3_600 + 60
    assert {r.kind for r in rows} <= {"text", "search", "image", "file"}
    assert all(r.turn >= 1 for r in rows)
    records = [json.loads(line) for line in (gzip.open(path, "rt") if path.name.endswith(".gz") else path.open())
               if line.strip()]
    by_chat = {r["chat_id"]: i for i, r in enumerate(records)}
    children = [(i, by_chat[r["parent_chat_id"]]) for i, r in enumerate(records) if r["parent_chat_id"] in by_chat]
    assert children, "no follow-up turn has its parent in the file"
    assert all(rows[i].session == rows[p].session for i, p in children)
    assert all(rows[i].turn > rows[p].turn for i, p in children)
    extends = sum(1 for i, p in children if rows[i].hash_ids[: len(rows[p].hash_ids) - 1] == rows[p].hash_ids[:-1])
    assert extends / len(children) > 0.5
    sessions = Counter(r.session for r in rows)
    assert sorted(sessions) == list(range(len(sessions)))
    assert math.isfinite(infinite_cache_hit_ratio(replay(name), BS))
