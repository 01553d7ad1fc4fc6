"""The LoRA export (`run.save_final(..., merged=True)`): the adapter in final/, the merged model beside it in
final/merged/ once host RAM is seen to hold it, and the adapter alone, with the reason, when it is not."""

import json
import types

import pytest
import torch
from test_run import events, start

from colab_kit import ColabKitError, lora
from colab_kit.checkpoints.validity import verify_folder
from colab_kit.memory import adapters
from colab_kit.export import merge


def tiny_lora(rank=4):
    from colab_kit import text

    settings = lora.resolve_settings("quick", rank=rank)
    tokenizer = text.train_bpe_tokenizer(text.generate_corpus(20), vocab_size=300)
    return lora.build_model(settings, tokenizer, seed=0), tokenizer


def test_the_merged_size_counts_the_base_at_its_precision_and_4_bit_weights_by_the_shape_they_stand_for():
    model, _ = tiny_lora()
    base = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    assert adapters.merged_bytes(model) == base * 4  # float32
    model.half()
    assert adapters.merged_bytes(model) == base * 2
    packed = types.SimpleNamespace(numel=lambda: 8, quant_state=types.SimpleNamespace(shape=torch.Size([4, 4])))
    assert adapters._elements(packed) == 16  # two 4-bit weights a byte: 8 bytes stand for a 4 x 4 weight


def test_a_merge_that_would_not_fit_host_ram_says_the_numbers_and_what_to_do():
    model, _ = tiny_lora()
    need = adapters.merged_bytes(model)
    assert merge.check_host_ram(model, available=10 << 30) == need
    with pytest.raises(ColabKitError, match=r"needs about .* of host RAM \(the merged model is .*\), and 1.0 MiB is "
                                            r"available, so it was not merged.*PeftModel.from_pretrained.*High-RAM"):
        merge.check_host_ram(model, available=1 << 20)


def test_merged_export_equals_the_adapter_on_its_base_and_leaves_the_trained_model_as_it_was(drive, local):
    model, tokenizer = tiny_lora()
    with torch.no_grad():  # a trained adapter: B is zero at first, which would merge to the base unchanged
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    run = start(drive, local, "m", quiet=True, gauges=False)
    target = run.save_final(model, tokenizer, metrics={"perplexity": 3.0}, merged=True)
    assert verify_folder(target) is None  # one manifest covers the adapter and merged/
    manifest = json.loads((target / "MANIFEST.json").read_text())["files"]
    assert {"adapter_model.safetensors", "merged/model.safetensors", "merged/config.json"} <= set(manifest)
    assert json.loads((target / "metrics.json").read_text())["merged"] is True
    assert any(name.startswith("base_model.model") for name, _ in model.named_parameters())  # still a peft model

    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(target / "merged").eval()
    ids = torch.randint(0, merged.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-4)
    run.finish(timeout=30)


def test_without_the_ram_for_a_merge_the_adapter_alone_is_exported_and_the_reason_journaled(drive, local, monkeypatch,
                                                                                           capsys):
    model, tokenizer = tiny_lora()
    monkeypatch.setattr(merge, "available_ram", lambda: 1 << 20)
    run = start(drive, local, "n", quiet=True, gauges=False)
    target = run.save_final(model, tokenizer, metrics={"perplexity": 3.0}, merged=True)
    assert verify_folder(target) is None and (target / "adapter_model.safetensors").is_file()
    assert not (target / "merged").exists()
    assert json.loads((target / "metrics.json").read_text())["merged"] is False
    assert "so it was not merged" in capsys.readouterr().out
    assert [e["what"] for e in events(run, "warn")] == ["merge_skipped"]
    run.finish(timeout=30)


def test_the_ram_a_merge_may_take_is_the_containers_limit_less_its_use(monkeypatch):
    from colab_kit.gauges import monitor

    monkeypatch.setattr(monitor, "read_host", lambda: monitor.HostReading(rss=1, peak_rss=1, used=9 << 30,
                                                                         limit=12 << 30))
    assert merge.available_ram() == 3 << 30  # Colab's 12.7 GB container, not the machine psutil sees


def test_merged_is_for_an_adapter_model(drive, local):
    run = start(drive, local, "p", quiet=True, gauges=False)
    with pytest.raises(ValueError, match="merged=True merges a peft adapter into its base model; this model has no "
                                         "adapter"):
        run.save_final(torch.nn.Linear(2, 2), merged=True)
    run.finish(timeout=30)


def test_a_4_bit_model_is_merged_onto_its_base_read_again_at_16_bits(drive, local, tiny_llama_files):
    """bitsandbytes on the CPU: the merge reads the base again from its files (4-bit weights would merge with
    rounding) and folds the adapter in; the result equals the adapter on that 16-bit base."""
    from peft import PeftModel
    from adapter_models import qlora
    from transformers import AutoModelForCausalLM

    if not lora.bitsandbytes_runs():
        pytest.skip("bitsandbytes is not installed: .ci/qlora runs this with it (pip install -r "
                    "requirements-qlora-test.txt)")
    model = qlora(tiny_llama_files, 4, False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    run = start(drive, local, "q", quiet=True, gauges=False)
    target = run.save_final(model, merged=True)
    assert verify_folder(target) is None and (target / "merged" / "model.safetensors").is_file()
    merged = AutoModelForCausalLM.from_pretrained(target / "merged").eval()
    assert not any(getattr(p, "quant_state", None) is not None for p in merged.parameters())
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_files, dtype="auto")
    expected = PeftModel.from_pretrained(base, target).eval()
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(expected(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-4)
    run.finish(timeout=30)


def test_any_failure_of_the_merge_leaves_the_adapter_exported(drive, local, monkeypatch, capsys):
    model, tokenizer = tiny_lora()

    def broken(*args, **kwargs):
        raise RuntimeError("peft could not merge this layer")

    monkeypatch.setattr(merge, "_merged_copy", broken)
    run = start(drive, local, "r", quiet=True, gauges=False)
    target = run.save_final(model, tokenizer, metrics={"perplexity": 3.0}, merged=True)
    assert verify_folder(target) is None and (target / "adapter_model.safetensors").is_file()
    assert not (target / "merged").exists() and json.loads((target / "metrics.json").read_text())["merged"] is False
    assert "the adapter was not merged: peft could not merge this layer" in capsys.readouterr().out
    run.finish(timeout=30)
