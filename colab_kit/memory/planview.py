"""A memory plan shown: a short table (one line per configuration at its largest micro-batch that
fits) and a stacked bar per configuration against the GPU's budget."""

from __future__ import annotations

from .._units import format_bytes

__all__ = ["plan_table", "plan_figure"]

_PARTS = ("weights", "gradients", "optimizer", "activations", "temporaries", "inputs", "fixed")
_COLOURS = ("#4c72b0", "#dd8452", "#937860", "#55a868", "#8c8c8c", "#ccb974", "#c44e52")


def _unit(plan) -> tuple[int, str]:
    """GiB, or MiB for a plan whose largest peak is under 2 GiB (a small model's parts would read 0.00)."""
    return (2**30, "GiB") if max(r.peak for r in plan.rows) >= 2**31 else (2**20, "MiB")


def _label(row) -> str:
    split = "whole" if row.micro_batches == 1 else f"{row.micro_batch} x{row.micro_batches}"
    return f"{row.precision} ckpt {'on ' if row.checkpointing else 'off'} {split}"


def plan_table(plan) -> str:
    gpu = plan.gpu
    lines = [f"memory plan: {plan.model}, per-device batch {plan.batch} x {plan.seq_len} tokens, on {gpu.name} "
             f"({format_bytes(gpu.capacity)}; {format_bytes(plan.budget)} with a {plan.margin:.0%} margin)",
             f"  {plan.gpu_note}; {plan.lengths_note}"]
    lines += [f"  note: {note}" for note in plan.notes]
    scale, unit = _unit(plan)

    def size(n: int) -> str:
        return f"{n / scale:.2f}" if unit == "GiB" else f"{n / scale:.1f}"

    header = (f"  {'configuration':<28} {'optimizer':<22} {'weights':>7} {'grads':>6} {'optim':>6} {'activ':>6} "
              f"{'temp':>6} {'fixed':>6} {'peak ' + unit:>8}  {'fits':<4} {'cost':>5}")
    lines += [header, "  " + "-" * (len(header) - 2)]
    chosen = plan.chosen
    for row in sorted(plan.best_rows(), key=lambda r: (r.optimizer != plan.rows[0].optimizer, r.precision != "fp32",
                                                       r.checkpointing)):
        p = row.parts
        mark = "<- use" if row is chosen else ("(now)" if row.current else "")
        lines.append(f"  {_label(row):<28} {row.optimizer[:22]:<22} {size(p['weights']):>7} {size(p['gradients']):>6} "
                     f"{size(p['optimizer']):>6} {size(p['activations']):>6} "
                     f"{size(p['temporaries'] + p['inputs']):>6} {size(p['fixed']):>6} {size(row.peak):>8}  "
                     f"{'yes' if row.fits else 'NO':<4} {row.cost:>5.2f} {mark}")
    host = plan.host
    if host:
        limit = f" of the runtime's {format_bytes(host['limit'])}" if host.get("limit") else ""
        lines.append(f"  host RAM beyond this process's {format_bytes(host.get('process'))}: "
                     f"{format_bytes(host['load'])} at load, {format_bytes(host['save'])} at save"
                     + (f", {format_bytes(host['merge'])} to merge the adapter" if "merge" in host else "") + limit)
    lines.append(f"  -> {plan.advice()}")
    lines.append(f"  (traced in {plan.seconds:.1f} s; cost: per optimizer step, relative to the run as it is now)")
    return "\n".join(lines)


def plan_figure(plan):
    """Stacked horizontal bars, one per configuration, and the budget as a line."""
    import matplotlib.pyplot as plt

    rows = plan.best_rows()
    scale, unit = _unit(plan)
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    for i, row in enumerate(rows):
        left = 0.0
        for part, colour in zip(_PARTS, _COLOURS):
            width = row.parts.get(part, 0) / scale
            ax.barh(i, width, left=left, color=colour, label=part if i == 0 else None)
            left += width
    if plan.budget <= 1.5 * max(r.peak for r in rows):  # a budget far beyond every bar would flatten them
        ax.axvline(plan.budget / scale, color="black", linestyle="--", linewidth=1, label="budget")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{_label(r)} {r.optimizer[:12]}" + (" <- use" if r is plan.chosen else "") for r in rows],
                       fontsize=8)
    ax.set_xlabel(f"{unit} at the step's peak on {plan.gpu.name} (budget {plan.budget / scale:.1f} {unit})")
    ax.legend(fontsize=7, ncol=7, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.tight_layout()
    return fig
