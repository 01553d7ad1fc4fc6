"""The stores the conformance suite runs on (issue 46): every kind of persistent home a run can have.

Each `Store` starts runs the way a notebook names that store, and reads what the store itself holds (the
cloud side: the emulator's cloud folder, the emulated Hub's head commit), never the VM's copy. A new store
kind (a bucket, Kaggle's datasets) joins the contract by getting a `Store` here and passing tests/stores.

    plain        a local folder (safe once written: no cloud behind it)
    drivefs      the DriveFS emulator (FUSE) with Drive's upload attributes
    drivefs-bare the DriveFS emulator without them (what a recycled runtime or an old DriveFS shows)
    drive-api    the DriveFS emulator without attributes, uploads confirmed through the Drive API emulator
    hub          the emulated Hugging Face Hub, spoken to by the real huggingface_hub client
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

import colab_kit as ck
from colab_kit.checkpoints.checkpoint import ARCHIVE, CHECKPOINTS, FINAL, list_checkpoints
from colab_kit.checkpoints.journal import EVENTS, parse_events
from colab_kit.checkpoints.leasefile import LEASE, parse_lease
from colab_kit.checkpoints.validity import verify_folder

KINDS = ["plain", "drivefs", "drivefs-bare", "drive-api", "hub"]


@dataclass
class Store:
    """One store under test: how a run is started on it, and what it holds."""

    kind: str
    vm_root: Path  # each VM's local disk is a folder below it
    start_kwargs: dict  # what start_run is given to use this store
    cloud: Path | None = None  # the folder store's cloud side (the folder itself for a plain folder)
    hub: object = None  # the emulated Hub
    drive: object = None  # the DriveFS emulator (EmulatedDrive)
    vms: int = field(default=0)

    @property
    def proof(self) -> bool | None:
        """What `finish` can say of the cloud here: True where the store proves uploads (attributes, the API,
        the Hub's listing), None on a plain folder (no cloud), False on Drive without attributes (written,
        never claimed: the kit has no proof to give)."""
        return {"plain": None, "drivefs-bare": False}.get(self.kind, True)

    # -- runs ----------------------------------------------------------------------------------------------
    def new_vm(self) -> Path:
        """A fresh VM's local disk: nothing of an earlier VM is on it."""
        self.vms += 1
        if self.drive is not None and self.vms > 1:
            self.drive.new_vm()  # the mount's cache is the VM's disk too: a new VM's starts as the cloud
        return self.vm_root / f"vm{self.vms}"

    def start(self, name: str, vm: Path, **kwargs):
        kwargs = {"save_every": 5, "keep": 2, "gauges": False, "quiet": True} | self.start_kwargs | kwargs
        return ck.start_run(name, local_dir=vm / name, **kwargs)

    def address(self, name: str) -> str:
        """What `python -m colab_kit status` is given for the run."""
        return f"hf://user/runs/{name}" if self.kind == "hub" else str(self.cloud_or_mount / name)

    @property
    def cloud_or_mount(self) -> Path:
        return self.start_kwargs["drive"]

    # -- what the store holds ------------------------------------------------------------------------------
    def files(self, name: str) -> dict[str, bytes]:
        """Every file of run `name` in the store: its path below the run's folder -> its bytes."""
        if self.kind == "hub":
            from hub_checks import head_files

            prefix = f"{name}/"
            return {path[len(prefix):]: entry.content for path, entry in head_files(self.hub).items()
                    if path.startswith(prefix)}
        if self.proof is False:
            # No proof of uploads: `finish` says so and returns at once; the store holds the run once the
            # runtime stays connected a while (checked where the store can prove it: finish waits there).
            self.drive.wait_uploaded(f"colab_kit/{name}")
        root = self.cloud / name
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    def checkpoints(self, name: str) -> set[int]:
        """The steps of the checkpoints the store holds whole (every file its manifest names, by sha256)."""
        if self.kind == "hub":
            from hub_checks import hub_checkpoints

            return hub_checkpoints(self.hub, name)
        return {step for step, folder in list_checkpoints(self.cloud / name / CHECKPOINTS)
                if verify_folder(folder) is None}

    def final(self, name: str) -> dict[str, bytes]:
        return _below(self.files(name), FINAL)

    def archived_finals(self, name: str) -> list[dict[str, bytes]]:
        """Each replaced export the store keeps, oldest first (archive/final-<stamp>)."""
        files = self.files(name)
        folders = sorted({p.split("/")[1] for p in files if p.startswith(f"{ARCHIVE}/{FINAL}-")})
        return [_below(files, f"{ARCHIVE}/{folder}") for folder in folders]

    def journal(self, name: str) -> list[dict]:
        raw = self.files(name).get(EVENTS)
        return parse_events(raw) if raw is not None else []

    def lease(self, name: str):
        raw = self.files(name).get(LEASE)
        return parse_lease(raw) if raw is not None else None


def _below(files: dict[str, bytes], folder: str) -> dict[str, bytes]:
    prefix = f"{folder}/"
    return {p[len(prefix):]: data for p, data in files.items() if p.startswith(prefix)}


@pytest.fixture(params=KINDS)
def store(request, tmp_path) -> Store:
    kind = request.param
    vms = tmp_path / "vms"
    if kind == "plain":
        folder = tmp_path / "persistent"
        return Store(kind, vms, {"drive": folder}, cloud=folder)
    if kind == "hub":
        hub = request.getfixturevalue("hub_env")
        return Store(kind, vms, {"store": "hf://user/runs"}, hub=hub)
    emulated_drive = request.getfixturevalue("emulated_drive")
    drive = emulated_drive(rate=20e6, attrs=kind == "drivefs")
    kwargs = {"drive": drive.mountpoint / "colab_kit"}
    if kind == "drive-api":
        from drive_api_server import DriveApiServer

        server = DriveApiServer(drive.cloud, drive.trash).start()
        request.addfinalizer(server.stop)
        kwargs["confirm"] = ck.DriveApi(server.url, drive.mountpoint)
    return Store(kind, vms, kwargs, cloud=drive.cloud / "colab_kit", drive=drive)
