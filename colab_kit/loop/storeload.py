"""Restoring the checkpoint rank 0 chose into every rank's model, optimizer and the rest.

Every step here either reaches the collectives of torch.distributed.checkpoint on every rank or fails
before any: the files are read, then the tensors are put in place, with one agreement (`agreed`) after
each step, so that a rank that fails (a file it cannot read, a state that does not fit) stops every
rank within seconds instead of leaving the others inside a collective.

    checkpoint          model               how
    shards/ (DCP)       sharded (FSDP2)     each rank reads its shards, resharded to this run (collective)
    shards/ (DCP)       plain (1 process,   each rank reads every shard on its own
                        or DDP's replicas)
    model.safetensors   sharded             each rank reads the whole tensors and keeps its shard (collective)
    model.safetensors   plain               safetensors and torch.load, as for one process
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..distributed import sharded
from ..errors import CheckpointError
from . import statefiles

__all__ = ["restore_into"]

log = logging.getLogger(__name__)
_RESTORE = "checkpoint restore"


def restore_into(agreed, path: Path, step: int, has_shards: bool, rank: int, *, model=None, optimizer=None,
                 scheduler=None, scaler=None, map_location="cpu") -> dict:
    """Load checkpoint-`step` at `path` into the given objects on every rank; returns its `extra`.

    `agreed(part, where, step)` runs `part` on this rank and lets every rank learn whether any failed;
    `has_shards` is rank 0's answer (every rank takes the same path)."""
    import torch

    rest = {"scheduler": scheduler, "scaler": scaler}
    if has_shards:
        folder = path / sharded.SHARDS
        state = agreed(lambda: _templates(step, folder, model, optimizer), _RESTORE, step)
        agreed(lambda: sharded.read(folder, model, state), _RESTORE, step)
        agreed(lambda: sharded.apply(model, optimizer, state), _RESTORE, step)
    elif model is not None and sharded.is_sharded(model):
        whole, optim = agreed(lambda: statefiles.read_whole(path, step, optimizer is not None, map_location),
                              _RESTORE, step)
        agreed(lambda: sharded.load_whole_model(model, whole), _RESTORE, step)
        if optim is not None:
            named = agreed(lambda: sharded.named_optimizer_state(model, optimizer, optim), _RESTORE, step)
            agreed(lambda: sharded.load_whole_optimizer(model, optimizer, named), _RESTORE, step)
    else:
        rest.update(model=model, optimizer=optimizer)

    def the_rest() -> dict:
        statefiles.load_state_files(path, step, map_location=map_location, **rest)
        extra = torch.load(path / statefiles.EXTRA_FILE, map_location=map_location, weights_only=True)
        if not statefiles.load_rng(path, rank):
            log.info("checkpoint-%d holds no RNG state for rank %d (saved by fewer processes): it keeps its own",
                     step, rank)
        return extra

    return agreed(the_rest, _RESTORE, step)


def _templates(step: int, folder: Path, model, optimizer) -> dict:
    """The state DCP fills in place: this run's tensors, in this run's shards."""
    if model is None:
        raise CheckpointError(f"checkpoint-{step} holds a sharded model ({folder.name}/): pass model= (and "
                              f"optimizer=) to restore_latest, which loads them together")
    if optimizer is not None and not sharded.has_optimizer(folder):
        raise CheckpointError(f"checkpoint-{step} has no optimizer state in {folder.name}/; it was saved "
                              f"without optimizer=")
    return sharded.state(model, optimizer)
