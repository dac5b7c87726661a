"""The training loader's cache: a generation batch's rows are fetched and moved once, not at every micro-step.

TRL's ``RepeatSampler`` hands the whole generation batch (per-device batch x ``steps_per_generation``
rows) to every micro-step, and TRL uses it only when it generates. For a µ-GRPO stage of 4,096 rows
that re-fetch (datasets) and re-traversal (accelerate's ``send_to_device``) cost ~25 ms per update on
CPU. :meth:`GRPOVariantTrainer.get_train_dataloader <grpo_variants.GRPOVariantTrainer.get_train_dataloader>`
therefore wraps the training set in :class:`RepeatedFetchCache` (a repeated batch of indices is fetched
once) and the collator's output in :class:`RowBatch` (a ``list`` of row dicts, as TRL's collator returns,
that accelerate and ``pin_memory`` pass through untouched); ``_prepare_inputs`` moves the rows to the
device only when TRL is about to generate from them.
"""

from __future__ import annotations

import torch

__all__ = ["RepeatedFetchCache", "RowBatch", "collate_rows"]


class RepeatedFetchCache(torch.utils.data.Dataset):
    """A map-style dataset view that serves a repeated batch of indices from its last fetch."""

    def __init__(self, dataset):
        self.dataset = dataset
        self._indices: list | None = None
        self._rows: list | None = None

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        return self.dataset[index]

    def __getitems__(self, indices):
        if indices != self._indices:
            fetch = getattr(self.dataset, "__getitems__", None)
            self._rows = fetch(indices) if fetch is not None else [self.dataset[i] for i in indices]
            self._indices = list(indices)
        return list(self._rows)


class RowBatch(list):
    """Collated training rows: TRL's list of row dicts, which accelerate's ``send_to_device`` and torch's
    ``pin_memory`` leave alone.

    A ``list`` (so ``training_step`` and any override of it see TRL's list of row dicts: indexing,
    iteration, equality, ``isinstance(inputs, list)``), with ``.to`` and ``.pin_memory`` returning itself:
    both helpers call those before walking a list, so a large generation batch is not traversed at every
    micro-step. ``_prepare_inputs`` moves the rows (as a plain list) only when TRL is about to generate.
    """

    __slots__ = ()

    def to(self, *args, **kwargs):  # noqa: ARG002 - accelerate's send_to_device: leave the rows where they are
        return self

    def pin_memory(self, *args, **kwargs):  # noqa: ARG002 - torch's pin_memory: nothing to pin
        return self


def collate_rows(collator, rows) -> RowBatch:
    """The data collator's output as a :class:`RowBatch` (the training loader's collate_fn)."""
    return RowBatch(collator(rows))
