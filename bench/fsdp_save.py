"""How long does a plain training loop stop for a checkpoint on 2 processes? Sharded (FSDP2) saves through
`ck.CheckpointStore`, written in the background (async DCP) or in the foreground (sync DCP), against the
kit's DDP path (rank 0 writes the replicated model and optimizer with safetensors and torch.save).

    python bench/fsdp_save.py [--width 1024 [2048 ...]] [--layers 8] [--saves 5] [--steps-between 6]
                              [--figure PATH | --no-figure]

Two gloo processes on the CPU (torchrun, started by this script). Each mode trains the same MLP with
AdamW and saves every --steps-between steps into its own run folder (a local folder standing in for
Drive: the mirror copies in the background in every mode). Pause = wall time inside `store.save` on
rank 0 (every rank waits for the slowest at the save's agreements), median over --saves saves; the
first save of each mode is left out (it starts the background thread and process group). Modes are
interleaved (ddp, sync, async, ddp, ...), one save each in turn.

Host RAM of an async save: the bytes of the state dict DCP's stager copies to host memory (counted on
the copy it returns), against the rank's shards of model and optimizer; and rank 0's resident memory
(psutil RSS, sampled every millisecond) at its peak while the save is in flight and after it, above its
RSS just before.

Several widths run in turn, each its own torchrun and its own table; the figure draws every width's pauses per
mode (rank 0 leaves its numbers in the run's folder for the launcher, which draws).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import figures


def build(width: int, layers: int, sharded: bool):
    import torch

    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(width, 8))
    if sharded:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        return model, model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model), model


def ranks_main(args) -> None:
    import psutil
    import torch
    import torch.distributed as dist

    import colab_kit as ck
    from colab_kit.distributed import sharded as sharding

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = Path(args.root)
    modes = {}
    for name in ("ddp", "sync", "async"):
        wrapped, model = build(args.width, args.layers, sharded=name != "ddp")
        optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
        store = ck.CheckpointStore(root / name / "drive", keep=2, local_dir=root / name / "local",
                                   async_save=name == "async")
        modes[name] = {"wrapped": wrapped, "model": model, "opt": optimizer, "store": store, "pauses": [], "step": 0}
    generator = torch.Generator().manual_seed(rank)
    process = psutil.Process()
    staged = staged_bytes()
    for mode in modes.values():  # one step first: AdamW makes its state at its first step
        train(mode, 1, args.width, generator)
    grew, held = async_ram(modes["async"], process)  # before any other staging copy the allocator could reuse
    for turn in range(args.saves + 1):
        for name, mode in modes.items():
            train(mode, args.steps_between, args.width, generator)
            dist.barrier()
            started = time.perf_counter()
            mode["store"].save(mode["step"], model=mode["model"], optimizer=mode["opt"])
            if turn > 0:
                mode["pauses"].append(time.perf_counter() - started)
    shard_bytes = sharding.state_bytes(sharding.state(modes["async"]["model"], modes["async"]["opt"]))
    for mode in modes.values():
        mode["store"].close()
    if rank == 0:
        report(args, modes, shard_bytes, grew, held, staged[0])
        keep_for_figure(root, modes)
    dist.barrier()
    dist.destroy_process_group()


def train(mode: dict, steps: int, width: int, generator) -> None:
    import torch
    import torch.nn.functional as F

    for _ in range(steps):
        x = torch.randn(16, width, generator=generator)
        y = torch.randint(0, 8, (16,), generator=generator)
        F.cross_entropy(mode["wrapped"](x), y).backward()
        mode["opt"].step()
        mode["opt"].zero_grad(set_to_none=True)
        mode["step"] += 1


def staged_bytes() -> list[int]:
    """Count the bytes of every state dict DCP's stager copies for an async save (appended to the list)."""
    from torch.distributed.checkpoint import staging

    from colab_kit.distributed import sharded as sharding

    counted: list[int] = []
    real = staging.DefaultStager._stage

    def stage(self, state_dict, **kwargs):
        staged = real(self, state_dict, **kwargs)
        counted.append(sharding.state_bytes(staged))
        return staged

    staging.DefaultStager._stage = stage
    return counted


def async_ram(mode: dict, process) -> tuple[int, int]:
    """Rank 0's peak RSS while one async save is in flight (sampled every ms), and its RSS once the save
    ended, each above its RSS just before."""
    import threading

    store = mode["store"]
    store._finish_pending()  # nothing else in flight: the baseline is the loop's own memory
    before = peak = process.memory_info().rss
    done = threading.Event()

    def sample():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, process.memory_info().rss)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    mode["step"] += 1
    store.save(mode["step"], model=mode["model"], optimizer=mode["opt"])
    store._finish_pending()
    done.set()
    sampler.join()
    return peak - before, process.memory_info().rss - before


def report(args, modes: dict, shard_bytes: int, grew: int, held: int, staged: int) -> None:
    params = sum(p.numel() for p in modes["sync"]["model"].parameters())
    print(f"MLP of {params / 1e6:.1f} M parameters (AdamW: {params * 16 / 2**20:.0f} MiB of model and optimizer "
          f"state), 2 gloo processes, {args.saves} saves per mode, {args.steps_between} steps between saves")
    print(f"{'mode':<28} {'median pause':>13} {'min':>8} {'max':>8}")
    medians = {}
    for name, label in (("ddp", "DDP (rank 0 writes all)"), ("sync", "FSDP2, sync DCP"), ("async", "FSDP2, async DCP")):
        pauses = modes[name]["pauses"]
        medians[name] = statistics.median(pauses)
        print(f"{label:<28} {medians[name] * 1e3:>10.1f} ms {min(pauses) * 1e3:>5.1f} ms {max(pauses) * 1e3:>5.1f} ms")
    print(f"pause ratio async/sync: {medians['async'] / medians['sync']:.2f}; async/ddp: "
          f"{medians['async'] / medians['ddp']:.2f}; sync/ddp: {medians['sync'] / medians['ddp']:.2f}")
    print(f"host RAM of an async save on rank 0: DCP's staged copy holds {staged / 2**20:.1f} MiB (the rank's "
          f"shards of model and optimizer: {shard_bytes / 2**20:.1f} MiB) until the write ends; RSS rose "
          f"{grew / 2**20:.1f} MiB at its peak (the allocator reuses memory the loop freed), "
          f"{held / 2**20:.1f} MiB after")


def keep_for_figure(root: Path, modes: dict) -> None:
    """Rank 0's pauses and model size, for the launcher to draw (it has the command line the figure is stamped with)."""
    params = sum(p.numel() for p in modes["sync"]["model"].parameters())
    (root / "pauses.json").write_text(json.dumps({"params": params, **{n: m["pauses"] for n, m in modes.items()}}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, nargs="+", default=[1024], help="the MLP's width; several run in turn")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--steps-between", type=int, default=6)
    parser.add_argument("--root")
    figures.add_arguments(parser, "fsdp_save")
    args = parser.parse_args()
    if "RANK" in os.environ:
        (args.width,) = args.width  # a rank runs the one width its launcher gave it
        ranks_main(args)
        return
    sizes = []  # (width, rank 0's numbers) per width run
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    with tempfile.TemporaryDirectory(prefix="fsdp-save-") as tmp:
        for width in args.width:
            root = Path(tmp) / f"width-{width}"
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", __file__,
                       "--width", str(width), "--layers", str(args.layers), "--saves", str(args.saves),
                       "--steps-between", str(args.steps_between), "--root", str(root)]
            code = subprocess.run(command, env=env).returncode
            if code:
                sys.exit(code)
            sizes.append((width, json.loads((root / "pauses.json").read_text())))
    draw(args, sizes)


def draw(args, sizes) -> None:
    """Per width, each mode's median pause as a bar and every save's pause as a dot."""
    import numpy as np

    fig, ax = figures.figure(7.5, 3.8)
    modes = (("ddp", "DDP (rank 0 writes all)", "tab:gray"), ("sync", "FSDP2, sync DCP", "tab:blue"),
             ("async", "FSDP2, async DCP", "tab:green"))
    x = np.arange(len(sizes))
    width = 0.8 / len(modes)
    for n, (name, label, color) in enumerate(modes):
        at = x + (n - 1) * width  # the three modes around each width's tick
        medians = [statistics.median(numbers[name]) * 1e3 for _, numbers in sizes]
        ax.bar(at, medians, width, label=label, color=color, alpha=0.8)
        for i, (_, numbers) in enumerate(sizes):
            pauses = [p * 1e3 for p in numbers[name]]
            ax.scatter([at[i]] * len(pauses), pauses, s=10, color="black", zorder=3)
            ax.annotate(f"{medians[i]:.0f} ms", (at[i], max(medians[i], *pauses)), ha="center", va="bottom",
                        fontsize=8, xytext=(0, 3), textcoords="offset points")  # above the bar and its dots
    ax.set_xticks(x, [f"--width {w}: {numbers['params'] / 1e6:.1f} M params,\n{numbers['params'] * 16 / 2**20:.0f} MiB "
                      "of model and AdamW state" for w, numbers in sizes], fontsize=8)
    ax.set_ylabel("training paused per save (ms)")
    ax.legend(fontsize=8, loc="upper left", frameon=False)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.08)
    ax.set_title(f"A plain loop's pause per checkpoint through CheckpointStore, 2 gloo processes:\nthe median of "
                 f"{args.saves} saves per mode (bars, in ms), each save (dots)", fontsize=10)
    figures.save(fig, args)


if __name__ == "__main__":
    main()
