"""OS names for the sink's threads.

Python names its threads for itself only: the kernel knows every thread of the process by
the interpreter's name, so ``top -H``, ``ps -L`` and per-thread CPU (``/proc/<pid>/task``)
cannot tell the consumer loop from the WAL writers, the decoders or the flushes. Each
long-lived thread gives itself a short OS name here (librdkafka and Lance name theirs).
"""

from __future__ import annotations

import ctypes
import sys
import threading

__all__ = ["name_os_thread"]

#: The kernel keeps 15 bytes of a thread's name (plus the terminating zero).
OS_NAME_BYTES = 15
_PR_SET_NAME = 15  # linux/prctl.h


def name_os_thread(name: str | None = None) -> bool:
    """Give the calling thread an OS name: `name`, or its Python name, cut to 15 bytes.

    A `ThreadPoolExecutor` initializer as it is (each worker takes its Python name, e.g.
    ``decode_0``). Returns whether it took effect (False off Linux).
    """
    if not sys.platform.startswith("linux"):
        return False
    text = (name or threading.current_thread().name).encode()[:OS_NAME_BYTES]
    try:
        return bool(ctypes.CDLL(None).prctl(_PR_SET_NAME, ctypes.c_char_p(text), 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False
