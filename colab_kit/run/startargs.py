"""`start_run`'s arguments, every one checked before anything is touched."""

from __future__ import annotations

from .._units import is_count, parse_duration, parse_rate
from ..drive.confirm import check_confirm
from ..drive.retention import Ladder
from ..lifecycle.find import RESUME_MODES

__all__ = ["check_settings"]


def parse_save_every(save_every) -> tuple[float | None, int | None]:
    if save_every is None:
        return None, None
    if isinstance(save_every, bool):
        raise ValueError("save_every must be a duration such as \"10min\" or an int number of steps")
    if isinstance(save_every, int):
        if save_every < 1:
            raise ValueError(f"save_every={save_every}: the number of steps must be at least 1")
        return None, save_every
    if isinstance(save_every, float):
        raise ValueError(f"save_every={save_every}: give an int number of steps, or a duration "
                         f"string such as \"90s\", \"10min\" or \"1h\"")
    return parse_duration(save_every), None


def check_settings(keep, confirm, resume, settle, assumed_rate, save_every) -> tuple[Ladder, float, tuple]:
    """Every argument checked before anything is touched: (ladder, pace rate, save interval)."""
    if not is_count(keep):
        raise ValueError(f"keep={keep!r}: keep at least 1 checkpoint on Drive")
    check_confirm(confirm)
    if resume not in RESUME_MODES or isinstance(resume, int) and not isinstance(resume, bool):
        raise ValueError(f"resume={resume!r}: use True (the newest checkpoint), False (start fresh, archiving the "
                         f"old ones) or 'readable' (the newest that can be read now)")
    if isinstance(settle, bool) or not isinstance(settle, (int, float, str)):
        raise ValueError(f"settle={settle!r}: give a duration such as \"10min\", or seconds")
    try:
        ladder = Ladder(settle if isinstance(settle, (int, float)) else parse_duration(settle))
    except ValueError as exc:
        raise ValueError(f"settle={settle!r}: {exc}") from None
    return ladder, parse_rate(assumed_rate), parse_save_every(save_every)
