"""colab_kit: fine-tune transformers in Google Colab without losing work.

    import colab_kit as ck
    run = ck.start_run("rna-bert", save_every="10min", keep=3)
    run.train(trainer)

`import colab_kit` needs no GPU, no ipywidgets and no google.colab; the parts that need
transformers or torch import them when used.
"""

from .errors import (CheckpointError, ColabKitError, ColabKitWarning, DriveError, LeaseHeldError,
                     ResumeMismatchError)
from .gauges import Gauges, plot_history
from .journal import read_events
from .preflight import preflight
from .oom import MicroBatcher, OutOfMemoryError, free_memory, is_oom_error
from .oom import configure_allocator as _configure_allocator
from .recipes import memory_args
from .run import Run
from .start import start_run
from .drivecheck import drive_check
from .runtime import detect_runtime, in_colab, in_notebook
from .store import CheckpointStore

__version__ = "0.1.0"

# Before anything creates a CUDA context: expandable segments fragment GPU memory less.
_configure_allocator()

__all__ = [
    "start_run",
    "Run",
    "CheckpointStore",
    "drive_check",
    "is_oom_error",
    "free_memory",
    "MicroBatcher",
    "OutOfMemoryError",
    "Gauges",
    "plot_history",
    "memory_args",
    "preflight",
    "read_events",
    "detect_runtime",
    "in_colab",
    "in_notebook",
    "ColabKitError",
    "ColabKitWarning",
    "DriveError",
    "LeaseHeldError",
    "ResumeMismatchError",
    "CheckpointError",
]
