"""RNA data: reading, the clear errors for each bad input, cleaning, tokens, lengths, overlap, metrics."""

import json

import pytest
from colab_kit.rna import (
    Records,
    RnaDataError,
    check_test_labels,
    choose_max_length,
    classification_metrics,
    clean_records,
    generate_rna_families,
    length_label_association,
    length_stats,
    nucleotide_tokenizer,
    read_sequences,
    seen_in_training,
    stratified_split,
)


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_fasta_records_with_multiline_sequences_and_labels(tmp_path):
    path = write(tmp_path, "train.fasta", ">RF1_a 5S_rRNA\nACGT\nacgt\n\n>RF2_b  some words miRNA\nGGGNNN\n")
    records = read_sequences(path)
    assert records.sequences == ["ACGTacgt", "GGGNNN"] and records.labels == ["5S_rRNA", "miRNA"]
    assert records.lines == [1, 5] and records.names == ["RF1_a", "RF2_b"]


@pytest.mark.parametrize("name, text", [("d.csv", "sequence,label\nACGU,x\nGGG,y\n"),
                                        ("d.tsv", "id\tSequence\tLabel\n1\tACGU\tx\n2\tGGG\ty\n")])
def test_csv_and_tsv_tables(tmp_path, name, text):
    records = read_sequences(write(tmp_path, name, text))
    assert records.sequences == ["ACGU", "GGG"] and records.labels == ["x", "y"] and records.lines == [2, 3]


@pytest.mark.parametrize("name, content, message", [
    ("no_header.fasta", "ACGU\n>r1 x\nACGU\n", r"no_header.fasta, line 1: sequence data before the first '>'"),
    ("empty_seq.fasta", ">r1 x\nACGU\n>r2 y\n>r3 z\nGG\n", r"empty_seq.fasta, line 3: record 'r2 y' has an empty sequence"),
    ("last_empty.fasta", ">r1 x\nACGU\n>r2 y\n", r"line 3: record 'r2 y' has an empty sequence"),
    ("no_label.fasta", ">r1 x\nACGU\n>lonely\nGG\n", r"no_label.fasta, line 3: record 'lonely' has no label"),
    ("cols.csv", "seq_id,nucleotides,class\n1,ACGU,x\n", r"cols.csv: no 'sequence' column \(columns found: seq_id, nucleotides, class\)"),
    ("nolabel.csv", "sequence,label\nACGU,x\nGGGG,\n", r"nolabel.csv, line 3: missing label"),
    ("emptyrow.csv", "sequence,label\n,x\n", r"emptyrow.csv, line 2: empty sequence"),
    ("binary.fasta", b"\x89PNG\r\n\x1a\n\x00\x00\x00", r"binary.fasta is not a text file"),
    ("latin.csv", "sequence,label\nACGU,caf\xe9\n".encode("latin-1"), r"latin.csv is not a UTF-8 text file"),
    ("empty.fasta", "", r"empty.fasta is empty"),
])
def test_each_bad_input_fails_with_a_message_naming_file_record_and_line(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(RnaDataError, match=message):
        read_sequences(path)


def test_missing_file_and_bad_url_say_what_to_give(tmp_path):
    with pytest.raises(RnaDataError, match="no such file.*Drive path.*URL"):
        read_sequences(tmp_path / "nope.fasta")
    with pytest.raises(RnaDataError, match="could not download http://127.0.0.1:9/x.fasta"):
        read_sequences("http://127.0.0.1:9/x.fasta")


def test_a_url_is_read_from_the_download_cache_under_xdg_cache_home(tmp_path, monkeypatch):
    from colab_kit.rna import download_path

    url = "http://127.0.0.1:9/data/train.fasta"  # nothing listens there: only the cached copy can be read
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cached = download_path(url)
    assert cached.parent == tmp_path / "cache" / "colab_kit" / "data" and cached.name.endswith("-train.fasta")
    assert download_path("http://127.0.0.1:9/other/train.fasta") != cached  # same name, other URL
    cached.parent.mkdir(parents=True)
    cached.write_text(">r1 tRNA\nACGU\n")
    assert read_sequences(url).labels == ["tRNA"]


def test_a_test_label_never_seen_in_training_is_refused(tmp_path):
    train = read_sequences(write(tmp_path, "train.fasta", ">a x\nACGU\n>b y\nGGG\n"))
    test = read_sequences(write(tmp_path, "test.fasta", ">c x\nACGU\n>d z\nCCC\n"))
    with pytest.raises(RnaDataError, match=r"test.fasta, line 3: label 'z' never occurs in the training data"):
        check_test_labels(train, test)


def test_cleaning_reports_what_changed(tmp_path):
    raw = read_sequences(write(tmp_path, "raw.fasta", ">a x\nacg t\n>b x\nACGU\n>c x\nAC*GX-U\n>d x\nRYKM\n"))
    cleaned, report = clean_records(raw)
    assert cleaned.sequences == ["ACGU", "ACGU", "ACNGNNU", "RYKM"]
    assert (report.changed, report.whitespace, report.lowercase, report.t_to_u) == (2, 1, 4, 1)
    assert report.replaced == {"*": 1, "X": 1, "-": 1}
    assert "2 of 4 sequences changed" in str(report) and "'*' x1" in str(report)


def test_the_tokenizer_gives_one_token_per_nucleotide_and_never_unk_for_rna():
    tokenizer = nucleotide_tokenizer()
    long_sequence = "ACGU" * 60  # a 240-character "word": WordPiece would make it one [UNK]
    ids = tokenizer(long_sequence)["input_ids"]
    assert len(ids) == 242 and tokenizer.unk_token_id not in ids
    assert tokenizer.convert_ids_to_tokens(tokenizer("GNRY")["input_ids"]) == ["[CLS]", "G", "N", "R", "Y", "[SEP]"]


def test_kmer_tokens_are_overlapping_known_after_a_reload_and_reach_the_dataset(tmp_path):
    from colab_kit.rna import as_token_text, kmer_size, to_dataset
    from transformers import AutoTokenizer

    tokenizer = nucleotide_tokenizer(model_max_length=64, k=3)
    assert as_token_text(["ACGUA", "AC"], 3) == ["ACG CGU GUA", "AC"] and as_token_text(["ACGUA"], 1) == ["ACGUA"]
    ids = tokenizer(as_token_text(["ACGUAN"], 3))["input_ids"][0]
    assert tokenizer.convert_ids_to_tokens(ids) == ["[CLS]", "ACG", "CGU", "GUA", "[UNK]", "[SEP]"]  # UAN: not ACGU
    assert len(tokenizer) == 5 + 4 ** 3 and kmer_size(tokenizer) == 3 and kmer_size(nucleotide_tokenizer()) == 1
    tokenizer.save_pretrained(tmp_path / "tok")
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert kmer_size(reloaded) == 3 and reloaded(as_token_text(["ACGUAN"], 3))["input_ids"][0] == ids
    records = Records(["ACGUAN", "GGGG"], ["x", "y"], "mem")
    data = to_dataset(records, reloaded, 64, {"x": 0, "y": 1})  # raw sequences in, k-mer ids out
    assert data["input_ids"][0] == ids and data["length"] == [6, 4]
    for bad in (0, 7, 2.5):
        with pytest.raises(ValueError, match="k-mer size from 2 to 6"):
            nucleotide_tokenizer(k=bad)


def test_kmer_masking_hides_whole_runs_so_neighbours_cannot_give_a_token_away():
    import torch
    from colab_kit.rna import as_token_text

    from colab_kit.tasks.rna.pretrain import _kmer_span_collator

    tokenizer = nucleotide_tokenizer(model_max_length=4096, k=3)
    rows = [{"input_ids": tokenizer(text)["input_ids"]} for text in as_token_text(["ACGUUGCA" * 250] * 4, 3)]
    torch.manual_seed(0)
    batch = _kmer_span_collator(tokenizer, 3)(rows)
    masked = batch["labels"] != -100
    inner = masked[:, 1:-1]
    share = inner.float().mean().item()
    assert 0.12 < share < 0.18  # about 15 % of the tokens, as with single nucleotides
    runs = [len(r) for row in inner.int().tolist() for r in "".join(map(str, row)).split("0") if r]
    assert min(runs) >= 3  # never a lone masked k-mer: its neighbours would spell it out
    assert not masked[:, 0].any() and not masked[:, -1].any()  # [CLS] and [SEP] stay
    to_mask = batch["input_ids"][masked] == tokenizer.mask_token_id
    assert 0.7 < to_mask.float().mean().item() < 0.9


def test_max_length_from_percentiles_capped_by_the_model():
    sequences = ["A" * n for n in range(10, 110)]  # lengths 10..109
    assert choose_max_length(sequences, 1024, percentile=95) == (112, 0)  # ceil(p95)=105, +2 special, up to 112
    assert choose_max_length(sequences, 64, percentile=95) == (64, 47)
    stats = length_stats(sequences)
    assert stats["min"] == 10 and stats["max"] == 109 and stats["p50"] == pytest.approx(59.5)


def test_duplicates_between_test_and_training_are_found(tmp_path):
    train = clean_records(read_sequences(write(tmp_path, "a.fasta", ">a x\nACGT\n>b y\nGGG\n")))[0]
    test = clean_records(read_sequences(write(tmp_path, "b.fasta", ">c x\nacgu\n>d y\nGGGA\n")))[0]
    assert seen_in_training(train, test) == [True, False]


def test_generated_families_exercise_cleaning_and_are_balanced():
    records = generate_rna_families(n_per_class=100, n_classes=4, seed=3)
    assert len(records) == 400 and len(set(records.labels)) == 4
    assert any("T" in s for s in records.sequences) and any(s.islower() for s in records.sequences)
    assert any("N" in s for s in records.sequences)
    assert records.sequences == generate_rna_families(n_per_class=100, n_classes=4, seed=3).sequences


def test_stratified_split_keeps_class_shares():
    labels = ["a"] * 90 + ["b"] * 10
    train, val = stratified_split(labels, fraction=0.1, seed=0)
    assert len(val) == 10 and sum(labels[i] == "b" for i in val) == 1 and not set(train) & set(val)


def test_metrics():
    metrics = classification_metrics(["a", "a", "b", "b"], ["a", "b", "b", "b"], ["a", "b"])
    assert metrics["accuracy"] == 0.75 and metrics["confusion"] == [[1, 1], [0, 2]]
    assert 0 < metrics["macro_f1"] < 1 and 0 < metrics["mcc"] < 1


def test_length_label_association_tells_when_length_grouping_would_sort_by_class():
    by_length = Records(["A" * 70, "A" * 75, "A" * 120, "A" * 125], ["tRNA", "tRNA", "5S", "5S"], "x")
    unrelated = Records(["A" * 70, "A" * 120, "A" * 70, "A" * 120], ["a", "a", "b", "b"], "x")
    assert length_label_association(by_length) > 0.95
    assert length_label_association(unrelated) == 0.0
    assert length_label_association(generate_rna_families(n_per_class=100, seed=1)) < 0.2


def test_masked_lm_pretraining_gives_the_classifier_its_encoder_and_is_not_redone_on_rerun(drive, local):
    import torch
    from colab_kit.rna import pretrain_masked_lm, scratch_bert_config
    from transformers import AutoModelForSequenceClassification

    import colab_kit as ck
    from colab_kit.checkpoints.journal import read_events

    records = clean_records(generate_rna_families(n_per_class=16, seed=3))[0]
    tokenizer = nucleotide_tokenizer(model_max_length=128)
    config = scratch_bert_config(len(tokenizer), 4, 128, size="tiny", layers=1)

    def pretrain():
        run = ck.start_run("mlm", drive=drive, local_dir=local, save_every=None, quiet=True, gauges=False)
        return run, pretrain_masked_lm(run, config, tokenizer, records, 128, epochs=2, batch_size=16, micro_batch=4)

    run, folder = pretrain()
    assert folder == run.drive_dir / "final" and (folder / "model.safetensors").is_file()
    losses = json.loads((folder / "metrics.json").read_text())["masked_lm_loss"]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5  # it learned something in its 8 steps
    first = AutoModelForSequenceClassification.from_pretrained(str(folder), config=config)
    encoder = {k: v.clone() for k, v in first.model.state_dict().items()}
    fresh = AutoModelForSequenceClassification.from_config(config)
    assert any(not torch.equal(v, fresh.model.state_dict()[k]) for k, v in encoder.items())  # learned, not fresh

    run, folder = pretrain()  # "Run all" again: the finished pre-training is reloaded, not redone
    events = [e["event"] for e in read_events(run.drive_dir / "events.jsonl")]
    assert events.count("complete") == 1
    again = AutoModelForSequenceClassification.from_pretrained(str(folder), config=config)
    assert all(torch.equal(v, again.model.state_dict()[k]) for k, v in encoder.items())

    with pytest.raises(ValueError, match="epochs=0"):
        pretrain_masked_lm(run, config, tokenizer, records, 128, epochs=0)
