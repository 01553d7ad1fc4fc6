"""Does QLoRA of a 1.5 B model fit a T4 at batch 4 x 1024? The memory plan's answer, made on the CPU.

    python bench/qlora_plan.py [--gpu T4] [--batch 4] [--seq 1024] [--rank 16] [--figure PATH | --no-figure]

Qwen2.5-1.5B's architecture (its published config.json: hidden 1536, MLP 8960, 28 layers, 12 query and 2
key/value heads, a 151,936-token vocabulary, tied embeddings) is built on the `meta` device (no memory, no
download), a LoRA adapter of rank 16 put on every linear layer with peft, and `ck.plan_memory(...,
four_bit=True)` plans it as QLoRA loads it: every linear layer but the head in 4 bits (NF4, double
quantization, computing in fp16 on a T4), the other weights upcast to float32 by
`prepare_model_for_kbit_training`. What is measured and what is stated: the plan's rules for 4-bit layers,
adapters and the upcasts are checked against real steps on the CPU (bitsandbytes' CPU path; within 0.5 %,
tests/memory/test_plan_lora.py); a T4's allocator, CUDA context and kernels are not (no GPU here:
bench/gpu_plan.py is the GPU check of the plan for full fine-tuning). The figure draws the plan's table as stacked
bars against the GPU's memory, with the whole batch without checkpointing that the last lines say does not fit.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import figures

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QWEN25_15B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                  tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="T4")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=16)
    figures.add_arguments(parser, "qlora_plan")
    args = parser.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM, TrainingArguments

    import colab_kit as ck

    with torch.device("meta"):
        base = Qwen2ForCausalLM(Qwen2Config(**QWEN25_15B, dtype=torch.float16))
    base.to(torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear",
                                                task_type="CAUSAL_LM"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    print(f"Qwen2.5-1.5B architecture, LoRA rank {args.rank} on every linear layer: {trainable:,} trainable of "
          f"{total:,} parameters; batch {args.batch} x {args.seq} on a {args.gpu}")
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long)
    training = TrainingArguments("/tmp/qlora_plan", per_device_train_batch_size=args.batch, fp16=True, report_to=[],
                                 use_cpu=True)
    plan = ck.plan_memory(model, training, batch={"input_ids": ids, "labels": ids}, gpu=args.gpu, four_bit=True)
    for checkpointing in (False, True):
        row = plan.for_configuration("fp16", checkpointing)
        whole = next(r for r in plan.rows if r.precision == "fp16" and r.checkpointing == checkpointing
                     and r.micro_batches == 1)
        print(f"fp16, checkpointing {'on ' if checkpointing else 'off'}: the whole batch needs "
              f"{whole.peak / 2**30:.2f} GiB of {plan.budget / 2**30:.2f} GiB -> "
              + (f"fits at micro-batches of {row.micro_batch}" if row else "does not fit at any micro-batch"))
    draw(args, plan)


# The plan table's columns (colab_kit/memory/planview.py), temporaries and inputs in one as the table has them.
PARTS = (("weights", ("weights",), "#4c72b0"), ("grads", ("gradients",), "#dd8452"),
         ("optim", ("optimizer",), "#937860"), ("activ", ("activations",), "#55a868"),
         ("temp", ("temporaries", "inputs"), "#8c8c8c"), ("fixed", ("fixed",), "#c44e52"))


def shown_rows(plan) -> list:
    """The table's rows in its order (its optimizer first, fp32 before fp16, checkpointing off before on), then each
    fp16 whole batch the table leaves out because it does not fit (the last lines' 'needs ... GiB')."""
    rows = sorted(plan.best_rows(), key=lambda r: (r.optimizer != plan.rows[0].optimizer, r.precision != "fp32",
                                                   r.checkpointing))
    optimizer = plan.rows[0].optimizer
    rows += [r for r in plan.rows if r.precision == "fp16" and r.optimizer == optimizer and r.micro_batches == 1
             and r not in rows]
    return rows


def label(row, chosen) -> str:
    split = "whole" if row.micro_batches == 1 else f"{row.micro_batch} x{row.micro_batches}"
    marks = ["<- use"] if row is chosen else []
    marks += ["(now)"] if row.current else []  # as the table marks them
    marks += [] if row.fits else ["(does not fit)"]
    return f"{row.precision} ckpt {'on ' if row.checkpointing else 'off'} {split} {row.optimizer} " + " ".join(marks)


def draw(args, plan) -> None:
    """Each configuration's peak split into the table's columns, against the GPU's memory and the budget."""
    rows = shown_rows(plan)
    gib = 2**30
    fig, ax = figures.figure(8.0, 1.6 + 0.42 * len(rows))
    for y, row in enumerate(rows):
        left = 0.0
        for name, keys, colour in PARTS:
            width = sum(row.parts.get(k, 0) for k in keys) / gib
            ax.barh(y, width, left=left, color=colour, label=name if y == 0 else None)
            left += width
        ax.annotate(f" {row.peak / gib:.2f}", (left, y), va="center", fontsize=7)
    ax.axvline(plan.gpu.capacity / gib, color="black", linewidth=1.2, label=f"{plan.gpu.name}'s memory")
    ax.axvline(plan.budget / gib, color="black", linestyle="--", linewidth=1,
               label=f"budget ({plan.margin:.0%} margin)")
    ax.set_yticks(range(len(rows)), [label(r, plan.chosen) for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.1 * max(max(r.peak for r in rows), plan.gpu.capacity) / gib)
    ax.set_xlabel(f"GiB at the step's peak on a {plan.gpu.name} ({plan.gpu.capacity / gib:.1f} GiB; budget "
                  f"{plan.budget / gib:.1f} GiB)")
    ax.legend(fontsize=7, ncols=4, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.suptitle(f"QLoRA of Qwen2.5-1.5B, batch {plan.batch} x {plan.seq_len}: the memory plan's parts per "
                 f"configuration", fontsize=10)
    figures.save(fig, args)


if __name__ == "__main__":
    main()
