"""An in-memory Google Drive as Colab's DriveFS shows it, for the simulator: the cloud, each VM's
cache with its upload queue, the Trash, and the ground truth the invariants read.

What a VM's mount shows (`view`) is its own files not yet uploaded (`Vm.dirty`) over the cloud. The
rules follow `tests/scripts/drivefs_emulator.py` and what is known of DriveFS
(`shared/research/drive-reality.md`), taking the worst case where it is not known:

- A write lands in the VM's cache at once and joins its upload queue. Checkpoint data files go one
  after another at `rate` bytes/s (FIFO); small files (manifests, the lease, the journal, emptied
  files) go on their own after a short latency, so a manifest can reach the cloud before the data it
  lists. A file reaches the cloud whole, replacing the cloud's copy at once.
- mkdir, unlink, rmdir and rename are small metadata operations: they reach the cloud at once, ahead
  of any queued upload. An unlinked cloud file goes to the Trash with its bytes.
- A VM that dies loses its cache and queue; a new VM's mount shows the cloud.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json

__all__ = ["Blob", "Vm", "DriveModel"]

MANIFEST = "MANIFEST.json"


class Blob:
    """One version of a file's bytes (a hard link shares the object)."""

    __slots__ = ("data", "mtime_ns")

    def __init__(self, data: bytes, mtime_ns: int):
        self.data, self.mtime_ns = data, mtime_ns


class CloudFile:
    __slots__ = ("data", "md5", "id", "mtime_ns")

    def __init__(self, data: bytes, item_id: str, mtime_ns: int):
        self.data, self.id, self.mtime_ns = data, item_id, mtime_ns
        self.md5 = hashlib.md5(data).hexdigest()


class Vm:
    """One runtime's machine: its Drive cache (files written, not yet uploaded) and upload queues."""

    def __init__(self, name: str, now: float):
        self.name = name
        self.alive = True
        self.dirty: dict[str, Blob] = {}
        self.local_ids: dict[str, str] = {}
        self.big: collections.deque = collections.deque()  # (path, blob), FIFO at the rate
        self.small: list = []  # (due, path, blob)
        self.done = 0.0  # bytes of the head of `big` already sent
        self.t = now


class DriveModel:
    """The cloud and the VMs that write to it, with the upload rule above.

    Args:
        root: the mount's path in the simulator (MyDrive).
        rate: checkpoint data uploaded per virtual second, in bytes.
        small_latency: (lo, hi) seconds a small file takes.
        quota: bytes of cloud + Trash + pending before writes fail with ENOSPC (None: none).
    """

    def __init__(self, root: str, *, rate: float, small_latency=(0.5, 2.0), quota: int | None = None, rng=None):
        self.root = root
        self.rate, self.small_latency, self.quota, self.rng = rate, small_latency, quota, rng
        self.files: dict[str, CloudFile] = {}
        self.dirs: dict[str, str] = {root: "root"}
        self.trash_bytes = 0
        self.version = 0  # bumped by every change under a checkpoints folder (ground truth caches)
        self.on_commit = None  # told (path, data) of every file that reaches the cloud
        self._ids = itertools.count(1)
        self.vms: list[Vm] = []

    # -- ids and time -----------------------------------------------------------------------------
    def new_id(self, prefix: str = "id") -> str:
        return f"{prefix}{next(self._ids)}"

    def new_vm(self, name: str, now: float) -> Vm:
        vm = Vm(name, now)
        self.vms.append(vm)
        return vm

    def kill(self, vm: Vm) -> None:
        """The VM dies: what it had not uploaded is gone."""
        vm.alive = False
        vm.dirty.clear()
        vm.big.clear()
        vm.small.clear()

    def advance(self, now: float) -> None:
        """Let every live VM's uploads progress up to `now`."""
        for vm in self.vms:
            if vm.alive and (vm.big or vm.small):
                self._advance(vm, now)
            vm.t = now

    def _advance(self, vm: Vm, now: float) -> None:
        if vm.small:
            due = [item for item in vm.small if item[0] <= now]
            if due:
                vm.small = [item for item in vm.small if item[0] > now]
                for _, path, blob in sorted(due, key=lambda item: item[0]):
                    self._commit(vm, path, blob)
        budget = (now - vm.t) * self.rate
        while vm.big and budget > 0:
            path, blob = vm.big[0]
            if vm.dirty.get(path) is not blob:  # superseded or deleted: not uploaded
                vm.big.popleft()
                vm.done = 0.0
                continue
            need = max(1.0, len(blob.data) - vm.done)
            if budget >= need:
                budget -= need
                vm.big.popleft()
                vm.done = 0.0
                self._commit(vm, path, blob)
            else:
                vm.done += budget
                budget = 0

    def _commit(self, vm: Vm, path: str, blob: Blob) -> None:
        if vm.dirty.get(path) is not blob:
            return  # a newer version waits behind it, or the file was deleted
        del vm.dirty[path]
        parent = path.rsplit("/", 1)[0]
        if parent not in self.dirs:  # its folder was deleted meanwhile: the upload has nowhere to go
            return
        old = self.files.get(path)
        vm.local_ids.pop(path, None)
        item_id = old.id if old is not None else self.new_id("f")
        self.files[path] = CloudFile(blob.data, item_id, blob.mtime_ns)
        self._changed(path)
        if self.on_commit is not None:
            self.on_commit(path, blob.data)

    def _changed(self, path: str) -> None:
        if "/checkpoints/" in path or path.endswith("/checkpoints"):
            self.version += 1

    # -- what a VM's mount does -------------------------------------------------------------------
    def write(self, vm: Vm, path: str, data: bytes, mtime_ns: int, now: float) -> None:
        blob = Blob(data, mtime_ns)
        vm.dirty[path] = blob
        if path not in self.files and path not in vm.local_ids:
            vm.local_ids[path] = self.new_id("local-")
        if _is_data(path) and data:
            vm.big.append((path, blob))
        else:
            lo, hi = self.small_latency
            vm.small.append((now + (self.rng.uniform(lo, hi) if self.rng else lo), path, blob))

    def unlink(self, vm: Vm, path: str) -> bool:
        """Delete `path` from the VM's cache and, at once, from the cloud (to the Trash). False: not there."""
        there = vm.dirty.pop(path, None) is not None
        cloud = self.files.pop(path, None)
        if cloud is not None:
            self.trash_bytes += len(cloud.data)
            self._changed(path)
        return there or cloud is not None

    def mkdir(self, path: str) -> None:
        if path not in self.dirs:
            self.dirs[path] = self.new_id("d")
            self._changed(path)

    def rmdir(self, path: str) -> None:
        self.dirs.pop(path, None)
        self._changed(path)

    def rename(self, src: str, dst: str) -> None:
        """Move a file or a folder (with everything under it), in the cloud and in every VM's cache."""
        def moved(path: str) -> str | None:
            if path == src:
                return dst
            return dst + path[len(src):] if path.startswith(src + "/") else None

        for table in [self.files, self.dirs] + [vm.dirty for vm in self.vms]:
            for path in [p for p in table if moved(p) is not None]:
                table[moved(path)] = table.pop(path)
        for vm in self.vms:
            vm.big = collections.deque((moved(p) or p, b) for p, b in vm.big)
            vm.small = [(t, moved(p) or p, b) for t, p, b in vm.small]
        self._changed(src)
        self._changed(dst)

    def delete_item(self, path: str) -> None:
        """Drive's API `files.delete`: the item and everything under it, for good (no Trash)."""
        for table in (self.files, self.dirs):
            for p in [p for p in table if p == path or p.startswith(path + "/")]:
                del table[p]
        self._changed(path)

    def used_bytes(self, vm: Vm | None) -> int:
        pending = sum(len(b.data) for b in vm.dirty.values()) if vm is not None else 0
        return sum(len(f.data) for f in self.files.values()) + self.trash_bytes + pending

    # -- ground truth -------------------------------------------------------------------------------
    def complete(self, folder: str) -> bool:
        """Is the checkpoint `folder` whole in the cloud: a manifest that parses, every file it lists with
        its sha256?"""
        manifest = self.files.get(folder + "/" + MANIFEST)
        if manifest is None:
            return False
        try:
            listed = json.loads(manifest.data)["files"]
        except (ValueError, KeyError, TypeError):
            return False
        for name, entry in listed.items():
            there = self.files.get(f"{folder}/{name}")
            if there is None or hashlib.sha256(there.data).hexdigest() != entry.get("sha256"):
                return False
        return True


def _is_data(path: str) -> bool:
    """A checkpoint's data file (the long FIFO lane); everything else is small."""
    return "/checkpoints/checkpoint-" in path and not path.endswith("/" + MANIFEST)
