"""PyTorch's memory tracker's snapshots in the kit's names (`steptrace` reads its peak, `depth` every moment)."""

from __future__ import annotations

__all__ = ["parts_of"]

CATEGORIES = {"Parameter": "weights", "Buffer": "buffers", "Gradient": "gradients", "Activation": "activations",
              "Temp": "temporaries", "Optstate": "optimizer", "Other": "inputs"}


def parts_of(snapshot) -> dict:
    """A tracker snapshot (the peak or the moment), summed over devices, with the kit's names."""
    parts: dict = {}
    for per_device in snapshot.values():
        for key, value in per_device.items():
            name = CATEGORIES.get(getattr(key, "value", key), "Total" if key == "Total" else str(key))
            parts[name] = parts.get(name, 0) + int(value)
    return parts
