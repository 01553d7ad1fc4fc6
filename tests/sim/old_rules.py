"""Rules the simulator's findings replaced, put back behind today's seams, one at a time: with one of them in
place the simulator must report a violation by itself (tests/drive/test_simulation.py). The rules of f65fb4d
that issue 27 found wanting (1-absence ... 6-listing), and those of 78514e6 that issue 38 found wanting
(38.1-same-step ... 38.4-clock-age).

Each is a function of a `patch(owner, name, value)` (pytest's monkeypatch.setattr, or `patched` below).
"""

from __future__ import annotations

import contextlib

from colab_kit.checkpoints.clock import clock
from colab_kit.checkpoints import search, snapshot, storage, validity
from colab_kit.checkpoints.checkpoint import CHECKPOINTS, list_checkpoints
from colab_kit.checkpoints.history import read_history
from colab_kit.checkpoints.journal import EVENTS
from colab_kit.drive import lease as lease_module, retention
from colab_kit.drive.gate import CheckpointGate, choose
from colab_kit.drive.lease import Lease
from colab_kit.checkpoints.leasefile import STALE_AFTER_BEATS
from colab_kit.drive.mirror import Mirror
from colab_kit.lifecycle import find
from colab_kit.loop import storefind

__all__ = ["OLD_RULES", "patched"]


def absence_is_a_fact(patch) -> None:
    """Finding 1: one ENOENT inside a listed checkpoint made it invalid, and retention deleted what is not
    valid, newer than the newest it counted too, on no proof but its own pass."""
    patch(validity, "_missing", lambda name, manifest: validity.Verdict(validity.INVALID, f"{name} is missing",
                                                                         manifest))

    def prunable(steps, valid, safe, keep, protect=frozenset(), best=None):
        ranked = sorted(safe & valid, reverse=True)
        if not ranked:
            return []
        newest = ranked[0]
        counted = {newest} | ({best} if best in ranked else set())
        for step in ranked:
            if len(counted) >= keep:
                break
            counted.add(step)
        kept = counted | set(protect) | ({best} if best in valid else set())
        return sorted(s for s in steps if s not in kept and (s < newest or s not in valid))

    patch(retention, "prunable", prunable)
    patch(CheckpointGate, "_witnessed", lambda self, target, witness: None)


def settle_rule(patch) -> None:
    """Finding 3: without attributes, a checkpoint counted as settled `settle` plus its size at the assumed
    rate (1 MB/s) after it was written, and older ones were deleted once a newer one settled."""

    def plan(self, listed, protect, best, tight=False):
        now = clock.time()
        settled, chosen = set(), {}
        for step, path in listed.items():
            try:
                chosen[step] = choose(path, step)
            except OSError as exc:
                return self._doubt(str(exc))
            verdict = validity.check(path, step=step)
            if verdict.unknown:
                return self._doubt(verdict.reason)
            if verdict.valid and now - chosen[step].written_at >= self.ladder.base_s + verdict.manifest.total_bytes / 1e6:
                settled.add(step)
        doomed = retention.prunable(listed, set(listed), settled, self.keep, set(protect), best)
        if not doomed:
            return [], None, ""
        newest = max(settled)
        return doomed, chosen[newest], f"checkpoint-{newest} settled"

    def witnessed(self, target, witness):  # the settled one vouched: it verifies, and is newer
        return None if witness is not None and validity.check(witness.path, step=witness.step).valid else "no"

    patch(retention.Pruner, "_plan_ladder", plan)
    patch(CheckpointGate, "_witnessed", witnessed)


def heartbeat_writes_unless_lost(patch) -> None:
    """Finding 4: `beat()` wrote unless `check()` was False, so an unknown read wrote the old runtime's lease
    over the new owner's; and `acquire()` took a lease file missing at one look for no lease."""

    def beat(self):
        if self.lost or self.check() is False:
            return False
        self._write()
        return True

    patch(Lease, "beat", beat)
    patch(Lease, "_run_folder_used", lambda self: False)


def one_short_listing(patch) -> None:
    """Finding 6: resume listed the folder three times back to back and took what those showed."""

    def listing(origin, root, told, waits):
        problem = ""
        for wait in (0.0, *waits):  # a listing that failed was tried again, as then
            clock.sleep(wait)
            try:
                found = {}
                for _ in range(3 if origin == "drive" else 1):
                    found.update(list_checkpoints(root))
                return found, ""
            except OSError as exc:
                problem = f"the folder could not be listed ({exc})"
        return None, problem

    patch(search, "_listing", listing)


def one_snapshot_folder_per_step(patch) -> None:
    """Issue 38, finding 1: a second save of a step took the first one's snapshot folder (emptied first), so
    letting go of the first (its upload failed once the Trainer rewrote its files) removed the second's."""

    def own_folder(root, step):
        target = root / f"checkpoint-{step}"
        storage.remove_tree(target)
        return target

    def submit(self, snap):
        with self._cond:
            if self._closed or self._paused:
                (snapshot.keep_on_disk if self.folder_gone else snapshot.discard)(snap)
                return
            kept = []
            for old in self._queued:
                if old.path == snap.path:  # the same step again: take_snapshot replaced its files
                    continue
                if old.step == self.best_step:
                    kept.append(old)
                    continue
                snapshot.discard(old)
            self._queued = kept + [snap]
            self._woken = True
            self._cond.notify_all()

    patch(snapshot, "_own_folder", own_folder)
    patch(Mirror, "submit", submit)


def the_oldest_must_verify(patch) -> None:
    """Issue 38, finding 2: the ladder's anchor was the oldest checkpoint, which had to verify: one that never
    would (a manifest whose model file died with its VM) held every deletion back for good."""

    plan_now = retention.Pruner._plan_ladder

    def plan(self, listed, protect, best, tight):
        try:
            finished = [c for c in (choose(path, step) for step, path in listed.items()) if c.manifest_raw is not None]
        except OSError as exc:
            return self._doubt(str(exc))
        if len(finished) >= 2:
            oldest = min(finished, key=lambda c: (c.written_at, c.step))
            if not validity.check(oldest.path, step=oldest.step).valid:
                return self._doubt(f"checkpoint-{oldest.step}, the oldest, does not verify now")
        return plan_now(self, listed, protect, best, tight)

    patch(retention.Pruner, "_plan_ladder", plan)


def one_look_at_the_folder(patch) -> None:
    """Issue 38, finding 3: one listing said whether the folder held checkpoints, and the journal was looked
    for again only if it did: a busy mount's first seconds (nothing listed, no journal) meant a fresh start."""

    def read_told(run_dir, local_copy=None):
        try:
            listed = bool(list_checkpoints(run_dir / CHECKPOINTS))
        except OSError:
            listed = True
        return read_history(run_dir / EVENTS, local_copy, expected=listed)

    patch(find, "read_told", read_told)
    patch(storefind, "read_told", read_told)


def heartbeat_age_by_this_clock(patch) -> None:
    """Issue 38, finding 4: another VM's heartbeat older than 4 beats by this VM's clock took the quick path,
    one confirming read after 2 s: a live runtime whose clock is behind was taken over."""
    original = Lease._dead_while_watched

    def watched(self, previous, on_watch, run_name):
        if clock.time() - previous.heartbeat <= STALE_AFTER_BEATS * previous.heartbeat_s:
            return original(self, previous, on_watch, run_name)
        beats = lease_module.WATCH_BEATS
        lease_module.WATCH_BEATS = min(2.0, previous.heartbeat_s) / previous.heartbeat_s
        try:
            return original(self, previous, on_watch, run_name)
        finally:
            lease_module.WATCH_BEATS = beats

    patch(Lease, "_dead_while_watched", watched)


OLD_RULES = {"1-absence": absence_is_a_fact, "3-settle": settle_rule, "4-heartbeat": heartbeat_writes_unless_lost,
             "6-listing": one_short_listing, "38.1-same-step": one_snapshot_folder_per_step,
             "38.2-invalid-anchor": the_oldest_must_verify, "38.3-one-look": one_look_at_the_folder,
             "38.4-clock-age": heartbeat_age_by_this_clock}


_INHERITED = object()  # the class had no attribute of its own: restoring deletes the patch


@contextlib.contextmanager
def patched(rule: str, rules: dict | None = None):
    """Run the block with the old rule `rule` (a key of OLD_RULES, or of `rules`: hub_rules.HUB_RULES) in place."""
    undo = []

    def patch(owner, name, value):
        # The raw attribute, not getattr's: getattr unwraps a staticmethod, and setting the bare function
        # back would turn it into a method for every later test in the process.
        own = vars(owner) if isinstance(owner, type) else None
        undo.append((owner, name, own.get(name, _INHERITED) if own is not None else getattr(owner, name)))
        setattr(owner, name, value)

    (rules or OLD_RULES)[rule](patch)
    try:
        yield
    finally:
        for owner, name, value in reversed(undo):
            if value is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
