"""What the toy-task benchmarks share: an offline environment, the toy run config, held-out evaluation.

Import it before torch / transformers (it sets the environment they read at import time)::

    from _bench import HeldOutEval, toy_run_config   # run as `python benchmarks/<script>.py`
"""

from __future__ import annotations

import os
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

os.environ.setdefault("GRPO_VARIANTS_CACHE", str(REPO / ".cache" / "grpo_variants"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

from transformers import TrainerCallback  # noqa: E402

from grpo_variants.tasks import toy  # noqa: E402
from grpo_variants.lab import TOY_CONFIG  # noqa: E402


def toy_run_config(output_dir: str, seed: int, batch: int, group: int, lr: float, **overrides) -> dict:
    """Config values of one benchmark arm: the lab's toy recipe (lr constant, 6 new tokens, no bf16, no
    gradient checkpointing, no checkpoints, log every step) with this arm's batch, seed and folder."""
    return {
        **TOY_CONFIG,
        "output_dir": output_dir,
        "per_device_train_batch_size": batch,
        "num_generations": group,
        "learning_rate": lr,
        "weight_decay": 0.0,
        "seed": seed,
        "data_seed": seed,
        "dataloader_num_workers": 0,
        **overrides,
    }


class HeldOutEval(TrainerCallback):
    """Held-out greedy accuracy (``toy.evaluate``, or ``evaluate(model, tokenizer)`` when given) at the start,
    every ``every_steps`` optimizer steps or every ``every_tokens`` generated tokens, and at the end.

    ``curve`` records (generated tokens, step, training seconds, accuracy); the time spent evaluating
    (wall and process CPU) is excluded from the training seconds and kept in ``eval_seconds`` /
    ``eval_cpu_seconds``. ``toy.evaluate`` leaves the training RNG untouched.
    """

    def __init__(self, trainer, eval_dataset, every_steps: int | None = None, every_tokens: int | None = None,
                 evaluate=None):
        if (every_steps is None) == (every_tokens is None):
            raise ValueError("give exactly one of every_steps / every_tokens")
        self.trainer, self.eval_dataset = trainer, eval_dataset
        self.evaluate = evaluate or (lambda model, tokenizer: toy.evaluate(model, eval_dataset, tokenizer))
        self.every_steps, self.every_tokens = every_steps, every_tokens
        self.curve: list[dict] = []
        self.eval_seconds = 0.0
        self.eval_cpu_seconds = 0.0
        self._next_tokens = every_tokens
        self._start = None

    def _tokens(self) -> int:
        return int(self.trainer._tokens_generated_total)

    def _evaluate(self, state) -> None:
        start, cpu = time.perf_counter(), time.process_time()
        accuracy = self.evaluate(self.trainer.model, self.trainer.processing_class)
        self.eval_seconds += time.perf_counter() - start
        self.eval_cpu_seconds += time.process_time() - cpu
        seconds = time.perf_counter() - self._start - self.eval_seconds
        self.curve.append(dict(tokens=self._tokens(), step=state.global_step, seconds=round(seconds, 3),
                               accuracy=accuracy))

    def on_train_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()
        self._evaluate(state)

    def on_step_end(self, args, state, control, **kwargs):
        if self.every_steps is not None:
            if state.global_step % self.every_steps == 0:
                self._evaluate(state)
        elif self._tokens() >= self._next_tokens:
            self._evaluate(state)
            while self._next_tokens <= self._tokens():
                self._next_tokens += self.every_tokens

    def on_train_end(self, args, state, control, **kwargs):
        if self.curve[-1]["step"] != state.global_step:
            self._evaluate(state)


def time_rollouts(trainer) -> dict:
    """Time the trainer's outermost training rollout call (generation, scoring, behaviour log-probs, memory
    release); returns the dict it fills: ``seconds``, ``sequences`` (over all processes) and ``calls``."""
    rollout = {"seconds": 0.0, "sequences": 0, "calls": 0}
    inner = trainer._generate_and_score_completions

    def timed_rollout(inputs):
        start = time.perf_counter()
        out = inner(inputs)
        if trainer.model.training:
            rollout["seconds"] += time.perf_counter() - start
            rollout["sequences"] += len(inputs) * trainer.accelerator.num_processes
            rollout["calls"] += 1
        return out

    trainer._generate_and_score_completions = timed_rollout
    return rollout


def mu_arm_fields(arm: str, adaptive_target: float | None = None) -> dict:
    """``MuGRPOConfig`` fields of a stage arm of the µ-GRPO benchmarks (the stage sizing comes separately).

    ``naive_large_mu``: standard clipping [0.8, 1.2], no veto; ``relaxed_no_veto``: [0, 5], no veto;
    ``mu_grpo``: [0, 5] + H_kappa veto (the paper); ``veto_<scope>``: [0, 5] + that veto scope;
    ``adaptive_mu_grpo``: the adaptive trust region (``adaptive_target``) + H_kappa veto. ``veto_H_kappa`` and
    ``adaptive_H_kappa`` are the ablation's names for the last two.
    """
    relaxed = dict(relaxed_clip=True, mu_clip_lower=0.0, mu_clip_upper=5.0)
    if arm == "naive_large_mu":
        return dict(relaxed_clip=False, epsilon=0.2, veto_scope=None)
    if arm == "relaxed_no_veto":
        return dict(relaxed, veto_scope=None)
    if arm in ("mu_grpo", "veto_H_kappa"):
        return dict(relaxed, veto_scope="H_kappa")
    if arm.startswith("veto_"):
        return dict(relaxed, veto_scope=arm[len("veto_"):])
    if arm in ("adaptive_mu_grpo", "adaptive_H_kappa"):
        return dict(relaxed, veto_scope="H_kappa", adaptive_clip_target=adaptive_target)
    raise ValueError(f"unknown µ-GRPO benchmark arm {arm!r}")


def timed_train(trainer, evaluator: HeldOutEval | None = None) -> dict:
    """Run ``trainer.train()`` and return its training ``wall`` / ``cpu`` seconds (evaluation by ``evaluator``
    excluded), the ``rollout`` timings of :func:`time_rollouts` and the ``phase`` seconds: generation, reward
    and log-prob passes (the trainer's ``time/*_s`` metrics), the rest of the rollout, and update + other."""
    rollout = time_rollouts(trainer)
    start, cpu = time.perf_counter(), time.process_time()
    trainer.train()
    wall, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    if evaluator is not None:
        wall, cpu_seconds = wall - evaluator.eval_seconds, cpu_seconds - evaluator.eval_cpu_seconds
    history = trainer.state.log_history
    phase = {name: sum(r[f"time/{name}_s"] for r in history if f"time/{name}_s" in r)
             for name in ("generation", "reward", "logprobs")}
    phase["rollout_other"] = max(rollout["seconds"] - sum(phase.values()), 0.0)
    phase["update_other"] = max(wall - rollout["seconds"], 0.0)
    return dict(wall=wall, cpu=cpu_seconds, rollout=rollout, phase=phase)
