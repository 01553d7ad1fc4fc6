"""Version drift on resume: a checkpoint written under other versions of torch, transformers, peft, accelerate,
CUDA or on another GPU than this runtime has (Colab's runtime versions change between sessions: "Change runtime
version" has to be chosen again each time, colabtools#6081).

Every manifest records what wrote it (`runtime.library_versions`). A resume says what changed, and what the
change may do; it refuses nothing: the load itself tells what cannot be read, and a load that fails is told
which change it met (`note_failure`).
"""

from __future__ import annotations

__all__ = ["drift", "describe_drift", "note_failure"]

# What a change of each may do to a resume, in the order they are said.
_EFFECTS = {
    "torch": "optimizer, scheduler and RNG states are read back with torch.load; a torch older than the one that "
             "wrote them may not read them, and random streams may differ (the data order does not)",
    "transformers": "the Trainer reads back the state and RNG files it wrote; across minor versions this loads, "
                    "and a model class changed between them may rename weights (the load then names the keys)",
    "peft": "an adapter_config.json written by a newer peft may hold options an older one rejects (the load says "
            "which)",
    "accelerate": "skipping the batches already trained is accelerate's: another version may skip differently",
    "trl": "a TRL trainer's own state may be read differently",
    "safetensors": "weights load across versions",
    "cuda": "kernels differ: results differ in the last digits, and nothing fails to load",
    "gpu": "the micro-batch learned on the other GPU is learned again here; bf16 needs an Ampere GPU or newer "
           "(a T4 runs fp16)",
    "python": "pickled states load across Python 3 versions",
}


def drift(saved: dict, now: dict) -> dict[str, tuple[str, str]]:
    """{name: (then, now)} of what differs between a checkpoint's recorded versions and this runtime's (a name
    recorded on one side only counts too: a library installed or removed since)."""
    return {name: (saved.get(name, "not installed"), now.get(name, "not installed"))
            for name in _EFFECTS if name in saved or name in now
            if saved and saved.get(name) != now.get(name)}


def describe_drift(step: int, saved: dict, now: dict) -> str | None:
    """One sentence on what changed since checkpoint-`step` was written, and what it may do; None when nothing
    did (or the checkpoint's kit recorded no versions)."""
    changed = drift(saved, now)
    if not changed:
        return None
    what = "; ".join(f"{name} {then} -> {here} ({_EFFECTS[name]})" for name, (then, here) in changed.items())
    pins = " ".join(f"{name}=={then.split('+')[0]}" for name, (then, _) in changed.items()
                    if name not in ("cuda", "gpu", "python") and then != "not installed")
    return (f"checkpoint-{step} was written under other versions than this runtime has: {what}. The resume goes "
            f"on" + (f"; to resume under the versions that wrote it: pip install {pins}, then restart the runtime"
                     if pins else ""))


def note_failure(exc: BaseException, step: int, saved: dict, now: dict, fresh: str) -> None:
    """Add to an error raised while resuming from checkpoint-`step` which versions changed since it was written
    (the likely cause when a load fails)."""
    changed = drift(saved, now)
    if changed and hasattr(exc, "add_note"):  # Python 3.11 and newer
        exc.add_note("colab_kit: checkpoint-{} was written under {}; if it cannot be loaded here, install those "
                     "versions and restart the runtime, or {}".format(
                         step, ", ".join(f"{name} {then} (now {here})" for name, (then, here) in changed.items()),
                         fresh))
