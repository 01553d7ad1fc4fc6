"""Absence is not evidence: a file or folder missing from one read or one listing is unknown until
several looks, spaced in time, agree.

Drive hides files for a moment (a listing short an entry, an ENOENT from a file that is there a
second later), and so do other network mounts. Whoever would act on "it is not there" (resume from an
older checkpoint, write over a folder without a manifest, take a lease nobody seems to hold) asks
`again` first: it looks again after each of `WAITS` while the answer is still an absence, and returns
the last answer. Only when every look agreed may the caller take the absence as a fact.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from .clock import clock

__all__ = ["WAITS", "again", "span"]

# Seconds between looks: 6 s in all, longer than the moments Drive is known to hide a file for.
WAITS = (1.0, 2.0, 3.0)
T = TypeVar("T")


def again(look: Callable[[], T], absent: Callable[[T], bool], waits=None) -> T:
    """`look()`, repeated after each of `waits` (default `WAITS`) while `absent(answer)`; the last answer.
    An answer that is not an absence ends the looking at once (presence needs one look)."""
    answer = look()
    for wait in WAITS if waits is None else waits:
        if not absent(answer):
            break
        clock.sleep(wait)
        answer = look()
    return answer


def span(waits=None) -> float:
    """How long the looks of `again` take in all (for messages: "missing at 4 looks over 6 s")."""
    return float(sum(WAITS if waits is None else waits))
