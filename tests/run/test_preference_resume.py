"""A preference trainer through `run.train` (issue 39): TRL's DPOTrainer on a LoRA adapter (its reference model
is the base, the adapter switched off), crashed at a step the kit did not save and resumed on a new VM, ends
with the uninterrupted run's adapter; its checkpoints hold the adapter, not the model."""

import random
import warnings

import pytest
import torch
from test_peer_resume import trained
from test_run import max_diff, weights

WORDS = ["<unk>", "<pad>", "<eos>", "<bos>"] + [f"w{i}" for i in range(60)]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>")


def preferences(n=64):
    """Prompts of four words; the chosen answer uses the first half of the vocabulary, the rejected the other."""
    import datasets

    rng = random.Random(0)
    return datasets.Dataset.from_list([
        {"prompt": " ".join(f"w{rng.randrange(60)}" for _ in range(4)),
         "chosen": " " + " ".join(f"w{rng.randrange(30)}" for _ in range(3)),
         "rejected": " " + " ".join(f"w{30 + rng.randrange(30)}" for _ in range(3))} for _ in range(n)])


def dpo_trainer(run, callbacks=None):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                        max_position_embeddings=64, pad_token_id=1, eos_token_id=2, bos_token_id=3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"],
                                                task_type="CAUSAL_LM"))
    args = DPOConfig(str(run.local_dir), max_steps=16, per_device_train_batch_size=8, learning_rate=1e-2, beta=0.1,
                     report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=4, seed=0, save_strategy="no")
    return DPOTrainer(model=model, args=args, train_dataset=preferences(), processing_class=tokenizer(),
                      callbacks=callbacks)


def test_dpo_on_an_adapter_crashed_and_resumed_ends_with_the_uninterrupted_adapter(drive, local):
    crash_at = 13  # after checkpoint-10, before checkpoint-15
    whole, _ = trained(drive, local, "whole", dpo_trainer)
    again, resumed = trained(drive, local, "again", dpo_trainer, crash_at=crash_at)
    assert resumed == (crash_at // 5) * 5 and again.state.global_step == 16
    assert max_diff(weights(whole), weights(again)) <= 1e-6
    assert [h["loss"] for h in again.state.log_history if "loss" in h][-1] == pytest.approx(
        [h["loss"] for h in whole.state.log_history if "loss" in h][-1], abs=1e-6)
    newest = drive / "again" / "checkpoints" / "checkpoint-16"
    assert (newest / "adapter_model.safetensors").is_file() and not (newest / "model.safetensors").exists()
