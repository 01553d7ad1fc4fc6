"""Where on the Hugging Face Hub a run lives: `store="hf://<user>/<repo>"` and its spellings.

    hf://alice/colab-runs                 a model repo; the run is <name>/ in it
    hf://datasets/alice/colab-runs        a dataset repo (private datasets are free too)
    hf://alice/colab-runs/experiments     runs under experiments/<name>/ in the repo

A repo holds any number of runs side by side, each in its own folder (its checkpoints, journal and lease),
so one private repo can serve every notebook of a user.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["HubAddress", "SCHEME", "is_hub_address"]

SCHEME = "hf://"
_TYPES = {"models": "model", "datasets": "dataset"}  # a Space is not a store: its repo restarts the Space
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def is_hub_address(store) -> bool:
    return isinstance(store, str) and store.startswith(SCHEME)


@dataclass(frozen=True)
class HubAddress:
    """A parsed `hf://` address: the repo, its type and the folder in it that holds runs."""

    repo_id: str
    repo_type: str = "model"
    prefix: str = ""

    @classmethod
    def parse(cls, text: str) -> "HubAddress":
        """Raises ValueError saying the expected spelling when `text` is not an `hf://` store address."""
        example = "store='hf://<user>/<repo>' (or 'hf://datasets/<user>/<repo>')"
        if not is_hub_address(text):
            raise ValueError(f"store={text!r}: a Hugging Face Hub store is written {example}")
        parts = [p for p in text[len(SCHEME):].split("/") if p]
        repo_type = "model"
        if parts and parts[0] in _TYPES:
            repo_type = _TYPES[parts.pop(0)]
        elif parts and parts[0] == "spaces":
            raise ValueError(f"store={text!r}: a Space cannot hold runs (each commit restarts it); use a model or "
                             f"dataset repo, {example}")
        if len(parts) < 2:
            raise ValueError(f"store={text!r}: name the owner and the repo, {example}")
        bad = [p for p in parts if not _PART.match(p) or p in (".", "..")]
        if bad:
            raise ValueError(f"store={text!r}: {bad[0]!r} is not a valid repo or folder name (letters, digits, "
                             f"'.', '_' and '-'), {example}")
        return cls(repo_id="/".join(parts[:2]), repo_type=repo_type, prefix="/".join(parts[2:]))

    def path(self, *parts: str) -> str:
        """A path in the repo, under the address's folder."""
        return "/".join(p for p in (self.prefix, *parts) if p)

    def __str__(self) -> str:
        kind = "" if self.repo_type == "model" else f"{self.repo_type}s/"
        return f"{SCHEME}{kind}{self.repo_id}" + (f"/{self.prefix}" if self.prefix else "")
