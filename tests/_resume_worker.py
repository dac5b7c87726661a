"""Worker for tests/test_resume.py and tests/test_signals.py: one tiny training run per call, results to JSON.

    python tests/_resume_worker.py --variant base --out DIR --max-steps 6 --save-steps 3 \
        [--reference REF_DIR] [--hang-after-save 3] [--resume] [--marker-at-step N]

* ``--reference REF_DIR`` first trains the same config uninterrupted in REF_DIR (result in
  REF_DIR/result.json), then does the main run in the same process.
* ``--hang-after-save K`` writes ``OUT/hang.marker`` once checkpoint-K has been saved (after the
  trainer's save, i.e. after the atomic rename) and sleeps: the test SIGKILLs the process.
* ``--resume`` resumes from the newest complete checkpoint in OUT (``resume_from_checkpoint=True``).
  With ``--variants a,b,...`` (and ``--out ROOT``) it resumes each variant's run in ROOT/<variant>/run, one
  after the other in this one process (tests/test_resume.py: one interpreter start for all the resumes); a
  variant whose resume raises writes ROOT/<variant>/run/resume_error.txt and the next one runs.
* ``--kill-each --variants a,b,... --out ROOT --hang-after-save K``: for each variant, a forked child trains the
  reference and the run that hangs after checkpoint-K, and is SIGKILLed there (tests/test_resume.py: one
  interpreter start for all the kills); how each ended is in ROOT/kills.json.
* ``--marker-at-step N`` writes ``OUT/step.marker`` at the end of optimizer step N and holds
  that step's end until a signal has arrived (the signal test then sends SIGTERM), so the signal
  lands at a known step. ``--slow-reward S`` sleeps S seconds in every reward call.
* ``--nan-at-step S --nan-rank R`` makes the loss value NaN at step S on process R only (finite
  gradient): every process must skip that update together.
* ``--slow-save-at K`` sleeps in the middle of saving checkpoint-K (after the model is written,
  before the optimizer) and writes ``OUT/saving.marker`` (the kill-during-save test).

Each run writes OUT/result.json: the per-step log records and where the final weights are
(``OUT/final``, saved with ``save_model``). Works under ``torchrun`` too (every rank trains; rank 0
writes the result).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GRPO_VARIANTS_CACHE", str(Path(__file__).resolve().parents[1] / ".cache" / "grpo_variants"))

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import grpo_variants  # noqa: E402, F401  (installs the CPU distributed shim under torchrun)
from grpo_variants import GRPOVariantConfig, GRPOVariantTrainer, get_variant, toy  # noqa: E402

NUM_PROMPTS = 8  # a tiny dataset: several epochs in a few steps (exercises the per-epoch data order)

# Settings that make a resume land in the middle of a generation batch (and of a µ-GRPO stage).
MID_BATCH = {
    "base": {"steps_per_generation": 2, "num_iterations": 2},
    "mu_grpo": {"stage_prompts": 8, "updates_per_stage": 4},  # 2 mini-batches x 2 passes per stage
}
DEFAULT_MID_BATCH = {"steps_per_generation": 2}


def build_config(variant: str, out: Path, max_steps: int, save_steps: int, extra: dict):
    config_cls = GRPOVariantConfig if variant == "base" else get_variant(variant).config_cls
    world = int(os.environ.get("WORLD_SIZE", "1"))
    values = dict(
        output_dir=str(out),
        per_device_train_batch_size=16 // world,
        num_generations=4,
        max_completion_length=6,
        max_steps=max_steps,
        learning_rate=1e-4,
        lr_scheduler_type="cosine",
        warmup_steps=0,
        weight_decay=0.01,
        logging_steps=1,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        report_to="none",
        seed=0,
        bf16=False,
        gradient_checkpointing=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    values.update(MID_BATCH.get(variant, DEFAULT_MID_BATCH))
    values.update(extra)
    return config_cls(**values), (GRPOVariantTrainer if variant == "base" else get_variant(variant).trainer_cls)


class _Hooks(TrainerCallback):
    def __init__(self, out: Path, opts, trainer):
        self.out, self.opts, self.trainer = out, opts, trainer

    def on_save(self, args, state, control, **kwargs):
        if self.opts.hang_after_save and state.global_step == self.opts.hang_after_save:
            if state.is_world_process_zero:
                (self.out / "hang.marker").write_text(str(state.global_step))
            time.sleep(3600)  # the test SIGKILLs us here

    def on_step_end(self, args, state, control, **kwargs):
        if self.opts.marker_at_step and state.global_step == self.opts.marker_at_step:
            if state.is_world_process_zero:
                (self.out / "step.marker").write_text(str(state.global_step))
            # wait (up to 2 minutes) for the test's signal, so that it lands at a known step
            deadline = time.monotonic() + 120
            while getattr(self.trainer._signal_watcher, "received", None) is None and time.monotonic() < deadline:
                time.sleep(0.05)


def _slow(reward, seconds):
    def slow_reward(*args, **kwargs):
        time.sleep(seconds)
        return reward(*args, **kwargs)

    slow_reward.__name__ = "toy_accuracy"
    return slow_reward


def train_once(opts, out: Path, hooks: bool, resume: bool) -> dict:
    kit = toy.prepare(task="addition", verbose=False)
    dataset = kit.train_dataset.select(range(opts.num_prompts))
    extra = json.loads(opts.extra) if opts.extra else {}
    args, trainer_cls = build_config(opts.variant, out, opts.max_steps, opts.save_steps, extra)
    reward = toy.toy_accuracy if not opts.slow_reward else _slow(toy.toy_accuracy, opts.slow_reward)
    if opts.nan_at_step:
        trainer_cls = _with_nan_loss(trainer_cls, opts.nan_at_step, opts.nan_rank)
    trainer = trainer_cls(model=kit.model_path, reward_funcs=reward, args=args, train_dataset=dataset)
    if hooks:
        trainer.add_callback(_Hooks(out, opts, trainer))
    if opts.slow_save_at:
        original = trainer._save_optimizer_and_scheduler

        def slow_save(output_dir):
            if trainer.state.global_step == opts.slow_save_at:
                if trainer.args.should_save:
                    (out / "saving.marker").write_text(output_dir)
                time.sleep(3600)  # killed here, mid-save
            return original(output_dir)

        trainer._save_optimizer_and_scheduler = slow_save
    trainer.train(resume_from_checkpoint=True if resume else None)
    trainer.save_model(str(out / "final"))
    records = [r for r in trainer.state.log_history if "loss" in r and "train_runtime" not in r]
    result = {"variant": opts.variant, "global_step": trainer.state.global_step, "records": records,
              "final": str(out / "final")}
    digest = hashlib.sha256()
    for name, p in sorted(trainer.model.named_parameters()):
        digest.update(name.encode() + p.detach().cpu().numpy().tobytes())
    rank = trainer.accelerator.process_index
    (out / f"weights_rank{rank}.sha256").write_text(digest.hexdigest())  # ranks must hold identical weights
    if trainer.accelerator.is_main_process:
        (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


def resume_each(opts) -> int:
    """``--resume --variants a,b,...``: resume every variant's killed run under ``--out`` in this process."""
    import traceback

    assert opts.resume, "--variants resumes killed runs: pass --resume"
    for variant in opts.variants.split(","):
        out = Path(opts.out) / variant / "run"
        try:
            train_once(argparse.Namespace(**{**vars(opts), "variant": variant}), out, hooks=True, resume=True)
        except Exception:
            (out / "resume_error.txt").write_text(traceback.format_exc())
    return 0


def kill_each(opts) -> int:
    """``--kill-each --variants a,b,... --out ROOT --hang-after-save K``: for each variant, a child process (forked
    from this one, so the interpreter and its imports start once) trains the reference in ROOT/<variant>/reference,
    then the same run in ROOT/<variant>/run until checkpoint-K is saved and hangs; this process SIGKILLs it then (a
    real kill: no handler, no clean-up). How each child ended is written to ROOT/kills.json; its output is in
    ROOT/<variant>/first.log."""
    import signal
    import traceback

    assert opts.hang_after_save and not opts.resume, "--kill-each needs --hang-after-save K (and no --resume)"
    root, report = Path(opts.out), {}
    for variant in opts.variants.split(","):
        folder = root / variant
        run, reference = folder / "run", folder / "reference"
        run.mkdir(parents=True, exist_ok=True)
        reference.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: the two runs of main(), with its output in first.log
            code = 1
            try:
                log = os.open(folder / "first.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(log, 1)
                os.dup2(log, 2)
                child = argparse.Namespace(**{**vars(opts), "variant": variant, "variants": ""})
                train_once(child, reference, hooks=False, resume=False)
                train_once(child, run, hooks=True, resume=False)
                print("the run finished: it should have hung after checkpoint", opts.hang_after_save)
            except BaseException:  # noqa: BLE001  (reported through first.log and the exit status)
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        marker, deadline, status = run / "hang.marker", time.monotonic() + opts.kill_timeout, None
        while not marker.exists() and time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            status = None
            time.sleep(0.1)
        if status is None:  # still running: hung after the checkpoint (or past the deadline)
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
        report[variant] = {"hang_marker": marker.exists(),
                           "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                           "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None}
    (root / "kills.json").write_text(json.dumps(report, indent=1))
    return 0


def _with_nan_loss(trainer_cls, step: int, rank: int):
    """The loss *value* becomes NaN at optimizer step ``step`` (1-based) on process ``rank`` only; the gradient
    stays finite, so only the all-reduced loss flag makes every process skip that update together."""

    class NaNLoss(trainer_cls):
        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            if self.state.global_step == step - 1 and self.accelerator.process_index == rank and self.model.training:
                loss = loss + float("nan") * loss.detach()
            return loss

    return NaNLoss


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", default="base")
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--save-steps", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=NUM_PROMPTS)
    parser.add_argument("--reference", default=None)
    parser.add_argument("--hang-after-save", type=int, default=0)
    parser.add_argument("--marker-at-step", type=int, default=0)
    parser.add_argument("--slow-reward", type=float, default=0.0)
    parser.add_argument("--slow-save-at", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--nan-at-step", type=int, default=0, help="NaN loss value at this step (1-based)")
    parser.add_argument("--nan-rank", type=int, default=0, help="... on this process only")
    parser.add_argument("--extra", default="", help="JSON dict of extra config fields")
    parser.add_argument("--variants", default="", help="with --resume: resume ROOT/<variant>/run for each; with "
                        "--kill-each: train and kill each")
    parser.add_argument("--kill-each", action="store_true", help="fork a child per variant, SIGKILL it after "
                        "checkpoint --hang-after-save (see kill_each)")
    parser.add_argument("--kill-timeout", type=float, default=420.0, help="--kill-each: seconds per variant")
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    if opts.kill_each:
        return kill_each(opts)
    if opts.variants:
        return resume_each(opts)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    # the test kills every rank by pid (torchrun starts its workers in their own process groups)
    (out / f"pid_rank{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))
    if opts.reference:
        ref = Path(opts.reference)
        ref.mkdir(parents=True, exist_ok=True)
        reference_opts = argparse.Namespace(**{**vars(opts), "slow_reward": 0.0, "slow_save_at": 0})
        train_once(reference_opts, ref, hooks=False, resume=False)
    train_once(opts, out, hooks=True, resume=opts.resume)
    return 0


if __name__ == "__main__":
    code = main()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from conftest import exit_without_teardown

    exit_without_teardown(code or 0)
