"""The one seam for time in the kit's durability core (the mirror, retention, leases, confirmation).

    from .clock import clock
    clock.time()        # wall time, seconds since the epoch (what journals and manifests record)
    clock.monotonic()   # for intervals and deadlines
    clock.sleep(s)      # waiting for Drive to answer again
    clock.within(s, fn) # fn() on a helper thread, waited for at most s seconds (the edges of a run)

Real time by default. The deterministic simulator (`tests/sim/`) installs a virtual clock with
`use_clock`, so that a 12-hour run of the kit's own workers takes a fraction of a second and every
schedule of events can be replayed from its seed.
"""

from __future__ import annotations

import contextlib
import threading
import time

__all__ = ["Clock", "clock", "use_clock", "Late"]


class Late(Exception):
    """`within` gave up waiting: the call goes on in the background, its outcome unknown."""


class Clock:
    """Real time."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def within(self, seconds: float | None, fn, name: str = "colab_kit-edge"):
        """`fn()`'s result, waiting for it at most `seconds` (None: no limit) on a daemon thread, so that
        a call that may hang on Drive never holds the caller longer.

        Raises:
            Late: it did not end in time (it goes on, and ends when Drive answers).
            Whatever `fn` raised.
        """
        if seconds is None:
            return fn()
        box: dict = {}

        def run():
            try:
                box["result"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box["error"] = exc

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        thread.join(max(0.0, seconds))
        if thread.is_alive():
            raise Late(f"still waiting after {seconds:.0f} s")
        if "error" in box:
            raise box["error"]
        return box.get("result")


class _Current:
    """Forwards to the clock in use (so `from .clock import clock` keeps working after `use_clock`)."""

    impl: Clock = Clock()

    def time(self) -> float:
        return self.impl.time()

    def monotonic(self) -> float:
        return self.impl.monotonic()

    def sleep(self, seconds: float) -> None:
        self.impl.sleep(seconds)

    def within(self, seconds: float | None, fn, name: str = "colab_kit-edge"):
        return self.impl.within(seconds, fn, name)


clock = _Current()


@contextlib.contextmanager
def use_clock(impl: Clock):
    """Run the block on `impl` (a virtual clock), then on the previous one again."""
    previous, _Current.impl = _Current.impl, impl
    try:
        yield impl
    finally:
        _Current.impl = previous
