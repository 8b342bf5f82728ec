"""A moto S3 server behind a TCP proxy that holds each request for a fixed latency.

    with slow_s3(latency_ms=50) as s3:
        s3.storage_options   # for `table.storage_options` / Lance / obstore
        s3.bucket            # a fresh bucket

The proxy forwards bytes both ways and sleeps `latency_ms` before passing on the first chunk
of each request (the first the client sends after a response: an HTTP request arrives as
one or a few chunks on a kept-alive connection, headers and body apart), so every S3 call
costs one latency, like a request to a remote region (held per chunk, as before, a request
sent in several chunks cost several). Used by
`bench.scale --s3-latency-ms` for the drain of many shards against its deadline.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.support.brokers import free_port, start_moto


@dataclass(frozen=True)
class SlowS3:
    endpoint: str
    bucket: str

    @property
    def storage_options(self) -> dict[str, str]:
        return {
            "aws_access_key_id": "testing",
            "aws_secret_access_key": "testing",
            "aws_region": "us-east-1",
            "aws_endpoint": self.endpoint,
            "allow_http": "true",
        }


class _Exchange:
    """One connection's turn: an HTTP/1.1 client sends its next request only after the
    response to the last one, so the first chunk after a response starts a request."""

    def __init__(self) -> None:
        self.answered = True


async def _pipe(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    delay_s: float,
    exchange: _Exchange,
    *,
    request: bool,
) -> None:
    try:
        while chunk := await reader.read(1 << 16):
            if request and exchange.answered:  # a new request: held once, not per chunk
                exchange.answered = False
                if delay_s:
                    await asyncio.sleep(delay_s)
            elif not request:
                exchange.answered = True
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


def _serve(port: int, target_port: int, delay_s: float, ready: threading.Event) -> None:
    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection("127.0.0.1", target_port)
        exchange = _Exchange()
        await asyncio.gather(
            _pipe(cr, sw, delay_s, exchange, request=True),
            _pipe(sr, cw, 0.0, exchange, request=False),
        )

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        ready.set()
        async with server:
            await server.serve_forever()

    asyncio.run(main())


@contextmanager
def slow_s3(latency_ms: float, log_dir: Path) -> Iterator[SlowS3]:
    import boto3  # noqa: PLC0415 - dev dependency (moto[server]), benchmarks only

    moto = start_moto(log_dir)
    try:
        port = free_port()
        ready = threading.Event()
        threading.Thread(
            target=_serve, args=(port, moto.port, latency_ms / 1000, ready), daemon=True
        ).start()
        ready.wait(10)
        bucket = f"scale-{uuid.uuid4().hex[:8]}"
        boto3.client(
            "s3",
            endpoint_url=moto.bootstrap,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",  # noqa: S106 - moto's fixed test key
            region_name="us-east-1",
        ).create_bucket(Bucket=bucket)
        yield SlowS3(f"http://127.0.0.1:{port}", bucket)
    finally:
        moto.stop()
