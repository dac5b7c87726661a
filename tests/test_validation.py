"""Bad inputs fail early with a documented exception type whose message names what is wrong.

Each row of a matrix below is (case id, what raises, exception type, words the message must
contain). The types are those of :mod:`grpo_variants.errors` (every one is also a ``ValueError``).
Config rows raise while the config is built; trainer rows while the trainer is constructed; the
last rows at ``train()`` (a reward function returning the wrong number of values is only known
once it has been called, and the checkpoint to resume from only once ``train`` is called).
"""

from __future__ import annotations

import re

import pytest
from datasets import IterableDataset

from grpo_variants import (
    ConfigError,
    DatasetError,
    GRPOVariantConfig,
    GRPOVariantsError,
    GRPOVariantTrainer,
    ModelPathError,
    RewardFunctionError,
    UnknownLossError,
    UnknownRewardError,
    UnknownVariantError,
    get_variant,
    toy,
)

BASE = dict(output_dir="unused", report_to="none", per_device_train_batch_size=8, num_generations=4,
            max_completion_length=4, bf16=False, gradient_checkpointing=False)


def config(cls_or_variant=None, **fields):
    cls = GRPOVariantConfig if cls_or_variant is None else get_variant(cls_or_variant).config_cls
    return lambda: cls(**{**BASE, **fields})


# ------------------------------------------------------------------------------------------------
# Config matrix (no model needed)
# ------------------------------------------------------------------------------------------------
CONFIG_CASES = [
    # generation batch arithmetic (checked before TRL's bare ValueError)
    ("gen-batch-not-divisible", config(per_device_train_batch_size=10), ConfigError,
     ["per_device_train_batch_size (10)", "num_generations (4)", "[8, 12]"]),
    ("gen-batch-size-not-divisible-by-G", config(generation_batch_size=24, num_generations=5), ConfigError,
     ["generation_batch_size (24)", "num_generations (5)"]),
    ("gen-batch-size-not-multiple-of-batch", config(generation_batch_size=12), ConfigError,
     ["generation_batch_size (12)", "per_device_train_batch_size (8)"]),
    ("steps-per-generation-not-divisible", config(per_device_train_batch_size=6, steps_per_generation=3),
     ConfigError, ["steps_per_generation (3)", "num_generations (4)"]),
    ("gen-batch-and-steps-both-set", config(generation_batch_size=16, steps_per_generation=2), ConfigError,
     ["generation_batch_size", "steps_per_generation", "only one"]),
    ("one-generation", config(num_generations=1), ConfigError, ["num_generations (1)", ">= 2"]),
    ("auto-find-batch-size", config(auto_find_batch_size=True), ConfigError, ["auto_find_batch_size"]),
    # clipping, veto, FIPO
    ("eps-high-below-eps-low", config(epsilon=0.2, epsilon_high=0.1), ConfigError, ["epsilon_high (0.1)", "epsilon"]),
    ("negative-epsilon", config(epsilon=-0.1, epsilon_high=0.2), ConfigError, ["epsilon (-0.1)"]),
    ("dual-clip-c-below-1", config(clip_ratio_c=0.5), ConfigError, ["clip_ratio_c (0.5)", "> 1"]),
    ("veto-threshold-0", config(veto_threshold=0.0), ConfigError, ["veto_threshold (0.0)", "(0, 1)"]),
    ("veto-threshold-1", config(veto_threshold=1.0), ConfigError, ["veto_threshold (1.0)", "(0, 1)"]),
    ("veto-threshold-above-1", config(veto_threshold=1.5), ConfigError, ["veto_threshold (1.5)"]),
    ("fipo-clip-inverted", config(fipo=True, fipo_clip_low=1.2, fipo_clip_high=1.0), ConfigError,
     ["fipo_clip_low (1.2)", "fipo_clip_high (1.0)"]),
    ("fipo-tau", config(fipo=True, fipo_tau=0.0), ConfigError, ["fipo_tau"]),
    # unknown building-block names
    ("unknown-aggregation", config(aggregation="tokenmean"), ConfigError, ["aggregation='tokenmean'", "token_mean"]),
    ("unknown-ratio-level", config(ratio_level="seq"), ConfigError, ["ratio_level='seq'", "sequence"]),
    ("unknown-kl-estimator", config(kl_estimator="k4"), ConfigError, ["kl_estimator='k4'", "k3"]),
    ("unknown-advantage", config(advantage_estimator="zscore"), ConfigError, ["advantage_estimator='zscore'"]),
    ("unknown-veto-scope", config(veto_scope="H"), ConfigError, ["veto_scope='H'", "H_kappa"]),
    ("unknown-reward-isolation", config(reward_isolation="docker"), ConfigError, ["reward_isolation='docker'"]),
    ("unknown-reward-on-error", config(reward_on_error="ignore"), ConfigError, ["reward_on_error='ignore'"]),
    # reliability fields
    ("max-consecutive-nonfinite-0", config(max_consecutive_nonfinite=0), ConfigError, ["max_consecutive_nonfinite"]),
    ("kl-in-reward-without-beta", config(kl_in_reward=True, beta=0.0), ConfigError, ["kl_in_reward", "beta"]),
    # variant configs
    ("mu-grpo-clip-bounds-inverted", config("mu_grpo", mu_clip_lower=0.5, mu_clip_upper=0.8, stage_prompts=8,
                                            updates_per_stage=4), ConfigError, ["mu_clip_upper"]),
    ("mu-grpo-clip-lower-above-1", config("mu_grpo", mu_clip_lower=2.0, mu_clip_upper=5.0, stage_prompts=8,
                                          updates_per_stage=4), ConfigError, ["mu_clip_lower"]),
    ("mu-grpo-stage-below-one-mini-batch", config("mu_grpo", stage_prompts=1, updates_per_stage=4), ConfigError,
     ["stage smaller than one mini-batch", "stage_prompts (1)", "per_device_train_batch_size (8)"]),
    ("mu-grpo-num-iterations-by-hand", config("mu_grpo", stage_prompts=8, updates_per_stage=4, num_iterations=3),
     ConfigError, ["num_iterations=3", "updates_per_stage"]),
    ("igrpo-no-drafts", config("igrpo", num_drafts=0), ConfigError, ["num_drafts=0"]),
    ("gspo-token-aggregation", config("gspo", aggregation="token_mean"), ConfigError,
     ["aggregation='token_mean'", "seq_mean_token_mean"]),
    ("dapo-band-inverted", config("dapo", dynamic_sampling_filter="band", dynamic_sampling_band_low=0.9,
                                  dynamic_sampling_band_high=0.1), ConfigError,
     ["dynamic_sampling_band_low (0.9)", "dynamic_sampling_band_high (0.1)"]),
    ("unknown-variant", lambda: get_variant("ppo-max"), UnknownVariantError, ["'ppo-max'", "dapo", "mu_grpo"]),
]


@pytest.mark.parametrize("build, error, words", [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_config_matrix(build, error, words):
    with pytest.raises(error) as info:
        build()
    assert isinstance(info.value, GRPOVariantsError) and isinstance(info.value, ValueError)
    for word in words:
        assert word in str(info.value), f"{word!r} not in: {info.value}"


def test_igrpo_budget_split_over_processes():
    """iGRPO's N + G budget: N drafts per prompt must split evenly over the processes (checked in _check_args)."""
    from grpo_variants.variants.igrpo import draft_plan

    with pytest.raises(ConfigError, match=r"N \+ G budget inconsistent.*num_drafts=3.*2 processes"):
        draft_plan(3, 3, 2, 0)
    assert draft_plan(2, 2, 2, 1) == [1, 1]


def test_unknown_loss_block_name():
    from grpo_variants.losses import get_aggregation

    with pytest.raises(UnknownLossError, match="Unknown aggregation 'mean_of_means'.*token_mean"):
        get_aggregation("mean_of_means")


# ------------------------------------------------------------------------------------------------
# Trainer construction matrix
# ------------------------------------------------------------------------------------------------
def _prompts(n=8):
    return toy.make_dataset(n=n)


def _iterable():
    rows = list(_prompts())
    return IterableDataset.from_generator(lambda: iter(rows))


def _wrong_count_reward(completions, **kwargs):
    return [1.0] * (len(completions) - 1)


def trainer(variant=None, model="toy", rewards="toy_accuracy", dataset=_prompts, args_cls=None, **fields):
    def build(toy_model_path, tmp_path):
        cls = GRPOVariantTrainer if variant is None else get_variant(variant).trainer_cls
        cfg_cls = args_cls or (GRPOVariantConfig if variant is None else get_variant(variant).config_cls)
        values = {**BASE, "output_dir": str(tmp_path / "out"), "max_steps": 1, **fields}
        cfg = cfg_cls(**values)
        return cls(model=toy_model_path if model == "toy" else model(tmp_path), reward_funcs=rewards, args=cfg,
                   train_dataset=dataset())

    return build


TRAINER_CASES = [
    ("missing-prompt-column", trainer(dataset=lambda: _prompts().rename_column("prompt", "question")), DatasetError,
     ["'prompt' column", "question", "rename_column"]),
    ("empty-dataset", trainer(dataset=lambda: _prompts(0)), DatasetError, ["train_dataset is empty"]),
    ("reward-weight-count", trainer(reward_weights=[1.0, 0.5]), ConfigError,
     ["Number of reward weights (2)", "number of reward functions (1)"]),
    ("unknown-reward", trainer(rewards=["acuracy"]), UnknownRewardError, ["'acuracy'", "toy_accuracy"]),
    ("no-reward", trainer(rewards=None), ConfigError, ["No reward source provided", "reward_funcs takes a callable"]),
    ("reward-not-callable", trainer(rewards=[42]), ConfigError, ["reward_funcs entry 42"]),
    ("model-path-missing", trainer(model=lambda tmp: str(tmp / "no-such-model")), ModelPathError,
     ["no-such-model", "does not exist"]),
    ("variant-with-trl-loss", trainer("grpo", loss_type="cispo"), ConfigError, ["'grpo'", "loss_type='cispo'"]),
    ("variant-with-adaptive-entropy", trainer("dr_grpo", use_adaptive_entropy=True), ConfigError,
     ["'dr_grpo'", "use_adaptive_entropy"]),
    ("variant-with-wrong-config-class", trainer("dapo", args_cls=GRPOVariantConfig), ConfigError,
     ["DAPOConfig", "GRPOVariantConfig"]),
    ("dataset-smaller-than-one-round", trainer(dataset=lambda: _prompts(3), per_device_train_batch_size=16),
     DatasetError, ["3 prompt(s)", "4 distinct prompts", "step 0", "at least 4 prompts"]),
    ("dapo-dynamic-sampling-iterable", trainer("dapo", dataset=_iterable, dynamic_sampling=True), ConfigError,
     ["dynamic_sampling=True", "IterableDataset"]),
]


@pytest.mark.parametrize("build, error, words", [c[1:] for c in TRAINER_CASES], ids=[c[0] for c in TRAINER_CASES])
def test_trainer_matrix(build, error, words, toy_model_path, tmp_path):
    with pytest.raises(error) as info:
        build(toy_model_path, tmp_path)
    assert isinstance(info.value, GRPOVariantsError) and isinstance(info.value, ValueError)
    for word in words:
        assert word in str(info.value), f"{word!r} not in: {info.value}"


# ------------------------------------------------------------------------------------------------
# Errors only train() can see
# ------------------------------------------------------------------------------------------------
def test_reward_returning_wrong_number_of_values(toy_model_path, tmp_path):
    t = trainer(rewards=_wrong_count_reward)(toy_model_path, tmp_path)
    with pytest.raises(RewardFunctionError) as info:
        t.train()
    message = str(info.value)
    counts = re.search(r"returned (\d+) rewards for (\d+) completions", message)  # (unique completions: cache)
    assert "_wrong_count_reward" in message and counts and int(counts[1]) == int(counts[2]) - 1, message
    assert t.state.global_step == 0


@pytest.mark.parametrize("resume, words", [
    (True, ["resume_from_checkpoint=True", "no complete checkpoint"]),
    ("missing", ["checkpoint-404", "does not exist"]),
    (7, ["resume_from_checkpoint=7"]),
])
def test_bad_resume_from_checkpoint(resume, words, toy_model_path, tmp_path):
    t = trainer()(toy_model_path, tmp_path)
    if resume == "missing":
        resume = str(tmp_path / "out" / "checkpoint-404")
    with pytest.raises(ConfigError) as info:
        t.train(resume_from_checkpoint=resume)
    for word in words:
        assert word in str(info.value), f"{word!r} not in: {info.value}"


def test_dataset_of_exactly_one_round_is_accepted(toy_model_path, tmp_path):
    """The boundary of the check above: as many prompts as one round takes is enough."""
    build = trainer(dataset=lambda: _prompts(4), per_device_train_batch_size=16)
    assert len(build(toy_model_path, tmp_path).train_dataset) == 4
