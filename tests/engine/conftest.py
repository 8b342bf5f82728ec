"""Fixtures for engine tests: a harness on a local folder or on the moto S3 server."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.engine import Harness

MakeHarness = Callable[..., Harness]


@pytest.fixture
def local_harness(tmp_path: Path) -> Iterator[MakeHarness]:
    made: list[Harness] = []

    def make(**kwargs: Any) -> Harness:
        h = Harness(str(tmp_path / "table.lance"), str(tmp_path / "wal"), **kwargs)
        made.append(h)
        return h

    yield make
    for h in made:
        h.flusher.shutdown()


Storage = tuple[str, str, "dict[str, str] | None"]


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def any_storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    """A table and WAL location (with storage options) on a local folder and on S3 (moto)."""
    if request.param == "local":
        return str(tmp_path / "table.lance"), str(tmp_path / "wal"), None
    bucket: str = request.getfixturevalue("s3_bucket")
    options: dict[str, str] = request.getfixturevalue("s3_storage_options")
    prefix = uuid.uuid4().hex[:8]
    return f"s3://{bucket}/{prefix}/table.lance", f"s3://{bucket}/{prefix}/wal", options


@pytest.fixture
def any_harness(any_storage: Storage) -> Iterator[MakeHarness]:
    """The same test on a local folder and on S3 (moto)."""
    made: list[Harness] = []
    table, wal, options = any_storage

    def make(**kwargs: Any) -> Harness:
        h = Harness(table, wal, storage_options=options, **kwargs)
        made.append(h)
        return h

    yield make
    for h in made:
        h.flusher.shutdown()
