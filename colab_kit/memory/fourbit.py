"""4-bit weights (QLoRA's bitsandbytes NF4) in the memory plan: a stand-in layer that holds what a 4-bit
layer holds and allocates what it allocates, so that the plan's trace of the user's step counts it.

A bitsandbytes `Linear4bit` keeps its weight packed two to a byte, plus its quantization state: one
absmax per block of 64 weights (with double quantization, itself quantized to 8 bits, with one float32
absmax per 256 of those), and small code tables. For a training step (more than 1,536 rows a batch on a
GPU, and always on the CPU) its matmul dequantizes the whole weight into a temporary of the compute
dtype, multiplies, and frees it; the backward pass dequantizes it again for the input's gradient, and
the weight takes no gradient. Its input is cast to the compute dtype and its output back to the
input's dtype. The stand-in does exactly these allocations on fake tensors (bitsandbytes 0.50's
`MatMul4Bit`, `gemm_4bit`'s dequantize-then-linear path, read 2026-12-04).

The same stand-in plans a model that is not quantized yet (`plan_memory(..., four_bit=True)` on a model
built on the `meta` device): the sizes are then computed as bitsandbytes computes them.
"""

from __future__ import annotations

import functools
import math

__all__ = ["is_four_bit", "four_bit_sizes", "stand_in", "replace_linear", "quantizable", "BLOCK", "NESTED_BLOCK"]

BLOCK = 64  # weights per absmax (bitsandbytes' default blocksize for 4-bit)
NESTED_BLOCK = 256  # absmax values per float32 absmax under double quantization
_CODE = 256  # float32 entries in an 8-bit code table (the nested absmax's)


def is_four_bit(module) -> bool:
    """A bitsandbytes 4-bit linear layer whose weight is quantized (not peft's adapter around one, which has
    the same class name)."""
    kind = type(module)
    return kind.__name__ == "Linear4bit" and kind.__module__.startswith("bitsandbytes") \
        and getattr(getattr(module, "weight", None), "quant_state", None) is not None


def quantizable(name: str, module, skip=("lm_head",)) -> bool:
    """A layer transformers' bitsandbytes integration would quantize: every `nn.Linear` but the output head
    (and not a peft adapter's own layers, which stay in their dtype)."""
    import torch

    parts = name.split(".")
    return (isinstance(module, torch.nn.Linear) and not any(p in skip for p in parts)
            and not any(p.startswith("lora_") or p == "modules_to_save" for p in parts))


def four_bit_sizes(out_features: int, in_features: int, double_quant: bool = True) -> dict:
    """name -> (elements, dtype name) of what bitsandbytes keeps for one 4-bit weight."""
    n = out_features * in_features
    blocks = math.ceil(n / BLOCK)
    sizes = {"weight": ((n + 1) // 2, "uint8")}
    if double_quant:
        sizes |= {"absmax": (blocks, "uint8"), "nested_absmax": (math.ceil(blocks / NESTED_BLOCK), "float32"),
                  "nested_code": (_CODE, "float32"), "offset": (1, "float32")}
    else:
        sizes |= {"absmax": (blocks, "float32")}
    sizes["code"] = (16, "float32")  # the NF4 table
    return sizes


def _real_sizes(module) -> dict:
    """The sizes of a quantized layer's own tensors."""
    state = module.weight.quant_state
    tensors = {"weight": module.weight, "absmax": state.absmax, "code": state.code}
    if getattr(state, "nested", False):
        tensors |= {"nested_absmax": state.state2.absmax, "nested_code": state.state2.code, "offset": state.offset}
    return {name: (t.numel(), str(t.dtype).replace("torch.", "")) for name, t in tensors.items()
            if hasattr(t, "numel")}


def stand_in(module, mode, *, compute_dtype=None, double_quant: bool = True):
    """The fake stand-in for `module` (call it under the fake mode `mode`): a quantized `Linear4bit`, or an
    `nn.Linear` to plan as one."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    if is_four_bit(module):
        out_features, in_features = module.weight.quant_state.shape
        sizes = _real_sizes(module)
        compute = module.compute_dtype or module.weight.quant_state.dtype
    else:
        out_features, in_features = module.out_features, module.in_features
        sizes = four_bit_sizes(out_features, in_features, double_quant)
        compute = compute_dtype or torch.float16
    layer = _stand_in_class()(out_features, in_features, compute)
    # Two tensors, the packed weight and its whole quantization state as bytes: the plan's memory tracker
    # looks at every live tensor at every operation, so fewer tensors of the same bytes trace faster.
    state = sum(count * getattr(torch, dtype).itemsize for name, (count, dtype) in sizes.items() if name != "weight")
    device = "cpu" if module.weight.device.type == "meta" else module.weight.device
    for name, count in (("weight", sizes["weight"][0]), ("quant_state", state)):
        fake = torch.empty(count, dtype=torch.uint8, device=device)
        layer.register_parameter(name, torch.nn.Parameter(fake, requires_grad=False))
    if module.bias is not None:
        bias = module.bias if isinstance(module.bias, FakeTensor) else mode.from_tensor(module.bias.detach())
        layer.bias = torch.nn.Parameter(bias, requires_grad=module.bias.requires_grad)
    return layer


def replace_linear(model, mode, compute_dtype) -> int:
    """Plan `model` (a fake copy, under `mode`) as QLoRA loads it: every layer `quantizable` becomes a 4-bit
    stand-in, and every other weight but an adapter's is upcast to float32, as peft's
    `prepare_model_for_kbit_training` does (about 1 GB for a 1.5 B model's 151,936-token embeddings).
    Returns how many layers are planned in 4 bits."""
    import torch

    named = dict(model.named_modules())
    chosen = [name for name, module in named.items() if quantizable(name, module)]
    for name in chosen:
        parent, _, child = name.rpartition(".")
        setattr(named[parent] if parent else model, child, stand_in(named[name], mode, compute_dtype=compute_dtype))
    upcast: dict = {}  # one float32 copy of a tensor shared by two modules (tied embeddings stay tied)
    for name, module in model.named_modules():
        if any(p.startswith("lora_") or p == "modules_to_save" for p in name.split(".")):
            continue
        for key, p in list(module._parameters.items()):
            if p is not None and p.is_floating_point() and p.dtype != torch.float32:
                module._parameters[key] = upcast.setdefault(id(p), torch.nn.Parameter(
                    torch.empty_like(p, dtype=torch.float32), requires_grad=p.requires_grad))
    return len(chosen)


@functools.cache
def _stand_in_class():
    import torch

    class _Dequantized(torch.autograd.Function):
        """x @ W.T + b with W dequantized into a temporary for the product, and again for the input's gradient."""

        @staticmethod
        def forward(ctx, x, bias, shape, dtype):
            ctx.shape, ctx.dtype, ctx.bias_grad = shape, dtype, bias is not None and bias.requires_grad
            weight = x.new_empty(shape, dtype=dtype)
            return torch.nn.functional.linear(x, weight, None if bias is None else bias.to(x.dtype))

        @staticmethod
        def backward(ctx, grad):
            weight = grad.new_empty(ctx.shape, dtype=ctx.dtype)
            bias_grad = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.bias_grad else None
            return grad @ weight.to(grad.dtype), bias_grad, None, None

    class FourBitLinear(torch.nn.Module):
        """What a bitsandbytes `Linear4bit` holds and allocates (see the module's docstring)."""

        def __init__(self, out_features, in_features, compute_dtype):
            super().__init__()
            self.out_features, self.in_features, self.compute_dtype = out_features, in_features, compute_dtype
            self.bias = None

        def forward(self, x):
            out = _Dequantized.apply(x.to(self.compute_dtype), self.bias, (self.out_features, self.in_features),
                                     self.compute_dtype)
            return out.to(x.dtype)

    return FourBitLinear
