"""A Confluent-compatible Schema Registry served over HTTP on 127.0.0.1, for tests.

No registry server is installable here (no Karapace on the package index, Confluent's jars
are not served), so this implements the REST subset confluent-kafka's client uses to
register and read schemas, with the registry's status and error codes:

    POST /subjects/{subject}/versions        register (same schema again = same id)
    POST /subjects/{subject}                 look a schema up in a subject
    GET  /schemas/ids/{id}                   a schema by id (404, error_code 40403)
    GET  /subjects/{subject}/versions/{v}    a version (or ``latest``) of a subject (40401)
    GET  /subjects, /subjects/{subject}/versions

Tests exercise the real client through it: caching (`requests` counts every request),
authentication (`basic_auth` or `bearer` makes others get 401), server errors
(`fail_with` answers every request with that status) and outages (`stop`, then `start`
on the same port: connections are refused meanwhile).
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlparse

from tests.support.brokers import free_port


class FakeRegistry:
    """The registry's state and its HTTP server (see the module docstring)."""

    def __init__(
        self, basic_auth: tuple[str, str] | None = None, bearer: str | None = None
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.basic_auth = basic_auth
        self.bearer = bearer
        self.fail_with: int | None = None
        self.delay_s = 0.0  # every answer waits this long (concurrent requests overlap)
        self.requests: Counter[str] = Counter()  # "GET /schemas/ids/1" -> count
        self.schemas: list[dict[str, Any]] = []  # id - 1 -> {"schema", "schemaType", ...}
        self.subjects: dict[str, list[int]] = {}  # subject -> schema ids by version
        self._lock = threading.RLock()  # `_route` registers under it
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> FakeRegistry:
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
                pass

            def do_GET(self) -> None:
                registry._handle(self, "GET")

            def do_POST(self) -> None:
                registry._handle(self, "POST")

        ThreadingHTTPServer.allow_reuse_address = True
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving: connections are refused until `start`."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # -- direct access for tests ---------------------------------------------------------

    def register(self, subject: str, schema: str, schema_type: str = "AVRO") -> int:
        with self._lock:
            entry = {"schema": schema, "schemaType": schema_type}
            if entry in self.schemas:
                schema_id = self.schemas.index(entry) + 1
            else:
                self.schemas.append(entry)
                schema_id = len(self.schemas)
            versions = self.subjects.setdefault(subject, [])
            if schema_id not in versions:
                versions.append(schema_id)
            return schema_id

    # -- HTTP ------------------------------------------------------------------------------

    def _handle(self, req: BaseHTTPRequestHandler, method: str) -> None:
        url = urlparse(req.path)
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        self.requests[f"{method} {url.path}"] += 1
        time.sleep(self.delay_s)
        if self.fail_with is not None:
            self._send(req, self.fail_with, {"error_code": 50001, "message": "failing"})
            return
        if not self._authorized(req.headers.get("Authorization")):
            self._send(req, 401, {"error_code": 40101, "message": "Unauthorized"})
            return
        body: dict[str, Any] = {}
        if method == "POST":
            length = int(req.headers.get("Content-Length") or 0)
            body = json.loads(req.rfile.read(length) or b"{}")
        status, payload = self._route(method, parts, body)
        self._send(req, status, payload)

    def _authorized(self, header: str | None) -> bool:
        if self.basic_auth is not None:
            token = base64.b64encode(":".join(self.basic_auth).encode()).decode()
            return header == f"Basic {token}"
        if self.bearer is not None:
            return header == f"Bearer {self.bearer}"
        return True

    def _route(self, method: str, parts: list[str], body: dict[str, Any]) -> tuple[int, Any]:
        with self._lock:
            if method == "GET" and parts[:2] == ["schemas", "ids"] and len(parts) == 3:
                schema_id = int(parts[2])
                if not 1 <= schema_id <= len(self.schemas):
                    return 404, {"error_code": 40403, "message": "Schema not found"}
                return 200, dict(self.schemas[schema_id - 1])
            if method == "GET" and parts == ["subjects"]:
                return 200, sorted(self.subjects)
            if parts[0] == "subjects" and len(parts) >= 2:
                subject = parts[1]
                if method == "POST" and len(parts) == 3 and parts[2] == "versions":
                    schema_id = self.register(
                        subject, body["schema"], body.get("schemaType", "AVRO")
                    )
                    return 200, {"id": schema_id}
                versions = self.subjects.get(subject)
                if versions is None:
                    return 404, {"error_code": 40401, "message": f"Subject '{subject}' not found."}
                if method == "POST" and len(parts) == 2:
                    entry = {"schema": body["schema"], "schemaType": body.get("schemaType", "AVRO")}
                    if entry not in self.schemas or self.schemas.index(entry) + 1 not in versions:
                        return 404, {"error_code": 40403, "message": "Schema not found"}
                    schema_id = self.schemas.index(entry) + 1
                    return 200, self._version(subject, versions.index(schema_id) + 1)
                if method == "GET" and len(parts) == 3 and parts[2] == "versions":
                    return 200, list(range(1, len(versions) + 1))
                if method == "GET" and len(parts) == 4 and parts[2] == "versions":
                    version = len(versions) if parts[3] == "latest" else int(parts[3])
                    if not 1 <= version <= len(versions):
                        return 404, {"error_code": 40402, "message": "Version not found."}
                    return 200, self._version(subject, version)
            return 404, {"error_code": 404, "message": "HTTP 404 Not Found"}

    def _version(self, subject: str, version: int) -> dict[str, Any]:
        schema_id = self.subjects[subject][version - 1]
        return {
            "subject": subject,
            "version": version,
            "id": schema_id,
            **self.schemas[schema_id - 1],
        }

    @staticmethod
    def _send(req: BaseHTTPRequestHandler, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        req.send_response(status)
        req.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        req.wfile.write(data)
