"""Rows of TRL rollout dicts: the padding rule, and concatenating rollouts of different widths.

TRL's rollout (``GRPOTrainer._generate_and_score_completions``) returns a dict of per-row tensors
(dim 0 = one completion): ``prompt_ids`` / ``prompt_mask`` left-padded to the longest prompt of the
call, ``completion_ids`` / ``completion_mask`` and every per-token value (behaviour and reference
log-probs, ``tool_mask``, ...) right-padded to the longest completion, ``advantages`` per row, and the
scalar ``num_items_in_batch`` (loss tokens of the call, summed over processes). Two calls pad to their
own widths, so their rows cannot be stacked as they are. The components that merge rollouts use
these helpers: µ-GRPO's stage (:mod:`grpo_variants.rollout.stages`, one call per generation chunk) and dynamic
sampling (:mod:`grpo_variants.rollout.sampling`, the kept groups of several rounds).

Padding values: the tokenizer's pad id for token ids, 1 for ``tool_mask`` (TRL's "not a tool token"),
0 for masks and per-token values, so a padded position is out of every mask.
"""

from __future__ import annotations

import torch

from grpo_variants.errors import GRPOVariantsError

__all__ = ["FORWARD_KEYS", "LEFT_PADDED", "cat_rows", "concat_rollouts", "pad_columns", "pad_value"]

# Inputs TRL forwards to the model for multimodal batches; passed through untouched by the loss.
FORWARD_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)
# Multimodal fields whose rows are not one per completion (or not padded per call): never concatenated.
UNCONCATENABLE_KEYS = tuple(k for k in FORWARD_KEYS if k != "token_type_ids") + ("num_images", "num_tiles")
# Rollout fields padded on the left (the prompt side); every other per-token field is padded on the right.
LEFT_PADDED = ("prompt_ids", "prompt_mask")


def pad_value(key: str, pad_token_id: int | None) -> int:
    """The value a padded position of rollout field ``key`` holds."""
    if key in ("prompt_ids", "completion_ids"):
        return pad_token_id
    return 1 if key == "tool_mask" else 0


def pad_columns(tensor: torch.Tensor, width: int, key: str, pad_token_id: int | None) -> torch.Tensor:
    """``tensor`` (rows x columns x ...) padded on dim 1 to ``width`` columns, on the side ``key`` is padded."""
    extra = width - tensor.size(1)
    if extra <= 0:
        return tensor
    filler = tensor.new_full((tensor.size(0), extra, *tensor.shape[2:]), pad_value(key, pad_token_id))
    return torch.cat([filler, tensor] if key in LEFT_PADDED else [tensor, filler], dim=1)


def cat_rows(tensors: list[torch.Tensor], key: str, pad_token_id: int | None) -> torch.Tensor:
    """The rows of ``tensors`` one after the other; per-token fields padded to the widest first."""
    if tensors[0].dim() < 2:
        return torch.cat(tensors, dim=0)
    width = max(t.size(1) for t in tensors)
    return torch.cat([pad_columns(t, width, key, pad_token_id) for t in tensors], dim=0)


def concat_rollouts(parts: list[dict], pad_token_id: int | None, *, fix: str = "") -> dict:
    """One rollout dict holding every row of ``parts`` in order (outputs of several TRL rollout calls).

    Per-row tensors are concatenated (prompts left-padded, completions right-padded to the widest
    part), lists are joined, ``num_items_in_batch`` is summed (the loss tokens of every call) and a
    field that is ``None`` in every part stays ``None``. Multimodal fields cannot be merged: a
    :class:`~grpo_variants.errors.GRPOVariantsError` names the field and ``fix``.
    """
    out = {}
    for key in parts[0]:
        values = [p.get(key) for p in parts]
        if all(v is None for v in values):
            out[key] = None
            continue
        if key in UNCONCATENABLE_KEYS:
            raise GRPOVariantsError(
                f"cannot concatenate the rollout field {key!r} of several rollout calls (multimodal inputs)"
                + (f"; {fix}." if fix else ".")
            )
        first = values[0]
        if isinstance(first, list):
            out[key] = [x for v in values for x in v]
        elif first.dim() == 0:
            if key != "num_items_in_batch":
                raise GRPOVariantsError(f"unexpected scalar {key!r} in a rollout output; cannot concatenate it.")
            out[key] = torch.stack(values).sum()
        else:
            out[key] = cat_rows(values, key, pad_token_id)
    return out
