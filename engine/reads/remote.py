"""The remote tier: other pods' memtables, asked over HTTP within a deadline (coordinator).

A query to any pod reads the base once and its own shards' memtables as before; the fresh
rows of every other shard live in the memtables of the pod that owns it
(`engine.reads.owners`). `RemoteTier` asks those pods for their memtable tier's part of
the query (`engine.reads.fresh` answers on the owner), relative to the coordinator's base
version, and hands the parts to the query kinds to merge.

Consistency (DESIGN.md, I18): every request carries the coordinator's base version V. The
owner takes its shard views, then opens the base at V, then keeps the memtables V does not
hold (`ShardView.fresh`, the single-process rule). A memtable flushed into a version above V
and dropped from the owner's view before it looked would be in neither; the owner sees that
(`ShardView.dropped_through` > V) and answers `stale_base` instead, and the coordinator runs
the query again on a newer snapshot (`StaleBase`). So no row is counted twice and none is
lost around a flush on another pod.

Failure: a pod that does not answer a request within `query.fanout_timeout_ms`, answers
with an error, or does not hold a shard it is listed for, makes that shard's fresh rows
missing: `MissingShard` entries, which the query reports
(`FanoutReport`) or fails on (`FreshRowsUnavailable`), as the request asks; never silently.
A pod that failed once in a query is not asked again by that query.

Wire format: request and answer are one Arrow IPC stream each; the schema metadata key
`lance_sink` holds the JSON parameters, the rows hold keys (requests) or result rows
(answers). The bearer token is the query API's own. A query of several kinds at once (a
hybrid query: vector and text) sends each owner ONE request of kind `parts`, whose rows
(column `part`) are the sub-requests, each a packed stream of its own; the owner answers
them all from one snapshot, with one packed answer per sub-request in the same order
(`RemoteTier.start_parts`), so each kind merges its answers as when it runs alone.

Lifecycle: one `Fanout` per reader (the HTTP client pool and a thread pool for the
requests), `close` shuts both down; one `RemoteTier` per query snapshot.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol

import numpy as np
import orjson
import pyarrow as pa
import structlog
import urllib3

from engine.reads.owners import Owner, ShardOwners
from engine.reads.trace import stage
from engine.schema import TableSpec

log = structlog.get_logger("lance_sink.reader")

#: Path of the internal endpoint an owner pod answers on (same port and token as the API).
FRESH_PATH = "/internal/v1/fresh"
ARROW_STREAM = "application/vnd.apache.arrow.stream"
META_KEY = b"lance_sink"
#: Times a query is run again on a newer snapshot when an owner flushed past its base
#: version meanwhile (each retry opens the latest base, which holds that flush: a second
#: retry needs another flush within the same few milliseconds).
STALE_BASE_RETRIES = 3
#: Request kind of several sub-requests in one (`RemoteTier.start_parts`), and the column of
#: its request and answer rows that holds one packed sub-request or sub-answer each.
PARTS = "parts"
PART = "part"


def pack(table: pa.Table, meta: Mapping[str, Any]) -> bytes:
    """One Arrow IPC stream: `table` with `meta` (JSON) in its schema metadata."""
    table = table.replace_schema_metadata({META_KEY: orjson.dumps(meta)})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def unpack(data: bytes) -> tuple[pa.Table, dict[str, Any]]:
    """The table and the JSON metadata of a `pack`ed stream (metadata removed)."""
    table = pa.ipc.open_stream(pa.BufferReader(data)).read_all()
    raw = (table.schema.metadata or {}).get(META_KEY, b"{}")
    meta: dict[str, Any] = orjson.loads(raw)
    return table.replace_schema_metadata(None), meta


def key_table(spec: TableSpec, keys: list[Any]) -> pa.Table:
    """The key columns of `keys` (scalars, or tuples for a composite key) as a table."""
    names = spec.primary_key
    columns: dict[str, pa.Array] = {}
    for j, name in enumerate(names):
        values = [k[j] if len(names) > 1 else k for k in keys]
        columns[name] = pa.array(values, type=spec.table_schema.field(name).type)
    return pa.table(columns)


#: Why a shard's fresh rows are missing, in one word (the metric's label): its owner did not
#: answer in time, answered with an error, does not hold the shard (rebalance, fence), or
#: recorded no URL to ask (a writer with the query API off, or of an earlier build).
Cause = Literal["timeout", "error", "unheld", "unadvertised"]


#: Why a shard listed for this process is missing.
UNHELD: Final = "listed for this process, which does not hold it now (rebalance or fence)"
#: Why a shard whose writer advertised no URL is missing.
UNADVERTISED: Final = (
    "its writer advertised no URL (query.advertised_url; its query API off, or an earlier "
    "build): its fresh rows are in no answer until they are flushed"
)


@dataclass(frozen=True, slots=True)
class MissingShard:
    """A shard whose fresh rows a query lacks, and why."""

    shard: str
    partitions: tuple[str, ...]
    owner: str
    reason: str
    cause: Cause = "error"

    def as_dict(self) -> dict[str, Any]:
        return {
            "shard": self.shard,
            "partitions": list(self.partitions),
            "owner": self.owner,
            "reason": self.reason,
        }


@dataclass
class FanoutReport:
    """What a caller wants of a query's fan-out, and what it got.

    `allow_partial`: answer without the fresh rows of shards whose owner did not answer in
    time (listed in `missing`), or fail with `FreshRowsUnavailable`.
    """

    allow_partial: bool = True
    missing: list[MissingShard] = field(default_factory=list)


class StaleBase(Exception):
    """An owner flushed past the coordinator's base version: run again on a newer snapshot."""

    def __init__(self, version: int) -> None:
        self.version = version
        super().__init__(f"an owner flushed into table version {version}")


class Fanout:
    """The HTTP client side of fan-out reads, shared by every query of a reader."""

    def __init__(
        self,
        owners: ShardOwners,
        self_url: str,
        timeout_s: float,
        token: str | None,
        workers: int,
        expected: Callable[[], Collection[str] | None] | None = None,
    ) -> None:
        """`expected`: the shards whose fresh rows every query must route (the sink's:
        one per partition of the topics it consumes), or None while they are unknown; a
        query then routes by owners read after it began (`ShardOwners.current`). Without
        `expected`, a shard claimed since the cached copy was read is in no answer until
        the copy is re-read."""
        self.owners = owners
        self.expected = expected
        self.self_url = self_url
        self.timeout_s = timeout_s
        self._headers = {"Content-Type": ARROW_STREAM, "Accept": ARROW_STREAM}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._http = urllib3.PoolManager(num_pools=64, maxsize=workers, retries=False)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="reader-fanout")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.clear()

    def tier(self, local: set[str], base_version: int, spec: TableSpec) -> RemoteTier | None:
        """The remote tier of a snapshot: every listed shard this process does not read
        itself (`local`: the shards whose view it took) and no clean close released,
        grouped by owner URL; None when there is none (local mode: no network hop).
        Missing, not asked: a shard listed for
        this process's own URL that it does not read (released in a rebalance, or fenced),
        and a shard of the expected ones (all, while they are unknown) whose writer
        advertised no URL: its fresh rows are in no answer, so the answer says so."""
        groups: dict[str, dict[str, Owner]] = {}
        missing: list[MissingShard] = []
        need: Collection[str] | None = ()
        if self.expected is not None:
            expected = self.expected()  # None: unknown yet (a pod starting)
            need = None if expected is None else [s for s in expected if s not in local]
        wanted = None if need is None or self.expected is None else set(need)
        for shard, owner in self.owners.current(need).items():
            if shard in local or owner.released:  # (released: every row is in the base)
                continue
            if not owner.url:
                if wanted is None or shard in wanted:
                    missing.append(
                        MissingShard(shard, owner.partitions, "", UNADVERTISED, "unadvertised")
                    )
            elif owner.url == self.self_url:
                missing.append(MissingShard(shard, owner.partitions, owner.url, UNHELD, "unheld"))
                self.owners.saw_epoch(shard, -1)  # a newer owner may have claimed it
            else:
                groups.setdefault(owner.url, {})[shard] = owner
        if not groups and not missing:
            return None
        tier = RemoteTier(self, groups, base_version, self.timeout_s, spec)
        for lacked in missing:
            tier.missing[lacked.shard] = lacked
        return tier

    def post(self, url: str, body: bytes, timeout_s: float) -> bytes:
        """POST `body` to an owner's fresh endpoint; the answer's body.

        Raises:
            urllib3.exceptions.HTTPError: no answer within `timeout_s`, or a broken one.
            RuntimeError: an error status (its body in the message).
        """
        response = self._http.request(
            "POST",
            url.rstrip("/") + FRESH_PATH,
            body=body,
            headers=self._headers,
            timeout=urllib3.Timeout(total=max(timeout_s, 0.001)),
            preload_content=True,
        )
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.data[:300]!r}")
        return bytes(response.data)


class RemoteTier:
    """The other pods' memtables, as one query snapshot sees them (see the module docstring).

    `ask` sends one request to every owner pod at once and gathers their answers for at most
    `timeout_s` (`query.fanout_timeout_ms`); what did not come is recorded in `missing`, and
    a pod that missed it is not asked again by this query, so a stopped pod costs a query
    one timeout at most.
    """

    def __init__(
        self,
        fanout: Fanout,
        groups: dict[str, dict[str, Owner]],
        base_version: int,
        timeout_s: float,
        spec: TableSpec,
    ) -> None:
        self.fanout = fanout
        self.groups = groups
        self.base_version = base_version
        self.timeout_s = timeout_s
        self.spec = spec
        self.missing: dict[str, MissingShard] = {}
        self._failed: set[str] = set()

    @property
    def shards(self) -> int:
        return sum(len(g) for g in self.groups.values())

    def start(
        self,
        meta: dict[str, Any],
        keys: pa.Table | None = None,
        only: set[str] | None = None,
    ) -> PendingAsk:
        """Send `meta` (and `keys`) to every owner pod (or those of `only`, by URL) that
        has not failed this query."""
        futures: dict[str, Future[bytes]] = {}
        deadline = time.monotonic() + self.timeout_s
        for url, shards in self.groups.items():
            if url in self._failed or (only is not None and url not in only):
                continue
            request = {
                **meta,
                "base_version": self.base_version,
                "shards": {s: o.epoch for s, o in shards.items()},
            }
            body = pack(keys if keys is not None else pa.table({}), request)
            try:
                futures[url] = self.fanout._pool.submit(self.fanout.post, url, body, self.timeout_s)
            except RuntimeError:  # the reader is closed
                self._fail(url, "the reader is closed", cause="error")
        return PendingAsk(self, futures, deadline)

    def start_parts(self, metas: list[dict[str, Any]]) -> list[Asked]:
        """Send every owner pod ONE request holding each of `metas` (a sub-request each;
        none with keys), which the owner answers from one snapshot; one `Asked` per
        sub-request, in order, whose `result` is that sub-request's answers. The answers
        are gathered once, by whichever `result` is called first (from any thread)."""
        parts = pa.array([pack(pa.table({}), meta) for meta in metas], pa.binary())
        shared = SharedAsk(self.start({"kind": PARTS}, pa.table({PART: parts})))
        return [PartAsk(shared, i) for i in range(len(metas))]

    def ask(self, meta: dict[str, Any], keys: pa.Table | None = None) -> list[RemoteAnswer]:
        return self.start(meta, keys).result()

    def decides(self, keys: list[Any]) -> np.ndarray:
        """For each key: does a remote memtable hold it (so a base row of it is hidden)?"""
        out = np.zeros(len(keys), dtype=bool)
        if not keys:
            return out
        for answer in self.ask({"kind": "decides"}, key_table(self.spec, keys)):
            mask = answer.table.column("decided").to_numpy(zero_copy_only=False)
            out |= mask.astype(bool)
        return out

    def _fail(
        self, url: str, reason: str, shards: list[str] | None = None, *, cause: Cause
    ) -> None:
        if shards is None:
            self._failed.add(url)
            # Gone (drained: it released them; killed: another pod will claim them) or slow.
            self.fanout.owners.recheck(list(self.groups[url]))
        for shard in shards if shards is not None else list(self.groups[url]):
            owner = self.groups[url][shard]
            self.missing.setdefault(
                shard, MissingShard(shard, owner.partitions, url, reason, cause)
            )
        log.warning("fanout_owner_missing", owner=url, reason=reason, shards=shards)

    def _gather(self, futures: dict[str, Future[bytes]], deadline: float) -> list[RemoteAnswer]:
        out = []
        for url, future in futures.items():
            remaining = deadline - time.monotonic()
            try:
                with stage("fanout_wait"):
                    data = future.result(timeout=max(remaining, 0.0))
            except (FutureTimeout, urllib3.exceptions.TimeoutError):
                # Whichever fires first: this wait, or the request's own socket timeout.
                future.cancel()
                self._fail(url, f"no answer within {self.timeout_s * 1000:.0f} ms", cause="timeout")
                continue
            except Exception as exc:  # noqa: BLE001 - any failure of one owner is "missing"
                self._fail(url, f"{type(exc).__name__}: {exc}", cause="error")
                continue
            try:
                table, meta = unpack(data)
            except Exception as exc:  # noqa: BLE001 - a broken answer is a missing one
                self._fail(url, f"unreadable answer: {exc}", cause="error")
                continue
            for shard, epoch in meta.get("served", {}).items():
                self.fanout.owners.saw_epoch(shard, int(epoch))
            refused = meta.get("refused", {})
            for shard, reason in refused.items():
                self.fanout.owners.saw_epoch(shard, -1)  # listed owner does not hold it
                self._fail(url, str(reason), [shard], cause="unheld")
            stale = meta.get("stale_base")
            if stale is not None:
                raise StaleBase(int(stale))
            out.append(RemoteAnswer(url, table, meta))
        return out


@dataclass(frozen=True, slots=True)
class RemoteAnswer:
    """One owner pod's answer: its rows and its JSON metadata."""

    owner: str
    table: pa.Table
    meta: dict[str, Any]


@dataclass(frozen=True, slots=True)
class PendingAsk:
    """Requests on their way; `result` waits for them until the query's deadline."""

    tier: RemoteTier
    futures: dict[str, Future[bytes]]
    deadline: float

    def result(self) -> list[RemoteAnswer]:
        return self.tier._gather(self.futures, self.deadline)


class Asked(Protocol):
    """Requests on their way to the owner pods (`PendingAsk`, or one part of a `parts`
    request: `PartAsk`); `result` waits for the answers until the query's deadline.

    Raises:
        StaleBase: an owner flushed past the request's base version.
    """

    def result(self) -> list[RemoteAnswer]: ...


class SharedAsk:
    """A `PendingAsk` whose answers several threads wait for: gathered once, by the first
    caller; every caller gets them (or the same `StaleBase`)."""

    def __init__(self, pending: PendingAsk) -> None:
        self._pending = pending
        self._lock = threading.Lock()
        self._answers: list[RemoteAnswer] | None = None
        self._error: StaleBase | None = None

    def result(self) -> list[RemoteAnswer]:
        with self._lock:
            if self._answers is None and self._error is None:
                try:
                    self._answers = self._pending.result()
                except StaleBase as exc:
                    self._error = exc
        if self._error is not None:
            raise StaleBase(self._error.version) from self._error
        assert self._answers is not None
        return self._answers


@dataclass(frozen=True, slots=True)
class PartAsk:
    """Sub-request `index` of a `parts` request: each owner's answer to it alone."""

    shared: SharedAsk
    index: int

    def result(self) -> list[RemoteAnswer]:
        out = []
        for answer in self.shared.result():
            try:
                table, meta = unpack(answer.table.column(PART)[self.index].as_py())
            except Exception as exc:  # noqa: BLE001 - a broken answer is a missing one
                tier = self.shared._pending.tier
                tier._fail(answer.owner, f"unreadable answer part: {exc}", cause="error")
                continue
            out.append(RemoteAnswer(answer.owner, table, {**answer.meta, **meta}))
        return out


@dataclass(frozen=True, slots=True)
class Started:
    """A query kind's search begun on a snapshot (its base search running): `request` is
    what it asks each owner pod in a first round (None: there is no owner pod to ask), and
    `finish` completes the search with those owners' answers (None: none asked)."""

    request: dict[str, Any] | None
    finish: Callable[[Asked | None], pa.Table]

    def alone(self, remote: RemoteTier | None) -> pa.Table:
        """The search with its own request to the owner pods."""
        if remote is None or self.request is None:
            return self.finish(None)
        return self.finish(remote.start(self.request))
