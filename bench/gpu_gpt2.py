"""The crashed notebook's DistilGPT2 configuration vs this kit's, on a GPU capped like a T4. JSON.

    python bench/gpu_gpt2.py                # needs CUDA; a few minutes on an H100/H200
    python bench/gpu_gpt2.py --cpu-smoke    # the same code path on a CPU with tiny shapes

Both use DistilGPT2's architecture with random weights (built from a config: no download) and
random token ids shaped like wikitext lines, under `set_per_process_memory_fraction` (--cap-gib).

- seed: the LM plus `Linear(50257, 50257)` on the logits, lines padded to 512 tokens, fp32,
  AdamW at lr 0.1, batch 16: reports where it runs out of memory, or its speed if it does not.
- kit: the LM alone, text grouped into full blocks of 512, mixed precision from
  `ck.memory_args`, effective batch 32 through `run.train` (which splits on OOM).

Reported: useful (non-padding) tokens per second, peak allocated memory, back-offs, errors.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch


def line_lengths(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 120, (n,), generator=g)
    lengths[torch.rand(n, generator=g) < 0.3] = 0  # wikitext has many empty lines
    return lengths.tolist()


def measure(fn) -> dict:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    result = {"error": None}
    try:
        result.update(fn())
    except Exception as exc:  # noqa: BLE001 - the seed is expected to fail; say how
        import colab_kit as ck

        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        result["out_of_memory"] = ck.is_oom_error(exc)
    result["seconds"] = round(time.perf_counter() - started, 2)
    if cuda:
        result["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 1024**3, 2)
    return result


def seed_run(config, device, steps: int, pad_to: int) -> dict:
    from transformers import GPT2LMHeadModel

    phase = {"at": "building the model in host RAM"}

    class SeedModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt2 = GPT2LMHeadModel(config)
            self.lm_head2 = torch.nn.Linear(config.vocab_size, config.vocab_size)

        def forward(self, input_ids, attention_mask):
            return self.lm_head2(self.gpt2(input_ids=input_ids, attention_mask=attention_mask).logits)

    try:
        model = SeedModel()
        phase["at"] = "moving the model to the GPU"
        model.to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        lengths = line_lengths(16 * steps)
        useful = 0
        started = time.perf_counter()
        for step in range(steps):
            rows = lengths[step * 16:(step + 1) * 16]
            ids = torch.randint(0, config.vocab_size, (16, pad_to), device=device)
            mask = (torch.arange(pad_to, device=device)[None] < torch.tensor(rows, device=device)[:, None]).long()
            phase["at"] = f"forward/backward, step {step + 1}"
            logits = model(ids, mask)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(),
                                                     reduction="none")
            (loss * mask[:, 1:].flatten()).sum().div(mask[:, 1:].sum().clamp(min=1)).backward()
            phase["at"] = f"optimizer step {step + 1}"
            optimizer.step()
            optimizer.zero_grad()
            useful += sum(rows)
        return {"steps": steps, "useful_tokens_per_s": round(useful / (time.perf_counter() - started), 1)}
    except Exception as exc:
        raise type(exc)(f"{exc} [while {phase['at']}]") from None


def kit_run(config, steps: int, block: int, root: Path, smoke: bool) -> dict:
    from transformers import GPT2LMHeadModel, Trainer, TrainingArguments, default_data_collator

    import colab_kit as ck

    run = ck.start_run("gpt2-bench", drive=root / "drive", local_dir=root / "local", save_every=None, quiet=True,
                       gauges=False)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, config.vocab_size, (32 * steps, block), generator=g)
    data = [{"input_ids": b, "attention_mask": torch.ones_like(b), "labels": b} for b in blocks]
    args = TrainingArguments(str(run.local_dir), max_steps=steps, per_device_train_batch_size=32, learning_rate=5e-5,
                             save_strategy="no", report_to=[], disable_tqdm=True, logging_steps=1000, use_cpu=smoke,
                             **ck.memory_args(run.runtime, group_by_length=False))
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator)
    started = time.perf_counter()
    output = run.train(trainer)
    seconds = time.perf_counter() - started
    return {"steps": output.global_step, "useful_tokens_per_s": round(32 * block * output.global_step / seconds, 1),
            "micro_batch": run.micro_batching.train.micro_batch, "backoffs": len(run.micro_batching.train.backoffs),
            "precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap-gib", type=float, default=15.0)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--cpu-smoke", action="store_true")
    args = parser.parse_args()
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device; run with --cpu-smoke to check the code path"}))
        return 0
    from transformers import GPT2Config

    report: dict = {"mode": "cpu-smoke" if smoke else "gpu"}
    if smoke:
        config = GPT2Config(vocab_size=512, n_positions=128, n_embd=64, n_layer=2, n_head=2, bos_token_id=0,
                            eos_token_id=0)
        block, pad_to, device = 64, 128, "cpu"
    else:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 1024**3 / total))
        report.update(gpu=torch.cuda.get_device_name(0), cap_gib=args.cap_gib)
        config = GPT2Config(n_layer=6)  # DistilGPT2's shape, vocabulary 50257
        block, pad_to, device = 512, 512, "cuda"
    report["seed"] = measure(lambda: seed_run(config, device, args.steps, pad_to))
    import colab_kit as ck

    ck.free_memory(verbose=False)
    report["kit"] = measure(lambda: kit_run(config, args.steps, block, Path(tempfile.mkdtemp()), smoke))
    report["ok"] = report["kit"]["error"] is None and report["kit"].get("steps") == args.steps
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
