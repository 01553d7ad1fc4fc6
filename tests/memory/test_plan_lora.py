"""The memory plan for LoRA and QLoRA (issue 39): adapters on frozen weights, 4-bit weights with their
quantization state, prepare_model_for_kbit_training's upcasts, checkpointing, bf16, host RAM to merge.

Predictions are checked as in test_plan.py: the same step run for real under PyTorch's profiler, its
allocation events replayed to a peak (`tests/scripts/measured_peak.py`). The 4-bit layers are bitsandbytes'
own, quantized and run on the CPU (its CPU path dequantizes then multiplies, as its GPU path does for a
training step's more than 1,536 rows); a GPU's allocator and kernels are not checked here.
"""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, TrainingArguments

import colab_kit as ck
from colab_kit.memory import fourbit
from colab_kit.memory.steptrace import FakeStep
from adapter_models import VOCAB, qlora, with_adapter
from measured_peak import measured_step_peak



def base_model(kind):
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=256, n_embd=128, n_layer=2, n_head=2, attn_pdrop=0.0))


def batch(rows=8, seq=128):
    ids = torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def predicted(model, precision, checkpointing, four_bit=None):
    step = FakeStep(model, None, round_to=1, four_bit=four_bit)  # the CPU allocator does not round
    spec = {k: (tuple(v.shape), v.dtype) for k, v in batch().items()}
    return max(step.trace(spec, precision=precision, checkpointing=checkpointing).peak,
               step.trace_optimizer_step().peak), step


def measured(build, precision):
    def make():
        model = build()
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-5, foreach=True)

    return measured_step_peak(make, batch(), precision=precision)


LORA = [("llama", 8, False, "fp32"), ("llama", 8, True, "fp32"), ("llama", 32, False, "bf16"),
        ("llama", 16, True, "bf16"), ("gpt2", 8, False, "fp32"), ("gpt2", 16, True, "bf16"), ("gpt2", 4, False, "bf16")]


@pytest.mark.parametrize("kind,rank,checkpointing,precision", LORA)
def test_a_lora_step_is_planned_within_ten_percent_of_a_measured_one(kind, rank, checkpointing, precision):
    def build():
        return with_adapter(base_model(kind), rank, checkpointing)

    prediction, step = predicted(build(), precision, checkpointing)
    actual = measured(build, precision)
    error = (prediction - actual) / actual
    print(f"{kind} LoRA r={rank} checkpointing={checkpointing} {precision}: predicted {prediction:,} B, "
          f"measured {actual:,} B, {error:+.2%}")
    assert abs(error) <= 0.10
    # The frozen base takes no gradient and no optimizer state: only the adapter's parameters do.
    adapter = sum(p.numel() * 4 for p in build().parameters() if p.requires_grad)
    assert step.trainable == adapter and step.optimizer_state == 2 * adapter + 4 * len(step.optimizer.state)


needs_bitsandbytes = pytest.mark.skipif(not ck.lora.bitsandbytes_runs(),
                                        reason="bitsandbytes is not installed: .ci/qlora runs this with it "
                                               "(pip install -r requirements-qlora-test.txt)")


@needs_bitsandbytes
@pytest.mark.parametrize("rank,checkpointing,precision,double_quant",
                         [(8, False, "fp32", True), (16, True, "fp32", True), (8, False, "bf16", False),
                          (32, True, "bf16", True)])
def test_a_qlora_step_with_bitsandbytes_4_bit_weights_is_planned_within_ten_percent(tiny_llama_files, rank,
                                                                                    checkpointing, precision,
                                                                                    double_quant):
    def build():
        return qlora(tiny_llama_files, rank, checkpointing, double_quant)

    model = build()
    prediction, step = predicted(model, precision, checkpointing)
    actual = measured(build, precision)
    error = (prediction - actual) / actual
    print(f"QLoRA r={rank} checkpointing={checkpointing} {precision} double_quant={double_quant}: predicted "
          f"{prediction:,} B, measured {actual:,} B, {error:+.2%}")
    assert abs(error) <= 0.10
    assert step.four_bit_layers == 14  # 7 linear layers a block, 2 blocks; the head stays as it is
    # The packed weights and their quantization state, to the byte, as bitsandbytes holds them.
    held = sum(m.weight.numel() + sum(n * getattr(torch, d).itemsize for name, (n, d) in fourbit._real_sizes(m).items()
                                      if name != "weight")
               for m in model.modules() if fourbit.is_four_bit(m))
    planned = sum(m.weight.numel() + m.quant_state.numel() for m in step.model.modules()
                  if type(m).__name__ == "FourBitLinear")
    assert planned == held


@needs_bitsandbytes
def test_planning_a_model_as_qlora_loads_it_equals_planning_the_loaded_model(tiny_llama_files):
    """`plan_memory(..., four_bit=True)` on the model before quantization (sizes computed as bitsandbytes
    computes them, the upcasts as peft makes them) against the same model loaded in 4 bits: to the byte."""
    from transformers import AutoModelForCausalLM

    loaded, _ = predicted(qlora(tiny_llama_files, 16, True), "bf16", True)
    plain = with_adapter(AutoModelForCausalLM.from_pretrained(tiny_llama_files, dtype=torch.bfloat16), 16, True)
    planned, step = predicted(plain, "bf16", True, four_bit=torch.bfloat16)
    assert planned == loaded and step.four_bit_layers == 14
    for name, module in plain.named_modules():
        if fourbit.quantizable(name, module):
            assert "base_layer" in name  # never the adapter's own layers, never the head
    sizes = fourbit.four_bit_sizes(512, 256)
    assert sizes["weight"] == (65_536, "uint8") and sizes["absmax"] == (2_048, "uint8")
    assert sizes["nested_absmax"] == (8, "float32")


def test_a_plan_made_before_loading_names_the_4_bit_layers_and_the_host_ram_to_merge(capsys):
    with torch.device("meta"):  # planned before it exists anywhere: no memory at all
        model = with_adapter(base_model("llama").to(torch.bfloat16), 16, False)
    args = TrainingArguments("/tmp/unused", per_device_train_batch_size=8, fp16=True, report_to=[], use_cpu=True)
    plan = ck.plan_memory(model, args, batch=batch(), gpu="T4", four_bit=True)
    said = capsys.readouterr().out
    assert "14 linear layers in 4 bits (NF4, double quantization)" in said and "prepare_model_for_kbit_training" in said
    base = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert plan.host["merge"] == base * 2  # a 16-bit copy of the base
    assert plan.host["save"] < 4 * adapter * 4  # the adapter and its largest optimizer tensor, not the model
    assert "to merge the adapter" in said
    assert plan.chosen is not None and {r.precision for r in plan.rows} == {"fp32", "fp16"}  # a T4 has no bf16


def test_tied_embeddings_stay_one_tensor_when_planned_as_upcast():
    """prepare_model_for_kbit_training casts a tied embedding in place: one float32 tensor, not two."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                         dtype=torch.bfloat16)).to(torch.bfloat16)
    step = FakeStep(with_adapter(model, 4, False), None, round_to=1, four_bit=torch.float16)
    embedding = step.model.get_input_embeddings().weight
    assert embedding is step.model.get_output_embeddings().weight and embedding.dtype == torch.float32
    assert step.weights < 2 * VOCAB * 64 * 4  # the embeddings counted once
