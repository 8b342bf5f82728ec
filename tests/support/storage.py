"""A real WAL storage that records its calls, and can answer each a round trip late (as S3
does), for tests that count or time storage requests. Nothing is faked: every call goes to
the storage it wraps."""

from __future__ import annotations

import time
from typing import Any

from engine.storage import Storage


class RecordingStorage:
    """`inner`, recording the prefix of every `folders`, `list` and `list_after` call and
    the key of every `get`, each `delay_s` late."""

    def __init__(self, inner: Storage, delay_s: float = 0.0) -> None:
        self.inner = inner
        self.uri = inner.uri
        self.delay_s = delay_s
        self.folder_listings: list[str] = []
        self.listings: list[str] = []
        self.gets: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _round_trip(self) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)

    def folders(self, prefix: str) -> list[str]:
        self.folder_listings.append(prefix)
        self._round_trip()
        return self.inner.folders(prefix)

    def list(self, prefix: str) -> list[str]:
        self.listings.append(prefix)
        self._round_trip()
        return self.inner.list(prefix)

    def list_after(self, prefix: str, after: str | None) -> list[str]:
        self.listings.append(prefix)
        self._round_trip()
        return self.inner.list_after(prefix, after)

    def get(self, key: str) -> bytes:
        self.gets.append(key)
        self._round_trip()
        return self.inner.get(key)

    def manifest_gets(self) -> int:
        return sum("/manifest/" in key for key in self.gets)
