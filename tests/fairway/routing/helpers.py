"""Builders shared by the router-policy tests: readable replica states, requests, seeded routers,
the ranks' shape check, and a load view on a manual clock."""

from __future__ import annotations

import weakref

import numpy as np

from fairway.clock import ManualClock
from fairway.load_view import LoadView
from fairway.routing import Ranking, ReplicaState, RouteRequest, RouterPolicy, choice, make_router
from fairway.routing.anchors.hashing import HashRing
from tests.factories import LinearCost, chain

BS = 16


def st(replica: int, outstanding: int = 0, running: int = 0, q: float = 0.0, kv: float = 0.0, matched: int = 0,
       tree: int = 0, qtok: int = 0, active: int = 0, qp: tuple[float, ...] = (), cap: int = 0,
       ends: tuple[float, ...] = (), routed_since: float = 0.0, routed: tuple[float, ...] = ()) -> ReplicaState:
    """A replica state with readable defaults (idle, empty, nothing matched). ``qp``: the waiting
    requests' prefill estimates (their sum becomes Q unless ``q`` is given); ``cap``: max_num_seqs;
    ``ends``: the estimated prefill ends of its started requests; ``routed``: the prefill
    estimates routed to it after ``routed_since``."""
    qp = tuple(sorted(qp))
    return ReplicaState(replica=replica, outstanding=outstanding, running=running, queued_prefill_s=q or sum(qp),
                        kv_usage=kv, matched_blocks=matched, index_blocks=tree, queued_prefill_tokens=qtok,
                        active_blocks=active, queued_prefills=qp, max_running=cap, prefill_ends=ends,
                        routed_since=routed_since, routed_prefills=tuple(sorted(routed)))


def req(prompt: int = 160, hashes=None, rid: int = 0, session: str | None = None) -> RouteRequest:
    hs = chain("p", prompt // BS) if hashes is None else list(hashes)
    return RouteRequest(rid=rid, prompt_tokens=prompt, block_hashes=hs, session=session)


def router(name: str, seed: int = 0, clock: ManualClock | None = None, **kw) -> RouterPolicy:
    return make_router(name, clock=clock or ManualClock(), cost=LinearCost(), block_size=BS,  # type: ignore[arg-type]
                       rng=np.random.default_rng(seed), **kw)


def check(ranks: list[list[int]], states) -> None:
    """Every replica exactly once across the ranks; no empty rank."""
    assert all(ranks), ranks
    flat = [j for r in ranks for j in r]
    assert sorted(flat) == sorted(s.replica for s in states)


_RANKINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def ranking(r: RouterPolicy, rq: RouteRequest, states) -> Ranking:
    """``r.rank``, its ranks checked; kept as ``r``'s last answer here (``last``)."""
    out = r.rank(rq, states)
    check(out.ranks, states)
    _RANKINGS[r] = out
    return out


def last(r: RouterPolicy) -> Ranking:
    """The ``Ranking`` ``r`` returned to the last ``ranked`` / ``ranking`` / ``picks`` call here."""
    return _RANKINGS[r]


def ranked(r: RouterPolicy, rq: RouteRequest, states) -> list[list[int]]:
    return ranking(r, rq, states).ranks


def picks(r: RouterPolicy, rq: RouteRequest, states, n: int) -> list[int]:
    return [choice(ranked(r, rq, states)) for _ in range(n)]


def view(n: int = 2, stale_s: float = 0.0) -> tuple[LoadView, ManualClock]:
    clock = ManualClock()
    return LoadView(n, clock, LinearCost(), block_size=BS, stale_s=stale_s), clock  # type: ignore[arg-type]


def ring_order(r: RouterPolicy, key: int, ids: list[int]) -> list[int]:
    """The anchor's own ring, read through a fresh ring of the same size (the ring is a pure
    function of the ids and the key)."""
    return HashRing(r._ring.vnodes).order(key, ids)  # type: ignore[attr-defined]
