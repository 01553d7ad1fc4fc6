"""The Hub repository's card (`README.md` at its root) lists the kit's runs in it and their state: a block of
its own between two markers, one row per run, so that whatever else the card says is kept as it is.

Each run rewrites its own row from the card at the head it commits on. Two runs of one repo that commit their
rows at the same moment can each miss the other's newest row; the next confirmed checkpoint of either writes
it again (the card is a view; each run's STATUS.md and lease are the truth).
"""

from __future__ import annotations

import time

__all__ = ["CARD", "update_card", "card_rows"]

CARD = "README.md"
_BEGIN, _END = "<!-- colab_kit runs: begin -->", "<!-- colab_kit runs: end -->"
_HEADER = ["| run | state | step | newest in the cloud | updated |", "|---|---|---|---|---|"]


def card_rows(text: str) -> dict[str, str]:
    """The rows of the kit's block in `text`, by run folder."""
    if _BEGIN not in text or _END not in text:
        return {}
    block = text.split(_BEGIN, 1)[1].split(_END, 1)[0]
    rows = {}
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("[") and "](" in cells[0]:
            rows[cells[0][1:cells[0].index("]")]] = line.strip()
    return rows


def update_card(existing: bytes | None, run: str, *, state: str, step: int | None, cloud_step: int | None,
                updated: float) -> bytes:
    """The card with `run`'s row written (the block added at the end when the card has none yet)."""
    text = existing.decode("utf-8", "replace") if existing else "# Training runs\n"
    rows = card_rows(text)
    rows[run] = (f"| [{run}]({run}/STATUS.md) | {state} | {step if step is not None else '-'} | "
                 f"{f'checkpoint-{cloud_step}' if cloud_step is not None else 'none yet'} | "
                 f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(updated))} |")
    block = "\n".join([_BEGIN, "Runs kept here by colab_kit (each run's `STATUS.md` says more):", "", *_HEADER,
                       *(rows[name] for name in sorted(rows)), _END])
    if _BEGIN in text and _END in text:
        before, rest = text.split(_BEGIN, 1)
        text = before + block + rest.split(_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    return text.encode()
