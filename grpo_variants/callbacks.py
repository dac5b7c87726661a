"""Trainer callbacks: metrics to JSONL, held-out evaluation on the toy task, and curve plots."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from transformers import TrainerCallback


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsJSONLCallback(TrainerCallback):
    """Append every log record (plus wall-seconds since training started) to ``path`` as JSON lines.

    Only the main process writes. On resume, records continue in the same file: the global step
    keeps increasing, so a curve read back is continuous.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._start = None
        self._offset = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()
        if state.is_world_process_zero and self.path.exists():
            # resume: continue the wall clock where the previous run's last record stopped
            for line in self.path.read_text().splitlines():
                try:
                    self._offset = max(self._offset, float(json.loads(line).get("wall_seconds", 0.0)))
                except (ValueError, AttributeError):
                    continue

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or logs is None:
            return
        if self._start is None:
            self._start = time.perf_counter()
        record = {"step": state.global_step, "wall_seconds": round(self._offset + time.perf_counter() - self._start, 3)}
        record.update({k: _clean(v) for k, v in logs.items()})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


class ToyEvalCallback(TrainerCallback):
    """Evaluate held-out greedy accuracy on a toy dataset every ``every`` optimizer steps.

    The value is added to the trainer's log as ``eval_toy_accuracy`` (so it reaches
    ``metrics.jsonl`` and the lab's tables). Evaluation does not touch the training RNG streams.
    """

    def __init__(self, eval_dataset, tokenizer, every: int = 10, batch_size: int = 256):
        self.eval_dataset = eval_dataset
        self.tokenizer = tokenizer
        self.every = every
        self.batch_size = batch_size
        self.history: list[tuple[int, float]] = []

    def _run(self, model, state):
        from grpo_variants.toy import evaluate

        accuracy = evaluate(model, self.eval_dataset, self.tokenizer, batch_size=self.batch_size)
        self.history.append((state.global_step, accuracy))
        return accuracy

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.every and state.global_step % self.every == 0:
            control.should_log = True
            state._toy_accuracy = self._run(model, state)
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        value = getattr(state, "_toy_accuracy", None)
        if logs is not None and value is not None:
            logs["eval_toy_accuracy"] = value
            state._toy_accuracy = None


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a ``metrics.jsonl`` file written by :class:`MetricsJSONLCallback`."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_reward_curve(records: list[dict], path: str | os.PathLike, title: str = "Reward during training") -> Path:
    """Plot mean reward (and held-out accuracy if logged) against optimizer step to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records if r.get("reward") is not None]
    rewards = [r["reward"] for r in records if r.get("reward") is not None]
    acc = [(r["step"], r["eval_toy_accuracy"]) for r in records if r.get("eval_toy_accuracy") is not None]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, label="mean reward (train rollouts)", color="tab:blue", alpha=0.8)
    if acc:
        ax.plot([s for s, _ in acc], [a for _, a in acc], "o-", label="held-out greedy accuracy", color="tab:red")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
