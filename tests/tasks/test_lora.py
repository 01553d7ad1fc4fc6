"""The LoRA notebook's model (`lora.build_model`) trains its adapter under gradient checkpointing on every
supported transformers (`.ci/version_matrix` runs this file on 4.57, whose Trainer turns checkpointing on
again as reentrant): every adapter weight gets a gradient, and preflight finds nothing."""

import torch
from transformers import Trainer, TrainingArguments, default_data_collator

import colab_kit as ck
from colab_kit import lora, text


def test_the_adapter_trains_under_gradient_checkpointing_and_preflight_finds_nothing(tmp_path):
    settings = lora.resolve_settings("quick", gpu=None, has_bitsandbytes=False)
    raw = lora.instruction_data("quick", "<|endoftext|>", seed=0)
    tokenizer = text.train_bpe_tokenizer(raw["train"]["text"], vocab_size=300)
    blocks = text.tokenize_and_group(raw["train"].select(range(40)), tokenizer, settings.block_size)
    model = lora.build_model(settings, tokenizer, gradient_checkpointing=True, seed=0)
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=4, max_steps=1, report_to=[], use_cpu=True,
                             disable_tqdm=True, **ck.memory_args(None, gradient_checkpointing=True,
                                                                 group_by_length=False))
    report = ck.preflight(model, args, tokenizer, train_dataset=blocks)
    assert report.ok, report
    trainer = Trainer(model=model, args=args, train_dataset=blocks, data_collator=default_data_collator)
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    model.train()
    trainer.compute_loss(model, batch).backward()
    adapter = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert adapter and all(n.count("lora_") for n in adapter)
    # B starts at zero, so A's first gradient is zero too; B's is not, wherever a gradient reaches.
    missing = [n for n, p in adapter.items() if p.grad is None or ("lora_B" in n and not p.grad.abs().sum() > 0)]
    assert not missing, f"no gradient reached {len(missing)} adapter weights, e.g. {missing[:2]}"
