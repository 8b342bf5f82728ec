"""The Lance base table: create/open, flush commits that carry their WAL watermark, and the
search for a shard's watermark in recent commits.

A flush commit is one Lance commit (new fragments, or merge-insert with deletes for upsert tables)
holding one frozen memtable of each of one or more shards (`engine.coalesce` gathers the
shards of a round). Its transaction properties record, per shard, the writer epoch, the
memtable generation, the WAL position it covers (`wal_end`) and the last source offsets
(`FlushRecord`). So the flush watermark lives in the table itself: a crash between the
Lance commit and the shard manifest updates is found on each shard's next open and no
generation is flushed twice (I3).

Two encodings, both read (`commit_records`): a commit of one shard keeps the properties of
earlier builds (`lance_sink.shard`, `.epoch`, `.generation`, `.wal_end`, `.offsets`), so a
table stays readable by them; a commit of several shards carries one property,
`lance_sink.shards`, a JSON object mapping each shard to {epoch, generation, wal_end,
offsets}.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

import lance
import pyarrow as pa
import structlog
from lance.commit import CommitConflictError

from engine.errors import PersistenceError
from engine.filter_tree import sql_integer
from engine.schema import Evolution, TableSpec
from engine.storage import is_local, local_path, sync_filesystem

if TYPE_CHECKING:
    from engine.memtable import Memtable

log = structlog.get_logger("lance_sink.table")

#: Evolutions `BaseTable.open` tries, each on the newest version: pods of one deployment
#: restart to evolve together, and each evolution another one preempted is tried again.
EVOLVE_ATTEMPTS: Final = 5

#: Commits of one flush that a concurrent incompatible change preempted, each made again at
#: once on the newest version (`BaseTable.commit_flush`); then the flusher's backoff.
COMMIT_ATTEMPTS: Final = 3

PROP_SHARD = "lance_sink.shard"
PROP_EPOCH = "lance_sink.epoch"
PROP_WAL_END = "lance_sink.wal_end"
PROP_GENERATION = "lance_sink.generation"
PROP_OFFSETS = "lance_sink.offsets"
#: A commit of several shards' flushes: JSON {shard: {epoch, generation, wal_end, offsets}}.
PROP_SHARDS = "lance_sink.shards"


@dataclass(frozen=True, slots=True)
class FlushRecord:
    """What one shard's flush records in the commit that holds its rows."""

    shard: str
    epoch: int
    generation: int
    wal_end: int
    offsets: dict[str, int]


@dataclass(frozen=True, slots=True)
class FlushMark:
    """A flush found in the table's commit history."""

    wal_end: int
    epoch: int
    generation: int
    version: int
    offsets: dict[str, int]


#: Lance's field metadata naming how a column's pages are laid out (file format 2.1 on).
STRUCTURAL_ENCODING = "lance-encoding:structural-encoding"


def stored_schema(schema: pa.Schema) -> pa.Schema:
    """`schema` as the sink creates its tables: vector columns (fixed-size lists of floats)
    laid out as mini-blocks. Lance's default for values this wide (a 384-dim vector is
    1,536 bytes) is full-zip, made for random access of single values; a flat kNN scan of
    200k x 384 rows, which every query runs over the rows no vector index covers yet,
    took 242 ms that way against 143 ms as mini-blocks on one core here (a take of 100
    rows: 1.3 against 1.6 ms). Lance lays out every file it writes to the table (flushes,
    compactions) as the table's schema says."""
    fields = []
    for field in schema:
        meta = field.metadata or {}
        vector = pa.types.is_fixed_size_list(field.type) and pa.types.is_floating(
            field.type.value_type
        )
        laid_out = STRUCTURAL_ENCODING.encode() in meta
        fields.append(
            field.with_metadata({**meta, STRUCTURAL_ENCODING: "miniblock"})
            if vector and not laid_out
            else field
        )
    return pa.schema(fields, metadata=schema.metadata)


def create_table(uri: str, schema: pa.Schema, storage_options: dict[str, str] | None) -> None:
    """Create an empty Lance table at `uri` as its version 1, or fail (`OSError`,
    `ValueError` or `RuntimeError`, as Lance says it) if any version exists.

    Not `lance.write_dataset(mode="create")`: it looks for the table first, and a create
    that finds nothing and then loses the commit of version 1 to another process is retried
    as an Overwrite on top of whatever the table holds by then (two creates together made
    version 2). An Overwrite replaces the rows of every earlier version, so a create retried
    after another pod's first write would drop those rows, whose offsets that pod has
    committed. Committed with `read_version=0` and no retries, it can only be version 1.
    Vector columns are laid out for scans (`stored_schema`)."""
    lance.LanceDataset.commit(
        uri,
        lance.LanceOperation.Overwrite(stored_schema(schema), []),
        read_version=0,
        max_retries=0,
        storage_options=storage_options,
        enable_v2_manifest_paths=True,
    )


def open_or_create(
    uri: str, schema: pa.Schema, storage_options: dict[str, str] | None
) -> lance.LanceDataset:
    """The Lance table at `uri`, created empty with `schema` (`create_table`) if there is
    none. Another process may create it first: its create wins, whatever this one's error
    says (the version exists locally; on S3 the losing create can see a preempted commit).

    Raises:
        PersistenceError: there is no table and creating one failed (saying why: the open
            that follows a failed create often says only "not found").
    """
    try:
        return lance.dataset(uri, storage_options=storage_options)
    except (ValueError, FileNotFoundError, OSError):
        pass  # no table yet (Lance says "not found" as a ValueError)
    try:
        create_table(uri, schema, storage_options)
    except (OSError, ValueError, RuntimeError) as exc:
        try:
            ds = lance.dataset(uri, storage_options=storage_options)
        except (ValueError, FileNotFoundError, OSError):
            raise PersistenceError(f"cannot create table: {exc}", table=uri) from exc
        log.info("table_created_elsewhere", table=uri, error=str(exc))
        return ds
    return lance.dataset(uri, storage_options=storage_options)


class AppendWatcher(Protocol):
    """Told about the rows an append flush writes, around its commit (the reader's
    unindexed-fragment cache takes them over instead of reading them back from storage).

    `appending(rows, memtable)` is entered before the commit, with the rows in the order
    they are written (the memtable's batches, not copied) and the memtable they come from
    (None if unknown); the callable it yields is called with the committed dataset once the
    commit succeeded (not if it failed); the context exits after either."""

    def appending(
        self, rows: pa.Table, memtable: Memtable | None
    ) -> AbstractContextManager[Callable[[lance.LanceDataset], None]]: ...


class BaseTable:
    """The Lance table at `spec.uri`. Thread-safe: every operation opens the latest version.

    `open()` must be called once before flushing; it creates the table if it does not exist
    and checks the schema of an existing one (`SchemaMismatch`).
    """

    def __init__(self, spec: TableSpec, *, sync: bool = True) -> None:
        self.spec = spec
        self.uri = spec.uri
        self.options = dict(spec.storage_options) or None
        # Sync local flushes to disk (see commit_flush); off with `wal.durable_writes=false`.
        self._sync = sync and is_local(spec.uri)
        self._lock = threading.Lock()
        self._watchers: list[AppendWatcher] = []
        self.transactions = Transactions()

    def watch_appends(self, watcher: AppendWatcher) -> None:
        """Tell `watcher` about every append flush of this process from now on."""
        with self._lock:
            self._watchers.append(watcher)

    def unwatch_appends(self, watcher: AppendWatcher) -> None:
        with self._lock:
            if watcher in self._watchers:
                self._watchers.remove(watcher)

    def open(self) -> None:
        """Create the table (empty, with the table schema) or check the existing one."""
        with self._lock:
            ds = open_or_create(self.uri, self.spec.table_schema, self.options)
            if self.spec.evolve:
                self._evolve(ds)
                ds = self.dataset()
            self.spec.check_table(ds.schema)

    def _evolve(self, ds: lance.LanceDataset) -> None:
        """Add the spec's new columns (all-null, metadata only) and widen the columns it
        widens (`TableSpec.evolution`), each as one Lance commit. Pods that start together
        evolve together: a commit another pod's evolution preempted is not retried as is
        (Lance refuses it); the newest version is read and what is left to do, usually
        nothing, is done, at most `EVOLVE_ATTEMPTS` times."""
        for attempt in range(1, EVOLVE_ATTEMPTS + 1):
            change = self.spec.evolution(ds.schema)
            if not change:
                return
            try:
                if change.add:
                    ds.add_columns(list(change.add))
                if change.widen:
                    ds = self._drop_indexes(ds, change.widen)
                    # Each argument is one alteration (pylance annotates them as iterables).
                    alterations: list[Any] = [
                        {"path": f.name, "data_type": f.type} for f in change.widen
                    ]
                    ds.alter_columns(*alterations)
            except (OSError, RuntimeError) as exc:  # a CommitConflictError is an OSError
                newest = self._raced(exc, change) if attempt < EVOLVE_ATTEMPTS else None
                if newest is not None:
                    log.info("table_evolution_preempted", table=self.uri, attempt=attempt)
                    ds = newest
                    continue
                raise PersistenceError(f"cannot evolve the table: {exc}", table=self.uri) from exc
            log.info(
                "table_evolved",
                table=self.uri,
                added=[f.name for f in change.add],
                widened=[f"{f.name}: {f.type}" for f in change.widen],
            )
            return

    def _drop_indexes(
        self, ds: lance.LanceDataset, widen: tuple[pa.Field, ...]
    ) -> lance.LanceDataset:
        """Drop every index on a column about to be widened and return the table after: Lance
        refuses to cast an indexed column ("they have 1 index(es) attached"), and
        maintenance builds the indexes the settings name again."""
        columns = {f.name for f in widen}
        names = indexes_on(ds, columns)
        if not names:
            return ds
        for name in names:
            try:
                ds.drop_index(name)
            except RuntimeError:  # "index not found": a drop moves `ds` to the newest version
                if name in indexes_on(self.dataset(), columns):
                    raise
                continue  # another pod widening too dropped it first
            log.info("table_index_dropped_to_widen", table=self.uri, index=name)
        return self.dataset()

    def _raced(self, exc: Exception, change: Evolution) -> lance.LanceDataset | None:
        """The newest version of the table to try an evolution again on, when its failure was
        another process's doing: a commit it preempted, another pod's evolution, or an
        index on a widened column built again (maintenance) between the drop and the cast;
        None otherwise."""
        try:
            now = self.dataset()
            if isinstance(exc, CommitConflictError):
                return now  # (an alter's preempted commit is a plain OSError: the tests below)
            if self.spec.evolution(now.schema) != change:
                return now  # another pod evolved the table meanwhile
            if change.widen and indexes_on(now, {f.name for f in change.widen}):
                return now
        except (OSError, ValueError):
            pass
        return None

    def dataset(self, version: int | None = None) -> lance.LanceDataset:
        """The table at its latest (or a given) version."""
        return lance.dataset(self.uri, version=version, storage_options=self.options)

    def latest_version(self) -> int:
        return int(self.dataset().version)

    def commit_flush(
        self,
        upserts: list[pa.RecordBatch],
        deletes: pa.Table | None,
        properties: dict[str, str],
        memtable: Memtable | None = None,
    ) -> int:
        """Write one memtable's rows in one commit carrying `properties`; returns the version.
        Append flushes tell the `AppendWatcher`s about the rows (and `memtable`).

        The written files are made durable (filesystem sync) before returning, because Lance
        does not fsync and the caller deletes WAL entries next.

        A commit that a concurrent change Lance cannot rebase it over preempted (another
        pod's evolution, or its upsert of the same fragments) is made again at once on the
        newest version, at most `COMMIT_ATTEMPTS` times.

        Raises:
            PersistenceError: the commit failed (the caller retries with backoff).
        """
        for attempt in range(1, COMMIT_ATTEMPTS + 1):
            try:
                if not self.spec.upsert:
                    ds = self._append(upserts, properties, memtable)
                else:
                    ds = self._merge(upserts, deletes, properties)
                break
            except (OSError, ValueError, RuntimeError) as exc:
                if isinstance(exc, CommitConflictError) and attempt < COMMIT_ATTEMPTS:
                    log.info(
                        "flush_commit_preempted", table=self.uri, attempt=attempt, error=str(exc)
                    )
                    continue
                raise PersistenceError(f"flush commit failed: {exc}", table=self.uri) from exc
        if self._sync:
            sync_filesystem(local_path(self.uri))
        return int(ds.version)

    def _append(
        self,
        upserts: list[pa.RecordBatch],
        properties: dict[str, str],
        memtable: Memtable | None,
    ) -> lance.LanceDataset:
        base = self.dataset()
        table = self._rows(upserts, base)
        with self._lock:
            watchers = list(self._watchers)
        if not watchers or not table.num_rows:
            return self._write(base, table, properties)
        with ExitStack() as stack:
            committed = [stack.enter_context(w.appending(table, memtable)) for w in watchers]
            # As the memtable's batches: Lance wrote 100k x 384 rows 3x slower as one batch.
            ds = self._write(base, table, properties)
            for notify in committed:
                try:
                    notify(ds)
                except Exception as exc:  # noqa: BLE001 - the commit stands; only a cache lost
                    log.warning("append_watcher_failed", error=str(exc))
        return ds

    def _rows(self, upserts: list[pa.RecordBatch], base: lance.LanceDataset) -> pa.Table:
        """The rows of a flush in the schema they are committed in to `base`: columns
        another pod's evolution widened since this process opened the table are cast to
        the table's type (`TableSpec.written_as`)."""
        table = pa.Table.from_batches(upserts, schema=self.spec.table_schema)
        schema = self.spec.written_as(base.schema)
        return table if schema.equals(table.schema) else table.cast(schema)

    def _write(
        self, base: lance.LanceDataset, table: pa.Table, properties: dict[str, str]
    ) -> lance.LanceDataset:
        """Commit `table` as new fragments on top of `base`.

        An Update that only adds fragments, not an Append: Lance (14.0.2) rebases an Append
        over another pod's evolution committed since `base` (a Merge), and the columns it
        widened then read as null in the appended rows; an Update is refused instead
        (`CommitConflictError`), and the flush's next attempt reads the new schema."""
        fragments = lance.fragment.write_fragments(table, base, storage_options=self.options)
        tx = lance.Transaction(
            read_version=base.version,
            operation=lance.LanceOperation.Update(new_fragments=list(fragments)),
            transaction_properties=properties,
        )
        # Given `base`, not the URI: its object store is reused (3.5 vs 4.0 ms a commit here).
        return lance.LanceDataset.commit(
            base, tx, read_version=base.version, storage_options=self.options
        )

    def _merge(
        self, upserts: list[pa.RecordBatch], deletes: pa.Table | None, properties: dict[str, str]
    ) -> lance.LanceDataset:
        ds = self.dataset()
        key = list(self.spec.primary_key)
        builder = ds.merge_insert(key if len(key) > 1 else key[0])
        builder = builder.when_matched_update_all().when_not_matched_insert_all()
        if deletes is not None and deletes.num_rows:
            # Deleted keys are not in the source, so their target rows are "not matched by
            # source": deleting those that match the key list makes it one commit.
            builder = builder.when_not_matched_by_source_delete(key_predicate(deletes, key))
        tx, _stats = builder.execute_uncommitted(self._rows(upserts, ds))
        tx = dataclasses.replace(tx, transaction_properties=properties)
        return lance.LanceDataset.commit(
            self.uri, tx, read_version=ds.version, storage_options=self.options
        )

    def find_flush(
        self, shard: str, after_version: int, ds: lance.LanceDataset | None = None
    ) -> FlushMark | None:
        """The newest flush of `shard` committed after `after_version`, if any (searching
        the latest version, or `ds`)."""
        ds = ds if ds is not None else self.dataset()  # (`ds or` would count its rows)
        commits = flush_commits(ds, after_version, self.transactions)
        for version, props in commits:  # newest first
            record = commit_records(props).get(shard)
            if record is None:
                continue
            return FlushMark(
                wal_end=record.wal_end,
                epoch=record.epoch,
                generation=record.generation,
                version=version,
                offsets=dict(record.offsets),
            )
        return None


def transaction_properties(ds: lance.LanceDataset, version: int) -> dict[str, str] | None:
    """The transaction properties of the commit that made table version `version`: {} when
    its transaction cannot be decoded, None when the version no longer exists (cleaned up).

    Reads one version's transaction at a time, never a range: pylance 14.0.2 cannot decode a
    compaction's Rewrite transaction once any index exists (`get_transactions` raises
    TypeError from `RewrittenIndex.__init__`), and one such commit must neither hide our
    flushes nor fail a flush. Only our flush commits (Append, Update) carry `lance_sink.*`
    properties, and those decode; a commit that cannot be decoded is another writer's
    (compaction, index), so it counts as carrying no properties.

    Raises:
        OSError: reading the version's manifest or transaction file failed (retriable).
    """
    try:
        tx = ds.read_transaction(version)
    except (TypeError, AttributeError, NotImplementedError) as exc:  # undecodable operation
        log.debug("transaction_undecodable", version=version, error=str(exc))
        return {}
    except OSError as exc:
        if "not found" in str(exc).lower():
            return None
        raise
    return dict(getattr(tx, "transaction_properties", None) or {})


class Transactions:
    """The transaction properties of a table's versions, each read once: a committed
    version's transaction never changes, and a flush round of many shards checks the same
    versions for each (`find_flush`): on S3 one read per version instead of one per shard
    and version. Thread-safe; keeps the newest `limit` versions read. A table recreated at
    the same URI (its latest version below one kept) empties it."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._props: dict[int, dict[str, str]] = {}
        self._newest = 0

    def properties(self, ds: lance.LanceDataset, version: int) -> dict[str, str] | None:
        """`transaction_properties(ds, version)`, from memory when read before."""
        latest = int(ds.version)
        with self._lock:
            if latest < self._newest:  # the table was recreated: versions mean others
                self._props.clear()
                self._newest = 0
            hit = self._props.get(version)
        if hit is not None:
            return hit
        props = transaction_properties(ds, version)
        if props is not None:
            with self._lock:
                self._props[version] = props
                self._newest = max(self._newest, version)
                while len(self._props) > self.limit:
                    del self._props[min(self._props)]
        return props


def flush_commits(
    ds: lance.LanceDataset, after_version: int, transactions: Transactions | None = None
) -> Iterator[tuple[int, dict[str, str]]]:
    """(version, properties) of every flush commit (one carrying a shard property, or the
    several shards' one) in `ds`'s history above `after_version`, newest first. Stops at the
    newest version that no longer exists: versions are cleaned up oldest first (see
    maintenance's "Version retention"), so nothing older is left either. `transactions`
    keeps what was read for the next call."""
    for version in range(int(ds.version), after_version, -1):
        if transactions is not None:
            props = transactions.properties(ds, version)
        else:
            props = transaction_properties(ds, version)
        if props is None:
            return
        if PROP_SHARD in props or PROP_SHARDS in props:
            yield version, props


def indexes_on(ds: lance.LanceDataset, columns: set[str]) -> list[str]:
    """The names of the indexes of `ds` on any of `columns`."""
    return [
        str(index.name)
        for index in ds.describe_indices()
        if columns & set(getattr(index, "field_names", None) or [])
    ]


def index_on(ds: lance.LanceDataset, column: str, kind: str | None) -> Any:
    """The index on exactly `column` (an entry of `describe_indices`), or None; kind:
    'Inverted', 'BTree' or None (= the vector index: any kind that is not a scalar one)."""
    for index in ds.describe_indices():
        names = list(getattr(index, "field_names", []) or [])
        type_url = str(getattr(index, "type_url", ""))
        if names != [column]:
            continue
        is_scalar = any(t in type_url for t in ("Inverted", "BTree", "Bitmap", "Zone"))
        if (kind is None and not is_scalar) or (kind is not None and kind in type_url):
            return index
    return None


def holds_generation(ds: lance.LanceDataset, shard: str, generation: int, floor: int) -> bool:
    """Does table version `ds` hold the flush of `generation` of `shard`, committed at a
    version above `floor`? Reads only the transactions of versions (floor, ds.version]."""
    for _version, props in flush_commits(ds, floor):
        record = commit_records(props).get(shard)
        if record is not None and record.generation == generation:
            return True
    return False


def flush_properties(
    shard: str, epoch: int, generation: int, wal_end: int, offsets: dict[str, int]
) -> dict[str, str]:
    """The transaction properties of a flush commit of one shard (the encoding of earlier
    builds, which they still read)."""
    return {
        PROP_SHARD: shard,
        PROP_EPOCH: str(epoch),
        PROP_GENERATION: str(generation),
        PROP_WAL_END: str(wal_end),
        PROP_OFFSETS: json.dumps(offsets, sort_keys=True),
    }


def commit_properties(records: list[FlushRecord]) -> dict[str, str]:
    """The transaction properties of a flush commit holding `records` (one per shard): one
    shard's in the single-shard encoding (`flush_properties`), several in `PROP_SHARDS`.

    Raises:
        ValueError: no record, or two of one shard (a commit holds one memtable a shard).
    """
    shards = {r.shard for r in records}
    if not records or len(shards) != len(records):
        raise ValueError("a flush commit holds one record per shard, at least one")
    if len(records) == 1:
        r = records[0]
        return flush_properties(r.shard, r.epoch, r.generation, r.wal_end, r.offsets)
    marks = {
        r.shard: {
            "epoch": r.epoch,
            "generation": r.generation,
            "wal_end": r.wal_end,
            "offsets": r.offsets,
        }
        for r in records
    }
    return {PROP_SHARDS: json.dumps(marks, sort_keys=True)}


def commit_records(props: dict[str, str]) -> dict[str, FlushRecord]:
    """The flush records of a commit's transaction properties, by shard (both encodings;
    {} for a commit that is not a flush). A property that does not decode (not written by
    lance-sink) counts as no record, like an undecodable transaction."""
    try:
        if PROP_SHARD in props:
            shard = props[PROP_SHARD]
            return {
                shard: FlushRecord(
                    shard=shard,
                    epoch=int(props[PROP_EPOCH]),
                    generation=int(props[PROP_GENERATION]),
                    wal_end=int(props[PROP_WAL_END]),
                    offsets=_offsets(json.loads(props.get(PROP_OFFSETS, "{}"))),
                )
            }
        if PROP_SHARDS in props:
            marks = json.loads(props[PROP_SHARDS])
            return {
                str(shard): FlushRecord(
                    shard=str(shard),
                    epoch=int(m["epoch"]),
                    generation=int(m["generation"]),
                    wal_end=int(m["wal_end"]),
                    offsets=_offsets(m.get("offsets", {})),
                )
                for shard, m in marks.items()
            }
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        log.warning("flush_properties_undecodable", error=str(exc))
    return {}


def _offsets(raw: Any) -> dict[str, int]:
    return {str(k): int(v) for k, v in dict(raw).items()}


def sql_literal(value: Any) -> str:
    """A SQL literal for a key value (string, integer or bytes)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return sql_integer(value)  # a tombstone of key -2**63 failed every flush
    if isinstance(value, bytes):
        return f"X'{value.hex()}'"
    text = str(value).replace("'", "''")
    return f"'{text}'"


def key_predicate(keys: pa.Table, columns: Iterable[str]) -> str:
    """A SQL predicate matching exactly the key tuples of `keys`."""
    names = list(columns)
    if len(names) == 1:
        values = keys.column(names[0]).to_pylist()
        return f"{_ident(names[0])} IN ({', '.join(sql_literal(v) for v in values)})"
    rows = zip(*(keys.column(n).to_pylist() for n in names), strict=True)
    return " OR ".join(
        "("
        + " AND ".join(f"{_ident(n)} = {sql_literal(v)}" for n, v in zip(names, row, strict=True))
        + ")"
        for row in rows
    )


def _ident(name: str) -> str:
    return f"`{name}`"
