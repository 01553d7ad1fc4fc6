"""What a run folder holds, for `python -m colab_kit status` and the end of `python -m colab_kit run`:
its checkpoints (which verify, which are in the cloud, what is still uploading), its lease, its
last events, and the metrics a notebook run was for.
"""

from __future__ import annotations

import json
import re
import socket
import sys
import time
from pathlib import Path

from .._units import format_age, format_bytes
from ..checkpoints.checkpoint import CHECKPOINTS, FINAL, list_checkpoints
from ..checkpoints.journal import EVENTS, read_events
from ..checkpoints import validity
from ..drive.cloud import cloud_files
from ..drive.drivefs import DRIVEFS, UNCONFIRMED, describe_kind, folder_kind, in_cloud
from ..drive.lease import lease_staleness, read_lease
from ..hub.address import is_hub_address
from ..report.state import state_lines

__all__ = ["show_status", "headline"]


_RUN_FOLDER = re.compile(r"persistent folder: (.+?)(?: \(Google Drive\)|, a replica of .*)?$", re.M)


def headline(executed: Path) -> list[str]:
    """What the user ran the notebook for: its run's metrics.json in a few lines, the run folder
    (the first `start_run` summary in the outputs) and the newest checkpoint; [] when none is found."""
    try:
        cells = json.loads(Path(executed).read_text())["cells"]
    except (OSError, ValueError, KeyError):
        return []
    texts = ["".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
             for c in cells for o in c.get("outputs", [])]
    found = next((m.group(1).strip() for t in texts for m in [_RUN_FOLDER.search(t)] if m), None)
    if found is None:
        return []
    run_dir = Path(found)
    lines = []
    try:
        summary = json.loads((run_dir / "metrics.json").read_text())
    except (OSError, ValueError):
        summary = {}
    for name, m in (summary.get("metrics") or {}).items():  # classification: accuracy, macro-F1, MCC per test set
        if isinstance(m, dict) and "accuracy" in m:
            lines.append(f"{name}: accuracy {m['accuracy']:.3f}, macro-F1 {m.get('macro_f1', float('nan')):.3f}, "
                         f"MCC {m.get('mcc', float('nan')):.3f} ({m.get('n', '?')} sequences)")
    if "perplexity_after" in summary:
        lines.append(f"perplexity: {summary['perplexity_before']:.2f} before, {summary['perplexity_after']:.2f} after "
                     f"training (test set: {summary.get('perplexity_test', float('nan')):.2f})")
    newest = list_checkpoints(run_dir / CHECKPOINTS)
    lines.append(f"run folder: {run_dir}" + (f" ({summary['steps']} steps)" if "steps" in summary else ""))
    lines.append(f"newest checkpoint: {newest[0][1].name if newest else 'none'}; exported model: "
                 f"{run_dir / 'final' if (run_dir / 'final').is_dir() else 'none'}")
    return lines


def _cloud_state(folder: Path, manifest, kind: str) -> tuple[str, int]:
    """("in the cloud" | "uploading: ..." | ..., bytes not yet in the cloud) of a valid folder."""
    if kind == UNCONFIRMED:
        return "written, upload not confirmed", manifest.total_bytes
    if kind != DRIVEFS:  # a plain folder: valid is all there is to say
        return "", 0
    try:
        done, pending = in_cloud(folder, cloud_files(folder, manifest), kind)
    except OSError as exc:
        return f"upload state unreadable ({exc.strerror})", 0
    return ("in the cloud", 0) if done else (f"uploading: {format_bytes(pending)} not yet in the cloud", pending)


def show_status(run_dir: str, events: int, quick: bool) -> int:
    from ..lifecycle.hubstatus import replica_address, show_hub_status

    if is_hub_address(run_dir):
        return show_hub_status(run_dir, events)
    root = Path(run_dir)
    on_hub = replica_address(root)
    if on_hub is not None:  # what the Hub holds is the run; this VM's copy may be ahead of it or behind it
        print(f"{root} is this VM's replica of a run on the Hugging Face Hub: what the Hub holds, read from it:")
        return show_hub_status(on_hub, events)
    if not root.is_dir():
        print(f"no run folder at {root} (a run folder holds checkpoints/ and events.jsonl)", file=sys.stderr)
        return 2
    print(f"run folder: {root.absolute()}")
    kind = folder_kind(root)
    print(f"durability: {describe_kind(kind)}")
    try:
        lease = read_lease(root)
    except (OSError, ValueError) as exc:
        lease = False
        print(f"lease: unreadable ({getattr(exc, 'strerror', None) or exc}); whether a runtime writes this run "
              f"is unknown")
    stale = None
    if lease is None:
        print("lease: none (no runtime is writing this run)")
    elif lease is not False:
        stale = lease_staleness(lease)
        if lease.host == socket.gethostname() or stale:
            print(f"lease: host {lease.host}, pid {lease.pid}, heartbeat {format_age(time.time() - lease.heartbeat)} "
                  f"ago ({f'stale: {stale}' if stale else 'live'})")
        else:  # another VM's clock wrote its time: whether it lives shows only by watching it change
            print(f"lease: host {lease.host}, pid {lease.pid}, a heartbeat every {format_age(lease.heartbeat_s)} "
                  f"(another VM: whether it lives shows by watching its heartbeat advance, as start_run does)")
    journal = read_events(root / EVENTS)
    print(*state_lines(lease, journal, stale), sep="\n")
    checkpoints = list_checkpoints(root / CHECKPOINTS)
    if (root / FINAL).is_dir():
        checkpoints.append((None, root / FINAL))
    print(f"checkpoints ({'sizes checked' if quick else 'sha256 verified'}):" if checkpoints
          else "checkpoints: none")
    newest_valid = newest_cloud = None
    pending, unreadable = 0, []
    for step, path in checkpoints:
        verdict = validity.check(path, step=step, hashes=not quick)  # the same verdict resume and pruning reach
        fine = verdict.valid or verdict.reason == validity.SIZES_MATCH
        cloud, detail = "", f"{'':>10}  {'':<16}"
        if verdict.manifest is not None:
            manifest = verdict.manifest
            detail = f"{format_bytes(manifest.total_bytes):>10}  saved {format_age(time.time() - manifest.created)} ago"
            if fine:
                cloud, waiting = _cloud_state(path, manifest, kind)
                pending += waiting
                if step is not None and newest_cloud is None and cloud == "in the cloud":
                    newest_cloud = (step, manifest.created)
        if fine:
            said = "valid"
            if newest_valid is None and step is not None:
                newest_valid = step
        elif verdict.unknown:
            said = f"UNREADABLE now: {verdict.reason}"
            unreadable.append(path.name)
        else:
            said = f"INVALID: {verdict.reason}"
        print(f"  {path.name:<20} {detail}  {said}" + (f", {cloud}" if cloud else ""))
    if unreadable:
        print(f"could not be read now: {', '.join(unreadable)} (not counted; run this again)")
    if checkpoints:
        print(f"resume would use: checkpoint-{newest_valid}" if newest_valid is not None
              else "resume would start fresh: no checkpoint verifies")
    if kind == DRIVEFS:
        print(f"newest in the cloud: checkpoint-{newest_cloud[0]}, saved {format_age(time.time() - newest_cloud[1])} ago"
              if newest_cloud else "newest in the cloud: none")
        rates = [e["rate_bps"] for e in journal if e["event"] == "cloud" and e.get("rate_bps")]
        if pending:
            eta = f", ~{format_age(pending / rates[-1])} at the last measured {format_bytes(rates[-1])}/s" if rates else ""
            print(f"pending upload: {format_bytes(pending)}{eta}")
    if journal:
        print(f"last {min(events, len(journal))} of {len(journal)} events:")
        for event in journal[-events:]:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(event.get("time", 0)))
            fields = " ".join(f"{k}={v}" for k, v in event.items() if k not in ("event", "time"))
            print(f"  {when}  {event['event']:<8} {fields[:160]}")
    return 0
