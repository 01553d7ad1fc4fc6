"""The notebooks' parameters resolved in the kit (`rna.resolve_settings`, `text.resolve_settings`):
presets, overrides, and one clear message for each value that cannot work."""

import pytest

from colab_kit import ColabKitError, rna, text
from colab_kit.runtime import GpuInfo

T4 = GpuInfo("Tesla T4", 15 << 30, (7, 5))


def test_rna_quick_preset_and_overrides():
    quick = rna.resolve_settings("quick")
    assert (quick.model, quick.train, quick.epochs, quick.kmer, quick.save_every) == ("scratch-bert-tiny", None, 4, 4, 40)
    assert quick.scratch and quick.model_limit == 512 and quick.pretrain_epochs == 0
    mine = rna.resolve_settings("quick", model="scratch-bert", epochs=3, learning_rate=1e-3, kmer=1, pretrain_epochs=2,
                                save_every="5min", train_data="a.fasta", test_data="b.fasta")
    assert (mine.model, mine.epochs, mine.learning_rate, mine.kmer, mine.pretrain_epochs, mine.save_every,
            mine.train, mine.test) == ("scratch-bert", 3, 1e-3, 1, 2, "5min", "a.fasta", "b.fasta")
    assert "scratch-bert (one token per nucleotide) on a.fasta / b.fasta" in mine.describe()


def test_rna_full_preset_needs_a_gpu_unless_allowed():
    with pytest.raises(ColabKitError, match='PRESET = "full" needs a GPU, and this runtime has none.*ALLOW_CPU = True'):
        rna.resolve_settings("full", gpu=None)
    full = rna.resolve_settings("full", gpu=T4)
    assert full.model == "multimolecule/rnafm" and not full.scratch and full.model_limit == 1024
    assert full.train.endswith("dataset_Rfam_6320_13classes.fasta") and full.save_every == "10min"
    assert rna.resolve_settings("full", allow_cpu=True).preset == "full"


@pytest.mark.parametrize("kwargs, message", [
    ({"preset": "fast"}, "PRESET='fast': use 'full' or 'quick'"),
    ({"train_data": "a.fasta"}, "give both TRAIN_DATA and TEST_DATA, or neither"),
    ({"model": "bert-base-uncased"}, "MODEL='bert-base-uncased': use None"),
    ({"kmer": 7}, r"KMER=7: give 1 \(one token per nucleotide\), a k-mer size from 2 to 6, or None \(4\)"),
    ({"kmer": 2.0}, "KMER=2.0: give 1"),
    ({"pretrain_epochs": -1}, "PRETRAIN_EPOCHS=-1: give a whole number of epochs"),
    ({"epochs": 2.5}, "EPOCHS=2.5: give a whole number of epochs >= 1"),
    ({"model": "multimolecule/rnafm", "kmer": 3}, "KMER is for the from-scratch models; multimolecule/rnafm has its own "
                                                  "tokenizer: set KMER = None"),
    ({"model": "multimolecule/rnafm", "pretrain_epochs": 2}, "PRETRAIN_EPOCHS is for the from-scratch models; "
                                                             "multimolecule/rnafm is already pre-trained: set "
                                                             "PRETRAIN_EPOCHS = 0"),
])
def test_rna_bad_parameters_stop_with_what_to_set(kwargs, message):
    kwargs = {"preset": "quick", **kwargs}
    with pytest.raises(ValueError, match=message):
        rna.resolve_settings(kwargs.pop("preset"), **kwargs)


def test_text_presets_overrides_and_bad_parameters():
    quick = text.resolve_settings("quick")
    assert (quick.epochs, quick.learning_rate, quick.save_every, quick.block_size, quick.freeze_layers) == \
        (3, 1e-3, 30, 128, 0)
    mine = text.resolve_settings("full", epochs=1, learning_rate=2e-5, save_every="1h", block_size=256,
                                 freeze_layers=2, gpu=T4)
    assert (mine.epochs, mine.learning_rate, mine.save_every, mine.block_size, mine.freeze_layers) == \
        (1, 2e-5, "1h", 256, 2)
    assert "DistilGPT2 on wikitext-2, blocks of 256 tokens" in mine.describe()
    with pytest.raises(ColabKitError, match='PRESET = "full" needs a GPU'):
        text.resolve_settings("full", gpu=None)
    for kwargs, message in [({"block_size": 1}, "BLOCK_SIZE=1"), ({"freeze_layers": -1}, "FREEZE_LAYERS=-1"),
                            ({"epochs": 0.5}, "EPOCHS=0.5")]:
        with pytest.raises(ValueError, match=message):
            text.resolve_settings("quick", **kwargs)
    with pytest.raises(ValueError, match="PRESET='slow'"):
        text.resolve_settings("slow")


def test_the_crashed_seed_notebook_is_flagged_by_preflight(tmp_path):
    import colab_kit as ck

    report = ck.preflight(text.seed_model(), text.seed_arguments(tmp_path / "seed"))
    assert not report.ok
    said = " ".join(str(f) for f in report.findings)
    assert "lm_head2" in said


A100 = GpuInfo("NVIDIA A100-SXM4-40GB", 40 << 30, (8, 0))


def test_lora_presets_choose_4_bit_weights_only_where_bitsandbytes_runs_on_a_gpu():
    from colab_kit import lora

    quick = lora.resolve_settings("quick", gpu=None, has_bitsandbytes=False)
    assert (quick.rank, quick.block_size, quick.four_bit, quick.save_every) == (8, 64, False, 20)
    assert "LoRA rank 8 on every linear layer of a tiny Llama-shaped model" in quick.describe()
    qlora = lora.resolve_settings("full", gpu=T4, has_bitsandbytes=True)
    assert qlora.four_bit and not qlora.bf16 and "in 4 bits (QLoRA: NF4, double quantization)" in qlora.describe()
    assert not lora.resolve_settings("full", gpu=T4, has_bitsandbytes=False).four_bit  # 16-bit LoRA instead
    assert not lora.resolve_settings("full", gpu=A100, has_bitsandbytes=True, quantize="none").four_bit
    assert lora.resolve_settings("full", gpu=A100, has_bitsandbytes=True).bf16
    with pytest.raises(ColabKitError, match='PRESET = "full" needs a GPU'):
        lora.resolve_settings("full", gpu=None, has_bitsandbytes=True)
    mine = lora.resolve_settings("quick", rank=32, block_size=128, epochs=1, learning_rate=1e-3, save_every="5min")
    assert (mine.rank, mine.block_size, mine.epochs, mine.learning_rate, mine.save_every) == (32, 128, 1, 1e-3, "5min")


def test_lora_4_bit_config_is_nf4_with_double_quantization_in_the_gpus_compute_dtype():
    import torch

    from colab_kit import lora

    config = lora.quantization_config(lora.resolve_settings("full", gpu=T4, has_bitsandbytes=True))
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4" and config.bnb_4bit_use_double_quant
    assert config.bnb_4bit_compute_dtype == torch.float16  # a T4 has no bf16
    assert lora.quantization_config(lora.resolve_settings("quick")) is None


@pytest.mark.parametrize("kwargs, message", [
    ({"rank": 0}, r"LORA_RANK=0: give the adapter's rank, a whole number >= 1 \(8 to 64 is usual\), or None \(8\)"),
    ({"block_size": 4}, r"BLOCK_SIZE=4: give the tokens per training example, a whole number >= 8, or None \(64\)"),
    ({"epochs": 1.5}, r"EPOCHS=1.5: give a whole number of epochs >= 1, or None \(3\)"),
    ({"quantize": "8bit"}, "QUANTIZE='8bit': use 'auto', '4bit', 'none'"),
    ({"quantize": "4bit"}, "QUANTIZE='4bit' is for the full preset's pre-trained model.*use QUANTIZE='auto'"),
    ({"quantize": "4bit", "preset": "full", "allow_cpu": True},
     "QUANTIZE='4bit' needs a GPU and bitsandbytes .*QUANTIZE='auto' falls back to 16-bit LoRA"),
])
def test_lora_parameters_that_cannot_work_say_what_to_use(kwargs, message):
    from colab_kit import lora

    kwargs = {"preset": "quick", **kwargs}
    with pytest.raises(ValueError, match=message):
        lora.resolve_settings(kwargs.pop("preset"), gpu=None, has_bitsandbytes=False, **kwargs)
