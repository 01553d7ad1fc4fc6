"""Messages for the user that arise in background threads and are shown from the main one.

Printing from a worker thread lands in whatever cell happens to run (or nowhere in Colab),
so workers queue their messages here and the training loop's callbacks show them.
"""

from __future__ import annotations

import collections
import logging
import sys
import threading

log = logging.getLogger("colab_kit")


class Notices:
    def __init__(self) -> None:
        self._queue: collections.deque[str] = collections.deque(maxlen=200)
        self._lock = threading.Lock()

    def add(self, message: str) -> None:
        log.warning(message)
        with self._lock:
            self._queue.append(message)

    def show(self) -> int:
        """Print the waiting messages (main thread only); returns how many."""
        with self._lock:
            messages = list(self._queue)
            self._queue.clear()
        for message in messages:
            print(f"colab_kit warning: {message}", file=sys.stderr, flush=True)
        return len(messages)
