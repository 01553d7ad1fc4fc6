"""Real out-of-memory recovery on a GPU capped like a free Colab T4. Prints JSON.

    python bench/gpu_oom.py                 # needs CUDA; about 2 minutes on an H100/H200
    python bench/gpu_oom.py --cpu-smoke     # the same code path on a CPU, with an injected OOM

On a GPU: caps this process at --cap-gib (15, a T4) with
`torch.cuda.set_per_process_memory_fraction`, shows that BERT-base (random weights, built
from a config) at batch 32 x 512 in fp32 really runs out of memory, then trains it through
`run.train` and reports the back-offs, the peak memory and tokens/s. Finally it lifts the cap,
trains the same steps unsplit and compares the weights (TF32 off, so only summation order
differs).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch


def data(n: int, length: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, vocab, (n, length), generator=g)
    labels = torch.randint(0, 2, (n,), generator=g)

    class Fixed(torch.utils.data.Dataset):
        def __len__(self):
            return n

        def __getitem__(self, i):
            return {"input_ids": ids[i], "attention_mask": torch.ones(length, dtype=torch.long),
                    "labels": labels[i]}

    return Fixed()


def build(smoke: bool, attn: str = "eager"):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    # Eager attention stores the 32 x 12 x 512 x 512 attention scores per layer, as bert-base
    # did for the users who hit this wall; with SDPA the same batch may fit in 15 GiB.
    config = BertConfig(num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        attn_implementation=attn)
    if smoke:
        config = BertConfig(vocab_size=2000, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, num_labels=2, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config)


def trainer_for(out: Path, model, args_ns, smoke: bool):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(str(out), max_steps=args_ns.steps, per_device_train_batch_size=args_ns.batch,
                             learning_rate=2e-5, save_strategy="no", report_to=[], disable_tqdm=True,
                             logging_steps=1, use_cpu=smoke, seed=0, dataloader_pin_memory=not smoke)
    return Trainer(model=model, args=args, train_dataset=data(args_ns.batch * args_ns.steps, args_ns.seq,
                                                              model.config.vocab_size))


def provoke(model, args_ns, device) -> dict:
    """One unsplit forward+backward at the full batch: does it really run out of memory?"""
    import colab_kit as ck

    batch = {k: torch.stack([d[k] for d in [data(args_ns.batch, args_ns.seq, model.config.vocab_size)[i]
                                            for i in range(args_ns.batch)]]).to(device)
             for k in ("input_ids", "attention_mask", "labels")}
    result = {"oom": False, "recognised": None, "error": None}
    try:
        model(**batch).loss.backward()
    except Exception as exc:  # noqa: BLE001
        result.update(oom=True, recognised=ck.is_oom_error(exc), error=str(exc).splitlines()[0][:200])
    model.zero_grad(set_to_none=True)
    del batch
    freed = ck.free_memory(verbose=False)
    result["allocated_after_free"] = freed["after"].get("allocated")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap-gib", type=float, default=15.0)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on a CPU, OOM injected above 8 rows")
    args = parser.parse_args()
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device; run with --cpu-smoke to check the code path"}))
        return 0
    import colab_kit as ck

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    report: dict = {"mode": "cpu-smoke" if smoke else "gpu", "batch": args.batch, "seq": args.seq,
                    "steps": args.steps, "attention": args.attn}
    device = "cpu" if smoke else "cuda"
    if not smoke:
        total = torch.cuda.get_device_properties(0).total_memory
        fraction = min(1.0, args.cap_gib * 1024**3 / total)
        torch.cuda.set_per_process_memory_fraction(fraction)
        report.update(gpu=torch.cuda.get_device_name(0), gpu_total_gib=round(total / 1024**3, 1),
                      cap_gib=args.cap_gib, fraction=round(fraction, 4))

    root = Path(tempfile.mkdtemp(prefix="gpu_oom-"))
    model = build(smoke, args.attn).to(device)
    if smoke:
        def hook(module, inputs, output):
            if module.training and output.shape[0] > 8:
                raise torch.OutOfMemoryError("CUDA out of memory (injected for the CPU smoke run)")

        model.get_input_embeddings().register_forward_hook(hook)
    report["provoked"] = provoke(model, args, device)

    run = ck.start_run("gpu-oom", drive=root / "drive", local_dir=root / "local", save_every=None, quiet=True)
    trainer = trainer_for(run.local_dir, model, args, smoke)
    if not smoke:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    output = run.train(trainer)
    seconds = time.perf_counter() - started
    backoffs = run.micro_batching.train.backoffs
    report["kit"] = {
        "steps": output.global_step, "seconds": round(seconds, 2),
        "tokens_per_s": round(args.batch * args.seq * output.global_step / seconds, 1),
        "backoffs": [{"step": b.get("step"), "where": b["where"], "from": b["from"], "to": b["to"]} for b in backoffs],
        "micro_batch": run.micro_batching.train.micro_batch,
        "effective_batch": run.fingerprint["effective_batch"],
    }
    if not smoke:
        report["kit"]["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 1024**3, 2)
    capped_weights = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
    del trainer, model
    ck.free_memory(verbose=False)

    # The same training, unsplit and uncapped: the recovery must not have changed the result.
    if not smoke:
        torch.cuda.set_per_process_memory_fraction(1.0)
    reference = build(smoke, args.attn).to(device)
    plain = trainer_for(root / "plain", reference, args, smoke)
    plain.train()
    diff = max((reference.state_dict()[k].detach().float().cpu() - capped_weights[k]).abs().max().item()
               for k in capped_weights)
    report["max_abs_weight_diff_vs_unsplit"] = diff
    ok = (report["provoked"]["oom"] and report["provoked"]["recognised"] and output.global_step == args.steps
          and backoffs and diff <= 1e-4)
    report["ok"] = bool(ok)
    print(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
