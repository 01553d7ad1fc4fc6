"""Pre-flight checks: catch the classic fine-tuning mistakes before they cost a session.

A user's DistilGPT2 run died of host-RAM exhaustion on CPU and GPU alike. The cause was not the
batch size: a `nn.Linear(50257, 50257)` on top of the logits (2.5 billion parameters, 10 GB of
fp32 weights built in RAM, 40 GB with gradients and Adam), with a learning rate of 0.1 and 2,500
warm-up steps for a 3-step run. `preflight` reads the model and the arguments, allocates nothing
(a model built on the `meta` device works), and says what to change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .._units import format_bytes
from .recipes import checkpointing_arg, checkpointing_requested

__all__ = ["Finding", "PreflightReport", "preflight"]

HUGE_LAYER = 1_000_000_000  # parameters in one layer
LAYER_SHARE = 0.25  # of free host RAM or GPU memory, for one layer's training state
ADAM_MAX_LR = 1e-2


@dataclass(frozen=True)
class Finding:
    level: str  # "error" (will fail), "warning" (will train badly or waste the session), "info"
    code: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"[{self.level}] {self.message}\n    -> {self.fix}"


@dataclass
class PreflightReport:
    parameters: int
    trainable: int
    memory: dict[str, int]  # weights, gradients, optimizer, total (bytes, before activations)
    largest_layers: list[tuple[str, str, int]]  # (name, description, parameters)
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No errors or warnings (infos are fine)."""
        return not [f for f in self.findings if f.level in ("error", "warning")]

    def codes(self) -> set[str]:
        return {f.code for f in self.findings}

    def __str__(self) -> str:
        m = self.memory
        lines = [f"parameters: {self.parameters:,} ({self.trainable:,} trainable, "
                 f"{self.parameters - self.trainable:,} frozen)",
                 f"training state before activations: weights {format_bytes(m['weights'])} + gradients "
                 f"{format_bytes(m['gradients'])} + optimizer {format_bytes(m['optimizer'])} = {format_bytes(m['total'])}",
                 "largest layers: " + "; ".join(f"{n} {d} ({p:,})" for n, d, p in self.largest_layers[:3])]
        if not self.findings:
            lines.append("preflight: no problems found")
        lines += [str(f) for f in self.findings]
        return "\n".join(lines)


def _optimizer_bytes(optim: str, params: list) -> tuple[int, str]:
    optim = optim.lower()
    trainable = [p for p in params if p.requires_grad]
    if "8bit" in optim:
        return sum(2 * p.numel() for p in trainable), "8-bit Adam: 2 bytes/parameter"
    if "adafactor" in optim:  # factored second moments: one row and one column vector per matrix
        total = sum(4 * (p.shape[0] + p.shape[1]) if p.dim() == 2 else 4 * p.numel() for p in trainable)
        return total, "Adafactor: factored second moments"
    if "sgd" in optim or "lion" in optim:
        return sum(p.numel() * max(p.element_size(), 4) for p in trainable), f"{optim}: one state per parameter"
    return sum(2 * p.numel() * max(p.element_size(), 4) for p in trainable), "AdamW: two fp32 states per parameter"


def _plan_finding(plan) -> Finding:
    """The memory verdict of a plan: nothing fits (error), the run as it is does not fit (warning), or it fits."""
    budget = f"{format_bytes(plan.budget)} on the {plan.gpu.name}"
    if plan.chosen is None:
        return Finding("error", "memory_plan", f"no configuration fits in {budget} (batch {plan.batch} x "
                       f"{plan.seq_len} tokens)", plan.advice())
    current = next((r for r in plan.rows if r.current), None)
    if current is not None and not current.fits:
        return Finding("warning", "memory_plan", f"the run as it is ({current.describe()}) needs "
                       f"{format_bytes(current.peak)} of {budget}: it would run out of memory at its first step",
                       plan.advice())
    row = current or plan.chosen
    return Finding("info", "memory_plan", f"{row.describe()} needs {format_bytes(row.peak)} of {budget}",
                   plan.advice())


def _describe(module) -> str:
    import torch

    if isinstance(module, torch.nn.Linear):
        return f"Linear({module.in_features} -> {module.out_features})"
    if isinstance(module, torch.nn.Embedding):
        return f"Embedding({module.num_embeddings} x {module.embedding_dim})"
    return type(module).__name__


def _free_memory() -> tuple[int | None, int | None]:
    """(free host RAM, free GPU memory) without touching CUDA.

    Host RAM is measured as the gauges measure it: the container's limit less its working set,
    since the cgroup limit, not the VM's RAM, is what kills a Colab runtime.
    """
    from ..gauges.monitor import _Nvml, read_gpu, read_host

    ram = read_host()
    host = ram.limit - ram.used if ram.limit is not None and ram.used is not None else None
    gpu = None
    nvml = _Nvml()
    reading = read_gpu(nvml)
    nvml.close()
    if reading.total is not None:
        gpu = reading.total - reading.used
    return host, gpu


def _total_steps(args, train_dataset, num_training_steps) -> int | None:
    if num_training_steps:
        return int(num_training_steps)
    if args is None:
        return None
    if args.max_steps is not None and args.max_steps > 0:
        return int(args.max_steps)
    if train_dataset is None:
        return None
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * max(1, getattr(args, "world_size", 1))
    return math.ceil(args.num_train_epochs * math.ceil(len(train_dataset) / per_step))


def _checkpointing_starves_blocks(model, args) -> bool:
    """Frozen input embeddings + reentrant checkpointing: the blocks' inputs need no gradient, so
    the checkpointed blocks' parameters get none. transformers 5 defaults to non-reentrant and
    enables input gradients itself; 4.x did neither."""
    import transformers

    if not checkpointing_requested(model, args) or not hasattr(model, "get_input_embeddings"):
        return False
    embeddings = model.get_input_embeddings()
    if embeddings is None or any(p.requires_grad for p in embeddings.parameters()):
        return False
    if hasattr(model, "_require_grads_hook"):
        return False
    kwargs = (getattr(args, "activation_checkpointing_kwargs", None)
              or getattr(args, "gradient_checkpointing_kwargs", None) or {})
    v5 = int(transformers.__version__.split(".")[0]) >= 5
    reentrant = kwargs.get("use_reentrant", not v5)
    return reentrant and not v5


def preflight(model, training_args=None, tokenizer=None, *, train_dataset=None, num_training_steps: int | None = None,
              plan=None, verbose: bool = True) -> PreflightReport:
    """Check a model and its training arguments before training; allocates nothing.

    Reports the parameter count and the memory of weights, gradients and optimizer state, and
    flags: a layer over 1e9 parameters or over a quarter of free host RAM or GPU memory (by
    name), warm-up >= total steps, an Adam-family learning rate above 1e-2, a tokenizer longer
    than the embedding matrix, and trainable blocks that checkpointing would starve of gradients.

    Args:
        model: the model (on any device, `meta` included).
        training_args: the `TrainingArguments` to be used.
        tokenizer: its tokenizer.
        train_dataset: to know the total steps when `max_steps` is not set.
        num_training_steps: the total steps, when known (taken before `max_steps` and the dataset).
        plan: a memory plan (`ck.plan_memory`); default: the last one made for this model. With a plan,
            the memory verdict is the plan's (activations included) instead of a count of the training state.
        verbose: print the report.

    Returns:
        A `PreflightReport`; `report.ok` is False when there is an error or a warning.
    """
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    weights = sum(p.numel() * p.element_size() for p in params)
    gradients = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    optim = getattr(training_args, "optim", None) or "adamw_torch"
    optim = str(getattr(optim, "value", optim))  # an OptimizerNames enum in TrainingArguments
    optimizer, optimizer_note = _optimizer_bytes(optim, params)
    memory = {"weights": weights, "gradients": gradients, "optimizer": optimizer,
              "total": weights + gradients + optimizer}
    findings: list[Finding] = []

    free_host, free_gpu = _free_memory()
    import torch

    vocab_sizes = {m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    seen: set[int] = set()
    layers = []
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in own)
        count = sum(p.numel() for p in own)
        if count:
            state = sum(p.numel() * p.element_size() * (1 + (3 if p.requires_grad else 0)) for p in own)
            layers.append((name or "(model)", _describe(module), count, state, module))
    layers.sort(key=lambda row: -row[2])
    for name, description, count, state, module in layers:
        limits = [(free_host, "free host RAM"), (free_gpu, "free GPU memory")]
        too_big = [what for limit, what in limits if limit and state > LAYER_SHARE * limit]
        if count < HUGE_LAYER and not too_big:
            continue
        square = description.startswith("Linear(") and getattr(module, "in_features", 0) == getattr(module, "out_features", -1)
        hint = (" A vocabulary-to-vocabulary projection on top of the logits adds nothing the LM head does not "
                "already do." if square and module.in_features in vocab_sizes else "")
        findings.append(Finding(
            "error" if count >= HUGE_LAYER else "warning", "huge_layer",
            f"layer '{name}' is {description} with {count:,} parameters: {format_bytes(state)} of weights, "
            f"gradients and optimizer state" + (f", more than a quarter of the {' and '.join(too_big)}" if too_big else "")
            + "." + hint,
            f"remove '{name}' (AutoModelForCausalLM already has its LM head), or shrink it (a bottleneck "
            f"Linear(n, 256) -> Linear(256, n) has 512 * n parameters)"))

    steps = _total_steps(training_args, train_dataset, num_training_steps)
    if training_args is not None:
        lr = float(training_args.learning_rate)
        if any(k in optim.lower() for k in ("adam", "lion")) and lr > ADAM_MAX_LR:
            findings.append(Finding("warning", "learning_rate",
                                    f"learning rate {lr:g} with {optim}: fine-tuning with Adam uses 1e-5 to 5e-4 "
                                    f"(the Trainer's default is 5e-5); at {lr:g} the loss diverges",
                                    "TrainingArguments(learning_rate=5e-5) (up to 5e-4 for a small model from scratch)"))
        if steps is not None:
            warmup = training_args.get_warmup_steps(steps) if hasattr(training_args, "get_warmup_steps") else 0
            if warmup >= steps:
                findings.append(Finding("warning", "warmup",
                                        f"warm-up of {warmup:,} steps for a run of {steps:,} steps: the learning rate "
                                        f"never leaves the ramp (it reaches {steps / max(warmup, 1):.2%} of its peak)",
                                        f"warmup_steps=0.06 (6 % of the steps) or an int below {steps}"))
        else:
            findings.append(Finding("info", "steps_unknown", "the total number of steps is unknown, so the warm-up "
                                    "could not be checked", "pass train_dataset= or num_training_steps="))
    if _checkpointing_starves_blocks(model, training_args):
        findings.append(Finding("warning", "no_gradient",
                                "gradient checkpointing (reentrant) with frozen input embeddings: the checkpointed "
                                "blocks' trainable parameters get no gradient and do not train",
                                "model.enable_input_require_grads() before training, or "
                                f"{checkpointing_arg(kwargs=True)}={{'use_reentrant': False}}"))
    if tokenizer is not None and hasattr(model, "get_input_embeddings") and model.get_input_embeddings() is not None:
        rows = model.get_input_embeddings().num_embeddings
        if len(tokenizer) > rows:
            findings.append(Finding("error", "tokenizer_size",
                                    f"the tokenizer has {len(tokenizer):,} tokens but the embedding matrix {rows:,} rows: "
                                    f"ids from {rows:,} up crash the run (an index error on CPU, a device-side assert "
                                    f"on GPU)",
                                    "do not add tokens you do not need (text grouped into blocks needs no [PAD]), or "
                                    "model.resize_token_embeddings(len(tokenizer))"))
        elif len(tokenizer) < rows:
            findings.append(Finding("info", "tokenizer_size", f"the embedding matrix has {rows - len(tokenizer):,} more "
                                    f"rows than the tokenizer has tokens (padding for speed is normal)", "nothing to do"))
    from .plan import plan_for

    plan = plan if plan is not None else plan_for(model)
    if plan is not None:
        findings.append(_plan_finding(plan))
    elif free_gpu is not None and memory["total"] > free_gpu:
        findings.append(Finding("warning", "training_state",
                                f"weights, gradients and optimizer state ({format_bytes(memory['total'])}; "
                                f"{optimizer_note}) exceed the free GPU memory ({format_bytes(free_gpu)}) before any "
                                f"activation", "a smaller model, frozen layers, or optim='adamw_bnb_8bit' / 'adafactor'"))
    elif free_gpu is None and free_host is not None and memory["total"] > free_host:
        findings.append(Finding("warning", "training_state",
                                f"weights, gradients and optimizer state ({format_bytes(memory['total'])}) exceed the "
                                f"free host RAM ({format_bytes(free_host)})", "a smaller model or frozen layers"))
    report = PreflightReport(parameters=total, trainable=trainable, memory=memory,
                             largest_layers=[(n, d, c) for n, d, c, _, _ in layers[:5]], findings=findings)
    if verbose:
        print(report)
    return report
