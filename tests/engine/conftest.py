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


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def any_harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MakeHarness]:
    """The same test on a local folder and on S3 (moto)."""
    made: list[Harness] = []
    if request.param == "local":
        table, wal, options = str(tmp_path / "table.lance"), str(tmp_path / "wal"), None
    else:
        bucket: str = request.getfixturevalue("s3_bucket")
        options = request.getfixturevalue("s3_storage_options")
        prefix = uuid.uuid4().hex[:8]
        table, wal = f"s3://{bucket}/{prefix}/table.lance", f"s3://{bucket}/{prefix}/wal"

    def make(**kwargs: Any) -> Harness:
        h = Harness(table, wal, storage_options=options, **kwargs)
        made.append(h)
        return h

    yield make
    for h in made:
        h.flusher.shutdown()
