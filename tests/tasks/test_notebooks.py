"""The notebooks: committed clean, with their parameters cell and Colab metadata; run headless."""

import json
import os
import time
from pathlib import Path

import pytest
from hub_checks import head_files, verified_on_hub
from notebook_runs import events, kill_after_first_durable_checkpoint_and_rerun, printed, run_notebook  # noqa: E402
from project import ROOT  # noqa: E402

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
RNA = ROOT / "notebooks" / "rna_bert_classification.ipynb"
COMMON = {"RUN_NAME", "PRESET", "MAX_STEPS", "DRIVE_DIR", "BATCH_SIZE", "EPOCHS", "LEARNING_RATE", "SAVE_EVERY",
          "ALLOW_CPU"}
REQUIRED = {
    "rna_bert_classification.ipynb": COMMON | {"MODEL", "TRAIN_DATA", "TEST_DATA", "MAX_LENGTH", "KMER"},
    "distilgpt2_finetune.ipynb": COMMON | {"MODEL_NAME", "BLOCK_SIZE", "FREEZE_LAYERS"},
    "lora_finetune.ipynb": COMMON | {"MODEL_NAME", "BLOCK_SIZE", "QUANTIZE", "LORA_RANK", "MERGE"},
}


def load(path):
    return json.loads(path.read_text())


def parameters_cell(nb):
    tagged = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1
    return "".join(tagged[0]["source"])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_clean_with_parameters_and_colab_gpu_metadata(path):
    nb = load(path)
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [] and cell.get("execution_count") is None, "clear the outputs"
    assert "widgets" not in nb["metadata"]
    assert nb["metadata"]["accelerator"] == "GPU" and nb["metadata"]["colab"]["gpuType"] == "T4"
    source = parameters_cell(nb)
    names = {line.split("=")[0].strip() for line in source.splitlines() if "=" in line}
    assert REQUIRED[path.name] <= names
    for line in source.splitlines():  # plain literals only: papermill replaces them
        value = line.split("=", 1)[1].split("#")[0].strip()
        compile(value, "parameter", "eval")
        assert "(" not in value, f"no logic in the parameters cell: {line}"
    first = "".join(nb["cells"][0]["source"])
    assert "colab-badge.svg" in first and f"notebooks/{path.name}" in first


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_valid_with_cell_ids_as_nbformat_writes_them(path):
    """A cell without an id makes nbformat warn in the middle of the main job's output (MissingIDFieldWarning)."""
    import warnings

    import nbformat

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
    ids = [cell.get("id") for cell in nb.cells]
    assert all(ids) and len(set(ids)) == len(ids), "give every cell a unique id (nbformat 4.5)"
    assert path.read_text() == nbformat.writes(nb) + "\n", "write the notebook as nbformat does (sorted keys)"


def test_rna_notebook_never_applies_an_english_wordpiece_tokenizer():
    import inspect

    from colab_kit import rna

    code = "".join("".join(c["source"]) for c in load(RNA)["cells"] if c["cell_type"] == "code")
    built_by = inspect.getsource(rna.build_model)  # where the notebook's tokenizer comes from
    for forbidden in ("bert-base-uncased", "BertTokenizer", "AutoTokenizer"):
        assert forbidden not in code and forbidden not in built_by
    assert "rna.build_model" in code and "nucleotide_tokenizer" in built_by and "RnaTokenizer" in built_by


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_code_cell_is_one_short_step(path):
    # The notebooks read as recipes: parameter checks and presets live in the kit (resolve_settings).
    for cell in load(path)["cells"]:
        if cell["cell_type"] == "code":
            lines = "".join(cell["source"]).splitlines()
            assert len(lines) <= 18, f"a {len(lines)}-line cell: {lines[0]}"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_the_full_preset_without_a_gpu_stops_at_once_unless_allowed(path, tmp_path):
    started = time.monotonic()
    proc = run_notebook(path, tmp_path, ("PRESET", "full"))
    seconds = time.monotonic() - started
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and 'PRESET = "full" needs a GPU, and this runtime has none' in text, text[-3000:]
    assert "T4 GPU" in text and "ALLOW_CPU = True" in text
    assert not (tmp_path / "drive").exists()  # stopped before start_run made anything
    assert seconds < 90, f"took {seconds:.0f} s (kernel start included)"
    if path != RNA:
        return  # the GPT-2 notebook's full preset runs with ALLOW_CPU in test_full_rehearsal.py, always
    # ALLOW_CPU=True goes past the check (and here stops later, at the download: no network, and offline
    # at once rather than after the hub's connection timeouts); the RNA rehearsal needs the nRC files.
    allowed = run_notebook(path, tmp_path, ("PRESET", "full"), ("ALLOW_CPU", "True"), ("MAX_STEPS", "1"),
                           env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert "needs a GPU" not in allowed.stdout + allowed.stderr and (tmp_path / "drive").exists()


def killed_then_run_to_the_end(notebook, workdir, run_name, *params, hub=None) -> tuple[Path, dict]:
    """Run the notebook, kill its kernel once a checkpoint is in the cloud, run it again: it must resume
    from there, finish and leave a verified `final/`. Returns (run folder, metrics).

    With `hub` (the emulated Hub), the run is kept on the Hub (DRIVE_DIR = "hf://user/runs"), killed once a
    checkpoint is confirmed there, and run again on a new VM (nothing on its disk): it comes back from the Hub,
    and the Hub holds its newest checkpoint and final/ whole, each file with the manifest's sha256."""
    from colab_kit.checkpoints.validity import verify_folder

    run_dir, env, durable_event = workdir / "drive" / run_name, None, "sync"
    if hub is not None:
        params = (("DRIVE_DIR", "hf://user/runs"), *params)
        env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_test", "HF_HUB_DISABLE_XET": "1",
               "HF_HOME": str(workdir / "hf_home")}
        run_dir, durable_event = workdir / "scratch" / f"{run_name}.hub", "cloud"  # the replica, beside the scratch
    durable, second, said = kill_after_first_durable_checkpoint_and_rerun(
        notebook, workdir, run_dir, *params, env=env, new_vm=hub is not None, durable_event=durable_event)
    resumed = [e for e in second if e["event"] == "resume"]
    assert resumed and resumed[0]["step"] >= durable
    assert verify_folder(run_dir / "final") is None
    summary = json.loads((run_dir / "metrics.json").read_text())
    # The terminal ends with the result: the headline of metrics.json, the run folder, the newest checkpoint.
    newest = max(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("checkpoint-*"))
    tail = said[said.index("done in "):]
    assert f"run folder: {run_dir} ({summary['steps']} steps)" in tail, tail
    assert f"newest checkpoint: checkpoint-{newest}; exported model: {run_dir / 'final'}" in tail
    if "perplexity_after" in summary:
        assert f"{summary['perplexity_after']:.2f} after training" in tail
    else:
        test = summary["metrics"]["test"]
        assert f"test: accuracy {test['accuracy']:.3f}, macro-F1 {test['macro_f1']:.3f}, MCC {test['mcc']:.3f}" in tail
    if hub is not None:
        files = head_files(hub)
        assert verified_on_hub(files, f"{run_name}/checkpoints/checkpoint-{newest}")
        assert verified_on_hub(files, f"{run_name}/final")
        assert files[f"{run_name}/metrics.json"].content == (run_dir / "metrics.json").read_bytes()
    return run_dir, summary


@pytest.mark.slow(65)
def test_rna_quick_preset_on_the_hub_killed_then_resumed_on_a_new_vm_learns(hub_env, tmp_path):
    # On a plain folder the RNA notebook runs whole in the pretraining test below (and as the README's main job).
    run_dir, summary = killed_then_run_to_the_end(RNA, tmp_path, "rna-bert", hub=hub_env)
    assert summary["metrics"]["test"]["accuracy"] >= 0.9
    assert {"macro_f1", "mcc", "confusion", "per_class"} <= set(summary["metrics"]["test (de-duplicated)"])
    assert {"model.safetensors", "config.json", "tokenizer.json", "metrics.json"} <= {p.name for p in (run_dir / "final").iterdir()}
    assert [e["event"] for e in events(run_dir)][0] == "start" and any(e["event"] == "finish" for e in events(run_dir))


@pytest.mark.slow(55)
def test_rna_notebook_pretrains_the_scratch_model_in_its_own_run_then_fine_tunes(tmp_path):
    from colab_kit.checkpoints.validity import verify_folder

    proc = run_notebook(RNA, tmp_path, ("PRETRAIN_EPOCHS", "1"), ("EPOCHS", "2"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    pretrain_dir, run_dir = tmp_path / "drive" / "rna-bert-mlm", tmp_path / "drive" / "rna-bert"
    assert verify_folder(pretrain_dir / "final") is None
    assert json.loads((pretrain_dir / "final" / "metrics.json").read_text())["epochs"] == 1
    # a plain folder: final/ counts as in the cloud as soon as it is written and read back
    assert [e["event"] for e in events(pretrain_dir)][-3:] == ["finish", "final", "cloud"]
    assert events(pretrain_dir)[-1]["what"] == "final"
    assert json.loads((run_dir / "metrics.json").read_text())["steps"] == 58  # 2 epochs of 900 // 32 + 1 steps


@pytest.mark.slow
def test_rna_notebook_stops_on_a_bad_parameter_with_the_kits_message(tmp_path):
    # Every check is tested as a function (tests/tasks/test_settings.py); here one reaches the user.
    proc = run_notebook(RNA, tmp_path, ("KMER", "7"))
    assert proc.returncode == 1 and "KMER=7: give 1 (one token per nucleotide)" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_rna_notebook_stops_on_a_bad_file_with_its_message(tmp_path):
    bad = tmp_path / "train.fasta"
    bad.write_text("ACGUACGU\n>r1 x\nACGU\n")
    good = tmp_path / "test.fasta"
    good.write_text(">r1 x\nACGU\n")
    proc = run_notebook(RNA, tmp_path, ("TRAIN_DATA", str(bad)), ("TEST_DATA", str(good)))
    assert proc.returncode == 1
    assert "RnaDataError" in proc.stderr and "train.fasta, line 1: sequence data before the first '>'" in proc.stderr


GPT2 = ROOT / "notebooks" / "distilgpt2_finetune.ipynb"


ON_A_FOLDER = pytest.param("folder", marks=pytest.mark.skipif(
    not os.environ.get("COLAB_KIT_VERSION_MATRIX"), reason="on a plain folder it runs in .ci/version_matrix (the "
    "lowest transformers); the main suite runs it on the Hub, and the LoRA and RNA notebooks on plain folders"))


@pytest.mark.slow(90)
@pytest.mark.parametrize("store", [ON_A_FOLDER, "hub"])
def test_gpt2_quick_preset_killed_after_a_durable_checkpoint_resumes_and_lowers_perplexity(tmp_path, request, store):
    hub = request.getfixturevalue("hub_env") if store == "hub" else None  # the Hub: killed, a new VM, resumed
    _, metrics = killed_then_run_to_the_end(GPT2, tmp_path, "distilgpt2-wikitext", hub=hub)
    assert metrics["perplexity_after"] < metrics["perplexity_before"] / 5
    said = printed(tmp_path)
    assert "layer 'lm_head2' is Linear(50257 -> 50257)" in said  # the seed's model, flagged
    assert "preflight: no problems found" in said  # this notebook's configuration


LORA = ROOT / "notebooks" / "lora_finetune.ipynb"


@pytest.mark.slow(90)
def test_lora_quick_preset_killed_after_a_durable_checkpoint_resumes_learns_and_exports_adapter_and_merged(tmp_path):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, metrics = killed_then_run_to_the_end(LORA, tmp_path, "lora-instruct", ("MERGE", "True"))
    assert metrics["steps"] == 33 and metrics["merged"] is True and metrics["four_bit"] is False
    assert metrics["perplexity_after"] < metrics["perplexity_before"] / 20
    said = printed(tmp_path)
    assert "LoRA rank 8 on every linear layer" in said and "trainable params: 16,384" in said

    # Checkpoints hold the adapter, not the model: its weights are the trainable parameters only.
    final, newest = run_dir / "final", run_dir / "checkpoints" / "checkpoint-33"
    adapter = load_file(newest / "adapter_model.safetensors")
    assert sum(t.numel() for t in adapter.values()) == 16_384 and all("lora_" in name for name in adapter)
    assert not (newest / "model.safetensors").exists()
    merged_file = final / "merged" / "model.safetensors"
    assert (newest / "adapter_model.safetensors").stat().st_size * 5 < merged_file.stat().st_size  # 16 k of 147 k

    # final/ holds the adapter (loaded here onto the quick preset's base, built again from its seed), and
    # merged/ the same model with the adapter folded in.
    from colab_kit import lora

    base = lora.build_model(lora.resolve_settings("quick"), AutoTokenizer.from_pretrained(final), seed=42).unload()
    with_adapter = PeftModel.from_pretrained(base, final).eval()
    merged = AutoModelForCausalLM.from_pretrained(final / "merged").eval()
    ids = torch.randint(0, merged.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(with_adapter(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-4)
