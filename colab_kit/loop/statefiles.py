"""The files of a `CheckpointStore` checkpoint: what each rank writes, and how each is read back.

    checkpoint-<step>/
      model.safetensors      the model (one process, or DDP: rank 0's copy of the replicated weights)
      adapter.safetensors    instead, for a peft model: its trainable tensors only, and in its metadata the
                             fingerprint of the frozen base they were trained on (`memory/adapters.py`)
      optimizer.pt           its state_dict() (likewise)
      shards/                a sharded model (FSDP2) and its optimizer: torch.distributed.checkpoint,
                             one `__<rank>_0.distcp` per rank and `.metadata` (`distributed/sharded.py`)
      scheduler.pt, scaler.pt, extra.pt      rank 0's (the same on every rank)
      rng_state.pt           one process; with several, rng_state_<rank>.pt from each rank

Every file is fsynced before the folder is renamed into place; tensors are read back with safetensors
or `torch.load(weights_only=True)` only.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from ..errors import CheckpointError

__all__ = ["MODEL_FILE", "ADAPTER_FILE", "EXTRA_FILE", "STATE_FILES", "rng_file", "staging_name", "remove_abandoned_staging",
           "write_rank_files", "load_state_files", "read_whole", "load_rng", "save_fsynced"]

MODEL_FILE = "model.safetensors"
ADAPTER_FILE = "adapter.safetensors"
EXTRA_FILE = "extra.pt"
STATE_FILES = {"optimizer": "optimizer.pt", "scheduler": "scheduler.pt", "scaler": "scaler.pt"}


def rng_file(rank: int, world: int) -> str:
    return "rng_state.pt" if world == 1 else f"rng_state_{rank}.pt"


_STAGING = ".staging-"


def staging_name(step: int, token: str) -> str:
    """The folder a checkpoint is written in before it is renamed into place; it names the writing process."""
    return f"{_STAGING}{int(step)}-{os.getpid()}-{token}"


def remove_abandoned_staging(local_dir: Path) -> list[str]:
    """Delete the staging folders of processes that are gone (a save killed halfway: up to a checkpoint's
    size each, on a local disk that fills up); returns their names. Local scratch only, never a checkpoint."""
    import shutil

    removed = []
    try:
        entries = list(os.scandir(local_dir))
    except OSError:
        return removed
    for entry in entries:
        parts = entry.name[len(_STAGING):].split("-") if entry.name.startswith(_STAGING) else []
        if len(parts) != 3 or not parts[1].isdigit() or _alive(int(parts[1])):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists but is not ours to signal
        return True
    return True


def _rng_state() -> dict:
    import numpy as np
    import torch

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        # numpy's state holds an ndarray, which weights_only loading refuses: store plain ints.
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    random.setstate(_as_tuple(state["python"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(obj):
    return tuple(_as_tuple(x) for x in obj) if isinstance(obj, (list, tuple)) else obj


def save_fsynced(obj, path: Path) -> None:
    import torch

    with open(path, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())


def write_rank_files(folder: Path, rank: int, world: int, *, sharded: bool, model=None, optimizer=None,
                     scheduler=None, scaler=None, extra: dict | None = None) -> None:
    """Write this rank's share of a checkpoint into `folder`, fsynced (the shards are `sharded.py`'s)."""
    folder.mkdir(parents=True, exist_ok=True)
    save_fsynced(_rng_state(), folder / rng_file(rank, world))
    if rank != 0:
        return  # everything else is the same on every rank: rank 0's copy is the checkpoint's
    if model is not None and not sharded:
        name = _write_model(model, folder)
        with open(folder / name, "rb+") as fh:  # safetensors does not fsync
            os.fsync(fh.fileno())
    parts = (("scheduler", scheduler), ("scaler", scaler)) + ((("optimizer", optimizer),) if not sharded else ())
    for key, obj in parts:
        if obj is not None:
            save_fsynced(obj.state_dict(), folder / STATE_FILES[key])
    save_fsynced(dict(extra or {}), folder / EXTRA_FILE)


def _write_model(model, folder: Path) -> str:
    """The model's file: a peft model's trainable tensors with its base's fingerprint, else the whole model."""
    from safetensors.torch import save_file, save_model

    from ..memory.adapters import base_fingerprint, is_adapter_model, trainable_state

    if is_adapter_model(model):
        tensors = {name: t.contiguous() for name, t in trainable_state(model).items()}
        save_file(tensors, str(folder / ADAPTER_FILE), metadata={"base": base_fingerprint(model),
                                                                 "base_dtype": _frozen_dtype(model)})
        return ADAPTER_FILE
    save_model(model, str(folder / MODEL_FILE))
    return MODEL_FILE


def _frozen_dtype(model) -> str:
    """The dtype most of the frozen base's weights are in (its name: "bfloat16", "uint8" for 4 bits)."""
    from collections import Counter

    counts = Counter(str(p.dtype).replace("torch.", "") for p in model.parameters() if not p.requires_grad)
    return counts.most_common(1)[0][0] if counts else "none"


def _load_adapter(model, file: Path, step: int) -> None:
    """Put an adapter checkpoint's tensors into `model`'s trainable parameters: every one of them, onto the
    same frozen base (its fingerprint), or nothing at all."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    from ..errors import ResumeMismatchError
    from ..memory.adapters import base_fingerprint, trainable_state

    with safe_open(str(file), "pt") as fh:
        saved = fh.metadata() or {}
    if saved.get("base") != base_fingerprint(model):
        if saved.get("base_dtype") not in (None, _frozen_dtype(model)):
            raise ResumeMismatchError(
                f"checkpoint-{step}'s adapter was trained on the base model in {saved['base_dtype']}, and this one "
                f"is in {_frozen_dtype(model)} (another GPU picks another half precision), so it was not loaded: "
                f"load the base with dtype=torch.{saved['base_dtype']}, or save into a new folder")
        raise ResumeMismatchError(
            f"checkpoint-{step}'s adapter was trained on another base model than this one (its frozen weights "
            f"differ: another model, another quantization, or other weights), so it was not loaded. Load the "
            f"same base model the same way (MODEL_NAME, QUANTIZE), or save into a new folder")
    tensors, own = load_file(str(file)), trainable_state(model)
    if set(tensors) != set(own) or any(tensors[n].shape != own[n].shape for n in own):
        raise ResumeMismatchError(
            f"checkpoint-{step}'s adapter has other tensors than this model's ({len(tensors)} saved, {len(own)} "
            f"trainable here): build the adapter as it was (rank, target modules), or save into a new folder")
    with torch.no_grad():
        for name, value in tensors.items():
            own[name].copy_(value)


def _state_of(path: Path, step: int, key: str, map_location):
    import torch

    file = path / STATE_FILES[key]
    if not file.exists():
        raise CheckpointError(f"checkpoint-{step} has no {key} state ({file.name}); it was saved without {key}=")
    return torch.load(file, map_location=map_location, weights_only=True)


def load_state_files(path: Path, step: int, *, model=None, optimizer=None, scheduler=None, scaler=None,
                     map_location="cpu") -> None:
    """Load a checkpoint written without shards (model.safetensors, optimizer.pt) into the given objects
    (a plain model: no collective)."""
    from safetensors.torch import load_model

    if model is not None and (path / ADAPTER_FILE).is_file():
        _load_adapter(model, path / ADAPTER_FILE, step)
    elif model is not None:
        load_model(model, str(path / MODEL_FILE), strict=True)
    for key, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
        if obj is not None:
            obj.load_state_dict(_state_of(path, step, key, map_location))


def read_whole(path: Path, step: int, optimizer: bool, map_location="cpu") -> tuple[dict, dict | None]:
    """The whole tensors of a checkpoint written without shards: (model state, optimizer state or None), for a
    sharded model to take its shards of (`sharded.load_whole`)."""
    from safetensors.torch import load_file

    return (load_file(str(path / MODEL_FILE)),
            _state_of(path, step, "optimizer", map_location) if optimizer else None)


def load_rng(path: Path, rank: int) -> bool:
    """Restore this rank's RNG states from the checkpoint; False when it holds none for this rank (it was
    saved by fewer processes: this rank keeps its own)."""
    import torch

    names = [f"rng_state_{rank}.pt"] + (["rng_state.pt"] if rank == 0 else [])
    for name in names:
        if (path / name).is_file():
            _set_rng_state(torch.load(path / name, weights_only=True))
            return True
    return False
