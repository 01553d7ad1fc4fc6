"""OOM detection, MicroBatcher exactness and bounds, free_memory, the allocator setting."""

import os
import subprocess
import sys

import pytest
import torch

import colab_kit as ck
from colab_kit.memory.oom import is_fatal_cuda_error, split_batch
from colab_kit.memory.splitstep import MicroBatcher
from colab_kit.memory.oomforms import OOM_FORMS as FORM_TABLE
from colab_kit.memory.oomforms import oom_form


def _wrapped(inner, how):
    try:
        try:
            raise inner
        except Exception as exc:
            if how == "cause":
                raise RuntimeError("training step failed") from exc
            raise ValueError("while handling it, something else failed")  # noqa: B904 - an implicit __context__
    except Exception as outer:
        return outer


def _accelerator_error(text, code):
    exc = torch.AcceleratorError(text)
    exc.error_code = code  # what torch/csrc/Exceptions.cpp sets from c10::AcceleratorError
    return exc


OOM_FORMS = [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 14.75 GiB total capacity)"),
    torch.cuda.OutOfMemoryError("anything: the type alone is enough"),
    RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"),  # before torch 1.13 it was a RuntimeError
    RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a "
                 "non-contiguous input."),
    RuntimeError("HIP out of memory. Tried to allocate 1.00 GiB"),
    RuntimeError("XPU out of memory. Tried to allocate 512.00 MiB"),
    RuntimeError("MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1 MB)"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                  "you tried to allocate 10737418240 bytes. Error code 12 (Cannot allocate memory)"),
    MemoryError(),
    ck.OutOfMemoryError("even a micro-batch of 1 does not fit"),
    # Issue 21: the bare allocator sentence, without its period (Composer's and Lightning's tests, wrappers).
    RuntimeError("CUDA out of memory"),
    RuntimeError("CUDA out of memory (re-raised by an extension)"),
    RuntimeError("Caught RuntimeError in replica 0 on device 0.\nOriginal Traceback: ... CUDA out of memory"),
    # Issue 13: the forms the kit missed.
    RuntimeError("CUDA driver error: out of memory"),  # expandable segments (cuMemCreate)
    RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
    torch.AcceleratorError("HIP error: out of memory\nHIP kernel errors might be asynchronously reported at "
                           "some other API call, so the stacktrace below might be incorrect."),
    _accelerator_error("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported", 2),
    RuntimeError("[enforce fail at alloc_cpu.cpp:114] data. DefaultCPUAllocator: not enough memory: you "
                 "tried to allocate 8589934592 bytes."),
]
NOT_OOM = [
    RuntimeError("CUDA error: device-side assert triggered\nCompile with `TORCH_USE_CUDA_DSA`"),
    RuntimeError("CUDA error: an illegal memory access was encountered"),
    RuntimeError("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"),
    RuntimeError("CUDA error: unspecified launch failure"),
    ValueError("Expected input batch_size (16) to match target batch_size (32)."),
    KeyError("labels"),
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (16x32 and 64x2)"),
    # cuDNN v8's warning (aten/src/ATen/native/cudnn/Conv_v8.cpp), an error only under
    # warnings.simplefilter("error"): a plan that is not supported, not a lack of memory.
    UserWarning("Plan failed with a cudnnException: CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR: cudnnFinalize "
                "Descriptor Failed cudnn_status: CUDNN_STATUS_NOT_SUPPORTED (Triggered internally at "
                "/pytorch/aten/src/ATen/native/cudnn/Conv_v8.cpp:919.)"),
    RuntimeError("CUDA driver error: invalid argument"),
    _accelerator_error("CUDA error: an illegal memory access was encountered", 700),
    _accelerator_error("HIP error: unspecified launch failure", 719),
    _accelerator_error("probability tensor contains either `inf`, `nan` or element < 0", 2),  # MPS, not CUDA
]


@pytest.mark.parametrize("exc", OOM_FORMS, ids=lambda e: type(e).__name__ + ":" + str(e)[:30])
@pytest.mark.parametrize("how", ["direct", "cause", "context"])
def test_every_oom_form_is_recognised_also_when_wrapped(exc, how):
    assert ck.is_oom_error(exc if how == "direct" else _wrapped(exc, how))


@pytest.mark.parametrize("exc", NOT_OOM, ids=lambda e: str(e)[:40])
@pytest.mark.parametrize("how", ["direct", "cause", "context"])
def test_other_errors_are_not_oom(exc, how):
    assert not ck.is_oom_error(exc if how == "direct" else _wrapped(exc, how))


def test_every_form_of_the_table_is_exercised_and_names_its_source():
    hit = {oom_form(exc).name for exc in OOM_FORMS}
    assert hit == {form.name for form in FORM_TABLE}
    assert all(len(form.source) > 20 for form in FORM_TABLE)


def test_the_new_forms_are_found_by_the_right_entry():
    assert oom_form(OOM_FORMS[-5]).name == "CUDA driver API"
    assert oom_form(OOM_FORMS[-4]).name == "cuDNN allocation"
    assert oom_form(OOM_FORMS[-3]).name == "HIP runtime API"
    assert oom_form(OOM_FORMS[-2]).name == "torch.AcceleratorError with an out-of-memory code"
    assert oom_form(OOM_FORMS[-1]).name == "CPU allocator (Windows)"


def test_fatal_cuda_errors_are_told_apart():
    assert is_fatal_cuda_error(NOT_OOM[-2]) and is_fatal_cuda_error(NOT_OOM[-3])  # AcceleratorErrors
    assert not is_fatal_cuda_error(OOM_FORMS[-3]) and not is_fatal_cuda_error(OOM_FORMS[-2])
    assert is_fatal_cuda_error(NOT_OOM[0]) and is_fatal_cuda_error(NOT_OOM[1])
    assert not is_fatal_cuda_error(OOM_FORMS[2]) and not is_fatal_cuda_error(NOT_OOM[4])


def test_a_self_referencing_chain_terminates():
    exc = RuntimeError("loop")
    exc.__context__ = exc
    assert not ck.is_oom_error(exc)


# -- MicroBatcher ------------------------------------------------------------------------------

def tiny_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(20, 8), torch.nn.Linear(8, 20))


def lm_batch(rows=32, length=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 20, (rows, length), generator=g)
    lengths = torch.randint(2, length + 1, (rows,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": labels}


def lm_loss(model, b):
    logits = model(b["input_ids"])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100)


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_split_step_gives_the_unsplit_gradient_weighted_by_tokens():
    batch = lm_batch()
    reference = tiny_model()
    lm_loss(reference, batch).backward()

    model = tiny_model()
    seen = []

    def forward(b):
        seen.append(b["input_ids"].shape[0])
        if b["input_ids"].shape[0] > 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return lm_loss(model, b)

    mb = MicroBatcher(on_backoff=lambda r: None)
    loss = mb.step(batch, forward, model=model, weight="tokens")
    assert mb.micro_batch == 8 and [b["from"] for b in mb.backoffs] == [32, 16]
    assert seen == [32, 16, 8, 8, 8, 8]
    assert torch.allclose(loss, lm_loss(tiny_model(), batch), atol=1e-6)
    for a, b in zip(grads(reference), grads(model)):
        assert torch.allclose(a, b, atol=1e-6)


def test_oom_in_a_later_micro_batch_discards_the_partial_gradients():
    batch = lm_batch()
    reference = tiny_model()
    lm_loss(reference, batch).backward()
    model = tiny_model()
    calls = {"n": 0}

    def forward(b):
        calls["n"] += 1
        if calls["n"] == 2:  # the second micro-batch fails after the first one's backward
            raise RuntimeError("CUDA error: out of memory")
        return lm_loss(model, b)

    mb = MicroBatcher(micro_batch=16, on_backoff=lambda r: None)
    mb.step(batch, forward, model=model, weight="tokens")
    assert mb.micro_batch == 8
    for a, b in zip(grads(reference), grads(model)):
        assert torch.allclose(a, b, atol=1e-6)


def test_the_learned_size_is_kept_and_a_small_last_batch_does_not_shrink_it():
    model = tiny_model()
    mb = MicroBatcher(micro_batch=8, on_backoff=lambda r: None)
    mb.step(lm_batch(rows=5), lambda b: lm_loss(model, b), model=model)
    assert mb.micro_batch == 8


def test_grow_back_is_tried_once_after_clean_steps_and_not_repeated_after_failing():
    model = tiny_model()
    limit = {"rows": 16}

    def forward(b):
        if b["input_ids"].shape[0] > limit["rows"]:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return lm_loss(model, b)

    mb = MicroBatcher(micro_batch=8, grow_back_after=2, on_backoff=lambda r: None)
    sizes = []
    for _ in range(8):
        mb.step(lm_batch(), forward, model=model)
        sizes.append(mb.micro_batch)
    assert sizes == [8, 8, 16, 16, 16, 16, 16, 16]  # grew to 16; 32 failed once and is not tried again
    assert [(b["from"], b["to"]) for b in mb.backoffs] == [(32, 16)]


def test_even_one_sample_failing_is_a_bounded_error_with_a_diagnosis():
    model = tiny_model()

    def forward(b):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    mb = MicroBatcher(on_backoff=lambda r: None, diagnose=lambda: "Next steps: use fp16.")
    with pytest.raises(ck.OutOfMemoryError, match="even with a micro-batch of 1.*Next steps: use fp16") as info:
        mb.step(lm_batch(rows=4), forward, model=model)
    assert ck.is_oom_error(info.value) and isinstance(info.value, ck.ColabKitError)
    assert [b["to"] for b in mb.backoffs] == [2, 1]
    assert all(p.grad is None for p in model.parameters())


def test_other_errors_pass_through_untouched():
    model = tiny_model()
    with pytest.raises(KeyError, match="labels"):
        MicroBatcher().step({"x": torch.zeros(4, 2)}, lambda b: b["labels"], model=model)


def test_map_splits_evaluation_without_touching_gradients():
    batch = lm_batch(rows=12)
    mb = MicroBatcher(on_backoff=lambda r: None)

    def predict(b):
        if b["input_ids"].shape[0] > 4:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return b["input_ids"].sum(dim=1)

    chunks, outputs = mb.map(batch, predict)
    assert [c["input_ids"].shape for c in chunks] == [torch.Size([3, 10])] * 4  # 12 -> 6 -> 3; padding kept
    assert torch.equal(torch.cat(outputs), batch["input_ids"].sum(dim=1))


def test_split_batch_handles_dicts_tuples_tensors_and_trims_right_padding():
    batch = lm_batch(rows=6)
    batch["attention_mask"][:3, 7:] = 0
    batch["attention_mask"][3:, 5:] = 0
    first, second = split_batch(batch, 3)  # ordered by length first: the shorter rows come first
    assert first["input_ids"].shape == (3, 5) and second["labels"].shape == (3, 7)
    x, y = split_batch((torch.zeros(5, 2), torch.ones(5)), 2)[2]
    assert x.shape == (1, 2) and y.shape == (1,)
    assert [t.shape[0] for t in split_batch(torch.zeros(7, 3), 3)] == [3, 3, 1]


def test_a_split_batch_groups_rows_of_similar_length_and_keeps_them_whole():
    batch = lm_batch(rows=8, length=12, seed=3)
    batch["names"] = [f"row{i}" for i in range(8)]
    lengths = [int(n) for n in batch["attention_mask"].sum(dim=1)]
    chunks = split_batch(batch, 2)
    # every row once, with its own ids, labels and name; the shortest rows share a micro-batch
    rows = {}
    for chunk in chunks:
        for i, name in enumerate(chunk["names"]):
            n = int(chunk["attention_mask"][i].sum())
            rows[name] = (chunk["input_ids"][i, :n].tolist(), chunk["labels"][i, :n].tolist())
    assert rows == {f"row{i}": (batch["input_ids"][i, :lengths[i]].tolist(), batch["labels"][i, :lengths[i]].tolist())
                    for i in range(8)}
    assert [c["input_ids"].shape[1] for c in chunks] == sorted(lengths)[1::2]  # each cut to its longest row
    assert sum(c["input_ids"].numel() for c in chunks) < sum(c["input_ids"].numel() for c in _unsorted(batch, 2))
    # evaluation keeps the order (its outputs are concatenated back)
    assert [c["names"] for c in split_batch(batch, 2, trim_padding=False)] == [batch["names"][i:i + 2]
                                                                              for i in range(0, 8, 2)]


def _unsorted(batch, micro):
    rows = batch["input_ids"].shape[0]
    return [{k: v[i:i + micro] for k, v in batch.items() if hasattr(v, "shape")} for i in range(0, rows, micro)]


def test_plain_loop_with_a_grad_scaler_style_backward():
    model = tiny_model()
    scaled = []
    MicroBatcher().step(lm_batch(rows=4), lambda b: lm_loss(model, b), model=model,
                        backward=lambda loss: (scaled.append(loss), (loss * 2).backward()))
    assert len(scaled) == 1 and model[1].weight.grad is not None


# -- free_memory and the allocator -----------------------------------------------------------

def test_free_memory_is_safe_without_cuda_or_ipython(capsys):
    sys.last_value = RuntimeError("left by an uncaught exception")
    report = ck.free_memory()
    assert not hasattr(sys, "last_value") and report["dropped_references"] >= 1
    assert "no CUDA in use" in capsys.readouterr().out


def test_expandable_segments_are_set_at_import_when_unset():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    code = "import os, colab_kit; print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "expandable_segments:True"
    env["PYTORCH_CUDA_ALLOC_CONF"] = "max_split_size_mb:128"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "max_split_size_mb:128"  # the user's choice is kept


def test_a_warning_when_cuda_started_before_the_kit(monkeypatch):
    from colab_kit.memory.oom import configure_allocator

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.warns(ck.ColabKitWarning, match="CUDA was initialised before colab_kit"):
        configure_allocator()
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
