"""Offline stand-ins for what the notebooks' `full` presets download, placed where the downloads land.

The hub and the dataset hosts are out of reach here, so the rehearsal of the `full` presets
(tests/test_full_rehearsal.py) builds tiny random-weight models of the real classes and puts
them, and the data, exactly where an earlier online run would have left them:

- models in the Hugging Face hub cache (`$XDG_CACHE_HOME/huggingface/hub/models--ORG--NAME/`:
  blobs, a snapshot of symlinks, `refs/main`), under the real repository ids;
- wikitext-2 in `datasets`' prepared cache (`.../datasets/Salesforce___wikitext/wikitext-2-raw-v1/
  0.0.0/<commit>/`), written by `datasets`' own Parquet builder as a Hub load does;
- the nRC FASTA files in colab_kit's download cache (`rna.download_path`).

With HF_HUB_OFFLINE=1 the notebooks' real loading calls (`from_pretrained`, `load_dataset`,
`rna.read_sequences(url)`) then find them without a network. Nothing here is copied into the
project: it all lives in a temporary cache folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

# What a commit id looks like; any fixed 40-hex string does (offline, refs/main is all that is read).
COMMIT = "0" * 39 + "1"


def offline_env(cache: Path) -> dict[str, str]:
    """Environment variables that send every cache to `cache` and keep every library offline."""
    return {"XDG_CACHE_HOME": str(cache), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def put_in_hub_cache(cache: Path, repo_id: str, folder: Path) -> Path:
    """Store `folder`'s files as the hub cache stores a download of `repo_id`; returns the snapshot."""
    repo = cache / "huggingface" / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / path.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def save_rnafm_standin(folder: Path) -> None:
    """A 2-layer RNA-FM of multimolecule's own classes, with its RNA tokenizer (random weights)."""
    from multimolecule import RnaFmConfig, RnaFmForMaskedLM, RnaTokenizer

    tokenizer = RnaTokenizer()
    config = RnaFmConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64)
    RnaFmForMaskedLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def save_distilgpt2_standin(folder: Path, texts: list[str]) -> None:
    """A 2-layer GPT-2 with a byte-level BPE tokenizer (GPT-2's kind) trained on `texts` here, in the
    files the `distilgpt2` repository holds: the tokenizer class comes from config.json's model type."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Config, GPT2LMHeadModel

    folder.mkdir(parents=True, exist_ok=True)
    core = ByteLevelBPETokenizer()
    core.train_from_iterator(texts, vocab_size=800, min_frequency=2, special_tokens=["<|endoftext|>"])
    core.save_model(str(folder))  # vocab.json, merges.txt
    core.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1024}))
    eos = core.token_to_id("<|endoftext|>")
    config = GPT2Config(vocab_size=core.get_vocab_size(), n_positions=1024, n_embd=64, n_layer=2, n_head=2,
                        bos_token_id=eos, eos_token_id=eos)
    GPT2LMHeadModel(config).save_pretrained(folder)


def put_wikitext_in_datasets_cache(cache: Path, splits: dict[str, list[str]]) -> Path:
    """Prepare `splits` (lines of text) where `load_dataset("Salesforce/wikitext", "wikitext-2-raw-v1")`
    leaves its prepared copy: the Hub repository holds Parquet files, which `datasets` turns into Arrow
    files with its Parquet builder under `Salesforce___wikitext/<config>/0.0.0/<commit>/`."""
    import datasets
    from datasets.packaged_modules.parquet.parquet import Parquet

    target = cache / "huggingface" / "datasets" / "Salesforce___wikitext" / "wikitext-2-raw-v1" / "0.0.0" / COMMIT
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for split, lines in splits.items():
            files[split] = f"{tmp}/{split}-00000-of-00001.parquet"
            datasets.Dataset.from_dict({"text": lines}).to_parquet(files[split])
        builder = Parquet(cache_dir=f"{tmp}/work", dataset_name="wikitext", config_name="wikitext-2-raw-v1",
                          hash=COMMIT, data_files=files)
        builder.download_and_prepare(output_dir=str(target))
    return target


def put_downloads(cache: Path, files: dict[str, Path]) -> None:
    """Place local copies of `files` (URL -> file) where colab_kit keeps its downloads."""
    from unittest import mock

    from colab_kit.rna import download_path

    with mock.patch.dict(os.environ, {"XDG_CACHE_HOME": str(cache)}):
        for url, path in files.items():
            target = download_path(url)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
