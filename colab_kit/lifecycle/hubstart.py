"""`start_run(store="hf://<user>/<repo>")`: a run kept on the Hugging Face Hub (Kaggle, and everywhere without
Google Drive).

    run = ck.start_run("rna-bert", store="hf://alice/colab-runs")

The run's folder is `<repo>/<name>/` (under the address's folder, if it names one), written through a
replica on this machine's disk beside the local scratch (`<local_dir>.hub/`). Opening it: the token is
found on the main thread (`hub/token.py`), the repo is made private if it does not exist, the lease is
claimed by a commit on the head where it was read (`hub/lease.py`), the repo's .gitattributes sends every
file of the runs to LFS, and the replica is made to hold what the head holds (`HubStore.pull`). From then
on the kit's durability core runs unchanged on the replica, with the Hub behind it (`hub/store.py`).

On Kaggle (no Drive), a run with neither `drive=` nor `store=` goes to `hf://<user>/colab_kit` when a token
is found (Kaggle's secrets), and says so.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .._notices import Countdown
from .._units import format_age, format_bytes
from ..checkpoints import storage
from ..checkpoints.clock import clock
from ..errors import ColabKitError, DriveError
from ..hub.address import HubAddress, is_hub_address
from ..hub.lease import HUB_HEARTBEAT_S, HubLease
from ..hub.repo import HubRepo, HubUnavailable
from ..hub.store import HubStore
from ..hub.token import find_token
from ..drive.mount import ENV_DRIVE
from .hubstatus import mark_replica

__all__ = ["hub_address", "HubOpening", "open_hub", "replica_of", "KAGGLE_REPO"]

KAGGLE_REPO = "colab_kit"  # the repo a Kaggle run goes to when no store is named: hf://<user>/colab_kit


def hub_address(store, drive, *, kaggle: bool, say) -> HubAddress | None:
    """The Hub address of the run's store, or None for a folder (Drive or local). `drive=` and
    $COLAB_KIT_DRIVE may hold an `hf://` address too (the notebooks' DRIVE_DIR); on Kaggle with neither, the
    user's `colab_kit` repo when a token is found (`say` tells why)."""
    if store is not None and drive is not None:
        raise ValueError(f"store={store!r} and drive={drive!r}: give one of them (store= for the Hugging Face Hub)")
    named = store if store is not None else drive if drive is not None else os.environ.get(ENV_DRIVE)
    if named is not None:
        if store is not None or is_hub_address(named):
            return HubAddress.parse(str(named))
        return None
    if not kaggle:
        return None
    try:
        token, where = find_token()
    except ColabKitError:
        say("Kaggle has no Google Drive, and no Hugging Face token was found (Add-ons -> Secrets -> HF_TOKEN), so "
            "the run stays on this session's disk: it outlives the session only through Save Version")
        return None
    from huggingface_hub import HfApi

    try:
        user = HfApi(endpoint=os.environ.get("HF_ENDPOINT"), token=token).whoami()["name"]
    except Exception as exc:  # noqa: BLE001 - no network, a bad token: said, and the local folder it is
        say(f"Kaggle has no Google Drive, and the Hub could not be asked who the token ({where}) belongs to "
            f"({exc}): the run stays on this session's disk")
        return None
    address = HubAddress(repo_id=f"{user}/{KAGGLE_REPO}")
    say(f"Kaggle has no Google Drive: the run is kept on the Hugging Face Hub, in {address} (private; token from "
        f"{where}). store='hf://<user>/<repo>' names another repo")
    return address


def replica_of(name: str, local: Path) -> Path:
    """The run folder's replica on this machine's disk: beside the local scratch, never inside it (the
    Trainer's checkpoints live there)."""
    return local.parent / f"{local.name}.hub"


class HubOpening:
    """What `open_hub` made: the replica (the run's folder for the kit), the lease held, the store."""

    def __init__(self, replica: Path, lease: HubLease, store: HubStore, replaced, pulled: int):
        self.replica, self.lease, self.store, self.replaced, self.pulled = replica, lease, store, replaced, pulled


def open_hub(name: str, address: HubAddress, local: Path, *, heartbeat_s: float | None, takeover: bool,
             claim) -> HubOpening:
    """Claim the run on the Hub and fill its replica; `claim(lease)` acquires the lease (start_run's countdown).

    Raises:
        ColabKitError: no token. DriveError: the Hub cannot be reached or written. LeaseHeldError: see `claim`.
    """
    token, _ = find_token()
    repo = HubRepo(address, token, endpoint=os.environ.get("HF_ENDPOINT"))  # read now, not at the client's import
    repo.on_wait = _say_wait  # start_run's waits on a Hub that does not answer are said, not only logged
    try:
        return _open(name, address, local, repo, heartbeat_s=heartbeat_s, claim=claim)
    finally:
        repo.on_wait = None  # the uploader's own retries, later, are said by the gauges and finish


def _open(name: str, address: HubAddress, local: Path, repo: HubRepo, *, heartbeat_s: float | None,
          claim) -> HubOpening:
    replica = replica_of(name, local)
    try:
        repo.create()
    except HubUnavailable as exc:
        raise DriveError(f"cannot reach the Hugging Face Hub for {address} ({exc}). Check the network and run this "
                         f"cell again; nothing was changed") from exc
    except Exception as exc:  # noqa: BLE001 - a 401/403: a read-only token, another user's namespace
        raise DriveError(f"cannot create or open {address}: {exc}. The token needs write access "
                         f"(huggingface.co/settings/tokens), and the repo must be yours or your organisation's") from exc
    lease = HubLease(repo, address.path(name), heartbeat_s=heartbeat_s or HUB_HEARTBEAT_S)
    replaced = claim(lease)
    store = HubStore(repo, lease, replica)
    try:
        storage.make_dirs(replica / "checkpoints")
        store.ensure_lfs_rule()
        pulled = store.pull(progress=PullProgress(name))
        mark_replica(replica, address, lease.folder)
    except OSError as exc:  # HubUnavailable, a local disk that refused the replica
        lease.release()
        raise DriveError(f"cannot read the run {name!r} from {address} ({exc}): nothing was started. Run this cell "
                         f"again in a minute") from exc
    except BaseException:  # the stop button: the lease goes back
        lease.release()
        raise
    return HubOpening(replica, lease, store, replaced, pulled)


PULL_QUIET_S = 2.0  # a fill of the replica that takes longer says what it fetches


def _say_wait(text: str) -> None:
    print(f"colab_kit: {text}", file=sys.stderr, flush=True)


class PullProgress:
    """What the replica's filling says once it has taken a few seconds: bytes and files done, the rate and the time
    left (a new VM fetches the checkpoint it resumes from, and `save_final` the export it replaces: GBs in real
    runs)."""

    def __init__(self, name: str):
        self.name = name
        self.started = clock.monotonic()
        self.countdown: Countdown | None = None

    def __call__(self, done: int, total: int, files: int, all_files: int) -> None:
        spent = clock.monotonic() - self.started
        if self.countdown is None and spent < PULL_QUIET_S:
            return  # a quick fill says nothing
        self.countdown = self.countdown or Countdown()
        rate = done / spent if spent > 0 else 0.0
        left = f", ~{format_age((total - done) / rate)} left at {format_bytes(rate)}/s" if rate and done < total else ""
        self.countdown.show(f"colab_kit: fetching run {self.name!r} from the Hub: {format_bytes(done)} of "
                            f"{format_bytes(total)} ({files} of {all_files} files){left}")
