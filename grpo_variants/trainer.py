"""``GRPOVariantTrainer``: ``trl.GRPOTrainer`` with a composable loss, robust rewards and honest metrics.

The trainer wraps TRL rather than copying it:

* ``_compute_loss`` computes log-probs with TRL's own ``_get_per_token_logps_and_entropies`` and
  builds the loss from the pure functions of :mod:`grpo_variants.losses`, selected by the config
  (see :class:`~grpo_variants.config.GRPOVariantConfig`). For TRL loss types we do not compose
  (cispo, sapo, vespo, luspo) and for TRL options we do not re-implement (adaptive entropy,
  bias-corrected KL) it defers to ``super()._compute_loss``: with no variant chosen, the trainer
  behaves exactly like TRL's.
* Rollouts go through ``super()._generate_and_score_completions``; variants filter, extend or
  re-weight what it returns (DAPO drops groups, iGRPO rewrites prompts, µ-GRPO buffers stages).
* Reward functions are resolved by name and wrapped with a per-call timeout and clear errors.
* Every step logs clip/veto/FIPO fractions, the useful-token fraction and per-phase timings.
* Off-policy steps cost no extra forward pass: the behaviour log-probs TRL would recompute are
  recorded while HF generate samples (``behaviour_logprobs``, :mod:`grpo_variants.rollout_logprobs`),
  and the training loader fetches a generation batch once instead of at every micro-step.
"""

from __future__ import annotations

import functools
import os
import re
import time
from contextlib import contextmanager
from dataclasses import fields

import torch
from accelerate.utils import send_to_device
from trl import GRPOConfig, GRPOTrainer

from grpo_variants.config import GRPOVariantConfig
from grpo_variants.errors import ConfigError, DatasetError, ModelPathError, UnknownRewardError
from grpo_variants.losses import LossSpec, compute_policy_loss
from grpo_variants.rewards.columns import check_reward_columns
from grpo_variants.rollout_logprobs import SampledLogprobRecorder

# Inputs TRL forwards to the model for multimodal batches; passed through untouched.
_FORWARD_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class _RepeatedFetchCache(torch.utils.data.Dataset):
    """A map-style dataset view that serves a repeated batch of indices from its last fetch."""

    def __init__(self, dataset):
        self.dataset = dataset
        self._indices: list | None = None
        self._rows: list | None = None

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        return self.dataset[index]

    def __getitems__(self, indices):
        if indices != self._indices:
            fetch = getattr(self.dataset, "__getitems__", None)
            self._rows = fetch(indices) if fetch is not None else [self.dataset[i] for i in indices]
            self._indices = list(indices)
        return list(self._rows)


class _RowBatch:
    """Collated training rows that accelerate's ``send_to_device`` and torch's ``pin_memory`` leave alone.

    Not a list, tuple or Mapping and without ``.to``: both return it unchanged instead of walking every
    row of a large generation batch at every micro-step. ``_prepare_inputs`` unwraps it.
    """

    __slots__ = ("rows",)

    def __init__(self, collator, rows):
        self.rows = collator(rows)

    def __len__(self):
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def __getitem__(self, index):
        return self.rows[index]

    def __contains__(self, item):
        return item in self.rows


# ------------------------------------------------------------------------------------------------
# Input validation helpers (construction time, clear messages)
# ------------------------------------------------------------------------------------------------
def check_model_path(model) -> None:
    """Fail early, and clearly, for a model path that does not exist."""
    if not isinstance(model, (str, os.PathLike)):
        return
    path = os.path.expanduser(str(model))
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")) and not os.path.exists(
            os.path.join(path, "adapter_config.json")
        ):
            raise ModelPathError(
                f"model={str(model)!r} is a folder but holds no config.json: it is not a saved model. "
                "Save one with model.save_pretrained(path), or use grpo_variants.toy.prepare().model_path."
            )
        return
    looks_local = path.startswith((os.sep, ".", "~")) or os.sep in path.strip(os.sep) and not _HUB_ID.match(path)
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    if looks_local or not _HUB_ID.match(path) or offline and not _in_hf_cache(path):
        raise ModelPathError(
            f"model={str(model)!r} does not exist: it is neither a local folder nor "
            + ("a hub id in the local cache (HF_HUB_OFFLINE is set)." if offline else "a hub id of the form org/name.")
            + " Pass the folder of a saved model (e.g. grpo_variants.toy.prepare().model_path) or a hub id."
        )


def _in_hf_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # pragma: no cover - very old huggingface_hub
        return False


def check_dataset(dataset, name: str) -> None:
    """A dataset must exist, be non-empty and carry a ``prompt`` column."""
    if dataset is None:
        if name == "train_dataset":
            raise DatasetError("train_dataset is required: pass a datasets.Dataset with a 'prompt' column.")
        return
    if isinstance(dataset, dict):  # several eval datasets
        for key, value in dataset.items():
            check_dataset(value, f"{name}[{key!r}]")
        return
    columns = getattr(dataset, "column_names", None)
    if columns is not None and "prompt" not in columns:
        raise DatasetError(
            f"{name} has no 'prompt' column (columns: {columns}). Rename the column holding the prompts, e.g. "
            "dataset.rename_column('question', 'prompt')."
        )
    try:
        size = len(dataset)
    except TypeError:  # IterableDataset
        return
    if size == 0:
        raise DatasetError(f"{name} is empty: it needs at least one row with a 'prompt'.")


def resolve_reward_funcs(reward_funcs) -> list:
    """Turn registered reward names into callables; keep callables, reward-model paths and hub ids."""
    from grpo_variants.rewards.registry import get_reward

    if reward_funcs is None:
        raise ConfigError(
            "reward_funcs is required: pass a callable, a registered reward name (see `grpo-variants list`) "
            "or a list of them."
        )
    items = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not items:
        raise ConfigError("reward_funcs is empty: pass at least one reward function.")
    resolved = []
    for item in items:
        if isinstance(item, str):
            try:
                resolved.append(get_reward(item))
                continue
            except UnknownRewardError:
                if os.path.isdir(os.path.expanduser(item)) or _HUB_ID.match(item):
                    resolved.append(item)  # a reward *model*: TRL loads it
                    continue
                raise
        elif not callable(item):
            raise ConfigError(f"reward_funcs entry {item!r} is neither callable nor a registered reward name.")
        resolved.append(item)
    return resolved


# ------------------------------------------------------------------------------------------------
# The trainer
# ------------------------------------------------------------------------------------------------
class GRPOVariantTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose loss is composed from :mod:`grpo_variants.losses` by the config.

    Drop-in for TRL's trainer: same constructor, same config fields (plus ours). Variants subclass
    it, set ``config_class`` and override one rollout or loss hook.
    """

    config_class = GRPOVariantConfig
    variant_name: str | None = None

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
        from grpo_variants.models import resolve_model  # lazy: `python -m grpo_variants.models` imports us

        model = resolve_model(model)  # a registered name ("smollm2") -> its prepared folder
        args = self._coerce_args(args, model)
        check_model_path(model)
        check_dataset(train_dataset, "train_dataset")
        check_dataset(eval_dataset, "eval_dataset")
        reward_funcs = resolve_reward_funcs(reward_funcs)
        if args.reward_weights is not None and len(args.reward_weights) != len(reward_funcs):
            raise ConfigError(
                f"reward_weights has {len(args.reward_weights)} values but there are {len(reward_funcs)} reward "
                f"functions ({[getattr(f, '__name__', f) for f in reward_funcs]}): give one weight per function."
            )
        self._check_args(args)
        check_reward_columns(reward_funcs, train_dataset, "train_dataset")  # before any generation
        reward_funcs = self._wrap_rewards(reward_funcs, args)
        # Phase timers and token counters (see `_timed` and `_record_generated_tokens`).
        self._phase_time = {"generation": 0.0, "reward": 0.0, "logprobs": 0.0, "rollout": 0.0}
        self._in_rollout = False
        self._last_rewards_per_func = None
        self._tokens_generated_round = 0  # every generated token of the current rollout (kept or not)
        self._tokens_generated_total = 0
        self._tokens_useful_total = 0
        self._generation_rounds_total = 0
        self._completions_generated_total = 0  # every completion generated in training (drafts included)
        self._kept_fraction = 1.0  # kept tokens / generated tokens of the last rollout (filters, drafts)
        self._consecutive_nonfinite = 0
        self._rollouts_started = 0
        self._last_prepare_seconds = 0.0
        self._rollout_logps = None  # behaviour log-probs recorded during the last HF generate call
        self._rollout_logps_expected = False  # a recorded generate awaits its behaviour pass
        self.rollout_logprob_failures: list[str] = []  # why a recording was not usable (then TRL recomputes)
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
        self.loss_spec = self._build_loss_spec()
        self._record_rollout_logprobs = self._rollout_logprobs_supported()
        if torch.cuda.is_available():  # model FLOPs utilisation (throughput/mfu); never logged on CPU
            from grpo_variants.callbacks import MFUCallback

            self.add_callback(MFUCallback(self))

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
        if self.variant_name is not None:
            if args.use_adaptive_entropy:
                raise ConfigError(
                    f"variant {self.variant_name!r} does not support use_adaptive_entropy=True (TRL's adaptive "
                    "entropy controller); use a static entropy_coef or set it to False."
                )

    def _wrap_rewards(self, reward_funcs, args) -> list:
        from grpo_variants.rewards.robust import wrap_reward_funcs

        return wrap_reward_funcs(
            reward_funcs,
            timeout=args.reward_timeout,
            isolation=args.reward_isolation,
            on_error=args.reward_on_error,
            cache_duplicates=args.reward_cache,
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
        }

    def load_variant_state_dict(self, state: dict) -> None:
        """Restore what :meth:`variant_state_dict` returned."""
        self._tokens_generated_total = state.get("tokens_generated_total", 0)
        self._tokens_useful_total = state.get("tokens_useful_total", 0)
        self._generation_rounds_total = state.get("generation_rounds_total", 0)
        self._completions_generated_total = state.get("completions_generated_total", 0)
        self._kept_fraction = state.get("kept_fraction", 1.0)

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
        start = time.perf_counter()
        try:
            yield
        finally:
            self._phase_time[phase] += time.perf_counter() - start

    # ---- behaviour log-probs recorded during generation (grpo_variants.rollout_logprobs) ---------
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
        self._completions_generated_total += len(completion_ids) * self.accelerator.num_processes
        return result

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        with self._timed("reward"):
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._last_rewards_per_func = rewards_per_func  # gathered over processes: (global batch, n_funcs)
        self._log_reward_health()
        return rewards_per_func

    def _log_reward_health(self) -> None:
        """Error / timeout / NaN / cache-hit rates and time of every wrapped reward, averaged over processes."""
        keys = ("error_rate", "timeout_rate", "nan_rate", "cache_hit_rate", "time_s")
        mode = "train" if self.model.training else "eval"
        for func, name in zip(self.reward_funcs, self.reward_func_names, strict=True):
            if not hasattr(func, "pop_metrics"):
                continue
            local = func.pop_metrics()
            values = torch.tensor([float(local[k]) for k in keys], device=self.accelerator.device)
            values = self.accelerator.reduce(values, reduction="mean")
            for key, value in zip(keys, values.tolist(), strict=True):
                self._metrics[mode][f"rewards/{name}/{key}"].append(value)

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
        """TRL's rollout, timed, with a ``generated_mask`` of every generated token added."""
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
        if self.args.kl_in_reward:
            output = self._apply_kl_in_reward(output)
        return output

    @torch.no_grad()
    def _apply_kl_in_reward(self, output):
        """KL in the reward: R_i <- R_i - beta * sum_t KL_t(pi_old || pi_ref); advantages recomputed."""
        from grpo_variants.losses import KL_ESTIMATORS, get_advantage_estimator

        mask = output["completion_mask"].float()
        policy_logps = output.get("old_per_token_logps")
        if policy_logps is None:  # on-policy step: TRL skipped it, the KL needs it once per rollout
            ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
            attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
            policy_logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model, ids, attention, output["completion_ids"].size(1)
            )
        kl = KL_ESTIMATORS[self.args.kl_estimator](policy_logps, output["ref_per_token_logps"])
        seq_kl = self.accelerator.gather((kl * mask).sum(dim=1))
        rewards = self.weighted_rewards() - self.args.beta * seq_kl
        mode = "train" if self.model.training else "eval"
        group = self.num_generations if mode == "train" else self.num_generations_eval
        estimator = get_advantage_estimator(self.args.resolved_advantage_estimator)
        advantages = torch.nan_to_num(estimator(rewards, group), nan=0.0)
        local = output["advantages"].size(0)
        start = self.accelerator.process_index * local
        output["advantages"] = advantages[start : start + local]
        self._metrics[mode]["kl_penalty/mean"].append((self.args.beta * seq_kl).mean().item())
        return output

    @staticmethod
    def generated_mask(output) -> torch.Tensor:
        """1 for every generated completion token, including truncated rows masked out of the loss."""
        mask = output["completion_mask"]
        fully_masked = mask.sum(dim=1) == 0  # only truncated rows (with mask_truncated_completions) are empty
        return torch.where(fully_masked.unsqueeze(1), torch.ones_like(mask), mask)

    # ---- the training data loader: a stage's rows are fetched and moved once ---------------------
    # TRL's RepeatSampler hands the whole generation batch (per-device batch x steps_per_generation
    # rows) to every micro-step and TRL uses it only when it generates. For a µ-GRPO stage of 4,096 rows
    # that re-fetch (datasets) and re-traversal (accelerate's send_to_device) cost ~25 ms per update on
    # CPU. The train loader therefore fetches a repeated batch of indices once (_RepeatedFetchCache) and
    # hands rows over in a container that accelerate and pin_memory pass through (_RowBatch); the rows
    # are moved to the device only when TRL is about to generate from them.
    def get_train_dataloader(self):
        if isinstance(self.train_dataset, torch.utils.data.IterableDataset):
            return super().get_train_dataloader()
        dataset, collator = self.train_dataset, self.data_collator
        self.train_dataset, self.data_collator = _RepeatedFetchCache(dataset), functools.partial(_RowBatch, collator)
        try:
            return super().get_train_dataloader()
        finally:
            self.train_dataset, self.data_collator = dataset, collator

    def _prepare_inputs(self, generation_batch):
        if isinstance(generation_batch, _RowBatch):
            rows = generation_batch.rows
            generate_every = self.args.steps_per_generation * self.num_iterations
            if self._step % generate_every == 0 or self._buffered_inputs is None:  # TRL's condition to generate
                rows = send_to_device(rows, self.accelerator.device)
            generation_batch = rows
        start = time.perf_counter()
        rounds_before = self._rollouts_started
        inputs = super()._prepare_inputs(generation_batch)
        self._last_prepare_seconds = time.perf_counter() - start
        if self.model.training and self._rollouts_started > rounds_before:
            self._on_rollout_done()
        return inputs

    def _on_rollout_done(self) -> None:
        """Bookkeeping after each training rollout: counters, kept fraction, phase timings."""
        kept = sum(int(b["generated_mask"].sum().item()) for b in self._buffered_inputs)
        kept = int(self.accelerator.gather(torch.tensor([kept], device=self.accelerator.device)).sum().item())
        generated = max(self._tokens_generated_round, 1)
        self._kept_fraction = min(kept / generated, 1.0)
        self._tokens_generated_total += self._tokens_generated_round
        self._generation_rounds_total += 1
        metrics = self._metrics["train"]
        t = self._phase_time
        metrics["time/generation_s"].append(t["generation"])
        metrics["time/reward_s"].append(t["reward"])
        metrics["time/logprobs_s"].append(t["logprobs"])
        metrics["time/rollout_s"].append(t["rollout"])
        if t["generation"] > 0:
            metrics["throughput/generated_tokens_per_s"].append(self._tokens_generated_round / t["generation"])
        metrics["tokens/generated"].append(float(self._tokens_generated_round))
        metrics["tokens/kept_fraction"].append(self._kept_fraction)
        self._phase_time = dict.fromkeys(self._phase_time, 0.0)
        self._tokens_generated_round = 0

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
        if self.loss_spec is None:
            return super()._compute_loss(model, inputs)
        spec = self.loss_spec
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
            # Whole-optimisation-batch token mean, normalised exactly as TRL's "dapo" loss_type does.
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

        if self.args.entropy_coef != 0.0:  # static entropy bonus, TRL's definition (mean over acting tokens)
            acting = mask if entropy_mask is None else mask * entropy_mask
            entropy_term = (entropies * acting).sum() / acting.sum().clamp(min=1.0) / accumulation
            loss = loss - self.args.entropy_coef * entropy_term
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())

        self._log_loss_metrics(mode, out.stats, entropies, mask, inputs)
        return loss

    def _global_mean(self, values: torch.Tensor, mask: torch.Tensor) -> float:
        """Masked mean over every process (values may be (B, 1) per-sequence or (B, T) per-token)."""
        if values.dim() == 2 and values.shape[1] == 1 and mask.shape[1] != 1:
            values = values.expand_as(mask)
        values = values.float()
        totals = torch.stack([(values * mask).sum(), mask.sum().float()])
        totals = self.accelerator.reduce(totals, reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    def _global_sequence_fraction(self, flags: torch.Tensor, mask: torch.Tensor) -> float:
        """Fraction, over every process, of sequences with at least one trained token whose ``flags`` is set.

        ``flags`` is per sequence ((B,) or (B, 1)) or per token ((B, T): a row counts if any trained token is set).
        """
        rows = (mask > 0).any(dim=-1)
        if flags.dim() == 2 and flags.shape[1] != 1:
            flags = (flags.expand(mask.shape) & (mask > 0)).any(dim=-1)
        flagged = flags.reshape(-1).bool() & rows
        counts = self.accelerator.reduce(torch.stack([flagged.sum(), rows.sum()]).float(), reduction="sum")
        return (counts[0] / counts[1].clamp(min=1.0)).item()

    def _log_loss_metrics(self, mode, stats, entropies, mask, inputs) -> None:
        metrics = self._metrics[mode]
        mask = mask.float()
        metrics["entropy"].append(self._global_mean(entropies.detach(), mask))
        for key, name in (
            ("is_low_clipped", "clip_ratio/low_mean"),
            ("is_high_clipped", "clip_ratio/high_mean"),
            ("is_dual_clipped", "clip_ratio/dual_mean"),
        ):
            if key in stats:
                metrics[name].append(self._global_mean(stats[key], mask))
        if "is_low_clipped" in stats and "is_high_clipped" in stats:
            region = stats["is_low_clipped"] | stats["is_high_clipped"]
            metrics["clip_ratio/region_mean"].append(self._global_mean(region, mask))
        if "kl" in stats:
            metrics["kl"].append(self._global_mean(stats["kl"], mask))
        if self.loss_spec.veto_scope is not None:
            metrics["veto/trigger_fraction"].append(self._global_mean(stats["veto_triggers"], mask))
            metrics["veto/fraction"].append(self._global_mean(stats["vetoed"], mask))
        if "fipo_weights" in stats:
            weights = stats["fipo_weights"]
            metrics["fipo/weight_mean"].append(self._global_mean(weights, mask))
            masked_max = torch.where(mask.bool(), weights.expand_as(mask), torch.zeros_like(mask)).max()
            metrics["fipo/weight_max"].append(self.accelerator.reduce(masked_max, reduction="max").item())
        # Useful-token fraction: tokens whose policy gradient is non-zero after filtering, clipping and
        # masking, over every token generated for this micro-batch (the part discarded by filters or
        # spent on drafts is charged through the rollout's kept fraction).
        if mode == "train":
            generated = inputs.get("generated_mask", mask)
            totals = torch.stack([stats["useful"].float().mul(mask).sum(), generated.float().sum()])
            totals = self.accelerator.reduce(totals, reduction="sum")
            useful, produced = totals.tolist()
            self._tokens_useful_total += int(useful)
            metrics["useful_token_fraction"].append(useful / max(produced, 1.0) * self._kept_fraction)
            metrics["tokens/useful_total"].append(float(self._tokens_useful_total))
            metrics["tokens/generated_total"].append(float(self._tokens_generated_total))
            metrics["generation_rounds_total"].append(float(self._generation_rounds_total))
