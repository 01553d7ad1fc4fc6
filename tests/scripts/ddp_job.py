"""A tiny 2-process training job for the several-processes tests (gloo on CPU).

    python -m torch.distributed.run --nproc_per_node 2 ddp_job.py --drive D --scratch L --out final.safetensors
    python ddp_job.py --launcher notebook ...        # accelerate.notebook_launcher(num_processes=2)

Every rank runs the same code, as a notebook's cells would: `start_run`, a Trainer, `run.train`,
`run.save_final`. Options make one rank misbehave:
  --stall R:STEP:S    rank R sleeps S seconds at the end of STEP (a slow rank; time-based saves)
  --oom R:N           rank R runs out of memory whenever a micro-batch holds more than N rows
  --step-sleep S      every rank sleeps S seconds per step (time for a test to kill the job)
  --slow-reads S      every file read from the persistent folder takes S seconds more
  --fetch-fails-on R  rank R cannot fetch a checkpoint from the persistent folder
  --fail R:WHERE:STEP rank R raises a ValueError at STEP in the forward pass, the backward pass or the
                      optimizer step (WHERE: forward, backward, optimizer)
  --linger S          the rank made to --fail stays alive S seconds after its error (a notebook kernel)
  --plain-ddp         the Trainer's own DDP training step (no micro-batching), for comparison
  --start-in-parent   (with --launcher notebook) start_run in the parent, run.train in the children
Rank 0 writes the final weights to --out and prints "FINAL step=N"; every rank prints
"RANK r micro=M resumed=STEP" at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def worker(args) -> None:
    import torch
    from transformers import TrainerCallback

    import colab_kit as ck
    from colab_kit.tasks.demo import tiny_trainer

    rank = int(os.environ.get("RANK", "0"))
    if args.slow_reads:  # a slow persistent folder: every file read from it takes this long
        from colab_kit.checkpoints import storage

        copy = storage.copy_file
        drive = os.path.abspath(args.drive)

        def slow_copy(src, dst, *a, **kw):
            if os.path.abspath(str(src)).startswith(drive):
                time.sleep(args.slow_reads)
            return copy(src, dst, *a, **kw)

        storage.copy_file = slow_copy

    current = {"step": 0}

    class Misbehave(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            current["step"] = state.global_step + 1

        def on_step_end(self, a, state, control, **kw):
            time.sleep(args.step_sleep)
            if args.stall and args.stall[0] == rank and state.global_step == args.stall[1]:
                time.sleep(args.stall[2])

    if args.fetch_fails_on == rank:  # this rank's machine cannot read the persistent folder
        import errno

        from colab_kit.checkpoints import search

        def unreadable(*a, **kw):
            raise OSError(errno.EIO, "injected: the persistent folder cannot be read here")

        search.fetch_checkpoint = unreadable
    run = ck.start_run(args.name, drive=args.drive, local_dir=args.scratch, save_every=args.save_every,
                       keep=args.keep, heartbeat_s=1.0)
    # --plain-ddp: the Trainer's own step, without its loss x world-size scaling for token-averaged losses
    # (average_tokens_across_devices), which a mean-per-sample classification loss does not divide back.
    plain = {"average_tokens_across_devices": False} if args.plain_ddp else {}
    trainer = tiny_trainer(run, max_steps=args.steps, batch_size=8, dropout=args.dropout, callbacks=[Misbehave()],
                           **plain)
    if args.oom and args.oom[0] == rank:
        limit = args.oom[1]

        def forward_hook(module, inputs, output):
            if module.training and output.shape[0] > limit:
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {output.shape[0]} MiB (injected)")

        trainer.model.get_input_embeddings().register_forward_hook(forward_hook)
    if args.fail and args.fail[0] == rank:
        _inject_failure(trainer.model, args.fail[1], args.fail[2], current, rank)
    try:
        output = run.train(trainer, oom_recovery=not args.plain_ddp)
    except Exception:
        if args.linger and args.fail and args.fail[0] == rank:  # as a notebook's kernel stays up after an error
            import traceback

            traceback.print_exc()
            time.sleep(args.linger)
        raise
    resumed = run.resume_manifest.step if run.resume_manifest is not None else 0  # agreed in run.train
    run.save_final(trainer.model)
    micro = run.micro_batching.train.micro_batch if run.micro_batching is not None else None
    print(f"RANK {rank} micro={micro} resumed={resumed}", flush=True)
    if rank == 0:
        from safetensors.torch import save_model

        save_model(trainer.model, args.out)
        print(f"FINAL step={output.global_step}", flush=True)
    run.finish(timeout=60)
    # As every torch.distributed script should: the ranks leave together (no rank closes its connections
    # while another still works) and destroy the process group before the interpreter exits.
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _inject_failure(model, where: str, step: int, current: dict, rank: int) -> None:
    """A ValueError on this rank at `step`: in the forward pass, the backward pass or the optimizer step."""

    def fail(*_):
        if current["step"] == step:
            raise ValueError(f"injected on rank {rank} in the {where} at step {step}")

    if where == "optimizer":
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(lambda optimizer, a, kw: fail())
        return

    def forward_hook(module, inputs, output):
        if not module.training:
            return
        if where == "forward":
            fail()
        elif where == "backward":
            output.register_hook(lambda grad: fail())

    model.get_input_embeddings().register_forward_hook(forward_hook)


def _failure(text: str) -> tuple[int, str, int]:
    r, where, step = text.split(":")
    if where not in ("forward", "backward", "optimizer"):
        raise argparse.ArgumentTypeError(f"--fail {text}: WHERE is forward, backward or optimizer")
    return int(r), where, int(step)


def _triple(text: str) -> tuple[int, int, float]:
    r, step, seconds = text.split(":")
    return int(r), int(step), float(seconds)


def _pair(text: str) -> tuple[int, int]:
    r, n = text.split(":")
    return int(r), int(n)


def free_port() -> str:
    """A port no one listens on now, for notebook_launcher's rank 0 to bind: its default (29500) is shared by
    every test that runs it, and two such tests at once (pytest-xdist) fail with EADDRINUSE. Drawn below
    Linux's ephemeral range (32768-60999): a port the kernel hands out (bind to 0) is free for any client
    socket to take before rank 0 binds it, or for rank 1's own connect to take as its source port."""
    import random
    import socket

    for _ in range(100):
        port = random.randrange(20000, 32768)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return str(port)
    raise RuntimeError("no free port in 20000-32767 after 100 tries")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--drive", required=True)
    parser.add_argument("--scratch", required=True, help="the local folder (torchrun would take --local for its own)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", default="ddp")
    parser.add_argument("--launcher", choices=["torchrun", "notebook"], default="torchrun")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save-every", default="10")
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--stall", type=_triple, default=None)
    parser.add_argument("--oom", type=_pair, default=None)
    parser.add_argument("--slow-reads", type=float, default=0.0)
    parser.add_argument("--linger", type=float, default=0.0, help="seconds a failed rank stays alive")
    parser.add_argument("--fail", type=_failure, default=None, help="R:WHERE:STEP, rank R raises a ValueError")
    parser.add_argument("--fetch-fails-on", type=int, default=None, help="this rank cannot fetch from the persistent folder")
    parser.add_argument("--plain-ddp", action="store_true",
                        help="run.train(oom_recovery=False): the Trainer's own DDP step, for comparison")
    parser.add_argument("--start-in-parent", action="store_true",
                        help="notebook form done wrong: start_run before notebook_launcher, run.train inside")
    args = parser.parse_args()
    args.save_every = int(args.save_every) if args.save_every.isdigit() else args.save_every
    if args.launcher == "notebook" and args.start_in_parent:
        from accelerate import notebook_launcher

        import colab_kit as ck

        run = ck.start_run(args.name, drive=args.drive, local_dir=args.scratch, save_every=args.save_every)

        def train_in_child():
            from colab_kit.tasks.demo import tiny_trainer

            run.train(tiny_trainer(run, max_steps=args.steps, batch_size=8))

        started = time.monotonic()
        try:
            notebook_launcher(train_in_child, num_processes=2, use_port=free_port())
        except Exception as exc:
            print(f"LAUNCH FAILED: {exc}", flush=True)
        run.finish(timeout=600)
        print(f"PARENT FINISHED in {time.monotonic() - started:.1f} s", flush=True)
    elif args.launcher == "notebook":
        from accelerate import notebook_launcher

        notebook_launcher(worker, args=(args,), num_processes=2, use_port=free_port())
    else:
        worker(args)
        # Skip the interpreter's teardown: the Trainer's DDP wrapper still holds the gloo process group,
        # and freeing it while Python finalizes can abort a rank that has finished everything with
        # "terminate called without an active exception" (exit code -6, seen now and then in CI;
        # pytorch/pytorch PR 179291 describes the mechanism). Everything is written and fsynced.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
