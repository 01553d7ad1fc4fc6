"""A sharded model (FSDP2: parameters are DTensors) and its optimizer, saved and loaded with
torch.distributed.checkpoint (DCP).

Each rank writes its own shards and rank 0 writes `.metadata` once all have finished; a load reshards,
so a checkpoint written by 2 processes loads into 1 (a plain model) and back. `ShardWriter.start` can
save in the background (`dcp.async_save`): it first copies the rank's state into host memory (the
training loop pauses only for that copy, and it costs one checkpoint's worth of host RAM per process),
then writes from a thread. Never more than one save is in flight: the next one, or any restore, waits
for it. The background save runs its collectives on a gloo process group of its own, so that they never
interleave with the training loop's (and so that a run whose default group is NCCL-only can save in the
background at all).

Each function here is one step that either reaches DCP's collectives on every rank or fails before any:
building the state (`state`), saving, reading, applying. The caller agrees between steps.

DCP raises one `CheckpointException` on every rank when any rank fails inside it; `own_error` turns that
back into this rank's own exception (or None when only others failed), for `agreement.py` to tell every
rank who failed and why.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

from . import ranks
from .ranks import group

__all__ = ["SHARDS", "is_sharded", "state", "has_optimizer", "ShardWriter", "read", "apply", "load_whole_model",
           "named_optimizer_state", "load_whole_optimizer", "own_error", "state_bytes",
           "room_for_copy"]

SHARDS = "shards"  # the DCP folder inside a CheckpointStore checkpoint
_BACKGROUND_MINUTES = 60  # a background save's collectives wait this long for the other ranks' threads


@contextlib.contextmanager
def _alone(alone: bool):
    """Around a DCP call without collectives: DCP warns that it "assumes" one process (the kit chose to), and
    wraps a failure in a CheckpointException that names rank 0 whatever this process's rank: it is this
    process's own error, raised as such."""
    if not alone:
        yield
        return
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninit")
        try:
            yield
        except CheckpointException as exc:
            inner = next(iter(exc.failures.values()), None)
            inner = inner[0] if isinstance(inner, tuple) else inner
            if isinstance(inner, BaseException):
                raise inner from exc
            raise


def is_sharded(model) -> bool:
    """True when `model`'s parameters are DTensors (FSDP2's `fully_shard`, or tensor parallelism)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def state(model, optimizer) -> dict:
    """The model's and optimizer's state as DCP saves and loads it (each rank's shards; no collective)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, [optimizer] if optimizer is not None else [])
    return {"model": model_state, **({"optimizer": optim_state} if optimizer is not None else {})}


def state_bytes(state) -> int:
    """Bytes of this rank's tensors in `state` (from `state()`): what an async save copies to host RAM."""
    import torch

    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(value) for value in state)
    return 0


def room_for_copy(state) -> tuple[bool, int, int]:
    """Whether host RAM has room for an async save's copy of `state`: (at most half of what is available,
    the copy's bytes, the bytes available). Half: the training loop goes on beside the copy."""
    import psutil

    need, free = state_bytes(state), int(psutil.virtual_memory().available)
    return need <= free // 2, need, free


class ShardWriter:
    """Writes the shards of one checkpoint at a time, in the foreground or the background.

    Args:
        background: whether saves may go in the background: then the writer takes a process group of its
            own (`ranks.side_group`: gloo, beside the training loop's; collective, every rank makes one).
    """

    def __init__(self, background: bool):
        self._future = None
        self._pg = ranks.side_group(_BACKGROUND_MINUTES) if background else None

    @property
    def in_flight(self) -> bool:
        return self._future is not None

    def start(self, folder: Path, state: dict, *, background: bool) -> None:
        """Save `state` (from `state()`) into `folder` (collective: every rank calls it with the same folder).
        In the background, it returns once this rank's state is copied; `finish` waits for the write."""
        import torch.distributed.checkpoint as dcp

        if self._future is not None:
            raise RuntimeError("a sharded save is still in flight: finish() it first")
        alone = group() is None
        if not background:
            with _alone(alone):
                dcp.save(state, checkpoint_id=str(folder), no_dist=alone)
            return
        with _alone(alone and self._pg is None):
            self._future = dcp.async_save(state, checkpoint_id=str(folder), process_group=self._pg)

    def abandon(self) -> None:
        """After a start that failed on some rank (every rank calls it): forget a save this rank may have
        begun, whose thread waits for ranks that never began theirs, and take a fresh process group, so that
        the next save cannot meet that thread's collectives."""
        self._future = None
        if self._pg is not None:
            self._pg = ranks.side_group(_BACKGROUND_MINUTES)

    def close(self) -> None:
        """Let go of the process group (nothing is in flight: `finish` came first)."""
        ranks.drop_group(self._pg)
        self._pg = None

    def finish(self) -> None:
        """Wait for the save in flight, if any; raises what it raised."""
        future, self._future = self._future, None
        if future is not None:
            with _alone(group() is None and self._pg is None):
                future.result()


def has_optimizer(folder: Path) -> bool:
    """Whether the DCP checkpoint in `folder` holds an optimizer state."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return any(key.startswith("optimizer.") for key in keys)


def read(folder: Path, model, state: dict) -> None:
    """Fill `state` (from `state()`) from the DCP checkpoint in `folder`, resharded to this run's processes.
    Collective for a sharded model; a plain model (one process, or DDP's replicas) reads every shard alone."""
    import torch.distributed.checkpoint as dcp

    alone = not is_sharded(model) or group() is None
    with _alone(alone):
        dcp.load(state, checkpoint_id=str(folder), no_dist=alone)


def apply(model, optimizer, state: dict) -> None:
    """Put the `state` that `read` filled into `model` and `optimizer`."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, [optimizer] if optimizer is not None else [], model_state_dict=state["model"],
                   optim_state_dict=state.get("optimizer", {}))


def load_whole_model(model, model_state: dict) -> None:
    """Load whole tensors (a checkpoint saved without shards) into a sharded model: each rank keeps its own
    shard of each. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, model_state, options=StateDictOptions(full_state_dict=True))


def named_optimizer_state(model, optimizer, optim_state: dict) -> dict:
    """A plain `optimizer.state_dict()` (parameters numbered in the order of its groups) keyed by parameter
    names instead, as `load_whole_optimizer` takes it: this optimizer was built over the same parameters in
    the same order, which names them. No collective."""
    names = {id(p): name for name, p in model.named_parameters()}
    state, groups = {}, []
    for saved, current in zip(optim_state["param_groups"], optimizer.param_groups, strict=True):
        fqns = [names[id(p)] for p in current["params"]]
        for index, fqn in zip(saved["params"], fqns, strict=True):
            if index in optim_state["state"]:
                state[fqn] = optim_state["state"][index]
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": fqns})
    return {"state": state, "param_groups": groups}


def load_whole_optimizer(model, optimizer, named_state: dict) -> None:
    """Load an optimizer state of whole tensors (`named_optimizer_state`) into a sharded model's optimizer.
    Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, named_state, options=StateDictOptions(full_state_dict=True))


def own_error(exc: BaseException, rank: int) -> BaseException | None:
    """This rank's own exception inside DCP's `CheckpointException`, or None when only other ranks failed
    (the agreement names them); any other exception is this rank's."""
    if type(exc).__name__ != "CheckpointException":  # without importing DCP, which may be what failed
        return exc
    mine = exc.failures.get(rank)
    if mine is None:
        return None
    inner = mine[0] if isinstance(mine, tuple) else mine
    return inner if isinstance(inner, BaseException) else exc
