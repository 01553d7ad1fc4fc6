"""colab_kit: fine-tune transformers in Google Colab without losing work.

    import colab_kit as ck
    run = ck.start_run("rna-bert", save_every="10min", keep=3)
    run.train(trainer)

`import colab_kit` needs no GPU, no ipywidgets and no google.colab; the parts that need
transformers or torch import them when used. The subpackages are layers, each importing only
from those below it (pyproject.toml's import-linter contract; docs/architecture.md):

    __main__ (the command line)  >  tasks (what the notebooks do)  >  run  >  drive | memory  >
    gauges  >  distributed  >  checkpoints  >  the base: _notices, runtime, _units, errors
"""

import sys as _sys

from .checkpoints.journal import read_events
from .drive.drivecheck import drive_check
from .drive.driveapi import DriveApi
from .errors import (CheckpointError, ColabKitError, ColabKitWarning, DriveError, LeaseHeldError, LeaseLostError,
                     RankFailedError, ResumeMismatchError, TimeLimitReached)
from .gauges.gauges import Gauges, plot_history
from .memory import recipes  # noqa: F401  (ck.recipes.freeze_layers, as notebooks before 0.3 call it)
from .memory.oom import OutOfMemoryError, free_memory, is_oom_error
from .memory.splitstep import MicroBatcher
from .memory.oom import configure_allocator as _configure_allocator
from .memory.plan import MemoryPlan, plan_memory
from .memory.preflight import preflight
from .memory.recipes import memory_args
from .run.run import Run
from .run.start import start_run
from .loop.store import CheckpointStore
from .runtime import KIT_VERSION as __version__  # noqa: F401
from .runtime import detect_runtime, in_colab, in_kaggle, in_notebook
from .tasks import lora, rna, text, versions

# Module paths that notebooks saved before the kit had subpackages import (`from colab_kit.versions
# import ...` in the RNA notebook's install cell, `from colab_kit.rna import ...`): kept working.
for _name, _module in {"lora": lora, "rna": rna, "text": text, "versions": versions}.items():
    _sys.modules.setdefault(f"{__name__}.{_name}", _module)
del _name, _module

# Before anything creates a CUDA context: expandable segments fragment GPU memory less.
_configure_allocator()

__all__ = [
    "start_run",
    "Run",
    "CheckpointStore",
    "drive_check",
    "DriveApi",
    "is_oom_error",
    "free_memory",
    "MicroBatcher",
    "OutOfMemoryError",
    "Gauges",
    "plot_history",
    "memory_args",
    "preflight",
    "plan_memory",
    "MemoryPlan",
    "read_events",
    "detect_runtime",
    "in_colab",
    "in_kaggle",
    "in_notebook",
    "ColabKitError",
    "ColabKitWarning",
    "DriveError",
    "LeaseHeldError",
    "LeaseLostError",
    "ResumeMismatchError",
    "CheckpointError",
    "RankFailedError",
    "TimeLimitReached",
]
