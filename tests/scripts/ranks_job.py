"""Measurements under 2 gloo processes for tests/distributed/test_agreement.py (one launch each).

    ranks_job.py perplexity --rows 13 --out result.json
        text.perplexity of a tiny GPT-2 (seed 0) on `rows` generated blocks, evaluated by both ranks.
    ranks_job.py memory --drive D --scratch L --out result.json
        the peak memory allocated during one training step (step 2, whole step: forward, backward,
        gradient averaging, optimizer) of the Trainer's own DDP step, then of the kit's step, on a BERT
        with over 50 MB of gradients, measured with PyTorch's CPU memory profiler.
Rank 0 writes the result as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

GPT2 = dict(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)


def perplexity_rows(rows: int):
    """`rows` blocks of 16 generated tokens, the last row partly unlabelled (-100)."""
    import torch

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, GPT2["vocab_size"], (rows, 16), generator=generator)
    labels = ids.clone()
    labels[-1, 9:] = -100
    return [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": l} for i, l in zip(ids, labels)]


def perplexity_trainer(out: str, rows: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, default_data_collator

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**GPT2))
    args = TrainingArguments(out, per_device_eval_batch_size=4, use_cpu=True, report_to=[], disable_tqdm=True)
    return Trainer(model=model, args=args, eval_dataset=perplexity_rows(rows), data_collator=default_data_collator)


def perplexity(args) -> dict:
    from colab_kit import text

    trainer = perplexity_trainer(tempfile.mkdtemp(), args.rows)
    return {"perplexity": text.perplexity(trainer, rows_per_forward=3), "rank": int(os.environ.get("RANK", 0))}


def _peak_bytes(prof) -> int:
    """The highest 'Total Allocated' the profiler recorded (bytes allocated since it started)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.load(open(trace.name))["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"
              and str(e["args"].get("Device Type")) in ("0", "cpu")]
    return max(totals, default=0)


def memory(args) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

    import colab_kit as ck
    from colab_kit.tasks.demo import tiny_bert_config, toy_classification

    class StepPeak(TrainerCallback):
        """Profiles step 2 whole (step 1 allocates what stays: DDP's buckets are made at wrapping)."""

        def __init__(self):
            self.prof, self.peak = None, None

        def on_step_begin(self, a, state, control, **kw):
            if state.global_step == 1:
                self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
                self.prof.__enter__()

        def on_step_end(self, a, state, control, **kw):
            if state.global_step == 2:
                self.prof.__exit__(None, None, None)
                self.peak = _peak_bytes(self.prof)

    peaks, sizes = {}, {}
    for name in ("trainer", "kit"):
        run = ck.start_run(f"memory-{name}", drive=args.drive, local_dir=os.path.join(args.scratch, name),
                           save_every=None, quiet=True, gauges=False)
        probe = StepPeak()
        torch.manual_seed(0)
        model = BertForSequenceClassification(tiny_bert_config(dropout=0.0, hidden=512, layers=8))
        targs = TrainingArguments(run.local_dir, max_steps=3, per_device_train_batch_size=8, learning_rate=1e-3,
                                  optim="sgd", save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                                  average_tokens_across_devices=False)
        trainer = Trainer(model=model, args=targs, train_dataset=toy_classification(), callbacks=[probe])
        sizes["gradients"] = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
        run.train(trainer, oom_recovery=name == "kit")
        peaks[name] = probe.peak
        bucket = getattr(trainer.model_wrapped, "bucket_bytes_cap", None)
        run.finish(timeout=60)
    return {"peaks": peaks, "gradient_bytes": sizes["gradients"], "bucket_bytes_cap": bucket,
            "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["perplexity", "memory"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", type=int, default=13)
    parser.add_argument("--drive")
    parser.add_argument("--scratch")
    args = parser.parse_args()
    result = perplexity(args) if args.what == "perplexity" else memory(args)
    print(f"RESULT {json.dumps(result)}", flush=True)
    if int(os.environ.get("RANK", 0)) == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
