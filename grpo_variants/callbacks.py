"""Trainer callbacks: metrics to JSONL, the record every run leaves (:class:`RunRecordCallback`), held-out
evaluation on the toy task, curve plots, a generation budget (:class:`GenerationBudgetCallback`) and model
FLOPs utilisation (:class:`MFUCallback`, CUDA only)."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from transformers import TrainerCallback

from grpo_variants.registry import run_label


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsJSONLCallback(TrainerCallback):
    """Append every log record (plus wall-seconds since training started) to ``path`` as JSON lines.

    Only the main process writes. On resume, records continue in the same file: the global step
    keeps increasing, so a curve read back is continuous.
    """

    def __init__(self, path: str | os.PathLike, fresh_on_new_run: bool = False):
        self.path = Path(path)
        self.fresh_on_new_run = fresh_on_new_run
        self._start = None
        self._offset = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()
        if self.fresh_on_new_run and state.is_world_process_zero and state.global_step == 0 and self.path.exists():
            self.path.unlink()  # a new run (not a resume) in a used folder: start a new record
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
    ``metrics.jsonl`` and the lab's tables), with the seconds the evaluation took as
    ``eval_toy_seconds`` (the lab subtracts them from wall time). With ``eval_at_end=True`` it
    also evaluates at the step where training stops (max_steps, a budget), if that step is not a
    multiple of ``every``; place it after callbacks that stop training. Evaluation does not touch
    the training RNG streams.
    """

    def __init__(self, eval_dataset, tokenizer, every: int = 10, batch_size: int = 256, eval_at_end: bool = False):
        self.eval_dataset = eval_dataset
        self.tokenizer = tokenizer
        self.every = every
        self.batch_size = batch_size
        self.eval_at_end = eval_at_end
        self.history: list[tuple[int, float]] = []
        self.seconds = 0.0

    def _evaluate(self, model) -> float:
        from grpo_variants.tasks.toy import evaluate

        return evaluate(model, self.eval_dataset, self.tokenizer, batch_size=self.batch_size)

    def _run(self, model, state):
        start = time.perf_counter()
        accuracy = self._evaluate(model)
        self._last_seconds = time.perf_counter() - start
        self.seconds += self._last_seconds
        self.history.append((state.global_step, accuracy))
        return accuracy

    def on_step_end(self, args, state, control, model=None, **kwargs):
        due = bool(self.every) and state.global_step % self.every == 0
        at_end = self.eval_at_end and control.should_training_stop
        if (due or at_end) and not (self.history and self.history[-1][0] == state.global_step):
            control.should_log = True
            state._toy_accuracy = self._run(model, state)
            state._toy_seconds = self._last_seconds
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        value = getattr(state, "_toy_accuracy", None)
        if logs is not None and value is not None:
            logs["eval_toy_accuracy"] = value
            logs["eval_toy_seconds"] = round(getattr(state, "_toy_seconds", 0.0), 4)
            state._toy_accuracy = None


class RunRecordCallback(TrainerCallback):
    """The record every run leaves in ``output_dir`` (installed by ``GRPOVariantTrainer``).

    During training every log record is appended to ``metrics.jsonl`` (whatever ``report_to``
    says; a new run in a used folder starts a new file, a resumed one continues it). When
    training ends, the main process writes ``trainer_state.json`` (the full log history),
    ``reward_curve.png`` (mean reward, and accuracy where one is logged) and ``README.md``, the
    model card naming the variant, its paper and the non-default hyper-parameters
    (``trainer.create_model_card``). ``paths()`` lists them.
    """

    FILES = ("metrics.jsonl", "trainer_state.json", "reward_curve.png", "README.md")
    heldout: dict | None = None  # held-out accuracy before / after training, see record_heldout

    def __init__(self, trainer, print_summary: bool = True):
        self.trainer = trainer
        self.output_dir = Path(trainer.args.output_dir)
        self.metrics = MetricsJSONLCallback(self.output_dir / "metrics.jsonl", fresh_on_new_run=True)
        self.written: list[Path] = []
        self.print_summary = print_summary  # the CLI and the demo print their own table (with held-out rows)
        self.seconds = 0.0
        self._begin = None

    def paths(self) -> dict[str, Path]:
        return {name: self.output_dir / name for name in self.FILES}

    def records(self) -> list[dict]:
        path = self.paths()["metrics.jsonl"]
        return read_jsonl(path) if path.exists() else []

    def _console_on(self) -> bool:
        """Whether the run prints progress at all (callers that removed the progress / printer callback,
        like the lab and the notebooks, asked for a quiet run: no summary table either)."""
        from transformers.trainer_callback import PrinterCallback, ProgressCallback

        return any(isinstance(cb, (PrinterCallback, ProgressCallback)) or "ProgressCallback" in type(cb).__name__
                   for cb in self.trainer.callback_handler.callbacks)

    start_step = 0  # the global step this train() call started at (> 0 on a resume)

    def this_run_records(self) -> list[dict]:
        """The records of this ``train()`` call: a resumed run's file also holds the original run's."""
        return [r for r in self.records() if r.get("step", 0) > self.start_step]

    def on_train_begin(self, args, state, control, **kwargs):
        self._begin = time.perf_counter()
        self.start_step = state.global_step  # TRL's state is restored before on_train_begin on a resume
        self.metrics.on_train_begin(args, state, control, **kwargs)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.metrics.on_log(args, state, control, logs=logs, **kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        paths = self.paths()
        state.save_to_json(str(paths["trainer_state.json"]))
        self.written = [paths["metrics.jsonl"], paths["trainer_state.json"]]
        self.final_step = state.global_step
        if self.plot():
            self.written.append(paths["reward_curve.png"])
        model_name = Path(args.output_dir).name if args.hub_model_id is None else args.hub_model_id.split("/")[-1]
        self.trainer.create_model_card(model_name=model_name)
        self.written.append(paths["README.md"])
        self.seconds = time.perf_counter() - self._begin if self._begin is not None else 0.0
        if self.print_summary and self._console_on():
            from grpo_variants.console import RESUMED_HEAD, run_title, summary_rows, summary_table

            from grpo_variants.card import weights_folder

            name = run_label(getattr(self.trainer, "variant_name", None))
            outputs = f"{self.output_dir}/ ({', '.join(p.name for p in self.written)})"
            if weights_folder(self.trainer)[0] is None:  # say so where the run ends, as the card does
                outputs += f"; the model is not saved: trainer.save_model({str(self.output_dir)!r})"
            print(summary_table(run_title(name, state.global_step, self.start_step),
                                summary_rows(self.this_run_records()), self.seconds, outputs,
                                head=RESUMED_HEAD if self.start_step else ("first", "last")),
                  flush=True)


    def plot(self) -> bool:
        """(Re)write ``reward_curve.png`` from ``metrics.jsonl`` (and the held-out points, if recorded)."""
        import logging

        paths = self.paths()
        try:
            records = read_jsonl(paths["metrics.jsonl"]) if paths["metrics.jsonl"].exists() else []
            name = run_label(getattr(self.trainer, "variant_name", None))
            plot_reward_curve(records, paths["reward_curve.png"], title=f"{name}: reward during training",
                              heldout=self.heldout)
            return True
        except Exception as exc:  # noqa: BLE001 - a missing plot must not lose a finished run
            logging.getLogger(__name__).warning("reward_curve.png not written: %s", exc)
            return False

    def record_heldout(self, before: float, after: float, label: str = "held-out accuracy") -> None:
        """Add the held-out accuracy measured before and after ``train()`` to ``reward_curve.png`` (as the
        points at step 0 and at the last step) and redraw it; main process only."""
        self.heldout = {"before": before, "after": after, "label": label,
                        "after_step": getattr(self, "final_step", None) or self.trainer.state.global_step}
        if self.trainer.is_world_process_zero():
            self.plot()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a ``metrics.jsonl`` file written by :class:`MetricsJSONLCallback`."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _accuracy_keys(records: list[dict]) -> list[str]:
    """Logged training accuracies: ``rewards/<name>/right_fraction`` of the accuracy rewards (fraction right)."""
    from grpo_variants.console import _accuracy_keys as keys_of

    return keys_of({k for r in records for k in r})


def plot_reward_curve(records: list[dict], path: str | os.PathLike, title: str = "Reward during training",
                      heldout: dict | None = None) -> Path:
    """Plot to a PNG, against optimizer step: mean training reward, training accuracy (per-reward means of
    accuracy rewards), the eval reward TRL logs on ``eval_dataset`` (``eval_reward``), held-out accuracy
    logged during training (``eval_toy_accuracy``) and, with ``heldout={"before": b, "after": a,
    "after_step": n, "label": ...}``, the held-out accuracy before training (step 0) and after it (step n).

    Every series has markers, so a run with one logged point still shows it; the layout keeps every label
    and the legend inside the image."""
    fig = reward_curve_figure(records, title, heldout)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def reward_curve_figure(records: list[dict], title: str = "Reward during training", heldout: dict | None = None):
    """The figure :func:`plot_reward_curve` saves (a bare matplotlib ``Figure``)."""
    # A bare Figure with its own Agg canvas: nothing global changes, so a notebook's inline backend
    # (and any pyplot state of the user's) is left as it was.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps = [r["step"] for r in records if r.get("reward") is not None]
    rewards = [r["reward"] for r in records if r.get("reward") is not None]
    acc = [(r["step"], r["eval_toy_accuracy"]) for r in records if r.get("eval_toy_accuracy") is not None]
    eval_reward = [(r["step"], r["eval_reward"]) for r in records if r.get("eval_reward") is not None]
    fig = Figure(figsize=(7, 4), layout="constrained")  # labels, title and legend never clipped
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    lines = []
    same_as_reward = None
    for key in _accuracy_keys(records):
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if not points or min(v for _, v in points) < 0.0:  # a ±1 reward's mean is not a fraction right
            continue
        if [a for _, a in points] == rewards:  # the only reward: the reward line is its training accuracy
            same_as_reward = key.split("/")[1]
        else:
            lines.append((points, f"training accuracy ({key.split('/')[1]})"))
    label = ("mean reward = training accuracy" + f" ({same_as_reward})" if same_as_reward
             else "mean reward (train rollouts)")
    marker = dict(marker="o", markersize=4)
    ax.plot(steps, rewards, label=label, color="tab:blue", alpha=0.8, **marker)
    for points, acc_label in lines:
        ax.plot([s for s, _ in points], [a for _, a in points], "--", label=acc_label, alpha=0.7, **marker)
    if eval_reward:
        ax.plot([s for s, _ in eval_reward], [v for _, v in eval_reward], "s-", label="eval reward (eval_dataset)",
                color="tab:green", markersize=5)
    if acc:
        ax.plot([s for s, _ in acc], [a for _, a in acc], "o-", label="held-out greedy accuracy", color="tab:red",
                markersize=5)
    held = []
    if heldout is not None and heldout.get("before") is not None and heldout.get("after") is not None:
        held = [heldout["before"], heldout["after"]]
        after_step = heldout.get("after_step", max(steps + [s for s, _ in acc] + [1]))
        ax.plot([0, after_step], held, ":", color="tab:purple", alpha=0.6)
        ax.plot([0], [held[0]], "D", color="tab:purple", markersize=8,
                label=f"{heldout.get('label', 'held-out accuracy')}: before {held[0]:.1%}")
        ax.plot([after_step], [held[1]], "*", color="tab:purple", markersize=13,
                label=f"{heldout.get('label', 'held-out accuracy')}: after {held[1]:.1%}")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # optimizer steps are whole numbers
    xs = [x for line in ax.lines for x in line.get_xdata()]
    if xs and max(xs) - min(xs) < 2:  # one or two steps: whole-step ticks around them
        ax.set_xlim(min(xs) - 1, max(xs) + 1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward / accuracy")
    values = rewards + [a for _, a in acc] + [v for _, v in eval_reward] + held
    if not values or (min(values) >= 0.0 and max(values) <= 1.0):
        ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", framealpha=0.85, fontsize="small")
    ax.set_title(title)
    return fig


# ------------------------------------------------------------------------------------------------
# Generation budget: stop training once a number of generated tokens / completions is spent
# ------------------------------------------------------------------------------------------------
def rollout_due(trainer) -> bool:
    """Whether the trainer's next micro-step starts a new rollout.

    TRL generates when ``_step % (steps_per_generation * num_iterations) == 0`` (or nothing is
    buffered); every built-in variant keeps that rule (µ-GRPO derives both numbers from its
    stage size). A trainer with its own schedule can define ``rollout_due()``.
    """
    own = getattr(type(trainer), "rollout_due", None)
    if callable(own):
        return bool(own(trainer))
    if getattr(trainer, "_buffered_inputs", None) is None:
        return True
    generate_every = trainer.args.steps_per_generation * trainer.num_iterations
    return trainer._step % generate_every == 0


class GenerationBudgetCallback(TrainerCallback):
    """Stop a ``GRPOVariantTrainer`` once a generation budget is spent.

    The budget counts *everything the rollouts generated* (the base trainer's counters
    ``_tokens_generated_total`` and ``_completions_generated_total``): groups that DAPO's
    dynamic sampling discarded, iGRPO's drafts and truncated completions all count.

    ``stop="rollout"`` (default) lets the trainer finish training on the data it has already
    generated and stops before the next rollout would start, so a variant that reuses a rollout
    for many updates (µ-GRPO's stages, ``num_iterations`` > 1) gets every update it paid for.
    ``stop="step"`` stops at the first optimizer step after the budget is spent. Either way the
    last rollout may overshoot the budget; the exact amount spent is logged as
    ``budget/generated_tokens`` and ``budget/completions`` (cumulative) at every log.

        trainer.add_callback(GenerationBudgetCallback(trainer, budget_tokens=200_000))
    """

    def __init__(self, trainer, budget_tokens: int | None = None, budget_completions: int | None = None,
                 stop: str = "rollout"):
        from grpo_variants.errors import ConfigError

        if budget_tokens is None and budget_completions is None:
            raise ConfigError("GenerationBudgetCallback needs budget_tokens or budget_completions (or both).")
        for name, value in (("budget_tokens", budget_tokens), ("budget_completions", budget_completions)):
            if value is not None and value <= 0:
                raise ConfigError(f"{name}={value} must be a positive number of generated {name.split('_')[1]}.")
        if stop not in ("rollout", "step"):
            raise ConfigError(f"stop={stop!r} is not valid; choose 'rollout' or 'step'.")
        if not hasattr(trainer, "_tokens_generated_total"):
            raise ConfigError(
                f"GenerationBudgetCallback needs a GRPOVariantTrainer (it reads its generated-token counters); "
                f"got {type(trainer).__name__}."
            )
        self.trainer = trainer
        self.budget_tokens = budget_tokens
        self.budget_completions = budget_completions
        self.stop = stop
        self.stopped_at_step: int | None = None

    def spent(self) -> dict:
        t = self.trainer
        return {
            "generated_tokens": int(t._tokens_generated_total + t._tokens_generated_round),
            "completions": int(getattr(t, "_completions_generated_total", 0)),
        }

    def exhausted(self) -> bool:
        spent = self.spent()
        return (self.budget_tokens is not None and spent["generated_tokens"] >= self.budget_tokens) or (
            self.budget_completions is not None and spent["completions"] >= self.budget_completions
        )

    def on_step_end(self, args, state, control, **kwargs):
        if self.exhausted() and (self.stop == "step" or rollout_due(self.trainer)):
            control.should_training_stop = True
            if self.stopped_at_step is None:
                self.stopped_at_step = state.global_step
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        spent = self.spent()
        logs["budget/generated_tokens"] = spent["generated_tokens"]
        logs["budget/completions"] = spent["completions"]
        fractions = []
        if self.budget_tokens:
            fractions.append(spent["generated_tokens"] / self.budget_tokens)
        if self.budget_completions:
            fractions.append(spent["completions"] / self.budget_completions)
        logs["budget/spent_fraction"] = max(fractions)


# ------------------------------------------------------------------------------------------------
# Model FLOPs utilisation (GPU only)
# ------------------------------------------------------------------------------------------------
# Peak dense (no sparsity) bf16 tensor-core FLOP/s per device, from the vendors' datasheets. First
# regex that matches ``torch.cuda.get_device_name()`` wins (so "H200" is tried before "H20").
# Override with the environment variable GRPO_VARIANTS_PEAK_FLOPS (FLOP/s per device, e.g. 989e12)
# or MFUCallback(peak_flops=...).
PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    (r"GB200", 2.5e15),
    (r"B200", 2.25e15),
    (r"B100", 1.75e15),
    (r"GH200", 989e12),
    (r"H200", 989e12),
    (r"H100.*PCIe", 756e12),
    (r"H100.*NVL", 835e12),
    (r"H100", 989e12),  # SXM ("NVIDIA H100 80GB HBM3")
    (r"H800", 989e12),
    (r"\bH20\b", 148e12),
    (r"A100", 312e12),
    (r"A800", 312e12),
    (r"L40S", 362e12),
    (r"\bL40\b", 181e12),
    (r"\bL4\b", 121e12),
    (r"\bA10\b", 125e12),
    (r"RTX A6000", 154.8e12),
    (r"RTX 6000 Ada", 364e12),
    (r"RTX 4090", 165e12),  # fp32 accumulate
    (r"MI300X", 1307e12),
    (r"MI250X", 383e12),
]


def peak_bf16_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of one device named ``device_name`` (None when unknown)."""
    import re

    override = os.environ.get("GRPO_VARIANTS_PEAK_FLOPS")
    if override:
        return float(override)
    for pattern, flops in PEAK_BF16_FLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return flops
    return None


def count_parameters(model) -> int:
    """Every parameter of ``model`` (DeepSpeed ZeRO-3 partitions counted at full size)."""
    return int(sum(getattr(p, "ds_numel", 0) or p.numel() for p in model.parameters()))


def step_flops(n_params: int, trained_tokens: float, generated_tokens: float) -> float:
    """Model FLOPs of one optimizer step: 6 N per trained token (forward + backward) + 2 N per generated token."""
    return 6.0 * n_params * trained_tokens + 2.0 * n_params * generated_tokens


class MFUCallback(TrainerCallback):
    """Log model FLOPs utilisation as ``throughput/mfu`` (and ``throughput/model_tflops_per_s``), CUDA only.

    Over each optimizer step (``on_step_begin`` -> ``on_step_end``, generation included)::

        FLOPs = 6 * N * trained_tokens + 2 * N * generated_tokens        (per device)
        MFU   = FLOPs / (step_seconds * peak_bf16_flops(device))

    N counts every parameter. ``trained_tokens`` are the non-padding tokens (prompt + completion)
    of every forward pass run with gradients (counted by a forward pre-hook on the policy);
    ``generated_tokens`` is the base trainer's count of every token the rollouts generated, divided
    by the number of processes (generation with vLLM in server mode runs on other GPUs and is not
    counted). Forward passes without gradients (old / reference log-probs), prompt prefill during
    generation and attention FLOPs are left out, so the value is a conservative estimate (the
    usual 6N / 2N convention). The peak comes from :data:`PEAK_BF16_FLOPS` (dense bf16); on an
    unknown device nothing is logged unless ``peak_flops`` or ``$GRPO_VARIANTS_PEAK_FLOPS`` is set.
    Without CUDA the callback does nothing. The base trainer installs it on CUDA machines.
    """

    def __init__(self, trainer, peak_flops: float | None = None):
        import torch

        self.trainer = trainer
        self.enabled = torch.cuda.is_available()
        self.peak_flops = peak_flops
        self.n_params = None
        self._hook = None
        self._trained_tokens = 0.0
        self._start = None
        self._generated_before = 0

    def _setup(self):
        import logging

        import torch

        if self.peak_flops is None:
            name = torch.cuda.get_device_name(self.trainer.accelerator.device) if torch.cuda.is_available() else "cpu"
            self.peak_flops = peak_bf16_flops(name)
            if self.peak_flops is None:
                logging.getLogger(__name__).warning(
                    "MFU not logged: unknown peak FLOP/s for device %r. Set GRPO_VARIANTS_PEAK_FLOPS "
                    "(dense bf16 FLOP/s per device) to enable it.", name)
                self.enabled = False
                return
        self.n_params = count_parameters(self.trainer.model)
        if self._hook is None:
            self._hook = self.trainer.model.register_forward_pre_hook(self._count_tokens, with_kwargs=True)

    def _count_tokens(self, module, args, kwargs):
        import torch

        if not (module.training and torch.is_grad_enabled()):
            return None
        mask = kwargs.get("attention_mask")
        ids = kwargs.get("input_ids", args[0] if args else None)
        packed = getattr(self.trainer, "_packed_real_tokens", None)  # padding-free: the packed rows' real tokens
        if packed is not None:
            self._trained_tokens = self._trained_tokens + packed
        elif mask is not None:
            self._trained_tokens = self._trained_tokens + mask.sum()  # a tensor: no device sync per forward
        elif ids is not None:
            self._trained_tokens = self._trained_tokens + ids.numel()
        return None

    def _generated(self) -> int:
        t = self.trainer
        return int(getattr(t, "_tokens_generated_total", 0) + getattr(t, "_tokens_generated_round", 0))

    def on_train_begin(self, args, state, control, **kwargs):
        if self.enabled:
            self._setup()

    def on_step_begin(self, args, state, control, **kwargs):
        if not self.enabled:
            return
        self._start = time.perf_counter()
        self._trained_tokens = 0.0
        self._generated_before = self._generated()

    def on_step_end(self, args, state, control, **kwargs):
        if not self.enabled or self._start is None:
            return
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - self._start
        t = self.trainer
        generated = (self._generated() - self._generated_before) / max(t.accelerator.num_processes, 1)
        if getattr(t, "use_vllm", False) and getattr(t.args, "vllm_mode", "") == "server":
            generated = 0.0
        flops = step_flops(self.n_params, float(self._trained_tokens), generated)
        if seconds > 0:
            t._metrics["train"]["throughput/mfu"].append(flops / (seconds * self.peak_flops))
            t._metrics["train"]["throughput/model_tflops_per_s"].append(flops / seconds / 1e12)
        self._start = None

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
