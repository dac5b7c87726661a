"""Process supervision and the adaptive KL coefficient, as two trainer components (mixed into the base trainer).

**Process supervision** (DeepSeekMath §4.1.3, PURE). A reward function declared with
:func:`~grpo_variants.rewards.steps.step_reward` scores every step of a completion
(:mod:`grpo_variants.rewards.steps`). After TRL's rollout (``super()``'s, untouched) the trainer:

1. maps each completion's step ends to completion tokens with the tokenizer's decoding of the generated
   ids (:func:`~grpo_variants.rewards.steps.token_char_ends`; a step belongs to the token holding the last byte of
   its last character); in a completion cut by the length limit (TRL's test: its last token is neither EOS nor
   padding) only the steps that ended before the cut are credited, the unfinished trailing step is dropped and
   counted (``process/steps_dropped``; :func:`~grpo_variants.rewards.steps.ended_steps`), so the tokens after the
   last finished step get no process credit, only the outcome advantage;
2. normalises every step reward over all steps of its group with the advantage estimator in force
   (``scale_rewards``: group std / none / batch std; :func:`~grpo_variants.losses.normalize_step_rewards`);
3. turns them into token credit, ``process_credit="sum"`` (DeepSeekMath: sum over the steps that end at or
   after the token) or ``"min"`` (PURE: their minimum) (:func:`~grpo_variants.losses.step_credit`), times the
   function's ``reward_weights`` entry, summed over step functions;
4. adds the outcome advantage of the other reward functions (their weighted sum, group-normalised as TRL
   does; minus beta x KL with ``kl_in_reward``): A_{i,t} = A_i^outcome + A_{i,t}^process.

``advantages`` then has shape (rows, completion tokens); every token-ratio loss uses it unchanged. TRL's
``frac_reward_zero_std`` is logged as the share of rows whose token advantages are all zero (no learning signal). Refused at
construction: a sequence-level ratio (GSPO: one ratio per sequence cannot carry per-token credit),
TRL's own losses, ``multi_objective_aggregation="normalize_then_sum"``, and dynamic sampling with
``scale_rewards="batch"`` (its batch-std re-normalisation is per sequence).

**Adaptive KL** (``kl_target``): beta follows a controller toward a target KL per token (Ziegler et al.
2019, verl's ``kl_ctrl.type=adaptive``): after each optimizer step with measured KL per token KL_t over
n_t sequences, beta <- clamp(beta (1 + clip(KL_t / kl_target - 1, -0.2, 0.2) n_t / kl_horizon),
kl_beta_min, kl_beta_max) (:func:`~grpo_variants.losses.adaptive_kl_beta`). KL_t is the KL the loss
measured in the step (KL in the loss) or of the rollout's sequences (``kl_in_reward``, measured once per
rollout). ``beta`` is the start value and must be > 0. ``kl_ctl/beta`` (the beta used in the step) and
``kl_ctl/kl`` are logged every step; beta is part of the checkpoint (exact resume).
"""

from __future__ import annotations

import logging

import torch
from transformers import TrainerCallback

from grpo_variants.errors import ConfigError
from grpo_variants.rewards.robust import _completion_text

logger = logging.getLogger(__name__)

__all__ = ["AdaptiveKLMixin", "ProcessSupervisionMixin"]


def _declared_delimiter(func) -> str | None:
    """The step delimiter a step reward declared (``@step_reward(delimiter=...)``, a PRM's ``delimiter``), if any."""
    for _ in range(8):
        for name in ("step_delimiter", "delimiter"):
            value = getattr(func, name, None)
            if isinstance(value, str) and value:
                return value
        func = getattr(func, "__wrapped__", None)
        if func is None:
            break
    return None


class ProcessSupervisionMixin:
    """Token-level advantages from step rewards for :class:`~grpo_variants.GRPOVariantTrainer`."""

    def _init_process_supervision(self, reward_funcs, args) -> None:
        """Construction checks (before any generation) and one log line naming what runs."""
        self._step_func_indices = [i for i, f in enumerate(reward_funcs) if getattr(f, "returns_steps", False)]
        self._last_step_rows = None
        if not self._step_func_indices:
            return
        names = [getattr(reward_funcs[i], "__name__", str(i)) for i in self._step_func_indices]
        if args.resolved_aggregation is None or args.use_adaptive_entropy:
            raise ConfigError(
                f"step rewards {names} give per-token advantages, which TRL's own loss (loss_type={args.loss_type!r}"
                f"{', use_adaptive_entropy=True' if args.use_adaptive_entropy else ''}) is not checked for here. Use a "
                "composed loss_type (grpo, bnpo, dr_grpo, dapo) or a variant."
            )
        if args.resolved_ratio_level == "sequence":
            raise ConfigError(
                f"step rewards {names} give per-token advantages, but ratio_level='sequence' (GSPO) has one ratio "
                "per sequence and cannot carry per-token credit. Use variant 'gspo_token' (ratio_level="
                "'sequence_token'), a token-ratio variant, or outcome rewards only."
            )
        if args.multi_objective_aggregation != "sum_then_normalize":
            raise ConfigError(
                f"step rewards {names} need multi_objective_aggregation='sum_then_normalize' (outcome rewards are "
                "summed with their weights, step rewards normalised over the group's steps)."
            )
        if args.dynamic_sampling and args.scale_rewards == "batch":
            raise ConfigError(
                f"step rewards {names} with dynamic_sampling=True and scale_rewards='batch': the batch-std "
                "re-normalisation over the optimisation batch is per sequence. Use scale_rewards='group' or 'none'."
            )
        outcome = [getattr(f, "__name__", str(i)) for i, f in enumerate(reward_funcs)
                   if i not in self._step_func_indices]
        logger.warning(
            "Step rewards %s: advantages are per token (process_credit=%r%s), A = A_outcome%s + A_process.",
            names, args.process_credit,
            ", DeepSeekMath sum-form" if args.process_credit == "sum" else ", PURE min-form",
            f" of {outcome}" if outcome else " (none: no outcome reward)",
        )

    @property
    def process_supervision(self) -> bool:
        return bool(getattr(self, "_step_func_indices", None))

    # ---- after the reward call: step ends -> tokens (local rows) ------------------------------------
    def _collect_steps(self, completions, completion_ids_list) -> None:
        """Per step function, per local row: (token indices, scores) of the steps the reward returned."""
        from grpo_variants.rewards.steps import PrefixCharEnds, ended_steps, step_token_indices

        tokenizer = self._tokenizer
        # TRL's test for a completion cut by the length limit (completions/clipped_ratio, mask_truncated_completions)
        eos_and_pad = {*getattr(self, "eos_token_ids", [tokenizer.eos_token_id]), tokenizer.pad_token_id}
        char_ends, offsets, texts, truncated = [], [], [], []
        for completion, ids in zip(completions, completion_ids_list, strict=True):
            ends = PrefixCharEnds(tokenizer, ids)  # prefixes decoded lazily: O(steps x log tokens) decodes
            seen = _completion_text(completion)
            decoded = ends.total
            offsets.append(len(seen) - decoded if len(seen) >= decoded else 0)  # e.g. a prefilled assistant turn
            char_ends.append(ends)
            texts.append(seen)
            truncated.append(len(ids) > 0 and int(ids[-1]) not in eos_and_pad)
        rows_per_func, dropped = [], 0
        for i in self._step_func_indices:
            steps = self.reward_funcs[i].last_steps or [None] * len(completions)
            delimiter = _declared_delimiter(self.reward_funcs[i])
            rows = []
            for step, ends, offset, text, cut in zip(steps, char_ends, offsets, texts, truncated, strict=True):
                if step is None:
                    rows.append(([], []))
                    continue
                step, unfinished = ended_steps(step, text, truncated=cut, delimiter=delimiter)  # only steps that ended
                dropped += unfinished
                mapped = step_token_indices(step.ends, ends, offset=offset)
                dropped += sum(t is None for t in mapped)
                kept = [(t, s) for t, s in zip(mapped, step.scores, strict=True) if t is not None]
                rows.append(([t for t, _ in kept], [s for _, s in kept]))
            rows_per_func.append(rows)
        self._last_step_rows = rows_per_func
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["process/steps_dropped"].append(float(dropped))

    # ---- after the rollout: token advantages ------------------------------------------------------
    def _global_step_rows(self, rows: list) -> list:
        if self.accelerator.num_processes == 1:
            return rows
        from accelerate.utils import gather_object

        return list(gather_object(list(rows)))

    @torch.no_grad()
    def _apply_process_advantages(self, output, outcome_rewards: torch.Tensor | None):
        """``output["advantages"]`` <- A_outcome (B, 1) + A_process (B, T) for this process's rows."""
        from grpo_variants.losses import get_advantage_estimator, outcome_plus_process, step_credit
        from grpo_variants.losses import normalize_step_rewards

        mode = "train" if self.model.training else "eval"
        group = self.num_generations if mode == "train" else self.num_generations_eval
        estimator_name = self.args.resolved_advantage_estimator
        completion_ids = output["completion_ids"]
        local, width = completion_ids.shape
        start = self.accelerator.process_index * local
        device = completion_ids.device
        if outcome_rewards is not None:
            outcome = torch.nan_to_num(get_advantage_estimator(estimator_name)(outcome_rewards, group), nan=0.0)
            outcome = outcome[start : start + local].to(device)
        else:
            outcome = torch.zeros(local, device=device)
        process = torch.zeros(local, width, device=device)
        weights = self.reward_weights.tolist()
        steps_per_row = []
        for k, func_index in enumerate(self._step_func_indices):
            rows = self._global_step_rows(self._last_step_rows[k])
            most = max((len(s) for _, s in rows), default=0)
            scores = torch.full((len(rows), max(most, 1)), float("nan"))
            tokens = torch.zeros((len(rows), max(most, 1)), dtype=torch.long)
            for r, (idx, s) in enumerate(rows):
                if s:
                    scores[r, : len(s)] = torch.tensor(s, dtype=torch.float32)
                    tokens[r, : len(idx)] = torch.tensor(idx, dtype=torch.long)
            normalised = normalize_step_rewards(scores, group, estimator_name)
            mine = slice(start, start + local)
            credit = step_credit(normalised[mine], tokens[mine], width, self.args.process_credit)
            process += weights[func_index] * credit.to(device)
            steps_per_row.append(float((~torch.isnan(scores)).sum()) / max(len(rows), 1))
        output["advantages"] = outcome_plus_process(outcome, process).to(torch.float32)
        self._metrics[mode]["process/steps_per_completion"].append(sum(steps_per_row) / len(steps_per_row))
        mask = output["completion_mask"].float()
        signal = ((output["advantages"] != 0).float() * mask).sum() / mask.sum().clamp(min=1.0)
        self._metrics[mode]["process/nonzero_advantage_fraction"].append(signal.item())
        self._log_zero_signal_rows(output, mode)
        return output

    def _log_zero_signal_rows(self, output, mode: str) -> None:
        """TRL's ``frac_reward_zero_std`` means the share of rows that get no learning signal; with step rewards that
        is the share of rows whose token advantages are all zero on their generated tokens (TRL's value, the std of
        one number per completion, counts a group with equal means but different step scores as zero-std)."""
        logged = self._metrics[mode].get("frac_reward_zero_std")
        if not logged:
            return
        generated = output.get("generated_mask", output["completion_mask"])
        silent = ~((output["advantages"] != 0) & (generated > 0)).any(dim=1)
        if self.accelerator.num_processes > 1:
            silent = self.accelerator.gather(silent.float().contiguous())
        logged[-1] = silent.float().mean().item()

    def outcome_rewards(self) -> torch.Tensor | None:
        """Weighted sum of the last rollout's outcome (non-step) rewards, global batch; None without any."""
        per_func = self._last_rewards_per_func
        outcome = [i for i in range(per_func.size(1)) if i not in self._step_func_indices]
        if not outcome:
            return None
        values = per_func[:, outcome]
        weights = self.reward_weights.to(per_func.device)[outcome].unsqueeze(0)
        rewards = (values * weights).nansum(dim=1)
        rewards[torch.isnan(values).all(dim=1)] = torch.nan
        return rewards

    def token_signal_groups(self, output) -> torch.Tensor:
        """Dynamic sampling's zero-signal test on token advantages: one bool per group (global, CPU)."""
        from grpo_variants.losses import has_token_signal

        adv = output["advantages"]
        adv = adv if adv.dim() == 2 else adv.unsqueeze(1)
        row = ((adv != 0) & (output["completion_mask"] > 0)).any(dim=1).float()
        if self.accelerator.num_processes > 1:
            row = self.accelerator.gather(row.contiguous())
        return has_token_signal(row.cpu(), torch.ones(row.numel(), 1), self.num_generations)


class _AdaptiveKLCallback(TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._adaptive_kl_step()


class AdaptiveKLMixin:
    """``kl_target``: beta adapted after every optimizer step (see the module docstring)."""

    def _init_adaptive_kl(self, args) -> None:
        self._kl_beta = float(args.beta)
        self._kl_acc = [0.0, 0.0, 0.0]  # KL sum over tokens, tokens, sequences since the last update (local)

    def _install_adaptive_kl(self) -> None:
        if self.args.kl_target is not None:
            if self.loss_spec is None:  # the config refuses this already; kept for subclasses that drop the spec
                raise ConfigError("kl_target needs a composed loss (grpo, bnpo, dr_grpo, dapo or a variant).")
            self.add_callback(_AdaptiveKLCallback(self))
            args = self.args
            n = args.per_device_train_batch_size * args.gradient_accumulation_steps * self.accelerator.num_processes
            if 0.2 * n / args.kl_horizon > 0.5:
                logger.warning(
                    "kl_target: %d sequences per step with kl_horizon=%g let beta change by up to %.0f%% in one step "
                    "(0.2 x n / H); the first on-policy steps (KL ~0 < target) can collapse it toward kl_beta_min. "
                    "Use kl_horizon >= %d for at most 50%%.", n, args.kl_horizon, 100 * 0.2 * n / args.kl_horizon,
                    int(0.4 * n) + 1,
                )
            if args.kl_beta_min < args.beta:
                logger.warning(
                    "kl_target: beta may fall from its start %g toward kl_beta_min=%g while the measured KL is below "
                    "the target, as it is in the first on-policy steps (KL ~0); kl_beta_min=%g keeps the start as a "
                    "floor (docs/algorithms.md, 'Adaptive KL coefficient').", args.beta, args.kl_beta_min, args.beta,
                )

    @property
    def kl_beta(self) -> float:
        """The KL coefficient in force (``beta``, or the adaptive one with ``kl_target``)."""
        return self._kl_beta if self.args.kl_target is not None else float(self.args.beta)

    def _note_kl(self, kl: torch.Tensor, mask: torch.Tensor) -> None:
        """Accumulate the KL per token measured in this step (local rows)."""
        if self.args.kl_target is None or not self.model.training:
            return
        m = mask.float()
        self._kl_acc[0] += float((kl.detach().float() * m).sum())
        self._kl_acc[1] += float(m.sum())
        self._kl_acc[2] += float(kl.size(0))

    def _adaptive_kl_step(self) -> None:
        from grpo_variants.losses import adaptive_kl_beta

        args = self.args
        acc = torch.tensor(self._kl_acc, dtype=torch.float64, device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            acc = self.accelerator.reduce(acc, reduction="sum")
        kl_sum, tokens, samples = acc.tolist()
        self._kl_acc = [0.0, 0.0, 0.0]
        metrics = self._metrics["train"]
        metrics["kl_ctl/beta"].append(self._kl_beta)
        if samples <= 0 or tokens <= 0:  # no KL measured in this step (kl_in_reward between rollouts)
            return
        kl = kl_sum / tokens
        metrics["kl_ctl/kl"].append(kl)
        self._kl_beta = adaptive_kl_beta(self._kl_beta, kl, args.kl_target, int(samples), args.kl_horizon,
                                         beta_min=args.kl_beta_min, beta_max=args.kl_beta_max)

    def _adaptive_kl_state(self) -> dict:
        return {"kl_beta": self._kl_beta, "kl_acc": list(self._kl_acc)}

    def _load_adaptive_kl_state(self, state: dict) -> None:
        self._kl_beta = float(state.get("kl_beta", self.args.beta))
        self._kl_acc = [float(v) for v in state.get("kl_acc", (0.0, 0.0, 0.0))]
