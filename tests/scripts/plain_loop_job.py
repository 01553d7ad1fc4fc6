"""A plain PyTorch training loop under several gloo processes (tests/distributed/test_plain_loop.py).

    plain_loop_job.py --out final.safetensors [--steps 6] [--micro 2] [--fail R:WHERE:STEP] [--linger S]
                      [--ddp-backward]

Each rank wraps the same tiny BERT (seed 0) in DistributedDataParallel and trains on its own shard of
generated rows, 4 a step: `ck.MicroBatcher(micro).step(batch, lambda b: ddp(**b).loss, model=ddp)`, then
SGD. `--ddp-backward` runs DDP's own step instead (`ddp(**batch).loss.backward()`), for comparison.
`--fail R:WHERE:STEP` makes rank R raise a ValueError at STEP in the forward or the backward pass;
`--linger S` keeps that rank alive S seconds after its error, as a notebook kernel stays.
Every rank prints "ERROR <type>: <message>" for what its step raised, and how many parameters still hold
a gradient after it ("GRADIENTS LEFT n"); rank 0 writes the weights to --out.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

ROWS = 4  # rows of one optimizer step on each rank


def shard(step: int, rank: int):
    """Rank `rank`'s rows for `step`: the same on every run."""
    import torch

    generator = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(1, 64, (ROWS, 12), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": (ids[:, 0] > 32).long()}


def train(args, rank: int):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from transformers import BertForSequenceClassification

    import colab_kit as ck
    from colab_kit.tasks.demo import tiny_bert_config

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = BertForSequenceClassification(tiny_bert_config(dropout=0.0, vocab_size=64))
    current = {"step": 0}
    if args.fail is not None and args.fail[0] == rank:
        from ddp_job import _inject_failure  # the Trainer job's injection: same hooks, same message

        _inject_failure(model, args.fail[1], args.fail[2], current, rank)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    batcher = ck.MicroBatcher(args.micro)
    for step in range(1, args.steps + 1):
        current["step"] = step
        batch = shard(step, rank)
        if args.ddp_backward:
            ddp(**batch).loss.backward()
        else:
            try:
                batcher.step(batch, lambda b: ddp(**b).loss, model=ddp, context={"step": step})
            except Exception:
                print(f"GRADIENTS LEFT {sum(p.grad is not None for p in model.parameters())}", flush=True)
                raise
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--fail", type=lambda t: (int(t.split(":")[0]), t.split(":")[1], int(t.split(":")[2])))
    parser.add_argument("--linger", type=float, default=0.0)
    parser.add_argument("--ddp-backward", action="store_true")
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", 0))
    try:
        model = train(args, rank)
    except Exception as exc:  # noqa: BLE001 - what a notebook cell would show, then the kernel lives on
        traceback.print_exc()
        print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
        if args.fail is not None and args.fail[0] == rank:
            time.sleep(args.linger)
        sys.stdout.flush()
        os._exit(1)
    if rank == 0:
        from safetensors.torch import save_model

        save_model(model, args.out)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    print(f"DONE rank {rank}", flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
