"""The GPUs a memory plan is made for: what PyTorch can use on each, and what each runs fast.

Capacities are the totals PyTorch prints in its own out-of-memory messages on these GPUs ("GPU 0
has a total capacity of 14.75 GiB" on a T4, 22.03 GiB on an L4, 39.59 GiB on an A100 40 GB); the
CUDA context and the kernels loaded with it live outside PyTorch's allocator, and the same messages
put them at about 0.26 GiB on an L4 (22.03 total, 21.72 reserved by PyTorch, 0.05 free). Throughputs
are NVIDIA's datasheet figures for dense math (fp32 without TF32, which PyTorch leaves off for
matrix products; fp16/bf16 on tensor cores); a plan uses them to rank configurations, never as a
stopwatch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GpuTarget", "TARGETS", "resolve_target"]

GiB = 1 << 30


@dataclass(frozen=True)
class GpuTarget:
    name: str
    capacity: int  # bytes: the total PyTorch reports
    context: int  # bytes outside PyTorch's allocator: the CUDA context, cuBLAS/cuDNN kernels
    fp16: bool
    bf16: bool
    flash_attention: bool  # FlashAttention-2 kernels (sm80 and newer); a T4 runs the memory-efficient kernel
    tflops: dict  # {"fp32": ..., "fp16": ..., "bf16": ...} dense, from the datasheet

    @property
    def usable(self) -> int:
        """What PyTorch's allocator can hold."""
        return self.capacity - self.context

    def precisions(self) -> list[str]:
        """fp32, and the half precision autocast would use here (bf16 where the GPU has it)."""
        return ["fp32"] + (["bf16"] if self.bf16 else ["fp16"] if self.fp16 else [])


TARGETS = {
    "T4": GpuTarget("T4", int(14.75 * GiB), int(0.30 * GiB), fp16=True, bf16=False, flash_attention=False,
                    tflops={"fp32": 8.1, "fp16": 65.0}),
    "L4": GpuTarget("L4", int(22.03 * GiB), int(0.30 * GiB), fp16=True, bf16=True, flash_attention=True,
                    tflops={"fp32": 30.3, "fp16": 121.0, "bf16": 121.0}),
    "A100-40GB": GpuTarget("A100-40GB", int(39.59 * GiB), int(0.40 * GiB), fp16=True, bf16=True,
                           flash_attention=True, tflops={"fp32": 19.5, "fp16": 312.0, "bf16": 312.0}),
}
_ALIASES = {"TESLA T4": "T4", "NVIDIA L4": "L4", "A100": "A100-40GB", "A100-SXM4-40GB": "A100-40GB",
            "NVIDIA A100-SXM4-40GB": "A100-40GB", "A100-PCIE-40GB": "A100-40GB"}


def resolve_target(gpu) -> tuple[GpuTarget, str]:
    """A `GpuTarget` and a line saying where it came from, for `gpu` given as a name ("T4", "L4",
    "A100-40GB"), "auto" (the GPU attached; a T4, Colab's free GPU, when there is none), a byte count,
    or a `GpuTarget`."""
    if isinstance(gpu, GpuTarget):
        return gpu, f"{gpu.name} as given"
    if isinstance(gpu, bool) or gpu is None:
        raise ValueError(f"gpu={gpu!r}: give 'T4', 'L4', 'A100-40GB', 'auto' or the GPU's memory in bytes")
    if isinstance(gpu, int):
        if gpu <= 0:
            raise ValueError(f"gpu={gpu}: the GPU's memory in bytes must be positive")
        t4 = TARGETS["T4"]
        return (GpuTarget(f"{gpu / GiB:.2f} GiB GPU", gpu, t4.context, True, False, False, t4.tflops),
                "a GPU of the memory given; speeds and precisions as a T4's")
    name = str(gpu).strip()
    if name.lower() == "auto":
        return _attached()
    key = _ALIASES.get(name.upper(), name.upper())
    for known in TARGETS:
        if known.upper() == key:
            return TARGETS[known], f"{known} as asked"
    names = ", ".join(repr(t) for t in TARGETS)
    raise ValueError(f"gpu={gpu!r} is not one this kit knows: give one of {names}, 'auto', or the GPU's memory "
                     f"in bytes (e.g. gpu=16 * 2**30)")


def _attached() -> tuple[GpuTarget, str]:
    from ..runtime import gpu_info

    info = gpu_info()
    if info is None:
        return TARGETS["T4"], "no GPU is attached: planned for a T4, the GPU Colab's free tier gives"
    name = info.name.upper()
    for alias, known in _ALIASES.items():
        if alias in name:
            return _measured(TARGETS[known], info), f"the attached {info.name}"
    for known in TARGETS:
        if known.split("-")[0] in name:
            return _measured(TARGETS[known], info), f"the attached {info.name}"
    base = TARGETS["L4"] if info.bf16 else TARGETS["T4"]
    return (GpuTarget(info.name, int(info.total_bytes * 0.983), base.context, True, info.bf16, info.bf16, base.tflops),
            f"the attached {info.name} (speeds taken as an {base.name}'s)")


def _measured(target: GpuTarget, info) -> GpuTarget:
    """The known GPU with the capacity this one has. NVML counts what the driver keeps (a T4's 15.0 GiB
    against PyTorch's 14.75): a total within 5 % of the known one is that GPU; another (an 80 GB A100,
    a MIG slice) gets its NVML total less the same 1.7 %."""
    total = getattr(info, "total_bytes", None)
    if not total or abs(total - target.capacity) <= 0.05 * target.capacity:
        return target
    return GpuTarget(info.name, int(total * 0.983), target.context, target.fp16, target.bf16,
                     target.flash_attention, target.tflops)
