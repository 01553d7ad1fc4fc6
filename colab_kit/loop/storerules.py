"""When a `CheckpointStore` refuses, and what its message says to do.

Each refusal is decided where every rank reaches the same answer: the launch's environment before any
collective (`refuse_launch`), or rank 0's state inside an agreed step of a save (`refuse_unusable`).
"""

from __future__ import annotations

from ..distributed import ranks
from ..errors import CheckpointError, ColabKitError, LeaseLostError

__all__ = ["refuse_launch", "refuse_unusable"]


def refuse_launch(here: ranks.Ranks) -> None:
    """Refuse a launch the store cannot serve: several machines, or ranks without a process group."""
    if here.nodes > 1:
        raise ColabKitError(
            f"CheckpointStore under {here.describe()}: each machine's ranks would write their share of a "
            f"checkpoint to that machine's disk, and the kit mirrors one folder, rank 0's, so no checkpoint "
            f"would be complete. Train on one machine, or use the HF Trainer with run.train, which gathers "
            f"every rank's RNG state and fetches per machine")
    if here.distributed and ranks.group() is None:
        raise ColabKitError(f"WORLD_SIZE={here.world_size} but torch.distributed is not initialised, so the ranks "
                            f"cannot save and restore together: call dist.init_process_group() (or create the "
                            f"model with FSDP/DDP) before creating the CheckpointStore")


def refuse_unusable(store, step: int) -> None:
    """Rank 0: refuse a save that could never reach the persistent folder (the store closed, its run finished,
    the lease lost to another runtime)."""
    if store._closed:
        raise CheckpointError("this CheckpointStore is closed; create a new one to save again")
    mirror = store._mirror
    if mirror.closed:  # the run it came from is finished: nothing would copy this checkpoint
        raise CheckpointError(f"the run this CheckpointStore belongs to is finished, so checkpoint-{int(step)} "
                              f"would never reach {store.dir}: run start_run again and take a new "
                              f"store from it (run.checkpoint_store()); it resumes from the newest checkpoint")
    if mirror.paused:  # the lease was lost: another runtime writes the folder now
        raise LeaseLostError(f"{mirror.unsynced_reason}: checkpoint-{int(step)} is not saved, and this "
                             f"runtime should train no further. Continue in the runtime that took over; or, to "
                             f"take the run back here, run the start_run cell again with takeover=True")
