"""Padding-free packing: pure helpers that move a padded ``(rows, tokens)`` batch into a few packed rows and back.

TRL's training-side forward (policy log-probs under gradient, reference log-probs, recomputed old
log-probs) runs on ``cat(prompt_ids, completion_ids)``: prompts left-padded, completions right-padded,
every row as long as the longest. :func:`pack` removes the pads: each row's real tokens (its
``attention_mask`` ones, one contiguous span) are laid end to end in a few packed rows with
``position_ids`` restarting at 0 for every sequence, so transformers builds a block-diagonal causal mask
(``masking_utils.find_packed_sequence_indices``) and no token attends across sequences. It also lists
the *scored* positions: the packed position whose hidden state predicts each completion token, so the
LM head runs on those positions only. :func:`unpack` scatters the per-scored-token values back to TRL's
``(rows, logits_to_keep)`` layout with zeros where TRL's padded path has zeros (prompt and pad
positions), so everything downstream of the forward is unchanged.

Shapes: ``B`` rows of ``T`` tokens, ``K = logits_to_keep`` completion columns, ``P`` packed rows of
``L`` slots, ``N`` scored tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PackedBatch", "real_spans", "plan_packs", "pack", "unpack"]


@dataclass(frozen=True)
class PackedBatch:
    """A padded batch packed for one forward pass (see :func:`pack`)."""

    input_ids: torch.Tensor  # (P, L) real tokens end to end; a pack's tail slots hold pad_id
    position_ids: torch.Tensor  # (P, L) 0, 1, ... restarting at every sequence (and at a pack's tail)
    score_index: torch.Tensor  # (N,) flat index into (P * L): the position whose hidden state predicts a token
    score_labels: torch.Tensor  # (N,) the token predicted there
    score_dest: torch.Tensor  # (N,) flat index into (B * K) of that token's column in TRL's layout
    shape: tuple[int, int]  # (B, K)
    rows_per_pack: tuple[tuple[int, ...], ...]  # original row indices in each pack, in packed order
    real_tokens: int  # sum of the rows' real tokens
    dummy: bool = False  # no scored token: one dummy position keeps the graph (its value is discarded)

    @property
    def slots(self) -> int:
        """Token slots the packed forward computes (P * L); the padded forward computes B * T."""
        return self.input_ids.numel()


def real_spans(attention_mask: torch.Tensor) -> tuple[list[int], list[int]]:
    """``(starts, lengths)``: where each row's real tokens begin and how many there are.

    attention_mask: (B, T) of 0/1. A row's ones must be one contiguous span (TRL's left-padded prompt
    followed by its right-padded completion); a mask with holes raises ``ValueError``.
    """
    mask = attention_mask.bool()
    lengths = mask.sum(dim=1)
    starts = torch.where(lengths > 0, mask.float().argmax(dim=1), torch.zeros_like(lengths))
    cols = torch.arange(mask.size(1), device=mask.device).unsqueeze(0)
    span = (cols >= starts.unsqueeze(1)) & (cols < (starts + lengths).unsqueeze(1))
    if not torch.equal(span, mask):
        bad = (span != mask).any(dim=1).nonzero()[0].item()
        raise ValueError(
            f"padding_free=True packs each row's attention_mask ones as one contiguous sequence, but row {bad} has "
            "holes in its mask; set padding_free=False for this rollout."
        )
    return starts.tolist(), lengths.tolist()


def plan_packs(lengths: list[int], budget: int) -> list[list[int]]:
    """First-fit decreasing: row indices grouped into packs of at most ``budget`` tokens.

    Rows are taken longest first (ties by index); each goes into the first pack with room, else opens one.
    A row longer than ``budget`` gets a pack of its own. Rows of length 0 are left out. Within a pack, rows
    keep the order they were placed in. Deterministic.
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: (-lengths[i], i))
    packs: list[list[int]] = []
    used: list[int] = []
    for i in order:
        for p, total in enumerate(used):
            if total + lengths[i] <= budget:
                packs[p].append(i)
                used[p] += lengths[i]
                break
        else:
            packs.append([i])
            used.append(lengths[i])
    return packs


def pack(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    budget: int | None = None,
    pad_id: int = 0,
) -> PackedBatch:
    """Pack ``input_ids`` (B, T) by ``attention_mask`` into rows of at most ``budget`` tokens.

    ``budget=None`` uses the longest row's real length, so no packed row is longer than the longest
    sequence (attention work never exceeds the padded batch's). Scored tokens are TRL's: token ``t`` in the
    last ``logits_to_keep`` columns with ``attention_mask[b, t] == 1``, predicted from the hidden state at
    ``t - 1``. A scored token must follow a real token of its own row (a row whose first real token is a
    completion token has nothing to predict it from): ``ValueError`` otherwise.
    """
    B, T = input_ids.shape
    K = int(logits_to_keep)
    if not 0 < K < T:
        raise ValueError(f"logits_to_keep must be in [1, {T - 1}] for {T} columns, got {K}")
    device = input_ids.device
    starts, lengths = real_spans(attention_mask)
    if budget is None:
        budget = max(max(lengths), 1)
    packs = plan_packs(lengths, budget)
    if not packs:  # no real token at all: one pad slot keeps the forward (a collective pass under ZeRO-3) alive
        ids = torch.full((1, 1), pad_id, dtype=input_ids.dtype, device=device)
        zero = torch.zeros(1, dtype=torch.long, device=device)
        return PackedBatch(ids, zero.view(1, 1), zero, ids.view(1), zero[:0], (B, K), (), 0, dummy=True)
    width = max(sum(lengths[i] for i in rows) for rows in packs)
    P = len(packs)

    src, dst, pos = [], [], []
    score_index, score_dest, score_src = [], [], []
    tail_dst, tail_pos = [], []
    first_kept = T - K
    for p, rows in enumerate(packs):
        offset = 0
        for b in rows:
            n, s = lengths[b], starts[b]
            base = p * width + offset
            src.append(torch.arange(b * T + s, b * T + s + n))
            dst.append(torch.arange(base, base + n))
            pos.append(torch.arange(n))
            if s >= first_kept:
                raise ValueError(
                    f"row {b}: its first real token (column {s}) is a completion token, with no prompt token "
                    "before it to predict it from; padding_free=True needs a non-empty prompt."
                )
            cols = torch.arange(first_kept, s + n)  # scored columns t of row b (maybe none)
            score_index.append(base + (cols - 1 - s))
            score_dest.append(b * K + (cols - first_kept))
            score_src.append(b * T + cols)
            offset += n
        if offset < width:  # the pack's tail: its own "sequence" of pads, attending only to itself
            tail_dst.append(torch.arange(p * width + offset, (p + 1) * width))
            tail_pos.append(torch.arange(width - offset))

    src_t, dst_t = torch.cat(src).to(device), torch.cat(dst).to(device)
    flat_ids = torch.full((P * width,), pad_id, dtype=input_ids.dtype, device=device)
    flat_pos = torch.zeros(P * width, dtype=torch.long, device=device)
    flat_ids[dst_t] = input_ids.reshape(-1)[src_t]
    flat_pos[dst_t] = torch.cat(pos).to(device)
    if tail_dst:
        flat_pos[torch.cat(tail_dst).to(device)] = torch.cat(tail_pos).to(device)
    index = torch.cat(score_index).to(device)
    dest = torch.cat(score_dest).to(device)
    labels = input_ids.reshape(-1)[torch.cat(score_src).to(device)]
    dummy = index.numel() == 0
    if dummy:
        index = torch.zeros(1, dtype=torch.long, device=device)
        labels = flat_ids[:1].clone()
    return PackedBatch(
        input_ids=flat_ids.view(P, width),
        position_ids=flat_pos.view(P, width),
        score_index=index,
        score_labels=labels,
        score_dest=dest,
        shape=(B, K),
        rows_per_pack=tuple(tuple(rows) for rows in packs),
        real_tokens=int(sum(lengths)),
        dummy=dummy,
    )


def unpack(values: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """Per-scored-token ``values`` (N,) or (1, N) -> (B, K) in TRL's layout, 0 at unscored positions.

    Differentiable in ``values``. With ``packed.dummy`` the one dummy value is discarded but kept in the
    graph (``0 * value``) so a backward pass still reaches every parameter the forward used, as TRL's
    all-masked micro-batch does.
    """
    flat = values.reshape(-1)
    B, K = packed.shape
    out = flat.new_zeros(B * K)
    if packed.dummy:
        return (out + 0.0 * flat.sum()).view(B, K)
    return out.scatter(0, packed.score_dest, flat).view(B, K)
