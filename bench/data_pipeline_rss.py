"""Peak host RAM of the data pipeline: the crashed notebook's vs this kit's, on the same corpus.

    python bench/data_pipeline_rss.py [--articles 3000] [--max-length 1024] [--block-size 512]
                                      [--figure PATH | --no-figure]

Both pipelines read the same generated wikitext-like corpus from a text file with `datasets`
(memory-mapped Arrow, as wikitext-2 is), tokenize it with the same byte-level BPE tokenizer,
and then feed one epoch through a DataLoader as the Trainer would. Each runs in its own process;
peak RSS is that process's maximum resident set.

- seed: `tokenizer(..., padding="max_length", max_length=1024, return_tensors="pt")` inside
  `datasets.map`, after adding a `[PAD]` token: every line, empty ones too, becomes 1024 ids.
- kit: `text.tokenize_and_group` (no padding, no tensors; the token stream cut into blocks).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import figures


def pipeline(kind: str, corpus: Path, tokenizer_dir: Path, max_length: int, block_size: int) -> dict:
    import datasets
    import torch
    from transformers import PreTrainedTokenizerFast, default_data_collator

    from colab_kit import text

    started = time.perf_counter()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    raw = datasets.load_dataset("text", data_files={"train": str(corpus)}, cache_dir=str(corpus.parent / f"cache-{kind}"))
    if kind == "seed":
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
        data = raw["train"].map(lambda b: tokenizer(b["text"], padding="max_length", truncation=True,
                                                    max_length=max_length, return_tensors="pt"),
                                batched=True, remove_columns=["text"])
        data = data.map(lambda b: {"labels": b["input_ids"]}, batched=True)
    else:
        data = text.tokenize_and_group(raw, tokenizer, block_size)["train"]
    data.set_format("torch")
    loader = torch.utils.data.DataLoader(data, batch_size=8, collate_fn=default_data_collator)
    tokens = 0
    for batch in loader:
        tokens += int(batch["input_ids"].numel())
    cache = sum(f.stat().st_size for f in (corpus.parent / f"cache-{kind}").rglob("*.arrow"))
    return {"kind": kind, "rows": len(data), "tokens_fed": tokens, "arrow_cache_bytes": cache,
            "seconds": round(time.perf_counter() - started, 2),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--articles", type=int, default=3000)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    figures.add_arguments(parser, "data_pipeline_rss")
    args = parser.parse_args()
    if args._child:
        kind, workdir = args._child
        workdir = Path(workdir)
        print(json.dumps(pipeline(kind, workdir / "corpus.txt", workdir / "tokenizer", args.max_length,
                                  args.block_size)))
        return 0

    from colab_kit import text

    workdir = Path(tempfile.mkdtemp(prefix="pipeline-rss-"))
    lines = text.generate_corpus(args.articles, seed=0)
    (workdir / "corpus.txt").write_text("\n".join(lines) + "\n")
    text.train_bpe_tokenizer(lines[:20000], vocab_size=2000).save_pretrained(workdir / "tokenizer")
    results = {}
    for kind in ("seed", "kit"):
        proc = subprocess.run([sys.executable, __file__, "--_child", kind, str(workdir), "--max-length",
                               str(args.max_length), "--block-size", str(args.block_size)],
                              capture_output=True, text=True, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
        if proc.returncode:
            print(proc.stderr[-3000:])
            return 1
        results[kind] = json.loads(proc.stdout.strip().splitlines()[-1])
    mb = 1024 ** 2
    print(f"corpus: {len(lines):,} lines ({(workdir / 'corpus.txt').stat().st_size / mb:.1f} MiB of text)\n")
    print(f"{'pipeline':<8}{'rows':>9}{'tokens fed':>14}{'Arrow cache':>14}{'peak RSS':>12}{'time':>8}")
    for kind, r in results.items():
        print(f"{kind:<8}{r['rows']:>9,}{r['tokens_fed']:>14,}{r['arrow_cache_bytes'] / mb:>12.1f}Mi"
              f"{r['peak_rss_bytes'] / mb:>10.0f}Mi{r['seconds']:>7.1f}s")
    seed, kit = results["seed"], results["kit"]
    print(f"\npeak RSS seed/kit: {seed['peak_rss_bytes'] / kit['peak_rss_bytes']:.2f}x; tokens fed per epoch "
          f"seed/kit: {seed['tokens_fed'] / kit['tokens_fed']:.1f}x (padding); Arrow cache seed/kit: "
          f"{seed['arrow_cache_bytes'] / max(kit['arrow_cache_bytes'], 1):.1f}x")
    draw(args, results, len(lines))
    return 0


def draw(args, results: dict, lines: int) -> None:
    """The table's three sizes side by side, seed beside kit, each panel titled with its ratio seed/kit."""
    mb = 1024 ** 2
    fig, axes = figures.figure(8.0, 3.2, ncols=3)
    names = ["seed", "kit"]
    panels = (("peak_rss_bytes", "peak RSS (MiB)", mb, "{:.0f}", "{:.2f}"),  # the ratios as the last line has them
              ("tokens_fed", "tokens fed per epoch (M)", 1e6, "{:.2f}", "{:.1f}"),
              ("arrow_cache_bytes", "Arrow cache (MiB)", mb, "{:.1f}", "{:.1f}"))
    for ax, (key, title, scale, fmt, ratio) in zip(axes, panels):
        values = [results[kind][key] / scale for kind in ("seed", "kit")]
        ax.bar(names, values, color=["tab:red", "tab:green"])
        ax.set_title(f"{title}\nseed/kit: {ratio.format(results['seed'][key] / max(results['kit'][key], 1))}x",
                     fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
        ax.set_ylim(0, max(values) * 1.15)
        for x, value in enumerate(values):
            ax.annotate(fmt.format(value), (x, value), ha="center", va="bottom", fontsize=8)
    fig.suptitle(f"The DistilGPT2 notebook's data pipeline, one epoch of the same {lines:,}-line corpus:\n"
                 f"seed: padded to max_length={args.max_length}; kit: text.tokenize_and_group into blocks of "
                 f"{args.block_size}", fontsize=10)
    figures.save(fig, args)


if __name__ == "__main__":
    sys.exit(main())
