"""RNA tokens and models: nucleotide and k-mer tokenizers, datasets, the from-scratch encoder,
the notebook's model (RNA-FM or from scratch, with optional masked-LM pre-training) and prediction.

An English WordPiece tokenizer is wrong for RNA: any "word" over 100 characters becomes a
single [UNK], which turns 74 % of the nRC training sequences into `[CLS] [UNK] [SEP]`. Here
every nucleotide is a token (A, C, G, U and the IUPAC ambiguity codes), or every overlapping
k-mer of A, C, G and U is, built locally with the `tokenizers` library: no download.
"""

from __future__ import annotations

import itertools

from ..._units import is_count
from .data import clean_records
from .files import NUCLEOTIDES, Records

__all__ = ["SPECIAL_TOKENS", "MAX_K", "nucleotide_tokenizer", "kmer_size", "as_token_text", "to_dataset", "predict",
           "scratch_bert_config", "scratch_config", "build_model"]

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
MAX_K = 6  # 4,096 k-mers; beyond that most k-mers are too rare in a few thousand sequences to learn


def nucleotide_tokenizer(model_max_length: int = 1024, k: int = 1):
    """A nucleotide tokenizer, built locally and savable with the model.

    k = 1: one token per nucleotide, `[CLS] A C G U ... [SEP]` (IUPAC ambiguity codes have their
    own tokens). k = 2 .. 6: one token per overlapping k-mer of A, C, G and U, DNABERT's scheme
    (for k = 3, ACGUA is `[CLS] ACG CGU GUA [SEP]`; a k-mer holding any other letter is [UNK]).
    A k-mer token hands the first layer a motif-sized unit: on nRC (2 x 128, 10 epochs, no
    pre-training) validation accuracy was 0.69 with k = 1, 0.85 with k = 3, 0.87 with k = 4 and
    0.83 with k = 5 (1,024 k-mers: it memorises the training set). The number of
    tokens stays the sequence length (minus k - 1), so the cost per step is the same.

    The tokenizer stores k (`kmer_size(tokenizer)`, kept through `save_pretrained`); with k > 1
    give it `as_token_text(sequences, k)`, not raw sequences. `to_dataset` and `predict` do that
    themselves.
    """
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if not is_count(k) or k > MAX_K:
        raise ValueError(f"k={k!r}: give 1 (one token per nucleotide) or a k-mer size from 2 to {MAX_K}")
    words = list(NUCLEOTIDES) if k == 1 else ["".join(t) for t in itertools.product("ACGU", repeat=k)]
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + words)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = (pre_tokenizers.Split(Regex("."), behavior="isolated") if k == 1
                          else pre_tokenizers.WhitespaceSplit())
    core.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    extra = {"kmer": k} if k > 1 else {}
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", model_max_length=model_max_length,
                                   model_input_names=["input_ids", "attention_mask"], **extra)


def kmer_size(tokenizer) -> int:
    """The k of a tokenizer from `nucleotide_tokenizer` (also after a reload); 1 for any other tokenizer."""
    return int(getattr(tokenizer, "init_kwargs", {}).get("kmer", 1))


def as_token_text(sequences: list[str], k: int) -> list[str]:
    """The text a k-mer tokenizer reads: each sequence as its overlapping k-mers, space-separated.
    k = 1 returns the sequences unchanged; a sequence shorter than k stays one (unknown) word."""
    if k == 1:
        return list(sequences)
    return [" ".join(s[i:i + k] for i in range(len(s) - k + 1)) if len(s) >= k else s for s in sequences]


def to_dataset(records: Records, tokenizer, max_length: int, label2id: dict[str, int]):
    """A `datasets.Dataset` of token ids (truncated, not padded: the collator pads per batch), labels
    and a `length` column (so length-grouped batching needs no pass over the data)."""
    import datasets

    data = datasets.Dataset.from_dict({"sequence": records.sequences,
                                       "label": [label2id[label] for label in records.labels]})

    def encode(batch):
        encoded = tokenizer(as_token_text(batch["sequence"], kmer_size(tokenizer)), truncation=True,
                            max_length=max_length)
        encoded["length"] = [len(ids) for ids in encoded["input_ids"]]
        return encoded

    return data.map(encode, batched=True, remove_columns=["sequence"])


def predict(model, tokenizer, sequences: list[str], max_length: int, batch_size: int = 64) -> tuple[list[int], list[float]]:
    """Predicted class ids and their probabilities for raw sequences (cleaned first)."""
    import torch

    cleaned = clean_records(Records(list(sequences), ["?"] * len(sequences), "input"))[0].sequences
    k = kmer_size(tokenizer)
    device = next(model.parameters()).device
    model.eval()
    ids, probs = [], []
    with torch.no_grad():
        for start in range(0, len(cleaned), batch_size):
            text = as_token_text(cleaned[start:start + batch_size], k)
            batch = tokenizer(text, truncation=True, max_length=max_length, padding=True, return_tensors="pt").to(device)
            batch.pop("token_type_ids", None)  # other tokenizers (RNA-FM's) may still make them
            logits = model(**batch).logits.float()
            p = torch.softmax(logits, dim=-1)
            best = p.argmax(dim=-1)
            ids += best.tolist()
            probs += p.gather(1, best[:, None]).squeeze(1).tolist()
    return ids, probs


def scratch_bert_config(vocab_size: int, num_labels: int, max_length: int, size: str = "small",
                        layers: int | None = None, dropout: float = 0.0):
    """A BERT-family encoder to train from scratch on nucleotide tokens: "small" (4 x 256) or "tiny" (2 x 128).

    `dropout` is applied in the embeddings, attention and MLP blocks (ModernBERT's default is
    none; `bench/rna_nrc.py` uses 0.1 with 4-mer tokens). `layers` overrides the size's depth
    (width stays). On nRC, 4 x 128 reached 0.76 validation
    accuracy after 10 epochs where 2 x 128 reached 0.64, at twice the time per epoch; over 22
    epochs after masked-LM pre-training, though, it ended at 0.75, so `bench/rna_nrc.py` keeps
    2 layers and spends the time on epochs.

    It has ModernBERT's layout (transformers' `ModernBertConfig`): rotary positions, pre-norm
    layers and mean pooling. On nRC, measured against a BERT of the same size: BERT with its
    [CLS] pooler reached 41 % validation accuracy after 3 epochs, with mean pooling 52 %, and
    this layout 53 % at half the time per epoch; on the quick preset's generated families it
    reaches 0.96-0.98 where BERT reached 0.945. Learned absolute positions make local motifs
    slow to learn from scratch; rotary positions are relative.

    The rotary base is 1,000 instead of ModernBERT's 160,000 (global) and 10,000 (local): a
    smaller base rotates more of the head's dimensions fast, so neighbouring nucleotides are told
    apart and short motifs are easier to learn. On nRC (2 x 128, 10 epochs) validation accuracy
    was 0.644 with ModernBERT's bases, 0.672 with 10,000 and 0.680 with 1,000.
    """
    from transformers import ModernBertConfig

    if size not in ("small", "tiny"):
        raise ValueError(f"size={size!r}: use 'small' (4 x 256) or 'tiny' (2 x 128)")
    if not 0 <= dropout < 1:
        raise ValueError(f"dropout={dropout!r}: give a probability from 0 (none) to below 1")
    if layers is not None and not is_count(layers):
        raise ValueError(f"layers={layers!r}: give a whole number of layers >= 1, or None for the size's own")
    hidden, depth = {"small": (256, 4), "tiny": (128, 2)}[size]
    return ModernBertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers or depth,
                            num_attention_heads=4,
                            intermediate_size=2 * hidden, max_position_embeddings=max(512, max_length),
                            local_attention=64, classifier_pooling="mean", num_labels=num_labels,
                            global_rope_theta=1000.0, local_rope_theta=1000.0,
                            embedding_dropout=dropout, attention_dropout=dropout, mlp_dropout=dropout,
                            pad_token_id=0, cls_token_id=2, sep_token_id=3, bos_token_id=2, eos_token_id=3)


def build_model(settings, labels: list[str], max_length: int, *, seed: int = 0, encoder=None):
    """The tokenizer and the classifier `settings` (from `resolve_settings`) name; returns (tokenizer, model).

    RNA-FM (or another multimolecule model) comes with its own tokenizer and loads with PyTorch's SDPA
    attention rather than multimolecule's eager default: the same logits (`bench/rnafm_attention.py`:
    within 4e-7), while eager keeps every layer's attention probabilities for backward (~5.7 GiB at
    32 x 448). A from-scratch model gets `nucleotide_tokenizer(k=settings.kmer)` and starts from
    `encoder` (a folder from `pretrain_masked_lm`) when given, else from random weights (seeded).
    """
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    label2id = {label: i for i, label in enumerate(labels)}
    id2label = dict(enumerate(labels))
    if not settings.scratch:
        from ..versions import check_multimolecule

        check_multimolecule()  # a clear message, not an ImportError, when transformers is older than 5.2
        from multimolecule import RnaFmForSequencePrediction, RnaTokenizer

        tokenizer = RnaTokenizer.from_pretrained(settings.model)
        config = AutoConfig.from_pretrained(settings.model, num_labels=len(labels), id2label=id2label,
                                            label2id=label2id)
        config.problem_type = "multiclass"  # multimolecule's name for single-label classification
        model = RnaFmForSequencePrediction.from_pretrained(settings.model, config=config, ignore_mismatched_sizes=True,
                                                           attn_implementation="sdpa")
        return tokenizer, model
    tokenizer = nucleotide_tokenizer(model_max_length=max_length, k=settings.kmer)
    config = scratch_config(settings, len(tokenizer), labels, max_length)
    torch.manual_seed(seed)
    if encoder is not None:
        return tokenizer, AutoModelForSequenceClassification.from_pretrained(str(encoder), config=config)
    return tokenizer, AutoModelForSequenceClassification.from_config(config)


def scratch_config(settings, vocab_size: int, labels: list[str], max_length: int):
    """`scratch_bert_config` for the from-scratch model `settings` names, with the label names."""
    config = scratch_bert_config(vocab_size, len(labels), max_length,
                                 size="tiny" if settings.model.endswith("tiny") else "small")
    config.id2label, config.label2id = dict(enumerate(labels)), {label: i for i, label in enumerate(labels)}
    return config
