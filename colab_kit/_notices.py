"""Messages for the user that arise in background threads and are shown from the main one.

Printing from a worker thread lands in whatever cell happens to run (or nowhere in Colab),
so workers queue their messages here and the training loop's callbacks show them.
"""

from __future__ import annotations

import collections
import contextlib
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


@contextlib.contextmanager
def no_shard_bars():
    """Hide transformers' "Writing model shards" progress bar (one per checkpoint: a notebook that
    saves every few minutes fills with them) while the block runs; every other bar is left alone."""
    try:
        from transformers.utils import logging as hf_logging

        set_hook = hf_logging.set_tqdm_hook  # transformers 5: the bar and the hook came together
    except (ImportError, AttributeError):
        yield
        return
    previous = None

    def hook(factory, args, kwargs):
        if kwargs.get("desc") == "Writing model shards":
            return hf_logging.EmptyTqdm(*args, **kwargs)
        return previous(factory, args, kwargs) if previous is not None else factory(*args, **kwargs)

    previous = set_hook(hook)
    try:
        yield
    finally:
        set_hook(previous)
