"""What a run prints: a progress bar with a handful of live metrics, a summary table, no known noise.

* :class:`LiveProgressCallback` replaces transformers' ``ProgressCallback``: the bar shows reward,
  accuracy (held-out when evaluated, else the training accuracy of an accuracy reward), KL (when
  ``beta`` > 0) or the clipped fraction, and generated tokens/s, instead of writing every log
  record as a dict. :class:`CompactPrinterCallback` replaces ``PrinterCallback`` (``disable_tqdm``)
  with one short line per log. ``verbose=True`` in the config restores transformers' callbacks
  (the per-step dicts). Every metric still goes to ``metrics.jsonl`` and to ``report_to``.
* :func:`summary_table` formats the end-of-run table (first -> last values, time, outputs).
* Known-harmless third-party messages are filtered by :mod:`grpo_variants.runtime.noise`.
"""

from __future__ import annotations

import math

__all__ = [
    "LiveProgressCallback",
    "CompactPrinterCallback",
    "live_metrics",
    "summary_rows",
    "summary_table",
    "optimizer_steps",
    "run_title",
    "install_console_callbacks",
]


# ------------------------------------------------------------------------------------------------
# Live metrics
# ------------------------------------------------------------------------------------------------
def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _accuracy_keys(keys) -> list[str]:
    """Training accuracy metrics: ``rewards/<accuracy reward>/right_fraction``, the fraction of completions the
    accuracy reward called right (not the reward's mean, which for a +1 / -1 reward is no accuracy)."""
    return sorted(k for k in keys if k.startswith("rewards/") and k.endswith("/right_fraction") and "acc" in k)


def _accuracy_key(logs: dict) -> str | None:
    keys = _accuracy_keys(logs)
    return keys[0] if keys else None


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}"


def live_metrics(logs: dict, beta: float = 0.0) -> dict[str, str]:
    """The handful of values the progress bar shows for one log record (only those present)."""
    out: dict[str, str] = {}
    if _finite(logs.get("reward")):
        out["reward"] = _fmt(logs["reward"])
    if _finite(logs.get("eval_toy_accuracy")):
        out["held-out acc"] = f"{logs['eval_toy_accuracy']:.1%}"
    key = _accuracy_key(logs)
    if key is not None and _finite(logs[key]):
        out["train acc"] = f"{logs[key]:.1%}"
    if beta and _finite(logs.get("kl")):
        out["kl"] = _fmt(logs["kl"])
    elif _finite(logs.get("clip_ratio/region_mean")):
        out["clip"] = _fmt(logs["clip_ratio/region_mean"])
    if _finite(logs.get("throughput/generated_tokens_per_s")):
        out["tok/s"] = f"{logs['throughput/generated_tokens_per_s']:.0f}"
    return out


def _join(metrics: dict[str, str]) -> str:
    return "  ".join(f"{k} {v}" for k, v in metrics.items())


def _progress_base():
    from transformers.trainer_callback import ProgressCallback

    return ProgressCallback


def _printer_base():
    from transformers.trainer_callback import PrinterCallback

    return PrinterCallback


class LiveProgressCallback(_progress_base()):
    """transformers' progress bar, with live metrics in its postfix instead of a dict per step.

    The last values seen are kept (a log record without a reward, e.g. an evaluation, updates
    only what it carries).
    """

    def __init__(self, beta: float = 0.0):
        super().__init__()
        self.beta = beta
        self.shown: dict[str, str] = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or self.training_bar is None or not logs:
            return
        self.shown.update(live_metrics(logs, self.beta))
        if self.shown:
            self.training_bar.set_postfix_str(_join(self.shown), refresh=True)


class CompactPrinterCallback(_printer_base()):
    """With ``disable_tqdm``: one short line per training log record instead of the full dict."""

    def __init__(self, beta: float = 0.0):
        super().__init__()
        self.beta = beta

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_local_process_zero or not logs:
            return
        metrics = live_metrics(logs, self.beta)
        if metrics:
            total = f"/{state.max_steps}" if state.max_steps and state.max_steps > 0 else ""
            print(f"step {state.global_step}{total}  {_join(metrics)}", flush=True)


def install_console_callbacks(trainer) -> None:
    """Swap transformers' per-step dict printers for the compact ones (unless ``args.verbose``)."""
    if getattr(trainer.args, "verbose", False):
        return
    beta = float(getattr(trainer.args, "beta", 0.0) or 0.0)
    callbacks = trainer.callback_handler.callbacks
    for cb in list(callbacks):
        if type(cb) is _progress_base():
            trainer.remove_callback(cb)
            trainer.add_callback(LiveProgressCallback(beta))
        elif type(cb) is _printer_base():
            trainer.remove_callback(cb)
            trainer.add_callback(CompactPrinterCallback(beta))


# ------------------------------------------------------------------------------------------------
# The summary table
# ------------------------------------------------------------------------------------------------
def _first_last(records: list[dict], key: str):
    values = [r[key] for r in records if _finite(r.get(key))]
    return (values[0], values[-1]) if values else None


def summary_rows(records: list[dict]) -> list[tuple[str, str, str]]:
    """(label, first, last) for reward, training accuracy and held-out accuracy, from log records."""
    rows = []
    pair = _first_last(records, "reward")
    if pair:
        rows.append(("reward (train rollouts)", _fmt(pair[0]), _fmt(pair[1])))
    keys = _accuracy_keys({k for r in records for k in r})
    for key in keys[:2]:
        pair = _first_last(records, key)
        if pair:
            rows.append((f"train accuracy ({key.split('/')[1]})", f"{pair[0]:.1%}", f"{pair[1]:.1%}"))
    pair = _first_last(records, "eval_toy_accuracy")
    if pair:
        rows.append(("held-out accuracy", f"{pair[0]:.1%}", f"{pair[1]:.1%}"))
    return rows


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def optimizer_steps(n: int) -> str:
    """``"1 optimizer step"``, ``"3 optimizer steps"``."""
    return f"{n} optimizer step" + ("" if n == 1 else "s")


def run_title(name: str, global_step: int, start_step: int = 0) -> str:
    """The summary's title: the run's name and its optimizer steps; a resumed run counts its own steps and
    says where it resumed (its table's "first" column is then this run's first value, not the original's)."""
    if start_step > 0:
        return (f"{name}: {optimizer_steps(global_step - start_step)} in this run (resumed at step {start_step}, "
                f"now at step {global_step})")
    return f"{name}: {optimizer_steps(global_step)}"


RESUMED_HEAD = ("first (this run)", "last")


def summary_table(title: str, rows: list[tuple[str, str, str]], seconds: float | None, outputs: str | None,
                  head: tuple[str, str] = ("first", "last")) -> str:
    """A few lines: a title, (label, first, last) rows, the time and where the outputs are."""
    width = max([len(r[0]) for r in rows] + [8])
    col = max(9, len(head[0]), len(head[1]))
    lines = [title]
    if rows:
        lines.append(f"  {'':<{width}}  {head[0]:>{col}}  {head[1]:>9}")
        lines += [f"  {label:<{width}}  {a:>{col}}  {b:>9}" for label, a, b in rows]
    if seconds is not None:
        lines.append(f"  {'time':<{width}}  {_duration(seconds)}")
    if outputs:
        lines.append(f"  {'outputs':<{width}}  {outputs}")
    return "\n".join(lines)
