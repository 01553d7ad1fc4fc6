"""Mount, kill and remount the DriveFS emulator (`drivefs_emulator.py`) from tests and benchmarks.

    with EmulatedDrive(tmp_path, rate=4e6) as drive:      # mounted at drive.mountpoint
        ...write through drive.mountpoint...
        drive.kill()                                       # the VM dies: the mount answers errno 107
        drive.new_vm()                                     # a fresh mount whose cache is the cloud
        drive.cloud / "run" / "checkpoints"                # what survived
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

EMULATOR = Path(__file__).with_name("drivefs_emulator.py")
REQUIRE_ENV = "COLAB_KIT_REQUIRE_FUSE"  # set by .ci/run: there a missing FUSE is a failure, not a skip


def why_no_fuse() -> str | None:
    """Why the emulator cannot run here (None when it can, as far as can be told without mounting)."""
    if not Path("/dev/fuse").exists():
        return "/dev/fuse is missing (no FUSE in this kernel or container)"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is missing: install the Debian package fuse3 (apt-get install -y fuse3)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"mfusepy cannot load libfuse: {exc}"
    return None


class EmulatedDrive:
    """One emulated Drive under `root`: cache/ (the VM's disk), cloud/, trash/ and the mount mnt/.

    Args:
        rate: upload bytes per second.
        quota: bytes of cache + Trash before writes fail with ENOSPC (None: no limit).
        attrs: False mounts without DriveFS's upload attributes.
        faults: the emulator's `--faults` ("eio=0.01,vanish=0.02,stall=0.005:3,enotconn=0.001"), seeded
            by `seed` (each mount the next seed); every fault lands in `fault_log`.
        stall_s: `stall()` holds every operation for this long (the emulator's --stall-on-signal).
        name: the daemon's name in the mount table (`fuse.drive` as Colab's; another stands in for rclone & co).
    """

    def __init__(self, root: str | os.PathLike, *, rate: float = 4e6, quota: int | None = None, attrs: bool = True,
                 faults: str = "", seed: int = 0, stall_s: float = 0.0, name: str = "drive"):
        self.root = Path(root)
        self.mountpoint = self.root / "mnt"
        self.cache, self.cloud, self.trash = self.root / "cache", self.root / "cloud", self.root / "trash"
        self.rate, self.quota, self.attrs = rate, quota, attrs
        self.faults, self.seed, self.stall_s, self.name = faults, seed, stall_s, name
        self.fault_log = self.root / "faults.jsonl"
        self.proc: subprocess.Popen | None = None
        self.mounts = 0

    def mount(self, timeout: float = 20.0) -> "EmulatedDrive":
        """Mount a new VM's view: its cache starts as a copy of the cloud."""
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(EMULATOR), str(self.mountpoint), "--cache", str(self.cache),
               "--cloud", str(self.cloud), "--trash", str(self.trash), "--rate", str(self.rate)]
        if self.quota is not None:
            cmd += ["--quota", str(self.quota)]
        if not self.attrs:
            cmd.append("--no-attrs")
        if self.name != "drive":
            cmd += ["--name", self.name]
        if self.faults:
            cmd += ["--faults", self.faults, "--seed", str(self.seed + self.mounts)]
        if self.stall_s:
            cmd += ["--stall-on-signal", str(self.stall_s)]
        if self.faults or self.stall_s:
            cmd += ["--fault-log", str(self.fault_log)]
        log = open(self.root / f"emulator-{self.mounts}.log", "wb")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.mounts += 1
        deadline = time.monotonic() + timeout
        while not os.path.ismount(self.mountpoint):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                text = (self.root / f"emulator-{self.mounts - 1}.log").read_text(errors="replace")
                raise RuntimeError(f"the DriveFS emulator did not mount at {self.mountpoint}: {text[-2000:]}")
            time.sleep(0.05)
        return self

    def kill(self) -> None:
        """SIGKILL the daemon (pending uploads die with it); the mount then answers errno 107."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None

    def unmount(self) -> None:
        self.kill()
        if os.path.ismount(self.mountpoint) or _dead_mount(self.mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], check=False,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def new_vm(self) -> "EmulatedDrive":
        """Kill this VM's daemon and mount a fresh one from the cloud."""
        self.unmount()
        return self.mount()

    def wait_uploaded(self, folder: str = "", timeout: float = 60.0) -> None:
        """Wait until every file below `folder` of the VM's cache is in the cloud, byte for byte: what keeping
        the runtime connected for a while does on a mount that reports no uploads."""
        deadline = time.monotonic() + timeout
        while (behind := self._not_uploaded(folder)) and time.monotonic() < deadline:
            time.sleep(0.05)
        if behind:
            raise TimeoutError(f"the DriveFS emulator had not uploaded {behind[:5]} after {timeout:.0f} s")

    def _not_uploaded(self, folder: str) -> list[str]:
        cache = self.cache / folder
        behind = []
        for path in sorted(cache.rglob("*")):
            rel = path.relative_to(self.cache)
            try:
                if path.is_file() and (self.cloud / rel).read_bytes() != path.read_bytes():
                    behind.append(str(rel))
            except FileNotFoundError:
                behind.append(str(rel))
        return behind

    def stall(self) -> None:
        """Hold every operation of the mount for `stall_s` seconds from now (a stalled Drive)."""
        os.kill(self.proc.pid, signal.SIGUSR2)

    def faults_seen(self) -> list[dict]:
        """Every fault the emulator injected so far, one dict each (fault, op, path, t)."""
        import json

        if not self.fault_log.exists():
            return []
        return [json.loads(line) for line in self.fault_log.read_text().splitlines() if line.strip()]

    def trash_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.trash.iterdir()) if self.trash.exists() else 0

    def __enter__(self) -> "EmulatedDrive":
        return self.mount()

    def __exit__(self, *exc) -> None:
        self.unmount()


def _dead_mount(path: Path) -> bool:
    try:
        os.stat(path)
        return False
    except OSError as exc:
        return exc.errno == 107  # ENOTCONN: the daemon died and the mount is still there
