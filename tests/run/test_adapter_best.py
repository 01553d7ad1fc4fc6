"""Best-model protection with an adapter (issue 39): a LoRA run that keeps the best checkpoint by its evaluation
loss, crashed after it and resumed on a new VM, loads the same best adapter at the end as an uninterrupted run,
and the best checkpoint (adapter files only) is kept in the run folder."""

import warnings

import pytest
import torch
from test_peer_resume import trained
from test_run import max_diff, weights
from transformers import Trainer, TrainingArguments


def lora_best_trainer(run, callbacks=None):
    import datasets
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"],
                                                task_type="CAUSAL_LM"))
    ids = torch.randint(4, 64, (96, 16), generator=torch.Generator().manual_seed(0)).tolist()
    data = datasets.Dataset.from_dict({"input_ids": ids[:80], "labels": ids[:80]})
    held = datasets.Dataset.from_dict({"input_ids": ids[80:], "labels": ids[80:]})
    # A learning rate that overshoots after a while: the evaluation loss is best in the middle, not at the end.
    args = TrainingArguments(str(run.local_dir), max_steps=30, per_device_train_batch_size=8, learning_rate=0.05,
                             eval_strategy="steps", eval_steps=5, save_strategy="steps", save_steps=5,
                             load_best_model_at_end=True, metric_for_best_model="eval_loss", report_to=[],
                             use_cpu=True, disable_tqdm=True, seed=0)
    return Trainer(model=model, args=args, train_dataset=data, eval_dataset=held, callbacks=callbacks)


def test_the_best_adapter_survives_a_crash_and_a_new_vm(drive, local):
    whole, _ = trained(drive, local, "whole", lora_best_trainer)
    again, resumed = trained(drive, local, "again", lora_best_trainer, crash_at=22)
    best = whole.state.best_global_step
    assert best is not None and best < 30, "the run should overshoot after its best evaluation"
    assert resumed == 20 and again.state.best_global_step == best
    assert max_diff(weights(whole), weights(again)) <= 1e-6  # the best adapter, loaded at the end, in both
    kept = drive / "again" / "checkpoints" / f"checkpoint-{best}"
    assert (kept / "adapter_model.safetensors").is_file() and not (kept / "model.safetensors").exists()
