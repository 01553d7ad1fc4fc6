"""Several processes, one run (torchrun, `accelerate launch`, `notebook_launcher`): who does what.

Every rank-dependent decision of the kit lives here. Global rank 0 is the run's one writer: the
lease and its heartbeat, the mirror and its pruning, the journal, `gauges.html`,
`micro_batch.json` and `final/`. The other ranks follow: no lease, no uploader, no output of
their own. On every node local rank 0 fetches the checkpoint to resume from into that node's
local folder; rank 0's choice of step is broadcast and every rank checks that it can read it.

The ranks come from the environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE: torchrun,
`accelerate launch` and `notebook_launcher` set them), because `start_run` usually runs before
the Trainer has created the process group. Collectives are used only once it exists; without
it every helper here is the single-process answer, so the kit's code calls them unconditionally.
How a step ended is agreed in `agreement.py`; gradients are averaged in `gradients.py`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Ranks", "detect", "group", "place", "side_group", "drop_group", "barrier",
           "from_writer", "broadcast_object", "all_agree", "sum_over_ranks",
           "gather_rank_files", "rank_files_missing"]


@dataclass(frozen=True)
class Ranks:
    """This process's place among the processes of one launch."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    @property
    def writer(self) -> bool:
        """Global rank 0: the only process that writes to the persistent folder."""
        return self.rank == 0

    @property
    def node_leader(self) -> bool:
        """Local rank 0: fetches the checkpoint to resume from for its node."""
        return self.local_rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def nodes(self) -> int:
        """The machines of the launch (each with its own local disk)."""
        return max(1, self.world_size // max(1, self.local_world_size))

    def describe(self) -> str:
        if not self.distributed:
            return "1 process"
        nodes = self.nodes
        where = f" on {nodes} nodes" if nodes > 1 else ""
        return (f"{self.world_size} processes{where}; this is rank {self.rank}"
                + (", the one that writes to the persistent folder" if self.writer else ", a follower"))


def _int(environ, name: str, default: int) -> int:
    value = environ.get(name)
    if value in (None, ""):
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} in the environment is not a whole number; it is set by the "
                         f"launcher (torchrun, accelerate launch, notebook_launcher), so unset it or fix it") from None


def detect(environ=None) -> Ranks:
    """This process's ranks, from the launcher's environment variables (1 process when unset)."""
    environ = os.environ if environ is None else environ
    world = _int(environ, "WORLD_SIZE", 1)
    rank = _int(environ, "RANK", 0)
    local_rank = _int(environ, "LOCAL_RANK", rank if world > 1 else 0)
    local_world = _int(environ, "LOCAL_WORLD_SIZE", world)
    if world < 1 or not 0 <= rank < world or not 0 <= local_rank < max(local_world, 1):
        raise ValueError(f"inconsistent launcher environment: RANK={rank}, LOCAL_RANK={local_rank}, "
                         f"WORLD_SIZE={world}, LOCAL_WORLD_SIZE={local_world}")
    return Ranks(rank, local_rank, world, local_world)


# -- collectives (single-process answers without a process group) --------------------------------

def group():
    """`torch.distributed` when its default process group exists with more than one rank, else None."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    return dist


def _device(dist, pg=None):
    import torch

    if dist.get_backend(pg) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def place() -> tuple[int, int]:
    """(this rank, the number of processes) in the process group; (0, 1) without one."""
    dist = group()
    return (dist.get_rank(), dist.get_world_size()) if dist is not None else (0, 1)


def barrier() -> None:
    dist = group()
    if dist is not None:
        dist.barrier()


def from_writer(value: bool) -> bool:
    """Rank 0's `value` on every rank (one small broadcast): a decision only rank 0 can make."""
    dist = group()
    if dist is None:
        return value
    import torch

    flag = torch.tensor([int(bool(value))], device=_device(dist))
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def broadcast_object(obj, pg=None):
    """Rank 0's `obj` (picklable) on every rank; `pg`: a group from `side_group` instead of the default one."""
    dist = group()
    if dist is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=pg)
    return box[0]


def side_group(minutes: float):
    """A gloo process group over every rank, beside the default one (collective: every rank calls it); None
    without torch.distributed. For collectives that must not queue behind the training loop's, or that may
    wait longer than the default group's timeout (10 minutes on NCCL) while rank 0 reads or writes Drive."""
    import datetime

    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=minutes))


def sum_over_ranks(values: list[float]) -> list[float]:
    """Element-wise sums of `values` over every rank (float64); `values` itself with one process."""
    dist = group()
    if dist is None:
        return list(values)
    import torch

    summed = torch.tensor(values, dtype=torch.float64, device=_device(dist))
    dist.all_reduce(summed)
    return summed.tolist()


def drop_group(pg) -> None:
    """Let go of a group from `side_group` (None: nothing to do)."""
    dist = sys.modules.get("torch.distributed")
    if pg is not None and dist is not None and dist.is_initialized():
        dist.destroy_process_group(pg)


def all_agree(ok: bool, pg=None) -> list[int]:
    """The ranks for which `ok` is False (every rank learns them); [] when all are fine."""
    dist = group()
    if dist is None:
        return [] if ok else [0]
    import torch

    flags = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=_device(dist, pg))
    flags[dist.get_rank()] = 0 if ok else 1
    dist.all_reduce(flags, group=pg)
    return [r for r, bad in enumerate(flags.tolist()) if bad]


def gather_rank_files(folder: Path, names: list[str]) -> int:
    """Copy each rank's `names` (small files, such as its RNG state) into rank 0's `folder`, where rank 0
    cannot see them (another node's local disk). Collective; returns how many files rank 0 wrote."""
    dist = group()
    if dist is None:
        return 0
    mine = {}
    for name in names:
        path = Path(folder) / name
        if path.is_file():
            mine[name] = path.read_bytes()
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    written = 0
    if dist.get_rank() == 0:
        for files in gathered[1:]:
            for name, data in (files or {}).items():
                target = Path(folder) / name
                if not target.exists():
                    target.write_bytes(data)
                    written += 1
    return written


def rank_files_missing(folder: Path, world_size: int) -> list[str]:
    """The per-rank RNG files (`rng_state_<r>.pth`, written by the Trainer) missing from a checkpoint."""
    if world_size < 2:
        return []
    return [f"rng_state_{r}.pth" for r in range(world_size) if not (Path(folder) / f"rng_state_{r}.pth").is_file()]
