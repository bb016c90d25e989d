"""Trace replays: block-id JSONL (Mooncake: ids per 512-token block; Qwen-Bailian: ids per
16-token block, with chat sessions) and timing-only CSVs (Azure).

Both are open loop: arrival = trace time / ``time_scale`` (``time_scale`` 2 replays twice as
fast), and requests arriving at or after ``duration_s`` are dropped (pass ``math.inf`` for the
whole trace). Files are read and validated when the workload is built: a missing file raises
``WorkloadError`` naming the path, a malformed line one naming ``file:line``. Request content
(block hashes) is built lazily by ``initial()``. rids follow arrival order (a stable sort of the
trace by time). A file ending in ``.gz`` is read through gzip. Public traces that are too big to
commit are known by name (``KNOWN_TRACES``, e.g. ``trace:mooncake-toolagent``) and looked up in
the shared traces folder; docs/traces.md says where each comes from and how to fetch it.
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import os
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

import numpy as np

from fairway.hashing import DEFAULT_BLOCK_SIZE, HashState, expand_trace_block, salt_seed
from fairway.request import RequestSpec, Workload, WorkloadError
from workloads.content import (
    LogNormalLen,
    ZipfChoice,
    random_tokens,
    segment_rng,
)

MOONCAKE_BLOCK_TOKENS = 512
BAILIAN_BLOCK_TOKENS = 16


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One trace request: time in trace seconds, lengths, prefix block ids (block-id traces),
    and the conversation it belongs to where the trace says (``session`` -1: unknown)."""

    time_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()
    session: int = -1
    turn: int = 0
    kind: str = "trace"


def _open_text(path: Path) -> TextIO:
    try:
        if path.name.lower().endswith(".gz"):
            return gzip.open(path, "rt", encoding="utf-8", newline="")
        return path.open(encoding="utf-8", newline="")
    except FileNotFoundError:
        raise WorkloadError(f"trace file not found: {path}") from None
    except OSError as e:
        raise WorkloadError(f"cannot read trace file {path}: {e.strerror or e}") from None


def _int_field(obj: dict, key: str, lo: int, where: str) -> int:
    if key not in obj:
        raise WorkloadError(f"{where}: missing field {key!r}")
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise WorkloadError(f"{where}: field {key!r} must be an integer, got {v!r}")
    if v < lo:
        raise WorkloadError(f"{where}: field {key!r} must be >= {lo}, got {v}")
    return v


def _json_lines(path: Path) -> Iterator[tuple[str, dict]]:
    """``(file:line, object)`` for each non-blank line of a JSONL file."""
    with _open_text(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise WorkloadError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise WorkloadError(f"{where}: expected a JSON object")
            yield where, obj


def _timestamp(obj: dict, where: str) -> float:
    ts = obj.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not (math.isfinite(ts) and ts >= 0):
        raise WorkloadError(f"{where}: field 'timestamp' must be a number >= 0, got {ts!r}")
    return float(ts)


def _hash_ids(obj: dict, where: str, n_in: int, block_tokens: int, *, exact: bool) -> tuple[int, ...]:
    """The ``hash_ids`` list: ``ceil(n_in / block_tokens)`` ids, or (not ``exact``) at most that."""
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in ids):
        raise WorkloadError(f"{where}: field 'hash_ids' must be a list of integers >= 0")
    want = -(-n_in // block_tokens)
    if len(ids) > want or (exact and len(ids) != want):
        raise WorkloadError(
            f"{where}: {len(ids)} hash_ids for input_length {n_in}; expected "
            f"{'' if exact else 'at most '}{want} (one per {block_tokens}-token block)"
        )
    return tuple(ids)


def read_mooncake(path: str | Path) -> list[TraceRow]:
    """Parse a Mooncake JSONL trace: ``timestamp`` (ms), ``input_length``, ``output_length``,
    ``hash_ids`` (one id per 512-token block, so ``len == ceil(input_length / 512)``).

    Blank lines are skipped. ``output_length`` 0 is read as 1 (an engine always emits the first
    token). Mooncake names no sessions: ``session`` stays -1. O(file size).
    """
    path = Path(path)
    rows: list[TraceRow] = []
    for where, obj in _json_lines(path):
        ts = _timestamp(obj, where)
        n_in = _int_field(obj, "input_length", 1, where)
        n_out = _int_field(obj, "output_length", 0, where)
        ids = _hash_ids(obj, where, n_in, MOONCAKE_BLOCK_TOKENS, exact=True)
        rows.append(TraceRow(ts / 1000.0, n_in, max(n_out, 1), ids))
    return rows


def read_bailian(path: str | Path) -> list[TraceRow]:
    """Parse a Qwen-Bailian JSONL trace (alibaba-edu/qwen-bailian-usagetraces-anon, README):
    ``chat_id``, ``parent_chat_id`` (-1 for a first request), ``timestamp`` (seconds),
    ``input_length``, ``output_length``, ``type`` (text/search/image/file), ``turn``,
    ``hash_ids`` (one id per 16-token block).

    ``session`` is the conversation: requests linked through ``parent_chat_id`` share one,
    numbered 0, 1, ... in the order the conversations first appear (by time). A parent missing
    from the file (before the window) still joins its children. ``kind`` is the ``type``.
    Upstream hashes each block's content on its own, not its prefix, so an id can recur under a
    different prefix; the replay chains ids, so only equal prefixes share engine blocks. At most
    ``ceil(input_length / 16)`` ids are accepted (the README does not promise exactly that
    many; blocks without an id get unique content). O(file size).
    """
    path = Path(path)
    raw: list[tuple[float, int, int, tuple[int, ...], int, int, int, str]] = []
    parent_of: dict[int, int] = {}
    for where, obj in _json_lines(path):
        ts = _timestamp(obj, where)
        chat = _int_field(obj, "chat_id", 0, where)
        parent = _int_field(obj, "parent_chat_id", -1, where) if "parent_chat_id" in obj else -1
        n_in = _int_field(obj, "input_length", 1, where)
        n_out = _int_field(obj, "output_length", 0, where)
        turn = _int_field(obj, "turn", 0, where) if "turn" in obj else 1
        kind = obj.get("type", "trace")
        if not isinstance(kind, str) or not kind:
            raise WorkloadError(f"{where}: field 'type' must be a non-empty string, got {kind!r}")
        ids = _hash_ids(obj, where, n_in, BAILIAN_BLOCK_TOKENS, exact=False)
        parent_of.setdefault(chat, parent)
        raw.append((ts, n_in, max(n_out, 1), ids, chat, parent, turn, kind))
    root_of: dict[int, int] = {}

    def root(chat: int) -> int:
        """The first request of ``chat``'s conversation, following ``parent_of``; amortised
        O(1) (path compression)."""
        walk: list[int] = []
        seen: set[int] = set()
        while chat not in root_of:
            walk.append(chat)
            seen.add(chat)
            up = parent_of.get(chat, -1)
            if up < 0 or up in seen:  # a first request, a parent before the window, or a cycle
                root_of[chat] = chat
                break
            chat = up
        r = root_of[chat]
        for c in walk:
            root_of[c] = r
        return r

    roots = [root(parent) if parent >= 0 else root(chat) for _, _, _, _, chat, parent, _, _ in raw]
    session_of: dict[int, int] = {}
    for i in sorted(range(len(raw)), key=lambda i: raw[i][0]):  # stable: ties keep file order
        session_of.setdefault(roots[i], len(session_of))
    rows: list[TraceRow] = []
    for (ts, n_in, n_out, ids, _, _, turn, kind), r in zip(raw, roots, strict=True):
        rows.append(TraceRow(ts, n_in, n_out, ids, session_of[r], turn, kind))
    return rows


def _parse_time(text: str, where: str) -> float:
    """Seconds from ``YYYY-MM-DD HH:MM:SS[.fraction]`` (UTC assumed) or a plain number."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    main, _, frac = text.partition(".")
    try:
        dt = datetime.fromisoformat(main).replace(tzinfo=UTC)
        return dt.timestamp() + (float("0." + frac) if frac else 0.0)
    except ValueError:
        raise WorkloadError(f"{where}: bad TIMESTAMP {text!r}") from None


AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def read_azure(path: str | Path) -> list[TraceRow]:
    """Parse a timing-only CSV trace (Azure LLM inference 2023 format): a header naming
    ``TIMESTAMP,ContextTokens,GeneratedTokens`` (any order, extra columns ignored), then one row
    per request. Times are made relative to the earliest row. ``GeneratedTokens`` 0 is read as
    1. O(file size).
    """
    path = Path(path)
    rows: list[TraceRow] = []
    with _open_text(path) as f:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            raise WorkloadError(f"{path}:1: empty file, expected a header") from None
        header = [h.strip() for h in header]
        missing = [c for c in AZURE_COLUMNS if c not in header]
        if missing:
            raise WorkloadError(f"{path}:1: header lacks column(s) {', '.join(missing)}")
        i_t, i_c, i_g = (header.index(c) for c in AZURE_COLUMNS)
        width = max(i_t, i_c, i_g) + 1
        for fields in reader:
            lineno = reader.line_num
            if not fields or all(not x.strip() for x in fields):
                continue
            where = f"{path}:{lineno}"
            if len(fields) < width:
                raise WorkloadError(f"{where}: expected {len(header)} fields, got {len(fields)}")
            t = _parse_time(fields[i_t], where)
            try:
                ctx = int(fields[i_c])
                gen = int(fields[i_g])
            except ValueError:
                raise WorkloadError(f"{where}: token counts must be integers") from None
            if ctx < 1 or gen < 0:
                raise WorkloadError(
                    f"{where}: need ContextTokens >= 1 and GeneratedTokens >= 0, got {ctx}, {gen}"
                )
            rows.append(TraceRow(t, ctx, max(gen, 1)))
    if rows:
        t0 = min(r.time_s for r in rows)
        rows = [TraceRow(r.time_s - t0, r.input_tokens, r.output_tokens) for r in rows]
    return rows


class _TraceWorkload(Workload):
    closed_loop = False

    def __init__(
        self,
        rows: list[TraceRow],
        rng: np.random.Generator,
        *,
        block_size: int,
        time_scale: float,
        duration_s: float,
    ) -> None:
        if block_size < 1:
            raise WorkloadError(f"block_size must be >= 1, got {block_size}")
        if not (time_scale > 0 and math.isfinite(time_scale)):
            raise WorkloadError(f"time_scale must be a positive finite number, got {time_scale!r}")
        if not duration_s > 0:
            raise WorkloadError(f"duration_s must be > 0, got {duration_s!r}")
        rows = sorted(rows, key=lambda r: r.time_s)  # stable: ties keep file order
        self.rows = [r for r in rows if r.time_s / time_scale < duration_s]
        self.arrivals = np.array([r.time_s / time_scale for r in self.rows], dtype=np.float64)
        self.block_size = block_size
        self.time_scale = time_scale
        self.duration_s = duration_s
        self._seed = int(rng.integers(0, 2**63 - 1))

    def __len__(self) -> int:
        return len(self.rows)


class BlockTraceWorkload(_TraceWorkload):
    """Replay of a trace that names prompt content by block ids (Mooncake, Qwen-Bailian).

    Each ``trace_block_tokens``-token trace block becomes ``trace_block_tokens // block_size``
    engine blocks via ``fairway.hashing.expand_trace_block``, chained through the whole prompt,
    so requests with equal leading ``hash_ids`` get equal leading engine hashes (and an id met
    again under another prefix does not). The partial last trace block gives
    ``floor(remaining / block_size)`` sub-blocks: the first ones of that id's full expansion, so
    a request whose last block is partial shares them with one where it is full. The prompt
    tokens past the ids, and the output tokens, get unique random content. ``session``,
    ``turn`` and ``kind`` come from the rows. Traces carry no token ids, so ``keep_tokens`` is
    not supported.
    """

    def __init__(
        self,
        rows: list[TraceRow],
        rng: np.random.Generator,
        *,
        trace_block_tokens: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        time_scale: float = 1.0,
        duration_s: float = math.inf,
    ) -> None:
        if block_size < 1 or trace_block_tokens % block_size:
            raise WorkloadError(
                f"block_size must divide {trace_block_tokens} to replay a trace of "
                f"{trace_block_tokens}-token blocks, got {block_size}"
            )
        super().__init__(rows, rng, block_size=block_size, time_scale=time_scale, duration_s=duration_s)
        self.trace_block_tokens = trace_block_tokens

    def initial(self) -> Iterator[RequestSpec]:
        """Specs in arrival order. O(distinct (prefix, trace block) pairs * trace block /
        block_size) hashing, memoised per ``(parent hash, trace id)`` when a trace block spans
        several engine blocks (not when it is one: one hash costs less than the memo's memory on
        a long trace of 16-token blocks), plus O(tokens) for unique tails."""
        bs = self.block_size
        tb = self.trace_block_tokens
        n_sub = tb // bs
        root = salt_seed(None)
        rng = np.random.default_rng(self._seed)
        memo: dict[tuple[int, int], list[int]] = {}
        for rid, row in enumerate(self.rows):
            hashes: list[int] = []
            parent = root
            last = len(row.hash_ids) - 1
            for j, tid in enumerate(row.hash_ids):
                if n_sub == 1:
                    full = expand_trace_block(parent, tid, 1)
                else:
                    key = (parent, tid)
                    full = memo.get(key)
                    if full is None:
                        full = expand_trace_block(parent, tid, n_sub)
                        memo[key] = full
                if j < last:
                    hashes.extend(full)
                    parent = full[-1]
                else:
                    k = (row.input_tokens - tb * last) // bs
                    hashes.extend(full[:k])
            tail = HashState(
                bs,
                hashes[-1] if hashes else root,
                random_tokens(rng, row.input_tokens - bs * len(hashes)),
                [],
            )
            tail.extend(random_tokens(rng, row.output_tokens))
            hashes.extend(tail.hashes)
            yield RequestSpec(
                rid=rid,
                arrival_s=float(self.arrivals[rid]),
                prompt_tokens=row.input_tokens,
                output_tokens=row.output_tokens,
                block_hashes=tuple(hashes),
                session=row.session,
                turn=row.turn,
                kind=row.kind,
            )


class _BlockTraceFile(BlockTraceWorkload):
    """A ``BlockTraceWorkload`` read from a file in one trace format: subclasses name the
    format (``label``), its block size (``block_tokens``) and its reader. The block size is
    checked before the file is read."""

    label: str
    block_tokens: int

    @staticmethod
    def read(path: str | Path) -> list[TraceRow]:
        raise NotImplementedError

    def __init__(
        self,
        path: str | Path,
        rng: np.random.Generator,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        time_scale: float = 1.0,
        duration_s: float = math.inf,
    ) -> None:
        if block_size < 1 or self.block_tokens % block_size:  # before reading the file
            raise WorkloadError(
                f"block_size must divide {self.block_tokens} to replay a {self.label} trace, got {block_size}"
            )
        super().__init__(
            self.read(path),
            rng,
            trace_block_tokens=self.block_tokens,
            block_size=block_size,
            time_scale=time_scale,
            duration_s=duration_s,
        )
        self.path = Path(path)


class MooncakeTraceWorkload(_BlockTraceFile):
    """Replay of a Mooncake trace (512-token blocks, no sessions). Kind: ``trace``."""

    name = "mooncake"
    label = "Mooncake"
    block_tokens = MOONCAKE_BLOCK_TOKENS
    read = staticmethod(read_mooncake)


class BailianTraceWorkload(_BlockTraceFile):
    """Replay of a Qwen-Bailian trace (16-token blocks; sessions from ``parent_chat_id``).
    Kinds: the trace's request ``type`` (text, search, image, file)."""

    name = "bailian"
    label = "Qwen-Bailian"
    block_tokens = BAILIAN_BLOCK_TOKENS
    read = staticmethod(read_bailian)


@dataclass(frozen=True, slots=True)
class PrefixModel:
    """Prefix structure for a timing-only trace, which has lengths but no content.

    Each request, in arrival order:
    - with probability ``followup_prob``, continues an open conversation: its prompt is that
      conversation's last request's whole sequence (prompt + output) plus new unique tokens.
      Candidates are the ``window`` most recently created open conversations whose sequence is
      at most ``ContextTokens - min_new_tokens`` long; one is chosen uniformly. A conversation
      is continued at most once per turn; if none fits, the request starts a new one.
    - otherwise starts a conversation: a Zipf(``zipf_s``)-chosen one of ``n_system_prompts``
      shared system prompts (``system_len`` tokens, cut to leave ``min_new_tokens`` unique
      tokens), then unique tokens up to ``ContextTokens``.

    Why: conversation services reuse (a) per-application system prompts with skewed popularity
    and (b) the growing history of multi-turn chats. The conversation CSV has no session ids,
    so ``followup_prob`` = 0.5 is an assumption, not a measurement: the realised share is lower
    because a follow-up must be longer than a candidate's history (count ``conv-turn`` kinds).
    System prompts are median 400 tokens, against the Azure conversation median context of
    ~1,000: shared but not dominant.
    """

    followup_prob: float = 0.5
    window: int = 64
    n_system_prompts: int = 32
    zipf_s: float = 1.0
    system_len: LogNormalLen = LogNormalLen(400, 0.6, 32, 2_048)
    min_new_tokens: int = 16

    def __post_init__(self) -> None:
        if not (
            0 <= self.followup_prob <= 1
            and self.window >= 1
            and self.n_system_prompts >= 1
            and self.min_new_tokens >= 1
        ):
            raise WorkloadError(f"bad prefix model {self!r}")


@dataclass(slots=True)
class _Tail:
    session: int
    turn: int
    state: HashState  # whole sequence so far (prompt + output)
    tokens: np.ndarray | None


class TimingTraceWorkload(_TraceWorkload):
    """Replay of a timing-only CSV trace (Azure 2023 format) with a ``PrefixModel``.

    Kinds: ``conv-start`` (new conversation behind a shared system prompt) and ``conv-turn``
    (continues an earlier request's whole sequence). ``session``/``turn`` name the conversation.
    """

    name = "azure"

    def __init__(
        self,
        path: str | Path,
        rng: np.random.Generator,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        time_scale: float = 1.0,
        duration_s: float = math.inf,
        keep_tokens: bool = False,
        prefix: PrefixModel | None = None,
    ) -> None:
        super().__init__(
            read_azure(path),
            rng,
            block_size=block_size,
            time_scale=time_scale,
            duration_s=duration_s,
        )
        self.path = Path(path)
        self.keep_tokens = keep_tokens
        self.prefix = p = prefix or PrefixModel()
        self._content_seed = int(rng.integers(0, 2**63 - 1))
        self._zipf = ZipfChoice(p.n_system_prompts, p.zipf_s)
        self.system_lengths = p.system_len.sample(
            segment_rng(self._content_seed, 0), p.n_system_prompts
        )
        self._system: dict[int, tuple[HashState, np.ndarray]] = {}

    def _system_prompt(self, k: int) -> tuple[HashState, np.ndarray]:
        hit = self._system.get(k)
        if hit is None:
            toks = random_tokens(segment_rng(self._content_seed, 1, k), self.system_lengths[k])
            st = HashState.start(self.block_size)
            st.extend(toks)
            hit = self._system[k] = (st, toks)
        return hit

    def initial(self) -> Iterator[RequestSpec]:
        """Specs in arrival order. O(window) per request to pick a conversation, O(new tokens)
        hashing; system prompts are hashed once."""
        p = self.prefix
        bs = self.block_size
        rng = np.random.default_rng(self._seed)
        tails: deque[_Tail] = deque(maxlen=p.window)
        n_sessions = 0
        for rid, row in enumerate(self.rows):
            ctx, out_len = row.input_tokens, row.output_tokens
            tail: _Tail | None = None
            if rng.random() < p.followup_prob:
                limit = ctx - p.min_new_tokens
                cands = [i for i, t in enumerate(tails) if t.state.n_tokens <= limit]
                if cands:
                    i = cands[int(rng.integers(len(cands)))]
                    tail = tails[i]
                    del tails[i]
            if tail is not None:
                tail.turn += 1
                new = random_tokens(rng, ctx - tail.state.n_tokens)
                state = tail.state  # owned: the tail left the deque
                prefix_tokens = tail.tokens
                kind = "conv-turn"
            else:
                k = int(self._zipf.sample(rng))
                sys_state, sys_tokens = self._system_prompt(k)
                shared = min(int(sys_tokens.size), max(0, ctx - p.min_new_tokens))
                if shared == sys_tokens.size:
                    state = sys_state.copy()
                else:
                    state = HashState.start(bs)
                    state.extend(sys_tokens[:shared])
                prefix_tokens = sys_tokens[:shared]
                new = random_tokens(rng, ctx - shared)
                tail = _Tail(n_sessions, 0, state, None)
                n_sessions += 1
                kind = "conv-start"
            state.extend(new)
            output = random_tokens(rng, out_len)
            state.extend(output)
            prompt_ids = None
            if self.keep_tokens:
                base = prefix_tokens if prefix_tokens is not None else np.empty(0, np.uint32)
                prompt_ids = np.concatenate([base, new])
                tail.tokens = np.concatenate([prompt_ids, output])
            tail.state = state
            tails.append(tail)
            yield RequestSpec(
                rid=rid,
                arrival_s=float(self.arrivals[rid]),
                prompt_tokens=ctx,
                output_tokens=out_len,
                block_hashes=tuple(state.hashes),
                session=tail.session,
                turn=tail.turn,
                kind=kind,
                tokens=prompt_ids,
            )


#: Public traces by name: the file each is kept as in the shared traces folder
#: (``trace_dir()``). docs/traces.md gives each one's source, licence and fetch step.
KNOWN_TRACES: dict[str, str] = {
    "mooncake-synthetic": "mooncake_synthetic_trace.jsonl",
    "mooncake-conversation": "mooncake_conversation_trace.jsonl",
    "mooncake-toolagent": "mooncake_toolagent_trace.jsonl",
    "azure-conv": "azure2023_AzureLLMInferenceTrace_conv.csv",
    "bailian-a": "qwen_traceA_blksz_16.jsonl",
    "bailian-b": "qwen_traceB_blksz_16.jsonl",
    "bailian-coder": "qwen_coder_blksz_16.jsonl",
    "bailian-thinking": "qwen_thinking_blksz_16.jsonl",
}


TRACE_DIR_ENV = "FAIRWAY_TRACE_DIR"


def trace_dir() -> Path:
    """Where named traces are looked up: ``$FAIRWAY_TRACE_DIR`` if set (read at each call),
    else the shared traces folder, ``shared/traces`` beside the repository (a worktree's
    ``../shared`` links to it)."""
    env = os.environ.get(TRACE_DIR_ENV)
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "traces"


def resolve_trace(name_or_path: str | Path) -> Path:
    """A ``KNOWN_TRACES`` name (or its file name, gzipped or not) in ``trace_dir()``, else
    the path as given. A named trace that is absent raises ``WorkloadError`` saying where it
    was looked for and where to read how to fetch it."""
    text = str(name_or_path)
    if text not in KNOWN_TRACES:
        return Path(name_or_path)
    base = trace_dir() / KNOWN_TRACES[text]
    for cand in (base, base.with_name(base.name + ".gz")):
        if cand.exists():
            return cand
    raise WorkloadError(
        f"trace {text!r} not found: expected {base} (or .gz); docs/traces.md says how to fetch it"
    )


def _is_bailian(path: Path) -> bool:
    """Whether a JSONL trace is in the Qwen-Bailian format: its first record has ``chat_id``."""
    for _, obj in _json_lines(path):
        return "chat_id" in obj
    return False


def trace_workload(
    path: str | Path,
    rng: np.random.Generator,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    time_scale: float = 1.0,
    duration_s: float = math.inf,
    keep_tokens: bool = False,
) -> Workload:
    """A replay of ``path`` (or a ``KNOWN_TRACES`` name), chosen by suffix (after a ``.gz``):
    ``.jsonl`` block ids, Qwen-Bailian if its first record has ``chat_id``, else Mooncake;
    ``.csv`` timing-only (Azure)."""
    path = resolve_trace(path)
    name = path.name.lower()
    suffix = Path(name[:-3] if name.endswith(".gz") else name).suffix
    if suffix == ".jsonl":
        if keep_tokens:
            raise WorkloadError(
                f"{path}: block-id traces carry no token ids, so keep_tokens is not supported"
            )
        cls = BailianTraceWorkload if _is_bailian(path) else MooncakeTraceWorkload
        return cls(path, rng, block_size=block_size, time_scale=time_scale, duration_s=duration_s)
    if suffix == ".csv":
        return TimingTraceWorkload(
            path,
            rng,
            block_size=block_size,
            time_scale=time_scale,
            duration_s=duration_s,
            keep_tokens=keep_tokens,
        )
    raise WorkloadError(
        f"unknown trace format {path}: expected a .jsonl (Mooncake, Qwen-Bailian) or .csv file, "
        f"or one of {', '.join(sorted(KNOWN_TRACES))}"
    )
