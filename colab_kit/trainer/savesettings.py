"""The Trainer's save settings beside the kit's saves: every setting keeps them, or is refused before training.

The kit asks the Trainer for a save by setting `control.should_save` at a step's end (`callbacks.py`): its
schedule (`save_every`), the stop button's step, and the final state. The Trainer makes that save after its
evaluation of the step, and each of its save settings is one of these cases (the table in docs/trainer.md,
tested through `run.train` in tests/run/test_save_settings.py):

- `save_strategy="no"`, `"steps"`: the Trainer's own saves come on top; the kit's are made as asked.
- `"epoch"`: the Trainer saves at each epoch's end; a kit save due at the epoch's last step is left to that save
  (one save of the step, holding the epoch's evaluation: `SaveScheduleCallback._ask`).
- `"best"`: each evaluation sets `should_save` to "is this a new best?", AFTER the kit asked, so every save of
  the kit's that is not a new best, the final state included, would be dropped without a word. The kit keeps
  the Trainer's judgement of the best (`_determine_best_metric`, which records the best step) and makes its
  answer "a new best, or a save someone asked for" (`keep_asked_saves`). A save asked at the last step of an
  epoch evaluated at its end is left to the epoch's end, as for "epoch".
- `load_best_model_at_end`, `metric_for_best_model`, `save_total_limit`, the eval strategies: the Trainer's,
  unchanged (its rotation never removes the best checkpoint; the kit keeps its own copies on the store).
- `save_only_model=True`: made as asked, said: such a checkpoint holds no optimizer or RNG state, so a resume
  from it is not exact.
- `push_to_hub=True` (any `hub_strategy`): the Trainer's own commits. Into the repo that holds the kit's run
  they are refused: two writers of one repo, one of them outside the kit's lease and gate.

A save the kit asked for that the Trainer still did not make (a setting of a later transformers, another
callback) is said and journaled (`SaveScheduleCallback.check_made`), never dropped silently.
"""

from __future__ import annotations

import contextlib

from ..errors import ColabKitError

__all__ = ["strategy", "saves_at_epoch_end", "check_save_settings", "keep_asked_saves"]


def strategy(value) -> str:
    """A TrainingArguments strategy as its plain name ("epoch"), whether given as a string or an enum."""
    return str(getattr(value, "value", value) or "")


def saves_at_epoch_end(args) -> bool:
    """Does the Trainer save on its own at an epoch's end (after the epoch's evaluation, if any)?"""
    saving = strategy(getattr(args, "save_strategy", None))
    return saving == "epoch" or (saving == "best" and strategy(getattr(args, "eval_strategy", None)) == "epoch")


def check_save_settings(run, trainer) -> None:
    """Refuse, before anything trains, a save setting the kit cannot honour, saying what to set instead."""
    args = trainer.args
    if strategy(args.save_strategy) == "best" and not callable(getattr(trainer, "_determine_best_metric", None)):
        raise ColabKitError(
            "save_strategy='best' would drop the kit's saves with this transformers (its Trainer has no "
            "_determine_best_metric, through which the kit keeps them). Set save_strategy to the eval_strategy "
            "('steps' with save_steps=eval_steps, or 'epoch') and keep load_best_model_at_end=True: the Trainer "
            "then keeps the best checkpoint, and the kit's saves are made")
    if getattr(args, "push_to_hub", False):
        repo = _run_repo(run)
        pushed = getattr(args, "hub_model_id", None)
        if repo is not None and pushed is not None and pushed.strip("/") == repo:
            raise ColabKitError(
                f"push_to_hub=True with hub_model_id={pushed!r}: the Trainer would commit its checkpoints to the "
                f"repo that keeps run {run.name!r}, outside the kit's lease and its one gate for deletions. Set "
                f"push_to_hub=False (the kit already keeps every checkpoint and final/ in {repo}), or push the "
                f"Trainer's copies to another repo (hub_model_id='<user>/<other-repo>')")


def _run_repo(run) -> str | None:
    """The Hub repo that keeps this run, or None for a folder."""
    address = getattr(getattr(run.mirror.tracker.api, "repo", None), "address", None)  # a HubStore's
    return getattr(address, "repo_id", None)


@contextlib.contextmanager
def keep_asked_saves(trainer):
    """While training with save_strategy="best": an evaluation's "new best?" also answers yes to a save that
    was asked for at this step (the kit's, or another callback's), which the Trainer would otherwise drop.
    The best step and metric stay the Trainer's own."""
    if strategy(trainer.args.save_strategy) != "best":
        yield
        return
    judge, own = trainer._determine_best_metric, trainer.__dict__.get("_determine_best_metric")

    def new_best_or_asked(*args, **kwargs):
        asked = bool(trainer.control.should_save)  # read before the Trainer overwrites it with the answer
        return judge(*args, **kwargs) or asked

    trainer._determine_best_metric = new_best_or_asked
    try:
        yield
    finally:  # the trainer's method as it was (a trainer outlives its run in a notebook)
        if own is None:
            del trainer._determine_best_metric
        else:
            trainer._determine_best_metric = own
