"""Reliability for :class:`~grpo_variants.GRPOVariantTrainer`: exact resume, atomic checkpoints, preemption, NaN guard.

What a stock ``trl.GRPOTrainer`` 1.16 + ``transformers`` 5.24 run loses on resume, and what this
module restores (TRL #3247, verl #7401 / #7933: "resume breaks or silently skips data"):

* **The half-used generation batch.** TRL generates once per ``steps_per_generation x
  num_iterations`` micro-steps and serves slices of ``self._buffered_inputs`` indexed by its
  micro-step counter ``self._step``. Neither is saved: after a resume ``_step`` restarts at 0 and
  the buffer is ``None``, so TRL *regenerates* that generation batch with the resumed policy and
  serves slice 0 again -- silently different training. We save both, per process.
* **Epoch-dependent data order.** ``RepeatSampler`` draws one permutation per epoch from its own
  generator, seeded once. Transformers skips the epochs already trained without iterating the
  sampler, so a run resumed in epoch ``e >= 1`` replays epoch 0's order. We advance the
  generator by the epochs already trained before the first batch is drawn.
* **Metrics of an open logging window** (``self._metrics`` and the accumulated loss when
  ``logging_steps`` does not divide ``save_steps``) and the trainer's own counters
  (:meth:`~grpo_variants.GRPOVariantTrainer.variant_state_dict`: generated/useful token totals,
  and whatever each variant adds: DAPO's sampling state, µ-GRPO's stage bookkeeping, ...).

Transformers already restores the model, optimizer, scheduler, ``TrainerState`` (global step,
log history), the per-process RNG states (``rng_state_{rank}.pth``) and skips the consumed
batches (``skip_first_batches`` with ``steps_trained_in_current_epoch = (global_step mod
steps_per_epoch) x gradient_accumulation_steps`` dataloader batches; each batch of TRL's
dataloader is one micro-step's generation batch, so the skip is exact). Everything extra goes
into one file per process, ``grpo_variants_state_{rank}.pt``, inside the checkpoint. With it, a
resumed CPU run is bitwise identical to an uninterrupted one (``tests/test_resume.py``).

**Atomic checkpoints.** Transformers 5.24 writes ``checkpoint-N`` in place: a crash or a kill
during the save leaves a half-written folder that ``resume_from_checkpoint=True`` then picks.
:func:`save_checkpoint_atomically` writes into ``tmp-checkpoint-N/checkpoint-N`` (every process
writes its files there, DeepSpeed ZeRO-3 shards included), waits for every process, and the
saving process renames it to ``checkpoint-N`` with one ``os.replace``; rotation
(``save_total_limit``) and hub pushes then see only complete checkpoints, and stale ``tmp-*``
folders are removed at the next save. ``resume_from_checkpoint=True`` resolves to the newest
*complete* checkpoint (:func:`latest_complete_checkpoint`). The rename protects against the
process dying (crash, SIGKILL, OOM killer); it does not fsync file contents, so a power loss
right after a save can still lose data the OS had not flushed.

**Preemption** (``save_on_signal=True``, the default): for the duration of ``train()`` (main
thread only; previous handlers restored afterwards) SIGTERM and SIGINT set a flag. At the end of
the current optimizer step (all processes agree through an all-reduce) a complete checkpoint is
written and training stops; then ``train()`` raises ``SystemExit(143)`` for SIGTERM (the
conventional 128 + 15, what SLURM / Kubernetes expect) or ``KeyboardInterrupt`` for SIGINT. A
*second* signal while waiting for the step to end exits immediately, without a checkpoint.

**Variants** extend :meth:`~grpo_variants.GRPOVariantTrainer.variant_state_dict` /
``load_variant_state_dict`` (call ``super()``) with whatever else a resumed run needs. Values must
load with ``torch.load(weights_only=True)``: tensors, numbers, strings, None, and lists / tuples /
dicts of them. ``load_variant_state_dict`` receives tensors on the CPU (move them where they
belong) and runs after ``_step`` and ``_buffered_inputs`` are restored, which the base already saves.

**Non-finite loss or gradients** (``max_consecutive_nonfinite``): every micro-step's loss and,
at the optimizer step, every gradient is checked; the flag is all-reduced so that all processes
agree. A non-finite step is *skipped*: ``optimizer.step()`` is not called (AdamW's moments and
step count stay untouched), the LR scheduler does not advance (as for an fp16 overflow), the
gradients are zeroed. ``nonfinite/skipped_steps`` (cumulative) is logged. After
``max_consecutive_nonfinite`` non-finite steps in a row training stops with
:class:`~grpo_variants.errors.NonFiniteLossError`. **Under DeepSpeed** the engine steps inside
``backward()``, before the trainer's optimizer step, so the decision is DeepSpeed's: ZeRO-3 (0.19)
discards every step whose gradient norm is not finite, ZeRO-1/2 only with fp16 or
``check_grad_overflow``. The guard reads that decision (``step_was_skipped``): a discarded step is
counted in ``nonfinite/skipped_steps`` like ours, an applied one only in ``nonfinite/steps``, and the
streak limit stops training in both cases (``tests/test_zero3.py`` injects a NaN loss under ZeRO-3 and
checks that the weights and the step count do not move).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import threading
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from grpo_variants.errors import ConfigError, NonFiniteLossError

logger = logging.getLogger(__name__)

__all__ = [
    "STATE_FILE",
    "TMP_PREFIX",
    "NonFiniteGuard",
    "ReliabilityCallback",
    "SignalCheckpointer",
    "checkpoint_incomplete_reason",
    "latest_complete_checkpoint",
    "load_resume_state",
    "resolve_resume_checkpoint",
    "run_train",
    "save_checkpoint_atomically",
    "save_resume_state",
]

STATE_FILE = "grpo_variants_state_{rank}.pt"
TMP_PREFIX = "tmp-"  # staging folders: tmp-checkpoint-N (never matched by transformers' checkpoint-* globs)
TRAINER_STATE_NAME = "trainer_state.json"
STATE_FORMAT = 1
_CHECKPOINT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
)


# ------------------------------------------------------------------------------------------------
# Tensors <-> CPU
# ------------------------------------------------------------------------------------------------
def _move(obj, device):
    """Copy every tensor in a nested dict / list / tuple to ``device`` (detached); other values as they are."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(device)
    if isinstance(obj, dict):
        return {k: _move(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_move(v, device) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_move(v, device) for v in obj)
    return obj


# ------------------------------------------------------------------------------------------------
# Which checkpoints are complete
# ------------------------------------------------------------------------------------------------
def checkpoint_incomplete_reason(path: str | os.PathLike) -> str | None:
    """None if ``path`` is a complete checkpoint, else what is missing (a sentence fragment)."""
    path = Path(path)
    if not path.is_dir():
        return "it does not exist"
    state_file = path / TRAINER_STATE_NAME
    if not state_file.is_file():
        return f"it has no {TRAINER_STATE_NAME} (the save was interrupted)"
    try:
        json.loads(state_file.read_text())
    except (OSError, ValueError) as err:
        return f"its {TRAINER_STATE_NAME} does not parse ({err})"
    has_weights = any((path / name).is_file() for name in _WEIGHT_FILES)
    has_deepspeed = (path / "latest").is_file() or any(p.name.startswith("global_step") for p in path.iterdir())
    if not (has_weights or has_deepspeed):
        return "it holds no model weights"
    return None


def _numbered_checkpoints(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = []
    for entry in folder.iterdir():
        match = _CHECKPOINT_RE.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest complete ``checkpoint-N`` in ``output_dir`` (staging ``tmp-*`` folders never count)."""
    for step, path in reversed(_numbered_checkpoints(output_dir)):
        reason = checkpoint_incomplete_reason(path)
        if reason is None:
            return str(path)
        logger.warning("Skipping %s for resume: %s.", path, reason)
    return None


def resolve_resume_checkpoint(resume_from_checkpoint, output_dir) -> str | None:
    """``train(resume_from_checkpoint=...)``: True -> the newest complete checkpoint; a path -> checked."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        found = latest_complete_checkpoint(output_dir)
        if found is None:
            seen = [p.name for _, p in _numbered_checkpoints(output_dir)]
            raise ConfigError(
                f"resume_from_checkpoint=True but output_dir {str(output_dir)!r} holds no complete checkpoint"
                + (f" (incomplete: {seen})" if seen else "")
                + ". Start without resume_from_checkpoint, or pass the path of a checkpoint-N folder."
            )
        return found
    if not isinstance(resume_from_checkpoint, (str, os.PathLike)):
        raise ConfigError(
            f"resume_from_checkpoint={resume_from_checkpoint!r} must be True, None or the path of a checkpoint-N folder."
        )
    reason = checkpoint_incomplete_reason(resume_from_checkpoint)
    if reason is not None:
        newest = latest_complete_checkpoint(Path(resume_from_checkpoint).parent)
        raise ConfigError(
            f"resume_from_checkpoint={str(resume_from_checkpoint)!r} cannot be resumed from: {reason}. "
            + (f"The newest complete checkpoint next to it is {newest!r}; " if newest else "")
            + "resume_from_checkpoint=True picks the newest complete one."
        )
    return str(resume_from_checkpoint)


def remove_stale_staging(run_dir: str | os.PathLike) -> None:
    """Delete ``tmp-checkpoint-*`` folders a crashed save left behind (saving process only)."""
    folder = Path(run_dir)
    if not folder.is_dir():
        return
    for entry in folder.iterdir():
        if entry.name.startswith(TMP_PREFIX + PREFIX_CHECKPOINT_DIR) and entry.is_dir():
            logger.info("Removing %s, left by an interrupted checkpoint save.", entry)
            shutil.rmtree(entry, ignore_errors=True)


# ------------------------------------------------------------------------------------------------
# Per-process resume state
# ------------------------------------------------------------------------------------------------
def save_resume_state(trainer, checkpoint_dir: str) -> str:
    """Write this process's ``grpo_variants_state_{rank}.pt`` into ``checkpoint_dir``.

    Holds: TRL's micro-step counter ``_step`` and its buffered generation batch (on CPU), the
    metrics of the open logging window, the loss accumulated since the last log, the non-finite
    guard's counters and :meth:`variant_state_dict` (tensors moved to CPU).
    """
    args = trainer.args
    guard = getattr(trainer, "_nonfinite_guard", None)
    tr_loss = getattr(trainer, "_tr_loss", None)
    state = {
        "format": STATE_FORMAT,
        "world_size": int(args.world_size),
        "process_index": int(args.process_index),
        "global_step": int(trainer.state.global_step),
        "trl_step": int(trainer._step),
        "buffered_inputs": _move(trainer._buffered_inputs, "cpu"),
        "metrics": {mode: {k: list(v) for k, v in values.items()} for mode, values in trainer._metrics.items()},
        "tr_loss": None if tr_loss is None else tr_loss.detach().cpu().clone(),
        "globalstep_last_logged": getattr(trainer, "_globalstep_last_logged", None),
        "nonfinite": guard.state_dict() if guard is not None else {},
        "variant": _move(trainer.variant_state_dict(), "cpu"),
    }
    os.makedirs(checkpoint_dir, exist_ok=True)
    path = os.path.join(checkpoint_dir, STATE_FILE.format(rank=args.process_index))
    torch.save(state, path)
    return path


def load_resume_state(trainer, checkpoint_dir: str) -> bool:
    """Restore what :func:`save_resume_state` wrote (called from ``_load_optimizer_and_scheduler``).

    Returns False (with a warning) when the checkpoint has no state for this process: it was
    written by plain TRL or with another number of processes; the run then resumes as TRL would.
    """
    args = trainer.args
    path = os.path.join(checkpoint_dir, STATE_FILE.format(rank=args.process_index))
    trainer._resumed_from = checkpoint_dir
    if not os.path.isfile(path):
        logger.warning(
            "%s has no %s: it was not written by grpo-variants (or with save_only_model=True). The resume is not "
            "exact: a half-used generation batch is regenerated and the trainer's counters restart.",
            checkpoint_dir,
            os.path.basename(path),
        )
        return False
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - re-raised with the file named
        raise ConfigError(
            f"cannot read {path}: {err}. variant_state_dict() values must be tensors, numbers, strings, None, or "
            "lists / tuples / dicts of them (torch.load(weights_only=True))."
        ) from err
    if state.get("world_size") != args.world_size:
        logger.warning(
            "%s was written by %s processes, this run has %s: TRL's buffered generation batch and the per-process "
            "state are not restored (the resume is not exact).",
            checkpoint_dir,
            state.get("world_size"),
            args.world_size,
        )
        return False
    trainer._step = int(state["trl_step"])
    trainer._buffered_inputs = _move(state["buffered_inputs"], trainer.accelerator.device)
    for mode, values in state.get("metrics", {}).items():
        trainer._metrics[mode].clear()
        trainer._metrics[mode].update({k: list(v) for k, v in values.items()})
    guard = getattr(trainer, "_nonfinite_guard", None)
    if guard is not None:
        guard.load_state_dict(state.get("nonfinite", {}))
    trainer.load_variant_state_dict(state.get("variant", {}))
    # The training loop resets these after loading the checkpoint; ReliabilityCallback re-applies them.
    trainer._pending_loop_state = {
        "tr_loss": state.get("tr_loss"),
        "globalstep_last_logged": state.get("globalstep_last_logged"),
    }
    return True


# ------------------------------------------------------------------------------------------------
# Atomic checkpoints
# ------------------------------------------------------------------------------------------------
def save_checkpoint_atomically(trainer, save, trial=None) -> str:
    """Run transformers' ``_save_checkpoint`` (``save()``) into a staging folder, then publish it with a rename.

    All processes call this (as they call ``_save_checkpoint``). Returns the final folder.
    """
    args = trainer.args
    accelerator = trainer.accelerator
    run_dir = trainer._get_output_dir(trial=trial)
    step = trainer.state.global_step
    name = f"{PREFIX_CHECKPOINT_DIR}-{step}"
    final = os.path.join(run_dir, name)
    staging_root = os.path.join(run_dir, f"{TMP_PREFIX}{name}")
    staged = os.path.join(staging_root, name)
    publisher = args.should_save  # process 0 (or each node's local 0 with save_on_each_node)

    if publisher:
        remove_stale_staging(run_dir)
        os.makedirs(staging_root, exist_ok=True)
    accelerator.wait_for_everyone()

    pushes: list[str] = []
    trainer._get_output_dir = lambda trial=None: staging_root  # transformers builds <run_dir>/checkpoint-N
    trainer._push_from_checkpoint = pushes.append  # pushed from the final folder below
    try:
        save()
    finally:
        del trainer._get_output_dir, trainer._push_from_checkpoint  # back to the class's methods
    if not args.save_only_model:
        save_resume_state(trainer, staged)
    accelerator.wait_for_everyone()

    if publisher:
        best = trainer.state.best_model_checkpoint
        if best is not None and os.path.abspath(best).startswith(os.path.abspath(staging_root) + os.sep):
            trainer.state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(best))
            trainer.state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))
        _publish(staged, final, run_dir)
        shutil.rmtree(staging_root, ignore_errors=True)
        rotate_checkpoints(
            output_dir=run_dir,
            save_total_limit=args.save_total_limit,
            best_model_checkpoint=trainer.state.best_model_checkpoint,
            use_mtime=True,
        )
        if pushes:
            trainer._push_from_checkpoint(final)
    accelerator.wait_for_everyone()
    trainer._last_checkpoint_step = step
    return final


def _publish(staged: str, final: str, run_dir: str) -> None:
    if os.path.exists(final):  # re-saving a step (e.g. a resumed run reaching an old checkpoint's step again)
        old = os.path.join(run_dir, f"{TMP_PREFIX}replaced-{os.path.basename(final)}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(staged, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staged, final)
    try:  # make the rename itself durable
        fd = os.open(run_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # pragma: no cover - filesystems without directory fsync
        pass


# ------------------------------------------------------------------------------------------------
# Non-finite loss / gradients
# ------------------------------------------------------------------------------------------------
class NonFiniteGuard:
    """Skip optimizer steps whose loss or gradients are non-finite; stop after too many in a row."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.max_consecutive = int(trainer.args.max_consecutive_nonfinite)
        self.consecutive = 0
        self.consecutive_applied = 0  # of the current streak, updates DeepSpeed's engine applied anyway
        self.skipped_total = 0
        self.nonfinite_total = 0
        self._pending = None  # bool tensor: a micro-step loss of the current step was non-finite

    # ---- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive, "consecutive_applied": self.consecutive_applied,
                "skipped_total": self.skipped_total, "nonfinite_total": self.nonfinite_total}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive = int(state.get("consecutive", 0))
        self.consecutive_applied = int(state.get("consecutive_applied", 0))
        self.skipped_total = int(state.get("skipped_total", 0))
        self.nonfinite_total = int(state.get("nonfinite_total", 0))

    # ---- hooks ------------------------------------------------------------------------------------
    def note_loss(self, loss: torch.Tensor) -> None:
        """Called with every micro-step's loss (no host sync here)."""
        bad = ~torch.isfinite(loss.detach()).all()
        self._pending = bad if self._pending is None else self._pending | bad

    def install(self, optimizer) -> None:
        """Wrap ``optimizer.step`` (the accelerate-prepared optimizer) once."""
        if optimizer is None or getattr(optimizer, "_grpo_variants_guard", None) is self:
            return
        original = optimizer.step
        guard = self

        def step(*args, **kwargs):
            if guard.check(optimizer):
                return None
            return original(*args, **kwargs)

        # torch's LR scheduler wrapped ``step`` to check the call order; keep its marker (we call through it)
        if hasattr(original, "_wrapped_by_lr_sched"):
            step._wrapped_by_lr_sched = True
        optimizer.step = step
        optimizer._grpo_variants_guard = self

    def _grads_nonfinite(self, optimizer) -> torch.Tensor | None:
        """One fused pass: a gradient has a NaN/inf iff its norm is non-finite (``_foreach_norm``)."""
        grads = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if hasattr(g, "to_local"):  # DTensor (FSDP2): check the local shard, the all-reduce does the rest
                    g = g.to_local()
                grads.append(g)
        if not grads:
            return None
        norms = torch._foreach_norm(grads)
        return ~torch.isfinite(torch.stack(norms)).all()

    def check(self, optimizer) -> bool:
        """True if this step must be skipped (the caller then does not call the real ``step``)."""
        trainer = self.trainer
        device = trainer.accelerator.device
        deepspeed = trainer.is_deepspeed_enabled
        bad = torch.zeros((), dtype=torch.bool, device=device)
        if self._pending is not None:
            bad = bad | self._pending.to(device)
        self._pending = None
        if not deepspeed:
            grads = self._grads_nonfinite(optimizer)
            if grads is not None:
                bad = bad | grads.to(device)
        flag = bad.float()
        if trainer.accelerator.num_processes > 1:
            flag = trainer.accelerator.reduce(flag, reduction="max")  # every process takes the same decision
        nonfinite = bool(flag.item() > 0)
        metrics = trainer._metrics["train"]
        if not nonfinite:
            self.consecutive = 0
            self.consecutive_applied = 0
            if hasattr(optimizer, "_is_overflow") and getattr(optimizer, "scaler", None) is None:
                optimizer._is_overflow = False  # our previous skip set it; accelerate resets it only with a scaler
            metrics["nonfinite/skipped_steps"] = [float(self.skipped_total)]
            return False
        self.consecutive += 1
        self.nonfinite_total += 1
        step = trainer.state.global_step + 1
        if not deepspeed:
            self.skipped_total += 1
            optimizer.zero_grad(set_to_none=True)
            if hasattr(optimizer, "_is_overflow"):
                optimizer._is_overflow = True  # the trainer then skips the LR scheduler step too
            logger.warning("Non-finite loss or gradients at optimizer step %d: update skipped (%d in a row).",
                           step, self.consecutive)
        elif getattr(optimizer, "step_was_skipped", False):
            # The engine stepped inside backward(); ZeRO-3 (and fp16 / check_grad_overflow) discards a step whose
            # gradient norm is not finite, and the trainer then skips the LR scheduler step as well.
            self.skipped_total += 1
            logger.warning("Non-finite loss or gradients at optimizer step %d: DeepSpeed discarded the update "
                           "(%d in a row).", step, self.consecutive)
        else:
            self.consecutive_applied += 1
            logger.warning("Non-finite loss at optimizer step %d under DeepSpeed: the engine applied the update "
                           "(%d in a row).", step, self.consecutive)
        metrics["nonfinite/skipped_steps"] = [float(self.skipped_total)]
        metrics["nonfinite/steps"] = [float(self.nonfinite_total)]
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteLossError(
                f"the loss or the gradients were non-finite (NaN/inf) for {self.consecutive} consecutive optimizer "
                f"steps (up to step {step}; max_consecutive_nonfinite={self.max_consecutive}). "
                + ("Those updates were skipped, so the weights are those before the first of them. "
                   if self.consecutive_applied == 0
                   else f"DeepSpeed's engine applied {self.consecutive_applied} of those updates. ")
                + "Lower learning_rate, set max_grad_norm, check the reward functions for inf values and the data "
                "for empty completions, or raise max_consecutive_nonfinite to tolerate longer streaks."
            )
        return not deepspeed


# ------------------------------------------------------------------------------------------------
# Signals
# ------------------------------------------------------------------------------------------------
class SignalCheckpointer:
    """SIGTERM / SIGINT -> a flag; the trainer saves and stops at the next optimizer-step boundary."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, trainer):
        self.trainer = trainer
        self.received: int | None = None
        self._previous: dict[int, object] = {}
        self.installed = False

    def install(self) -> bool:
        if threading.current_thread() is not threading.main_thread():
            logger.warning("save_on_signal: train() runs outside the main thread; signal handlers not installed.")
            return False
        for sig in self.SIGNALS:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)
        self.installed = True
        return True

    def restore(self) -> None:
        if not self.installed:
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self.installed = False

    def _handle(self, signum, frame):
        if self.received is not None:  # a second signal: stop now, without a checkpoint
            self.restore()
            logger.warning("Second %s: exiting immediately, without a checkpoint.", signal.Signals(signum).name)
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        self.received = signum
        logger.warning(
            "Received %s: a checkpoint will be written at the end of the current optimizer step, then training "
            "stops (send it again to exit immediately).",
            signal.Signals(signum).name,
        )

    def agreed(self) -> int:
        """The signal number any process received (0 if none); a collective when there are several processes."""
        accelerator = self.trainer.accelerator
        value = float(self.received or 0)
        if accelerator.num_processes > 1:
            flag = torch.tensor(value, device=accelerator.device)
            value = accelerator.reduce(flag, reduction="max").item()
        return int(value)


class ReliabilityCallback(TrainerCallback):
    """Wires the pieces into the training loop (added by ``GRPOVariantTrainer.train``)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        pending = getattr(trainer, "_pending_loop_state", None)
        if pending:
            if pending.get("tr_loss") is not None:
                trainer._tr_loss = pending["tr_loss"].to(trainer._tr_loss.device)
            if pending.get("globalstep_last_logged") is not None:
                trainer._globalstep_last_logged = int(pending["globalstep_last_logged"])
            trainer._pending_loop_state = None
        if getattr(trainer, "_resumed_from", None) is not None:
            _advance_sampler_epochs(trainer, kwargs.get("train_dataloader"), state)
            trainer._resumed_from = None
        trainer._nonfinite_guard.install(trainer.optimizer)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        watcher = getattr(self.trainer, "_signal_watcher", None)
        if watcher is None:
            return control
        signum = watcher.agreed()
        if signum:
            watcher.received = watcher.received or signum
            control.should_save = True
            control.should_training_stop = True
            self.trainer._stopped_by_signal = signum
        return control


def _find_repeat_sampler(obj, depth: int = 0):
    """The ``RepeatSampler`` behind an (accelerate-wrapped) dataloader, or None."""
    if obj is None or depth > 6:
        return None
    if hasattr(obj, "generator") and hasattr(obj, "num_samples") and hasattr(obj, "repeat_count"):
        return obj
    for attr in ("sampler", "batch_sampler", "base_dataloader"):
        found = _find_repeat_sampler(getattr(obj, attr, None), depth + 1)
        if found is not None:
            return found
    return None


def _advance_sampler_epochs(trainer, dataloader, state) -> None:
    """Draw the permutations of the epochs already trained, as the uninterrupted run did."""
    sampler = _find_repeat_sampler(dataloader)
    if sampler is None or not getattr(sampler, "shuffle", True) or dataloader is None:
        return
    try:
        batches = len(dataloader)
    except TypeError:
        return
    ga = trainer.args.gradient_accumulation_steps
    steps_per_epoch = max(batches // ga + int(batches % ga > 0), 1)
    epochs_trained = state.global_step // steps_per_epoch
    for _ in range(epochs_trained):
        torch.randperm(sampler.num_samples, generator=sampler.generator)


# ------------------------------------------------------------------------------------------------
# train()
# ------------------------------------------------------------------------------------------------
def run_train(trainer, train, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None):
    """``GRPOVariantTrainer.train``: resolve the checkpoint, install the callback and signal handlers, run."""
    args = trainer.args
    checkpoint = resolve_resume_checkpoint(resume_from_checkpoint, args.output_dir)
    if getattr(trainer, "_reliability_callback", None) is None:
        trainer._reliability_callback = ReliabilityCallback(trainer)
        trainer.add_callback(trainer._reliability_callback)
    trainer._nonfinite_guard = NonFiniteGuard(trainer)
    trainer._stopped_by_signal = None
    trainer._last_checkpoint_step = None
    if args.should_save:
        remove_stale_staging(args.output_dir)
    watcher = SignalCheckpointer(trainer) if args.save_on_signal else None
    if watcher is not None and not watcher.install():
        watcher = None
    trainer._signal_watcher = watcher
    try:
        result = train(resume_from_checkpoint=checkpoint, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval)
        signum = watcher.agreed() if watcher is not None else 0
        if signum and trainer._last_checkpoint_step != trainer.state.global_step:
            # the signal came after the last optimizer step: save the final state now
            trainer._save_checkpoint(trainer.model_wrapped, trial)
    finally:
        if watcher is not None:
            watcher.restore()
        trainer._signal_watcher = None
    if signum:
        logger.warning("Stopped by %s after saving checkpoint-%d.", signal.Signals(signum).name,
                       trainer.state.global_step)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)
    return result
