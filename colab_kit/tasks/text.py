"""Causal-LM fine-tuning, as the GPT-2 notebook does it (`from colab_kit import text`): its parameters
resolved against its presets, text tokenized without padding and grouped into blocks, a generated
corpus and tokenizer for the quick preset, the crashed seed notebook's model for `ck.preflight`,
perplexity and samples.

The seed notebook that died of RAM exhaustion padded every line to the maximum length and asked
`datasets.map` for `return_tensors='pt'`, and added a `[PAD]` token the model had no row for.
Grouping the token stream into fixed blocks needs no padding and no pad token at all, and the
result stays in `datasets`' memory-mapped Arrow files rather than in RAM.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ..runtime import GpuInfo
from .presets import preset_values

__all__ = ["TextSettings", "resolve_settings", "PRESETS", "generate_corpus", "train_bpe_tokenizer",
           "tokenize_and_group", "perplexity", "samples", "seed_model", "seed_arguments"]

PRESETS = {
    "full": {"epochs": 3, "learning_rate": 5e-5, "save_every": "10min"},
    "quick": {"epochs": 3, "learning_rate": 1e-3, "save_every": 30},
}


@dataclass(frozen=True)
class TextSettings:
    """What the GPT-2 notebook runs: the preset's values with the parameters given on top."""

    preset: str
    epochs: int
    learning_rate: float
    save_every: str | int
    block_size: int
    freeze_layers: int

    def describe(self) -> str:
        what = "DistilGPT2 on wikitext-2" if self.preset == "full" else "a tiny GPT-2 on generated text"
        frozen = f", the embeddings and {self.freeze_layers} lowest blocks frozen" if self.freeze_layers else ""
        return (f"preset {self.preset}: {what}, blocks of {self.block_size} tokens; {self.epochs} epochs at "
                f"learning rate {self.learning_rate:g}{frozen}; checkpoints every {self.save_every}")


def resolve_settings(preset: str, *, epochs: int | None = None, learning_rate: float | None = None,
                     save_every: str | int | None = None, block_size: int = 128, freeze_layers: int = 0,
                     allow_cpu: bool = False, gpu: GpuInfo | None = None) -> TextSettings:
    """The notebook's settings: the `preset`'s values, with every parameter that is not None on top.

    Raises:
        ValueError: a parameter that cannot work, with the value to use instead.
        ColabKitError: the `full` preset on a runtime without a GPU, unless `allow_cpu`.
    """
    chosen = preset_values(preset, PRESETS, allow_cpu=allow_cpu, cpu_time="hours", gpu=gpu)
    n_epochs = epochs or chosen["epochs"]
    if type(n_epochs) is not int or n_epochs < 1:
        raise ValueError(f"EPOCHS={epochs!r}: give a whole number of epochs >= 1, or None ({chosen['epochs']})")
    if type(block_size) is not int or block_size < 2:
        raise ValueError(f"BLOCK_SIZE={block_size!r}: give the tokens per training example, a whole number >= 2 "
                         f"(128 fits a T4 well)")
    if type(freeze_layers) is not int or freeze_layers < 0:
        raise ValueError(f"FREEZE_LAYERS={freeze_layers!r}: give how many of the lowest blocks to freeze (0: none)")
    return TextSettings(preset=preset, epochs=n_epochs, learning_rate=learning_rate or chosen["learning_rate"],
                        save_every=save_every or chosen["save_every"], block_size=block_size,
                        freeze_layers=freeze_layers)

_SUBJECTS = ["the river", "a small village", "the old king", "the museum", "a young engineer", "the storm",
             "the city council", "the orchestra", "a famous painter", "the research team", "the harbour",
             "the railway", "a local farmer", "the library", "the football club", "the mountain pass"]
_VERBS = ["built", "crossed", "described", "visited", "restored", "opened", "studied", "defended",
          "painted", "recorded", "discovered", "closed", "expanded", "celebrated"]
_OBJECTS = ["a stone bridge", "the northern road", "an ancient temple", "the new station", "a large collection",
            "the coastal forts", "a golden statue", "the winter festival", "a narrow valley", "the first album",
            "the eastern wall", "a wooden church"]
_TAILS = ["in the early years of the century", "after the long war", "during the summer", "with great care",
          "for the first time", "despite the heavy rain", "before the end of the season", "near the old market"]


def generate_corpus(n_articles: int = 120, seed: int = 0) -> list[str]:
    """Wikitext-like lines: " = Title = " headings and paragraphs of simple, grammatical sentences
    (learnable structure, so perplexity visibly falls after a short training)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_articles):
        subject = rng.choice(_SUBJECTS)
        lines += ["", f" = {subject.title().replace('The ', '').replace('A ', '')} = ", ""]
        for _ in range(rng.randint(2, 5)):
            sentences = []
            for _ in range(rng.randint(3, 6)):
                s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)} ."
                sentences.append(s[0].upper() + s[1:])
            lines.append(" " + " ".join(sentences) + " ")
    return lines


def train_bpe_tokenizer(texts: list[str], vocab_size: int = 1000):
    """A byte-level BPE tokenizer (GPT-2's kind) trained on `texts` here, with no download."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    core = ByteLevelBPETokenizer()
    core.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")


def tokenize_and_group(dataset, tokenizer, block_size: int, text_column: str = "text", num_proc: int | None = None):
    """Tokenize without padding, then cut the concatenated token stream into blocks of `block_size`.

    Works on a `datasets.Dataset` or `DatasetDict`; the returned rows hold `input_ids`,
    `attention_mask` and `labels` (= input_ids; the model shifts them). The remainder shorter
    than a block is dropped.
    """
    def tokenize(batch):
        return tokenizer(batch[text_column])  # lists of ids: no padding, no tensors

    def group(batch):
        ids = [token for row in batch["input_ids"] for token in row]
        usable = len(ids) // block_size * block_size
        blocks = [ids[i:i + block_size] for i in range(0, usable, block_size)]
        return {"input_ids": blocks, "attention_mask": [[1] * block_size for _ in blocks],
                "labels": [list(block) for block in blocks]}

    columns = dataset["train"].column_names if hasattr(dataset, "keys") else dataset.column_names
    tokenized = dataset.map(tokenize, batched=True, remove_columns=columns, num_proc=num_proc,
                            desc="tokenizing")
    tokenized_columns = tokenized["train"].column_names if hasattr(tokenized, "keys") else tokenized.column_names
    # Grouping changes the number of rows, so the tokenized columns are replaced, not kept.
    return tokenized.map(group, batched=True, batch_size=1000, num_proc=num_proc, remove_columns=tokenized_columns,
                         desc=f"grouping into blocks of {block_size}")


def perplexity(trainer, dataset=None, rows_per_forward: int = 8) -> float:
    """exp(mean cross-entropy over every predicted token) of `trainer.model` on `dataset` (default:
    the trainer's eval_dataset), computed here rather than read from `trainer.evaluate()`.

    The Trainer's eval_loss is not that number on every version: transformers 4.57 divides the
    summed token losses by the count of *unshifted* labels (one token per block too many), which
    under-reports a causal LM's perplexity (2.6 % with DistilGPT2 on wikitext-2 blocks of 128).
    Here each block's labels are shifted as the model's loss shifts them, the losses are summed in
    float32, and the sum is divided by the number of tokens predicted. Under several processes every
    process evaluates its shard and the per-row sums are gathered with accelerate's
    `gather_for_metrics`, which drops the rows repeated to even out the last batch: every process
    returns the number one process would compute on the whole set.
    """
    import torch
    import torch.nn.functional as F

    model = trainer.model
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)  # summed loss, tokens predicted
    with torch.no_grad(), trainer.compute_loss_context_manager():
        for batch in trainer.get_eval_dataloader(dataset):
            batch = trainer._prepare_inputs(batch)
            labels = batch.pop("labels")
            rows = []  # (summed loss, tokens predicted) per row of this batch
            for start in range(0, labels.shape[0], rows_per_forward):  # bounded logits memory (vocab-wide)
                part = slice(start, start + rows_per_forward)
                logits = model(**{k: v[part] for k, v in batch.items()}).logits[:, :-1].float()
                target = labels[part, 1:]
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100,
                                       reduction="none").view(target.shape).sum(dim=1)
                rows.append(torch.stack([loss.double(), target.ne(-100).sum(dim=1).double()], dim=1))
            gathered = trainer.accelerator.gather_for_metrics(torch.cat(rows))  # every process's rows, once each
            total += gathered.sum(dim=0).cpu()
    model.train(was_training)
    return math.exp(total[0].item() / max(total[1].item(), 1.0))


def samples(model, tokenizer, prompts: list[str], *, seed: int = 0, max_new_tokens: int = 30) -> list[str]:
    """One sampled continuation (top-k 40) per prompt, each drawn with the same seed, so that the
    samples before and after training differ only by the model."""
    import torch

    model.eval()
    out = []
    for prompt in prompts:
        torch.manual_seed(seed)
        ids = tokenizer(prompt, return_tensors="pt").to(model.device)
        generated = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=True, top_k=40,
                                   pad_token_id=tokenizer.eos_token_id)
        out.append(tokenizer.decode(generated[0], skip_special_tokens=True))
    return out


def seed_model():
    """The crashed seed notebook's model, on the `meta` device (no memory at all): DistilGPT2 with a
    Linear(50257, 50257) on top of its logits, 2.5 billion parameters, for `ck.preflight` to read."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    class SeedModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=6))
            self.lm_head2 = torch.nn.Linear(50257, 50257)

        def get_input_embeddings(self):
            return self.gpt2.get_input_embeddings()

    with torch.device("meta"):
        return SeedModel()


def seed_arguments(output_dir: str):
    """The crashed seed notebook's training arguments: learning rate 0.1, 2,500 warm-up steps for a
    3-step run."""
    from transformers import TrainingArguments

    return TrainingArguments(str(output_dir), learning_rate=0.1, warmup_steps=2500, max_steps=3, report_to=[])
