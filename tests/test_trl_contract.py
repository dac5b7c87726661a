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
    cls = GRPOVariantConfig if refusal.config == "GRPOVariantConfig" else get_variant(refusal.config).config_cls
    with pytest.raises(ConfigError, match=refusal.error.replace("(", r"\(").replace(")", r"\)")):
        cls(output_dir=str(tmp_path), report_to="none", **refusal.example)
