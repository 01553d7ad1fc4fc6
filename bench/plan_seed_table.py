"""The seeds' BERT-base memory table, answered by the memory plan. Prints a table.

    python bench/plan_seed_table.py            # about a minute on 2 CPU cores; nothing downloaded

A seed page claims BERT-base fine-tuning goes from 10,240 MB to 4,860 MB (-52 %) and from 58 to 38
minutes per epoch with fp16 autocast, gradient checkpointing and gradient accumulation, without saying
at which batch size and sequence length. This prints the plan's peak for a T4 (PyTorch's allocator:
`steptrace` with the GPU's 512-byte rounding, plus cuBLAS's workspace; the CUDA context, outside the
allocator, is left out as `nvidia-smi`-style figures usually include it and allocator figures do not)
for BERT-base (from its config) with AdamW at the usual settings, in fp32 and in fp16 autocast with
checkpointing and the batch split in two micro-batches (accumulation), and the plan's relative cost.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MB = 2**20


def main() -> int:
    import torch
    from transformers import BertConfig, BertForSequenceClassification
    from transformers.utils import logging

    from colab_kit.memory.gpus import TARGETS
    from colab_kit.memory.planrows import CUBLAS_WORKSPACE, LAUNCH_S, UTILISATION, step_parts
    from colab_kit.memory.steptrace import FakeStep

    logging.set_verbosity_error()
    torch.manual_seed(0)
    started = time.perf_counter()
    step = FakeStep(BertForSequenceClassification(BertConfig(num_labels=2)), None)
    optimizer = step.trace_optimizer_step()
    t4 = TARGETS["T4"]
    print(f"BERT-base ({sum(p.numel() for p in step.model.parameters()) / 1e6:.1f} M parameters), AdamW, on a T4; "
          f"MB = MiB, PyTorch's allocator (the CUDA context, ~{t4.context / MB:.0f} MB, not included)")
    print(f"{'batch x tokens':>15} {'fp32':>9} {'fp16+ckpt+accum':>16} {'change':>8} {'cost':>6}")
    for rows, seq in [(16, 128), (32, 128), (16, 256), (32, 256), (16, 512), (32, 512)]:
        spec = {"input_ids": ((rows, seq), torch.long), "attention_mask": ((rows, seq), torch.long),
                "labels": ((rows,), torch.long)}
        plain = step.trace(spec, precision="fp32")
        light = step.trace(spec, precision="fp16", checkpointing=True)
        fp32 = sum(step_parts(plain, step, optimizer, 0, 1.0, 1).values()) + CUBLAS_WORKSPACE
        fp16 = sum(step_parts(light, step, optimizer, 0, 0.5, 2).values()) + CUBLAS_WORKSPACE

        def seconds(trace, precision, k):
            return trace.flops / (t4.tflops[precision] * 1e12 * UTILISATION) + k * trace.ops * LAUNCH_S

        cost = seconds(light, "fp16", 2) / seconds(plain, "fp32", 1)
        print(f"{rows:>6} x {seq:<6} {fp32 / MB:>9,.0f} {fp16 / MB:>16,.0f} {(fp16 - fp32) / fp32:>8.0%} {cost:>6.2f}")
    print(f"(seed's claim: 10,240 -> 4,860 MB, -52 %; 58 -> 38 min per epoch, cost 0.66)  "
          f"[{time.perf_counter() - started:.0f} s]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
