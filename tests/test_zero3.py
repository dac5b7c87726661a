"""DeepSpeed ZeRO-3 for every variant, on CPU: 2 processes over gloo, the single-process reference, resume.

How it runs: ``accelerate launch --config_file recipes/accelerate/zero3.yaml --num_processes 2
tests/_zero3_worker.py ...``. On a machine without CUDA accelerate picks no backend for a DeepSpeed
launch; ``grpo_variants.runtime.distributed`` (installed on ``import grpo_variants``) makes it use gloo, so
DeepSpeed really partitions across the two CPU processes (the test asserts it).

What must hold, for the base trainer and per registered variant (collected from ``list_variants()``
at collection time, so a new variant is covered without touching this file):

* the parameters are partitioned: each rank holds half of every parameter (``ds_tensor``), and
  every parameter above ZeRO-3's persistence threshold is released (``numel() == 0``) outside a
  gather; the reference model (beta > 0) is partitioned too;
* with generation made identical in both layouts (``_zero3_worker.make_deterministic``: the real,
  gathered-parameter generation still runs every rollout, then its samples are replaced by a fixed
  function of the prompt), the per-step loss and gradient norm and the whole parameter update of
  3 steps (on-policy, off-policy reuse, fresh rollout) match a single-process run without
  DeepSpeed on the same global batch and seed. Tolerances: loss ``rel 1e-4 / abs 1e-5``, gradient
  norm ``rel 1e-4``, update ``||d_zero3 - d_ref|| <= 1e-3 ||d_ref||`` (observed at most 2e-7 abs,
  3e-6 rel, 4e-5 rel: float32 reduction order). A cross-rank normalisation bug moves them by orders
  of magnitude more (dropping the ``/ num_processes`` of the token-mean halves DAPO's loss and
  gradient norm under 2 processes);
* the same holds with ``ds3_gather_for_generation=False`` (generation on the partitioned model,
  ranks stepping through ``generate`` in lock-step) and TRL's padded training forward
  (``padding_free=False``; the default "auto" packs the toy model in the other cases), checked for GRPO
  (``grpo@nogather``);
* padding-free under ZeRO-3 equals TRL's padded forward in one process: GRPO with ``padding_free=True`` and
  µ-GRPO under "auto" against their ``@padded`` single-process runs (same launches, same tolerances);
* save -> kill (``os._exit`` right after the checkpoint) -> resume in fresh processes continues
  with the same losses and parameters as the uninterrupted run (real sampling, DAPO).

Both layouts keep every prompt group on one rank, and a rollout is one mini-batch
(``steps_per_generation=1``): with more, TRL shuffles each rank's local generation batch into
mini-batches, so which rows share a mini-batch would depend on the layout (TRL's design, not a bug).
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_variants import list_variants

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "_zero3_worker.py"
ZERO3_YAML = REPO / "recipes" / "accelerate" / "zero3.yaml"
# every registered variant, plus the base trainer with no variant (TRL's defaults)
VARIANTS = ["base", *(spec.name for spec in list_variants())]
# extra ZeRO-3 cases, compared with the reference run of their variant (see _zero3_worker.CASES)
EXTRA_CASES = {"grpo@nogather": "grpo"} if "grpo" in VARIANTS else {}
# padding-free under ZeRO-3 against TRL's padded single-process forward: ZeRO-3 case -> single-process case.
# GRPO (beta > 0: a partitioned reference model) with padding_free=True as asked, µ-GRPO (stage rollouts,
# recomputed behaviour log-probs) under the default "auto", which packs it (asserted above). Same launches as the
# other cases: the padded references run in the single process, "grpo@padfree" in the ZeRO-3 launch.
PADFREE_PAIRS = {f"{v}@padfree" if v == "grpo" else v: f"{v}@padded" for v in ("grpo", "mu_grpo") if v in VARIANTS}
LAUNCH_TIMEOUT = 600

LOSS_REL, LOSS_ABS = 1e-4, 1e-5
GRAD_NORM_REL = 1e-4
UPDATE_REL = 1e-3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES=env.get("CUDA_VISIBLE_DEVICES", ""))
    return env


def _zero3_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ZERO3_YAML),
            "--num_processes", "2", "--main_process_port", str(_free_port()), str(WORKER), *args]


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    handle = log.open("w")
    # own session: on a timeout the whole launcher tree (launcher + ranks) is killed by its group id
    return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=handle, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait(proc: subprocess.Popen, log: Path, what: str) -> None:
    try:
        rc = proc.wait(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"{what} did not finish in {LAUNCH_TIMEOUT} s (ranks out of lock-step?). Log tail:\n"
                    + _tail(log))
    if rc != 0:
        pytest.fail(f"{what} exited with {rc}. Log tail:\n" + _tail(log))


def _tail(log: Path, lines: int = 60) -> str:
    text = [line for line in log.read_text(errors="replace").splitlines() if "Warning" not in line]
    return "\n".join(text[-lines:])


@pytest.fixture(scope="module")
def compare_runs(toy_model_path, tmp_path_factory):
    """One 2-process ZeRO-3 launch over every variant and one single-process reference, run side by side."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'grpo-variants[deepspeed]')")
    root = tmp_path_factory.mktemp("zero3")
    zero3_cases = [*VARIANTS, *EXTRA_CASES, *(case for case in PADFREE_PAIRS if case not in VARIANTS)]
    common = ["compare", "--model", toy_model_path, "--variants", ",".join([*VARIANTS, *PADFREE_PAIRS.values()])]
    zero3 = _start(_zero3_cmd("compare", "--model", toy_model_path, "--variants", ",".join(zero3_cases),
                              "--workdir", str(root / "zero3"), "--out", str(root / "zero3.json")),
                   root / "zero3.log")
    single = _start([sys.executable, str(WORKER), *common, "--workdir", str(root / "single"),
                     "--out", str(root / "single.json")], root / "single.log")
    _wait(single, root / "single.log", "the single-process reference run")
    _wait(zero3, root / "zero3.log", "the 2-process ZeRO-3 launch")
    return json.loads((root / "single.json").read_text()), json.loads((root / "zero3.json").read_text())


def _initial_params(model_path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v.float() for k, v in load_file(os.path.join(model_path, "model.safetensors")).items()}


def _update_difference(initial, ref_file, other_file) -> tuple[float, float]:
    """(||d_other - d_ref||, ||d_ref||) over all trainable parameters, d = final - initial."""
    ref, other = torch.load(ref_file), torch.load(other_file)
    assert ref.keys() == other.keys()
    diff = norm = 0.0
    for name, final in ref.items():
        start = initial[name]
        d_ref, d_other = (final - start).double(), (other[name] - start).double()
        diff += (d_other - d_ref).pow(2).sum().item()
        norm += d_ref.pow(2).sum().item()
    return math.sqrt(diff), math.sqrt(norm)


def _assert_close_series(name, ref, got, rel, abs_=0.0):
    assert len(ref) == len(got), f"{name}: {len(ref)} logged steps in the reference, {len(got)} under ZeRO-3"
    for step, (a, b) in enumerate(zip(ref, got, strict=True), start=1):
        assert math.isfinite(b), f"{name} at step {step} is not finite under ZeRO-3: {b}"
        assert math.isclose(a, b, rel_tol=rel, abs_tol=abs_), (
            f"{name} at step {step}: single process {a!r}, ZeRO-3 x2 {b!r} (tolerance rel {rel}, abs {abs_})"
        )


@pytest.mark.parametrize("variant", [*VARIANTS, *EXTRA_CASES])
def test_zero3_partitions_and_matches_single_process(variant, compare_runs, toy_model_path):
    single, zero3 = compare_runs
    ref, got = single[EXTRA_CASES.get(variant, variant)], zero3[variant]

    # the layouts are what they claim to be
    assert ref["num_processes"] == 1 and not ref["deepspeed"] and not ref["shards"]["zero3"]
    assert got["num_processes"] == 2 and got["deepspeed"] and got["zero_stage"] == 3, got["distributed_type"]
    assert got["global_step"] == ref["global_step"] >= 3
    # padding_free="auto": packed in both layouts (single process: the probe passes; ZeRO-3: qwen2 is a verified
    # backbone), except grpo@nogather, which asks for TRL's padded forward
    assert ref["padding_free_steps"] == ref["global_step"]
    assert got["padding_free_steps"] == (0 if variant.endswith("@nogather") else got["global_step"])

    # each rank holds only its shard; large parameters are released outside a gather
    shards = got["shards"]
    assert shards["zero3"] and shards["world"] == 2
    total, per_rank = shards["total_numel"], shards["local_shard_numel_per_rank"]
    assert total == ref["shards"]["total_numel"]
    for local in per_rank:  # ceil(numel / world) per parameter
        assert total / 2 <= local <= total / 2 + shards["num_params"], (per_rank, total)
    assert shards["num_above_threshold"] > 0
    assert shards["released_above_threshold"] == shards["num_above_threshold"], shards
    assert shards["visible_numel"] < total / 10, shards
    if "ref_model_zero3" in shards:
        assert shards["ref_model_zero3"], "the reference model is not partitioned under ZeRO-3"

    # same global batch and seed, identical samples: same losses, gradients and update
    assert any(g > 0 for g in ref["grad_norm"]), f"{variant}: no gradient at all, the comparison would be vacuous"
    _assert_close_series(f"{variant} loss", ref["loss"], got["loss"], LOSS_REL, LOSS_ABS)
    _assert_close_series(f"{variant} grad_norm", ref["grad_norm"], got["grad_norm"], GRAD_NORM_REL)
    diff, norm = _update_difference(_initial_params(toy_model_path), ref["params_file"], got["params_file"])
    assert norm > 0, f"{variant}: the reference run did not change the parameters"
    assert diff <= UPDATE_REL * norm, (
        f"{variant}: parameter update under ZeRO-3 differs from the single-process one by {diff:.3g} "
        f"(||update|| = {norm:.3g}, tolerance {UPDATE_REL} relative)"
    )


@pytest.mark.parametrize("case", PADFREE_PAIRS)
def test_zero3_padding_free_matches_padded_single_process(case, compare_runs, toy_model_path):
    """padding_free under ZeRO-3 on 2 processes equals TRL's padded forward in one process: same global batch,
    seed and (fixed) samples; losses, gradient norms and the parameter update within the tolerances above."""
    single, zero3 = compare_runs
    ref, got = single[PADFREE_PAIRS[case]], zero3[case]
    assert ref["num_processes"] == 1 and not ref["deepspeed"]
    assert got["num_processes"] == 2 and got["deepspeed"] and got["zero_stage"] == 3
    assert got["shards"]["zero3"] and got["global_step"] == ref["global_step"] >= 3
    if "ref_model_zero3" in got["shards"]:
        assert got["shards"]["ref_model_zero3"]
    assert any(g > 0 for g in ref["grad_norm"])
    assert got["padding_free_steps"] == got["global_step"] and ref["padding_free_steps"] == 0  # packed vs padded
    _assert_close_series(f"{case} loss", ref["loss"], got["loss"], LOSS_REL, LOSS_ABS)
    _assert_close_series(f"{case} grad_norm", ref["grad_norm"], got["grad_norm"], GRAD_NORM_REL)
    diff, norm = _update_difference(_initial_params(toy_model_path), ref["params_file"], got["params_file"])
    assert norm > 0 and diff <= UPDATE_REL * norm, (diff, norm)


RESUME_VARIANT = "dapo" if "dapo" in VARIANTS else "grpo"
RESUME_STEPS, KILL_AFTER = 5, 3


@pytest.fixture(scope="module")
def resume_runs(toy_model_path, tmp_path_factory):
    """Launch 1: the uninterrupted run, then the same run killed right after checkpoint-3.
    Launch 2: fresh processes resume checkpoint-3 and finish. Real sampling throughout."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'grpo-variants[deepspeed]')")
    root = tmp_path_factory.mktemp("zero3_resume")
    common = ["resume", "--model", toy_model_path, "--variants", RESUME_VARIANT, "--workdir", str(root),
              "--steps", str(RESUME_STEPS), "--save-steps", str(KILL_AFTER), "--kill-after", str(KILL_AFTER),
              "--real-generation"]
    kill = _start(_zero3_cmd(*common, "--phase", "kill", "--out", str(root / "kill.json")), root / "kill.log")
    _wait(kill, root / "kill.log", "the save -> kill launch")
    resume = _start(_zero3_cmd(*common, "--phase", "resume", "--out", str(root / "resume.json")),
                    root / "resume.log")
    _wait(resume, root / "resume.log", "the resume launch")
    return root, json.loads((root / "kill.json").read_text()), json.loads((root / "resume.json").read_text())


def test_zero3_save_kill_resume(resume_runs, toy_model_path):
    root, killed_run, resumed_run = resume_runs
    reference, killed, resumed = killed_run["reference"], killed_run["killed"], resumed_run["resumed"]
    assert reference["global_step"] == RESUME_STEPS and killed["global_step"] == KILL_AFTER
    # real sampling with num_iterations=2: the behaviour log-probs were recorded in generate on both ranks
    # (ZeRO-3 generate keeps ranks in lock-step with synced_gpus), never recomputed
    assert reference["recorded_logprob_steps"] > 0 and reference["record_failures"] == [], reference
    checkpoint = root / "killed" / f"checkpoint-{KILL_AFTER}"
    # ZeRO-3's checkpoint: one model-state and one optimizer-state shard per rank
    shards = sorted(p.name for p in (checkpoint / f"global_step{KILL_AFTER}").iterdir())
    assert sum("optim_states" in s for s in shards) == 2 and sum("model_states" in s for s in shards) == 2, shards

    # before the kill the run was the reference run; after the resume it continues as if never stopped
    _assert_close_series("loss before the kill", reference["loss"][:KILL_AFTER], killed["loss"], 1e-6, 1e-8)
    assert resumed["global_step"] == RESUME_STEPS
    assert len(resumed["loss"]) == RESUME_STEPS
    _assert_close_series("loss after the resume", reference["loss"][KILL_AFTER:], resumed["loss"][KILL_AFTER:],
                         1e-6, 1e-8)
    _assert_close_series("grad_norm after the resume", reference["grad_norm"][KILL_AFTER:],
                         resumed["grad_norm"][KILL_AFTER:], 1e-6)
    assert any(g > 0 for g in reference["grad_norm"][KILL_AFTER:]), "no gradient after the checkpoint: vacuous"
    diff, norm = _update_difference(_initial_params(toy_model_path), reference["params_file"],
                                    resumed["params_file"])
    assert norm > 0 and diff <= 1e-6 * norm, f"resumed parameters differ: {diff:.3g} (update norm {norm:.3g})"
    assert resumed["shards"]["zero3"] and resumed["shards"]["released_above_threshold"] > 0


@pytest.fixture(scope="module")
def nonfinite_run(toy_model_path, tmp_path_factory):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'grpo-variants[deepspeed]')")
    root = tmp_path_factory.mktemp("zero3_nonfinite")
    proc = _start(_zero3_cmd("nonfinite", "--model", toy_model_path, "--workdir", str(root),
                             "--out", str(root / "nonfinite.json")), root / "nonfinite.log")
    _wait(proc, root / "nonfinite.log", "the non-finite launch")
    return json.loads((root / "nonfinite.json").read_text())


def test_zero3_discards_a_nonfinite_update(nonfinite_run):
    """A NaN loss at step 2 of 3: DeepSpeed's ZeRO-3 engine discards the update on both ranks (weights and
    AdamW's step count unchanged), the guard counts it as skipped, and training goes on."""
    run = nonfinite_run
    assert run["global_step"] == 3
    for rank in run["per_rank"]:
        assert rank["step1_changed"] and rank["step3_changed"], rank  # finite steps do move the shard
        assert not rank["nan_step_changed"], rank  # the NaN step does not
        assert rank["finite_after"], rank
    assert run["engine_skipped_steps"] == 1
    assert run["adam_steps"] == [2], run  # 3 optimizer steps, one discarded
    assert run["skipped_logged"][-1] == 1.0 and run["nonfinite_logged"][-1] == 1.0, run
