"""Will it fit? in seconds: the memory plan's time and peaks next to the full-depth trace's, side by side.

    python bench/plan_speed.py [--shapes bert,distilgpt2,...] [--no-full] [--before]

For each shape the same `ck.plan_memory` is made twice in this process: as it is made by default (a model of
repeated blocks traced as copies with 2 and 3 of them, its full depth derived: `colab_kit/memory/depth.py`) and
with `full_depth=True` (every block traced). Printed: each one's time, their ratio, and the largest difference
between the two plans' peaks over every row (each configuration and micro-batch). `--before` also times the plan
as it was made before issue 47: full depth, with the memory tracker's walk over every module after every
operation (`steptrace._peak_only` not applied), which made a full trace grow with the square of the depth. Models are
built from their published configs on the `meta` device (no memory, no download); the LoRA adapters are peft's,
r16 on every linear layer; "QLoRA" plans them as bitsandbytes loads them in 4 bits (`four_bit=True`).
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import sys
import time
import warnings
from contextlib import redirect_stdout
from datetime import date
from pathlib import Path

import figures

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Published config.json values (the fields that size memory).
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)
QWEN25_15B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)
LLAMA31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False, rope_theta=500000.0)


def bert_base():
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(num_labels=2)), dict(rows=32, seq=512, labels="row")


def distilgpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=6)), dict(rows=32, seq=128)  # the GPT-2 notebook's full preset


def causal(config: dict, rows: int, seq: int, *, adapter: bool, dtype="float16"):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    kind, klass = (LlamaConfig, LlamaForCausalLM) if config is LLAMA31_8B else (Qwen2Config, Qwen2ForCausalLM)
    model = klass(kind(**config, dtype=getattr(torch, dtype)))
    model.to(getattr(torch, dtype))
    if adapter:
        from peft import LoraConfig, get_peft_model

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                     task_type="CAUSAL_LM"))
    return model, dict(rows=rows, seq=seq)


SHAPES = {
    "bert": ("BERT-base, full fine-tuning, 32 x 512, T4", bert_base, "T4", False, False),
    "distilgpt2": ("DistilGPT2, full fine-tuning, 32 x 128, T4", distilgpt2, "T4", False, False),
    "qwen05-lora": ("Qwen2.5-0.5B, LoRA r16 (fp16 base), 16 x 512, T4",
                    lambda: causal(QWEN25_05B, 16, 512, adapter=True), "T4", False, True),
    "qwen05-qlora": ("Qwen2.5-0.5B, QLoRA r16, 16 x 512, T4 (the LoRA notebook)",
                     lambda: causal(QWEN25_05B, 16, 512, adapter=True), "T4", True, True),
    "qwen15-lora": ("Qwen2.5-1.5B, LoRA r16 (fp16 base), 4 x 1024, T4",
                    lambda: causal(QWEN25_15B, 4, 1024, adapter=True), "T4", False, False),
    "qwen15-qlora": ("Qwen2.5-1.5B, QLoRA r16, 4 x 1024, T4 (bench/qlora_plan.py)",
                     lambda: causal(QWEN25_15B, 4, 1024, adapter=True), "T4", True, False),
    "llama8b-qlora": ("Llama-3.1-8B, QLoRA r16, 2 x 2048, L4",
                      lambda: causal(LLAMA31_8B, 2, 2048, adapter=True, dtype="bfloat16"), "L4", True, True),
}


def plan_once(key: str, full_depth: bool, before: bool = False):
    """(seconds, plan) of one plan of shape `key`, the model built afresh on the meta device (not timed)."""
    import torch

    from colab_kit.memory import steptrace
    from transformers import TrainingArguments

    import colab_kit as ck
    from colab_kit.memory.recipes import checkpointing_arg

    title, build, gpu, four_bit, checkpointing = SHAPES[key]
    with torch.device("meta"):
        model, size = build()
    ids = torch.zeros(size["rows"], size["seq"], dtype=torch.long)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "labels": torch.zeros(size["rows"], dtype=torch.long) if size.get("labels") == "row" else ids}
    precision = {"fp16": True} if next(model.parameters()).dtype == torch.float16 else (
        {"bf16": True} if next(model.parameters()).dtype == torch.bfloat16 else {})
    args = TrainingArguments("/tmp/plan_speed", per_device_train_batch_size=size["rows"], report_to=[],
                             use_cpu=True, **{checkpointing_arg(): checkpointing}, **precision)
    kept = steptrace._peak_only
    if before:
        steptrace._peak_only = lambda tracker: None  # the tracker's own bookkeeping, every module after every op
    try:
        started = time.perf_counter()
        with redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = ck.plan_memory(model, args, batch=batch, gpu=gpu, four_bit=four_bit, full_depth=full_depth)
        return time.perf_counter() - started, plan
    finally:
        steptrace._peak_only = kept


def largest_difference(fast, full) -> float:
    """The largest |peak / full-depth peak - 1| over rows of the same configuration and micro-batch."""
    key = lambda r: (r.precision, r.checkpointing, r.optimizer, r.micro_batch)  # noqa: E731
    theirs = {key(r): r.peak for r in full.rows}
    return max(abs(r.peak / theirs[key(r)] - 1) for r in fast.rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}")
    parser.add_argument("--no-full", action="store_true", help="time the plans only, without the full-depth check")
    parser.add_argument("--before", action="store_true", help="also time the plan as made before issue 47 (slow: "
                        "minutes for the 1.5 B shapes)")
    figures.add_arguments(parser, "plan_speed")
    args = parser.parse_args()
    keys = [k.strip() for k in args.shapes.split(",") if k.strip()]
    unknown = [k for k in keys if k not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}: choose among {', '.join(SHAPES)}")

    import torch

    print(f"bench/plan_speed.py, {date.today()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}")
    print(f"{'shape':<58} {'plan s':>7} {'full s':>7} {'ratio':>6} {'peaks':>9}  how"
          + (f"  {'before s':>8} {'ratio':>7}" if args.before else ""))
    timed = []  # (shape, plan s, full s or None, before s or None)
    for key in keys:
        seconds, plan = plan_once(key, full_depth=False)
        how = next((n for n in plan.notes if "configurations traced" in n), "")
        how = "derived" if "derived" in how else "full depth"
        if args.no_full:
            print(f"{SHAPES[key][0]:<58} {seconds:7.1f} {'-':>7} {'-':>6} {'-':>9}  {how}", flush=True)
            timed.append((SHAPES[key][0], seconds, None, None))
            continue
        full_seconds, full = plan_once(key, full_depth=True)
        difference = largest_difference(plan, full)
        line = (f"{SHAPES[key][0]:<58} {seconds:7.1f} {full_seconds:7.1f} {full_seconds / seconds:5.1f}x "
                f"{difference:8.4%}  {how:<10}")
        before_seconds = None
        if args.before:
            before_seconds, before = plan_once(key, full_depth=True, before=True)
            assert largest_difference(plan, before) < 1e-3, "the plan before issue 47 gave other peaks"
            line += f"  {before_seconds:8.1f} {before_seconds / seconds:6.1f}x"
        print(line, flush=True)
        timed.append((SHAPES[key][0], seconds, full_seconds, before_seconds))
    print("plan s: the plan as made by default; full s: every block traced; peaks: the largest difference between "
          "the two plans' peaks over every row" + ("; before s: full depth as before issue 47" if args.before else ""))
    draw(args, timed)


def draw(args, timed) -> None:
    """Seconds to make each plan, by default beside every block traced (and the plan before issue 47)."""
    import numpy as np

    fig, ax = figures.figure(8.0, 1.4 + 0.55 * len(timed))
    y = np.arange(len(timed))
    series = [("the plan (default)", 1, "tab:green"), ("every block traced (full_depth=True)", 2, "tab:blue"),
              ("before issue 47", 3, "tab:red")]
    series = [s for s in series if any(row[s[1]] is not None for row in timed)]
    height = 0.8 / len(series)
    for n, (label, column, color) in enumerate(series):
        values = [row[column] or 0.0 for row in timed]
        ax.barh(y + n * height, values, height, label=label, color=color)
    ax.set_yticks(y + height * (len(series) - 1) / 2, [row[0] for row in timed], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    longest = max(v for row in timed for v in row[1:] if v)
    ticks = [t for t in (1, 2, 5, 10, 20, 50, 100, 200, 500) if t <= 1.5 * longest]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("seconds to make the plan (log scale)")
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=len(series), frameon=False)
    fig.suptitle("Will it fit? Seconds to plan each shape on this machine", fontsize=10)
    figures.save(fig, args)


if __name__ == "__main__":
    main()
