"""What the trainers log beyond TRL's metrics: loss-side fractions, useful tokens, reward health, rollout timings.

:class:`TrainerMetrics` is a mixin of :class:`~grpo_variants.GRPOVariantTrainer` (it reads the
trainer's ``accelerator``, ``_metrics`` and counters). Every value is reduced over all processes, so
each rank logs the same number. Variants add their own metrics by overriding ``_log_loss_metrics``
and calling ``super()`` first (GSPO's sequence clip fractions, FIPO's drop fraction, µ-GRPO's
staleness).

Per micro-batch (``_log_loss_metrics``): ``entropy``, ``clip_ratio/{low,high,dual,region}_mean``,
``kl``, ``veto/{trigger_fraction,fraction}``, ``fipo/weight_{mean,max}``, and in training
``useful_token_fraction`` (tokens whose policy gradient is non-zero over every token generated for the
update, dropped groups and drafts included) with the running token totals, and the token ledger
(:meth:`TrainerMetrics.token_ledger`: ``token_fate/<fate>``, cumulative fractions of generated tokens, and
``tokens/signal_fraction``, generated tokens that reached an update with non-zero advantage). Per rollout
(``_on_rollout_done``): ``time/{generation,reward,logprobs,rollout}_s``,
``throughput/generated_tokens_per_s``, ``tokens/{generated,kept_fraction}`` (training rollouts only: an
evaluation's rollouts add no seconds to these; kept_fraction is the share of this rollout's generated tokens
that is trained, now or as groups carried to the next batch), ``rollout/zero_signal`` (1 when every group of
the rollout had zero reward variance: no policy gradient; warned once). Per reward call
(``_log_reward_health``): ``rewards/<name>/{error_rate,timeout_rate,nan_rate,cache_hit_rate,time_s}``, and for
an accuracy reward ``rewards/<name>/right_fraction`` (the training accuracy: the share it scored above 0).
"""

from __future__ import annotations

import torch

__all__ = ["TOKEN_FATES", "TrainerMetrics"]

# Where every generated token goes (the token ledger, cumulative over the run; see TrainerMetrics.token_ledger).
# Before the loss: dropped by the dynamic-sampling filter, qualifying but cut (surplus "discard"). At the loss
# (each micro-batch, first match wins): outside the loss mask although generated (truncated completions under
# overlong filtering, tool output), zero advantage, clipped low / high / dual (non-zero advantage, no gradient
# from the trust region), no gradient for another reason (ratio cap, veto, FIPO drop, TRL's token masks), useful.
TOKEN_FATES = (
    "dropped_by_filter",
    "surplus_cut",
    "masked",
    "zero_advantage",
    "clipped_dual",
    "clipped_low",
    "clipped_high",
    "no_gradient_other",
    "useful",
)


class TrainerMetrics:
    """The metric logging of :class:`~grpo_variants.GRPOVariantTrainer` (a mixin; see the module docstring)."""

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

    def _log_lengths_by_outcome(self, completion_ids_list) -> None:
        """``completions/mean_length_right`` / ``_wrong`` / ``right_fraction``, right as the accuracy reward says,
        and ``rewards/<name>/right_fraction`` per accuracy reward (grpo_variants.mechanisms)."""
        from grpo_variants.mechanisms import accuracy_reward_indices, lengths_by_outcome, outcome_rewards, right_fraction

        mode = "train" if self.model.training else "eval"
        names = list(getattr(self, "reward_func_names", None) or [])
        per_func = getattr(self, "_last_rewards_per_func", None)
        if per_func is not None and names:
            for i in accuracy_reward_indices(names):
                value = right_fraction(per_func[:, i])
                if value == value:
                    self._metrics[mode][f"rewards/{names[i]}/right_fraction"].append(value)
        outcome = outcome_rewards(per_func, names, self.weighted_rewards())
        if outcome is None:
            return
        lengths = torch.tensor([float(len(ids)) for ids in completion_ids_list], device=self.accelerator.device)
        lengths = self.accelerator.gather(lengths)
        for key, value in lengths_by_outcome(lengths, outcome).items():
            if value == value:  # not NaN: a batch with no right (or no wrong) completion logs nothing for it
                self._metrics[mode][f"completions/{key}"].append(value)

    def _on_rollout_done(self) -> None:
        """Bookkeeping after each training rollout: counters, kept fraction, phase timings."""
        # Kept tokens are credited to the rollout that generated them: this buffer's own rows (not the groups carried
        # in from the previous rollout) plus the surplus this rollout carries out to the next one.
        def own(batch):
            mask = batch["generated_mask"]
            carried = batch.get("carried_rows")
            return mask.sum() if carried is None else (mask * (1 - carried.to(mask.device).view(-1, 1))).sum()

        local = torch.tensor([[float(own(b)), float(b["generated_mask"].sum())] for b in self._buffered_inputs])
        kept, trained = self.accelerator.gather(local.sum(0, keepdim=True).to(self.accelerator.device)).sum(0).tolist()
        carried_out = getattr(self, "_ds_carried", None)
        if carried_out is not None and "generated_mask" in carried_out:
            kept += float(carried_out["generated_mask"].sum())
        generated = max(self._tokens_generated_round, 1)
        self._kept_fraction = min(kept / generated, 1.0)
        # trained tokens of this buffer (carried-in rows included) per token generated this round: the factor that
        # turns the useful share of trained tokens into useful tokens per generated token (useful_token_fraction)
        self._trained_per_generated = trained / generated
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

    def token_ledger(self) -> dict:
        """Where the run's generated tokens went: counts per fate (:data:`TOKEN_FATES`) and fractions of generated.

        ``carried_pending``: tokens of qualifying groups carried to the next batch and not trained yet (at the end
        of a run: generated, never used). ``unaccounted``: the rest (generated, not yet trained: a rollout still in
        the buffer). ``signal``: tokens that reached an update in the loss mask with non-zero advantage (useful +
        clipped + no gradient for another reason), i.e. before the trust region acts. Counts are global (every
        process); a micro-batch visited twice (``num_iterations`` > 1, µ-GRPO's repeated stages) counts twice.
        ``carried_rows``: of the signal tokens, those of groups carried from the previous batch (sampled by an older
        policy) and how many of them were clipped (dynamic sampling with ``"carry"`` only).
        """
        counts = {name: self._token_ledger[name] for name in TOKEN_FATES}
        carried = getattr(self, "_ds_carried", None)
        counts["carried_pending"] = int(carried["generated_mask"].sum().item()) if carried is not None else 0
        generated = int(self._tokens_generated_total)
        counts["unaccounted"] = generated - sum(counts.values())
        counts["signal"] = counts["useful"] + counts["clipped_dual"] + counts["clipped_low"] \
            + counts["clipped_high"] + counts["no_gradient_other"]
        fractions = {k: v / max(generated, 1) for k, v in counts.items()}
        carried_rows = {k: self._token_ledger.get(f"carried_{k}", 0) for k in ("signal", "clipped")}
        return {"generated": generated, "tokens": counts, "fractions": fractions, "carried_rows": carried_rows}

    def _count_token_fates(self, stats, mask, inputs) -> None:
        """Add one training micro-batch's tokens to the ledger (reduced over processes)."""
        from grpo_variants.losses import as_token_advantages

        trained = mask > 0
        generated = inputs.get("generated_mask", mask).float()
        adv = as_token_advantages(inputs["advantages"]).expand(mask.shape)
        zero = trained & (adv == 0)
        signal = trained & ~zero
        remaining = signal
        counts = [generated.sum() - trained.float().sum(), zero.float().sum()]
        for key in ("is_dual_clipped", "is_low_clipped", "is_high_clipped"):
            flagged = stats[key].expand(mask.shape) & remaining if key in stats else torch.zeros_like(remaining)
            counts.append(flagged.float().sum())
            remaining = remaining & ~flagged
        useful = stats["useful"].expand(mask.shape) & trained
        counts.append((remaining & ~useful).float().sum())
        counts.append(useful.float().sum())
        names = list(TOKEN_FATES[2:])
        if "carried_rows" in inputs:  # rows of groups carried from the previous batch (dynamic sampling)
            rows = inputs["carried_rows"].bool().view(-1, 1).expand(mask.shape)
            clipped = signal & ~remaining
            counts += [(signal & rows).float().sum(), (clipped & rows).float().sum()]
            names += ["carried_signal", "carried_clipped"]
        totals = self.accelerator.reduce(torch.stack(counts).to(self.accelerator.device), reduction="sum")
        for name, value in zip(names, totals.tolist(), strict=True):
            self._token_ledger[name] = self._token_ledger.get(name, 0) + int(round(value))

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
            # TRL's extremes over sequences: the least low-clipped and the most high-clipped sequence (NaN-aware)
            from trl.trainer.utils import nanmax, nanmin

            def seq_mean(x):
                x = x.float()
                return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

            metrics["clip_ratio/low_min"].append(
                nanmin(self.accelerator.gather(seq_mean(stats["is_low_clipped"]))).item())
            metrics["clip_ratio/high_max"].append(
                nanmax(self.accelerator.gather(seq_mean(stats["is_high_clipped"]))).item())
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
            factor = getattr(self, "_trained_per_generated", self._kept_fraction)
            metrics["useful_token_fraction"].append(useful / max(produced, 1.0) * factor)
            self._count_token_fates(stats, mask, inputs)
            generated_total = max(self._tokens_generated_total, 1)
            ledger = self._token_ledger
            signal = sum(ledger[k] for k in ("useful", "clipped_dual", "clipped_low", "clipped_high",
                                             "no_gradient_other"))
            metrics["tokens/signal_fraction"].append(signal / generated_total)
            for name in TOKEN_FATES:
                metrics[f"token_fate/{name}"].append(ledger[name] / generated_total)
            metrics["tokens/useful_total"].append(float(self._tokens_useful_total))
            metrics["tokens/generated_total"].append(float(self._tokens_generated_total))
            metrics["generation_rounds_total"].append(float(self._generation_rounds_total))
