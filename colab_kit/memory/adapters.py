"""What the kit needs to know of a peft adapter model (LoRA, QLoRA), in one place: whether a model is one,
how many weights its frozen base stands for (4-bit weights counted by the shape they stand for, not their
packed bytes), and what merging the adapter into a 16-bit copy of the base costs in host RAM."""

from __future__ import annotations

__all__ = ["is_adapter_model", "base_elements", "export_dtype", "merged_bytes"]


def is_adapter_model(model) -> bool:
    """A peft model (an adapter on a frozen base)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _elements(module_or_param) -> int:
    state = getattr(module_or_param, "quant_state", None)
    shape = getattr(state, "shape", None)
    if shape is not None:  # a 4-bit bitsandbytes weight: two weights a byte, its shape in the state
        n = 1
        for size in shape:
            n *= int(size)
        return n
    return module_or_param.numel()


def base_elements(model) -> int:
    """The number of weights of the model without its adapter (the frozen base, as it would be merged)."""
    own = {id(p): p for name, p in model.named_parameters()
           if "lora_" not in name and ".modules_to_save." not in name}
    return sum(_elements(p) for p in own.values())


def export_dtype(model):
    """The precision a merged copy is written in: a 4-bit model's compute dtype, else the base's own."""
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    quantization = getattr(getattr(base, "config", None), "quantization_config", None)
    if quantization is not None:
        wanted = (quantization.get("bnb_4bit_compute_dtype") if isinstance(quantization, dict)
                  else getattr(quantization, "bnb_4bit_compute_dtype", None))
        if isinstance(wanted, str):
            wanted = getattr(torch, wanted.replace("torch.", ""), None)
        return wanted or torch.float16
    return next((p.dtype for p in base.parameters() if p.is_floating_point()), torch.float32)


def merged_bytes(model) -> int:
    """The merged model's size: the base's weights at the export precision."""
    import torch

    return base_elements(model) * torch.empty((), dtype=export_dtype(model)).element_size()
