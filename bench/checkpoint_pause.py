"""How long does the training loop stop for a checkpoint? The kit vs writing straight to Drive.

    python bench/checkpoint_pause.py [--rate-mb 20] [--reps 2]

Drive is simulated by a writer throttled to --rate-mb MB/s (every byte the kit writes to the
persistent folder goes through `storage._write_chunk`, which this script throttles).

- direct: `TrainingArguments(output_dir=<drive folder>)`, the usual advice. Modelled as the
  Trainer's own save followed, inside the same save call, by pushing the checkpoint's bytes
  through the throttled writer (what a synchronous write to a 20 MB/s folder costs).
- kit: `ck.start_run` + `run.train`; the Trainer saves to local disk, the kit snapshots it
  (hard links) and uploads in a background thread through the same throttled writer.

Pause = time inside `Trainer._save_checkpoint` plus the `on_save` callbacks, per save; runs
are interleaved (direct, kit, direct, kit, ...). Prints medians and the ratio kit/direct.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import figures


def install_throttle(rate_bytes: float, slow_root: Path) -> None:
    from colab_kit.checkpoints import storage

    lock = threading.Lock()
    original = storage._write_chunk

    def throttled(fh, data):
        if str(slow_root) in str(getattr(fh, "name", "")):
            with lock:  # one link to "Drive", shared by every writer
                time.sleep(len(data) / rate_bytes)
        original(fh, data)

    storage._write_chunk = throttled


def build(output_dir: Path, steps: int, save_every: int, callbacks=None):
    import datasets
    import numpy as np
    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = BertConfig(vocab_size=8192, hidden_size=384, num_hidden_layers=4, num_attention_heads=6,
                        intermediate_size=1536, max_position_embeddings=128, num_labels=2)
    model = BertForSequenceClassification(config)
    rng = np.random.default_rng(0)
    data = datasets.Dataset.from_dict({"input_ids": rng.integers(5, 8192, (1024, 64)).tolist(),
                                       "labels": rng.integers(0, 2, 1024).tolist()})
    args = TrainingArguments(str(output_dir), max_steps=steps, per_device_train_batch_size=8,
                             save_strategy="steps", save_steps=save_every, report_to=[], use_cpu=True,
                             disable_tqdm=True, logging_steps=1000, save_total_limit=2)
    return Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)


class PauseMeter:
    """Times Trainer._save_checkpoint + CallbackHandler.on_save, per save."""

    def __init__(self):
        from transformers import Trainer
        from transformers.trainer_callback import CallbackHandler

        self.pauses: list[float] = []
        self._t0 = 0.0
        save, on_save = Trainer._save_checkpoint, CallbackHandler.on_save
        meter = self

        def timed_save(trainer, *a, **k):
            meter._t0 = time.perf_counter()
            return save(trainer, *a, **k)

        def timed_on_save(handler, *a, **k):
            result = on_save(handler, *a, **k)
            meter.pauses.append(time.perf_counter() - meter._t0)
            return result

        Trainer._save_checkpoint, CallbackHandler.on_save = timed_save, timed_on_save

    def take(self) -> list[float]:
        pauses, self.pauses = self.pauses, []
        return pauses


def run_direct(root: Path, steps: int, save_every: int) -> tuple[float, int]:
    from transformers import Trainer

    from colab_kit.checkpoints import storage

    local, slow = root / "local", root / "drive"
    trainer = build(local, steps, save_every)
    original = Trainer._save_checkpoint
    sizes = []

    def save_to_slow_folder(self, model, trial):
        original(self, model, trial)
        folder = local / f"checkpoint-{self.state.global_step}"
        target = slow / folder.name
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                dst = target / path.relative_to(folder)
                dst.parent.mkdir(parents=True, exist_ok=True)
                storage.copy_file(path, dst)
                sizes.append(path.stat().st_size)

    trainer._save_checkpoint = save_to_slow_folder.__get__(trainer)
    started = time.perf_counter()
    trainer.train()
    return time.perf_counter() - started, sum(sizes)


def run_kit(root: Path, steps: int, save_every: int) -> tuple[float, float]:
    import colab_kit as ck

    run = ck.start_run("bench", drive=root / "drive", local_dir=root / "local", save_every=None, quiet=True)
    trainer = build(run.local_dir, steps, save_every)
    started = time.perf_counter()
    trainer.add_callback(run.callbacks()[1])
    trainer.add_callback(run.callbacks()[0])
    trainer.train()
    trained = time.perf_counter() - started
    run.finish(timeout=600)
    return trained, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate-mb", type=float, default=20.0)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=10)
    figures.add_arguments(parser, "checkpoint_pause")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="checkpoint_pause-"))
    install_throttle(args.rate_mb * 1e6, workdir)
    meter = PauseMeter()
    direct_pauses, kit_pauses, direct_wall, kit_wall, kit_durable = [], [], [], [], []
    checkpoint_bytes = 0
    for rep in range(args.reps):
        wall, total = run_direct(workdir / f"direct{rep}", args.steps, args.save_every)
        direct_wall.append(wall)
        pauses = meter.take()
        direct_pauses += pauses
        checkpoint_bytes = total / max(len(pauses), 1)
        trained, durable = run_kit(workdir / f"kit{rep}", args.steps, args.save_every)
        kit_wall.append(trained)
        kit_durable.append(durable)
        kit_pauses += meter.take()
    d, k = statistics.median(direct_pauses), statistics.median(kit_pauses)
    print(f"checkpoint size {checkpoint_bytes / 1e6:.0f} MB, Drive simulated at {args.rate_mb:g} MB/s, "
          f"{args.steps} steps saving every {args.save_every}, {args.reps} interleaved reps")
    print(f"{'':<8}{'pause/save (median)':>21}  {'train wall':>10}  all pauses (s)")
    for label, pauses, wall in (("direct", direct_pauses, direct_wall), ("kit", kit_pauses, kit_wall)):
        print(f"{label:<8}{statistics.median(pauses):>20.3f}s  {statistics.median(wall):>9.1f}s  "
              + ", ".join(f"{p:.2f}" for p in pauses))
    print(f"ratio kit/direct pause: {k / d:.3f} (target <= 0.10); every kit checkpoint written "
          f"{statistics.median(kit_durable):.1f} s after training started (uploads overlap training)")
    draw(args, direct_pauses, kit_pauses, checkpoint_bytes, d, k)
    return 0 if k / d <= 0.10 else 1


def draw(args, direct_pauses, kit_pauses, checkpoint_bytes, d, k) -> None:
    """Each save's pause, the direct write's beside the kit's, with their medians."""
    fig, ax = figures.figure(6.5, 3.4)
    for row, (label, pauses) in enumerate((("Trainer writes output_dir on Drive", direct_pauses),
                                           ("colab_kit (local write, background copy)", kit_pauses))):
        ax.scatter(pauses, [row] * len(pauses), alpha=0.6, s=30)
        ax.plot([statistics.median(pauses)] * 2, [row - 0.25, row + 0.25], color="black", lw=2)
    ax.set_yticks([0, 1], ["Trainer writes output_dir\non the Drive mount", "colab_kit: local write,\nbackground copy"])
    ax.set_ylim(-0.6, 1.6)
    ax.set_xlabel("training paused per checkpoint (s)")
    ax.set_title(f"{checkpoint_bytes / 1e6:.0f} MB checkpoints, Drive at {args.rate_mb:g} MB/s:\nthe kit's pause "
                 f"is {k / d:.3f}x the direct write's (medians: the black lines)", fontsize=10)
    figures.save(fig, args)


if __name__ == "__main__":
    sys.exit(main())
