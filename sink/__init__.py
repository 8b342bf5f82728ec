"""lance-sink, the Kafka side: consumer loop, decoding, offsets, pause/resume, DLQ, metrics,
HTTP and CLI."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("lance-sink")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
