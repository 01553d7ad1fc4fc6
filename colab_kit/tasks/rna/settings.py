"""The RNA notebook's parameters resolved against its preset: one `RnaSettings`, or one clear error.

    settings = rna.resolve_settings(PRESET, model=MODEL, epochs=EPOCHS, kmer=KMER, ...)

`full` fine-tunes RNA-FM on the real nRC files and wants a GPU; `quick` trains a tiny encoder from
scratch on generated families, on a CPU, with no network. A parameter left at None takes the
preset's value; every check says what to set instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...runtime import GpuInfo
from ..presets import preset_values
from .model import MAX_K

__all__ = ["RnaSettings", "resolve_settings", "PRESETS", "SCRATCH_MODELS"]

_NRC = "https://raw.githubusercontent.com/IcarPA-TBlab/nrc/05b10b55ede28586ae8eea00d6aa26c494831844/data/ECCB2017/"
PRESETS = {
    "full": {"model": "multimolecule/rnafm", "train": _NRC + "dataset_Rfam_6320_13classes.fasta",
             "test": _NRC + "dataset_Rfam_validated_2600_13classes.fasta", "epochs": 10, "learning_rate": 3e-5,
             "pretrain_epochs": 0, "save_every": "10min"},
    # Generated families are learnt in 3 epochs (test accuracy 1.0 in 30 s on a CPU); 4 leave room.
    "quick": {"model": "scratch-bert-tiny", "train": None, "test": None, "epochs": 4, "learning_rate": 2e-3,
              "pretrain_epochs": 0, "save_every": 40},
}
SCRATCH_MODELS = ("scratch-bert", "scratch-bert-tiny")  # 4 x 256 and 2 x 128, trained from scratch
DEFAULT_KMER = 4  # from-scratch models read overlapping 4-mers (bench/rna_nrc.py)
# One RNA-FM step of 8 sequences x 192 tokens takes ~25 s on 2 CPU cores.
_FULL_ON_CPU = "about two days on 2 CPU cores (one RNA-FM step of 8 sequences x 192 tokens takes ~25 s)"


@dataclass(frozen=True)
class RnaSettings:
    """What the RNA notebook runs: the preset's values with the parameters given on top."""

    preset: str
    model: str  # "multimolecule/<name>", or one of SCRATCH_MODELS
    train: str | None  # a file or URL; None: generated families
    test: str | None
    epochs: int
    learning_rate: float
    pretrain_epochs: int  # masked-LM epochs before fine-tuning (from-scratch models only)
    kmer: int  # 1: one token per nucleotide; 2..MAX_K: overlapping k-mers (from-scratch models only)
    save_every: str | int

    @property
    def scratch(self) -> bool:
        """A from-scratch model (nucleotide tokens built here), not a pre-trained one."""
        return self.model in SCRATCH_MODELS

    @property
    def model_limit(self) -> int:
        """The longest input the model takes, in tokens."""
        return 512 if self.scratch else 1024

    def describe(self) -> str:
        data = f"{self.train} / {self.test}" if self.train else "generated RNA families"
        tokens = (f"{self.kmer}-mer tokens" if self.kmer > 1 else "one token per nucleotide") if self.scratch \
            else "its own tokenizer"
        pretrain = f", {self.pretrain_epochs} epochs of masked-LM pre-training first" if self.pretrain_epochs else ""
        return (f"preset {self.preset}: {self.model} ({tokens}) on {data}; {self.epochs} epochs at learning rate "
                f"{self.learning_rate:g}{pretrain}; checkpoints every {self.save_every}")


def resolve_settings(preset: str, *, model: str | None = None, train_data: str | None = None,
                     test_data: str | None = None, epochs: int | None = None, learning_rate: float | None = None,
                     pretrain_epochs: int | None = None, kmer: int | None = None, save_every: str | int | None = None,
                     allow_cpu: bool = False, gpu: GpuInfo | None = None) -> RnaSettings:
    """The notebook's settings: the `preset`'s values, with every parameter that is not None on top.

    Args:
        gpu: the GPU to judge the `full` preset by (default: the one this runtime has).

    Raises:
        ValueError: a parameter that cannot work, with the value to use instead.
        ColabKitError: the `full` preset on a runtime without a GPU, unless `allow_cpu`.
    """
    chosen = preset_values(preset, PRESETS, allow_cpu=allow_cpu, cpu_time=_FULL_ON_CPU, gpu=gpu)
    if (train_data is None) != (test_data is None):
        raise ValueError("give both TRAIN_DATA and TEST_DATA, or neither (the preset's data)")
    name = model or chosen["model"]
    if name not in SCRATCH_MODELS and not name.startswith("multimolecule/"):
        raise ValueError(f"MODEL={name!r}: use None (the preset's model), 'multimolecule/rnafm' (or another "
                         f"multimolecule RNA model), 'scratch-bert' or 'scratch-bert-tiny'")
    scratch = name in SCRATCH_MODELS
    pretrain = chosen["pretrain_epochs"] if pretrain_epochs is None else pretrain_epochs
    if type(pretrain) is not int or pretrain < 0:
        raise ValueError(f"PRETRAIN_EPOCHS={pretrain_epochs!r}: give a whole number of epochs (0: no pre-training)")
    k = DEFAULT_KMER if kmer is None else kmer
    if type(k) is not int or not 1 <= k <= MAX_K:
        raise ValueError(f"KMER={kmer!r}: give 1 (one token per nucleotide), a k-mer size from 2 to {MAX_K}, "
                         f"or None ({DEFAULT_KMER})")
    if kmer is not None and not scratch:
        raise ValueError(f"KMER is for the from-scratch models; {name} has its own tokenizer: set KMER = None")
    if pretrain and not scratch:
        raise ValueError(f"PRETRAIN_EPOCHS is for the from-scratch models; {name} is already pre-trained: "
                         f"set PRETRAIN_EPOCHS = 0")
    n_epochs = epochs or chosen["epochs"]
    if type(n_epochs) is not int or n_epochs < 1:
        raise ValueError(f"EPOCHS={epochs!r}: give a whole number of epochs >= 1, or None ({chosen['epochs']})")
    return RnaSettings(preset=preset, model=name, train=train_data or chosen["train"], test=test_data or chosen["test"],
                       epochs=n_epochs, learning_rate=learning_rate or chosen["learning_rate"], pretrain_epochs=pretrain,
                       kmer=k, save_every=save_every or chosen["save_every"])
