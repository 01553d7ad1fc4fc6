"""What the kit knows of the huggingface_hub client: the versions the Hub store speaks, its progress bars and
log lines kept out of the notebook's cells, and which of its errors are "no answer" (unknown, ask again).
"""

from __future__ import annotations

import contextlib
import logging
import threading

from ..errors import ColabKitError

__all__ = ["LOWEST_CLIENT", "require_client", "no_answer", "no_progress_bars", "quiet_client_log", "retry_after", "status_of"]

# The Hub store speaks huggingface_hub 1.x (its errors and answers): measured on 1.27 (Colab's, in the Colab
# matrix) and 2.4. transformers 4.57 pins the client below 1.0, so requirements.txt admits 0.34 for runs kept
# in folders, and a Hub store with an older client is refused, saying what to install.
LOWEST_CLIENT = (1, 0)
_TRANSIENT = (429, 500, 502, 503, 504)


def status_of(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def retry_after(exc: BaseException) -> float | None:
    """Seconds the Hub asked the kit to wait before it asks again (None: it did not say): the later of its
    `Retry-After` and, where the client reads them (`parse_ratelimit_headers`), its rate-limit headers' time to
    the window's reset when no request is left in it (the Hub's 429s carry those; Retry-After may be absent)."""
    headers = getattr(getattr(exc, "response", None), "headers", None) or {}
    waits = []
    try:
        waits.append(float(headers.get("Retry-After")))
    except (TypeError, ValueError):
        pass
    limit = _rate_limit(headers)
    if limit is not None and limit.remaining == 0 and limit.reset_in_seconds is not None:
        waits.append(float(limit.reset_in_seconds))
    return max(waits, default=None)


def _rate_limit(headers):
    try:  # the client's own reader of the IETF rate-limit headers, in the versions that have it
        from huggingface_hub.utils import parse_ratelimit_headers
    except ImportError:
        return None
    try:
        return parse_ratelimit_headers(headers)
    except (TypeError, ValueError):
        return None


_BARS = threading.Lock()
_quiet = {"count": 0, "were_off": False}


@contextlib.contextmanager
def no_progress_bars():
    """The client's progress bars off while the kit talks to the Hub: they would be drawn from the uploader's
    thread into whatever cell the notebook runs. The client's switch is process-wide, so it is counted: the
    bars come back when the last such call ends (a download the user starts meanwhile shows no bar either)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    with _BARS:
        if _quiet["count"] == 0:
            _quiet["were_off"] = are_progress_bars_disabled()
            disable_progress_bars()
        _quiet["count"] += 1
    try:
        yield
    finally:
        with _BARS:
            _quiet["count"] -= 1
            if _quiet["count"] == 0 and not _quiet["were_off"]:
                enable_progress_bars()


class _MainThreadOnly(logging.Filter):
    """The client's own log lines ("Retrying in 2s") from the kit's background threads are dropped: they would
    land in the notebook's output; the kit says what the Hub's trouble costs itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return threading.current_thread() is threading.main_thread()


def quiet_client_log() -> None:
    hub_log = logging.getLogger("huggingface_hub")
    if not any(isinstance(f, _MainThreadOnly) for f in hub_log.filters):
        hub_log.addFilter(_MainThreadOnly())


def no_answer(exc: BaseException) -> bool:
    """A request whose outcome is unknown: no answer came, or a 5xx/429 did."""
    status = status_of(exc)
    if status is not None:
        return status in _TRANSIENT
    return isinstance(exc, (OSError, TimeoutError)) or type(exc).__module__.split(".")[0] in ("httpx", "httpx2",
                                                                                              "requests", "urllib3")


def require_client() -> None:
    """Refuse a Hub store whose huggingface_hub is older than the store speaks, saying what to install."""
    import huggingface_hub

    version = huggingface_hub.__version__
    parts = tuple(int(p) if p.isdigit() else 0 for p in version.split(".")[:2])
    if parts < LOWEST_CLIENT:
        raise ColabKitError(
            f"a Hub store needs huggingface_hub {'.'.join(map(str, LOWEST_CLIENT))} or newer, and this runtime has "
            f"{version} (transformers 4.x pins it below 1.0). pip install -U 'transformers>=5' 'huggingface_hub>=1', "
            f"then restart the runtime; or keep the run in a folder (drive=...)")
