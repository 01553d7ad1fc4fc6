"""What the notebooks' presets share: "full" (the real model and data, meant for a GPU) and "quick" (a
tiny model on data made on the spot, minutes on a CPU), and the check that "full" has a GPU."""

from __future__ import annotations

from ..runtime import GpuInfo, require_gpu

__all__ = ["preset_values"]


def preset_values(preset: str, presets: dict[str, dict], *, allow_cpu: bool, cpu_time: str,
                  gpu: GpuInfo | None = None) -> dict:
    """The values of `preset` in `presets`, once `full` is known to have a GPU (or `allow_cpu`).

    Raises:
        ValueError: an unknown preset. ColabKitError: `full` without a GPU, unless `allow_cpu`.
    """
    if preset not in presets:
        raise ValueError(f"PRESET={preset!r}: use {' or '.join(repr(p) for p in presets)}")
    if preset == "full":  # stop within seconds on a runtime without a GPU, unless told otherwise
        require_gpu('PRESET = "full"', allow_cpu=allow_cpu, cpu_time=cpu_time, gpu=gpu)
    return dict(presets[preset])
