"""`python -m colab_kit status hf://<user>/<repo>/<run>`: what a run on the Hugging Face Hub holds, read from the
Hub itself (issue 46, path 6), never from a replica on some VM's disk: the lease at the head, each checkpoint
and `final/` judged by the store's own proof (the listing shows each file with its manifest's sha256,
`hub/verify.py`), the checkpoint a new VM would resume from, and the journal's last lines as committed.

`status` on a replica (`<local_dir>.hub`, what `start_run(store=...)` works on) names the Hub address and
asks the Hub: the replica may hold what the Hub never got, or lack what another runtime committed since.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

from .._units import format_age, format_bytes
from ..checkpoints.checkpoint import CHECKPOINTS, FINAL, step_of
from ..checkpoints.journal import EVENTS, parse_events
from ..checkpoints.leasefile import LEASE, lease_staleness, parse_lease
from ..checkpoints.manifest import MANIFEST, parse_manifest
from ..hub.address import HubAddress
from ..hub.repo import HubRepo, HubUnavailable
from ..hub.verify import not_shown
from ..report.state import state_lines

__all__ = ["show_hub_status", "mark_replica", "replica_address"]

_MARK = ".store"  # beside the replica, never in it: what is in it is committed to the Hub


def mark_replica(replica: Path, address: HubAddress, folder: str) -> None:
    """Note, beside the replica, which run on the Hub it is a replica of (for `status` on the replica)."""
    from ..checkpoints import storage

    where = HubAddress(address.repo_id, address.repo_type, folder)
    storage.atomic_write_bytes(replica.parent / f"{replica.name}{_MARK}", f"{where}\n".encode())


def replica_address(folder: Path) -> str | None:
    """The `hf://` address of the run whose replica `folder` is, or None when it is no replica."""
    try:
        return (folder.parent / f"{folder.name}{_MARK}").read_text().strip() or None
    except OSError:
        return None


def show_hub_status(text: str, events: int) -> int:
    """Print what the run at `text` (an hf:// address naming the run's folder) holds; the CLI's exit code."""
    try:
        address = HubAddress.parse(text)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if not address.prefix:
        print(f"{text}: name the run too, hf://<user>/<repo>/<run> (the run's folder in the repo)", file=sys.stderr)
        return 2
    try:
        return _show(address, events)
    except HubUnavailable as exc:
        print(f"the Hub could not be read ({exc}): nothing is known of the run now; run this again", file=sys.stderr)
        return 1


def _show(address: HubAddress, events: int) -> int:
    repo = HubRepo(HubAddress(address.repo_id, address.repo_type), _token(), endpoint=os.environ.get("HF_ENDPOINT"),
                   waits=(1.0, 2.0, 4.0))
    folder = address.prefix
    head = repo.head()
    listing = repo.listing(folder, revision=head)
    if not listing:
        print(f"no run at {address}: the repo holds no folder {folder!r} at its head ({head[:12]})", file=sys.stderr)
        return 2
    print(f"run: {address} (the Hub's head: {head[:12]})")
    print("durability: the Hugging Face Hub: a checkpoint is in the cloud when the repo's listing shows each of its "
          "files with its manifest's sha256")
    lease = _print_lease(repo.read(f"{folder}/{LEASE}", revision=head))
    raw = repo.read(f"{folder}/{EVENTS}", revision=head)
    journal = parse_events(raw) if raw else []
    # As on Drive: a lease of this host's is judged by its process; another host's only by watching it advance.
    print(*state_lines(lease, journal, lease_staleness(lease) if lease else None), sep="\n")
    newest = _print_checkpoints(repo, folder, head, listing)
    print(f"resume would use: checkpoint-{newest}" if newest is not None
          else "resume would start fresh: no checkpoint is whole on the Hub")
    if journal:
        print(f"last {min(events, len(journal))} of {len(journal)} events (as committed):")
        for event in journal[-events:]:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(event.get("time", 0)))
            fields = " ".join(f"{k}={v}" for k, v in event.items() if k not in ("event", "time"))
            print(f"  {when}  {event['event']:<8} {fields[:160]}")
    return 0


def _token() -> str | None:
    from ..errors import ColabKitError
    from ..hub.token import find_token

    try:
        return find_token()[0]
    except ColabKitError:
        return None  # a public repo reads without one; a private one answers 401, said as unreadable


def _print_lease(raw: bytes | None):
    """Say the lease at the head; returns it (None: none; False: unreadable)."""
    if raw is None:
        print("lease: none (no runtime has written this run)")
        return None
    try:
        lease = parse_lease(raw)
    except ValueError as exc:
        print(f"lease: unreadable ({exc}); whether a runtime writes this run is unknown")
        return False
    if lease.released:
        print(f"lease: released by host {lease.host} when its run finished (no runtime is writing this run)")
        return lease
    if lease.host == socket.gethostname():  # this host's clock wrote its time, and its process can be asked after
        stale = lease_staleness(lease)
        print(f"lease: host {lease.host}, pid {lease.pid}, heartbeat committed {format_age(time.time() - lease.heartbeat)} "
              f"ago ({f'stale: {stale}' if stale else 'live'})")
        return lease
    # Its time was written by that VM's clock: whether it lives shows by watching the lease's commits advance.
    print(f"lease: host {lease.host}, pid {lease.pid}, a heartbeat committed every {format_age(lease.heartbeat_s)}, "
          f"the last stamped {time.strftime('%H:%M:%S', time.localtime(lease.heartbeat))} by its clock (start_run "
          f"watches it advance before it takes a run over)")
    return lease


def _print_checkpoints(repo: HubRepo, folder: str, head: str, listing: dict) -> int | None:
    """Each checkpoint and final/ with its verdict; returns the newest step whole on the Hub."""
    found: dict[str, int | None] = {}
    for path in listing:
        parts = path[len(folder) + 1:].split("/")
        if len(parts) >= 3 and parts[0] == CHECKPOINTS and step_of(parts[1]) is not None:
            found[f"{folder}/{CHECKPOINTS}/{parts[1]}"] = step_of(parts[1])
        elif len(parts) >= 2 and parts[0] == FINAL:
            found[f"{folder}/{FINAL}"] = None
    if not found:
        print("checkpoints: none")
        return None
    print("checkpoints (the listing's sha256 against each manifest):")
    newest = None
    order = sorted(found.items(), key=lambda item: -1 if item[1] is None else item[1], reverse=True)
    for where, step in order:
        raw = repo.read(f"{where}/{MANIFEST}", revision=head)
        manifest = parse_manifest(raw) if raw is not None else None
        name = where.rsplit("/", 1)[1]
        if manifest is None:
            print(f"  {name:<20} {'':>10}  NOT WHOLE: no readable manifest (an upload that never finished)")
            continue
        missing = not_shown(where, manifest, raw, listing)
        size = format_bytes(manifest.total_bytes)
        if missing:
            print(f"  {name:<20} {size:>10}  NOT WHOLE: {', '.join(missing[:3])}"
                  f"{' ...' if len(missing) > 3 else ''} not shown with the manifest's sha256")
            continue
        age = format_age(time.time() - manifest.created)
        print(f"  {name:<20} {size:>10}  saved {age} ago, in the cloud")
        if step is not None and newest is None:
            newest = step
    return newest
