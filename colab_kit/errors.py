"""The kit's exceptions and warnings: one small hierarchy a user can catch."""

from __future__ import annotations

__all__ = [
    "ColabKitError",
    "ColabKitWarning",
    "DriveError",
    "LeaseHeldError",
    "LeaseLostError",
    "ResumeMismatchError",
    "CheckpointError",
    "RankFailedError",
    "TimeLimitReached",
]


class ColabKitError(Exception):
    """Base class of every error the kit raises on purpose."""


class DriveError(ColabKitError):
    """The persistent folder (Google Drive or its stand-in) cannot be used."""


class LeaseHeldError(ColabKitError):
    """Another live runtime is already writing this run's folder."""


class LeaseLostError(LeaseHeldError):
    """Another runtime took this run's folder over while this one trained: training stops here."""


class ResumeMismatchError(ColabKitError):
    """The checkpoint to resume from was made by an incompatible configuration."""


class CheckpointError(ColabKitError):
    """A checkpoint cannot be saved or loaded."""


class RankFailedError(ColabKitError):
    """Another process of the same launch failed during a step; this one stops with it."""


class TimeLimitReached(ColabKitError):
    """The run stopped before the session's time limit (`start_run(time_limit=...)`), saved and finished."""


class ColabKitWarning(UserWarning):
    """Base class of the kit's warnings (Drive trouble, skipped checkpoints, ...)."""
