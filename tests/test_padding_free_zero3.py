"""padding_free=True under DeepSpeed ZeRO-3 on 2 CPU processes equals the padded single-process run.

One 2-process ZeRO-3 launch trains GRPO (beta > 0: a partitioned reference model) and µ-GRPO (stage
rollouts, recomputed behaviour log-probs) with ``padding_free=True``; the single-process reference trains the
same variants on TRL's padded forward. Same global batch, seed and (fixed) samples: the losses, gradient
norms and the parameter update must agree within the tolerances of tests/test_zero3.py.
"""

from __future__ import annotations

import json
import sys

import pytest

from test_zero3 import (
    GRAD_NORM_REL,
    LOSS_ABS,
    LOSS_REL,
    UPDATE_REL,
    WORKER,
    _assert_close_series,
    _initial_params,
    _start,
    _update_difference,
    _wait,
    _zero3_cmd,
)

pytestmark = pytest.mark.slow

VARIANTS = ["grpo", "mu_grpo"]


@pytest.fixture(scope="module")
def runs(toy_model_path, tmp_path_factory):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'grpo-variants[deepspeed]')")
    root = tmp_path_factory.mktemp("zero3_padfree")
    zero3 = _start(_zero3_cmd("compare", "--model", toy_model_path, "--variants",
                              ",".join(f"{v}@padfree" for v in VARIANTS), "--workdir", str(root / "zero3"),
                              "--out", str(root / "zero3.json")), root / "zero3.log")
    single = _start([sys.executable, str(WORKER), "compare", "--model", toy_model_path, "--variants",
                     ",".join(f"{v}@padded" for v in VARIANTS), "--workdir", str(root / "single"), "--out", str(root / "single.json")],
                    root / "single.log")
    _wait(single, root / "single.log", "the single-process padded reference run")
    _wait(zero3, root / "zero3.log", "the 2-process ZeRO-3 padding-free launch")
    return json.loads((root / "single.json").read_text()), json.loads((root / "zero3.json").read_text())


@pytest.mark.parametrize("variant", VARIANTS)
def test_zero3_padding_free_matches_padded_single_process(variant, runs, toy_model_path):
    single, zero3 = runs
    ref, got = single[f"{variant}@padded"], zero3[f"{variant}@padfree"]
    assert ref["num_processes"] == 1 and not ref["deepspeed"]
    assert got["num_processes"] == 2 and got["deepspeed"] and got["zero_stage"] == 3
    assert got["shards"]["zero3"] and got["global_step"] == ref["global_step"] >= 3
    if "ref_model_zero3" in got["shards"]:
        assert got["shards"]["ref_model_zero3"]
    assert any(g > 0 for g in ref["grad_norm"])
    assert got["padding_free_steps"] == got["global_step"] and ref["padding_free_steps"] == 0  # packed vs padded
    _assert_close_series(f"{variant} loss", ref["loss"], got["loss"], LOSS_REL, LOSS_ABS)
    _assert_close_series(f"{variant} grad_norm", ref["grad_norm"], got["grad_norm"], GRAD_NORM_REL)
    diff, norm = _update_difference(_initial_params(toy_model_path), ref["params_file"], got["params_file"])
    assert norm > 0 and diff <= UPDATE_REL * norm, (diff, norm)
