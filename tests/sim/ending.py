"""The end of a schedule (`World` takes it from `WindDown`): the faults heal and nothing new happens; the runtime
holding the run gets the time its uploads need, then what it left is judged (`Invariants.settled`: I7, I8).
"""

from __future__ import annotations

import heapq

from faults import FaultRates

__all__ = ["WindDown"]


class WindDown:
    """A mixin of `World`: its events, clock, drive, faults and invariants."""

    def _wind_down(self) -> None:
        """The end: the faults heal and nothing new happens; the runtime holding the run gets the time its
        uploads need (and pruning passes), then `Invariants.settled` judges what it left."""
        self.ending = True
        self.faults.rates, self.faults.enotconn_until = FaultRates(), -1.0
        self.faults._hidden.clear()
        self.service.fail = self.service.fail_page = 0.0
        self.service.down_until = -1.0
        backlog = sum(len(b.data) for vm in self.drive.vms for _, b in vm.big)
        # The uploads, plus the longest the kit lets a checkpoint wait for the one before it (publish.GATE_MIN_S)
        # and Drive's API polls between them (backing off to 2 minutes).
        grace = (backlog + 3 * self.s.size) / self.s.rate + 3 * self.s.size / self.s.pace_bps + 900.0
        until = self.clock.t + grace
        while self._events and not self.invariants.violations and not self._settled(final=False):
            t, _, kind, rt, payload = heapq.heappop(self._events)
            if t > until:
                break
            if kind != "mirror" or rt is None or not rt.alive or rt.busy:  # no heartbeat is needed: none takes over
                continue
            self.clock.t = max(self.clock.t, t)
            self.drive.advance(self.clock.t)
            self._do(kind, rt, payload)
            self.invariants.after_event()
        self._settled(final=True)

    def _settled(self, final: bool) -> bool:
        """Has the runtime holding the run (whoever holds it now: a takeover under way at the end may have
        finished) nothing left to do, and does what it left hold? With `final`, what does not is a violation."""
        for rt in self.live():
            if rt.run is not None and self.invariants.holds(rt) and not rt.run.mirror.paused:
                if not final and (rt.run.mirror._busy() or rt.run.mirror.gate.pending):
                    return False
                problems = self.invariants.settled(rt)
                if problems and final:
                    self.invariants.violate(*problems[0])
                return not problems
        return True
