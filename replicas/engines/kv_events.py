"""vLLM's prefix cache in our hash space, exactly, from vLLM's own KV-cache events.

vLLM (``kv_events_config``) publishes, after each scheduler step, a batch of events over ZMQ:
``BlockStored`` (vLLM block hashes, the parent block's hash, the blocks' token ids, per-block
extra keys such as the tenant's ``cache_salt``), ``BlockRemoved`` (vLLM hashes) and
``AllBlocksCleared``. vLLM's hashes differ from ``fairway/hashing.py``'s, but a stored event carries
the tokens, so the mirror recomputes OUR chained hashes for every stored vLLM block: it keeps, per
vLLM block, the hash-chain state at its end (our parent hash plus any tokens of an unfinished
block of ours), so a child block's hashes continue from its parent's state. A removed vLLM block
removes our hashes it completed.

- ``KvEventMirror``: the bookkeeping, plain Python (no vLLM or ZMQ import; unit-tested alone).
  Same read interface as ``CacheEstimate`` (``cached_prefix_blocks``, ``predicted_hit_blocks``,
  ...), and its changes go to the same stored / removed listener.
- ``KvEventSubscriber``: an asyncio task on a ZMQ SUB socket (``zmq.asyncio``) that decodes vLLM's
  ``KVEventBatch``es and applies them; it asks vLLM's replay socket for what it missed (the
  batches published before the subscription took, or any sequence gap).

Host tier (vLLM's CPU offloading, ``kv_offloading_size``): the offloading manager publishes, in
the same batches after the scheduler's own events, ``BlockStored`` / ``BlockRemoved`` with
``medium="CPU"`` under the same vLLM block hash as the GPU block the copy came from. The mirror
keeps a vLLM block (its our-hashes and chain state) while either medium holds it, so a block
evicted from the GPU but kept on CPU is still cached (a child reloaded or stored later still
chains from it), and reports *tier events* (``(host_only, hash)``, as the engine model's block
pool does: ``fairway/engine/block_pool.py``, Tier events) to ``set_tier_listener``'s listener:
``(True, h)`` when no GPU block completes ``h`` any more but a CPU copy does, ``(False, h)`` when
a GPU copy is stored again or the last CPU copy is removed (the KV removal then comes too).
Tier events are netted per batch like the KV events (a hash's status before the batch against
after it) and emitted after them. ``host_only()`` is the set for a full resend. Without CPU
events nothing of this runs: the GPU path pays one empty-set test per removed vLLM block.

Limits: only the primary cache (``medium`` GPU or None; vLLM-CPU reports its KV as GPU), CPU
copies (``medium`` "CPU"; a disk tier, "STORAGE", is ignored) and KV group 0. A CPU copy stored
after its GPU block was evicted and whose chain state the mirror no longer has (not evicted in
the same batch, no token ids in the event or an unknown parent) is skipped and counted in
``orphans``. ``AllBlocksCleared`` carries no medium: it clears both tiers here (should vLLM
clear one tier alone, the other's blocks count as misses until stored again). vLLM's default
offloading connector (``OffloadingConnector``) names a CPU chunk by the vLLM hash of its last
GPU block and sends no tokens unless its ``kv_connector_extra_config`` has
``self_describing_kv_events: true`` (then every GPU block hash of the chunk): without it, and
with chunks of several GPU blocks, only each chunk's last block is known to be on CPU, so the
host-only prefix is cut short (a host hit seen as a miss, never the reverse). A block hash
announced on CPU by two overlapping chunks counts once (a set, not a count): the first removal
ends it, again erring towards a miss. The gate's own hit estimate (``cached_prefix_blocks``)
counts either tier, as the sim engine's does. LoRA adapters' blocks are hashed as the base
model's (we do not salt by adapter). A stored block whose parent the mirror does not know
(events lost beyond the replay buffer) is skipped and counted in ``orphans``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from fairway.hashing import HashState, longest_cached_prefix

log = logging.getLogger(__name__)

Listener = Callable[[Iterable[int]], None]
TierListener = Callable[[list[tuple[bool, int]]], None]
PRIMARY_MEDIA = (None, "GPU")
HOST_MEDIUM = "CPU"  # vllm.distributed.kv_events.MEDIUM_CPU: the offloading manager's copies


class KvEventMirror:
    """The set of our block hashes that vLLM holds, rebuilt from its KV events.

    Invariant: a hash is held iff at least one stored, not yet removed vLLM block (on the GPU or
    on CPU) completed it; it is host-only iff every such block is on CPU only.
    Costs: ``apply`` O(tokens of stored blocks + hashes removed + hashes whose tier changed);
    lookups O(matched + 1). Memory: O(vLLM blocks held in either tier).
    """

    def __init__(self, block_size: int = 16, engine_block_size: int | None = None) -> None:
        if block_size < 1:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.engine_block_size = engine_block_size or block_size
        # vLLM hash -> (our hashes it completed, chain state at its end: (parent, pending tokens))
        self._blocks: dict[Any, tuple[tuple[int, ...], tuple[int, np.ndarray]]] = {}
        self._held: dict[int, int] = {}  # our hash -> number of vLLM blocks that completed it
        self._on_stored: Listener | None = None
        self._on_removed: Listener | None = None
        self._on_tier: TierListener | None = None
        # Host tier (CPU offloading); all empty without CPU events. Why counts per our hash:
        # one hash of ours may be completed by several vLLM blocks (other extra keys), so it is
        # host-only iff all of them are on CPU only: _host_n[h] == _held[h]. O(1) per change.
        self._cpu: set[Any] = set()  # vLLM blocks with a CPU copy
        self._cpu_only: set[Any] = set()  # of those, the ones no longer on the GPU
        self._host_n: dict[int, int] = {}  # our hash -> vLLM blocks completing it that are CPU-only
        self._touched: dict[int, bool] = {}  # this batch: our hash -> host-only before its first change
        self._stash: dict[Any, tuple[tuple[int, ...], tuple[int, np.ndarray]]] = {}  # GPU drops this batch
        self._offload = False  # a CPU event was seen: keep this batch's GPU drops in _stash
        self.events_applied = 0
        self.orphans = 0  # stored blocks skipped: parent unknown

    def set_listener(self, on_stored: Listener | None, on_removed: Listener | None) -> None:
        self._on_stored, self._on_removed = on_stored, on_removed

    def set_tier_listener(self, on_tier: TierListener | None) -> None:
        """Receive the tier events (``(host_only, hash)``, after the KV events of a batch)."""
        self._on_tier = on_tier

    def host_only(self) -> list[int]:
        """Our hashes held on CPU only (no GPU block completes them). O(host-tier hashes)."""
        return [h for h in self._host_n if self._is_host_only(h)]

    def _is_host_only(self, h: int) -> bool:
        """Every vLLM block completing ``h`` is on CPU only (and one is). O(1)."""
        n = self._host_n.get(h, 0)
        return n > 0 and n == self._held.get(h, 0)

    # -- reads (CacheEstimate's interface) -----------------------------------------------------

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, h: object) -> bool:
        return h in self._held

    def blocks(self) -> list[int]:
        return list(self._held)

    @property
    def engine_blocks(self) -> int:
        return len(self._blocks)

    def cached_prefix_blocks(self, hashes: Sequence[int]) -> int:
        return longest_cached_prefix(hashes, self._held)

    def stored_blocks(self, prompt_tokens: int) -> int:
        ebs = self.engine_block_size
        return (prompt_tokens // ebs) * ebs // self.block_size

    def max_hit_blocks(self, prompt_tokens: int) -> int:
        ebs = self.engine_block_size
        return (max(0, prompt_tokens - 1) // ebs) * ebs // self.block_size

    def predicted_hit_blocks(self, hashes: Sequence[int], prompt_tokens: int) -> int:
        return min(self.cached_prefix_blocks(hashes), self.max_hit_blocks(prompt_tokens))

    # The estimate's update hooks: nothing to do, the events are the truth.
    def observe(self, hashes: Sequence[int], prompt_tokens: int, cached_tokens: int | None) -> None:
        return None

    def touch(self, hashes: Sequence[int]) -> None:
        return None

    # -- updates -------------------------------------------------------------------------------

    def clear(self) -> list[int]:
        removed: list[int] = []
        self._forget_all(removed)
        self._emit([], removed)
        self._emit_tier()
        return removed

    def apply(self, events: Iterable[Any]) -> tuple[list[int], list[int]]:
        """Apply one batch of vLLM events (objects with vLLM's field names); emit and return the
        net (stored, removed) of our hashes."""
        stored: list[int] = []
        removed: list[int] = []
        for ev in events:
            self.events_applied += 1
            kind = type(ev).__name__
            if kind == "AllBlocksCleared":
                self._forget_all(removed)
                continue
            if (getattr(ev, "group_idx", None) or 0) != 0:
                continue
            medium = getattr(ev, "medium", None)
            if medium in PRIMARY_MEDIA:
                if kind == "BlockStored":
                    self._stored(ev, stored)
                elif kind == "BlockRemoved":
                    cpu = self._cpu
                    for vh in ev.block_hashes:
                        if cpu and vh in cpu:  # a CPU copy stays: host-only now
                            self._gpu_gone(vh)
                        else:
                            self._drop(vh, removed)
            elif medium == HOST_MEDIUM:
                self._offload = True
                if kind == "BlockStored":
                    self._stored_cpu(ev, stored)
                elif kind == "BlockRemoved":
                    for vh in ev.block_hashes:
                        self._drop_cpu(vh, removed)
        # net change: a hash stored and removed in one batch is neither
        gone = set(removed)
        back = set(stored)
        net_stored = [h for h in stored if h not in gone and h in self._held]
        net_removed = [h for h in removed if h not in back and h not in self._held]
        self._emit(net_stored, net_removed)
        if self._touched:
            self._emit_tier()
        if self._stash:
            self._stash.clear()
        return net_stored, net_removed

    def _stored(self, ev: Any, stored: list[int], cpu: bool = False) -> None:
        vbs = int(ev.block_size)
        tokens = np.asarray(ev.token_ids, dtype=np.uint32)
        n = len(ev.block_hashes)
        if n == 0 or vbs <= 0 or tokens.size < n * vbs:  # vbs 0: an offloading placeholder (no payload)
            if cpu:  # a CPU copy of a block the mirror no longer knows, without its tokens
                self.orphans += 1
            return
        if ev.parent_block_hash is None:
            keys = (ev.extra_keys or [None])[0]
            salts = [k for k in (keys or ()) if isinstance(k, str) and k != getattr(ev, "lora_name", None)]
            start = HashState.start(self.block_size, salts[-1] if salts else None)
            parent, pending = start.parent, start.pending
        elif ev.parent_block_hash in self._blocks:
            parent, pending = self._blocks[ev.parent_block_hash][1]
        else:
            self.orphans += 1
            return
        for i, vh in enumerate(ev.block_hashes):
            state = HashState(self.block_size, parent, pending, [])
            new = state.extend(tokens[i * vbs : (i + 1) * vbs])
            parent, pending = state.parent, state.pending
            if vh in self._blocks:  # re-announced (vLLM also reports reused blocks): already counted
                if cpu:
                    self._cpu.add(vh)
                elif self._cpu_only and vh in self._cpu_only:  # back on the GPU (reloaded)
                    self._not_cpu_only(vh)
                continue
            if cpu:
                self._add_cpu_only(vh, (tuple(new), (parent, pending)), stored)
                continue
            self._blocks[vh] = (tuple(new), (parent, pending))
            host_n = self._host_n
            for h in new:
                c = self._held.get(h, 0)
                if host_n and h in host_n:  # another vLLM block holds it on CPU only
                    self._touch(h)
                self._held[h] = c + 1
                if c == 0:
                    stored.append(h)

    def _drop(self, vh: Any, removed: list[int]) -> None:
        entry = self._blocks.pop(vh, None)
        if entry is None:
            return
        if self._offload:  # its CPU copy may still be reported in this batch (_stored_cpu)
            self._stash[vh] = entry
        host_n = self._host_n
        for h in entry[0]:
            c = self._held.get(h, 0)
            if c <= 1:
                if self._held.pop(h, None) is not None:
                    removed.append(h)
            else:
                if host_n and h in host_n:  # the others completing it may be CPU-only
                    self._touch(h)
                self._held[h] = c - 1

    # -- the host tier (CPU offloading) ----------------------------------------------------------

    def _touch(self, h: int) -> None:
        """Remember ``h``'s host-only status before this batch changes it (netting). O(1)."""
        if h not in self._touched:
            self._touched[h] = self._is_host_only(h)

    def _stored_cpu(self, ev: Any, stored: list[int]) -> None:
        """CPU copies: of a block the mirror holds (the usual case: offloaded from the GPU), of
        one evicted from the GPU earlier in this batch, else rebuilt from the event's tokens."""
        for vh in ev.block_hashes:
            if vh in self._cpu:
                continue
            if vh in self._blocks:
                self._cpu.add(vh)  # still on the GPU: no tier change yet
                continue
            entry = self._stash.pop(vh, None)
            if entry is None:
                self._stored(ev, stored, cpu=True)
                return
            self._add_cpu_only(vh, entry, stored)

    def _add_cpu_only(self, vh: Any, entry: tuple[tuple[int, ...], tuple[int, np.ndarray]],
                      stored: list[int]) -> None:
        self._blocks[vh] = entry
        self._cpu.add(vh)
        self._cpu_only.add(vh)
        held, host_n = self._held, self._host_n
        for h in entry[0]:
            self._touch(h)
            c = held.get(h, 0)
            held[h] = c + 1
            host_n[h] = host_n.get(h, 0) + 1
            if c == 0:
                stored.append(h)

    def _gpu_gone(self, vh: Any) -> None:
        """The GPU copy of ``vh`` was evicted, its CPU copy stays: its hashes may be host-only."""
        if vh in self._cpu_only or vh not in self._blocks:
            return
        self._cpu_only.add(vh)
        host_n = self._host_n
        for h in self._blocks[vh][0]:
            self._touch(h)
            host_n[h] = host_n.get(h, 0) + 1

    def _not_cpu_only(self, vh: Any) -> None:
        """``vh`` is no longer on CPU only (back on the GPU, reloaded or recomputed; or its CPU
        copy went): its hashes leave the host-only counts."""
        self._cpu_only.discard(vh)
        host_n = self._host_n
        for h in self._blocks[vh][0]:
            self._touch(h)
            n = host_n.get(h, 0)
            if n <= 1:
                host_n.pop(h, None)
            else:
                host_n[h] = n - 1

    def _drop_cpu(self, vh: Any, removed: list[int]) -> None:
        """The CPU copy of ``vh`` was removed: it leaves the mirror if the GPU has none."""
        if vh not in self._cpu:
            return
        self._cpu.discard(vh)
        if vh in self._cpu_only:
            self._not_cpu_only(vh)
            self._drop(vh, removed)

    def _forget_all(self, removed: list[int]) -> None:
        """Every block is gone from both tiers (vLLM's ``AllBlocksCleared``, or ``clear``): every
        held hash goes into ``removed``, and the host-only ones will leave the host-only set."""
        for h in self._host_n:
            self._touch(h)
        self._cpu.clear()
        self._cpu_only.clear()
        self._host_n.clear()
        self._stash.clear()
        removed.extend(self._held)
        self._blocks.clear()
        self._held.clear()

    def _emit_tier(self) -> None:
        """The batch's net tier changes, after its KV events. O(hashes touched)."""
        touched, self._touched = self._touched, {}
        events = []
        for h, before in touched.items():
            now = self._is_host_only(h)
            if now != before:
                events.append((now, h))
        if events and self._on_tier is not None:
            self._on_tier(events)

    def _emit(self, stored: list[int], removed: list[int]) -> None:
        if removed and self._on_removed is not None:
            self._on_removed(removed)
        if stored and self._on_stored is not None:
            self._on_stored(stored)


END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KvEventSubscriber:
    """Feeds a ``KvEventMirror`` from vLLM's ZMQ publishers (needs ``zmq`` and vLLM's msgspec types).

    ``endpoints``: ``[(pub_endpoint, replay_endpoint or None), ...]`` from
    ``AsyncLLM.get_kv_event_sources()``. Sequence numbers are per publisher; a batch whose number is
    not the next expected triggers a replay from the first missing one (so batches published before
    the subscription took are not lost), and batches already applied are skipped.
    """

    def __init__(self, mirror: KvEventMirror, endpoints: Sequence[tuple[str, str | None]], topic: str = "") -> None:
        import msgspec
        import zmq
        import zmq.asyncio
        from vllm.distributed.kv_events import KVEventBatch

        self.mirror = mirror
        self.endpoints = list(endpoints)
        self._zmq = zmq
        self._ctx = zmq.asyncio.Context.instance()
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._topic = topic.encode()
        self._next: dict[str, int] = {}  # pub endpoint -> next expected sequence number
        self._task: asyncio.Task | None = None
        self.batches = 0
        self.replays = 0
        self.gaps = 0  # batches lost for good (beyond vLLM's replay buffer)
        self.errors = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="vllm-kv-events")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping anyway
                pass

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _run(self) -> None:
        zmq = self._zmq
        subs = []
        try:
            poller = zmq.asyncio.Poller()
            for pub, replay in self.endpoints:
                sock = self._ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.SUBSCRIBE, self._topic)
                sock.connect(pub)
                subs.append((sock, pub, replay))
                poller.register(sock, zmq.POLLIN)
                self._next[pub] = 0
                if replay:  # what was published before this subscription took
                    await self._replay(pub, replay, 0)
            while True:
                ready = dict(await poller.poll())
                for sock, pub, replay in subs:
                    if sock not in ready:
                        continue
                    frames = await sock.recv_multipart()
                    if len(frames) != 3:
                        continue
                    seq = int.from_bytes(frames[1], "big", signed=True)
                    if seq > self._next[pub] and replay:
                        await self._replay(pub, replay, self._next[pub])
                    self._apply(pub, seq, frames[2])
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the replica keeps serving on a stale view
            self.errors += 1
            log.exception("vLLM KV-event subscriber failed; the prefix view stops updating")
        finally:
            for sock, _, _ in subs:
                sock.close(linger=0)

    def _apply(self, pub: str, seq: int, payload: bytes) -> None:
        expected = self._next[pub]
        if seq < expected:
            return  # applied already (from a replay)
        if seq > expected:
            self.gaps += seq - expected
            log.warning("vLLM KV events %d..%d lost; the prefix view may be stale", expected, seq - 1)
        batch = self._decoder.decode(payload)
        self.mirror.apply(batch.events)
        self._next[pub] = seq + 1
        self.batches += 1

    async def _replay(self, pub: str, replay: str, start: int, timeout_s: float = 5.0) -> None:
        zmq = self._zmq
        sock = self._ctx.socket(zmq.DEALER)
        sock.connect(replay)
        self.replays += 1
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await sock.poll(timeout_s * 1000):
                    log.warning("vLLM KV-event replay from %d timed out", start)
                    return
                frames = await sock.recv_multipart()
                if len(frames) < 3 or frames[-2] == END_SEQ:
                    return
                self._apply(pub, int.from_bytes(frames[-2], "big", signed=True), frames[-1])
        finally:
            sock.close(linger=0)


__all__ = ["KvEventMirror", "KvEventSubscriber"]
