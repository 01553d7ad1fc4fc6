"""A run's state in one word or two, said alike by its status page and by `python -m colab_kit status`.

The runtime that writes the page and the command that reads the store judge the same two facts: whether the
lease is released, and the status of the run's last `finish` (its journal line). A runtime that was killed or
cut never released its lease: both say "running", and the page's time (the command: the heartbeat's) tells a
reader that it stopped beating.
"""

from __future__ import annotations

from .page import utc

__all__ = ["RUNNING", "FINISHED", "state_of", "store_state", "state_lines"]

RUNNING, FINISHED = "running", "finished"
_DONE = ("finished", "completed")


def state_of(released: bool, finish_status: str | None) -> str:
    """"running", "finished", or "stopped (<why>)": a time limit, an error, the process's exit."""
    if not released:
        return RUNNING
    if finish_status is None or finish_status in _DONE:
        return FINISHED
    return f"stopped ({finish_status})"


def store_state(lease, events: list[dict]) -> str | None:
    """The state the store shows: its lease (a `LeaseInfo`, or None where none was ever written) and its journal.
    None: no runtime has opened the run."""
    if lease is None:
        return None
    finishes = [e.get("status") for e in events if e.get("event") == "finish"]
    return state_of(lease.released, finishes[-1] if finishes else None)


def state_lines(lease, events: list[dict], stale: str | None = None) -> list[str]:
    """`status`'s lines for the run's state and step as the store shows them (`lease`: False when it could not
    be read; `stale`: why this host's lease no longer protects its run), in the words of the status page."""
    if lease is False:
        return ["state: unknown (the lease could not be read)"]
    state = store_state(lease, events)
    if state is None:
        return ["state: never opened (no lease)"]
    lines = [f"state: {state}" + (f" (but {stale})" if state == RUNNING and stale else "")]
    if lease.step is not None:
        lines.append(f"step: {lease.step} (at the heartbeat of {utc(lease.heartbeat)}, by that runtime's clock)")
    return lines
