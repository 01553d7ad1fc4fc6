"""Tiny causal LMs with LoRA adapters for the tests, and the QLoRA recipe run on the CPU with bitsandbytes."""

import logging
import warnings

import torch

VOCAB = 2000


def save_tiny_llama(folder) -> None:
    """A 2-block Llama-shaped model's files, as a hub download would leave them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=256)).save_pretrained(folder)


def with_adapter(model, rank, checkpointing):
    from peft import LoraConfig, get_peft_model

    from colab_kit.memory.recipes import set_checkpointing

    if checkpointing:
        set_checkpointing(model)  # before peft, which then makes the inputs require gradients
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                target_modules="all-linear", task_type="CAUSAL_LM"))


def qlora(folder, rank, checkpointing, double_quant=True):
    """The QLoRA recipe on the CPU: bitsandbytes NF4, prepare_model_for_kbit_training, LoRA everywhere."""
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    torch.manual_seed(0)
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=torch.bfloat16)
    logging.disable(logging.WARNING)  # bitsandbytes says once that it found no optional CPU kernel
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization, dtype=torch.bfloat16,
                                                     device_map="cpu")
    finally:
        logging.disable(logging.NOTSET)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing,
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    return with_adapter(model, rank, checkpointing=False)
