"""LoRA fine-tuning of a causal LM, as the third notebook does it (`from colab_kit import lora`): its
parameters resolved against its presets, the model loaded in 4 bits where bitsandbytes runs (QLoRA) or at
16 bits, the adapter put on it with peft, and instruction data for the quick preset.

What people fine-tune in Colab now is mostly this: a 0.5-8 B causal LM, its weights frozen (in 4 bits, NF4
with double quantization, in QLoRA), low-rank adapters on every linear layer trained, on a T4. The frozen
weights need no gradients and no optimizer state; the adapter is a few MB, and so are its checkpoints.
"""

from __future__ import annotations

import importlib.util
import random
import warnings
from dataclasses import dataclass

from ..runtime import GpuInfo, gpu_info
from .presets import preset_values

__all__ = ["LoraSettings", "resolve_settings", "PRESETS", "generate_instructions", "format_example",
           "instruction_data", "build_model", "quantization_config", "bitsandbytes_runs"]

PRESETS = {
    "full": {"epochs": 1, "learning_rate": 2e-4, "save_every": "10min", "rank": 16, "block_size": 512},
    "quick": {"epochs": 3, "learning_rate": 1e-2, "save_every": 20, "rank": 8, "block_size": 64},
}
_QUANTIZE = ("auto", "4bit", "none")


@dataclass(frozen=True)
class LoraSettings:
    """What the LoRA notebook runs: the preset's values with the parameters given on top."""

    preset: str
    epochs: int
    learning_rate: float
    save_every: str | int
    block_size: int
    rank: int
    four_bit: bool  # QLoRA: the frozen base in 4 bits (NF4, double quantization)
    bf16: bool  # the compute dtype on this GPU: bf16 on Ampere or newer, fp16 on a T4

    def describe(self) -> str:
        what = "the pre-trained model" if self.preset == "full" else "a tiny Llama-shaped model on generated instructions"
        weights = "in 4 bits (QLoRA: NF4, double quantization)" if self.four_bit else (
            "at 16 bits" if self.preset == "full" else "in float32")
        return (f"preset {self.preset}: LoRA rank {self.rank} on every linear layer of {what}, its frozen weights "
                f"{weights}; blocks of {self.block_size} tokens; {self.epochs} epochs at learning rate "
                f"{self.learning_rate:g}; checkpoints every {self.save_every}")


def bitsandbytes_runs() -> bool:
    """Is bitsandbytes importable here (a GPU runtime where `pip install bitsandbytes` was run)?"""
    return importlib.util.find_spec("bitsandbytes") is not None


def resolve_settings(preset: str, *, epochs: int | None = None, learning_rate: float | None = None,
                     save_every: str | int | None = None, block_size: int | None = None, rank: int | None = None,
                     quantize: str = "auto", allow_cpu: bool = False, gpu: GpuInfo | None = None,
                     has_bitsandbytes: bool | None = None) -> LoraSettings:
    """The notebook's settings: the `preset`'s values, with every parameter that is not None on top.
    `quantize`: "auto" (4 bits for the full preset where bitsandbytes runs on a GPU, else 16 bits), "4bit"
    or "none".

    Raises:
        ValueError: a parameter that cannot work, with the value to use instead.
        ColabKitError: the `full` preset on a runtime without a GPU, unless `allow_cpu`.
    """
    chosen = preset_values(preset, PRESETS, allow_cpu=allow_cpu, cpu_time="hours", gpu=gpu)
    for name, value, what in (("EPOCHS", epochs, "a whole number of epochs >= 1"),
                              ("BLOCK_SIZE", block_size, "the tokens per training example, a whole number >= 8"),
                              ("LORA_RANK", rank, "the adapter's rank, a whole number >= 1 (8 to 64 is usual)")):
        low = 8 if name == "BLOCK_SIZE" else 1
        if value is not None and (type(value) is not int or value < low):
            raise ValueError(f"{name}={value!r}: give {what}, or None ({chosen[name.lower().replace('lora_', '')]})")
    if quantize not in _QUANTIZE:
        raise ValueError(f"QUANTIZE={quantize!r}: use {', '.join(repr(q) for q in _QUANTIZE)}")
    gpu = gpu or gpu_info()
    has_bitsandbytes = bitsandbytes_runs() if has_bitsandbytes is None else has_bitsandbytes
    if quantize == "4bit" and preset != "full":
        raise ValueError("QUANTIZE='4bit' is for the full preset's pre-trained model; the quick preset's tiny model "
                         "is built in float32 on the CPU: use QUANTIZE='auto'")
    if quantize == "4bit" and (gpu is None or not has_bitsandbytes):
        raise ValueError("QUANTIZE='4bit' needs a GPU and bitsandbytes (pip install bitsandbytes, then restart the "
                         "session); QUANTIZE='auto' falls back to 16-bit LoRA where it cannot run")
    four_bit = quantize == "4bit" or (quantize == "auto" and preset == "full" and gpu is not None and has_bitsandbytes)
    return LoraSettings(preset=preset, epochs=epochs or chosen["epochs"],
                        learning_rate=learning_rate or chosen["learning_rate"],
                        save_every=save_every or chosen["save_every"], block_size=block_size or chosen["block_size"],
                        rank=rank or chosen["rank"], four_bit=four_bit, bf16=bool(gpu and gpu.bf16))


_TASKS = [
    ("List the colours of {a} in order.", lambda a, b: f"The colours of {a} are {b}."),
    ("Which road leads to {a}?", lambda a, b: f"The {b} road leads to {a}."),
    ("Name the keeper of {a}.", lambda a, b: f"The keeper of {a} is {b}."),
]
_PLACES = ["the harbour", "the old mill", "the north tower", "the library", "the orchard", "the station",
           "the museum", "the bridge", "the market", "the lighthouse", "the valley", "the castle"]
_ANSWERS = ["red and green", "western", "Anna", "blue and white", "eastern", "Tomas", "gold and black", "southern",
            "Maria", "grey and yellow", "northern", "Pavel"]


def generate_instructions(n: int = 300, seed: int = 0) -> list[dict]:
    """Instruction/response pairs with learnable structure (each place has its answer), for the quick preset."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        place = rng.randrange(len(_PLACES))
        question, answer = _TASKS[place % len(_TASKS)]
        rows.append({"instruction": question.format(a=_PLACES[place]),
                     "response": answer(_PLACES[place], _ANSWERS[place])})
    return rows


def format_example(instruction: str, response: str = "", context: str = "") -> str:
    """One example in the Alpaca layout the full preset's data uses (a prompt alone when `response` is empty)."""
    extra = f"### Input:\n{context}\n\n" if context else ""
    return f"### Instruction:\n{instruction}\n\n{extra}### Response:\n{response}"


FULL_DATA = "yahma/alpaca-cleaned"  # 51,760 instruction/response pairs (CC BY 4.0), ungated


def instruction_data(preset: str, eos_token: str, *, seed: int = 0):
    """A `datasets.DatasetDict` (train, validation, test) with one "text" column: each example in the Alpaca
    layout, ended by `eos_token` (so the model learns to stop). `full`: FULL_DATA from the hub, 2 % held out
    for validation and for test; `quick`: generated pairs."""
    import datasets

    if preset == "full":
        rows = datasets.load_dataset(FULL_DATA, split="train")
        texts = rows.map(lambda r: {"text": format_example(r["instruction"], r["output"], r["input"]) + eos_token},
                         remove_columns=rows.column_names, desc="formatting")
        held = texts.train_test_split(test_size=0.04, seed=seed)
        halves = held["test"].train_test_split(test_size=0.5, seed=seed)
        return datasets.DatasetDict(train=held["train"], validation=halves["train"], test=halves["test"])
    return datasets.DatasetDict({
        split: datasets.Dataset.from_dict({"text": [format_example(r["instruction"], r["response"]) + eos_token
                                                    for r in generate_instructions(n, seed=seed + i)]})
        for i, (split, n) in enumerate([("train", 400), ("validation", 40), ("test", 40)])})


def quantization_config(settings: LoraSettings):
    """QLoRA's 4-bit weights (NF4, double quantization, computing in bf16 or fp16), or None."""
    if not settings.four_bit:
        return None
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16 if settings.bf16 else torch.float16)


def build_model(settings: LoraSettings, tokenizer, model_name: str | None = None, *,
                gradient_checkpointing: bool = False, seed: int = 0):
    """The causal LM with a LoRA adapter on every linear layer (peft), only the adapter trainable.

    `full`: `model_name` from the hub, in 4 bits (then `prepare_model_for_kbit_training`: norms and head
    upcast to float32, inputs made to require gradients for checkpointing) or at 16 bits. `quick`: a
    2-layer Llama-shaped model built from a config, sized to `tokenizer`.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if settings.preset == "full":
        quantization = quantization_config(settings)
        on_gpu = torch.cuda.is_available()
        dtype = (torch.bfloat16 if settings.bf16 else torch.float16) if on_gpu else torch.float32  # ALLOW_CPU
        model = AutoModelForCausalLM.from_pretrained(model_name, quantization_config=quantization, dtype=dtype,
                                                     attn_implementation="sdpa",
                                                     device_map={"": 0} if on_gpu else None)
        if quantization is not None:
            from peft import prepare_model_for_kbit_training

            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing,
                                                    gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(128, settings.block_size),
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
            # A random base at the usual 0.02 has logits within about +-1.3 (unit-norm states against head rows
            # of norm 0.16): no adapter on its linear layers could make it confident. At 0.2 the head's rows are
            # ten times longer, and the adapter can lower the loss as it would on a trained model.
            initializer_range=0.2))
    if gradient_checkpointing:
        # The frozen embeddings' output takes no gradient; checkpointed blocks must still see one, or their
        # adapters would not train under reentrant checkpointing (transformers 4.x's default, which the
        # Trainer sets again). Harmless under non-reentrant checkpointing.
        model.enable_input_require_grads()
    adapter = LoraConfig(r=settings.rank, lora_alpha=2 * settings.rank, lora_dropout=0.05, target_modules="all-linear",
                         task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # peft 0.21 asks the model by transformers 4's name, which 5.x deprecates
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(model, adapter)
