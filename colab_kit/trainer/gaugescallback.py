"""The live gauges while the Trainer runs (`gauges/`), fed from the training loop and closed at its end."""

from __future__ import annotations

from transformers import TrainerCallback

__all__ = ["GaugesCallback"]


class GaugesCallback(TrainerCallback):
    """Live gauges while the Trainer runs; updated from the training loop, closed at the end."""

    def __init__(self, run):
        self.run = run
        self.gauges = None

    def _status(self) -> dict:
        run = self.run
        batching = run.micro_batching
        backoffs = len(batching.train.backoffs) + len(batching.eval.backoffs) if batching is not None else 0
        return {"saved_step": run.last_saved_step, "cloud": run.mirror.tracker.describe(),
                "oom_backoffs": backoffs, "micro_batch": batching.train.micro_batch if batching else None,
                "session": run.session.describe() if getattr(run, "session", None) is not None else None}

    def on_train_begin(self, args, state, control, **kwargs):
        from ..gauges.gauges import Gauges

        if self.gauges is not None and not self.gauges.closed:
            return
        run = self.run

        def warn(message):  # from the sampler thread: journal it; the gauges show it
            run.journal.write("warn", what="memory", message=message)

        self.gauges = Gauges(total_steps=state.max_steps or None, title=f"run {run.name!r}",
                             local_dir=run.local_dir, drive_dir=run.drive_dir,
                             save_html=run.drive_dir / "gauges.html", on_warn=warn, write=run.mirror.write_later,
                             all_gpus=run.ranks.local_world_size > 1)
        self.gauges.update(step=state.global_step, **self._status())

    def on_step_end(self, args, state, control, **kwargs):
        if self.gauges is not None:
            self.gauges.update(step=state.global_step, **self._status())

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.gauges is not None and logs and "loss" in logs:
            self.gauges.update(step=state.global_step, loss=logs["loss"])

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self, error: str | None = None) -> None:
        if self.gauges is not None and not self.gauges.closed:
            self.gauges.update(**self._status())
            self.gauges.close(error=error)
