"""Training-argument recipes the notebooks share: memory settings that fit the GPU, and
length-grouped batches that survive a resume.

`memory_args()` gives fp16 autocast on a T4 (no bf16 there) and bf16 on Ampere or newer,
length-grouped batches (less padding), and gradient checkpointing on request, spelled as
the installed transformers version wants them.

The Trainer's `LengthGroupedSampler` draws its permutation from the global RNG, with no seed
per epoch; after a resume in a later epoch it would produce another order, and skipping the
seen batches by index would then skip the wrong samples. `run.train` swaps in a sampler that
is seeded with (seed + epoch), as accelerate does for the plain random sampler.
"""

from __future__ import annotations

from ..distributed.ranks import detect as detect_ranks
from ..runtime import RuntimeInfo, detect_runtime

__all__ = ["memory_args", "make_length_grouping_resumable", "checkpointing_requested", "checkpointing_arg",
           "set_checkpointing", "freeze_layers"]


def memory_args(runtime: RuntimeInfo | None = None, *, gradient_checkpointing: bool = False,
                group_by_length: bool = True) -> dict:
    """`TrainingArguments` keywords for memory: mixed precision per GPU, length grouping, checkpointing
    (and `use_cpu` when several processes are launched without a GPU, so that they train together).

    Example:
        >>> args = TrainingArguments(run.local_dir, **ck.memory_args(run.runtime), ...)
    """
    from transformers import TrainingArguments

    fields = TrainingArguments.__dataclass_fields__
    gpu = (runtime or detect_runtime()).gpu
    args: dict = {}
    if gpu is not None:
        args["bf16" if gpu.bf16 else "fp16"] = True
    else:
        args["dataloader_pin_memory"] = False  # pinning needs a GPU; on a CPU it only warns
        if detect_ranks().distributed:  # else the Trainer launched as several CPU processes trains each alone
            args["use_cpu"] = True
    if group_by_length:
        if "train_sampling_strategy" in fields:  # transformers 5
            args["train_sampling_strategy"] = "group_by_length"
        else:
            args["group_by_length"] = True
    if gradient_checkpointing:
        args[checkpointing_arg()] = True
    return args


def set_checkpointing(model, on: bool = True) -> None:
    """Turn gradient checkpointing on (non-reentrant, as transformers 5 does it) or off on a transformers model,
    by the installed version's own name (5.x: `activation_checkpointing_enable`; 4.x: `gradient_...`)."""
    if on:
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": False})  # the options, given by position: both versions take them first
    else:
        (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()


def checkpointing_arg(kwargs: bool = False) -> str:
    """The TrainingArguments name for gradient checkpointing in the installed transformers: 5.x renamed it
    `activation_checkpointing` (the old name still works there, with a FutureWarning). `kwargs`: its options'."""
    from transformers import TrainingArguments

    name = ("activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
            else "gradient_checkpointing")
    return name + ("_kwargs" if kwargs else "")


def freeze_layers(model, n: int) -> int:
    """Freeze the input embeddings and the lowest `n` transformer blocks; returns the frozen parameters.

    Frozen parameters get no gradient and no optimizer state (the Trainer gives the optimizer
    only parameters that require gradients), so this saves 12 bytes per frozen parameter with
    AdamW, on top of the activations below the first trainable block. With GPT-2 the LM head
    shares the embedding matrix, so it is frozen too. n = 0 leaves everything trainable.
    """
    import torch

    if n <= 0:
        return 0
    base = getattr(model, "base_model", model)
    blocks = next((m for m in base.children() if isinstance(m, torch.nn.ModuleList)), None)
    if blocks is None:
        encoder = getattr(base, "encoder", None)
        blocks = getattr(encoder, "layer", None)
    if blocks is None:
        raise ValueError(f"cannot find the transformer blocks of {type(model).__name__}; freeze its parameters "
                         f"by hand with p.requires_grad_(False)")
    if n > len(blocks):
        raise ValueError(f"FREEZE_LAYERS={n}, but the model has {len(blocks)} blocks")
    frozen = []
    for module in [model.get_input_embeddings(), getattr(base, "wpe", None), *blocks[:n]]:
        if module is not None:
            frozen += [p for p in module.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    return sum(p.numel() for p in frozen)


def checkpointing_requested(model, args=None) -> bool:
    """Is gradient (activation) checkpointing on, or asked for in the training arguments?"""
    on_model = getattr(model, "is_activation_checkpointing", None)  # transformers 5's name
    if on_model is None:
        on_model = getattr(model, "is_gradient_checkpointing", False)
    return bool(on_model or getattr(args, "activation_checkpointing", False)
                or getattr(args, "gradient_checkpointing", False))


def make_length_grouping_resumable(trainer) -> None:
    """Make the trainer's length-grouped sampler reproduce each epoch's order from (seed, epoch)."""
    import torch
    from transformers.trainer_pt_utils import LengthGroupedSampler, get_length_grouped_indices

    class EpochSeededLengthGroupedSampler(LengthGroupedSampler):
        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __iter__(self):
            generator = torch.Generator()
            generator.manual_seed(self.seed + getattr(self, "epoch", 0))
            return iter(get_length_grouped_indices(self.lengths, self.batch_size, generator=generator))

    original = trainer._get_train_sampler
    if getattr(original, "_colab_kit", False):
        return

    def sampler(*args, **kwargs):
        made = original(*args, **kwargs)
        if type(made) is LengthGroupedSampler:
            made.__class__ = EpochSeededLengthGroupedSampler
            made.seed = int(trainer.args.seed)
        return made

    sampler._colab_kit = True
    trainer._get_train_sampler = sampler
