"""Checkpoint folders made for tests: random files, with a manifest or without one (a killed save)."""

import json
import os
from pathlib import Path

from colab_kit.checkpoints.manifest import Manifest, hash_folder, write_manifest


def make_checkpoint(root: Path, step: int, *, manifest: bool = True, payload: bytes | None = None) -> Path:
    folder = root / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(payload or os.urandom(4096))
    (folder / "optimizer.pt").write_bytes(os.urandom(1000))
    (folder / "sub").mkdir()
    (folder / "sub" / "state.json").write_text(json.dumps({"step": step}))
    if manifest:
        write_manifest(folder, Manifest(step=step, files=hash_folder(folder)))
    return folder
