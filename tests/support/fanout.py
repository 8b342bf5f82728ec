"""Fan-out reads in one process: the parts of a "pod" that tests build on 127.0.0.1.

A pod's coordinator side is a `Reader` with a `Fanout` that routes by the shard manifests
under one WAL root (`coordinator_fanout`); its owner side is the query server other pods
ask for its memtables' part (`serve_queries`: the real HTTP app, `POST
/internal/v1/fresh`). `tests/reads/test_fanout.py` builds whole pods of both
(`Pod`); the read oracle (`tests/reads/test_read_oracle.py`, tier (d)) a coordinator that
holds no shard and one owner server for many tables.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import SecretStr

from config.settings import QuerySettings
from engine.reader import Fanout, NoReaderEvents, Reader
from engine.reads.owners import ShardOwners
from engine.storage import Storage
from sink.http import ServerHandle, create_query_app, run_server

#: The bearer token of every test pod's query API (fan-out requests carry it too).
TOKEN = "s3cret"


class Events(NoReaderEvents):
    """Records the shards queries lacked, the queries run again on a newer base, and the
    kinds of queries answered (what the metrics facade counts)."""

    def __init__(self) -> None:
        self.missing: list[tuple[str, str]] = []
        self.stale_base = 0
        self.kinds: list[str] = []

    def query(self, kind: str, seconds: float, rows: int) -> None:
        self.kinds.append(kind)

    def fanout_missing(self, shard: str, cause: str) -> None:
        self.missing.append((shard, cause))

    def fanout_stale_base(self) -> None:
        self.stale_base += 1


def coordinator_fanout(
    storage: Storage,
    timeout_ms: int,
    expected: Callable[[], set[str] | None] | None = None,
) -> Fanout:
    """The fan-out of a pod whose shards' manifests are under `storage`: the owners are
    re-read at every query (`refresh_s` 0, so a claim is routed to at once), and an owner
    that does not answer within `timeout_ms` makes its shards missing. Its `self_url` is
    empty: set it to the pod's own URL when the pod serves queries too."""
    owners = ShardOwners(storage, refresh_s=0.0)
    return Fanout(owners, "", timeout_ms / 1000, TOKEN, workers=8, expected=expected)


def serve_queries(reader: Reader, timeout_ms: int) -> ServerHandle:
    """The query API over `reader` on 127.0.0.1 (a free port; `ServerHandle.port`), behind
    `TOKEN`, with `timeout_ms` as its own fan-out deadline. Stopping it takes ~0.2 s
    (uvicorn's shutdown)."""
    settings = QuerySettings(
        host="127.0.0.1", port=0, auth_token=SecretStr(TOKEN), fanout_timeout_ms=timeout_ms
    )
    return run_server(create_query_app(reader, settings), "127.0.0.1", 0)
