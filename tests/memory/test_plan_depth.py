"""Will it fit? in seconds (issue 47): a deep model's step derived from copies with 2 and 3 of its blocks.

Each test compares the derived trace with the full-depth trace of the same model (`FakeStep.traced`, every block
run): the peak, its parts, the FLOPs and the operations. Models are built from configs, small enough that the
full-depth trace takes a second; bench/plan_speed.py makes the same comparison for the shapes people plan.
"""

import re

import pytest
import torch
from transformers import (BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel, Qwen2Config,
                          Qwen2ForCausalLM)

import colab_kit as ck
from colab_kit.memory import planrows
from colab_kit.memory.depth import MIN_BLOCKS, find_blocks
from colab_kit.memory.steptrace import FakeStep

LAYERS = MIN_BLOCKS + 2


def build(kind: str, layers: int = LAYERS):
    torch.manual_seed(0)
    if kind == "bert":
        return BertForSequenceClassification(BertConfig(
            vocab_size=2000, hidden_size=128, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=512,
            max_position_embeddings=256, num_labels=2))
    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=2000, n_positions=256, n_embd=128, n_layer=layers, n_head=2))
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=3000, hidden_size=128, intermediate_size=512,
                                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2))
    if kind == "qwen-lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    return model


def spec(kind: str, rows: int = 4, seq: int = 128) -> dict:
    labels = ((rows,), torch.long) if kind == "bert" else ((rows, seq), torch.long)
    return {"input_ids": ((rows, seq), torch.long), "attention_mask": ((rows, seq), torch.long), "labels": labels}


def same_step(derived, full):
    assert derived.derived, "the trace was not derived"
    assert not full.derived
    assert derived.peak == pytest.approx(full.peak, rel=1e-3)
    for part in set(derived.parts) | set(full.parts):
        assert derived.parts.get(part, 0) == pytest.approx(full.parts.get(part, 0), rel=1e-3, abs=4096), part
    assert (derived.flops, derived.ops, derived.gradients) == (full.flops, full.ops, full.gradients)


@pytest.mark.parametrize("kind", ["bert", "gpt2", "qwen", "qwen-lora"])
@pytest.mark.parametrize("precision,checkpointing", [("fp32", False), ("fp16", False), ("bf16", True)])
def test_a_derived_step_is_the_full_depth_step(kind, precision, checkpointing):
    step = FakeStep(build(kind), None)
    settings = dict(precision=precision, checkpointing=checkpointing)
    same_step(step.trace(spec(kind), **settings), step.traced(spec(kind), **settings))


def test_4_bit_layers_with_an_adapter_are_derived_as_traced():
    step = FakeStep(build("qwen-lora"), None, four_bit=torch.float16)
    assert step.four_bit_layers
    same_step(step.trace(spec("qwen"), precision="fp16", checkpointing=True),
              step.traced(spec("qwen"), precision="fp16", checkpointing=True))


def test_the_peak_is_found_where_the_deep_model_has_it_not_where_the_copies_do():
    """Checkpointing, a wide vocabulary, one row: the copies' peak is the logits' moment, the deep model's the
    end of the backward pass (every block's gradient). A line through the copies' peaks misses it."""
    model = GPT2LMHeadModel(GPT2Config(vocab_size=16000, n_positions=128, n_embd=256, n_layer=40, n_head=4))
    batch = spec("gpt2", rows=4, seq=128)
    step = FakeStep(model, None)
    derived = step.trace(batch, checkpointing=True)
    same_step(derived, step.traced(batch, checkpointing=True))
    short, long = (s.traced(batch, checkpointing=True) for s in step._shallow)
    assert short.parts["gradients"] < short.parts["activations"] + short.parts["temporaries"]  # the logits' moment
    assert derived.parts["gradients"] > derived.parts["activations"] + derived.parts["temporaries"]  # the end
    secant = short.peak + (40 - 2) * (long.peak - short.peak)
    assert abs(secant / derived.peak - 1) > 0.05, "the case does not tell the two apart"


def test_blocks_of_different_sizes_are_traced_at_full_depth():
    model = build("gpt2")
    wider = GPT2LMHeadModel(GPT2Config(vocab_size=2000, n_positions=256, n_embd=128, n_layer=LAYERS, n_head=2,
                                       n_inner=1024)).transformer.h[-1]
    model.transformer.h[-1] = wider  # a top block with a wider MLP: no line through the copies reaches it
    assert find_blocks(model) is None
    step = FakeStep(model, None)
    trace = step.trace(spec("gpt2"))
    assert trace.derived == "" and trace.peak == step.traced(spec("gpt2")).peak


def test_a_shallow_model_is_traced_at_full_depth():
    step = FakeStep(build("gpt2", layers=MIN_BLOCKS - 1), None)
    assert step.trace(spec("gpt2")).derived == ""


def test_the_user_model_is_left_as_it_is():
    model = build("qwen-lora")
    before = ({n: (tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()},
              len(model.base_model.model.model.layers), model.config.num_hidden_layers)
    FakeStep(model, None).trace(spec("qwen"), checkpointing=True)
    after = ({n: (tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()},
             len(model.base_model.model.model.layers), model.config.num_hidden_layers)
    assert after == before
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_a_plan_says_what_it_traced_and_derived_and_that_it_is_working(capsys, monkeypatch):
    monkeypatch.setattr(planrows, "SAY_AFTER_S", 0.0)  # a real plan says so after 2 s; this one is quick
    model = build("gpt2")
    ids = torch.zeros(4, 128, dtype=torch.long)
    plan = ck.plan_memory(model, batch={"input_ids": ids, "labels": ids}, gpu="T4")
    said = capsys.readouterr().out
    assert re.search(r"^memory plan: \d+ s, tracing fp32, checkpointing off \(1 of ", said, re.M), said  # its seconds: the load
    note = next(n for n in plan.notes if "configurations traced" in n)
    assert f"from copies of 2 and 3 of its {LAYERS} blocks and derived for all {LAYERS}" in note
    full = ck.plan_memory(model, batch={"input_ids": ids, "labels": ids}, gpu="T4", full_depth=True,
                          verbose=False)
    assert "traced at full depth" in next(n for n in full.notes if "configurations traced" in n)
    assert [r.peak for r in plan.rows] == pytest.approx([r.peak for r in full.rows], rel=1e-3)


def test_a_model_that_needs_all_its_blocks_is_traced_at_full_depth():
    class Counted(torch.nn.Module):  # its forward checks its block count, as some models' code reads its config
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(LAYERS))

        def forward(self, x):
            assert len(self.blocks) == LAYERS, "built with another depth"
            for block in self.blocks:
                x = block(x)
            return (x.square().mean(),)

    step = FakeStep(Counted(), None)
    trace = step.trace({"x": ((4, 16), torch.float32)})
    assert trace.derived == "" and trace.peak == step.traced({"x": ((4, 16), torch.float32)}).peak
