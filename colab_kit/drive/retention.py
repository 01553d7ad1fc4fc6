"""Which checkpoints to let go: the rules that choose, for `gate.py`, which takes the proof and deletes.

Where uploads are confirmed (DriveFS's attributes, Drive's API) `keep` counts checkpoints *in the
cloud*: older ones go once a newer one is there, and what is newer than the newest one there stays
(a delete is a small metadata operation and reaches the cloud before a large pending upload does, so
pruning on anything less can leave no checkpoint in the cloud at all: tests/drive/test_cloud_e2e.py).
On a plain folder, written and read back is as safe as it gets.

Where nothing confirms uploads (a Drive mount without attributes, another network mount, and no API),
no guess about the upload rate may delete. The kit keeps a *ladder*, whatever the rate:

  - the run's oldest checkpoint that verifies, its *anchor* (never deleted there: every deletion needs an
    older checkpoint to vouch for it, `gate.py`), so that once one checkpoint reached the cloud, one always is
    there. An older one that does not verify (the upload of a runtime recycled half-way: its small manifest
    reached Drive, its model file never did) holds nothing a resume could use: it is reported, and deleted
    through the same gate on the proof that the anchor verifies now (else it would hold every later deletion
    back, and the folder would grow without bound);
  - every checkpoint younger than `base_s` (they may be on their way);
  - and one per doubling of age beyond it (the oldest written in each band [base, 2 base), [2 base,
    4 base), ...), so that something about half the run's age or younger is there too.

That is about log2(run age / base) + 2 checkpoints (9 for a 12-hour run at the default 10 minutes).

A pass decides from reads, and a read that fails is unknown, not "invalid" or "gone": the pass then
stops and deletes nothing (`Pruner.prune` returns None), and the next pass looks again.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Iterable

from ..checkpoints.clock import clock
from .._units import format_age
from ..checkpoints import validity
from ..checkpoints.checkpoint import list_checkpoints
from .drivefs import PLAIN, UNCONFIRMED
from .gate import Chosen, CheckpointGate, choose

__all__ = ["Ladder", "prunable", "ladder", "Pruner"]

log = logging.getLogger(__name__)


class Ladder:
    """What the ladder keeps where nothing confirms uploads: see the module docstring."""

    def __init__(self, base_s: float = 600.0):
        if not isinstance(base_s, (int, float)) or isinstance(base_s, bool) or not base_s > 0:
            raise ValueError(f"settle={base_s!r}: give a duration longer than zero, such as \"10min\"")
        self.base_s = float(base_s)

    def describe(self) -> str:
        return (f"the run's oldest checkpoint, every one younger than {format_age(self.base_s)}, and one per "
                f"doubling of age beyond that")


def ladder(written: dict[int, float], now: float, base_s: float) -> set[int]:
    """The steps the ladder keeps, given when each was written (`written`: step -> time)."""
    if not written:
        return set()
    kept = {min(written, key=lambda s: (written[s], s))}  # the oldest written
    bands: dict[int, int] = {}
    for step, at in written.items():
        age = now - at
        if age < base_s:
            kept.add(step)
            continue
        band = int(math.log2(age / base_s))
        if band not in bands or (at, step) < (written[bands[band]], bands[band]):
            bands[band] = step
    return kept | set(bands.values())


def prunable(steps: Iterable[int], valid: set[int], safe: set[int], keep: int,
             protect: set[int] = frozenset(), best: int | None = None) -> list[int]:
    """The checkpoints to delete where uploads are confirmed, given which are valid and which are safe.

    Keeps the `keep` newest safe checkpoints (so at least one always remains), everything newer than
    the newest safe one (valid or not: it may be on its way, and what is newer is never deleted on
    account of an older one), and `protect`; chooses the older rest. With no safe checkpoint nothing.

    `best`, the Trainer's best checkpoint, is never deleted while it is valid, and once safe it
    takes one of the `keep` places, as in the Trainer's own rotation: with keep=1 the newest and
    the best both stay.
    """
    ranked = sorted(safe & valid, reverse=True)
    if not ranked:
        return []
    newest = ranked[0]
    counted = {newest} | ({best} if best in ranked else set())  # the places of `keep` they take
    for step in ranked:
        if len(counted) >= keep:
            break
        counted.add(step)
    kept = counted | set(protect) | ({best} if best in valid else set())
    return sorted(s for s in steps if s not in kept and s < newest)


class Pruner:
    """Chooses the checkpoints of one folder that the rules let go, and hands each to the gate.

    Args:
        root: the folder of `checkpoint-<step>` folders.
        kind: the folder's kind (the gate's: PLAIN for the rule before 0.2, `prune_after="written"`).
        keep: checkpoints in the cloud to keep (where uploads are confirmed).
        gate: the `CheckpointGate` that proves and deletes.
        ladder: what is kept where nothing confirms uploads.
    """

    def __init__(self, root: Path, *, kind: str, keep: int, gate: CheckpointGate, ladder: Ladder = Ladder()):
        self.root, self.kind, self.keep, self.gate, self.ladder = Path(root), kind, keep, gate, ladder
        self.last_doubt: str | None = None  # why the last pass deleted nothing, when it was a doubt
        self._reported: set[int] = set()  # checkpoints journaled as invalid (said once)
        self.again = False  # the last pass chose a checkpoint the gate kept (its proof may hold at the next)

    def prune(self, tracker, *, protect: set[int], best: int | None, tight: bool = False) -> list[int] | None:
        """One pass: delete what the rules allow and the gate proves; returns the steps, or None when a
        doubt (a failed read, a listing without a checkpoint being followed) stopped the pass. `tight`: Drive is
        full, so keep as little as the rules allow (the newest in the cloud; without confirmation, the oldest
        and the newest), each deletion on the same proof."""
        try:
            listed = {s: p for s, p in list_checkpoints(self.root) if p not in set(self.gate.pending)}
        except OSError as exc:
            return self._doubt(f"the checkpoints could not be listed ({exc.strerror or exc})")
        self.gate.evidence.new_pass(listed.values())
        followed = tracker.checkpoint_steps()
        if followed - set(listed):  # a listing that hides a checkpoint: look again later
            return self._doubt(f"checkpoint-{min(followed - set(listed))} is missing from the listing")
        away = {s: c for s, c in self.gate.elsewhere().items() if s not in listed}  # the Hub's, on their way
        if self.kind == UNCONFIRMED:
            plan = self._plan_ladder(listed, protect, best, tight)
        else:
            plan = self._plan_confirmed(tracker, listed, away, protect, best, 1 if tight else self.keep)
        if plan is None:
            return None
        doomed, witness, because = plan
        self.last_doubt = None
        self.again = False
        deleted = []
        for step in doomed:
            try:
                target = away[step][0] if step in away else choose(listed[step], step)
                done = self.gate.delete(target, witness, because=because)
            except OSError as exc:  # Drive trouble: what is left is chosen again at the next pass
                return self._doubt(f"checkpoint-{step} could not be deleted now ({exc.strerror or exc})")
            if done:
                tracker.forget(f"checkpoint-{step}")
                deleted.append(step)
            else:
                self.again = True
        return deleted

    def _plan_confirmed(self, tracker, listed: dict[int, Path], away: dict, protect, best, keep: int):
        """`away`: the checkpoints on their way to the folder (`CheckpointGate.elsewhere`), judged as the store
        holds them: the rules judge the whole run, never the part that has arrived."""
        safe = set(listed) if self.kind == PLAIN else (tracker.confirmed_steps(verified_only=False)
                                                       | self.gate.in_cloud_elsewhere())
        steps = set(listed) | set(away)
        known_bad = {s for s, (_, whole) in away.items() if not whole}
        counted: list[int] = []
        for step in sorted(safe & steps - known_bad, reverse=True):
            if len(counted) >= keep and step != best:
                continue  # enough counted: only the best still needs a look
            if step in away:
                counted.append(step)
                continue
            verdict = validity.check(listed[step], step=step)
            if verdict.unknown:
                return self._doubt(f"checkpoint-{step}: {verdict.reason}")
            if verdict.valid:
                tracker.mark_verified(step)
                counted.append(step)
            else:
                known_bad.add(step)
                tracker.forget(f"checkpoint-{step}")  # never claimed in the cloud
        doomed = prunable(steps, steps - known_bad, set(counted), keep, set(protect), best)
        if not doomed:
            return [], None, ""
        newest = max(counted)
        try:
            witness = away[newest][0] if newest in away else choose(listed[newest], newest)
        except OSError as exc:
            return self._doubt(f"checkpoint-{newest} could not be read ({exc.strerror or exc})")
        return doomed, witness, f"checkpoint-{newest} is {'in the cloud' if self.kind != PLAIN else 'saved'}"

    def _plan_ladder(self, listed: dict[int, Path], protect, best, tight: bool):
        chosen: dict[int, Chosen] = {}
        for step, path in listed.items():
            try:
                chosen[step] = choose(path, step)
            except OSError as exc:
                return self._doubt(f"checkpoint-{step} could not be read ({exc.strerror or exc})")
        finished = {s: c for s, c in chosen.items() if c.manifest_raw is not None}
        if len(finished) < 2:
            return [], None, ""
        order = self.gate.evidence.write_order  # written before or after: never read off a clock
        anchor, invalid = self._anchor(sorted(finished.values(), key=order))
        if anchor is None:  # nothing verifies: nothing is deleted
            return [], None, ""
        later = {s: c for s, c in finished.items() if order(c) >= order(anchor)}
        newest = max(later.values(), key=order).step
        written = {s: c.written_at for s, c in later.items()}  # ages: the files' times, which only choose
        kept = ({anchor.step} if tight else ladder(written, clock.time(), self.ladder.base_s)) | set(protect) | {newest}
        if best is not None:
            kept.add(best)
        doomed = sorted({s for s, c in chosen.items() if s not in kept and order(c) > order(anchor)}
                        | (invalid - set(protect)))
        return doomed, anchor, f"the ladder keeps checkpoint-{anchor.step} (the first written that verifies) and " \
                               f"one per doubling of age"

    def _anchor(self, oldest_first: list[Chosen]) -> tuple[Chosen | None, set[int]]:
        """(the first written checkpoint that verifies, or None; the steps of those written before it that hold no
        checkpoint, by the gate's evidence: they go, vouched for by it). One written before it that cannot be
        read now is neither: it stays, and the next pass looks again."""
        invalid: set[int] = set()
        for chosen in oldest_first:
            verdict = validity.check(chosen.path, step=chosen.step)
            if verdict.valid:
                return chosen, invalid
            if verdict.state == validity.UNFINISHED or not self.gate.evidence.holds_no_checkpoint(chosen):
                continue  # no manifest (not a checkpoint yet), or unknown for now
            invalid.add(chosen.step)
            if chosen.step not in self._reported:
                self._reported.add(chosen.step)
                reason = validity.check(chosen.path, step=chosen.step).reason
                log.info("checkpoint-%d holds no checkpoint (%s): it goes, vouched for by a newer one", chosen.step,
                         reason)
                self.gate.journal.write("warn", what="invalid_checkpoint", step=chosen.step, reason=reason)
        return None, invalid

    def _doubt(self, why: str) -> None:
        self.again = False
        if why != self.last_doubt:
            log.info("pruning deleted nothing this time: %s", why)
        self.last_doubt = why
        return None
