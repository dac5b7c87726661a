"""Failures during training: preemption signals, crashes (no half-written checkpoint), non-finite steps.

* SIGTERM (a real one, sent to a training process) -> a complete, loadable checkpoint at the next
  optimizer step, exit code 143, and the run resumes from it.
* SIGINT in-process -> checkpoint, then KeyboardInterrupt; a second SIGINT exits at once; the
  previous handlers are restored.
* A reward crash, an exception in the middle of a save, and a SIGKILL in the middle of a save
  never leave a ``checkpoint-N`` folder that is incomplete; resume picks the newest complete one.
* A non-finite loss (or gradient) skips the update: parameters, AdamW moments and the LR
  schedule unchanged; ``max_consecutive_nonfinite`` in a row -> NonFiniteLossError.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainerCallback

from grpo_variants import GRPOVariantConfig, GRPOVariantTrainer, NonFiniteLossError, RewardFunctionError, toy
from grpo_variants.reliability import STATE_FILE, checkpoint_incomplete_reason, latest_complete_checkpoint
from test_resume import WORKER, _wait_for, _worker_env

import _resume_worker


def _args(output_dir, **overrides):
    values = dict(
        output_dir=str(output_dir), per_device_train_batch_size=8, num_generations=4, max_completion_length=4,
        max_steps=4, learning_rate=1e-4, lr_scheduler_type="linear", weight_decay=0.01, logging_steps=1,
        save_strategy="no", report_to="none", seed=0, bf16=False, gradient_checkpointing=False, disable_tqdm=True,
    )
    values.update(overrides)
    return GRPOVariantConfig(**values)


def _complete_checkpoints(folder: Path) -> list[int]:
    found = []
    for path in folder.glob("checkpoint-*"):
        assert checkpoint_incomplete_reason(path) is None, f"{path} is incomplete: {checkpoint_incomplete_reason(path)}"
        found.append(int(path.name.split("-")[1]))
    return sorted(found)


# ------------------------------------------------------------------------------------------------
# Signals
# ------------------------------------------------------------------------------------------------
def test_sigterm_saves_a_complete_checkpoint_and_resume_continues(toy_kit, tmp_path):
    run = tmp_path / "run"
    log = tmp_path / "worker.log"
    # save_strategy="no": the only checkpoint is the one the signal triggers.
    cmd = [sys.executable, str(WORKER), "--variant", "base", "--out", str(run), "--max-steps", "200",
           "--save-steps", "0", "--marker-at-step", "2"]
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_worker_env())
    try:
        _wait_for(run / "step.marker", proc, log)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, log.read_text()[-3000:]
    assert "Received SIGTERM" in log.read_text()
    steps = _complete_checkpoints(run)
    assert steps == [2], steps  # the worker holds step 2's end until the signal has arrived
    step = steps[0]
    ckpt = run / f"checkpoint-{step}"
    assert not list(run.glob("tmp-*"))
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["global_step"] == step
    assert (ckpt / STATE_FILE.format(rank=0)).is_file() and (ckpt / "optimizer.pt").is_file()
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    assert sum(p.numel() for p in model.parameters()) > 0

    # ... and training resumes from it
    args, trainer_cls = _resume_worker.build_config("base", run, step + 1, 0, {})
    trainer = trainer_cls(model=toy_kit.model_path, reward_funcs=toy.toy_accuracy, args=args,
                          train_dataset=toy_kit.train_dataset.select(range(_resume_worker.NUM_PROMPTS)))
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == step + 1
    assert [r["step"] for r in trainer.state.log_history if "loss" in r] == list(range(1, step + 2))


class _SendSignal(TrainerCallback):
    def __init__(self, at_step, signum, times=1):
        self.at_step, self.signum, self.times = at_step, signum, times

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at_step:
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)


def test_sigint_saves_then_raises_keyboardinterrupt(toy_kit, tmp_path, small_train_dataset):
    previous = signal.getsignal(signal.SIGINT)
    trainer = GRPOVariantTrainer(model=toy_kit.model_path, reward_funcs=toy.toy_accuracy,
                                 args=_args(tmp_path / "out", max_steps=10), train_dataset=small_train_dataset,
                                 callbacks=[_SendSignal(1, signal.SIGINT)])
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert trainer.state.global_step == 1
    assert _complete_checkpoints(tmp_path / "out") == [1]
    assert signal.getsignal(signal.SIGINT) is previous  # handlers restored


def test_second_signal_exits_immediately_without_checkpoint(toy_kit, tmp_path, small_train_dataset):
    previous = signal.getsignal(signal.SIGTERM)
    trainer = GRPOVariantTrainer(model=toy_kit.model_path, reward_funcs=toy.toy_accuracy,
                                 args=_args(tmp_path / "out", max_steps=10), train_dataset=small_train_dataset,
                                 callbacks=[_SendSignal(1, signal.SIGTERM, times=2)])
    with pytest.raises(SystemExit) as exit_info:
        trainer.train()
    assert exit_info.value.code == 143
    assert not list((tmp_path / "out").glob("checkpoint-*"))
    assert signal.getsignal(signal.SIGTERM) is previous


def test_save_on_signal_false_installs_no_handler(toy_kit, tmp_path, small_train_dataset):
    seen = []

    class Probe(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(signal.getsignal(signal.SIGTERM))

    before = signal.getsignal(signal.SIGTERM)
    trainer = GRPOVariantTrainer(model=toy_kit.model_path, reward_funcs=toy.toy_accuracy,
                                 args=_args(tmp_path / "out", max_steps=1, save_on_signal=False),
                                 train_dataset=small_train_dataset, callbacks=[Probe()])
    trainer.train()
    assert seen == [before]


# ------------------------------------------------------------------------------------------------
# Crashes never leave a half-written checkpoint
# ------------------------------------------------------------------------------------------------
def test_reward_crash_leaves_only_complete_checkpoints(toy_kit, tmp_path, small_train_dataset):
    calls = {"n": 0}

    def flaky_reward(completions, **kwargs):
        calls["n"] += 1
        if calls["n"] >= 3:
            raise ZeroDivisionError("boom in the reward")
        return [0.0] * len(completions)

    trainer = GRPOVariantTrainer(model=toy_kit.model_path, reward_funcs=flaky_reward,
                                 args=_args(tmp_path / "out", save_strategy="steps", save_steps=1),
                                 train_dataset=small_train_dataset)
    with pytest.raises(RewardFunctionError, match="flaky_reward"):
        trainer.train()
    assert _complete_checkpoints(tmp_path / "out") == [1, 2]
    assert not list((tmp_path / "out").glob("tmp-*"))


def test_exception_during_save_leaves_no_checkpoint_dir(toy_kit, tmp_path, small_train_dataset):
    out = tmp_path / "out"
    trainer = GRPOVariantTrainer(model=toy_kit.model_path, reward_funcs=toy.toy_accuracy,
                                 args=_args(out, save_strategy="steps", save_steps=1, max_steps=3),
                                 train_dataset=small_train_dataset)
    original = trainer._save_rng_state  # runs after the model and optimizer files are written

    def crash(output_dir):
        if trainer.state.global_step == 2:
            raise OSError("disk full (simulated) while saving")
        return original(output_dir)

    trainer._save_rng_state = crash
    with pytest.raises(OSError, match="disk full"):
        trainer.train()
    assert _complete_checkpoints(out) == [1]
    staged = out / "tmp-checkpoint-2" / "checkpoint-2"
    assert (staged / "model.safetensors").is_file()  # the half-written save exists, but only under tmp-
    assert latest_complete_checkpoint(out) == str(out / "checkpoint-1")

    resumed = GRPOVariantTrainer(model=toy_kit.model_path, reward_funcs=toy.toy_accuracy,
                                 args=_args(out, save_strategy="steps", save_steps=1, max_steps=3),
                                 train_dataset=small_train_dataset)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3
    assert _complete_checkpoints(out) == [1, 2, 3]
    assert not list(out.glob("tmp-*")), "stale staging folder removed"


@pytest.mark.slow
def test_sigkill_during_save_leaves_no_checkpoint_dir(toy_model_path, tmp_path):
    run = tmp_path / "run"
    log = tmp_path / "worker.log"
    cmd = [sys.executable, str(WORKER), "--variant", "base", "--out", str(run), "--max-steps", "4",
           "--save-steps", "1", "--slow-save-at", "2"]
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_worker_env())
    try:
        _wait_for(run / "saving.marker", proc, log)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert (run / "tmp-checkpoint-2" / "checkpoint-2" / "model.safetensors").is_file()
    assert not (run / "checkpoint-2").exists()
    assert _complete_checkpoints(run) == [1]
    assert latest_complete_checkpoint(run) == str(run / "checkpoint-1")


# ------------------------------------------------------------------------------------------------
# Non-finite loss / gradients
# ------------------------------------------------------------------------------------------------
class _NaNLossTrainer(GRPOVariantTrainer):
    """The loss *value* is NaN during the optimizer steps in ``nan_steps`` (0-based); its gradient stays finite.

    (``loss + NaN * loss.detach()``: the NaN term is a constant for autograd, so only the loss check
    can catch it -- the gradient check is tested separately.)
    """

    nan_steps: set = set()

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        if self.state.global_step in self.nan_steps:
            loss = loss + float("nan") * loss.detach()
        return loss


class _Snapshots(TrainerCallback):
    def __init__(self):
        self.params, self.moments, self.lrs = {}, {}, {}

    def on_step_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        self.params[state.global_step] = {k: v.detach().clone() for k, v in model.named_parameters()}
        self.moments[state.global_step] = {
            i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in optimizer.state_dict()["state"].items()
        }
        self.lrs[state.global_step] = lr_scheduler.get_last_lr()[0]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        (torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else (_same(a[k], b[k]) if isinstance(a[k], dict)
                                                                 else a[k] == b[k]))
        for k in a
    )


@pytest.mark.parametrize("where", ["loss", "gradient"])
def test_nonfinite_step_is_skipped_and_training_continues(toy_kit, tmp_path, small_train_dataset, where):
    snaps = _Snapshots()
    cls = _NaNLossTrainer if where == "loss" else GRPOVariantTrainer
    trainer = cls(model=toy_kit.model_path, reward_funcs=toy.toy_accuracy, args=_args(tmp_path / "out"),
                  train_dataset=small_train_dataset, callbacks=[snaps])
    if where == "loss":
        trainer.nan_steps = {1}
    else:  # a finite loss whose gradient for one weight becomes inf at the second step
        weight = dict(trainer.model.named_parameters())["model.layers.0.mlp.up_proj.weight"]
        weight.register_hook(lambda g: g * float("inf") if trainer.state.global_step == 1 else g)
    trainer.train()
    assert trainer.state.global_step == 4
    assert _same(snaps.params[2], snaps.params[1]), "parameters changed on the skipped step"
    assert _same(snaps.moments[2], snaps.moments[1]), "AdamW state changed on the skipped step"
    assert snaps.lrs[2] == snaps.lrs[1], "the LR schedule advanced on the skipped step"
    assert not _same(snaps.params[3], snaps.params[2]), "training did not continue after the skip"
    assert all(torch.isfinite(p).all() for p in snaps.params[4].values())
    skipped = {r["step"]: r["nonfinite/skipped_steps"] for r in trainer.state.log_history
               if "nonfinite/skipped_steps" in r}
    assert skipped == {1: 0.0, 2: 1.0, 3: 1.0, 4: 1.0}


def test_consecutive_nonfinite_steps_raise(toy_kit, tmp_path, small_train_dataset):
    snaps = _Snapshots()
    trainer = _NaNLossTrainer(model=toy_kit.model_path, reward_funcs=toy.toy_accuracy,
                              args=_args(tmp_path / "out", max_steps=10, max_consecutive_nonfinite=2),
                              train_dataset=small_train_dataset, callbacks=[snaps])
    trainer.nan_steps = set(range(1, 10))
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    with pytest.raises(NonFiniteLossError, match=r"2 consecutive optimizer steps.*max_consecutive_nonfinite=2"):
        trainer.train()
    assert max(snaps.params) == 2  # step 2 was skipped, step 3 raised
    after = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    assert _same(after, snaps.params[1]) and not _same(after, before)
    assert math.isfinite(snaps.lrs[2])
