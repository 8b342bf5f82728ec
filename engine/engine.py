"""The engine of one process: the table, the WAL storage, the backpressure controller, the
flush pool and the WAL scheduler (`engine.wal_scheduler`: the WAL workers and their timer)
shared by every shard writer it opens.

Lifecycle: build with `Engine.from_settings` (or the constructor), call `open_shard` per
topic-partition the process owns (the sink does so on assign), `close_shard` when it loses
it, and `close` once at shutdown (it closes the writers, then stops the flush pool and the
WAL scheduler). Several shards write to the same Lance table. From the first open on, the
engine sweeps the WAL storage's claim board (`engine.claim_board`) on the probe lane: its
idle writers learn of another process's claim from one listing, not each from its own.
"""

from __future__ import annotations

import threading
import time
from typing import Final

import structlog

from config.settings import Settings
from engine.backpressure import BackpressureController, build_controller
from engine.claim_board import SAFETY_PROBE_S, ClaimBoard
from engine.coalesce import CoalesceLimits
from engine.errors import AmbiguousShard
from engine.flusher import Flusher
from engine.manifest import ShardOrigin
from engine.memtable import SealLimits
from engine.schema import TableSpec
from engine.shard import IDLE_WAKE_S, ShardWriter, WriterConfig
from engine.shard_ids import ShardFolders, legacy_shard_ids, moved_shard_ids, shard_id
from engine.shard_stats import EngineEvents
from engine.storage import Storage, canonical_uri, open_storage
from engine.table import BaseTable
from engine.wal_scheduler import DEFAULT_FENCE_PROBES_PER_S, ScheduledShard, WalScheduler

log = structlog.get_logger("lance_sink.engine")

#: How long one listing of the WAL storage root serves the opens looking for a moved
#: shard id (`Engine._shard_folders`): the opens of one assignment share it.
SHARD_FOLDERS_TTL_S: Final = 60.0


def writer_config(settings: Settings) -> WriterConfig:
    """The shard writer tuning from the settings tree."""
    return WriterConfig(
        limits=SealLimits(
            max_rows=settings.memtable.max_rows,
            max_bytes=int(settings.memtable.max_bytes),
            max_batches=settings.memtable.max_batches,
        ),
        max_wal_flush_interval_s=settings.wal.max_wal_flush_interval_ms / 1000,
        max_wal_buffer_bytes=int(settings.wal.max_wal_buffer_size),
        flush_retry_initial_s=settings.flush.retry_initial_backoff_ms / 1000,
        flush_retry_max_s=settings.flush.retry_max_backoff_ms / 1000,
        flush_max_attempts=settings.flush.max_attempts,
        fence_check_interval_s=settings.wal.fence_check_interval_ms / 1000,
        max_age_s=settings.memtable.max_age_s,
        advertised_url=settings.query.advertised_url or "",
    )


def coalesce_limits(settings: Settings) -> CoalesceLimits:
    """The pacing and size of flush commits from the settings tree."""
    return CoalesceLimits(
        max_commits_per_s=settings.flush.max_commits_per_s,
        max_rows=settings.flush.max_commit_rows,
        max_bytes=int(settings.flush.max_commit_bytes),
    )


class Engine:
    """Owns the shared parts and the open shard writers of this process."""

    def __init__(
        self,
        spec: TableSpec,
        storage: Storage,
        config: WriterConfig,
        controller: BackpressureController,
        flush_workers: int = 1,
        events: EngineEvents | None = None,
        *,
        durable: bool = True,
        own_wal_storage: bool = False,
        wal_workers: int | None = None,
        fence_probes_per_s: float = DEFAULT_FENCE_PROBES_PER_S,
        coalesce: CoalesceLimits | None = None,
        safety_probe_s: float = SAFETY_PROBE_S,
    ) -> None:
        self.spec = spec
        #: The WAL storage is the table's own (`<table.uri>/_lance_sink`): shard state in it
        #: under any spelling of the table's URI is this table's (see `shard_id`).
        self.own_wal_storage = own_wal_storage
        self.table = BaseTable(spec, sync=durable)
        self.storage = storage
        self.config = config
        self.controller = controller
        self.events = events
        #: Flushes of the shards waiting together go into one Lance commit, paced per
        #: table (`engine.coalesce`).
        self.flusher = Flusher(flush_workers, coalesce)
        #: Runs every shard's WAL work (`wal.workers` threads and one timer, started with the
        #: first shard) and their idle fence probes (at most `fence_probes_per_s` a second
        #: together): neither the threads nor the idle cost grow with the shards.
        self.wal_scheduler = WalScheduler(wal_workers, fence_probes_per_s=fence_probes_per_s)
        #: Claims posted by any process on the WAL storage: one listing a sweep tells the
        #: idle writers here that another process claimed their shards, so each writer's
        #: own idle probe runs only every `safety_probe_s` (`engine.claim_board`).
        self.claims = ClaimBoard(storage)
        self.safety_probe_s = safety_probe_s
        self._sweep: ScheduledShard | None = None
        self._writers: dict[str, ShardWriter] = {}
        self._lock = threading.Lock()
        # (when listed, the listing) of the WAL storage root (`_shard_folders`).
        self._folders: tuple[float, ShardFolders] | None = None
        self._folders_lock = threading.Lock()
        self.table.open()

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        controller: BackpressureController | None = None,
        events: EngineEvents | None = None,
    ) -> Engine:
        """Build the engine the settings describe; `controller` replaces the configured one."""
        spec = TableSpec.from_settings(settings.table)
        storage = open_storage(
            settings.wal_uri, spec.storage_options, fsync=settings.wal.durable_writes
        )
        bp = settings.backpressure
        return cls(
            spec,
            storage,
            writer_config(settings),
            controller
            or build_controller(
                bp.controller,
                process_budget_bytes=int(bp.process_budget_bytes),
                max_unflushed_memtable_bytes=int(bp.max_unflushed_memtable_bytes),
            ),
            settings.flush.workers,
            events,
            durable=settings.wal.durable_writes,
            own_wal_storage=settings.wal.uri is None,
            wal_workers=settings.wal.workers,
            fence_probes_per_s=settings.wal.fence_probes_per_s,
            coalesce=coalesce_limits(settings),
        )

    def shard_id(self, topic: str, partition: int, *, listed_after: float | None = None) -> str:
        """The id of a topic-partition's shard on this table.

        `shard_id` of the table's canonical URI, unless that shard has no state in the WAL
        storage while a legacy id has (an older lance-sink hashed `table.uri` as written,
        see `legacy_shard_ids`): the shard then keeps its legacy id, so its WAL is replayed
        and its flushes are found in the table (WAL entries and Lance commits carry the id).

        With the table's own WAL storage, a shard with neither is looked for under the ids
        of the table's earlier locations (`moved_shard_ids`: the table was moved or copied
        with its `_lance_sink` folder) and keeps that id for the same reason; a shared WAL
        storage is not searched (its other shards are other tables').

        The current id's folder in the root listing the opens share (`_shard_folders`)
        counts as state without a LIST of its manifest (a folder appears only when a claim
        writes its first manifest version): restarts, and `TopicShards` mapping every
        partition of a topic, cost one listing rather than a LIST a partition (1,024
        sequential LISTs took ~50 s on S3 at 50 ms a request).

        `listed_after` (monotonic time; the open's assignment): a root listing started at or
        after it answers "no state" too, for the current and the legacy ids alike, instead
        of a LIST of each one's manifest (four LISTs of a new shard; ~40% of a first start's
        requests on S3). Sound from then on: a shard folder appears only when a claim writes
        a manifest, and once the partition is assigned here no other member may claim it,
        so a folder missing from a listing started after the assignment stays missing until
        this open claims it. Without it (`TopicShards`, which maps partitions it was not
        assigned), each id without a folder in the cached listing is LISTed.

        Raises:
            AmbiguousShard: the table's own WAL storage holds this topic-partition's state
                under several earlier ids (moved more than once without draining).
            PersistenceError: listing or reading the WAL storage failed.
        """
        current = shard_id(self.spec.uri, topic, partition)
        folders = self._shard_folders(listed_after)
        fresh = listed_after is not None

        def has_state(shard: str) -> bool:
            if shard in folders.names:
                return shard == current or self._has_state(shard)
            return not fresh and self._has_state(shard)

        if has_state(current):
            return current
        for legacy in legacy_shard_ids(
            self.spec.uri, topic, partition, spellings=self.own_wal_storage
        ):
            if has_state(legacy):
                log.info(
                    "shard_legacy_id_kept",
                    topic=topic,
                    partition=partition,
                    shard=legacy,
                    canonical=current,
                )
                return legacy
        if not self.own_wal_storage:
            return current
        moved = moved_shard_ids(self.storage, topic, partition, current, folders)
        if len(moved) > 1:
            raise AmbiguousShard(
                "this table's WAL storage holds the topic-partition's state under several "
                "shard ids of earlier table locations: delete the folders of all but one "
                "(README, Moving a table)",
                topic=topic,
                partition=partition,
                shards=",".join(moved),
                wal=self.storage.uri,
            )
        if moved:
            log.warning(
                "shard_moved_id_kept",
                topic=topic,
                partition=partition,
                shard=moved[0],
                canonical=current,
            )
            return moved[0]
        return current

    def _shard_folders(self, listed_after: float | None = None) -> ShardFolders:
        """The WAL storage root's shard folders, listed at most every
        `SHARD_FOLDERS_TTL_S` for all opens (the opens of an assignment share one listing),
        and again when the listing started before `listed_after` (monotonic).

        A listing every open made opening N new shards cost N listings of a root growing to
        N folders: at 1,024 partitions, a stat per folder per open (~500,000) took most of
        the ~16 s the opens of a first start took (issue #39). One listing serves them all
        because what it looks for, a shard folder under an id of an earlier table location,
        only appears when a table is moved or copied with its WAL storage, before its sinks
        start there; a folder created since is a shard's current id here (this process's or
        a peer's), which `_has_state` finds without a listing."""
        with self._folders_lock:
            now = time.monotonic()
            if (
                self._folders is None
                or now - self._folders[0] > SHARD_FOLDERS_TTL_S
                or (listed_after is not None and self._folders[0] < listed_after)
            ):
                self._folders = (now, ShardFolders.listed(self.storage))
            return self._folders[1]

    def _has_state(self, shard: str) -> bool:
        """Has a writer ever claimed `shard` (its manifest exists)?"""
        return bool(self.storage.list(f"{shard}/manifest"))

    def open_shard(
        self, topic: str, partition: int, *, assigned_at: float | None = None
    ) -> ShardWriter:
        """Claim and replay the shard of a topic-partition (see `ShardWriter.open`).
        `assigned_at` (monotonic): when the partition was assigned to this process, which
        lets one root listing stand for the LISTs of its ids (`shard_id`'s `listed_after`);
        give it only for a partition the consumer group assigned here."""
        shard = self.shard_id(topic, partition, listed_after=assigned_at)
        if self.events is not None:
            self.events.shard_origin(shard, topic, partition)  # before its open's events
        self._start_sweep()
        writer = ShardWriter.open(
            shard,
            self.spec,
            self.table,
            self.storage,
            self.config,
            self.controller,
            self.flusher,
            self.events,
            origin=ShardOrigin(canonical_uri(self.spec.uri), topic, partition),
            scheduler=self.wal_scheduler,
            idle_probe_interval=max(self.config.fence_check_interval_s, self.safety_probe_s),
        )
        with self._lock:
            self._writers[shard] = writer
        newest = self.claims.newest_epoch(shard)
        if newest is not None and newest > writer.epoch:
            # A sweep saw a newer claim while this writer opened, before it was listed.
            writer.probe_fence()
        return writer

    def _start_sweep(self) -> None:
        """Sweep the claim board on the probe lane from the first open on."""
        with self._lock:
            if self._sweep is None:
                self._sweep = self.wal_scheduler.add_probe(
                    "claim_board",
                    self._sweep_claims,
                    max(self.config.fence_check_interval_s, IDLE_WAKE_S),
                )

    def _sweep_claims(self) -> None:
        """Probe the manifest of each writer here whose shard a newer claim names (the probe
        poisons it: `Fenced`); see `engine.claim_board`."""
        claimed = self.claims.claimed()
        if not claimed:
            return
        with self._lock:
            writers = dict(self._writers)
        for marker in claimed:
            writer = writers.get(marker.shard)
            if writer is not None and marker.epoch > writer.epoch:
                log.info("shard_claimed_elsewhere", shard=marker.shard, epoch=marker.epoch)
                writer.probe_fence()

    def close_shard(
        self, writer: ShardWriter, *, flush: bool, timeout: float, wait_trims: bool = True
    ) -> None:
        writer.close(flush=flush, timeout=timeout, wait_trims=wait_trims)
        with self._lock:
            self._writers.pop(writer.shard, None)

    def writers(self) -> list[ShardWriter]:
        with self._lock:
            return list(self._writers.values())

    def leave_trims(self) -> None:
        """Trim no flushed WAL entries from now on (a drain: `Flusher.leave_trims`)."""
        self.flusher.leave_trims()

    def close(self, *, flush: bool = True, timeout: float = 30.0) -> None:
        """Close every open writer, then the flush pool and the WAL scheduler."""
        for writer in self.writers():
            self.close_shard(writer, flush=flush, timeout=timeout)
        if self._sweep is not None:
            self.wal_scheduler.remove_probe(self._sweep)
        self.flusher.shutdown(cancel_trims=not flush)
        self.wal_scheduler.close(timeout)
