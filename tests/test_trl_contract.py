"""The TRL contract: TRL's input checks, metric names, hook inputs and loss types, kept or refused.

What TRL 1.16's own GRPO test suite (``tests/trl_compat``) found different, each pinned here on the toy kit
in seconds: an ``environment_factory`` may own the data and the reward (TRL's checks decide, with TRL's
messages); ``policy_loss`` / ``entropy_coef`` / ``clip_ratio/low_min`` / ``clip_ratio/high_max`` are logged on
our loss path; ``training_step`` receives TRL's list of row dicts; ``_generate`` runs on a trainer built with
``object.__new__`` (TRL's rollout-dispatch tests). And every TRL ``loss_type`` is trained exactly or refused.
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest
import torch

from grpo_variants import GRPOVariantConfig, GRPOVariantTrainer
from grpo_variants.config import TRL_LOSS_TYPE_TO_AGGREGATION, TRL_LOSS_TYPES
from grpo_variants.errors import ConfigError, DatasetError
from grpo_variants.registry import _VARIANTS, get_variant
from grpo_variants.variants.dapo import DAPOConfig

from conftest import position_reward


# ---- TRL's input checks ------------------------------------------------------------------------------
def test_missing_reward_and_dataset_use_trls_words(toy_model_path, small_train_dataset, make_args):
    args = make_args(max_steps=1)
    with pytest.raises(ConfigError, match="No reward source provided. Pass `reward_funcs`"):
        GRPOVariantTrainer(model=toy_model_path, reward_funcs=None, args=args, train_dataset=small_train_dataset)
    with pytest.raises(DatasetError, match="`train_dataset` is required unless an `environment_factory` is provided"):
        GRPOVariantTrainer(model=toy_model_path, reward_funcs=position_reward, args=args, train_dataset=None)


class _Env:
    def reset(self, **kwargs):
        return "What is 1 + 1?"

    def add(self, a: int, b: int) -> int:
        """Adds two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return a + b

    def get_reward(self):
        return 1.0


@pytest.mark.parametrize("dataset", ["none", "environment_column"])
def test_environment_factory_defers_to_trls_checks(toy_model_path, small_train_dataset, make_args, dataset,
                                                   monkeypatch):
    """With an environment, no dataset / no prompt column / no reward_funcs are TRL's to judge: our checks let it
    through and TRL's own next check speaks (here the toy tokenizer's chat template, which has no tool calling)."""
    import trl.trainer.grpo_trainer as trl_grpo

    seen = {}

    def supports(processing_class):
        seen["reached"] = True
        return False

    monkeypatch.setattr(trl_grpo, "supports_tool_calling", supports)
    from datasets import Dataset

    train = None if dataset == "none" else Dataset.from_dict({"environment": ["e"] * 8})
    with pytest.raises(ValueError, match="does not support tool calling"):
        GRPOVariantTrainer(model=toy_model_path, reward_funcs=None, args=make_args(max_steps=1), train_dataset=train,
                           environment_factory=_Env)
    assert seen == {"reached": True}


# ---- TRL's metric names on our loss path -----------------------------------------------------------------
def test_entropy_bonus_and_clip_extremes_are_logged(toy_model_path, small_train_dataset, make_args):
    args = make_args(max_steps=1, entropy_coef=0.5, logging_steps=1, steps_per_generation=1, reward_cache=False)
    trainer = GRPOVariantTrainer(model=toy_model_path, reward_funcs=position_reward, args=args,
                                 train_dataset=small_train_dataset)
    assert trainer.loss_spec is not None  # our composed loss, not TRL's
    trainer.train()
    record = next(r for r in trainer.state.log_history if "policy_loss" in r)
    assert record["entropy_coef"] == 0.5
    assert torch.isfinite(torch.tensor(record["policy_loss"]))
    # one micro-batch per log: the least-clipped sequence is below the token mean, the most-clipped above it
    assert record["clip_ratio/low_min"] <= record["clip_ratio/low_mean"] + 1e-9
    assert record["clip_ratio/high_max"] >= record["clip_ratio/high_mean"] - 1e-9


# ---- training_step sees TRL's list of row dicts -----------------------------------------------------------
def test_training_step_receives_a_list_of_row_dicts(toy_model_path, small_train_dataset, make_args):
    seen = []

    class Overrider(GRPOVariantTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            seen.append(inputs)
            return super().training_step(model, inputs, num_items_in_batch)

    args = make_args(max_steps=2, steps_per_generation=2)
    trainer = Overrider(model=toy_model_path, reward_funcs=position_reward, args=args,
                        train_dataset=small_train_dataset)
    trainer.train()
    assert len(seen) == 2
    for inputs in seen:
        assert isinstance(inputs, list) and len(inputs) == 32  # the whole generation batch, as TRL's loader yields
        assert all(isinstance(row, dict) and "prompt" in row for row in inputs)
        assert inputs == [dict(row) for row in inputs] and list(inputs) == inputs


# ---- _generate without our constructor (TRL's rollout-dispatch tests) ---------------------------------------
def test_generate_runs_on_a_trainer_built_without_init():
    trainer = object.__new__(GRPOVariantTrainer)
    trainer.accelerator = SimpleNamespace(device=torch.device("cpu"), is_main_process=True, gather=lambda t: t)
    trainer.args = SimpleNamespace(report_to=[])
    trainer.model = SimpleNamespace(training=True)
    trainer.state = SimpleNamespace(global_step=2, num_input_tokens_seen=0)
    trainer._last_loaded_step = 1
    trainer.use_vllm = False
    trainer.use_transformers_continuous_batching = False
    trainer.processing_class = SimpleNamespace(batch_decode=MagicMock(return_value=["decoded"]))
    trainer._tokenizer = SimpleNamespace(eos_token_id=2, pad_token_id=0)
    trainer.eos_token_ids = [2]  # TRL 1.16's _generate reads it (the newest TRL test does not set it)
    trainer.tools = None
    from collections import defaultdict

    trainer._metrics = {"train": defaultdict(list)}
    trainer.rollout_func = MagicMock(return_value={"prompt_ids": [[1]], "completion_ids": [[2]], "logprobs": [[-0.1]]})
    result = trainer._generate(["prompt"])
    assert result[0] == [[1]] and result[1] == [[2]]
    trainer.rollout_func.assert_called_once()
    assert trainer._tokens_generated_round == 1 and trainer._phase_time["generation"] >= 0.0


# ---- every TRL loss type: exact or refused ------------------------------------------------------------------
@pytest.mark.parametrize("loss_type", TRL_LOSS_TYPES)
def test_dapo_config_loss_types_are_exact_or_refused(loss_type, tmp_path):
    kwargs = dict(output_dir=str(tmp_path), report_to="none", loss_type=loss_type)
    if loss_type in DAPOConfig.composable_loss_types():
        args = DAPOConfig(**kwargs)
        assert args.resolved_aggregation == TRL_LOSS_TYPE_TO_AGGREGATION[loss_type]
        return
    with pytest.raises(ConfigError, match=f"loss_type={loss_type!r}") as err:
        DAPOConfig(**kwargs)
    assert "DAPOConfig" in str(err.value) or "variant 'dapo'" in str(err.value)


@pytest.mark.parametrize("name", sorted(_VARIANTS))
def test_every_variant_states_the_loss_types_it_composes(name, tmp_path):
    cls = get_variant(name).config_cls
    composes = cls.composable_loss_types()
    assert composes and set(composes) <= set(TRL_LOSS_TYPES)
    for loss_type in TRL_LOSS_TYPES:
        kwargs = dict(output_dir=str(tmp_path), report_to="none", loss_type=loss_type)
        if name == "mu_grpo":
            kwargs.update(stage_prompts=8, updates_per_stage=4, per_device_train_batch_size=8, num_generations=4)
        if loss_type in composes:
            cls(**kwargs)
        else:
            with pytest.raises(ConfigError, match="loss_type"):
                cls(**kwargs)


def test_base_config_runs_every_trl_loss_type_and_refuses_a_composed_aggregation_on_trls(tmp_path):
    assert GRPOVariantConfig.composable_loss_types() == TRL_LOSS_TYPES
    for loss_type in TRL_LOSS_TYPES:
        args = GRPOVariantConfig(output_dir=str(tmp_path), report_to="none", loss_type=loss_type)
        assert args.resolved_aggregation == TRL_LOSS_TYPE_TO_AGGREGATION.get(loss_type)  # None: TRL's own loss
        if loss_type not in TRL_LOSS_TYPE_TO_AGGREGATION:
            with pytest.raises(ConfigError, match="does not compose"):
                GRPOVariantConfig(output_dir=str(tmp_path), report_to="none", loss_type=loss_type,
                                  aggregation="token_mean")
    with pytest.raises(ConfigError, match="not a TRL 1.16 loss type"):
        GRPOVariantConfig(output_dir=str(tmp_path), report_to="none", loss_type="ppo")


def test_token_mean_with_an_update_across_two_rollouts(tmp_path):
    common = dict(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=8,
                  steps_per_generation=3, gradient_accumulation_steps=2)
    with pytest.raises(ConfigError, match="straddle two rollouts"):
        DAPOConfig(**common, num_generations=4)
    with pytest.raises(ConfigError, match="straddle two rollouts"):
        GRPOVariantConfig(**common, aggregation="token_mean")
    args = GRPOVariantConfig(**common, loss_type="dapo")  # TRL's rollout-average normaliser, announced
    (note,) = args.loss_composition_notes()
    assert "straddles two rollouts" in note and "rollout-average" in note


# ---- TRL features that meet our components ------------------------------------------------------------------
def test_off_policy_mask_in_a_stage_is_taken_against_each_rows_generation_logprobs(toy_model_path, small_train_dataset,
                                                                                  make_args):
    """The rule (docs/trl-users.md): TRL's off-policy mask compares the current policy with the log-probs the row
    was sampled with (vLLM's when it gave them, else the behaviour log-probs stored at generation), so a stage row
    or a carried group is judged on its whole drift since it was generated, not since the last update."""
    args = make_args(GRPOVariantConfig, max_steps=4, off_policy_mask_threshold=0.5, stage_prompts=8,
                     updates_per_stage=4, reward_cache=False)
    trainer = GRPOVariantTrainer(model=toy_model_path, reward_funcs=position_reward, args=args,
                                 train_dataset=small_train_dataset)
    seen, at_loss = [], []
    mask_fn, compute_loss = trainer.get_off_policy_mask, trainer._compute_loss

    def get_off_policy_mask(advantages, per_token_logps, sampling_logps, mask, threshold):
        seen.append((per_token_logps.detach().clone(), sampling_logps))
        return mask_fn(advantages, per_token_logps, sampling_logps, mask, threshold)

    def _compute_loss(model, inputs):
        at_loss.append(inputs["old_per_token_logps"])
        return compute_loss(model, inputs)

    trainer.get_off_policy_mask, trainer._compute_loss = get_off_policy_mask, _compute_loss
    trainer.train()
    assert len(seen) == len(at_loss) == 4  # one stage, µ = 4 updates
    for (_, sampling), old in zip(seen, at_loss, strict=True):
        assert sampling is old  # the row's stored generation-time log-probs
    current, sampling = seen[-1]
    assert (current - sampling).abs().max() > 0  # after 3 updates the policy has drifted from the stored ones


class _FakeVLLMRatio:
    """What TRL's vLLM rollout adds to a rollout, faked on CPU: ``importance_sampling_ratio``.

    With ``use_vllm`` TRL's rollout compares its behaviour log-probs with vLLM's sampling log-probs and returns
    the ratio per token ((B, T), ``token_*`` modes) or per sequence ((B, 1), ``sequence_*`` modes, the default
    ``sequence_mask`` zeroing rows outside its bounds). Here every rollout call gets drawn ratios instead (far
    from 1, some zeros, distinct per row), recorded with the rows they belong to. vLLM is not installed, so the
    trainer generates without it and ``use_vllm`` is switched on around the loss only (TRL's loss and ours read
    it there to apply the ratio). At every loss call the recorder keeps the inputs, our loss, TRL's own
    ``_compute_loss`` on the same inputs, and our loss with the ratio replaced by ones.
    """

    def __init__(self, trainer, shape: str = "sequence", old_shift: float | None = None):
        self.generator = torch.Generator().manual_seed(0)
        self.generated = []  # per rollout call: its rows (prompt, completion, ratio), on CPU
        self.at_loss = []
        rollout, compute_loss = trainer._scored_rollout, trainer._compute_loss

        def _scored_rollout(inputs):
            output = rollout(inputs)
            ids = output["completion_ids"]
            width = ids.size(1) if shape == "token" else 1
            ratio = 0.25 + 1.5 * torch.rand(ids.size(0), width, generator=self.generator)
            ratio[::5] = 0.0  # what the *_mask modes do to rows outside [clip_min, clip_max]
            output["importance_sampling_ratio"] = ratio.to(ids.device)
            self.generated.append({k: output[k].detach().cpu().clone() for k in (
                "prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "importance_sampling_ratio")})
            return output

        def _compute_loss(model, inputs):
            from trl import GRPOTrainer

            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
            with torch.no_grad():
                width = inputs["completion_ids"].size(1)
                logps = trainer._get_per_token_logps_and_entropies(model, ids, attention, width)[0]
            if old_shift is not None:  # behaviour log-probs off the current policy, so that the clip bites
                pattern = torch.linspace(-old_shift, old_shift, logps.size(1), device=logps.device)
                inputs = {**inputs, "old_per_token_logps": logps + pattern}
            trainer.use_vllm = True
            try:
                ours = compute_loss(model, inputs)
                with torch.no_grad():
                    trl = GRPOTrainer._compute_loss(trainer, model, inputs)
                    ones = compute_loss(model, {**inputs, "importance_sampling_ratio": torch.ones_like(
                        inputs["importance_sampling_ratio"])})
            finally:
                trainer.use_vllm = False
            self.at_loss.append(dict(inputs={k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                                             for k, v in inputs.items()},
                                     logps=logps.cpu(), ours=ours.item(), trl=trl.item(), ones=ones.item(),
                                     step=trainer.state.global_step))
            return ours

        trainer._scored_rollout, trainer._compute_loss = _scored_rollout, _compute_loss

    def generation_of(self, inputs, row):
        """(call index, row) of the generated row that row ``row`` of ``inputs`` is: same prompt, same completion,
        same ratio (exactly one; the drawn ratios are distinct but for the zeros, which fall in distinct groups)."""
        key = self._key(inputs, row)
        found = [(call, r) for call, gen in enumerate(self.generated) for r in range(gen["completion_ids"].size(0))
                 if self._key(gen, r) == key]
        assert len(found) == 1, found
        return found[0]

    @staticmethod
    def _key(batch, row):
        prompt = batch["prompt_ids"][row][batch["prompt_mask"][row].bool()]
        completion = batch["completion_ids"][row][batch["completion_mask"][row].bool()]
        ratio = batch["importance_sampling_ratio"][row]
        return tuple(prompt.tolist()), tuple(completion.tolist()), tuple(ratio.tolist())


def _three_of_four_groups_vary(prompts, completions, **kwargs):
    """Groups 0-2 of every 16-row call alternate 0/1 (qualify); group 3 is constant (dropped)."""
    return [0.0 if i % 16 >= 12 else float(i % 2) for i in range(len(completions))]


def _hand_loss(trainer, call, beta=0.0):
    """The loss of a recorded call by hand: TRL's clipped token term weighted by the IS ratio, + beta * k3 KL
    (not weighted), aggregated as the trainer's loss (TRL's grpo: per-sequence token mean; µ-GRPO's stage:
    token mean over the update's tokens)."""
    inputs, logp = call["inputs"], call["logps"]
    ratio, mask = inputs["importance_sampling_ratio"], inputs["completion_mask"].float()
    old, adv = inputs.get("old_per_token_logps", logp), inputs["advantages"].unsqueeze(1)  # none: on-policy
    r = torch.exp(logp - old)
    low, high = 1 - trainer.epsilon_low, 1 + trainer.epsilon_high
    per_token = -torch.min(r * adv, r.clamp(low, high) * adv) * ratio
    if beta:
        ref = inputs["ref_per_token_logps"]
        per_token = per_token + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    aggregation = trainer.loss_spec.aggregation
    if aggregation == "seq_mean_token_mean":
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
        return (loss / trainer.current_gradient_accumulation_steps).item(), ((r < low) | (r > high))[mask.bool()]
    assert aggregation == "token_mean"
    loss = (per_token * mask).sum() / inputs["num_items_in_update"].clamp(min=1)
    return loss.item(), ((r < low) | (r > high))[mask.bool()]


@pytest.mark.parametrize("shape", ["token", "sequence"])
@pytest.mark.parametrize("loss_type,beta", [("grpo", 0.0), ("grpo", 0.04), ("dapo", 0.0)])
def test_vllm_importance_sampling_ratio_weights_each_token_of_our_loss_as_in_trl(
        loss_type, beta, shape, toy_model_path, small_train_dataset, make_args):
    """The rule (docs/trl-users.md): with ``vllm_importance_sampling_correction``, TRL's
    ``importance_sampling_ratio`` multiplies each token's policy term (after the clip, before the KL term), in
    our loss exactly as in TRL's."""
    args = make_args(max_steps=1, loss_type=loss_type, beta=beta, reward_cache=False)
    trainer = GRPOVariantTrainer(model=toy_model_path, reward_funcs=position_reward, args=args,
                                 train_dataset=small_train_dataset)
    assert trainer.loss_spec is not None  # our loss, not TRL's
    fake = _FakeVLLMRatio(trainer, shape=shape, old_shift=0.4)
    trainer.train()
    (call,) = fake.at_loss
    inputs, logp = call["inputs"], call["logps"]
    ratio, mask = inputs["importance_sampling_ratio"], inputs["completion_mask"].float()
    assert ratio.shape[1] == (1 if shape == "sequence" else mask.size(1))
    assert ratio.min() == 0.0 and ratio.max() > 1.2  # far from a ratio of 1 everywhere
    assert call["ours"] == pytest.approx(call["trl"], rel=1e-5, abs=1e-6)  # TRL 1.16's own loss agrees
    assert abs(call["ours"] - call["ones"]) > 1e-3  # the ratio changes the loss
    if loss_type == "grpo":  # by hand: the ratio as a per-token weight of the clipped policy term
        hand, clipped = _hand_loss(trainer, call, beta)
        assert clipped.any()  # the clip bites on some tokens
        assert call["ours"] == pytest.approx(hand, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("loop", ["stage", "carry"])
def test_vllm_importance_sampling_ratio_of_a_stage_or_carried_row_is_the_one_of_its_generation(
        loop, toy_model_path, small_train_dataset, make_args):
    """The rule (docs/trl-users.md): a µ-GRPO / stage row and a group carried by dynamic sampling keep the
    ``importance_sampling_ratio`` of their generating rollout: every row at the loss carries the ratio drawn for
    it at its generation (looked up by its prompt, completion and that ratio), also at its later updates, and
    weights its tokens in our loss (by hand; and as TRL's own loss where the aggregation is TRL's grpo)."""
    if loop == "stage":  # one stage of 8 prompts x 4, µ = 4 updates of 16 rows: every row is trained twice
        args = make_args(max_steps=4, stage_prompts=8, updates_per_stage=4, reward_cache=False)
        reward = position_reward
    else:  # 3 of 4 groups qualify per round, whole-batch top-ups: the first batch carries 2 groups into the next
        args = make_args(max_steps=2, dynamic_sampling=True, dynamic_sampling_topup="full", reward_cache=False)
        reward = _three_of_four_groups_vary  # as in test_dapo.py
    trainer = GRPOVariantTrainer(model=toy_model_path, reward_funcs=reward, args=args,
                                 train_dataset=small_train_dataset)
    fake = _FakeVLLMRatio(trainer, shape="sequence")
    trainer.train()
    seen = {}  # generated row -> the steps it was trained at
    older = 0  # rows trained at a later step than the one that generated them
    for call in fake.at_loss:
        inputs = call["inputs"]
        assert call["ours"] == pytest.approx(_hand_loss(trainer, call)[0], rel=1e-5, abs=1e-6)
        if trainer.loss_spec.aggregation == "seq_mean_token_mean":  # TRL's grpo (a stage uses the token mean)
            assert call["ours"] == pytest.approx(call["trl"], rel=1e-5, abs=1e-6)
        assert abs(call["ours"] - call["ones"]) > 1e-4
        for row in range(inputs["completion_ids"].size(0)):
            seen.setdefault(fake.generation_of(inputs, row), []).append(call["step"])
    if loop == "stage":
        assert len(fake.generated) == 1 and len(fake.at_loss) == 4
        assert len(seen) == 32 and all(len(steps) == 2 for steps in seen.values())  # 2 passes over the stage
        older = sum(steps[1] > 0 for steps in seen.values())
    else:
        assert len(fake.generated) == 3 and len(fake.at_loss) == 2  # rollout calls: step 1 rounds 1-2, step 2
        carried = [c["inputs"]["carried_rows"] for c in fake.at_loss]
        assert [int(c.sum()) for c in carried] == [0, 8]
        # the carried rows (TRL may have shuffled them) were generated by the first step's second round
        second = fake.at_loss[1]["inputs"]
        for row in carried[1].nonzero().flatten().tolist():
            assert fake.generation_of(second, row)[0] == 1
            older += 1
    assert older > 0


@pytest.mark.parametrize("feature", ["tools", "rollout_func"])
@pytest.mark.parametrize("loop", [dict(dynamic_sampling=True), dict(stage_prompts=8, updates_per_stage=4)])
def test_custom_rollouts_with_our_rollout_loops_are_refused(feature, loop, toy_model_path, small_train_dataset,
                                                            make_args):
    def multiply(a: int, b: int) -> int:
        """Multiplies.

        Args:
            a: first.
            b: second.
        """
        return a * b

    value = [multiply] if feature == "tools" else (lambda prompts, trainer: None)
    with pytest.raises(ConfigError, match=f"{feature} with .*supported with TRL's rollout only"):
        GRPOVariantTrainer(model=toy_model_path, reward_funcs=position_reward, args=make_args(**loop),
                           train_dataset=small_train_dataset, **{feature: value})


def test_async_reward_trains_with_its_values(toy_model_path, small_train_dataset, make_args):
    import asyncio

    calls = []

    async def async_position(prompts, completions, **kwargs):
        await asyncio.sleep(0)
        calls.append(len(completions))
        return [i / len(completions) for i in range(len(completions))]

    args = make_args(max_steps=1, logging_steps=1, reward_cache=False)
    trainer = GRPOVariantTrainer(model=toy_model_path, reward_funcs=async_position, args=args,
                                 train_dataset=small_train_dataset)
    trainer.train()
    assert calls == [16]
    record = next(r for r in trainer.state.log_history if "reward" in r)
    assert record["reward"] == pytest.approx(sum(i / 16 for i in range(16)) / 16)


# ---- the GRPOConfig field table in docs/trl-users.md ------------------------------------------------------------
def test_the_committed_field_table_is_the_generated_one():
    from pathlib import Path

    from grpo_variants.trl_contract import BEGIN, END, config_table

    doc = (Path(__file__).resolve().parents[1] / "docs" / "trl-users.md").read_text()
    committed = doc[doc.index(BEGIN): doc.index(END) + len(END)]
    assert committed == config_table(), "regenerate: python -m grpo_variants.trl_contract --write docs/trl-users.md"
    from dataclasses import fields

    from trl import GRPOConfig

    for f in fields(GRPOConfig):
        if f.init:
            assert f"| `{f.name}` |" in committed


@pytest.mark.parametrize("index", range(len(__import__("grpo_variants.trl_contract").trl_contract.REFUSALS)))
def test_every_listed_refusal_raises_its_error(index, tmp_path):
    from grpo_variants.trl_contract import REFUSALS

    refusal = REFUSALS[index]
    if not refusal.config:  # checked by the trainer, not the config
        from grpo_variants.trainer import GRPOVariantTrainer as T

        args = GRPOVariantConfig(output_dir=str(tmp_path), report_to="none", beta=0.04, kl_in_reward=True,
                                 multi_objective_aggregation="normalize_then_sum")
        with pytest.raises(ConfigError, match=refusal.error):
            T._check_args(T.__new__(T), args)
        return
    if refusal.field == "vllm_enable_sleep_mode" and torch.cuda.is_available():
        pytest.skip("sleep mode is refused on CPU-only machines; this one has a GPU")
    if refusal.field.startswith("vllm_server_") and torch.cuda.is_available():
        pytest.skip("a remote vLLM server is refused on CPU-only machines (loopback sync); this one has a GPU")
    cls = GRPOVariantConfig if refusal.config == "GRPOVariantConfig" else get_variant(refusal.config).config_cls
    with pytest.raises(ConfigError, match=refusal.error.replace("(", r"\(").replace(")", r"\)")):
        cls(output_dir=str(tmp_path), report_to="none", **refusal.example)


def test_trl_compat_standins_are_built_by_one_process_at_a_time(tmp_path, monkeypatch):
    # Two pytest processes (or shards) sharing the cache used to build the same stand-in folder at once and
    # fail on each other's half-written files: the build is serialised by a lock on the cache folder.
    import threading
    import time

    from trl_compat import standins

    monkeypatch.setenv("GRPO_VARIANTS_CACHE", str(tmp_path))
    order = []

    def builder(tag, hold):
        with standins._build_lock("models"):
            order.append(("in", tag))
            time.sleep(hold)
            order.append(("out", tag))

    first = threading.Thread(target=builder, args=("a", 0.5))
    first.start()
    time.sleep(0.1)
    second = threading.Thread(target=builder, args=("b", 0.0))
    second.start()
    first.join()
    second.join()
    assert order == [("in", "a"), ("out", "a"), ("in", "b"), ("out", "b")]
    assert (tmp_path / "trl_compat" / ".models.lock").exists()
