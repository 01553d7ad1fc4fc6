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
    """Args: silent: keep messages out of the output (a follower rank: rank 0 says it once)."""

    def __init__(self, silent: bool = False) -> None:
        self._queue: collections.deque[str] = collections.deque(maxlen=200)
        self._lock = threading.Lock()
        self.silent = silent

    def add(self, message: str) -> None:
        log.info(message)  # show() prints it; a warning would print it twice through logging's last resort
        with self._lock:
            self._queue.append(message)

    def show(self) -> int:
        """Print the waiting messages (main thread only); returns how many."""
        with self._lock:
            messages = list(self._queue)
            self._queue.clear()
        for message in messages if not self.silent else ():
            print(f"colab_kit warning: {message}", file=sys.stderr, flush=True)
        return len(messages)


class Countdown:
    """One status line that a long wait updates: in place in a notebook (a display handle),
    a line every `every` seconds on stderr elsewhere. Main thread only."""

    def __init__(self, every: float = 10.0):
        from .runtime import in_notebook

        self._handle = None
        self._notebook = in_notebook()
        self._every = every
        self._last = float("-inf")

    def show(self, text: str) -> None:
        import time

        if self._notebook:
            from IPython.display import display

            if self._handle is None:
                self._handle = display({"text/plain": text}, raw=True, display_id=True)
            else:
                self._handle.update({"text/plain": text}, raw=True)
        elif time.monotonic() - self._last >= self._every:
            self._last = time.monotonic()
            print(text, file=sys.stderr, flush=True)
