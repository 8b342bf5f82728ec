"""`Maintenance`: background upkeep of the base Lance table: indexes, compaction, old versions.

`Maintenance.start()` runs `run_once()` every `interval_s` on its own daemon thread until
`stop()`, and in between, every `optimize_interval_s`, creates the cheap indexes the table
lacks (``fts_index``, ``key_index``, ``scalar_indexes``: at the first tick that finds rows,
not the next full run: until the text index exists, every text query tokenises the whole
base) and runs the ``optimize_indices`` task for the scalar indexes (BTREE, INVERTED), so
rows a flush appends are indexed within seconds (unindexed base rows are searched flat by
Lance: at tens of thousands of rows per second of ingestion, a 30 s cadence let a text
query over them take seconds). The vector index is built and optimised on a second thread
at the same cadence (tasks ``vector_index``, ``optimize_vector_index``): PQ-encoding is
~50x slower than indexing text; a first IVF_PQ build in the full run held the text index
back for its whole duration (text queries of a catch-up took 4-9 s), and a pass over a
large backlog took minutes during which the text index fell behind too. Tests and tools
call `run_once()` directly (it runs every task, the vector index's included).

Maintenance never takes a shard writer's lock and never waits for a flush: every task is
one or a few Lance commits of its own, so ingestion goes on while it runs. Lance commits are
optimistic, and a task that loses a commit race (Lance reports a commit conflict, e.g. with
a flush) is retried with exponential backoff (`CONFLICT_ATTEMPTS` times), then reported as
``conflict`` and tried again next run. A flush that loses a race against a compaction is
retried by the shard writer's own flush backoff.

Standby. The loops start tasks only while active (`set_active`, the constructors'
`active`). The sink runs one maintenance per consumer group this way: every pod starts its
loops, and only the pod that holds the group's maintenance partition is active
(`sink.maintenance_role`); the others stand by, so the pods do not race each other's
commits (in a trial with 3 pods all maintaining one table: 168 conflicts and 9 failures in
20 minutes, a cleanup failing on a version another pod's cleanup had removed, and every
index optimisation done three times). A runner set to standby finishes the task it is in
(one or a few atomic Lance commits; a lost commit race is not retried then) and starts no
other until it is active again; it then does its next full run as soon as one is due (at
once if the last was `interval_s` ago). `run_once()` called directly (tests, tools) runs
whatever the state.

Tasks, in order, each reporting `MaintenanceEvents.ran(task, outcome, seconds)` with
outcome ``done`` / ``skipped`` / ``conflict`` / ``failed``:

- ``vector_index``: once the table has `vector_index_min_rows` rows (IVF_PQ: and at least
  `PQ_TRAINING_ROWS`) and no index on the vector column: IVF_PQ or IVF_HNSW_SQ
  (`vector_index`) with the table's metric.
  `num_partitions` defaults to about sqrt(rows) (at least 1, at most rows / 256 so every
  partition can train), `num_sub_vectors` to the largest divisor of dim not above dim / 16;
  IVF_PQ's codebooks train on at most `PQ_SAMPLE_RATE` rows per code (a third of the build).
- ``fts_index``: an INVERTED index (default tokenizer, with positions for phrase queries)
  on every `fts_columns` column that has none, once the table has rows. The reader
  tokenises memtables with the same default tokenizer.
- ``key_index``: a BTREE index on a single-column primary key (fast `lookup` on the base).
- ``scalar_indexes``: the BTREE / BITMAP index of every `scalar_indexes` column that has
  none, once the table has rows (Lance pre-filters base rows with them).
- ``optimize_indices``: each index on its own, once it lacks `optimize_unindexed_rows` rows:
  scalar indexes (BTREE, INVERTED: cheap) first, the vector index (slow: PQ-encodes every
  new row) last, so a slow vector pass never delays the text index. The new rows become a
  new index segment (``num_indices_to_merge=0``: cost proportional to the new rows only; a
  merge rewrites the whole index, 2x slower for 300k new rows on a 1M-row 384-dim base);
  once an index has `MAX_INDEX_SEGMENTS` segments, the run merges them instead (bounded
  segments per query).
- ``compact``: once `compact_min_fragments` fragments are small (below
  `SMALL_FRAGMENT_ROWS`) or a fragment has `DELETED_SHARE` of its rows deleted (upsert
  tables): `compact_files`, at most `COMPACT_MAX_SOURCE_FRAGMENTS` source fragments per
  run (bounded work; Lance rewrites such a fragment without its deleted rows);
  ``skipped`` when Lance merged none (it merges only adjacent fragments covered by the
  same indexes).
- ``cleanup``: delete old table versions, see "Version retention" below.

Version retention. A shard writer's open (`BaseTable.find_flush`) reads the transaction
properties of every version above the `lance_version` in its shard manifest, to find a
flush that committed just before a crash (the crash window, I3), one version at a time
(`engine.table.flush_commits`), and stops at the newest version no longer present, so
deleting such a version would make replay flush a memtable twice. Readers
(`holds_generation`) read the versions above a running flush's commit floor. The rule,
applied to each candidate version v:

1. v is older than `cleanup_retention_s` (Lance's `older_than`, also passed to Lance) and
   at least `MIN_RETAINED_VERSIONS` below the latest (covers readers and running flushes);
2. no shard still needs it: for every flush commit found in a version w <= v (transaction
   property `lance_sink.shard`, or each shard of `lance_sink.shards` for a coalesced commit,
   `engine.table.commit_records`), the shard's manifest `lance_version` is at least w, i.e.
   that flush is recorded in its manifest and `find_flush` will never search below it.
   Versions from the first unrecorded flush on are kept until its shard's next open or
   flush records it. Shards with no commit in the candidate range cannot be affected:
   their `find_flush` finds nothing there either way.

Work per run is bounded to `CLEANUP_MAX_VERSIONS` candidate versions (their transactions
are read one by one).
"""

from __future__ import annotations

import datetime as dt
import math
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import lance
import structlog

from config.settings import MaintenanceSettings
from engine.malloc import release_free_memory
from engine.manifest import ManifestStore
from engine.schema import TableSpec
from engine.storage import Storage
from engine.table import BaseTable, commit_records, index_on, transaction_properties

log = structlog.get_logger("lance_sink.maintenance")

#: A commit that lost a race is retried this often (0.2 s, 0.4 s, 0.8 s ... apart) before
#: the task gives up until the next run; five attempts span ~6 s, well under a run interval.
CONFLICT_ATTEMPTS = 5
CONFLICT_BACKOFF_S = 0.2
#: Fragments below this many rows count as small. Flushes write one fragment per memtable
#: (default 200k rows max), so small fragments are the norm and 16 of them a good batch.
SMALL_FRAGMENT_ROWS = 100_000
#: Rows per fragment compaction aims for (Lance's default) and the most source fragments one
#: run rewrites (bounds a run's IO to ~64 small fragments).
TARGET_ROWS_PER_FRAGMENT = 1 << 20
COMPACT_MAX_SOURCE_FRAGMENTS = 64
#: A fragment with this share of its rows deleted (an upsert table's superseded and deleted
#: rows) is compacted whatever its size: Lance's own threshold for materialising deletions.
#: Until then its deleted rows cost storage and scan time, and the text index keeps counting
#: them in its BM25 statistics (docs/reads.md).
DELETED_SHARE = 0.1
#: Versions always kept below the latest, whatever their age: more than the commits that
#: can land during one flush's find/commit window on a busy table.
MIN_RETAINED_VERSIONS = 32
#: Candidate versions examined (and deleted at most) per cleanup run.
CLEANUP_MAX_VERSIONS = 500
#: PQ needs 256 training rows per partition for its 8-bit codebooks.
ROWS_PER_PARTITION_MIN = 256
#: An index with this many segments (one per optimize pass) is merged into one by the next
#: pass: each segment is searched on its own, so a query's cost grows with their number;
#: 8 segments cost a query little, and merging every 8th pass keeps the merge cost (which
#: rewrites the index) amortised.
MAX_INDEX_SEGMENTS = 8

#: How `describe_indices` names the scalar index kinds of `scalar_indexes`.
SCALAR_INDEX_TYPES = {"BTREE": "BTree", "BITMAP": "Bitmap"}

TASKS = (
    "vector_index",
    "fts_index",
    "key_index",
    "scalar_indexes",
    "optimize_indices",
    "optimize_vector_index",
    "compact",
    "cleanup",
)


class MaintenanceEvents(Protocol):
    """What maintenance reports (the sink's metrics facade implements this)."""

    def ran(self, task: str, outcome: str, seconds: float) -> None: ...

    def process_exited(self, exitcode: int | None) -> None:
        """The `MaintenanceProcess` child exited on its own (it is restarted)."""


class NoMaintenanceEvents:
    """MaintenanceEvents that records nothing."""

    def ran(self, task: str, outcome: str, seconds: float) -> None:
        return None

    def process_exited(self, exitcode: int | None) -> None:
        return None


class _Skip(Exception):
    """A task has nothing to do this run."""


def is_conflict(exc: BaseException) -> bool:
    """Does this Lance error mean "another writer committed first; retry"?"""
    text = str(exc).lower()
    return "conflict" in text or "retryable" in text


def derived_sub_vectors(dim: int) -> int:
    """The largest divisor of dim that is at most dim / 16 (at least 1)."""
    best = 1
    for d in range(1, max(dim // 16, 1) + 1):
        if dim % d == 0:
            best = d
    return best


#: Most bytes of vectors the vector index trains on (IVF kmeans and PQ: each samples
#: num_partitions x sample_rate rows; Lance's sample_rate is 256). The maintenance child
#: holds them, and copies, while it builds: uncapped, 300k 384-dim rows took it to 440-590
#: MiB (bench/memory), the issue's 660k to 1 GiB. 64 MiB caps the sample at 43,690 rows of
#: 384 floats, still 79 per partition at sqrt(300k) partitions.
MAX_TRAINING_BYTES = 64 << 20
#: Rows IVF_PQ needs to train its codebooks (256 codes per sub-vector). On fewer, Lance
#: creates an index that holds no row (measured: 255 rows, 0 indexed; 256 rows, 256), and
#: the task would never run again since the column then has an index.
PQ_TRAINING_ROWS = 256
MIN_SAMPLE_RATE = 16  # below this per-partition sample, kmeans centroids get noisy
#: Most training rows per code for IVF_PQ. Lance's one `sample_rate` also sizes the PQ
#: codebooks' training: 256 codes x sample_rate rows, each of the `num_sub_vectors`
#: sub-vectors trained by its own kmeans. At Lance's 256 that was 12.4 of a 14.8 s build of
#: 50k x 384 rows (24 sub-vectors), 9.5 of 12.5 s at 100k; at 40 (10,240 rows, faiss's
#: lower bound of 39 points a centroid) the build takes a third of the time, with the same
#: recall (bench/index_build.py). A catch-up's queries scan the base flat until the first
#: vector index exists, so its build time is theirs too.
PQ_SAMPLE_RATE = 40


def training_sample_rate(partitions: int, dim: int, *, pq: bool = False) -> int:
    """Lance's `sample_rate` for an index of `partitions` IVF partitions over `dim` floats:
    256 (Lance's default) unless that would train on more than MAX_TRAINING_BYTES, and at
    most `PQ_SAMPLE_RATE` for a PQ index (`pq`)."""
    rows = MAX_TRAINING_BYTES // (4 * dim)
    most = PQ_SAMPLE_RATE if pq else 256
    return max(MIN_SAMPLE_RATE, min(most, rows // max(partitions, 1)))


def derived_partitions(rows: int) -> int:
    """About sqrt(rows), at least 1, at most rows / 256."""
    return max(1, min(round(math.sqrt(rows)), rows // ROWS_PER_PARTITION_MIN))


class Maintenance:
    """Runs the maintenance tasks (see the module docstring).

    Lifecycle: construct after the engine opened the table; `start()` once (the sink, when
    `maintenance.enabled`); `set_active()` from any thread, any time (see "Standby"); `stop()`
    during shutdown (always safe, idempotent). A task that raises is logged and reported as
    ``failed``; the thread keeps running.
    """

    def __init__(
        self,
        spec: TableSpec,
        table: BaseTable,
        storage: Storage,
        settings: MaintenanceSettings,
        events: MaintenanceEvents | None = None,
        *,
        min_retained_versions: int = MIN_RETAINED_VERSIONS,
        now: Callable[[], dt.datetime] = dt.datetime.now,
        active: bool = True,
    ) -> None:
        """`active` False: the loops stand by until `set_active(True)` (module docstring)."""
        self.spec = spec
        self.table = table
        self.storage = storage
        self.settings = settings
        self.events: MaintenanceEvents = events or NoMaintenanceEvents()
        self._now = now
        self.min_retained_versions = max(min_retained_versions, 1)
        self._stop = threading.Event()
        self._active = threading.Event()
        if active:
            self._active.set()
        self._thread: threading.Thread | None = None
        self._vector_thread: threading.Thread | None = None
        self._unindexed = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the background thread (no-op if running)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="maintenance", daemon=True)
        self._thread.start()
        self._vector_thread = threading.Thread(
            target=self._vector_loop, name="maintenance-vector", daemon=True
        )
        self._vector_thread.start()

    def set_active(self, active: bool) -> None:
        """Run the tasks (True), or stand by after the current one (False); see "Standby"."""
        if active:
            self._active.set()
        else:
            self._active.clear()

    @property
    def active(self) -> bool:
        return self._active.is_set()

    def request_stop(self, timeout: float) -> None:
        """Ask the threads to stop after the current task, without waiting (`stop` waits);
        `timeout` is for the child process's interface (see `MaintenanceProcess`)."""
        self._stop.set()

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the thread to stop after the current task, and wait (bounded)."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for thread in (self._thread, self._vector_thread):
            if thread is not None:
                thread.join(max(deadline - time.monotonic(), 0.01))

    def _halted(self) -> bool:
        """Should the loops start no further task (stopping, or standing by)? Never for a
        `run_once()` called directly, without the threads."""
        return self._thread is not None and (self._stop.is_set() or not self._active.is_set())

    def _loop(self) -> None:
        period = min(self.settings.optimize_interval_s, self.settings.interval_s)
        next_full = time.monotonic() + self.settings.interval_s
        while not self._stop.wait(period):
            if not self._active.is_set():
                continue  # standby; the next full run is due when it is active again
            if time.monotonic() >= next_full:
                self.run_once(vector=False)
                next_full = time.monotonic() + self.settings.interval_s
            else:
                # The cheap indexes a table lacks are built at the first tick that finds
                # rows, not at the next full run: until the text index exists, every text
                # query tokenises the whole base (`engine.reads.text`).
                for name, task in self._scalar_creations().items():
                    self._run(name, task)
                self._run("optimize_indices", lambda: self.optimize_indices(vector=False))

    def _vector_loop(self) -> None:
        """The vector index on a thread of its own: it is built (minutes for a large base)
        and optimised here, so the text and scalar indexes never wait for it."""
        while not self._stop.wait(self.settings.optimize_interval_s):
            if not self._active.is_set():
                continue
            if self._run("vector_index", self.vector_index) != "skipped":
                continue
            self._run(
                "optimize_vector_index", lambda: self.optimize_indices(scalar=False, vector=True)
            )

    # ------------------------------------------------------------------ the run

    def run_once(self, *, vector: bool = True) -> dict[str, str]:
        """Run every task once; returns the outcome per task. `vector` False leaves the
        vector index to the vector thread (the loops' full runs)."""
        outcomes: dict[str, str] = {}
        tasks: dict[str, Callable[[], None]] = {
            **({"vector_index": self.vector_index} if vector else {}),
            **self._scalar_creations(),
            "optimize_indices": lambda: self.optimize_indices(vector=vector),
            "compact": self.compact,
            "cleanup": self.cleanup,
        }
        for name, task in tasks.items():
            if self._halted():
                break
            outcomes[name] = self._run(name, task)
        return outcomes

    def _scalar_creations(self) -> dict[str, Callable[[], None]]:
        """The tasks that create the cheap indexes (each skipped when they exist)."""
        return {
            "fts_index": self.fts_index,
            "key_index": self.key_index,
            "scalar_indexes": self.scalar_indexes,
        }

    def _run(self, name: str, task: Callable[[], None]) -> str:
        started = time.monotonic()
        delay = CONFLICT_BACKOFF_S
        outcome = "failed"
        for attempt in range(1, CONFLICT_ATTEMPTS + 1):
            try:
                task()
            except _Skip:
                outcome = "skipped"
            except Exception as exc:  # noqa: BLE001 - reported, never kills the thread
                if is_conflict(exc) and attempt < CONFLICT_ATTEMPTS and not self._halted():
                    log.info("maintenance_conflict", task=name, attempt=attempt, error=str(exc))
                    time.sleep(delay)
                    delay *= 2
                    continue
                outcome = "conflict" if is_conflict(exc) else "failed"
                log.warning("maintenance_failed", task=name, outcome=outcome, error=str(exc))
            else:
                outcome = "done"
            break
        seconds = time.monotonic() - started
        self.events.ran(name, outcome, seconds)
        if outcome != "skipped":
            log.info("maintenance_ran", task=name, outcome=outcome, seconds=round(seconds, 3))
            release_free_memory()  # an index build frees hundreds of MiB at once
        return outcome

    # ------------------------------------------------------------------ indexes

    def _indexes(self, ds: lance.LanceDataset) -> list[Any]:
        return list(ds.describe_indices())

    def first_indexes_built(self) -> bool:
        """Does the table have the vector index and the text indexes the settings ask for
        (the ones a catch-up's queries wait for: until they exist, every query scans the
        base flat)?"""
        ds = self.table.dataset()
        vector = self.spec.vector
        if vector is not None and index_on(ds, vector.name, None) is None:
            return False
        texts = self.spec.fts_columns if self.settings.fts_index else ()
        return all(index_on(ds, c, "Inverted") is not None for c in texts)

    def vector_index(self) -> None:
        """Create the vector index once the table is large enough."""
        vector = self.spec.vector
        if vector is None:
            raise _Skip
        ds = self.table.dataset()
        rows = ds.count_rows()
        least = self.settings.vector_index_min_rows
        if self.settings.vector_index == "IVF_PQ":
            least = max(least, PQ_TRAINING_ROWS)
        if rows < least or index_on(ds, vector.name, None):
            raise _Skip
        partitions = self.settings.num_partitions or derived_partitions(rows)
        pq = self.settings.vector_index == "IVF_PQ"
        kwargs: dict[str, Any] = {
            "num_partitions": partitions,
            "sample_rate": training_sample_rate(partitions, vector.dim, pq=pq),
        }
        if pq:
            kwargs["num_sub_vectors"] = self.settings.num_sub_vectors or derived_sub_vectors(
                vector.dim
            )
        ds.create_index(
            vector.name, self.settings.vector_index, metric=vector.metric, replace=False, **kwargs
        )

    def fts_index(self) -> None:
        """Create an INVERTED index on every FTS column that has none."""
        if not self.settings.fts_index or not self.spec.fts_columns:
            raise _Skip
        ds = self.table.dataset()
        missing = [c for c in self.spec.fts_columns if not index_on(ds, c, "Inverted")]
        if not missing or ds.count_rows() == 0:
            raise _Skip
        for column in missing:
            ds.create_scalar_index(column, "INVERTED", with_position=True)
            ds = self.table.dataset()

    def key_index(self) -> None:
        """Create a BTREE index on a single-column primary key."""
        if len(self.spec.primary_key) != 1:
            raise _Skip
        (key,) = self.spec.primary_key
        ds = self.table.dataset()
        if index_on(ds, key, "BTree") or ds.count_rows() == 0:
            raise _Skip
        ds.create_scalar_index(key, "BTREE")

    def scalar_indexes(self) -> None:
        """Create the configured BTREE / BITMAP indexes that do not exist yet."""
        wanted = self.settings.scalar_indexes
        if not wanted:
            raise _Skip
        ds = self.table.dataset()
        if ds.count_rows() == 0:
            raise _Skip
        missing = [
            (column, kind)
            for column, kind in wanted.items()
            if index_on(ds, column, SCALAR_INDEX_TYPES[kind]) is None
        ]
        if not missing:
            raise _Skip
        for column, kind in missing:
            # Named by kind: a column may carry an INVERTED index (`<column>_idx`) as well.
            ds.create_scalar_index(column, kind, name=f"{column}_{kind.lower()}")
            ds = self.table.dataset()

    def unindexed_rows(self) -> int:
        """Rows of the base not covered by its least complete index (0 without indexes),
        as of the last run."""
        return self._unindexed

    def _measure_unindexed(self, ds: lance.LanceDataset) -> int:
        indexes = self._indexes(ds)
        if not indexes:
            self._unindexed = 0
            return 0
        rows = ds.count_rows()
        covered = min(int(getattr(i, "num_rows_indexed", rows) or 0) for i in indexes)
        self._unindexed = max(rows - covered, 0)
        return self._unindexed

    def optimize_indices(self, *, scalar: bool = True, vector: bool = True) -> None:
        """Index the rows appended since each index was last built or optimised, for every
        index lacking at least `optimize_unindexed_rows` rows (see the module docstring);
        `scalar` / `vector` select which kinds of index."""
        ds = self.table.dataset()
        self._measure_unindexed(ds)
        rows = ds.count_rows()
        due = []
        for index in self._indexes(ds):
            lacking = rows - int(getattr(index, "num_rows_indexed", rows) or 0)
            if lacking >= self.settings.optimize_unindexed_rows:
                type_url = str(getattr(index, "type_url", ""))
                is_scalar = any(t in type_url for t in ("Inverted", "BTree", "Bitmap", "Zone"))
                if not (scalar if is_scalar else vector):
                    continue
                segments = len(getattr(index, "segments", None) or [1])
                due.append((not is_scalar, str(index.name), segments))
        if not due:
            raise _Skip
        for _, name, segments in sorted(due):  # scalar indexes first
            merge = MAX_INDEX_SEGMENTS if segments >= MAX_INDEX_SEGMENTS else 0
            self.table.dataset().optimize.optimize_indices(
                index_names=[name], num_indices_to_merge=merge
            )
            if self._halted():
                break
        self._measure_unindexed(self.table.dataset())

    # ------------------------------------------------------------------ compaction

    def compact(self) -> None:
        """Merge small fragments, and rewrite fragments with `DELETED_SHARE` of their rows
        deleted (bounded per run). Skipped when Lance merges none: it compacts only runs of
        adjacent fragments covered by the same indexes, so small fragments can be left that
        it will not merge (nothing committed then)."""
        ds = self.table.dataset()
        fragments = ds.get_fragments()
        small = [f for f in fragments if f.metadata.physical_rows < SMALL_FRAGMENT_ROWS]
        if len(small) < self.settings.compact_min_fragments and not any(
            map(_deletions_due, fragments)
        ):
            raise _Skip
        metrics = ds.optimize.compact_files(
            target_rows_per_fragment=TARGET_ROWS_PER_FRAGMENT,
            max_source_fragments=COMPACT_MAX_SOURCE_FRAGMENTS,
        )
        if not metrics.fragments_removed:
            raise _Skip
        log.info(
            "table_compacted",
            fragments_removed=metrics.fragments_removed,
            fragments_added=metrics.fragments_added,
        )

    # ------------------------------------------------------------------ cleanup

    def cleanup_candidates(self) -> list[int]:
        """The versions `cleanup` may delete now (see "Version retention")."""
        ds = self.table.dataset()
        latest = int(ds.version)
        cutoff = self._now() - dt.timedelta(seconds=self.settings.cleanup_retention_s)
        old = []
        for v in ds.versions():
            stamp = v["timestamp"]
            if not isinstance(stamp, dt.datetime):
                continue
            if stamp.tzinfo is not None:
                stamp = stamp.astimezone().replace(tzinfo=None)
            if stamp < cutoff and int(v["version"]) <= latest - self.min_retained_versions:
                old.append(int(v["version"]))
        old = sorted(old)[:CLEANUP_MAX_VERSIONS]
        manifests: dict[str, int] = {}
        allowed = []
        for version in old:  # oldest first; stop at the first version a shard still needs
            props = transaction_properties(ds, version) or {}
            pinned = None
            for shard in commit_records(props):  # every shard of a coalesced flush commit
                if shard not in manifests:
                    manifests[shard] = ManifestStore(self.storage, shard).latest().lance_version
                if manifests[shard] < version:
                    pinned = shard
                    break
            if pinned is not None:
                log.info(
                    "cleanup_pinned", shard=pinned, version=version, manifest=manifests[pinned]
                )
                break
            allowed.append(version)
        return allowed

    def cleanup(self) -> None:
        """Delete the versions `cleanup_candidates` allows."""
        versions = self.cleanup_candidates()
        if not versions:
            raise _Skip
        stats = self.table.dataset().cleanup_old_versions(
            older_than=dt.timedelta(seconds=self.settings.cleanup_retention_s),
            versions=versions,
            error_if_tagged_old_versions=False,
        )
        log.info(
            "versions_cleaned",
            versions=len(versions),
            through=versions[-1],
            bytes_removed=stats.bytes_removed,
        )


def _deletions_due(fragment: Any) -> bool:
    """Has `fragment` `DELETED_SHARE` of its rows deleted?"""
    meta = fragment.metadata
    return bool(meta.physical_rows) and meta.num_deletions >= DELETED_SHARE * meta.physical_rows
