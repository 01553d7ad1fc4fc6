"""The merged model of a LoRA run: the adapter folded into a 16-bit (or the base's own precision) copy of
the base model, written beside the adapter in the export (`run.save_final(..., merged=True)`).

Merging is where LoRA runs in Colab lose the kernel: the merged copy lives in host RAM (12.7 GB on the
free tier), and `merge_and_unload()` on a 4-bit model dequantizes, merges and quantizes again (rounding
the result). So the merge here asks first: it needs the base's parameters at the export precision, plus a
margin, *available* in host RAM, and says the numbers and what to do instead when they are not there. A
quantized or GPU-resident base is loaded again on the CPU at the export precision, the adapter the export
just wrote loaded onto it, then merged; a base already in host RAM is copied and merged (the model
being trained is never changed).
"""

from __future__ import annotations

import copy
from pathlib import Path

from .._units import format_bytes
from ..errors import ColabKitError
from ..memory.adapters import has_four_bit_weights, merged_bytes

__all__ = ["available_ram", "check_host_ram", "save_merged", "MERGED"]

MERGED = "merged"  # the merged model's folder inside final/
_MARGIN = 1.2  # the copy, then safetensors' write buffers and the allocator's slack
_SPARE = 512 * 2**20  # what the kernel and Python need besides


def available_ram() -> int:
    """Host RAM this runtime can still take: its container's limit less what it uses (Colab's VM reports the
    machine's RAM to psutil, the container's limit is the truth), else what psutil says is available."""
    import psutil

    from ..gauges.monitor import read_host

    reading = read_host()
    if reading.limit and reading.used is not None:
        return max(reading.limit - reading.used, 0)
    return psutil.virtual_memory().available


def check_host_ram(model, available: int | None = None) -> int:
    """Stop before a merge that would exhaust host RAM. Returns the merged model's bytes.

    Raises:
        ColabKitError: the bytes it needs and the bytes available, and what to do instead.
    """
    need = merged_bytes(model)
    available = available_ram() if available is None else available
    copies = 2 if _on_gpu(model) and not has_four_bit_weights(model) else 1  # the model itself comes to the CPU too
    wanted = int(copies * need * _MARGIN) + _SPARE
    if available < wanted:
        raise ColabKitError(
            f"merging the adapter into the base model needs about {format_bytes(wanted)} of host RAM (the merged "
            f"model is {format_bytes(need)}), and {format_bytes(available)} is available, so it was not merged. "
            f"The adapter alone is exported (it loads onto the base model with peft's PeftModel.from_pretrained). "
            f"Merge later on a runtime with more RAM (Runtime -> Change runtime type -> High-RAM), or free RAM "
            f"first: del trainer, model; ck.free_memory()")
    return need


def save_merged(model, folder: Path, adapter_dir: Path) -> int:
    """Write the merged model to `folder` (safetensors, config). `adapter_dir`: where the export wrote
    the adapter (loaded onto a base read again from its own files when the trained base cannot be copied).
    Returns the merged model's bytes.

    Raises:
        ColabKitError: not enough host RAM (nothing merged), or a base that cannot be read again.
    """
    need = check_host_ram(model)
    merged = _merged_copy(model, adapter_dir)
    merged.save_pretrained(folder, safe_serialization=True)
    del merged
    return need


def _on_gpu(model) -> bool:
    return any(p.device.type != "cpu" for p in model.parameters())


def _merged_copy(model, adapter_dir: Path):
    """The merged model on the CPU, leaving `model` as it was (where it was)."""
    import torch

    if not has_four_bit_weights(model):
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        try:  # host RAM was checked for the copy; the GPU is not asked for a second model
            return copy.deepcopy(model.to("cpu")).merge_and_unload()
        finally:
            model.to(device)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    source = next(iter(model.peft_config.values())).base_model_name_or_path
    if not source:
        raise ColabKitError("the 4-bit base model's name is not recorded in the adapter's config, so it cannot be "
                            "loaded again at 16 bits for the merge; the adapter alone is exported")
    # 4-bit weights merge with rounding: the base is read again from its files, in the dtype they hold.
    fresh = AutoModelForCausalLM.from_pretrained(source, dtype="auto", device_map={"": "cpu"},
                                                 low_cpu_mem_usage=True)
    return PeftModel.from_pretrained(fresh, str(adapter_dir)).merge_and_unload()
