"""The moto fixture is a real S3 API with create-only (conditional) puts."""

from __future__ import annotations

import obstore
import pytest
from obstore.exceptions import AlreadyExistsError
from obstore.store import S3Store

pytestmark = pytest.mark.s3


def test_create_only_put_refuses_to_overwrite(
    s3_bucket: str, s3_storage_options: dict[str, str]
) -> None:
    store = S3Store(s3_bucket, config=s3_storage_options)  # type: ignore[arg-type]
    obstore.put(store, "shard/epoch/1", b"first", mode="create")
    with pytest.raises(AlreadyExistsError):
        obstore.put(store, "shard/epoch/1", b"second", mode="create")
    assert bytes(obstore.get(store, "shard/epoch/1").bytes()) == b"first"
    listed = [m["path"] for batch in obstore.list(store, "shard/") for m in batch]
    assert listed == ["shard/epoch/1"]
