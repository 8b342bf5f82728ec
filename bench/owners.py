"""Reading the owners of many shards on a slow S3: what fan-out routing costs.

Every query that routes other shards' fresh rows reads the shard manifests of the WAL
storage (`engine.manifest.list_owners`, through `engine.reads.owners.ShardOwners`): a root
listing, then a LIST and a GET per shard. This claims S shards on moto behind the latency
proxy (`bench.s3_latency`), then times `list_owners` with its default workers against the
yardstick of one shard at a time, in the same run, and the periodic re-read between whole
reads (`ShardOwners`: the claim board, then the shards claimed since).

Usage:

    python -m bench.owners [--shards 1024] [--latency-ms 50] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.s3_latency import slow_s3
from engine.manifest import OWNER_READ_WORKERS, ManifestStore, list_owners
from engine.reads.owners import ShardOwners
from engine.storage import open_storage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", type=int, default=1024)
    parser.add_argument("--latency-ms", type=float, default=50.0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with slow_s3(args.latency_ms, Path(tempfile.mkdtemp())) as s3:
        storage = open_storage(f"s3://{s3.bucket}/wal", s3.storage_options)
        with ThreadPoolExecutor(32) as pool:
            list(
                pool.map(
                    lambda i: ManifestStore(storage, f"t-{i}-0123456789ab").claim(f"http://p{i}"),
                    range(args.shards),
                )
            )
        print(
            f"bench/owners: list_owners of {args.shards} shards on moto S3, "
            f"{args.latency_ms:g} ms a request; seconds, median of {args.repeat}"
        )
        for workers, label in ((1, "one at a time"), (OWNER_READ_WORKERS, "default")):
            times = []
            for _ in range(args.repeat if workers > 1 else 1):
                started = time.monotonic()
                owners = list_owners(storage, workers=workers)
                times.append(time.monotonic() - started)
                assert len(owners) == args.shards
            print(f"  workers {workers:3d} ({label}): {statistics.median(times):7.1f} s")
        # A pod's periodic re-read between whole reads: the board, then the claimed shards.
        owners = ShardOwners(storage, refresh_s=0.0)
        copy = owners.current()
        times = []
        for i in range(args.repeat):
            ManifestStore(storage, f"t-{i}-0123456789ab").claim("http://moved")
            started = time.monotonic()
            copy = owners._read(copy, claims_only=True)  # the re-read itself, timed
            times.append(time.monotonic() - started)
            assert copy[f"t-{i}-0123456789ab"].url == "http://moved"
        print(
            f"  re-read between whole reads (one shard claimed since): "
            f"{statistics.median(times):7.2f} s"
        )


if __name__ == "__main__":
    main()
