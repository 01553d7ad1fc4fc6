"""Where are we running? Colab or not, notebook or not, which GPU, how much host RAM.

Everything here is cheap and side-effect free: no CUDA context is created when NVML can
answer, and nothing is imported that a laptop without a GPU lacks.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ._units import format_bytes

__all__ = ["KIT_VERSION", "GpuInfo", "RuntimeInfo", "in_colab", "in_kaggle", "in_notebook", "gpu_info", "host_ram_limit", "detect_runtime",
           "require_gpu", "library_versions"]



def _kit_version() -> str:
    """The installed kit's version (pyproject.toml is the one place it is kept)."""
    try:
        return version("colab-kit")
    except PackageNotFoundError:  # a source checkout that was never installed
        return "0+unknown"


KIT_VERSION = _kit_version()  # recorded in every manifest
# cgroup v1/v2 report "no limit" as a huge number close to 2**63.
_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class GpuInfo:
    """The first visible GPU."""

    name: str
    total_bytes: int
    compute_capability: tuple[int, int]

    @property
    def bf16(self) -> bool:
        """bf16 needs Ampere (compute capability 8.0) or newer; a T4 is 7.5."""
        return self.compute_capability >= (8, 0)


@dataclass(frozen=True)
class RuntimeInfo:
    """A snapshot of the runtime, printed once by `start_run`."""

    colab: bool
    notebook: bool
    gpu: GpuInfo | None
    ram_limit_bytes: int | None
    kaggle: bool = False

    def describe(self) -> str:
        where = "Google Colab" if self.colab else "Kaggle" if self.kaggle else "local machine"
        where += ", notebook" if self.notebook else ", script"
        if self.gpu is None:
            gpu = "none (CPU only)"
        else:
            cc = ".".join(map(str, self.gpu.compute_capability))
            gpu = (f"{self.gpu.name}, {format_bytes(self.gpu.total_bytes)}, compute {cc}, "
                   f"bf16 {'yes' if self.gpu.bf16 else 'no (use fp16)'}")
        return f"runtime: {where}\nGPU: {gpu}\nhost RAM limit: {format_bytes(self.ram_limit_bytes)}"


def in_colab() -> bool:
    """True inside a Google Colab runtime."""
    # Colab's kernel imports google.colab at start and sets COLAB_RELEASE_TAG; either is enough.
    return "google.colab" in sys.modules or bool(os.environ.get("COLAB_RELEASE_TAG"))


def in_kaggle() -> bool:
    """True inside a Kaggle notebook (interactive or a committed "Save Version" run)."""
    # Kaggle sets KAGGLE_KERNEL_RUN_TYPE ("Interactive" or "Batch") in every kernel it starts.
    return bool(os.environ.get("KAGGLE_KERNEL_RUN_TYPE"))


def in_notebook() -> bool:
    """True when running in a Jupyter/Colab kernel (not a plain script or terminal IPython)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def _first_visible_index() -> int | None:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return 0
    first = visible.split(",")[0].strip()
    if first in ("", "-1"):
        return None
    return int(first) if first.isdigit() else 0


def _visible_indices(count: int) -> list[int]:
    """NVML indices of the GPUs this process may use (CUDA_VISIBLE_DEVICES, else all of them)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(count))
    indices = []
    for part in visible.split(","):
        part = part.strip()
        if not part.isdigit():  # "-1", or UUIDs (not mapped here): stop, as CUDA does at an invalid entry
            break
        if int(part) < count:
            indices.append(int(part))
    return indices


def _gpu_from_nvml() -> GpuInfo | None:
    import pynvml  # nvidia-ml-py; raises ImportError where absent

    pynvml.nvmlInit()
    try:
        index = _first_visible_index()
        if index is None or pynvml.nvmlDeviceGetCount() <= index:
            return None
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(handle)
        if isinstance(name, bytes):  # older bindings return bytes
            name = name.decode()
        total = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        return GpuInfo(name=name, total_bytes=total, compute_capability=(int(major), int(minor)))
    finally:
        pynvml.nvmlShutdown()


def _gpu_from_torch() -> GpuInfo | None:
    torch = sys.modules.get("torch")
    # Only ask PyTorch when the user's code already initialised CUDA: asking it ourselves would
    # create a CUDA context (~300 MB of GPU memory) just to print a name.
    if torch is None or not torch.cuda.is_initialized():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return GpuInfo(name=props.name, total_bytes=int(props.total_memory),
                   compute_capability=(int(props.major), int(props.minor)))


def gpu_info() -> GpuInfo | None:
    """The first visible GPU, from NVML (no CUDA context), else from an initialised PyTorch."""
    try:
        return _gpu_from_nvml()
    except Exception:  # no NVML library, no driver, no device: all mean "ask elsewhere"
        return _gpu_from_torch()


_LIBRARIES = ("torch", "transformers", "peft", "accelerate", "trl", "safetensors")
_versions: dict[str, str] | None = None


def library_versions() -> dict[str, str]:
    """What a checkpoint is written with: Python, the libraries that read it back, CUDA and the GPU (recorded in
    every manifest; a resume under others says what changed, `lifecycle/drift.py`). Read once a process (a package
    upgraded under a running kernel is not the one it runs anyway); CUDA's, from the torch it has imported."""
    global _versions
    if _versions is None:
        found = {"python": platform.python_version()}
        for name in _LIBRARIES:
            try:
                found[name] = version(name)
            except PackageNotFoundError:
                pass
        gpu = gpu_info()
        found["gpu"] = gpu.name if gpu is not None else "none"
        _versions = found
    found = dict(_versions)
    cuda = getattr(getattr(sys.modules.get("torch"), "version", None), "cuda", None)
    if cuda:
        found["cuda"] = str(cuda)
    return found


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _UNLIMITED else value


def _meminfo_total(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # the file is in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def host_ram_limit(meminfo: Path = Path("/proc/meminfo"),
                   cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The RAM this container may really use: min(MemTotal, cgroup v2 or v1 memory limit).

    Colab's monitor shows the VM's RAM, while the container is killed at its cgroup limit;
    this is the number that predicts the crash. None when nothing can be read (not Linux).
    """
    limits = [
        _meminfo_total(meminfo),
        _read_int(cgroup_root / "memory.max"),  # cgroup v2
        _read_int(cgroup_root / "memory" / "memory.limit_in_bytes"),  # cgroup v1
    ]
    known = [v for v in limits if v]
    if not known:
        try:
            import psutil

            return int(psutil.virtual_memory().total)
        except Exception:
            return None
    return min(known)


def detect_runtime() -> RuntimeInfo:
    """Everything above in one snapshot."""
    return RuntimeInfo(colab=in_colab(), notebook=in_notebook(), gpu=gpu_info(),
                       ram_limit_bytes=host_ram_limit(), kaggle=in_kaggle())


def require_gpu(what: str, *, allow_cpu: bool = False, cpu_time: str = "", gpu: GpuInfo | None = None) -> None:
    """Stop at once when `what` (a GPU-sized preset) would run on a runtime without a GPU.

    A notebook's `full` preset on a CPU-only runtime runs for days; failing in its first cell
    says how to get a GPU instead. `allow_cpu=True` (the notebooks' ALLOW_CPU) lets it run.

    Raises:
        ColabKitError: no GPU and not `allow_cpu`, with the ways forward.
    """
    from .errors import ColabKitError

    if allow_cpu or (gpu or gpu_info()) is not None:
        return
    raise ColabKitError(
        f"{what} needs a GPU, and this runtime has none" + (f": on a CPU it would take {cpu_time}" if cpu_time else "")
        + ". In Colab: Runtime -> Change runtime type -> Hardware accelerator: T4 GPU -> Save, then Runtime -> "
        "Run all. Or set PRESET = \"quick\" (minutes on a CPU), or ALLOW_CPU = True to run it on the CPU anyway")
