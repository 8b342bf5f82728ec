"""One object-store abstraction for the WAL and shard manifests: a local directory or S3.

Operations: create-only put (the primitive behind WAL entries and epoch claims), get, list,
head, delete. A `put_if_absent` that returns has made the object durable:

- `LocalStorage` writes a temporary file, fsyncs it, links it into place (``link`` fails if
  the name exists, which makes the put create-only and atomic), removes the temporary name
  and fsyncs the directory. With ``fsync=False`` the data survives a process crash but not
  a power loss.
- `ObjectStorage` uses obstore's conditional PUT (``mode="create"``); an object store PUT is
  durable when it returns.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

import obstore
from obstore.exceptions import AlreadyExistsError, NotFoundError
from obstore.store import S3Store

from engine.errors import PersistenceError


class AlreadyExists(Exception):
    """A create-only put found the name taken."""


class Storage(Protocol):
    """Key/value object storage with create-only puts. Keys are '/'-separated."""

    uri: str

    def put_if_absent(
        self, key: str, data: bytes | memoryview, *, cached: bool = True, durable: bool = True
    ) -> None:
        """Store `data` under `key` durably, or raise `AlreadyExists` if `key` exists.

        ``cached=False``: the object is read back rarely (a WAL entry: only by a replay), so
        a local store drops it from the page cache once it is durable. ``durable=False``: a
        hint a crash of the host may lose (a claim board marker), which a local store does
        not sync (two of the six fsyncs of a shard's open)."""

    def get(self, key: str) -> bytes:
        """Return the object, or raise `FileNotFoundError`."""

    def exists(self, key: str) -> bool:
        """True if `key` exists."""

    def folders(self, prefix: str) -> list[str]:
        """Names of the folders directly under `prefix` ("" = the root), sorted."""

    def list_after(self, prefix: str, after: str | None) -> list[str]:
        """The keys under `prefix` greater than the key `after` (all with None), sorted:
        on an object store, one listing that starts there (S3's start-after)."""

    def list(self, prefix: str) -> list[str]:
        """Keys under `prefix` (a folder, no trailing slash), sorted."""

    def delete(self, key: str) -> None:
        """Delete `key`; a missing key is not an error."""

    def delete_many(self, keys: Sequence[str]) -> None:
        """Delete every key of `keys` (an object store: in bulk requests); missing keys are
        not an error."""


class LocalStorage:
    """A directory on a local filesystem, fsynced."""

    def __init__(self, root: str | Path, *, fsync: bool = True) -> None:
        self.root = Path(root).resolve()
        self.uri = str(self.root)
        self.fsync = fsync
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / key

    def put_if_absent(
        self, key: str, data: bytes | memoryview, *, cached: bool = True, durable: bool = True
    ) -> None:
        path = self._path(key)
        sync = self.fsync and durable
        new_dir = not path.parent.exists()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                if sync:
                    os.fsync(fd)
                    if not cached and hasattr(os, "posix_fadvise"):  # Linux
                        # Clean after the fsync: the pages leave the page cache now rather
                        # than crowd out table data (and keep the cache from growing by the
                        # WAL's whole write rate).
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)
            except FileExistsError as exc:
                raise AlreadyExists(key) from exc
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        if sync:
            fsync_dir(path.parent)
            if new_dir:
                fsync_dir(path.parent.parent)

    def get(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def folders(self, prefix: str) -> list[str]:
        folder = self._path(prefix) if prefix else self.root
        if not folder.is_dir():
            return []
        return sorted(p.name for p in folder.iterdir() if p.is_dir())

    def list_after(self, prefix: str, after: str | None) -> list[str]:
        return [key for key in self.list(prefix) if after is None or key > after]

    def list(self, prefix: str) -> list[str]:
        # os.scandir: the entry types come with the listing (no stat per entry). Every idle
        # shard's fence probe lists its manifest folder (1,024 a second at 1,024 shards).
        try:
            with os.scandir(self._path(prefix)) as entries:
                names = [e.name for e in entries if not e.name.startswith(".") and e.is_file()]
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(f"{prefix}/{name}" for name in names)

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()

    def delete_many(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.delete(key)


class ObjectStorage:
    """An S3 (or S3-compatible) bucket prefix through obstore."""

    def __init__(self, uri: str, options: dict[str, str]) -> None:
        parsed = urlparse(uri)
        self.uri = uri
        # Empty segments dropped, as object stores address "a//b/" and "a/b" alike.
        self.prefix = "/".join(part for part in parsed.path.split("/") if part)
        # Lance and obstore share the S3 option names; allow_http is a client option here.
        config = {k: v for k, v in options.items() if k != "allow_http"}
        client = {}
        if options.get("allow_http", "").lower() == "true":
            client["allow_http"] = True
        self.store = S3Store(
            parsed.netloc,
            prefix=self.prefix or None,
            config=config,  # type: ignore[arg-type]
            client_options=client,  # type: ignore[arg-type]
        )

    def put_if_absent(
        self, key: str, data: bytes | memoryview, *, cached: bool = True, durable: bool = True
    ) -> None:
        try:
            obstore.put(self.store, key, bytes(data), mode="create")
        except AlreadyExistsError as exc:
            raise AlreadyExists(key) from exc

    def get(self, key: str) -> bytes:
        try:
            return bytes(obstore.get(self.store, key).bytes())
        except (NotFoundError, FileNotFoundError) as exc:
            raise FileNotFoundError(key) from exc

    def exists(self, key: str) -> bool:
        try:
            obstore.head(self.store, key)
        except (NotFoundError, FileNotFoundError):
            return False
        return True

    def folders(self, prefix: str) -> list[str]:
        listed = obstore.list_with_delimiter(self.store, prefix + "/" if prefix else None)
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in listed["common_prefixes"])

    def list_after(self, prefix: str, after: str | None) -> list[str]:
        listed = obstore.list(self.store, prefix + "/", offset=after)
        return sorted(m["path"] for chunk in listed for m in chunk)

    def list(self, prefix: str) -> list[str]:
        keys = [m["path"] for chunk in obstore.list(self.store, prefix + "/") for m in chunk]
        return sorted(keys)

    def delete(self, key: str) -> None:
        with contextlib.suppress(NotFoundError, FileNotFoundError):
            obstore.delete(self.store, key)

    def delete_many(self, keys: Sequence[str]) -> None:
        """S3 DeleteObjects, up to 1,000 keys a request (obstore splits longer lists)."""
        if keys:
            with contextlib.suppress(NotFoundError, FileNotFoundError):
                obstore.delete(self.store, list(keys))


def is_local(uri: str) -> bool:
    """True for a local path or file:// URI."""
    scheme = urlparse(uri).scheme
    return len(scheme) <= 1 or scheme == "file"


def local_path(uri: str) -> Path:
    """The filesystem path of a local URI."""
    return Path(urlparse(uri).path if uri.startswith("file://") else uri)


def canonical_uri(uri: str) -> str:
    """One spelling per location, for identities derived from a URI (shard ids).

    A local path or file:// URI becomes its absolute path, normalised lexically (``.``,
    ``..``, repeated and trailing slashes removed; symlinks are not resolved, so a table
    reached through two different links has two spellings). An object-store URI becomes
    ``scheme://bucket/key`` with empty key segments (repeated, leading or trailing slashes)
    removed: object stores address ``s3://b//p/`` and ``s3://b/p`` alike. A URI already in
    this form is returned unchanged.
    """
    if is_local(uri):
        path = os.path.normpath(local_path(uri).absolute())
        return "/" + path.lstrip("/") if path.startswith("//") else path
    parsed = urlparse(uri)
    key = "/".join(part for part in parsed.path.split("/") if part)
    return f"{parsed.scheme.lower()}://{parsed.netloc}" + (f"/{key}" if key else "")


def uri_spellings(canonical: str) -> list[str]:
    """Other common spellings of the location `canonical` (a `canonical_uri`): with a
    trailing slash; for a local path also as a file:// URI and relative to each of its
    ancestors (as a process started there would have named it, with or without ``./``);
    for an object store also with a doubled slash after the bucket. Used to find state an
    older lance-sink stored under an identity derived from the URI as written."""
    out = [canonical + "/"]
    if is_local(canonical):
        out += [f"file://{canonical}", f"file://{canonical}/"]
        path = Path(canonical)
        for ancestor in path.parents:
            rel = str(path.relative_to(ancestor))
            out += [rel, rel + "/", f"./{rel}", f"./{rel}/"]
    else:
        parsed = urlparse(canonical)
        doubled = f"{parsed.scheme}://{parsed.netloc}/{parsed.path}"
        out += [doubled, doubled + "/"]
    return out


def open_storage(uri: str, options: dict[str, str] | None = None, *, fsync: bool = True) -> Storage:
    """The storage for `uri`: a local directory (fsynced) or an S3 prefix.

    Raises:
        PersistenceError: the URI scheme is not supported.
    """
    if is_local(uri):
        return LocalStorage(local_path(uri), fsync=fsync)
    if urlparse(uri).scheme == "s3":
        return ObjectStorage(uri, options or {})
    raise PersistenceError(f"unsupported storage URI {uri!r}")


def fsync_dir(path: Path) -> None:
    """fsync a directory so the names in it (new files, links) survive a power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_filesystem(path: Path) -> None:
    """Flush every dirty page of the filesystem holding `path` (Linux `syncfs`).

    Lance does not fsync its data files; this runs before WAL entries that a flush covered
    are deleted, so a power loss cannot lose rows that were acknowledged.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        syncfs = getattr(libc, "syncfs", None)
        if syncfs is None:  # not Linux: sync everything
            os.sync()
        elif syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err or errno.EIO), str(path))
    finally:
        os.close(fd)
