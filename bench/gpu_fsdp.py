"""The HF Trainer with FSDP2 on 2 GPUs through the kit: killed mid-run, resumed from its sharded checkpoint.

    python bench/gpu_fsdp.py            # needs 2 CUDA devices; a few minutes; prints JSON
    python bench/gpu_fsdp.py --steps 40 --kill-at 25
    python bench/gpu_fsdp.py --cpu-smoke  # the same launch, kill, resume and report on 2 CPU processes (DDP:
                                          # accelerate will not run FSDP on a CPU), with a tiny BERT

accelerate runs FSDP only on GPUs, so the CPU suite tests the kit's side of it (the mirror, manifest,
validity and resume of `pytorch_model_fsdp_0/`, `optimizer_0/` and `rng_state_<rank>.pth`) on
checkpoints written in that layout by raw FSDP2 + DCP (tests/distributed/test_sharded.py). This script is
the end-to-end check for a machine with 2 GPUs:

1. reference: BERT-base (built from its config: no download) on random token ids, `ck.start_run` +
   `run.train`, FSDP2 with sharded state dicts, a checkpoint every --save-every steps, --steps steps;
2. killed: the same run in a fresh folder, every rank ended with os._exit at --kill-at (a lost runtime),
   once the checkpoint before it is written to the run folder;
3. resumed: the same command again: `start_run` finds the newest checkpoint that verifies in the run
   folder and `run.train` resumes it through accelerate's FSDP loaders.

Reported: the step resumed from, what the checkpoint folder holds, its manifest's shard record, the largest
difference between the resumed run's final weights and the reference's (GPU kernels may differ in the last
bits; 0 or about 1e-6 is expected), and the kit's pause per save from its journal.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def rank_main(args) -> None:
    import numpy as np
    import torch
    from datasets import Dataset
    from transformers import BertConfig, BertForSequenceClassification, TrainerCallback, TrainingArguments, Trainer

    import colab_kit as ck

    run = ck.start_run("fsdp-bench", drive=args.drive, local_dir=args.scratch, save_every=args.save_every, keep=2,
                       quiet=True, gauges=False)
    torch.manual_seed(0)
    if args.cpu_smoke:
        from colab_kit.tasks.demo import tiny_bert_config

        config, length = tiny_bert_config(dropout=0.0, vocab_size=30522), 32
        sharding = {"use_cpu": True}
    else:
        config, length = BertConfig(num_labels=2), 128
        precision = {"bf16": True} if torch.cuda.is_bf16_supported() else {"fp16": True}
        sharding = {**precision, "fsdp": "full_shard auto_wrap",
                    "fsdp_config": {"fsdp_version": 2, "state_dict_type": "SHARDED_STATE_DICT",
                                    "reshard_after_forward": True, "transformer_layer_cls_to_wrap": ["BertLayer"]}}
    model = BertForSequenceClassification(config)
    rng = np.random.default_rng(0)
    rows = args.steps * 8 * 2
    data = Dataset.from_dict({"input_ids": rng.integers(1000, 30000, (rows, length)).tolist(),
                              "labels": rng.integers(0, 2, rows).tolist()})
    training = TrainingArguments(
        str(run.local_dir), max_steps=args.steps, per_device_train_batch_size=8, learning_rate=2e-5, report_to=[],
        logging_steps=1000, disable_tqdm=True, seed=0, data_seed=0, save_strategy="steps",
        save_steps=args.save_every, **sharding)

    class Kill(TrainerCallback):
        """At --kill-at, once the last checkpoint is written to the run folder: every rank ends at once."""

        def on_step_end(self, args_, state, control, **kwargs):
            if not args.kill_at or state.global_step != args.kill_at:
                return
            saved = state.global_step // args.save_every * args.save_every
            deadline = time.monotonic() + 300
            while run.ranks.writer and (run.mirror.written_step or 0) < saved and time.monotonic() < deadline:
                time.sleep(0.2)
            torch.distributed.barrier()
            os._exit(9)

    trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=[*run.callbacks(), Kill()])
    run.train(trainer)
    full = trainer.accelerator.get_state_dict(trainer.model)  # whole tensors on rank 0
    if int(os.environ["RANK"]) == 0:
        from safetensors.torch import save_file

        save_file({k: v.float().cpu().contiguous() for k, v in full.items()}, args.out)


def launch(args, drive: Path, local: Path, out: Path, kill_at: int) -> int:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", __file__, "--rank-main",
               "--drive", str(drive), "--scratch", str(local), "--out", str(out), "--steps", str(args.steps),
               "--save-every", str(args.save_every), "--kill-at", str(kill_at)] + (["--cpu-smoke"] * args.cpu_smoke)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.run(command, env=env, stdout=sys.stderr).returncode  # stdout is the report's


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--kill-at", type=int, default=15)
    parser.add_argument("--rank-main", action="store_true")
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--drive")
    parser.add_argument("--scratch")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.rank_main:
        import torch.distributed as dist

        rank_main(args)
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # gloo torn down during interpreter shutdown can abort a finished rank (README)
    import torch

    if args.cpu_smoke:
        args.steps, args.save_every, args.kill_at = 12, 4, 7
    elif torch.cuda.device_count() < 2:
        print(json.dumps({"skipped": f"needs 2 CUDA devices, found {torch.cuda.device_count()}"}))
        return 0
    from safetensors.torch import load_file

    from colab_kit.checkpoints import validity
    from colab_kit.checkpoints.journal import read_events

    root = Path(tempfile.mkdtemp(prefix="gpu-fsdp-"))
    report: dict = {"mode": "cpu-smoke (DDP)" if args.cpu_smoke else "gpu (FSDP2)", "folder": str(root),
                    "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    report["reference_rc"] = launch(args, root / "ref-drive", root / "ref-local", root / "reference.safetensors", 0)
    report["killed_rc"] = launch(args, root / "drive", root / "local-1", root / "unused.safetensors", args.kill_at)
    report["resumed_rc"] = launch(args, root / "drive", root / "local-2", root / "resumed.safetensors", 0)
    events = read_events(root / "drive" / "fsdp-bench" / "events.jsonl")
    report["resumed_from"] = [e.get("step") for e in events if e["event"] == "resume"]
    report["save_pause_s"] = [e.get("snapshot_s") for e in events if e["event"] == "save"]
    checkpoints = sorted((root / "drive" / "fsdp-bench" / "checkpoints").glob("checkpoint-*"),
                         key=lambda path: int(path.name.split("-")[1]))
    if checkpoints:
        newest = checkpoints[-1]
        verdict = validity.check(newest)
        report["newest"] = {"name": newest.name, "verdict": str(verdict),
                            "shards": verdict.manifest.shards if verdict.manifest else None,
                            "files": sorted(p.relative_to(newest).as_posix() for p in newest.rglob("*") if p.is_file())}
    if (root / "resumed.safetensors").exists() and (root / "reference.safetensors").exists():
        a, b = load_file(str(root / "reference.safetensors")), load_file(str(root / "resumed.safetensors"))
        report["max_abs_diff"] = max((a[k] - b[k]).abs().max().item() for k in a)
    report["ok"] = (report["reference_rc"] == 0 and report["resumed_rc"] == 0 and bool(report["resumed_from"])
                    and report.get("max_abs_diff", 1.0) <= 1e-3)
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
