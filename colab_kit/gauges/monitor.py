"""Readers of GPU, PyTorch, host and disk memory, and a 1 Hz sampler with a bounded history.

Everything here is safe to call from a background thread: NVML memory and utilisation
queries cost ~15 µs and psutil 12-60 µs (DESIGN.md §4); NVML *process* queries (~4.5 ms) are
avoided. The monitor never creates a CUDA context, never runs gc.collect() or
empty_cache(), and never resets PyTorch's peak statistics: it only looks.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..runtime import _first_visible_index, _visible_indices, host_ram_limit

__all__ = ["GpuReading", "TorchReading", "HostReading", "DiskReading", "Sample", "read_gpu", "read_torch",
           "read_host", "read_disk", "Sampler", "History"]


@dataclass(frozen=True)
class GpuReading:
    """What NVML says about the device (None = n/a)."""

    used: int | None = None
    total: int | None = None
    util: float | None = None  # percent
    temperature: float | None = None  # °C
    power: float | None = None  # W


@dataclass(frozen=True)
class TorchReading:
    """PyTorch's caching allocator, read only when the user's code already initialised CUDA."""

    allocated: int | None = None
    reserved: int | None = None
    peak_allocated: int | None = None


@dataclass(frozen=True)
class HostReading:
    rss: int | None = None
    peak_rss: int | None = None
    used: int | None = None  # by the whole container (cgroup) or machine
    limit: int | None = None  # min(MemTotal, cgroup limit): where the kernel dies


@dataclass(frozen=True)
class DiskReading:
    local_free: int | None = None
    drive_free: int | None = None


@dataclass(frozen=True)
class Sample:
    t: float
    gpu: GpuReading = field(default_factory=GpuReading)
    torch: TorchReading = field(default_factory=TorchReading)
    host: HostReading = field(default_factory=HostReading)
    disk: DiskReading = field(default_factory=DiskReading)
    others: tuple[GpuReading, ...] = ()  # the node's other GPUs (several processes, one per GPU)


class _Nvml:
    """One NVML session for the sampler's life (init once, handles, cheap queries).

    Args:
        all_gpus: also hold handles of the other visible GPUs (rank 0 of several processes shows them).
    """

    def __init__(self, all_gpus: bool = False):
        self.handle = None
        self.others: list = []
        try:
            import pynvml

            pynvml.nvmlInit()
            index = _first_visible_index()
            count = pynvml.nvmlDeviceGetCount()
            if index is not None and count > index:
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            if all_gpus:
                self.others = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in _visible_indices(count) if i != index]
            self.nvml = pynvml
        except Exception:  # no library, no driver, no GPU: every GPU field is n/a
            self.nvml = None

    def close(self) -> None:
        if self.nvml is not None:
            try:
                self.nvml.nvmlShutdown()
            except Exception:
                pass


def _try(fn, default=None):
    try:
        return fn()
    except Exception:
        return default


def read_gpu(nvml: _Nvml, handle=None) -> GpuReading:
    h = handle if handle is not None else nvml.handle
    if nvml.nvml is None or h is None:
        return GpuReading()
    n = nvml.nvml
    memory = _try(lambda: n.nvmlDeviceGetMemoryInfo(h))
    return GpuReading(
        used=int(memory.used) if memory is not None else None,
        total=int(memory.total) if memory is not None else None,
        util=_try(lambda: float(n.nvmlDeviceGetUtilizationRates(h).gpu)),
        temperature=_try(lambda: float(n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU))),
        power=_try(lambda: n.nvmlDeviceGetPowerUsage(h) / 1000.0),
    )


def read_torch() -> TorchReading:
    torch = sys.modules.get("torch")
    if torch is None or not _try(torch.cuda.is_initialized, False):
        return TorchReading()  # asking would create a CUDA context of ~300 MB
    return TorchReading(allocated=_try(torch.cuda.memory_allocated), reserved=_try(torch.cuda.memory_reserved),
                        peak_allocated=_try(torch.cuda.max_memory_allocated))


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_working_set(root: Path) -> int | None:
    """Container memory in use minus inactive file cache (reclaimable, so it kills nobody):
    the number the kernel's OOM killer acts on, as `docker stats` and the kubelet compute it."""
    for usage, stat, key in ((root / "memory.current", root / "memory.stat", "inactive_file"),
                             (root / "memory" / "memory.usage_in_bytes", root / "memory" / "memory.stat",
                              "total_inactive_file")):
        try:
            used = int(usage.read_text().strip())
        except (OSError, ValueError):
            continue
        return max(0, used - _stat_value(stat, key))
    return None


def read_host(meminfo: Path = Path("/proc/meminfo"), cgroup_root: Path = Path("/sys/fs/cgroup"),
              limit: int | None = None) -> HostReading:
    """Process RSS and peak RSS; memory used by the container (cgroup) or machine, and its limit."""
    rss = peak = used = None
    try:
        import psutil

        rss = psutil.Process().memory_info().rss
        vm = psutil.virtual_memory()
        used = vm.total - vm.available
    except Exception:
        pass
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    except Exception:
        pass
    container = _cgroup_working_set(cgroup_root)
    if container is not None:
        used = container
    if limit is None:
        limit = host_ram_limit(meminfo, cgroup_root)
    return HostReading(rss=rss, peak_rss=peak, used=used, limit=limit)


def read_disk(local: Path | None, drive: Path | None) -> DiskReading:
    def free(path):
        return _try(lambda: shutil.disk_usage(path).free) if path is not None else None

    return DiskReading(local_free=free(local), drive_free=free(drive))


class History:
    """A bounded record of samples: when full, every other old sample is dropped, so the whole
    run stays covered at a coarser resolution. Peaks are kept exactly, apart from the samples."""

    def __init__(self, capacity: int = 2048):
        self.capacity = max(16, capacity)
        self.samples: list[Sample] = []
        self.losses: list[tuple[float, int, float]] = []  # (time, step, loss)
        self.peaks: dict[str, float] = {}

    def add(self, sample: Sample) -> None:
        self.samples.append(sample)
        if len(self.samples) > self.capacity:
            self.samples = self.samples[::2]
        for key, value in (("gpu_used", sample.gpu.used), ("gpu_util", sample.gpu.util),
                           ("reserved", sample.torch.reserved), ("peak_allocated", sample.torch.peak_allocated),
                           ("rss", sample.host.rss), ("peak_rss", sample.host.peak_rss),
                           ("host_used", sample.host.used)):
            if value is not None and value > self.peaks.get(key, float("-inf")):
                self.peaks[key] = value

    def add_loss(self, t: float, step: int, loss: float) -> None:
        self.losses.append((t, step, loss))
        if len(self.losses) > self.capacity:
            self.losses = self.losses[::2]


class Sampler:
    """Reads everything about once a second in a daemon thread and feeds a `History`.

    Args:
        on_sample: called in the sampler thread after each sample (must not print or display).
        interval: seconds between samples.
        disk_paths: (local, drive) folders whose free space is read every `disk_every` seconds.
        all_gpus: read the node's other visible GPUs too (`Sample.others`).
    """

    def __init__(self, history: History, *, on_sample: Callable[[Sample], None] | None = None,
                 interval: float = 1.0, disk_paths: tuple[Path | None, Path | None] = (None, None),
                 disk_every: float = 30.0, all_gpus: bool = False):
        self.history = history
        self.on_sample = on_sample
        self.interval = interval
        self.disk_paths = disk_paths
        self.disk_every = disk_every
        self.all_gpus = all_gpus
        self._limit = host_ram_limit()
        self._disk = DiskReading()
        self._disk_at = 0.0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._nvml: _Nvml | None = None
        self._thread: threading.Thread | None = None
        self._disk_reader: threading.Thread | None = None

    def sample(self) -> Sample:
        """Take one sample now (also usable without the thread)."""
        with self._lock:
            if self._nvml is None:
                self._nvml = _Nvml(self.all_gpus)
            now = time.time()
            if now - self._disk_at >= self.disk_every:
                self._disk_at = now
                self._read_disk_aside()
            sample = Sample(t=now, gpu=read_gpu(self._nvml), torch=read_torch(),
                            host=read_host(limit=self._limit), disk=self._disk,
                            others=tuple(read_gpu(self._nvml, h) for h in self._nvml.others))
            self.history.add(sample)
            return sample

    def _read_disk_aside(self) -> None:
        """Free space, read in a thread of its own: statvfs on a stalled Drive mount hangs, and must
        hang neither the sampler nor anyone waiting for its lock. One read at a time."""
        if self._disk_reader is not None and self._disk_reader.is_alive():
            return

        def read():
            self._disk = read_disk(*self.disk_paths)

        self._disk_reader = threading.Thread(target=read, name="colab_kit-disk", daemon=True)
        self._disk_reader.start()

    def start(self) -> None:
        def loop():
            while not self._stop.is_set():
                sample = self.sample()
                if self.on_sample is not None:
                    try:
                        self.on_sample(sample)
                    except Exception:  # a view problem must not kill the sampler
                        pass
                self._stop.wait(self.interval)

        self._thread = threading.Thread(target=loop, name="colab_kit-gauges", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop sampling; waits at most `timeout` seconds for the thread (a daemon: one stuck in a
        hung read is left behind rather than waited for)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
        if not self._lock.acquire(timeout=timeout):
            return
        try:
            if self._nvml is not None:
                self._nvml.close()
                self._nvml = None
        finally:
            self._lock.release()
