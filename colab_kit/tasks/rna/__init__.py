"""RNA sequence classification, as the RNA notebook does it (`from colab_kit import rna`).

    settings = rna.resolve_settings(PRESET, model=MODEL, kmer=KMER, ...)   # the parameters, checked
    splits = rna.prepare_splits(rna.read_sequences(settings.train), rna.read_sequences(settings.test))
    tokenizer, model = rna.build_model(settings, splits.labels, max_length)
    metrics = rna.evaluate(trainer, {"test": rna.to_dataset(splits.test, tokenizer, ...)}, splits.labels)

The modules: `files` (reading FASTA and CSV/TSV), `data` (cleaning, lengths, generated families,
splits), `model` (nucleotide and k-mer tokens, datasets, models, prediction), `pretrain` (masked-LM
self-pre-training), `metrics` and `settings` (the notebook's parameters against its presets).
"""

from .data import (CleaningReport, Splits, check_test_labels, choose_max_length, clean_records, generate_rna_families,
                   length_label_association, length_stats, prepare_splits, seen_in_training, stratified_split)
from .files import NUCLEOTIDES, Records, RnaDataError, download_path, read_sequences
from .metrics import accuracy, classification_metrics, evaluate
from .model import (MAX_K, as_token_text, build_model, kmer_size, nucleotide_tokenizer, predict, scratch_bert_config,
                    scratch_config, to_dataset)
from .pretrain import pretrain_encoder, pretrain_masked_lm
from .settings import PRESETS, RnaSettings, resolve_settings

__all__ = ["RnaDataError", "Records", "CleaningReport", "read_sequences", "clean_records", "check_test_labels",
           "seen_in_training", "length_stats", "choose_max_length", "nucleotide_tokenizer", "kmer_size",
           "as_token_text", "generate_rna_families", "stratified_split", "classification_metrics", "NUCLEOTIDES",
           "to_dataset", "predict", "scratch_bert_config", "length_label_association", "pretrain_masked_lm",
           "download_path", "MAX_K", "Splits", "prepare_splits", "accuracy", "evaluate", "build_model",
           "scratch_config", "pretrain_encoder", "PRESETS", "RnaSettings", "resolve_settings"]
