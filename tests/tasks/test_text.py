"""text.perplexity: the true perplexity of a causal LM, on every supported transformers version.

The version-matrix leg of .ci/run (.ci/version_matrix) runs this file on the lowest supported
transformers too, where the Trainer's own eval_loss under-reports it.
"""

import math

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, default_data_collator

from colab_kit import text


def test_perplexity_is_exp_of_the_mean_loss_over_every_predicted_token(tmp_path):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    ids = torch.randint(0, 64, (13, 16))
    labels = ids.clone()
    labels[3, 10:] = -100  # ignored positions are not predicted tokens
    rows = [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": l} for i, l in zip(ids, labels)]
    args = TrainingArguments(str(tmp_path), per_device_eval_batch_size=5, use_cpu=True, report_to=[])
    trainer = Trainer(model=model, args=args, eval_dataset=rows, data_collator=default_data_collator)

    model.eval()
    with torch.no_grad():  # independently: shift, sum every predicted token's loss, divide by their number
        logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].double(), dim=-1)
        target = labels[:, 1:]
        mask = target.ne(-100)
        nll = -logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)[mask]
    expected = math.exp(nll.sum().item() / mask.sum().item())

    measured = text.perplexity(trainer, rows_per_forward=2)
    reported = math.exp(trainer.evaluate()["eval_loss"])
    assert abs(measured / expected - 1) <= 1e-6, (
        f"perplexity {measured} != {expected} (transformers {transformers.__version__}; the Trainer says {reported})")
    assert model.training is False  # left as it was
