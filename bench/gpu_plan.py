"""The memory plan against real steps on a GPU capped like a Colab T4. Prints JSON.

    python bench/gpu_plan.py                # needs CUDA; a few minutes
    python bench/gpu_plan.py --cpu-smoke    # the same comparison on a CPU with small models

On a GPU: caps this process at --cap-gib (15) with `torch.cuda.set_per_process_memory_fraction`; for
BERT-base (from a config) at 32 x 512 in fp32, fp16 autocast, and fp16 with gradient checkpointing,
and DistilGPT2 (from a config) at 8 x 1024 in fp32 and fp16, makes the plan (`ck.plan_memory`, traced
on fake CUDA tensors), then runs two real steps (AdamW, the second one measured) and compares the
plan's peak with `torch.cuda.max_memory_allocated` and `max_memory_reserved`. A configuration the plan
says does not fit is run too: it must run out of memory.

On a CPU (`--cpu-smoke`): the same models shrunk, traced without the GPU's rounding, against the peak
the profiler's allocation events replay to (`tests/scripts/measured_peak.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "scripts"))
GiB = 2**30


def build(kind: str, small: bool, checkpointing: bool):
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

    from colab_kit.memory.recipes import set_checkpointing

    torch.manual_seed(0)
    if kind == "bert-base":
        config = BertConfig(num_labels=2) if not small else BertConfig(
            vocab_size=2000, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512,
            num_labels=2, attention_probs_dropout_prob=0.0)
        model = BertForSequenceClassification(config)
    else:  # DistilGPT2's shape: GPT-2 with 6 layers
        config = GPT2Config(n_layer=6) if not small else GPT2Config(vocab_size=2000, n_positions=256, n_embd=128,
                                                                     n_layer=2, n_head=2, attn_pdrop=0.0)
        model = GPT2LMHeadModel(config)
    if checkpointing:
        set_checkpointing(model)
    return model


def batch(kind: str, rows: int, seq: int, vocab: int, device):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    if kind == "bert-base":
        out = {"input_ids": ids, "attention_mask": torch.ones(rows, seq, dtype=torch.long),
               "labels": torch.randint(0, 2, (rows,), generator=g)}
    else:
        out = {"input_ids": ids, "labels": ids.clone()}
    return {k: v.to(device) for k, v in out.items()}


def real_steps(model, inputs, precision: str, device) -> dict:
    """Two steps; the second measured. Returns the peaks, or out_of_memory."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    autocast = (torch.autocast(device.type, dtype=torch.float16) if precision == "fp16"
                else contextlib.nullcontext())
    scaler = torch.amp.GradScaler(enabled=precision == "fp16")
    try:
        for step in range(2):
            if step == 1:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            with autocast:
                loss = model(**inputs).loss
            scaler.scale(loss).backward()
            del loss
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved(),
                "out_of_memory": False}
    except torch.OutOfMemoryError:
        return {"out_of_memory": True}


def on_gpu(cap_gib: float) -> dict:
    import colab_kit as ck

    device = torch.device("cuda")
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GiB / total))
    rows = []
    configurations = [("bert-base", 32, 512, "fp32", False), ("bert-base", 32, 512, "fp16", False),
                      ("bert-base", 32, 512, "fp16", True), ("distilgpt2", 8, 1024, "fp32", False),
                      ("distilgpt2", 8, 1024, "fp16", False)]
    for kind, rows_, seq, precision, ckpt in configurations:
        model = build(kind, False, ckpt).to(device)
        inputs = batch(kind, rows_, seq, model.config.vocab_size, device)
        started = time.perf_counter()
        plan = ck.plan_memory(model, optimizer=torch.optim.AdamW(model.parameters(), lr=5e-5), batch=inputs,
                              gpu=int(cap_gib * GiB), margin=0.0, verbose=False)
        row = next(r for r in plan.rows if r.precision == precision and r.checkpointing == ckpt
                   and r.micro_batches == 1 and r.optimizer == "AdamW")
        seconds = time.perf_counter() - started
        predicted_allocated = row.peak - plan.gpu.context  # the context is outside PyTorch's allocator
        real = real_steps(model, inputs, precision, device)
        fits = predicted_allocated <= cap_gib * GiB  # the cap bounds PyTorch's allocator, the context aside
        entry = {"model": kind, "batch": f"{rows_}x{seq}", "precision": precision, "checkpointing": ckpt,
                 "plan_seconds": round(seconds, 1), "predicted_gib": round(predicted_allocated / GiB, 3),
                 "plan_fits": fits, **{k: (round(v / GiB, 3) if isinstance(v, int) else v) for k, v in real.items()}}
        if not real["out_of_memory"]:
            entry["vs_allocated"] = round(predicted_allocated / real["allocated"], 3)
            entry["vs_reserved"] = round(predicted_allocated / real["reserved"], 3)
        entry["agrees"] = (real["out_of_memory"] == (not fits)) and (
            real["out_of_memory"] or abs(entry["vs_allocated"] - 1) <= 0.10)
        rows.append(entry)
        del model, inputs, plan
        torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(0), "cap_gib": cap_gib, "rows": rows,
            "ok": all(r["agrees"] for r in rows)}


def on_cpu() -> dict:
    from colab_kit.memory.steptrace import FakeStep
    from measured_peak import measured_step_peak

    torch.set_num_threads(1)
    rows = []
    for kind, precision, ckpt in [("bert-base", "fp32", False), ("bert-base", "fp16", False),
                                  ("bert-base", "fp16", True), ("distilgpt2", "fp32", False)]:
        inputs = batch(kind, 8, 128, 2000, torch.device("cpu"))
        step = FakeStep(build(kind, True, False), None, round_to=1)
        trace = step.trace({k: (tuple(v.shape), v.dtype) for k, v in inputs.items()}, precision=precision,
                           checkpointing=ckpt)
        predicted = max(trace.peak, step.trace_optimizer_step().peak)

        def make(kind=kind, ckpt=ckpt):
            model = build(kind, True, ckpt)
            return model, torch.optim.AdamW(model.parameters(), lr=5e-5, foreach=True)

        measured = measured_step_peak(make, inputs, precision=precision)
        rows.append({"model": f"small {kind}", "precision": precision, "checkpointing": ckpt, "predicted": predicted,
                     "measured": measured, "error": round((predicted - measured) / measured, 4),
                     "trace_seconds": round(trace.seconds, 2)})
    return {"device": "cpu (smoke: small models, the profiler's peak)", "rows": rows,
            "ok": all(abs(r["error"]) <= 0.10 for r in rows)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--cap-gib", type=float, default=15.0)
    args = parser.parse_args()
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("no CUDA GPU here: run with --cpu-smoke", file=sys.stderr)
        return 2
    report = on_cpu() if args.cpu_smoke else on_gpu(args.cap_gib)
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
