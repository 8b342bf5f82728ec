"""Run librdkafka's mock cluster in its own process and print its bootstrap address.

The mock cluster lives inside a librdkafka client; this process holds one producer open
so the cluster stays up while sink processes come and go (and get SIGKILLed). Usage:

    python -m tests.support.mock_broker [NUM_BROKERS]

prints `BOOTSTRAP host:port` on stdout, then sleeps until terminated.
"""

from __future__ import annotations

import logging
import re
import signal
import sys
import threading

import confluent_kafka

_ADDRESS = re.compile(r"replaced with (\S+)")


def main() -> None:
    brokers = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    found = threading.Event()

    class _Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            match = _ADDRESS.search(record.getMessage())
            if match and not found.is_set():
                print(f"BOOTSTRAP {match.group(1)}", flush=True)
                found.set()

    logger = logging.getLogger("mock-broker")
    logger.addHandler(_Grab())
    logger.setLevel(logging.DEBUG)
    producer = confluent_kafka.Producer({"test.mock.num.brokers": brokers, "logger": logger})
    producer.poll(0.1)
    if not found.wait(10):
        print("ERROR mock cluster did not report its address", flush=True)
        sys.exit(1)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.is_set():
        producer.poll(0.5)


if __name__ == "__main__":
    main()
