"""The Trainer's saves in the simulator's world (`World` takes them from `TrainerSaves`): files on the VM's local
disk, a snapshot (`take_snapshot`) handed to the kit's mirror (`Mirror.submit`), the Trainer's `save_total_limit`;
and, at random, a second save of the same step, as the Trainer's epoch-end save beside the kit's own (issue 38,
finding 1): every file rewritten in place (a snapshot's hard links see the new bytes), at the moment the first
save's upload begins or a moment after the save.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from colab_kit.checkpoints import storage
from colab_kit.checkpoints.snapshot import SNAPSHOTS, take_snapshot

from memfs import LOCAL

__all__ = ["TrainerSaves", "OUT"]

OUT = Path(LOCAL) / "out"


class TrainerSaves:
    """The saves of `World`'s runtimes (a mixin: it uses the world's clock, rng, schedule, fs and events)."""

    def _on_save(self, rt: Runtime, _) -> None:
        if self.ending:
            return
        rt.step += 10
        folder = OUT / f"checkpoint-{rt.step}"
        storage.make_dirs(folder)
        lineage = rt.session if not self.s.deterministic else ""
        for name, size in (("model.safetensors", self.s.size), ("optimizer.pt", self.s.size // 3)):
            storage.atomic_write_bytes(folder / name, _payload(f"{lineage}{name}{rt.step}", size))
        storage.atomic_write_bytes(folder / "trainer_state.json", json.dumps({"global_step": rt.step}).encode())
        self._snapshot(rt, folder)
        for _, old in sorted((int(e.name.split("-")[1]), e.path) for e in storage.list_dir(OUT)
                             if e.name.startswith("checkpoint-"))[:-2]:
            storage.remove_tree(old)  # the Trainer's save_total_limit
        if self.rng.random() < self.s.double_save:  # the Trainer saves this step again at the epoch's end: as
            rt.resave = rt.step  # the upload of the first save begins (`_changing`), or a moment later at most
            self.at(self.clock.t + self.rng.uniform(0.0, 3.0), "resave", rt, rt.step)
        self.at(self.clock.t + self.s.interval_s * (0.9 + 0.2 * self.rng.random()), "save", rt)

    def _on_resave(self, rt: Runtime, step: int) -> None:
        """The same step saved again, as the Trainer does over an existing folder: every file rewritten in place
        (the hard links of the first save's snapshot see the new bytes), the trainer state with the evaluation."""
        folder = OUT / f"checkpoint-{step}"
        if self.ending or rt.step != step or rt.resave != step or not storage.exists(folder):
            return
        rt.resave = None
        lineage = rt.session if not self.s.deterministic else ""
        for name, size in (("model.safetensors", self.s.size), ("optimizer.pt", self.s.size // 3)):
            self.fs.rewrite_in_place(folder / name, _payload(f"{lineage}{name}{step}", size))
        self.fs.rewrite_in_place(folder / "trainer_state.json", json.dumps({"global_step": step, "eval": 1}).encode())
        self.note(f"{rt} saves checkpoint-{step} again")
        self.happened["steps saved twice"] += 1
        self._snapshot(rt, folder)

    def _snapshot(self, rt: Runtime, folder) -> None:
        snap = take_snapshot(folder, OUT / SNAPSHOTS, rt.step, {"model": "sim"}, {"step": rt.step})
        rt.run.mirror.submit(snap)
        rt.run.journal.write("save", step=rt.step)
        rt.saved = rt.step

    # -- what happens to them ---------------------------------------------------------------------------

    def _changing(self, op: str, path: str, data: bytes | None = None) -> None:
        """Every change to the mount, before it happens: judged by the invariants; and the moment a checkpoint's
        upload begins, while the Trainer may be saving the same step again (the race of issue 38's finding 1)."""
        self.invariants.before_change(op, path, data)
        rt = self.fs.actor
        if rt is not None and rt.resave is not None and op == "write" \
                and f"/checkpoints/checkpoint-{rt.resave}/" in path and not self.invariants.violations:
            self._on_resave(rt, rt.resave)


def _payload(key: str, size: int) -> bytes:
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]
