"""MicroBatcher: one optimizer step's batch in micro-batches, halved and redone on out of memory.

The effective batch, the learning-rate schedule and the data order never change: the same rows run
again in smaller pieces, each micro-batch's loss weighted by its share of the batch's items. Under
several processes every rank retries together on the smallest size, and an error on any rank is raised
on every rank (`distributed/agreement.py`). What counts as out of memory and how memory is freed is
`oom.py`'s; how a batch is cut is `batching.py`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

from ..distributed.agreement import agree_micro_batch
from ..distributed.gradients import reduce_gradients, straight_to_module, unwrap_ddp
from ..distributed.ranks import group
from .batching import batch_size, split_batch
from .oom import ELSEWHERE, OutOfMemoryError, describe_memory, is_oom_error, memory_numbers, release_for_retry

__all__ = ["MicroBatcher"]


class MicroBatcher:
    """Forward + backward of one optimizer step's batch in micro-batches, halving on OOM.

    The working micro-batch size is remembered between steps. For plain PyTorch loops:

        mb = ck.MicroBatcher()
        for batch in loader:                       # batch = the whole effective batch
            loss = mb.step(batch, lambda b: model(**b).loss, model=model)
            optimizer.step()
            optimizer.zero_grad()

    Under DistributedDataParallel give the wrapper as `model=` (each rank its own shard of the data):
    the step then averages the gradients itself, once every rank has finished its micro-batches, and
    an error on one rank (in its forward, its backward or the averaging) is raised on every rank
    (`RankFailedError` on the others) instead of leaving them inside a collective.

    Args:
        micro_batch: starting micro-batch size (None: the whole batch).
        on_backoff: called with a dict describing each back-off (for logs and journals).
        grow_back_after: after this many clean steps below the full batch, try doubling the
            micro-batch once more (off by default; a failed try is not repeated).
        diagnose: returns extra text for the error raised when even 1 sample does not fit.
    """

    def __init__(self, micro_batch: int | None = None, *, on_backoff: Callable[[dict], None] | None = None,
                 grow_back_after: int | None = None, diagnose: Callable[[], str] | None = None):
        self.micro_batch = micro_batch
        self.on_backoff = on_backoff
        self.grow_back_after = grow_back_after
        self.diagnose = diagnose
        self.backoffs: list[dict] = []
        self.phase = "idle"
        self._clean_steps = 0
        self._growing = False
        self._ceiling: int | None = None  # a size that failed after growing back

    def step(self, batch, forward: Callable[[Any], Any], *, model=None, backward: Callable | None = None,
             zero_grad: Callable[[], None] | None = None, weight: str | Callable[[Any], float] = "samples",
             total: float | None = None, context: dict | None = None):
        """Run `forward` and the backward pass over `batch` in micro-batches; returns the loss.

        Args:
            batch: one optimizer step's data (dict of tensors, tuple/list of tensors, or a tensor).
            forward: micro-batch -> scalar loss, a *mean* over that micro-batch's items.
            model: whose gradients are zeroed before a retry (or give `zero_grad`).
            backward: loss -> None; default `loss.backward()` (pass `lambda l: scaler.scale(l).backward()`
                for fp16 with a GradScaler).
            weight: "samples", "tokens" (label entries that are not -100), a callable
                micro-batch -> number of items its loss is averaged over, or "sum": each
                micro-batch's loss is already its share of the whole batch's (a loss divided by
                the whole batch's item count, as with the Trainer's `num_items_in_batch`), and
                the shares are added as they are.
            total: what the items are divided by; default their sum over this batch. Give it
                when the batch's items are counted elsewhere (over every process, say).
            context: extra fields for the back-off report (e.g. the step number).

        Returns:
            The batch's loss (a detached tensor): the items-weighted mean of the micro-batch losses.

        Raises:
            OutOfMemoryError: even a micro-batch of 1 does not fit (with a diagnosis).
        """
        if model is None and zero_grad is None:
            raise ValueError("give model= (or zero_grad=) so gradients can be cleared before a retry")
        zero_grad = zero_grad or (lambda: model.zero_grad(set_to_none=True))
        backward = backward or (lambda loss: loss.backward())
        weigh = None if weight == "sum" else _weigher(weight)

        def run_chunks(chunks):
            return self._forward_backward(chunks, forward, backward, weigh, total)

        inner = unwrap_ddp(model) if model is not None else None
        if inner is None:
            return self._retrying(batch, run_chunks, on_retry=zero_grad, trim_padding=True, context=context)
        # Under DDP (a plain loop's model=): the micro-batches run through the module inside it, so that no
        # forward or backward holds a collective that a failing rank never reaches; the ranks agree how the
        # step ended (an error anywhere is raised on every rank), then the gradients are averaged once.
        try:
            with straight_to_module(model):
                loss = self._retrying(batch, run_chunks, on_retry=zero_grad, trim_padding=True, context=context)
            reduce_gradients(inner, bucket_bytes=getattr(model, "bucket_bytes_cap", None))
        except BaseException:
            zero_grad()  # no gradient is left half accumulated or half averaged for a step run again
            raise
        return loss

    def map(self, batch, fn: Callable[[Any], Any], *, context: dict | None = None) -> tuple[list, list]:
        """Apply `fn` to micro-batches of `batch` (no backward pass: evaluation, prediction).

        Halves the micro-batch on OOM and starts over. Micro-batches keep the batch's padded
        length, so their outputs can be concatenated.

        Returns:
            (micro-batches, outputs), in order.
        """
        def run_all(chunks):
            self.phase = "evaluation"
            outputs = [fn(chunk) for chunk in chunks]
            self.phase = "idle"
            return chunks, outputs

        return self._retrying(batch, run_all, on_retry=None, trim_padding=False, context=context)

    def _retrying(self, batch, run_chunks, *, on_retry, trim_padding, context):
        rows = batch_size(batch)
        micro = self._maybe_grow(min(self.micro_batch or rows, rows), rows)
        while True:
            error = failure = None
            try:
                result = run_chunks(split_batch(batch, micro, trim_padding=trim_padding))
            except Exception as exc:  # noqa: BLE001 - anything but an OOM is raised by the agreement below
                if is_oom_error(exc):
                    error = str(exc).splitlines()[0][:300]  # only text: the exception (and its frames) go
                else:
                    failure = exc
            # Several processes: all retry together, on the smallest size, or all stop when any rank
            # failed otherwise (no rank is left waiting in a collective that the others never reach).
            micro, failed_ranks = agree_micro_batch(micro, error is not None, failure, where=self.phase,
                                                    step=(context or {}).get("step"))
            if not failed_ranks:
                self._succeeded(micro, rows)
                return result
            where = self.phase if error is not None else ELSEWHERE
            context = dict(context or {})
            if group() is not None:
                context["ranks"] = failed_ranks
                error = error or f"out of memory on rank(s) {failed_ranks}"
            if on_retry is not None:
                on_retry()
            release_for_retry()
            if micro <= 1:
                raise OutOfMemoryError(self._bounded_message(where, error))
            self._backoff(micro, max(1, micro // 2), where, error, rows, context)
            micro = max(1, micro // 2)

    def _forward_backward(self, chunks, forward, backward, weigh, total):
        if weigh is None:  # "sum": every share is already divided by the whole batch's items
            weights, denominator = [1.0] * len(chunks), 1.0
        else:
            weights = [weigh(c) for c in chunks]
            denominator = total if total is not None else sum(weights)
            if sum(weights) <= 0:  # no label items at all: fall back to rows
                weights = [batch_size(c) for c in chunks]
                denominator = sum(weights)
        summed = None
        for chunk, w in zip(chunks, weights):
            if w == 0:
                continue  # no label items: contributes no gradient (its mean loss would be NaN)
            self.phase = "forward"
            loss = forward(chunk)
            if w != denominator:
                loss = loss * (w / denominator)
            self.phase = "backward"
            backward(loss)
            loss = loss.detach()
            summed = loss if summed is None else summed + loss
            del loss
        self.phase = "idle"
        return summed

    def _succeeded(self, micro: int, rows: int) -> None:
        # Only a back-off or a successful grow-back changes the remembered size: a small last
        # batch of an epoch must not shrink it.
        if self._growing:
            self.micro_batch = micro
            self._growing = False
        self._clean_steps += 1

    def _maybe_grow(self, micro: int, rows: int) -> int:
        self._growing = False
        if (self.grow_back_after and micro < rows and self._clean_steps >= self.grow_back_after
                and (self._ceiling is None or micro * 2 < self._ceiling)):
            self._clean_steps = 0
            self._growing = True
            return min(rows, micro * 2)
        return micro

    def _backoff(self, old: int, new: int, where: str, error: str, rows: int, context: dict) -> None:
        if self._growing:
            self._ceiling = old  # growing back failed: never try this size again
            self._growing = False
        self._clean_steps = 0
        self.micro_batch = new
        report = {"where": where, "from": old, "to": new, "batch": rows, "error": error,
                  **memory_numbers(), **context}
        self.backoffs.append(report)
        if self.on_backoff is not None:
            self.on_backoff(report)
        else:
            print(f"colab_kit: out of memory in {where}: micro-batch {old} -> {new} "
                  f"(the batch of {rows} is kept; {describe_memory(report)})", flush=True)

    def _bounded_message(self, where: str, error: str) -> str:
        extra = self.diagnose() if self.diagnose else ""
        return (f"out of memory in {where} even with a micro-batch of 1 sample ({error}). "
                f"{describe_memory(memory_numbers())}. {extra}".strip())


def _weigher(weight) -> Callable[[Any], float]:
    if callable(weight):
        return weight
    if weight == "samples":
        return batch_size
    if weight == "tokens":
        def tokens(chunk):
            labels = chunk["labels"] if isinstance(chunk, Mapping) else chunk[-1]
            return int(labels.ne(-100).sum())

        return tokens
    raise ValueError(f"weight={weight!r}: use 'samples', 'tokens' or a function micro-batch -> item count")
