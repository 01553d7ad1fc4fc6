"""RNA-FM's attention: eager (multimolecule's default) vs PyTorch SDPA, side by side.

    python bench/rnafm_attention.py [--batch 4] [--length 448]

Builds the real RNA-FM architecture from multimolecule's config (12 layers x 640, 20 heads,
random weights: nothing is downloaded) with a 13-class sequence head, as the RNA notebook's
`full` preset uses it, and runs one training step (forward + backward) on `batch` random RNA
sequences of `length` tokens, a quarter of them padded to half length, once per implementation,
each in a fresh process so that peak memory is its own. Prints, per implementation: seconds per
step, peak memory (CUDA allocator peak on a GPU, else the process's peak RSS), and the largest
difference in logits from eager (evaluation mode, same weights and inputs).

Needs multimolecule (`pip install multimolecule`; transformers >= 5.2).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def one(impl: str, batch: int, length: int) -> dict:
    import torch
    from multimolecule import RnaFmConfig, RnaFmForSequencePrediction

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    config = RnaFmConfig(num_labels=13, problem_type="multiclass")
    config._attn_implementation = impl
    model = RnaFmForSequencePrediction(config).to(device)
    ids = torch.randint(6, 10, (batch, length), device=device)  # A, C, G, U
    ids[:, 0], ids[:, -1] = 1, 2  # <cls> ... <eos>
    mask = torch.ones_like(ids)
    for row in range(0, batch, 4):  # every fourth sequence is half as long: padding, as in a real batch
        ids[row, length // 2:], mask[row, length // 2:] = 0, 0
    labels = torch.randint(0, 13, (batch,), device=device)

    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float().cpu()
    model.train()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**30
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return {"impl": config._attn_implementation, "seconds": time.perf_counter() - started, "peak_gib": peak,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "CPU", "logits": logits.tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=448)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one(args.child, args.batch, args.length)))
        return

    import torch

    results = {}
    for impl in ("eager", "sdpa"):
        out = subprocess.run([sys.executable, __file__, "--child", impl, "--batch", str(args.batch),
                              "--length", str(args.length)], capture_output=True, text=True, check=True)
        results[impl] = json.loads(out.stdout.strip().splitlines()[-1])
    eager, sdpa = results["eager"], results["sdpa"]
    diff = (torch.tensor(eager["logits"]) - torch.tensor(sdpa["logits"])).abs().max().item()
    print(f"RNA-FM (12 x 640, 20 heads), one training step on {args.batch} x {args.length} tokens, {eager['device']}")
    print(f"{'attention':<10} {'s/step':>8} {'peak GiB':>9}")
    for name, r in results.items():
        print(f"{r['impl']:<10} {r['seconds']:>8.2f} {r['peak_gib']:>9.2f}")
    print(f"sdpa/eager: time {sdpa['seconds'] / eager['seconds']:.2f}x, peak memory "
          f"{sdpa['peak_gib'] / eager['peak_gib']:.2f}x; largest logit difference {diff:.1e}")
    scores = 32 * 20 * 448 * 448 * 4 / 2**30
    print(f"(eager keeps each layer's attention probabilities for backward: at the notebook's 32 x 448 that is "
          f"{scores:.2f} GiB per layer in fp32, {12 * scores:.1f} GiB for the 12 layers)")


if __name__ == "__main__":
    main()
