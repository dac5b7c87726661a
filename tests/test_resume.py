"""Exact resume: a run killed after checkpoint k and resumed equals an uninterrupted run, bitwise on CPU.

Every registered variant is covered (the list is read from the registry at collection time, so a
new variant is tested as soon as it registers). The slow tests really SIGKILL a training process
right after checkpoint k is on disk (tests/_resume_worker.py), resume it from the newest complete
checkpoint and train to 2k; per-step losses and every deterministic logged metric must equal the
uninterrupted run's, and so must the final weights. The settings put the resume in the middle of a
generation batch (steps_per_generation=2; base: also num_iterations=2; µ-GRPO: mid-stage) and, with
8 prompts, past an epoch boundary (the sampler's per-epoch order).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_variants import ConfigError, GRPOVariantConfig, GRPOVariantTrainer, list_variants, toy
from grpo_variants.reliability import (
    STATE_FILE,
    latest_complete_checkpoint,
    resolve_resume_checkpoint,
)

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_resume_worker.py"
K = 3  # checkpoint after K steps, then train to 2K

VARIANTS = ["base"] + [spec.name for spec in list_variants()]
# Absolute tolerance on losses, metrics and final weights, per variant. 0.0 = bitwise identical.
# Every variant registered today resumes bitwise; a variant that cannot must say why here.
TOLERANCE: dict[str, float] = {}


def _measures_time_or_memory(key: str) -> bool:
    """Logged keys that measure wall time, throughput or memory (they legitimately differ between runs)."""
    return ("time" in key or key.endswith(("_s", "_seconds")) or "per_s" in key or key.startswith("throughput/")
            or key.startswith("memory/"))


def _deterministic(record: dict) -> dict:
    return {k: v for k, v in record.items() if not _measures_time_or_memory(k)}


def _worker_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(HERE.parent) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _wait_for(path: Path, proc: subprocess.Popen, log: Path, timeout: float = 420.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"worker exited with {proc.returncode} before {path.name} appeared:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            pytest.fail(f"timed out waiting for {path}:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)


def _run(cmd: list[str], log: Path, timeout: float = 420.0) -> None:
    with log.open("w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=_worker_env(), timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{log.read_text()[-4000:]}"


def _assert_same_run(reference: Path, resumed: Path, steps: int, atol: float, ckpt_name: str = "") -> None:
    ref = json.loads((reference / "result.json").read_text())
    res = json.loads((resumed / "result.json").read_text())
    assert res["global_step"] == ref["global_step"] == steps
    ref_records, res_records = ref["records"], res["records"]
    assert [r["step"] for r in res_records] == [r["step"] for r in ref_records] == list(range(1, steps + 1))
    for a, b in zip(ref_records, res_records):
        a, b = _deterministic(a), _deterministic(b)
        assert a.keys() == b.keys(), f"step {a['step']}: logged keys differ: {a.keys() ^ b.keys()}"
        for key in a:
            if a[key] is None or b[key] is None or isinstance(a[key], str):
                assert a[key] == b[key], f"step {a['step']}: {key}: {a[key]} != {b[key]}"
            else:
                assert abs(a[key] - b[key]) <= atol, f"step {a['step']} {ckpt_name}: {key}: {a[key]!r} vs {b[key]!r}"
    wa = load_file(str(Path(ref["final"]) / "model.safetensors"))
    wb = load_file(str(Path(res["final"]) / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for name in wa:
        if atol == 0.0:
            assert torch.equal(wa[name], wb[name]), f"final weight {name} differs"
        else:
            torch.testing.assert_close(wb[name], wa[name], atol=atol, rtol=0.0)


# ------------------------------------------------------------------------------------------------
# Real kill, every variant (slow: three short trainings per variant). An interpreter start with its imports is
# most of the cost of a toy run, so one worker process starts once and forks a child per variant, which trains
# and is SIGKILLed after checkpoint-K; then one process resumes them all.
# ------------------------------------------------------------------------------------------------
def _check_killed(variant: str, folder: Path, ended: dict | None) -> None:
    """The child ran to checkpoint-K, was SIGKILLed there, and left checkpoint-K complete and nothing after it."""
    run, log = folder / "run", folder / "first.log"
    tail = log.read_text(errors="replace")[-4000:] if log.exists() else "(no log)"
    assert ended is not None, f"{variant}: no kill was recorded:\n{tail}"
    assert ended["hang_marker"], f"{variant}: the run ended before checkpoint-{K} was saved ({ended}):\n{tail}"
    assert ended["signal"] == signal.SIGKILL, f"{variant}: not ended by SIGKILL ({ended}):\n{tail}"
    assert (run / f"checkpoint-{K}").is_dir() and not (run / f"checkpoint-{2 * K}").exists()
    assert (run / f"checkpoint-{K}" / STATE_FILE.format(rank=0)).is_file()
    assert not (run / "result.json").exists()


@pytest.fixture(scope="module")
def killed_then_resumed(toy_model_path, tmp_path_factory):
    """Every variant trained and SIGKILLed after checkpoint-K (a forked child each), then resumed to 2K in one
    process. A variant whose kill phase fails keeps its failure for its own test; the others still resume."""
    root = tmp_path_factory.mktemp("resume_after_sigkill")
    _run([sys.executable, str(WORKER), "--kill-each", "--variants", ",".join(VARIANTS), "--out", str(root),
          "--max-steps", str(2 * K), "--save-steps", str(K), "--hang-after-save", str(K)], root / "kill.log",
         timeout=120.0 + 300 * len(VARIANTS))
    ended = json.loads((root / "kills.json").read_text())
    failed: dict[str, BaseException] = {}
    for variant in VARIANTS:
        try:
            _check_killed(variant, root / variant, ended.get(variant))
        except AssertionError as exc:
            failed[variant] = exc
    killed = [v for v in VARIANTS if v not in failed]
    if killed:
        _run([sys.executable, str(WORKER), "--resume", "--variants", ",".join(killed), "--out", str(root),
              "--max-steps", str(2 * K), "--save-steps", str(K)], root / "resume.log", timeout=420.0 + 60 * len(killed))
    return root, failed


@pytest.mark.slow
@pytest.mark.xdist_group("resume")  # the module fixture above runs once, on one worker
@pytest.mark.parametrize("variant", VARIANTS)
def test_resume_after_sigkill_matches_uninterrupted_run(variant, killed_then_resumed):
    root, failed = killed_then_resumed
    if variant in failed:
        raise failed[variant]
    error = root / variant / "run" / "resume_error.txt"
    assert not error.exists(), f"{variant}: the resume raised:\n{error.read_text()[-4000:]}"
    _assert_same_run(root / variant / "reference", root / variant / "run", 2 * K, TOLERANCE.get(variant, 0.0),
                     ckpt_name=variant)


@pytest.mark.slow
def test_resume_two_processes_after_sigkill(toy_model_path, tmp_path):
    """torchrun with 2 CPU processes (gloo): per-rank state files, all ranks killed, exact resume.

    Rank 1's loss is NaN at step 2 (finite gradient): both ranks must skip that update together.
    """
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(29500 + os.getpid() % 1000)]
    reference, run = tmp_path / "reference", tmp_path / "run"
    log = tmp_path / "first.log"
    nan = ["--nan-at-step", "2", "--nan-rank", "1"]
    cmd = torchrun + [str(WORKER), "--variant", "base", "--out", str(run), "--reference", str(reference),
                      "--max-steps", str(2 * K), "--save-steps", str(K), "--hang-after-save", str(K), *nan]
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_worker_env(), start_new_session=True)
    try:
        _wait_for(run / "hang.marker", proc, log)
    finally:
        # every rank (torchrun gives its workers their own process groups), then the launcher
        for pid_file in run.glob("pid_rank*"):
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    ckpt = run / f"checkpoint-{K}"
    assert (ckpt / STATE_FILE.format(rank=0)).is_file() and (ckpt / STATE_FILE.format(rank=1)).is_file()
    assert (ckpt / "rng_state_0.pth").is_file() and (ckpt / "rng_state_1.pth").is_file()
    assert not list(run.glob("tmp-*"))
    torchrun[-1] = str(29500 + (os.getpid() + 1) % 1000)
    _run(torchrun + [str(WORKER), "--variant", "base", "--out", str(run), "--max-steps", str(2 * K),
                     "--save-steps", str(K), "--resume", *nan], tmp_path / "resume.log")
    for folder in (reference, run):  # both ranks skipped step 2 together: identical weights everywhere
        assert (folder / "weights_rank0.sha256").read_text() == (folder / "weights_rank1.sha256").read_text()
    _assert_same_run(reference, run, 2 * K, 0.0)
    records = json.loads((run / "result.json").read_text())["records"]
    assert [r["nonfinite/skipped_steps"] for r in records] == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]


# ------------------------------------------------------------------------------------------------
# Fast, in-process: exact resume of the base trainer (mid generation batch, past an epoch boundary,
# in the middle of a logging window)
# ------------------------------------------------------------------------------------------------
def _in_process_args(output_dir, **overrides):
    values = dict(
        output_dir=str(output_dir), per_device_train_batch_size=16, num_generations=4, max_completion_length=6,
        max_steps=2 * K, learning_rate=1e-4, lr_scheduler_type="linear", weight_decay=0.01, logging_steps=2,
        save_strategy="steps", save_steps=K, steps_per_generation=2, report_to="none", seed=0, bf16=False,
        gradient_checkpointing=False, disable_tqdm=True,
    )
    values.update(overrides)
    return GRPOVariantConfig(**values)


def test_resume_in_process_is_exact(toy_kit, tmp_path):
    dataset = toy_kit.train_dataset.select(range(8))  # 2 optimizer steps per epoch: checkpoint 3 is in epoch 1
    first = GRPOVariantTrainer(model=toy_kit.model_path, reward_funcs=toy.toy_accuracy,
                               args=_in_process_args(tmp_path / "a"), train_dataset=dataset)
    first.train()
    ckpt = tmp_path / "a" / f"checkpoint-{K}"
    assert ckpt.is_dir() and (tmp_path / "a" / f"checkpoint-{2 * K}").is_dir()
    saved = torch.load(ckpt / STATE_FILE.format(rank=0), weights_only=True)
    assert saved["trl_step"] == K and saved["global_step"] == K
    assert saved["buffered_inputs"] is not None and len(saved["buffered_inputs"]) == 2  # a half-used batch
    assert saved["metrics"]["train"]["reward"], "the open logging window (step 3 of a 2-step window) was saved"

    second = GRPOVariantTrainer(model=toy_kit.model_path, reward_funcs=toy.toy_accuracy,
                                args=_in_process_args(tmp_path / "b"), train_dataset=dataset)
    second.train(resume_from_checkpoint=str(ckpt))
    assert second.state.global_step == 2 * K and second._step == first._step
    ref = [r for r in first.state.log_history if "loss" in r and "train_runtime" not in r]
    res = [r for r in second.state.log_history if "loss" in r and "train_runtime" not in r]
    assert [r["step"] for r in res] == [r["step"] for r in ref] == [2, 4, 6]
    for a, b in zip(ref, res):
        assert _deterministic(a) == _deterministic(b), f"step {a['step']}"
    # counters continue instead of restarting
    assert second._tokens_generated_total == first._tokens_generated_total > 0
    assert second._generation_rounds_total == first._generation_rounds_total == 3
    for (name, p), (_, q) in zip(first.model.named_parameters(), second.model.named_parameters()):
        assert torch.equal(p, q), name


# ------------------------------------------------------------------------------------------------
# Which checkpoint resume_from_checkpoint=True picks
# ------------------------------------------------------------------------------------------------
def _fake_checkpoint(path: Path, complete: bool = True) -> Path:
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"")
    if complete:
        (path / "trainer_state.json").write_text(json.dumps({"global_step": int(path.name.split("-")[-1])}))
    return path


def test_resume_true_picks_newest_complete_checkpoint(tmp_path):
    _fake_checkpoint(tmp_path / "checkpoint-2")
    newest_complete = _fake_checkpoint(tmp_path / "checkpoint-10")  # numeric, not lexicographic, order
    _fake_checkpoint(tmp_path / "checkpoint-12", complete=False)  # killed mid-save by a non-atomic writer
    _fake_checkpoint(tmp_path / "tmp-checkpoint-14")  # a staging folder: never a candidate
    (tmp_path / "checkpoint-11").mkdir()
    (tmp_path / "checkpoint-11" / "trainer_state.json").write_text("{truncated")  # unparsable
    assert latest_complete_checkpoint(tmp_path) == str(newest_complete)
    assert resolve_resume_checkpoint(True, tmp_path) == str(newest_complete)
    assert resolve_resume_checkpoint(None, tmp_path) is None

    with pytest.raises(ConfigError, match="trainer_state.json") as err:
        resolve_resume_checkpoint(str(tmp_path / "checkpoint-12"), tmp_path)
    assert "checkpoint-10" in str(err.value)
    shutil.rmtree(tmp_path / "checkpoint-2")
    shutil.rmtree(tmp_path / "checkpoint-10")
    with pytest.raises(ConfigError, match="resume_from_checkpoint=True.*no complete checkpoint"):
        resolve_resume_checkpoint(True, tmp_path)
