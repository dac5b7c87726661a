"""Concatenating TRL rollout dicts (grpo_variants.rollout.batch): every row of every part, padded on its side."""

from __future__ import annotations

import pytest
import torch

from grpo_variants.errors import GRPOVariantsError
from grpo_variants.rollout.batch import cat_rows, concat_rollouts, pad_columns, pad_value

PAD = 9


def _rollout(prompt_width: int, completion_width: int, rows: int, offset: int) -> dict:
    """A rollout-shaped dict whose real entries are distinct numbers (offset + position), with masks."""
    prompt = torch.arange(rows * prompt_width).view(rows, prompt_width) + offset
    completion = torch.arange(rows * completion_width).view(rows, completion_width) + offset + 1000
    return {
        "prompt_ids": prompt,
        "prompt_mask": torch.ones(rows, prompt_width, dtype=torch.long),
        "completion_ids": completion,
        "completion_mask": torch.ones(rows, completion_width, dtype=torch.long),
        "old_per_token_logps": -completion.float() / 1e4,
        "tool_mask": torch.zeros(rows, completion_width, dtype=torch.long),
        "advantages": torch.arange(rows, dtype=torch.float) + offset,
        "num_items_in_batch": torch.tensor(rows * completion_width),
        "sampling_per_token_logps": None,
        "texts": [f"{offset}-{i}" for i in range(rows)],
    }


def test_pad_values_and_sides():
    assert pad_value("prompt_ids", PAD) == pad_value("completion_ids", PAD) == PAD
    assert pad_value("tool_mask", PAD) == 1 and pad_value("completion_mask", PAD) == 0
    t = torch.tensor([[5, 6]])
    assert pad_columns(t, 4, "prompt_ids", PAD).tolist() == [[PAD, PAD, 5, 6]]  # prompts: left
    assert pad_columns(t, 4, "completion_ids", PAD).tolist() == [[5, 6, PAD, PAD]]  # completions: right
    assert pad_columns(t, 4, "prompt_mask", PAD).tolist() == [[0, 0, 5, 6]]
    assert pad_columns(t, 2, "prompt_ids", PAD) is t  # already wide enough: unchanged
    assert cat_rows([torch.tensor([1.0]), torch.tensor([2.0, 3.0])], "advantages", PAD).tolist() == [1.0, 2.0, 3.0]


def test_concat_two_rollouts_of_different_widths_gives_exactly_the_rows_of_each():
    a, b = _rollout(3, 2, rows=2, offset=0), _rollout(1, 4, rows=3, offset=100)
    out = concat_rollouts([a, b], PAD)
    assert out["prompt_ids"].shape == (5, 3) and out["completion_ids"].shape == (5, 4)
    # Stripping the padding gives back each part's rows, in order, unchanged.
    for key, side in (("prompt_ids", "left"), ("completion_ids", "right"), ("old_per_token_logps", "right"),
                      ("tool_mask", "right")):
        width_a, width_b = a[key].size(1), b[key].size(1)
        width = out[key].size(1)
        rows_a = out[key][:2, width - width_a :] if side == "left" else out[key][:2, :width_a]
        rows_b = out[key][2:, width - width_b :] if side == "left" else out[key][2:, :width_b]
        assert torch.equal(rows_a, a[key]) and torch.equal(rows_b, b[key]), key
    # The padding sits on the right side and is out of every mask.
    assert (out["prompt_ids"][2:, :2] == PAD).all() and (out["prompt_mask"][2:, :2] == 0).all()
    assert (out["completion_ids"][:2, 2:] == PAD).all() and (out["completion_mask"][:2, 2:] == 0).all()
    assert (out["tool_mask"][:2, 2:] == 1).all()
    assert out["prompt_mask"].sum() == 2 * 3 + 3 * 1 and out["completion_mask"].sum() == 2 * 2 + 3 * 4
    assert out["advantages"].tolist() == [0.0, 1.0, 100.0, 101.0, 102.0]
    assert int(out["num_items_in_batch"]) == 2 * 2 + 3 * 4  # the loss tokens of both calls
    assert out["sampling_per_token_logps"] is None
    assert out["texts"] == ["0-0", "0-1", "100-0", "100-1", "100-2"]


def test_concat_refuses_multimodal_fields_and_unknown_scalars():
    a, b = _rollout(2, 2, 1, 0), _rollout(2, 2, 1, 10)
    a["pixel_values"] = b["pixel_values"] = torch.zeros(1, 3)
    with pytest.raises(GRPOVariantsError, match="'pixel_values'.*leave generation_chunk_prompts=None"):
        concat_rollouts([a, b], PAD, fix="leave generation_chunk_prompts=None")
    a, b = _rollout(2, 2, 1, 0), _rollout(2, 2, 1, 10)
    a["temperature"] = b["temperature"] = torch.tensor(1.0)
    with pytest.raises(GRPOVariantsError, match="unexpected scalar 'temperature'"):
        concat_rollouts([a, b], PAD)
