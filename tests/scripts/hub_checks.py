"""What the emulated Hub holds, checked from the test's side: a checkpoint is whole there when its manifest and
every file it names are, each with the LFS sha256 the Hub computed from the bytes it received."""

import json

from hub_state import HubError

REPO = "user/runs"


def head_files(hub, repo: str = REPO) -> dict:
    """The files at the head of `repo`: path -> the emulated Hub's entry (content, and the LFS sha256 it computed);
    nothing while the repo does not exist."""
    try:
        return hub.state.commit_log(repo)[0].files
    except HubError:
        return {}


def verified_on_hub(files: dict, folder: str) -> bool:
    """Does the Hub hold `folder` (a checkpoint) whole: its manifest, and every file it names with its size and
    sha256, the sha256 being the LFS id the Hub computed from the bytes it received?"""
    raw = files.get(f"{folder}/MANIFEST.json")
    if raw is None:
        return False
    manifest = json.loads(raw.content)
    return all((entry := files.get(f"{folder}/{name}")) is not None and entry.sha256 == want["sha256"]
               and entry.size == want["size"] for name, want in manifest["files"].items())


def hub_checkpoints(hub, name: str, commit=None) -> set[int]:
    files = commit.files if commit is not None else head_files(hub)
    steps = {int(p.split("/")[2].split("-")[1]) for p in files if p.startswith(f"{name}/checkpoints/checkpoint-")}
    return {s for s in steps if verified_on_hub(files, f"{name}/checkpoints/checkpoint-{s}")}


def ever_verified(hub, name: str) -> set[int]:
    """The checkpoints that verified on the Hub at some commit of its history."""
    return set().union(*(hub_checkpoints(hub, name, commit) for commit in hub.state.commit_log(REPO)))


