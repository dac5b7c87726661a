"""``GRPOVariantTrainer``: ``trl.GRPOTrainer`` with a composable loss, robust rewards and honest metrics.

The trainer wraps TRL rather than copying it:

* ``_compute_loss`` computes log-probs with TRL's own ``_get_per_token_logps_and_entropies`` and
  builds the loss from the pure functions of :mod:`grpo_variants.losses`, selected by the config
  (see :class:`~grpo_variants.config.GRPOVariantConfig`). For TRL loss types we do not compose
  (cispo, sapo, vespo, luspo) and for TRL options we do not re-implement (adaptive entropy,
  bias-corrected KL) it defers to ``super()._compute_loss``: with no variant chosen, the trainer
  behaves exactly like TRL's.
* Rollouts go through ``super()._generate_and_score_completions``; variants and the rollout components
  filter, extend or re-weight what it returns: dynamic sampling drops groups (:mod:`grpo_variants.rollout.sampling`),
  a stage buffers a large rollout (:mod:`grpo_variants.rollout.stages`), the two-stage rollout rewrites prompts
  from drafts (:mod:`grpo_variants.rollout.two_stage`).
* Inputs are checked at construction (:mod:`grpo_variants.validation`); reward functions are resolved by
  name and wrapped with clear errors (TRL's batch, no time limit by default).
* Every step logs clip/veto/FIPO fractions, the useful-token fraction and per-phase timings
  (:mod:`grpo_variants.metrics`).
* Off-policy steps cost no extra forward pass: the behaviour log-probs TRL would recompute are
  recorded while HF generate samples (``behaviour_logprobs``, :mod:`grpo_variants.rollout.logprobs`),
  and the training loader fetches a generation batch once instead of at every micro-step
  (:mod:`grpo_variants.rollout.loader`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import fields

import torch
from accelerate.utils import send_to_device
from trl import GRPOConfig, GRPOTrainer

from grpo_variants import card as _card
from grpo_variants.card import (  # noqa: F401  (re-exported: the card's helpers lived in this module)
    PAPER_TITLES,
    _variant_paper,
    deepspeed_settings,
    describe_base_model,
    describe_dataset,
    lora_settings,
    model_card_section,
    model_card_setup,
    non_default_hyperparameters,
)
from grpo_variants.rollout.adaptive_clip import adapted_loss_spec
from grpo_variants.config import GRPOVariantConfig
from grpo_variants.errors import ConfigError
from grpo_variants.registry import run_label
from grpo_variants.rollout.loader import RepeatedFetchCache, RowBatch, collate_rows
from grpo_variants.losses import LossSpec, compute_policy_loss
from grpo_variants.metrics import TOKEN_FATES, TrainerMetrics
from grpo_variants.process import AdaptiveKLMixin, ProcessSupervisionMixin
from grpo_variants.rewards.columns import check_reward_columns
from grpo_variants.rollout.batch import FORWARD_KEYS as _FORWARD_KEYS
from grpo_variants.rollout.logprobs import SampledLogprobRecorder
from grpo_variants.rollout.packed_forward import PaddingFreeMixin
from grpo_variants.rollout.sampling import DynamicSamplingMixin
from grpo_variants.rollout.stages import StageRolloutMixin
from grpo_variants.rollout.vllm_engine import variant_vllm_generation
from grpo_variants.validation import (  # noqa: F401  (re-exported: the checks were importable from here)
    _HUB_ID,
    check_dataset,
    check_model_path,
    check_output_dir,
    check_prompts_per_round,
    resolve_reward_funcs,
)

logger = logging.getLogger(__name__)

# Kept importable from here (their home was this module): the construction checks, the loader cache.
_RepeatedFetchCache, _RowBatch = RepeatedFetchCache, RowBatch


def _tied_parameter_names(model) -> set[str]:
    """Names of parameters that are the same tensor as another parameter (tied embeddings)."""
    try:
        model = model.module if hasattr(model, "module") else model
        names = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
        return {n for group in names.values() if len(group) > 1 for n in group}
    except Exception:  # noqa: BLE001
        return set()



# ------------------------------------------------------------------------------------------------
# The trainer
# ------------------------------------------------------------------------------------------------
class GRPOVariantTrainer(DynamicSamplingMixin, StageRolloutMixin, ProcessSupervisionMixin, AdaptiveKLMixin,
                         TrainerMetrics, PaddingFreeMixin, GRPOTrainer):
    """``trl.GRPOTrainer`` whose loss is composed from :mod:`grpo_variants.losses` by the config.

    Drop-in for TRL's trainer: same constructor, same config fields (plus ours). Variants subclass
    it, set ``config_class`` and override one rollout or loss hook.
    """

    config_class = GRPOVariantConfig
    variant_name: str | None = None

    # Defaults of the per-run state `__init__` sets, so that TRL's methods we extend (`_generate`, the
    # reward and log-prob hooks) also work on a trainer built without it (TRL's tests use object.__new__).
    _record_rollout_logprobs = False
    _rollout_logps = None
    _rollout_logps_expected = False
    _in_rollout = False
    _tokens_generated_round = 0
    _completions_generated_total = 0
    _last_rewards_per_func = None

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        **kwargs,
    ):
        from grpo_variants.tasks.models import resolve_model  # lazy: `python -m grpo_variants.tasks.models` imports us

        model = resolve_model(model)  # a registered name ("smollm2") -> its prepared folder
        args = self._coerce_args(args, model)
        check_model_path(model)
        check_output_dir(args.output_dir)
        # An environment may own the data and the reward (TRL 1.16): then TRL's own checks decide.
        environment = kwargs.get("environment_factory") is not None
        check_dataset(train_dataset, "train_dataset", environment=environment)
        check_dataset(eval_dataset, "eval_dataset", environment=environment)
        reward_funcs = resolve_reward_funcs(reward_funcs, environment=environment)
        if args.reward_weights is not None and len(args.reward_weights) != len(reward_funcs):
            raise ConfigError(  # TRL's message, then which functions
                f"Number of reward weights ({len(args.reward_weights)}) must match number of reward functions "
                f"({len(reward_funcs)}): {[getattr(f, '__name__', f) for f in reward_funcs]}; give reward_weights one weight per "
                "function."
            )
        self._check_args(args)
        self._check_custom_rollouts(args, kwargs)
        check_prompts_per_round(train_dataset, args)
        self._init_dynamic_sampling(args, train_dataset)
        self._init_stages()
        check_reward_columns(reward_funcs, train_dataset, "train_dataset")  # before any generation
        reward_funcs = self._wrap_rewards(reward_funcs, args)
        self._init_process_supervision(reward_funcs, args)  # step rewards: checks (grpo_variants.process)
        self._init_adaptive_kl(args)
        # Phase timers and token counters (see `_timed` and `_record_generated_tokens`).
        self._phase_time = {"generation": 0.0, "reward": 0.0, "logprobs": 0.0, "rollout": 0.0}
        self._in_rollout = False
        self._last_rewards_per_func = None
        self._tokens_generated_round = 0  # every generated token of the current rollout (kept or not)
        self._tokens_generated_total = 0
        self._tokens_useful_total = 0
        self._token_ledger = dict.fromkeys(TOKEN_FATES, 0)  # where generated tokens went (metrics.token_ledger)
        self._generation_rounds_total = 0
        self._completions_generated_total = 0  # every completion generated in training (drafts included)
        self._kept_fraction = 1.0  # kept tokens / generated tokens of the last rollout (filters, drafts)
        self._consecutive_nonfinite = 0
        self._rollouts_started = 0
        self._last_prepare_seconds = 0.0
        self._rollout_logps = None  # behaviour log-probs recorded during the last HF generate call
        self._rollout_logps_expected = False  # a recorded generate awaits its behaviour pass
        self.rollout_logprob_failures: list[str] = []  # why a recording was not usable (then TRL recomputes)
        with variant_vllm_generation(args):  # TRL builds our VLLMGeneration subclass (grpo_variants.rollout.vllm_engine)
            super().__init__(
                model=model,
                reward_funcs=reward_funcs,
                args=args,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                reward_processing_classes=reward_processing_classes,
                callbacks=callbacks,
                optimizers=optimizers,
                peft_config=peft_config,
                **kwargs,
            )
        if self.use_vllm and self.accelerator.is_main_process and hasattr(self.vllm_generation, "announcement"):
            logger.warning(self.vllm_generation.announcement())  # the engine's dtype, reuse (one line)
        self._check_stage_dataset()
        self._check_padding_free()  # grpo_variants.rollout.packed_forward: refuse what packing cannot do
        self.loss_spec = self._build_loss_spec()
        self._check_dynamic_sampling_metric()
        self._record_rollout_logprobs = self._rollout_logprobs_supported()
        self._install_adaptive_kl()  # kl_target: beta adapted after every optimizer step
        announcement = self.args.announce_defaults() if hasattr(self.args, "announce_defaults") else None
        if announcement and self.accelerator.is_main_process:
            logger.warning(announcement)
        behaviour = self.announce_behaviour()
        if behaviour and self.accelerator.is_main_process:
            logger.warning(behaviour)
        if self.accelerator.is_main_process and hasattr(self.args, "loss_composition_notes"):
            for note in self.args.loss_composition_notes():
                logger.warning(note)
        if self.accelerator.is_main_process:
            for note in self.short_run_warnings():
                logger.warning(note)
        if torch.cuda.is_available():  # model FLOPs utilisation (throughput/mfu); never logged on CPU
            from grpo_variants.callbacks import MFUCallback

            self.add_callback(MFUCallback(self))
        from grpo_variants.callbacks import RunRecordCallback
        from grpo_variants.console import install_console_callbacks

        install_console_callbacks(self)  # a progress bar with live metrics instead of a dict per step

        # metrics.jsonl, trainer_state.json, reward_curve.png and the model card in output_dir
        self.run_record = RunRecordCallback(self)
        self.add_callback(self.run_record)

    # ---- what this run does beyond TRL's GRPO ------------------------------------------------------
    def behaviour_changes(self) -> list[str]:
        """What this run does that ``trl.GRPOTrainer`` with the same TRL fields would not, largest first.

        TRL fields we only set differently (``epsilon_high``, ``mask_truncated_completions``, ...) are TRL's own
        behaviour and go in the defaults line instead (``announce_defaults``). Announced at construction in one
        line (:meth:`announce_behaviour`). Subclasses extend it (call super).
        """
        a = self.args
        out = []
        if self._overrides_rollout():
            doc = (type(self).__doc__ or "").strip().splitlines()
            what = doc[0].split("; see")[0].rstrip(".") if doc else type(self).__name__
            out.append(f"its own rollout ({what})")
        if a.padding_free is True:
            how = (f"padding_free='auto': {self.padding_free_reason}" if getattr(self, "padding_free_auto", False)
                   else "padding_free=True")
            out.append(f"a padding-free training forward (packed sequences, the same losses to float rounding; {how}; "
                       "padding_free=False for TRL's padded forward)")
        if a.dynamic_sampling:
            out.append(f"dynamic sampling (only groups whose {a.dynamic_sampling_metric} passes the "
                       f"{a.dynamic_sampling_filter!r} filter are trained; more are generated to fill the batch, up "
                       f"to {a.max_num_gen_batches} rounds)")
        if getattr(a, "stage_prompts", None) is not None:
            out.append(f"stage rollout ({a.stage_prompts} prompts generated at once, reused for "
                       f"{a.updates_per_stage} updates)")
        names = list(getattr(self, "reward_func_names", []))
        if getattr(a, "overlong_penalty", False) and names:
            out.append(f"an extra reward {names[-1]!r} after your {len(names) - 1} reward function(s) (soft overlong "
                       f"punishment, L_max {a.max_completion_length}, L_cache {a.resolved_overlong_buffer_len}, "
                       "weight 1)")
        if a.clip_ratio_c is not None:
            out.append(f"dual clip (negative-advantage ratio capped at c={a.clip_ratio_c})")
        from grpo_variants.config import TRL_LOSS_TYPE_TO_AGGREGATION

        if a.aggregation is not None and a.aggregation != TRL_LOSS_TYPE_TO_AGGREGATION.get(a.loss_type):
            out.append(f"loss aggregation {a.aggregation!r} (grpo_variants.losses)")
        if a.fipo:
            out.append(f"FIPO future-KL advantage weights (tau={a.fipo_tau})")
        if a.veto_scope is not None:
            out.append(f"a veto of tokens whose ratio falls below {a.veto_threshold} (scope {a.veto_scope!r})")
        if a.kl_in_reward:
            out.append(f"KL subtracted from the reward (beta={a.beta}) instead of added to the loss")
        if a.adaptive_clip_target is not None:
            out.append(f"adaptive clip range (target clipped fraction {a.adaptive_clip_target})")
        return out

    def short_run_warnings(self) -> list[str]:
        """One line per way a run with ``max_steps`` set would silently not be the run asked for: a learning-rate
        warm-up as long as the run (the rate never reaches ``learning_rate``), or fewer optimizer steps than one
        rollout feeds (every update trains on the completions of the first rollout)."""
        args, notes = self.args, []
        if args.max_steps is None or args.max_steps <= 0:
            return notes
        warmup = args.get_warmup_steps(args.max_steps)
        if warmup >= args.max_steps and args.lr_scheduler_type != "constant":
            notes.append(
                f"warmup_steps={args.warmup_steps:g} covers all max_steps={args.max_steps} optimizer steps: the learning "
                f"rate is in warm-up the whole run and never reaches learning_rate={args.learning_rate:g}. Lower "
                "warmup_steps (e.g. warmup_steps=0) or raise max_steps.")
        per_rollout = (args.steps_per_generation // args.gradient_accumulation_steps) * args.num_iterations
        if args.max_steps < per_rollout:
            notes.append(
                f"max_steps={args.max_steps} is shorter than one rollout: each rollout feeds {per_rollout} optimizer "
                f"steps (steps_per_generation={args.steps_per_generation} / gradient_accumulation_steps="
                f"{args.gradient_accumulation_steps} x num_iterations={args.num_iterations}), so the whole run trains "
                f"on the completions of one rollout. Raise max_steps to a multiple of {per_rollout}, or lower "
                "steps_per_generation (mini_batches_per_rollout).")
        return notes

    def announce_behaviour(self) -> str | None:
        """One line naming :meth:`behaviour_changes` (None when the run is TRL's GRPO with our defaults)."""
        changes = self.behaviour_changes()
        if not changes:
            return None
        return f"grpo-variants {run_label(self.variant_name)}: beyond TRL's GRPO, this run uses " + "; ".join(changes) \
            + " (see `grpo-variants train --variant NAME --help` to change any of them)."

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def _coerce_args(cls, args, model):
        if args is None:
            name = os.path.basename(str(model).rstrip("/")) if isinstance(model, (str, os.PathLike)) else "model"
            return cls.config_class(output_dir=f"{name}-{cls.variant_name or 'grpo-variant'}")
        if isinstance(args, cls.config_class):
            return args
        if isinstance(args, GRPOConfig) and cls.config_class is GRPOVariantConfig:
            # A plain trl.GRPOConfig: carry its values over (derived batch fields are recomputed).
            values = {f.name: getattr(args, f.name) for f in fields(GRPOConfig) if f.init}
            values["generation_batch_size"] = None
            return GRPOVariantConfig(**values)
        raise ConfigError(
            f"{cls.__name__} needs args of type {cls.config_class.__name__}, got {type(args).__name__}. "
            f"Build it with {cls.config_class.__name__}(...) so that the variant's defaults apply."
        )

    def _check_args(self, args) -> None:
        """Reject combinations a variant cannot honour. Subclasses extend it (call super)."""
        if args.resolved_aggregation is None and self.variant_name is not None:
            raise ConfigError(
                f"variant {self.variant_name!r} composes its own loss; loss_type={args.loss_type!r} is a TRL loss it "
                "cannot honour. Leave loss_type at the variant's default."
            )
        if args.kl_in_reward and args.multi_objective_aggregation != "sum_then_normalize":
            raise ConfigError(
                "kl_in_reward=True needs multi_objective_aggregation='sum_then_normalize' (the KL is subtracted "
                "from the weighted reward sum before the group normalisation)."
            )
        if args.dynamic_sampling and (self._overrides_rollout() or getattr(args, "stage_prompts", None) is not None):
            what = (f"{type(self).__name__} rewrites the rollout itself" if self._overrides_rollout()
                    else f"stage_prompts={args.stage_prompts} makes it a stage rollout (grpo_variants.rollout.stages)")
            raise ConfigError(
                f"dynamic_sampling=True composes with variants that keep TRL's rollout (grpo, dr_grpo, gspo, "
                f"gspo_token, dapo, fipo); {what}. Set dynamic_sampling=False."
            )
        if self.variant_name is not None:
            if args.use_adaptive_entropy:
                raise ConfigError(
                    f"variant {self.variant_name!r} does not support use_adaptive_entropy=True (TRL's adaptive "
                    "entropy controller); use a static entropy_coef or set it to False."
                )

    @staticmethod
    def _check_custom_rollouts(args, kwargs) -> None:
        """TRL's multi-turn and custom rollouts (``tools``, ``environment_factory``, ``rollout_func``) run inside
        TRL's rollout; our loops over it (dynamic sampling's re-sampling, a stage's chunked rollout) are not tested
        with them (environment state per rollout, tool masks of carried groups): refused, not guessed."""
        custom = [name for name in ("tools", "environment_factory", "rollout_func") if kwargs.get(name)]
        loops = [name for name, on in (("dynamic_sampling=True", args.dynamic_sampling),
                                       (f"stage_prompts={getattr(args, 'stage_prompts', None)}",
                                        getattr(args, "stage_prompts", None) is not None)) if on]
        if custom and loops:
            raise ConfigError(
                f"{' and '.join(custom)} with {' and '.join(loops)}: TRL's tool / environment / custom rollouts are "
                "supported with TRL's rollout only (no dynamic sampling, no stage rollout). Remove one of them."
            )

    @classmethod
    def _overrides_rollout(cls) -> bool:
        """Whether a subclass replaces the rollout (iGRPO): dynamic sampling cannot wrap it then."""
        own = GRPOVariantTrainer._generate_and_score_completions
        return cls._generate_and_score_completions is not own

    def _wrap_rewards(self, reward_funcs, args) -> list:
        from grpo_variants.rewards.robust import wrap_reward_funcs

        if args.reward_cache:
            logger.warning(
                "reward_cache=True: each reward function is called with identical samples removed (not TRL's "
                "batch); right only for deterministic rewards that score each completion on its own."
            )
        return wrap_reward_funcs(
            reward_funcs,
            timeout=args.reward_timeout,
            isolation=args.reward_isolation,
            on_error=args.reward_on_error,
            cache_duplicates=args.reward_cache,
            warn_after=args.reward_warn_after,
        )

    def _build_loss_spec(self) -> LossSpec | None:
        """The loss composition in force, or None when TRL's own ``_compute_loss`` is used."""
        args = self.args
        aggregation = args.resolved_aggregation
        if aggregation is None or args.use_adaptive_entropy:
            return None
        return LossSpec(
            ratio_level=args.resolved_ratio_level,
            eps_low=args.epsilon,
            eps_high=args.epsilon_high,
            clip_ratio_c=args.clip_ratio_c,
            ratio_cap=args.delta,
            aggregation="token_mean" if aggregation == "token_mean_local" else aggregation,
            beta=0.0 if args.kl_in_reward else args.beta,
            kl_estimator=args.kl_estimator,
            kl_ratio_correction=bool(args.use_bias_correction_kl),
            veto_scope=args.veto_scope,
            veto_threshold=args.veto_threshold,
            fipo=args.fipo,
            fipo_tau=args.fipo_tau,
            fipo_c=args.fipo_c,
            fipo_clip_low=args.fipo_clip_low,
            fipo_clip_high=args.fipo_clip_high,
            fipo_safety_ratio=args.fipo_safety_ratio,
            fipo_drop_multi_dual_clip=args.fipo_drop_multi_dual_clip,
        )

    # ---- resumable state --------------------------------------------------------------------------
    def variant_state_dict(self) -> dict:
        """Extra per-process state a checkpoint must carry for an exact resume (tensors, numbers, lists).

        Subclasses extend it (call super and update the dict): DAPO's data-stream position, µ-GRPO's
        stage bookkeeping, ... The checkpointing code saves it per process and hands it back to
        :meth:`load_variant_state_dict` on resume.
        """
        return {
            "tokens_generated_total": self._tokens_generated_total,
            "tokens_useful_total": self._tokens_useful_total,
            "generation_rounds_total": self._generation_rounds_total,
            "completions_generated_total": self._completions_generated_total,
            "kept_fraction": self._kept_fraction,
            "trained_per_generated": getattr(self, "_trained_per_generated", self._kept_fraction),
            "token_ledger": dict(self._token_ledger),
            **self._dynamic_sampling_state(),
            **self._stage_state(),
            **self._adaptive_kl_state(),
        }

    def load_variant_state_dict(self, state: dict) -> None:
        """Restore what :meth:`variant_state_dict` returned."""
        self._tokens_generated_total = state.get("tokens_generated_total", 0)
        self._tokens_useful_total = state.get("tokens_useful_total", 0)
        self._generation_rounds_total = state.get("generation_rounds_total", 0)
        self._completions_generated_total = state.get("completions_generated_total", 0)
        self._kept_fraction = state.get("kept_fraction", 1.0)
        self._trained_per_generated = state.get("trained_per_generated", self._kept_fraction)
        self._token_ledger = {**dict.fromkeys(TOKEN_FATES, 0), **state.get("token_ledger", {})}
        self._load_dynamic_sampling_state(state)
        self._load_stage_state(state)
        self._load_adaptive_kl_state(state)

    def _issue_warnings_after_load(self, load_result) -> None:
        """transformers' check, without its warning when the only missing keys are tied weights (a model
        with tied embeddings saves ``lm_head.weight`` once, as the embedding): re-tie them instead."""
        tied = _tied_parameter_names(self.model)
        if load_result.missing_keys and tied and set(load_result.missing_keys) <= tied:
            self.model.tie_weights()
            load_result = type(load_result)([], list(load_result.unexpected_keys))
        super()._issue_warnings_after_load(load_result)

    # ---- model card (grpo_variants.card) -----------------------------------------------------------
    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's model card, naming the variant and its paper, with a Quick start that loads a saved folder
        (or says how to save one) and a table of the non-default hyper-parameters (:mod:`grpo_variants.card`)."""
        from grpo_variants.registry import _VARIANTS

        spec = _VARIANTS.get(self.variant_name) if self.variant_name else None
        title, paper_id = _variant_paper(spec)
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        tags += ["grpo-variants"] + ([self.variant_name] if self.variant_name else [])
        self._card_args = {"model_name": model_name, "dataset_name": dataset_name}
        with _card.trl_card_names(self, spec, title, paper_id):
            super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if self.is_world_process_zero():
            _card.complete_model_card(self, spec, title, paper_id, dataset_name)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """``Trainer.save_model``; a save after training also rewrites the model card written at the end of
        training, so that its Quick start loads the folder just saved (``final_model/`` in the demo)."""
        super().save_model(output_dir, _internal_call)
        if _internal_call:  # a checkpoint: TRL writes the card with it
            return
        self._saved_model_dir = output_dir or self.args.output_dir
        written = getattr(self, "_card_args", None)
        if written is not None and os.path.exists(os.path.join(self.args.output_dir, "README.md")):
            self.create_model_card(**written)

    # ---- checkpoints, resume, signals (grpo_variants.reliability) --------------------------------
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None):
        """``Trainer.train`` with exact resume, atomic checkpoints, save-on-signal and a non-finite guard.

        ``resume_from_checkpoint=True`` picks the newest *complete* checkpoint. With ``save_on_signal``
        a SIGTERM / SIGINT saves a checkpoint at the next optimizer step, then raises ``SystemExit(143)``
        / ``KeyboardInterrupt``. See :mod:`grpo_variants.reliability`.
        """
        from grpo_variants.reliability import run_train

        return run_train(self, super().train, resume_from_checkpoint, trial, ignore_keys_for_eval)

    def _save_checkpoint(self, model, trial):
        from grpo_variants.reliability import save_checkpoint_atomically

        save_checkpoint_atomically(self, functools.partial(super()._save_checkpoint, model, trial), trial)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            from grpo_variants.reliability import load_resume_state

            load_resume_state(self, checkpoint)

    # ---- timing and token accounting -------------------------------------------------------------
    @contextmanager
    def _timed(self, phase: str):
        """Add the block's seconds to a training phase timer. Evaluation rollouts (model in eval mode) are not
        training time: counting them would divide a training rollout's tokens by eval seconds too
        (``throughput/generated_tokens_per_s``, ``time/*_s``)."""
        model = getattr(self, "model", None)  # None on a trainer built without __init__
        training = model is None or model.training
        start = time.perf_counter()
        try:
            yield
        finally:
            if training:
                times = self.__dict__.get("_phase_time")
                if times is None:  # a trainer built without __init__ (see the class attributes)
                    times = self._phase_time = {"generation": 0.0, "reward": 0.0, "logprobs": 0.0, "rollout": 0.0}
                times[phase] = times.get(phase, 0.0) + time.perf_counter() - start

    # ---- behaviour log-probs recorded during generation (grpo_variants.rollout.logprobs) ---------
    def _rollout_logprobs_supported(self) -> bool:
        """Whether ``behaviour_logprobs`` asks for, and the rollout path allows, recording in generate."""
        mode = self.args.behaviour_logprobs
        if mode == "recompute":
            return False
        blockers = [
            name
            for name, present in (
                ("use_vllm", self.use_vllm),
                ("use_transformers_continuous_batching", self.args.use_transformers_continuous_batching),
                ("tools", bool(getattr(self, "tools", None))),
                ("rollout_func", getattr(self, "rollout_func", None) is not None),
            )
            if present
        ]
        if mode == "rollout" and blockers:
            raise ConfigError(
                f"behaviour_logprobs='rollout' records log-probs inside HF generate, which {blockers} bypasses; "
                "use behaviour_logprobs='auto' or 'recompute'."
            )
        if blockers:
            return False
        if mode == "auto":
            low_precision = self.args.bf16 or self.args.fp16
            return not low_precision and self.accelerator.unwrap_model(self.model).dtype == torch.float32
        return True

    def _trl_needs_old_logps(self) -> bool:
        """TRL's own rule: behaviour log-probs are needed when generation and optimizer steps are misaligned."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0

    def _generation_module(self):
        """The causal LM whose forward HF generate calls (inside PEFT and DeepSpeed wrappers)."""
        model = self.accelerator.unwrap_model(self.model)
        return model.get_base_model() if hasattr(model, "get_base_model") else model

    def _generate(self, prompts):
        self._rollout_logps = None
        record = self._record_rollout_logprobs and self.model.training and self._trl_needs_old_logps()
        self._rollout_logps_expected = record  # the same on every process: the next behaviour pass decides
        recorder = SampledLogprobRecorder(self.temperature) if record else None
        handle = self._generation_module().register_forward_hook(recorder, with_kwargs=True) if record else None
        try:
            with self._timed("generation"):
                result = super()._generate(prompts)
        finally:
            if handle is not None:
                handle.remove()
        if recorder is not None:
            self._rollout_logps = recorder.finish(result[1])
            if self._rollout_logps is None:
                self.rollout_logprob_failures.append(recorder.failure)
        if not self.model.training:
            return result
        completion_ids = result[1]
        local = sum(len(ids) for ids in completion_ids)
        total = int(self.accelerator.gather(torch.tensor([local], device=self.accelerator.device)).sum().item())
        self._tokens_generated_round += total
        self._completions_generated_total += len(completion_ids) * getattr(self.accelerator, "num_processes", 1)
        return result

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        with self._timed("reward"):
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            if self.process_supervision:  # step ends -> completion tokens (grpo_variants.process)
                self._collect_steps(completions, completion_ids_list)
        self._last_rewards_per_func = rewards_per_func  # gathered over processes: (global batch, n_funcs)
        self._log_reward_health()
        self._log_lengths_by_outcome(completion_ids_list)
        return rewards_per_func

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        if not self._in_rollout:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        if self._rollout_logps_expected and model is self.model:  # the behaviour pass after a recorded generate
            self._rollout_logps_expected = False
            recorded, self._rollout_logps = self._rollout_logps, None
            usable = (
                recorded is not None
                and not kwargs.get("compute_entropy")
                and recorded.size(0) == input_ids.size(0)
                and logits_to_keep <= recorded.size(1)
            )
            if self.accelerator.num_processes > 1:  # all or none: under ZeRO-3 a forward pass is collective
                flag = torch.tensor([1.0 if usable else 0.0], device=self.accelerator.device)
                usable = bool(self.accelerator.gather(flag).min().item())
            if usable:
                self._metrics["train"]["rollout_logprobs/recorded"].append(1.0)
                return recorded[:, :logits_to_keep].to(input_ids.device), None, None
        with self._timed("logprobs"):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )

    def weighted_rewards(self) -> torch.Tensor:
        """Weighted sum of the last rollout's rewards over reward functions (global batch, NaN-aware)."""
        rewards_per_func = self._last_rewards_per_func
        weights = self.reward_weights.to(rewards_per_func.device).unsqueeze(0)
        rewards = (rewards_per_func * weights).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        return rewards

    def _generate_and_score_completions(self, inputs):
        """One training rollout: TRL's (:meth:`_scored_rollout`), or dynamic sampling's or a stage's loop over it."""
        if self.model.training and self.args.dynamic_sampling:
            return self._dynamic_sampling_rollout(inputs)
        if self.model.training and self.stages_enabled:
            return self._stage_rollout(inputs)
        return self._scored_rollout(inputs)

    def _scored_rollout(self, inputs):
        """TRL's rollout, timed, with a ``generated_mask`` of every generated token added.

        A group whose rewards are all equal gets exactly zero advantage (TRL's float arithmetic leaves
        (R - mean) / (std + 1e-4) at ~1e-4 for rewards such as 0.1 that are not exactly representable).
        """
        self._in_rollout = True
        if self.model.training and not getattr(self, "_rollout_nested", False):
            self._rollouts_started += 1
        try:
            with self._timed("rollout"):
                output = super()._generate_and_score_completions(inputs)
        finally:
            self._in_rollout = False
            self._rollout_logps = None
            self._rollout_logps_expected = False
        output["generated_mask"] = self.generated_mask(output)
        if self.process_supervision:  # step rewards: (rows, tokens) advantages (grpo_variants.process)
            outcome = self.outcome_rewards()
            if self.args.kl_in_reward:
                seq_kl = self._sequence_kl(output)
                outcome = (0.0 if outcome is None else outcome) - self.kl_beta * seq_kl
            output = self._apply_process_advantages(output, outcome)
        elif self.args.kl_in_reward:
            output = self._apply_kl_in_reward(output)
        else:
            self._zero_constant_group_advantages(output)
        return output

    @torch.no_grad()
    def _zero_constant_group_advantages(self, output) -> None:
        """Exactly zero advantage for every member of a group whose weighted rewards have zero std.

        "Zero std" is TRL's own test for ``frac_reward_zero_std`` (``torch.isclose(std, 0)``) or exactly
        equal rewards (:func:`grpo_variants.losses.zero_std_groups`); TRL's ``frac_reward_zero_std`` of this
        rollout is replaced by the fraction of rows zeroed here. Applies to the group-wise advantages
        (``scale_rewards`` group / none / batch with ``sum_then_normalize``).
        """
        if self.multi_objective_aggregation != "sum_then_normalize" or self._last_rewards_per_func is None:
            return
        from grpo_variants.losses import zero_std_groups

        mode = "train" if self.model.training else "eval"
        group = self.num_generations if mode == "train" else self.num_generations_eval
        rewards = self.weighted_rewards()
        if group is None or group < 2 or rewards.numel() % group != 0:
            return
        constant = zero_std_groups(rewards, group).repeat_interleave(group)
        logged = self._metrics[mode].get("frac_reward_zero_std")
        if logged:  # TRL's metric, on the rows whose advantage is zeroed here (TRL's isclose misses 0.7 x G)
            logged[-1] = constant.float().mean().item()
        local = output["advantages"].size(0)
        start = self.accelerator.process_index * local
        constant = constant[start : start + local].to(output["advantages"].device)
        if output["advantages"].dim() > 1:
            constant = constant.view(-1, *([1] * (output["advantages"].dim() - 1)))
        output["advantages"] = torch.where(constant, torch.zeros_like(output["advantages"]), output["advantages"])

    @torch.no_grad()
    def _apply_kl_in_reward(self, output):
        """KL in the reward: R_i <- R_i - beta * sum_t KL_t(pi_old || pi_ref); advantages recomputed."""
        from grpo_variants.losses import get_advantage_estimator

        seq_kl = self._sequence_kl(output)
        rewards = self.weighted_rewards() - self.kl_beta * seq_kl
        mode = "train" if self.model.training else "eval"
        group = self.num_generations if mode == "train" else self.num_generations_eval
        estimator = get_advantage_estimator(self.args.resolved_advantage_estimator)
        advantages = torch.nan_to_num(estimator(rewards, group), nan=0.0)
        local = output["advantages"].size(0)
        start = self.accelerator.process_index * local
        output["advantages"] = advantages[start : start + local]
        return output

    @torch.no_grad()
    def _sequence_kl(self, output) -> torch.Tensor:
        """sum_t KL_t(pi_old || pi_ref) of every row of the rollout (gathered over processes); logs the penalty."""
        from grpo_variants.losses import KL_ESTIMATORS

        mask = output["completion_mask"].float()
        policy_logps = output.get("old_per_token_logps")
        if policy_logps is None:  # on-policy step: TRL skipped it, the KL needs it once per rollout
            ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
            attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
            policy_logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model, ids, attention, output["completion_ids"].size(1)
            )
        kl = KL_ESTIMATORS[self.args.kl_estimator](policy_logps, output["ref_per_token_logps"])
        self._note_kl(kl, mask)  # kl_target: the KL per token of this rollout
        seq_kl = self.accelerator.gather((kl * mask).sum(dim=1))
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["kl_penalty/mean"].append((self.kl_beta * seq_kl).mean().item())
        return seq_kl

    @staticmethod
    def generated_mask(output) -> torch.Tensor:
        """1 for every generated completion token, including truncated rows masked out of the loss."""
        mask = output["completion_mask"]
        fully_masked = mask.sum(dim=1) == 0  # only truncated rows (with mask_truncated_completions) are empty
        return torch.where(fully_masked.unsqueeze(1), torch.ones_like(mask), mask)

    # ---- the training data loader: a stage's rows are fetched and moved once (grpo_variants.rollout.loader) ----
    def get_train_dataloader(self):
        if isinstance(self.train_dataset, torch.utils.data.IterableDataset):
            return super().get_train_dataloader()
        dataset, collator = self.train_dataset, self.data_collator
        self.train_dataset, self.data_collator = RepeatedFetchCache(dataset), functools.partial(collate_rows, collator)
        try:
            return super().get_train_dataloader()
        finally:
            self.train_dataset, self.data_collator = dataset, collator

    def _prepare_inputs(self, generation_batch):
        if isinstance(generation_batch, RowBatch):
            rows = list(generation_batch)
            generate_every = self.args.steps_per_generation * self.num_iterations
            if self._step % generate_every == 0 or self._buffered_inputs is None:  # TRL's condition to generate
                rows = send_to_device(rows, self.accelerator.device)
            generation_batch = rows
        start = time.perf_counter()
        rounds_before = self._rollouts_started
        inputs = super()._prepare_inputs(generation_batch)
        self._last_prepare_seconds = time.perf_counter() - start
        if self.model.training and self._rollouts_started > rounds_before:
            self._count_update_tokens()
            self._on_rollout_done()
            self._check_rollout_signal()
        return inputs

    def _check_rollout_signal(self) -> None:
        """Warn when every group of the rollout just made had zero reward variance (all of a prompt's completions
        scored alike): every advantage is 0, so the updates it feeds carry no policy gradient. Said once (the
        first time); ``rollout/zero_signal`` logs 1 / 0 for every rollout."""
        local = all(bool((b["advantages"] == 0).all()) for b in self._buffered_inputs)
        flag = torch.tensor([0.0 if local else 1.0], device=self.accelerator.device)
        none = float(self.accelerator.reduce(flag, reduction="sum").item()) == 0.0
        self._metrics["train"]["rollout/zero_signal"].append(1.0 if none else 0.0)
        if none and not getattr(self, "_zero_signal_warned", False):
            self._zero_signal_warned = True
            if self.accelerator.is_main_process:
                logger.warning(
                    "step %d: every group of this rollout had zero reward variance (each prompt's %s completions "
                    "scored alike), so every advantage is 0 and its updates carry no policy gradient. Harder or "
                    "easier prompts, more num_generations, a finer reward, or dynamic_sampling=True (variants that "
                    "keep TRL's rollout) give a signal. Said once; rollout/zero_signal logs it every rollout.",
                    self.state.global_step, self.num_generations)

    def _count_update_tokens(self) -> None:
        """Store on every buffered micro-batch the loss-mask tokens of its optimizer update (``num_items_in_update``).

        Only for ``aggregation="token_mean"`` (the token mean over each update's optimisation batch,
        docs/algorithms.md, "Aggregation"). An update is ``gradient_accumulation_steps`` consecutive micro-batches
        of the rollout's buffer (TRL serves buffer slot ``step % steps_per_generation``); the local counts are
        summed over processes in one reduce.
        When ``steps_per_generation`` is not a multiple of ``gradient_accumulation_steps`` an update straddles two
        rollouts: refused with an explicit ``aggregation="token_mean"``; with ``loss_type="dapo"`` alone TRL's
        rollout-average normaliser is kept and announced (``GRPOVariantConfig.loss_composition_notes``).
        """
        if self.args.resolved_aggregation != "token_mean" or self.loss_spec is None:  # explicit or loss_type="dapo"
            return
        spg, ga = self.args.steps_per_generation, self.args.gradient_accumulation_steps
        if spg % ga != 0 or len(self._buffered_inputs) != spg:
            return
        from grpo_variants.losses import update_token_counts

        def tokens(batch):
            mask = batch["completion_mask"]
            return (mask if "tool_mask" not in batch else mask * batch["tool_mask"]).sum().float()

        local = torch.stack([tokens(b) for b in self._buffered_inputs])
        counts = update_token_counts(self.accelerator.reduce(local, reduction="sum"), ga)
        for batch, count in zip(self._buffered_inputs, counts, strict=True):
            batch["num_items_in_update"] = count

    def training_step(self, model, inputs, num_items_in_batch):
        start = time.perf_counter()
        self._last_prepare_seconds = 0.0
        loss = super().training_step(model, inputs, num_items_in_batch)
        guard = getattr(self, "_nonfinite_guard", None)
        if guard is not None:  # non-finite losses skip the optimizer step (grpo_variants.reliability)
            guard.note_loss(loss)
        elapsed = time.perf_counter() - start - self._last_prepare_seconds
        self._metrics["train"]["time/update_s"].append(max(elapsed, 0.0))
        if torch.cuda.is_available():
            self._metrics["train"]["memory/peak_gb"].append(torch.cuda.max_memory_allocated() / 2**30)
        return loss

    # ---- the loss ----------------------------------------------------------------------------------
    def _compute_loss(self, model, inputs):
        self._log_stage_staleness(inputs)  # rows of a stage rollout (grpo_variants.rollout.stages)
        if self.loss_spec is None:
            return super()._compute_loss(model, inputs)
        spec = self.loss_spec
        if self.args.kl_target is not None and spec.beta != 0.0:  # adaptive KL in the loss (grpo_variants.process)
            spec = dataclasses.replace(spec, beta=self.kl_beta)
        mode = "train" if self.model.training else "eval"
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{key: inputs.get(key) for key in _FORWARD_KEYS},
        )
        old_per_token_logps = inputs.get("old_per_token_logps")
        if old_per_token_logps is None:
            old_per_token_logps = per_token_logps.detach()
        if mode == "train" and self.args.adaptive_clip_target is not None:  # grpo_variants.rollout.adaptive_clip
            spec, bounds = adapted_loss_spec(spec, per_token_logps, old_per_token_logps, inputs["advantages"], mask,
                                             self.args)
            self._metrics[mode]["adaptive_clip/low"].append(bounds.lower)
            self._metrics[mode]["adaptive_clip/high"].append(bounds.upper)
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)

        # TRL's optional per-token weights on the policy term, applied in TRL's order.
        token_weights = None
        if self.off_policy_mask_threshold is not None:
            sampling = inputs.get("sampling_per_token_logps", old_per_token_logps)
            token_weights = self.get_off_policy_mask(
                advantages, per_token_logps, sampling, mask, self.off_policy_mask_threshold
            )
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
            token_weights = entropy_mask.float() if token_weights is None else token_weights * entropy_mask
        else:
            entropy_mask = None
        if self.use_vllm and self.vllm_importance_sampling_correction:
            is_ratio = inputs["importance_sampling_ratio"]
            token_weights = is_ratio if token_weights is None else token_weights * is_ratio

        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        num_items = None
        if spec.aggregation == "token_mean" and self.args.resolved_aggregation == "token_mean":
            if mode == "train" and "num_items_in_update" in inputs:
                # aggregation="token_mean": the tokens of this update's own optimisation batch (all processes,
                # every micro-batch of its accumulation window), see _count_update_tokens
                num_items = inputs["num_items_in_update"].clamp(min=1.0) / self.accelerator.num_processes
            else:
                # loss_type="dapo" left to TRL: normalised exactly as TRL does (the rollout's average per update)
                num_items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
                if mode == "train":
                    num_items = num_items * accumulation / self.args.steps_per_generation
        out = compute_policy_loss(
            spec,
            per_token_logps,
            old_per_token_logps,
            advantages,
            mask,
            ref_logp=inputs.get("ref_per_token_logps") if spec.beta != 0.0 else None,
            entropies=entropies,
            num_items=num_items,
            max_completion_length=self.max_completion_length,
            token_weights=token_weights,
        )
        loss = out.loss if num_items is not None else out.loss / accumulation
        if "kl" in out.stats:
            self._note_kl(out.stats["kl"], mask)

        if self.args.entropy_coef != 0.0:  # static entropy bonus, TRL's definition (mean over acting tokens)
            acting = mask if entropy_mask is None else mask * entropy_mask
            entropy_term = (entropies * acting).sum() / acting.sum().clamp(min=1.0) / accumulation
            coef = getattr(self, "entropy_coef", self.args.entropy_coef)
            loss = loss - coef * entropy_term
            # TRL's metrics of the entropy bonus: the policy term before the bonus (TRL's `policy_loss`: per
            # micro-batch before the accumulation divisor, except for token-normalised losses), and the coefficient
            policy_loss = out.loss.detach()
            self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
            if mode == "train" and self.accelerator.sync_gradients:
                self._metrics[mode]["entropy_coef"].append(coef)
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())

        self._log_loss_metrics(mode, out.stats, entropies, mask, inputs)
        return loss
