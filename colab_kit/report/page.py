"""The status page: `STATUS.md` in the run folder, Markdown that the Hub renders and Drive's preview shows as
text, for a person who opens the run folder from a phone while the notebook's page sits on "Connecting".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .._units import format_age, format_bytes

__all__ = ["STATUS_PAGE", "STATUS_PICTURE", "PageFacts", "render_page", "utc"]

STATUS_PAGE = "STATUS.md"
STATUS_PICTURE = "status.png"


@dataclass
class PageFacts:
    """What the page says, gathered by the runtime that writes it (`reporter.py`)."""

    name: str
    state: str  # `state.state_of`
    host: str
    where: str  # "Google Colab, Tesla T4"
    started: float  # the lease's start (this runtime's claim), wall clock
    updated: float  # the heartbeat this page goes with
    heartbeat_s: float
    durability: str  # `drivefs.describe_kind`
    step: int | None = None
    total_steps: int | None = None
    steps_per_s: float | None = None
    saved_step: int | None = None
    cloud_step: int | None = None
    cloud_saved: float | None = None  # when that checkpoint was saved
    uploading: list[str] = field(default_factory=list)
    pending_bytes: int = 0
    pending_eta_s: float | None = None
    session: str | None = None  # "session: 1h02m left" (start_run(time_limit=...))
    note: str | None = None  # a paused run, a lost lease: one sentence


def utc(when: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(when))


def render_page(facts: PageFacts, *, picture: bool = True) -> str:
    rows = [("state", f"**{facts.state}**" + (f" on host `{facts.host}` ({facts.where})" if facts.host else "")
             + f", this runtime since {utc(facts.started)}")]
    if facts.step is not None:
        rows.append(("step", f"{facts.step:,}" + (f" of {facts.total_steps:,}" if facts.total_steps else "")
                     + (f" · {facts.steps_per_s:.3g} steps/s" if facts.steps_per_s else "")))
    rows.append(("newest in the cloud", f"checkpoint-{facts.cloud_step}, saved "
                 f"{format_age(max(facts.updated - facts.cloud_saved, 0.0))} before this update"
                 if facts.cloud_step is not None and facts.cloud_saved is not None else "none yet"))
    if facts.saved_step is not None and facts.saved_step != facts.cloud_step:
        rows.append(("newest saved", f"checkpoint-{facts.saved_step} (on this runtime's disk, on its way)"))
    if facts.uploading:
        eta = f", ~{format_age(facts.pending_eta_s)} left" if facts.pending_eta_s else ""
        rows.append(("uploading", f"{', '.join(facts.uploading)} ({format_bytes(facts.pending_bytes)}{eta})"))
    if facts.session:
        rows.append(("session", facts.session.removeprefix("session: ")))
    rows.append(("durability", facts.durability))
    alive = (f"rewritten every {format_age(facts.heartbeat_s)} while the run lives: a time older than "
             f"{format_age(4 * facts.heartbeat_s)} means its runtime stopped without finishing (killed, or cut)"
             if facts.state == "running" else "the run's last page")
    rows.append(("updated", f"{utc(facts.updated)}, {alive}"))
    lines = [f"# Run `{facts.name}`: {facts.state}", "", "| | |", "|---|---|",
             *(f"| {key} | {value} |" for key, value in rows), ""]
    if facts.note:
        lines += [facts.note, ""]
    if picture:
        lines += [f"![loss, memory and checkpoints over time]({STATUS_PICTURE})", ""]
    lines += ["Written by colab_kit beside the run's files. To continue the run after a disconnect: open the notebook "
              "again and use Runtime → Run all (it resumes from the newest checkpoint in the cloud). From a "
              "terminal: `python -m colab_kit status <this folder>`.", ""]
    return "\n".join(lines)
