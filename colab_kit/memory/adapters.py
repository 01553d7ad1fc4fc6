"""What the kit needs to know of a peft adapter model (LoRA, QLoRA), in one place: whether a model is one,
how many weights its frozen base stands for (4-bit weights counted by the shape they stand for, not their
packed bytes), what merging the adapter into a 16-bit copy of the base costs in host RAM, and what a
`CheckpointStore` checkpoint of it holds (the trainable tensors, and a fingerprint of the frozen base)."""

from __future__ import annotations

__all__ = ["is_adapter_model", "has_four_bit_weights", "base_elements", "export_dtype", "merged_bytes", "trainable_state", "base_fingerprint"]


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


def has_four_bit_weights(model) -> bool:
    """Are some of the base's weights bitsandbytes 4-bit ones (each with its quantization state)?"""
    return any(getattr(p, "quant_state", None) is not None for p in model.parameters())


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


_SAMPLED = 4096  # values read from each frozen tensor for its fingerprint


def trainable_state(model) -> dict:
    """The trainable tensors by name (an adapter's weights, and any layer peft trains whole): what an adapter
    checkpoint holds."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def base_fingerprint(model) -> str:
    """A fingerprint of the frozen weights an adapter was trained on: every frozen tensor's name, shape and
    dtype, and 4,096 of its values read evenly through it (4-bit weights as their packed bytes). Another base
    model, another quantization or other weights under the same names give another fingerprint; it costs a
    few milliseconds, not a read of every weight."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        if p.requires_grad:
            continue
        flat = p.data.reshape(-1)
        digest.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
        if flat.numel():
            picks = torch.linspace(0, flat.numel() - 1, min(flat.numel(), _SAMPLED), device=flat.device).long()
            digest.update(flat[picks].contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]
