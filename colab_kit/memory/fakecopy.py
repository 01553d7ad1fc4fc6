"""The user's model copied with fake tensors for the memory plan's trace (`steptrace.FakeStep`): shared
(tied) tensors stay shared, frozen weights become buffers, 4-bit layers their stand-ins (`fourbit`), a
model on the `meta` device is copied as on the CPU, and the optimizer is the user's, rebuilt for the copy."""

from __future__ import annotations

import copy

from .fourbit import is_four_bit, stand_in

__all__ = ["fake_copy", "frozen_as_buffers", "same_optimizer", "tensor_bytes"]


def fake_copy(module, mode, memo: dict):
    """A copy of `module` whose parameters and buffers are fake; shared (tied) tensors stay shared.
    Hook dictionaries are copied too, so that what the copy registers never reaches the original."""
    if id(module) in memo:
        return memo[id(module)]
    if is_four_bit(module):  # its packed weight and quantization state, and its dequantizing matmul
        memo[id(module)] = stand_in(module, mode)
        return memo[id(module)]
    clone = copy.copy(module)
    memo[id(module)] = clone
    for key, value in list(vars(clone).items()):
        if key.startswith("_") and isinstance(value, dict):
            setattr(clone, key, type(value)(value) if type(value) is not dict else dict(value))
    clone._parameters = {name: None if p is None else _fake_tensor(p, mode, memo, parameter=True)
                         for name, p in module._parameters.items()}
    clone._buffers = {name: None if b is None else _fake_tensor(b, mode, memo)
                      for name, b in module._buffers.items()}
    clone._modules = {name: None if m is None else fake_copy(m, mode, memo) for name, m in module._modules.items()}
    if "config" in vars(module):  # a transformers model: what checkpointing changes in it stays in the copy
        clone.config = memo.setdefault(("config", id(module.config)), copy.copy(module.config))
    return clone


def frozen_as_buffers(model, round_to: int) -> int:
    """Frozen parameters of the copy held as buffers (the same bytes, no gradient, no optimizer state):
    the memory tracker hooks every parameter's gradient and cannot hook one that takes none. Returns
    their bytes."""
    moved: dict = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and not p.requires_grad:
                del module._parameters[name]
                module._buffers[name] = moved.setdefault(id(p), p.detach())
    return tensor_bytes(moved.values(), round_to)


def _fake_tensor(t, mode, memo: dict, parameter: bool = False):
    import torch

    if ("tensor", id(t)) in memo:
        return memo[("tensor", id(t))]
    if t.device.type == "meta":  # planned before it exists: traced as on the CPU (autocast has no meta kind)
        fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    else:
        fake = mode.from_tensor(t.detach())
    if parameter:
        fake = torch.nn.Parameter(fake, requires_grad=t.requires_grad)
    memo[("tensor", id(t))] = fake
    return fake


def same_optimizer(optimizer, params, torch):
    """An optimizer of the user's class and settings for the fake parameters (AdamW when none is given),
    in its multi-tensor form, which PyTorch picks on a GPU."""
    if optimizer is None:
        made = torch.optim.AdamW(params, lr=5e-5)
    elif callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        made = optimizer(params)
    else:
        import inspect

        accepted = inspect.signature(type(optimizer).__init__).parameters
        settings = {k: v for k, v in optimizer.defaults.items() if k in accepted}  # AdamW's defaults hold Adam's
        try:
            made = type(optimizer)(params, **settings)
        except Exception as exc:  # an optimizer that cannot be rebuilt from its defaults
            raise ValueError(f"cannot make a {type(optimizer).__name__} for the traced copy ({exc}); pass "
                             f"optimizer=None to plan with AdamW") from exc
    on_meta = any(p.device.type == "meta" for p in params)  # a model planned before it exists anywhere
    for group in made.param_groups:
        if on_meta and group.get("fused"):  # the fused kernel refuses meta tensors; its state is the same
            group["fused"] = False
        if "foreach" in group and not group.get("fused"):
            group["foreach"] = True
    return made


def tensor_bytes(tensors, round_to: int = 1) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        size = t.numel() * t.element_size()
        total += -(-size // round_to) * round_to
    return total
