"""The rules of f65fb4d that issue 27 found wanting, put back behind today's seams, one at a time: with one
of them in place the simulator must report a violation by itself (tests/sim/test_simulation.py).

Each is a function of a `patch(owner, name, value)` (pytest's monkeypatch.setattr, or `patched` below).
"""

from __future__ import annotations

import contextlib

from colab_kit.checkpoints.clock import clock
from colab_kit.checkpoints import search, validity
from colab_kit.checkpoints.checkpoint import list_checkpoints
from colab_kit.drive import retention
from colab_kit.drive.gate import CheckpointGate, choose
from colab_kit.drive.lease import Lease

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


OLD_RULES = {"1-absence": absence_is_a_fact, "3-settle": settle_rule, "4-heartbeat": heartbeat_writes_unless_lost,
             "6-listing": one_short_listing}


@contextlib.contextmanager
def patched(rule: str):
    """Run the block with the old rule `rule` (a key of OLD_RULES) in place."""
    undo = []

    def patch(owner, name, value):
        undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    OLD_RULES[rule](patch)
    try:
        yield
    finally:
        for owner, name, value in reversed(undo):
            setattr(owner, name, value)
