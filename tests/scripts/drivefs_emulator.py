"""A DriveFS emulator: a real FUSE filesystem with Google Drive's upload semantics, for tests.

    python drivefs_emulator.py MOUNTPOINT --cache DIR --cloud DIR --trash DIR
                               [--rate BYTES_PER_S] [--quota BYTES] [--no-attrs]
                               [--faults SPEC --seed N --fault-log FILE] [--stall-on-signal S]

What the mount shows is a *cache* folder (the VM's disk); what survives a runtime reset is the
*cloud* folder. The rules follow what is known of Colab's DriveFS
(`shared/research/drive-reality.md`), choosing the worst case where it is not known:

- A write returns once the bytes are in the cache. When a changed file is closed (or truncated
  by path) it joins a FIFO upload queue; one worker uploads it at `--rate` bytes/s and replaces
  the cloud copy atomically (a kill mid-upload leaves the old cloud copy, or none).
- `user.drive.uncommitted` reads b"1" while a file has changes the cloud lacks, b"0" after;
  `user.drive.id` reads b"local-<n>" until the item exists in the cloud, then its cloud id, the
  one the emulated Drive API (`drive_api_server.py`) gives it;
  `user.drive.md5` is the md5 of the cloud copy. Listing attributes shows none (as DriveFS).
  `--no-attrs` answers ENODATA for all of them (a mount where they are missing).
- unlink, rmdir and rename of an item that exists in the cloud reach the cloud at once, ahead of
  any queued upload (the worst case). An unlinked or replaced cloud file moves to the Trash
  folder with the bytes the cloud held; its bytes count against `--quota` like Drive's Trash.
- `--quota`: writes that would take the cache plus the Trash over it fail with ENOSPC, and
  statvfs reports the space left.
- At start the cache is replaced by a copy of the cloud (every file committed): each mount is a
  "new VM". Killing this process leaves the mount answering errno 107, "Transport endpoint is
  not connected", like Colab's mount when its daemon dies.

Faults, as users report them of Colab's mount (`--faults`, seeded by `--seed`, each one logged to
`--fault-log` as a JSON line): `eio=P` fails a fraction P of reads, stats, listings and attribute
reads with EIO; `vanish=P` leaves an entry out of a fraction P of listings (a file missing from a
listing for a moment); `stall=P:S` holds a fraction P of all operations for S seconds;
`enotconn=P` fails a fraction P of all operations with errno 107 mid-way. `--stall-on-signal S`:
SIGUSR2 holds every operation that starts in the next S seconds until they are over (a stalled mount).
"""

from __future__ import annotations

import argparse
import collections
import errno
import faulthandler
import hashlib
import itertools
import json
import os
import random
import shutil
import signal
import sys
import threading
import time
import uuid

import mfusepy as fuse
from drive_items import cloud_id, trash_index

ATTRS = ("user.drive.uncommitted", "user.drive.id", "user.drive.md5")
CHUNK = 256 << 10


class Faults:
    """Seeded random faults on the mount's operations, each one logged."""

    READS = {"read", "getattr", "readdir", "getxattr", "access", "open"}

    def __init__(self, spec: str, seed: int, log_path: str | None, stall_on_signal: float):
        self.rates = {"eio": 0.0, "vanish": 0.0, "stall": 0.0, "enotconn": 0.0}
        self.stall_s = 3.0
        for part in filter(None, (spec or "").split(",")):
            name, _, value = part.partition("=")
            if name == "stall" and ":" in value:
                value, seconds = value.split(":")
                self.stall_s = float(seconds)
            if name not in self.rates:
                raise SystemExit(f"unknown fault {name!r}: use eio, vanish, stall or enotconn")
            self.rates[name] = float(value)
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.log = open(log_path, "a", buffering=1) if log_path else None
        self.signal_stall_s = stall_on_signal
        self.stalled_until = 0.0
        if stall_on_signal:
            # The main thread sits in libfuse's C loop, where a Python signal handler never runs: SIGUSR2 is
            # blocked here (libfuse's threads inherit the mask) and a thread of its own waits for it.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
            threading.Thread(target=self._stall_on_signal, daemon=True).start()

    def _stall_on_signal(self) -> None:
        while True:
            signal.sigwait({signal.SIGUSR2})
            self.stalled_until = time.monotonic() + self.signal_stall_s

    def _draw(self, kind: str) -> bool:
        with self.lock:
            return self.rates[kind] > 0 and self.rng.random() < self.rates[kind]

    def _note(self, kind: str, op: str, path: str, **extra) -> None:
        if self.log is not None:
            self.log.write(json.dumps({"t": round(time.time(), 3), "fault": kind, "op": op, "path": path, **extra}) + "\n")

    def before(self, op: str, path: str) -> None:
        """Called at the start of every operation: may hold it, or fail it."""
        if time.monotonic() < self.stalled_until:
            self._note("signal_stall", op, path)
            while time.monotonic() < self.stalled_until:
                time.sleep(0.05)
        if self._draw("stall"):
            self._note("stall", op, path, seconds=self.stall_s)
            time.sleep(self.stall_s)
        if self._draw("enotconn"):
            self._note("enotconn", op, path)
            raise fuse.FuseOSError(errno.ENOTCONN)
        if op in self.READS and self._draw("eio"):
            self._note("eio", op, path)
            raise fuse.FuseOSError(errno.EIO)

    def listing(self, path: str, names: list[str]) -> list[str]:
        if names and self._draw("vanish"):
            gone = self.rng.choice(names)
            self._note("vanish", "readdir", path, entry=gone)
            return [n for n in names if n != gone]
        return names


class Node:
    """One file item: its path in the mount, its id, and what the cloud holds of it."""

    _ids = itertools.count(1)

    def __init__(self, path: str, in_cloud: bool = False, md5: str | None = None, item_id: str | None = None):
        self.path = path
        self.in_cloud = in_cloud  # an item exists in the cloud at `path`
        self.id = item_id if in_cloud else f"local-{next(self._ids)}"
        self.dirty = not in_cloud  # the cloud lacks some of the cache's content
        self.md5 = md5  # of the cloud copy
        self.version = 0
        self.queued = False
        self.uploading: int | None = None  # the version the uploader is sending now
        self.gone = False
        self.open_writers = 0


class DriveFS(fuse.Operations):
    use_ns = True

    def __init__(self, cache: str, cloud: str, trash: str, rate: float, quota: int | None, attrs: bool,
                 faults: Faults | None = None):
        self.cache, self.cloud, self.trash = cache, cloud, trash
        self.faults = faults
        self.partial = cloud.rstrip("/") + ".partial"
        self.rate, self.quota, self.attrs = rate, quota, attrs
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self.nodes: dict[str, Node] = {}
        self.dir_ids: dict[str, str] = {"/": "cloud-root"}
        self.handles: dict[int, Node] = {}
        self.queue: collections.deque[Node] = collections.deque()
        self.cache_bytes = 0
        self.trashed = 0
        self._new_vm()
        if faults is not None:
            self._with_faults()
        threading.Thread(target=self._uploader, name="uploader", daemon=True).start()

    # -- setup -----------------------------------------------------------------------------------
    def _new_vm(self) -> None:
        for folder in (self.trash, self.partial):
            os.makedirs(folder, exist_ok=True)
        shutil.rmtree(self.partial, ignore_errors=True)
        os.makedirs(self.partial)
        shutil.rmtree(self.cache, ignore_errors=True)
        shutil.copytree(self.cloud, self.cache)
        for root, dirs, files in os.walk(self.cache):
            rel = "/" + os.path.relpath(root, self.cache).replace(os.sep, "/").lstrip("./")
            rel = "/" if rel in ("/", "/.") else rel
            for name in dirs:
                self.dir_ids[_join(rel, name)] = cloud_id(self.cloud, self._cloud(_join(rel, name)))
            for name in files:
                path = _join(rel, name)
                with open(self._cache(path), "rb") as fh:
                    md5 = hashlib.file_digest(fh, "md5").hexdigest()
                self.nodes[path] = Node(path, in_cloud=True, md5=md5, item_id=cloud_id(self.cloud, self._cloud(path)))
                self.cache_bytes += os.path.getsize(self._cache(path))
        self.trashed = sum(os.path.getsize(os.path.join(self.trash, n)) for n in os.listdir(self.trash))

    def _cache(self, path: str) -> str:
        return os.path.join(self.cache, path.lstrip("/"))

    def _cloud(self, path: str) -> str:
        return os.path.join(self.cloud, path.lstrip("/"))

    # -- the cloud side (called with the lock held) ------------------------------------------------
    def _to_trash(self, cloud_path: str) -> None:
        if os.path.isdir(cloud_path):
            for root, _, files in os.walk(cloud_path, topdown=False):
                for name in files:
                    self._to_trash(os.path.join(root, name))
            shutil.rmtree(cloud_path, ignore_errors=True)
            return
        if os.path.exists(cloud_path):
            size = os.path.getsize(cloud_path)
            item = {"id": cloud_id(self.cloud, cloud_path), "parent": cloud_id(self.cloud, os.path.dirname(cloud_path)),
                    "name": os.path.basename(cloud_path), "file": f"{uuid.uuid4().hex[:12]}-{os.path.basename(cloud_path)}"}
            os.replace(cloud_path, os.path.join(self.trash, item["file"]))
            with open(trash_index(self.trash), "a") as index:  # what Drive's API says of a trashed item
                index.write(json.dumps(item) + "\n")
            self.trashed += size

    def _changed(self, node: Node) -> None:
        node.dirty = True
        node.version += 1

    def _enqueue(self, node: Node) -> None:
        # Already queued, or this very version is on its way: the uploader re-queues a newer one.
        if not node.queued and not node.gone and node.uploading != node.version:
            node.queued = True
            self.queue.append(node)
            self._wake.notify_all()

    def _uploader(self) -> None:
        while True:
            with self._lock:
                while not self.queue:
                    self._wake.wait()
                node = self.queue.popleft()
                node.queued = False
                if node.gone:
                    continue
                version, source = node.version, self._cache(node.path)
                node.uploading = version
                _debug("upload start", node.path, version)
            tmp = os.path.join(self.partial, uuid.uuid4().hex)
            digest = hashlib.md5()
            try:
                with open(source, "rb") as fin, open(tmp, "wb") as fout:
                    started, sent = time.monotonic(), 0
                    while chunk := fin.read(CHUNK):
                        fout.write(chunk)
                        digest.update(chunk)
                        sent += len(chunk)
                        ahead = sent / self.rate - (time.monotonic() - started)
                        if ahead > 0:
                            time.sleep(ahead)
            except FileNotFoundError:  # unlinked, or renamed before it could be opened: follow it
                with self._lock:
                    node.uploading = None
                    self._enqueue(node)  # (a no-op for an unlinked node)
                if os.path.exists(tmp):
                    os.unlink(tmp)
                continue
            with self._lock:
                _debug("upload end", node.path, version, node.version, node.gone)
                node.uploading = None
                if node.gone or node.version != version:  # changed under the upload: again
                    os.unlink(tmp)
                    if not node.gone:
                        self._enqueue(node)
                    continue
                target = self._cloud(node.path)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                os.replace(tmp, target)  # a new revision of the same item, not a Trash entry
                node.in_cloud, node.dirty, node.md5 = True, False, digest.hexdigest()
                if node.id.startswith("local-"):
                    node.id = cloud_id(self.cloud, target)

    # -- quota -----------------------------------------------------------------------------------
    def _grow(self, path: str, new_size: int) -> None:
        old = os.path.getsize(self._cache(path)) if os.path.exists(self._cache(path)) else 0
        if new_size > old and self.quota is not None and self.cache_bytes + self.trashed + new_size - old > self.quota:
            raise fuse.FuseOSError(errno.ENOSPC)
        self.cache_bytes += new_size - old

    # -- filesystem operations -------------------------------------------------------------------
    OPERATIONS = ("getattr", "readdir", "access", "statfs", "mkdir", "rmdir", "create", "open", "read", "write",
                  "truncate", "flush", "fsync", "release", "unlink", "rename", "chmod", "chown", "utimens",
                  "getxattr", "listxattr", "setxattr")

    def _with_faults(self) -> None:
        """Route every operation through `faults.before` (mfusepy calls the methods directly). Not `release`:
        the kernel drops its errors (close() has returned by then), so a fault there would only leave a file
        this emulator believes still open and never uploads; `flush`, whose errors close() does return, fails."""
        for op in self.OPERATIONS:
            if op == "release":
                continue
            method = getattr(self, op)

            def faulty(path, *args, _op=op, _method=method, **kwargs):
                self.faults.before(_op, path)
                return _method(path, *args, **kwargs)

            faulty.__name__ = op  # mfusepy reports errors by the method's name
            setattr(self, op, faulty)

    def getattr(self, path, fh=None):
        try:
            st = os.lstat(self._cache(path))
        except OSError as exc:
            raise fuse.FuseOSError(exc.errno) from None
        return {"st_mode": st.st_mode, "st_nlink": st.st_nlink, "st_size": st.st_size, "st_uid": st.st_uid,
                "st_gid": st.st_gid, "st_atime": st.st_atime_ns, "st_mtime": st.st_mtime_ns,
                "st_ctime": st.st_ctime_ns}

    def readdir(self, path, fh):
        names = os.listdir(self._cache(path))
        if self.faults is not None:
            names = self.faults.listing(path, names)
        return [".", "..", *names]

    def access(self, path, amode):
        if not os.path.exists(self._cache(path)):
            raise fuse.FuseOSError(errno.ENOENT)
        return 0

    def statfs(self, path):
        st = os.statvfs(self.cache)
        stats = {key: getattr(st, key) for key in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail",
                                                   "f_files", "f_ffree", "f_favail", "f_namemax")}
        if self.quota is not None:
            with self._lock:
                free = max(0, self.quota - self.cache_bytes - self.trashed)
            stats |= {"f_blocks": self.quota // st.f_frsize, "f_bfree": free // st.f_frsize,
                      "f_bavail": free // st.f_frsize}
        return stats

    def mkdir(self, path, mode):
        with self._lock:
            os.mkdir(self._cache(path), mode)
            os.makedirs(self._cloud(path), exist_ok=True)  # folders exist in the cloud at once
            self.dir_ids[path] = cloud_id(self.cloud, self._cloud(path))
        return 0

    def rmdir(self, path):
        with self._lock:
            try:
                os.rmdir(self._cache(path))
            except OSError as exc:
                raise fuse.FuseOSError(exc.errno) from None
            self._to_trash(self._cloud(path))
            self.dir_ids.pop(path, None)
        return 0

    def create(self, path, mode, fi=None):
        with self._lock:
            if self.quota is not None and self.cache_bytes + self.trashed >= self.quota:
                raise fuse.FuseOSError(errno.ENOSPC)
            fd = os.open(self._cache(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
            node = self.nodes.get(path)
            if node is None or node.gone:
                node = self.nodes[path] = Node(path)
            else:
                self._changed(node)
            node.open_writers += 1
            self.handles[fd] = (node, True)
            return fd

    def open(self, path, flags):
        with self._lock:
            fd = os.open(self._cache(path), flags)
            node = self.nodes.get(path)
            if node is not None:
                writer = bool(flags & (os.O_WRONLY | os.O_RDWR))
                self.handles[fd] = (node, writer)
                if writer:
                    node.open_writers += 1
                if flags & os.O_TRUNC:
                    self._changed(node)
            return fd

    def read(self, path, size, offset, fh):
        return os.pread(fh, size, offset)

    def write(self, path, data, offset, fh):
        with self._lock:
            node, _ = self.handles.get(fh, (None, False))
            end = offset + len(data)
            if node is not None:
                self._grow(node.path, max(end, os.fstat(fh).st_size))
                self._changed(node)
            return os.pwrite(fh, data, offset)

    def truncate(self, path, length, fh=None):
        with self._lock:
            node = self.nodes.get(path)
            self._grow(path, length)
            os.truncate(self._cache(path), length)
            if node is not None:
                self._changed(node)
                if not node.open_writers:  # a truncate by path is a change of its own
                    self._enqueue(node)
        return 0

    def flush(self, path, fh):
        return 0

    def fsync(self, path, datasync, fh):
        os.fsync(fh)  # into the VM's cache only: nothing waits for the upload
        return 0

    def release(self, path, fh):
        with self._lock:
            node, writer = self.handles.pop(fh, (None, False))
            os.close(fh)
            if node is not None and writer:  # a reader's close changes nothing
                node.open_writers -= 1
                if node.dirty and not node.open_writers:
                    self._enqueue(node)
        return 0

    def unlink(self, path):
        with self._lock:
            size = os.path.getsize(self._cache(path)) if os.path.exists(self._cache(path)) else 0
            try:
                os.unlink(self._cache(path))
            except OSError as exc:
                raise fuse.FuseOSError(exc.errno) from None
            self.cache_bytes -= size
            node = self.nodes.pop(path, None)
            if node is not None:
                node.gone = True
                if node.in_cloud:
                    self._to_trash(self._cloud(path))
        return 0

    def rename(self, old, new):
        with self._lock:
            replaced = self.nodes.get(new)
            replaced_size = os.path.getsize(self._cache(new)) if os.path.isfile(self._cache(new)) else 0
            try:
                os.rename(self._cache(old), self._cache(new))
            except OSError as exc:
                raise fuse.FuseOSError(exc.errno) from None
            if replaced is not None:
                replaced.gone = True
                self.cache_bytes -= replaced_size
                if replaced.in_cloud:
                    self._to_trash(self._cloud(new))
            moved = [p for p in self.nodes if p == old or p.startswith(old + "/")]
            for path in moved:
                node = self.nodes.pop(path)
                node.path = new + path[len(old):]
                self.nodes[node.path] = node
            for path in [p for p in self.dir_ids if p == old or p.startswith(old + "/")]:
                self.dir_ids[new + path[len(old):]] = self.dir_ids.pop(path)
            if os.path.exists(self._cloud(old)):  # renames of cloud items reach the cloud at once
                os.makedirs(os.path.dirname(self._cloud(new)), exist_ok=True)
                os.replace(self._cloud(old), self._cloud(new))
        return 0

    def symlink(self, target, source):
        raise fuse.FuseOSError(errno.EPERM)  # Drive has no symlinks

    def link(self, target, source):
        raise fuse.FuseOSError(errno.EPERM)

    def chmod(self, path, mode):
        return 0

    def chown(self, path, uid, gid):
        return 0

    def utimens(self, path, times=None):
        if times is None:
            os.utime(self._cache(path))
        else:
            os.utime(self._cache(path), ns=times)
        return 0

    def getxattr(self, path, name, position=0):
        if not self.attrs or name not in ATTRS:
            raise fuse.FuseOSError(errno.ENODATA)
        with self._lock:
            node = self.nodes.get(path)
            if node is None:
                if path not in self.dir_ids:
                    raise fuse.FuseOSError(errno.ENOENT if not os.path.exists(self._cache(path)) else errno.ENODATA)
                values = {"user.drive.uncommitted": b"0", "user.drive.id": self.dir_ids[path].encode()}
            else:
                values = {"user.drive.uncommitted": b"1" if node.dirty else b"0", "user.drive.id": node.id.encode()}
                if node.md5:
                    values["user.drive.md5"] = node.md5.encode()
        if name not in values:
            raise fuse.FuseOSError(errno.ENODATA)
        return values[name]

    def listxattr(self, path):
        return []  # DriveFS does not enumerate its attributes: ask for each by name

    def setxattr(self, path, name, value, options, position=0):
        raise fuse.FuseOSError(errno.ENOTSUP)


def _debug(*args) -> None:
    if os.environ.get("DRIVEFS_EMULATOR_DEBUG"):
        print(f"{time.monotonic():.3f}", *args, file=sys.stderr, flush=True)


def _join(folder: str, name: str) -> str:
    return f"{folder.rstrip('/')}/{name}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mountpoint")
    parser.add_argument("--cache", required=True)
    parser.add_argument("--cloud", required=True)
    parser.add_argument("--trash", required=True)
    parser.add_argument("--rate", type=float, default=4e6, help="upload bytes per second")
    parser.add_argument("--quota", type=int, default=None, help="bytes of cache + Trash before ENOSPC")
    parser.add_argument("--no-attrs", action="store_true", help="answer ENODATA for the DriveFS attributes")
    parser.add_argument("--faults", default="", help="eio=P,vanish=P,stall=P:S,enotconn=P (see the docstring)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the faults")
    parser.add_argument("--fault-log", default=None, help="append each fault injected here, as a JSON line")
    parser.add_argument("--stall-on-signal", type=float, default=0.0, help="SIGUSR2 stalls every operation for S s")
    parser.add_argument("--name", default="drive", help="the daemon's name in the mount table (fuse.<name>)")
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>`: every thread's stack, to the log
    os.makedirs(args.cloud, exist_ok=True)
    faults = (Faults(args.faults, args.seed, args.fault_log, args.stall_on_signal)
              if args.faults or args.stall_on_signal else None)
    ops = DriveFS(os.path.abspath(args.cache), os.path.abspath(args.cloud), os.path.abspath(args.trash),
                  args.rate, args.quota, not args.no_attrs, faults)
    print("mounting", args.mountpoint, flush=True)
    # fsname/subtype make the mount read "drive on ... type fuse.drive", as Colab's DriveFS mount does (another
    # --name stands in for another cloud mount: rclone, gcsfuse, ...).
    fuse.FUSE(ops, args.mountpoint, foreground=True, nothreads=False, fsname=args.name, subtype=args.name)
    sys.exit(0)


if __name__ == "__main__":
    main()
