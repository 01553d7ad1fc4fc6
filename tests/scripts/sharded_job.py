"""A sharded plain PyTorch loop, FSDP2 + AdamW, saved and resumed with ck.CheckpointStore
(tests/distributed/test_sharded.py).

    sharded_job.py --drive-dir D --local-dir L [--steps 8] [--every 2] [--sync] [--die STEP:WHERE]
                   [--fail R:WHERE:STEP] [--linger S] [--dump-restored F] [--out F]

With WORLD_SIZE > 1 each rank shards an MLP (seed 0) with `fully_shard`; with one process the MLP stays a
plain model. Each step trains on 8 generated rows (the same whatever the number of processes), each rank
on its share. The store restores the newest checkpoint first, then saves every --every steps (shards in
the background unless --sync). It prints "RESUMED <step>" and, for an error, "ERROR <type>: <message>".

--die STEP:WHERE ends every rank at once (os._exit, like a lost runtime) at STEP: "step" after the
optimizer step, "save" right after `save` returned (the shards still being written), "mirror" once the
checkpoint is queued for upload. --fail R:WHERE:STEP makes rank R raise a ValueError in the save of
STEP: "files" while writing its own files, "state" while taking the state DCP saves, "start" while starting
the background save, "shards" inside DCP's write; "restore" (STEP 0) while DCP reads the shards back;
--keep-going trains on after a failed save, as a user runs the cell again; --short-of-ram R makes rank R
see 40 kB of available host RAM. --linger S keeps that rank
alive S seconds after its error, as a notebook kernel stays. --no-shard keeps the model plain on every rank (DDP's replicas).
--dump-restored writes the restored model and optimizer (whole tensors) and exits; --out writes them at
the end. --open-run NAME opens the run with
`ck.start_run(NAME, drive=D, local_dir=L)` on every rank and takes the store from `run.checkpoint_store()`;
--step-sleep S makes each step last S seconds longer (uploads fall behind); --look-spacing S spaces the
kit's looks at a missing file S seconds apart (as tiny_job.py does on the emulator).

--trainer-layout DIR trains 2 steps and writes DIR/checkpoint-2 as the HF Trainer does with FSDP2 through
accelerate (which runs FSDP only on GPUs): `pytorch_model_fsdp_0/` and `optimizer_0/` written by DCP, one
`rng_state_<rank>.pth` per rank, and rank 0's trainer_state.json and scheduler.pt.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

ROWS = 8  # rows of one optimizer step, over every rank


def make_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 4))


def rows(step: int, rank: int, world: int):
    import torch

    generator = torch.Generator().manual_seed(step)
    x = torch.randn(ROWS, 16, generator=generator)
    y = torch.randint(0, 4, (ROWS,), generator=generator)
    share = ROWS // world
    return x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]


def whole_state(model, optimizer) -> dict:
    """Every tensor of the model and the optimizer, whole, keyed by name (on rank 0; {} on the others)."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer,
                                              options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    flat = {f"model.{k}": v for k, v in model_state.items()}
    for fqn, state in optim_state.get("state", {}).items():
        for key, value in state.items():
            flat[f"optim.{fqn}.{key}"] = torch.as_tensor(value).reshape(-1) if key == "step" else value
    return {k: v.contiguous().clone() for k, v in flat.items()}


def dump(model, optimizer, path: str, rank: int) -> None:
    from safetensors.torch import save_file

    state = whole_state(model, optimizer)
    if rank == 0:
        save_file(state, path)


def inject(where: str, at_step: int, rank: int, current: dict) -> None:
    """Make this rank raise a ValueError in the checkpoint save of `at_step`."""
    message = f"injected on rank {rank} in the checkpoint save at step {at_step}"
    if where == "files":
        from colab_kit.loop import statefiles

        real = statefiles._rng_state

        def rng_state():
            if current["step"] == at_step:
                raise ValueError(message)
            return real()

        statefiles._rng_state = rng_state
    elif where == "shards":
        from torch.distributed.checkpoint.filesystem import _FileSystemWriter

        real = _FileSystemWriter.write_data

        def write_data(self, plan, planner):  # in the background for an async save: told by its folder
            if f".staging-{at_step}-" in str(self.path):
                raise ValueError(message)
            return real(self, plan, planner)

        _FileSystemWriter.write_data = write_data
    elif where == "state":  # before DCP's first collective
        from colab_kit.distributed import sharded

        real_state = sharded.state

        def state(model, optimizer):
            if current["step"] == at_step:
                raise ValueError(message)
            return real_state(model, optimizer)

        sharded.state = state
    elif where == "start":  # starting the background save, while the other rank's has begun
        import torch.distributed.checkpoint as dcp

        real_async_save = dcp.async_save

        def async_save(*a, **kw):
            if current["step"] == at_step:
                raise ValueError(message)
            return real_async_save(*a, **kw)

        dcp.async_save = async_save
    elif where == "restore":  # reading the shards back
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        def read_data(self, plan, planner):
            raise ValueError(f"injected on rank {rank} in the checkpoint restore")

        FileSystemReader.read_data = read_data
    else:
        raise SystemExit(f"--fail: unknown place {where!r}")


def trainer_layout(folder: str, model, optimizer, rank: int) -> None:
    """A checkpoint in the layout accelerate's FSDP2 save gives the Trainer (its names, its DCP calls)."""
    import json
    from pathlib import Path

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out = Path(folder) / "checkpoint-2"
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state}, checkpoint_id=str(out / "pytorch_model_fsdp_0"))
    dcp.save({"optimizer": optim_state}, checkpoint_id=str(out / "optimizer_0"))
    torch.save({"python": 0, "torch": torch.get_rng_state()}, out / f"rng_state_{rank}.pth")
    if rank == 0:
        torch.save({"last_epoch": 2}, out / "scheduler.pt")
        (out / "trainer_state.json").write_text(json.dumps({"global_step": 2, "max_steps": 8}))


def train(args, rank: int, world: int):
    import torch
    import torch.nn.functional as F

    import colab_kit as ck

    model = make_model()
    if world > 1 and not args.no_shard:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    current = {"step": 0}
    if args.short_of_ram == rank:  # this rank's host RAM says 40 kB are available
        import psutil

        real_memory = psutil.virtual_memory
        psutil.virtual_memory = lambda: real_memory()._replace(available=40_000)
    if args.trainer_layout:
        for step in (1, 2):
            x, y = rows(step, rank, world)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        trainer_layout(args.trainer_layout, model, optimizer, rank)
        return
    if args.fail is not None and args.fail[0] == rank:
        inject(args.fail[1], args.fail[2], rank, current)
    run = None
    if args.open_run:  # the notebook's way: every rank opens the run, and takes the store from it
        run = ck.start_run(args.open_run, drive=args.drive_dir, local_dir=args.local_dir, keep=2, save_every=None,
                           quiet=True, gauges=False)
        store = run.checkpoint_store(async_save=not args.sync)
    else:
        store = ck.CheckpointStore(args.drive_dir, keep=2, local_dir=args.local_dir, async_save=not args.sync)
    start = store.restore_latest(model=model, optimizer=optimizer) or 0
    print(f"RESUMED {start} extra={store.extra}", flush=True)
    if args.dump_restored:
        dump(model, optimizer, args.dump_restored, rank)
        store.close()
        return
    for step in range(start + 1, args.steps + 1):
        current["step"] = step
        x, y = rows(step, rank, world)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        time.sleep(args.step_sleep)
        if args.die == (step, "step"):
            os._exit(9)
        if step % args.every == 0:
            try:
                store.save(step, model=model, optimizer=optimizer, seen=step)
            except Exception as exc:  # noqa: BLE001 - --keep-going: as a notebook user runs the cell again
                if not args.keep_going:
                    raise
                print(f"SAVE FAILED {type(exc).__name__}: {exc}", flush=True)
            if args.die == (step, "save"):
                os._exit(9)
            if args.die == (step, "mirror"):
                store._finish_pending()  # published and queued: the upload is under way
                os._exit(9)
    store.close()
    if run is not None:
        run.finish()
    if args.out:
        dump(model, optimizer, args.out, rank)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--drive-dir")
    parser.add_argument("--local-dir")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--sync", action="store_true")
    parser.add_argument("--die", type=lambda t: (int(t.split(":")[0]), t.split(":")[1]))
    parser.add_argument("--fail", type=lambda t: (int(t.split(":")[0]), t.split(":")[1], int(t.split(":")[2])))
    parser.add_argument("--linger", type=float, default=0.0)
    parser.add_argument("--dump-restored")
    parser.add_argument("--out")
    parser.add_argument("--trainer-layout")
    parser.add_argument("--open-run")
    parser.add_argument("--no-shard", action="store_true")
    parser.add_argument("--keep-going", action="store_true")
    parser.add_argument("--short-of-ram", type=int, default=None)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--look-spacing", type=float, default=None,
                        help="the first wait between looks (the kit's: 1 s), as in tiny_job.py")
    args = parser.parse_args()
    if args.look_spacing is not None:
        from colab_kit.checkpoints import looks, search

        step = args.look_spacing
        looks.WAITS, search.RETRY_WAITS = (step, 2 * step, 3 * step), (step, 2 * step, 4 * step, 4 * step)
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    try:
        train(args, rank, world)
    except Exception as exc:  # noqa: BLE001 - what a notebook cell would show, then the kernel lives on
        traceback.print_exc()
        print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
        if args.fail is not None and args.fail[0] == rank:
            time.sleep(args.linger)
        sys.stdout.flush()
        os._exit(1)
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    print(f"DONE rank {rank}", flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
