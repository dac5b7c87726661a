"""Every variant's config defaults equal the paper's algorithm (docs/algorithms.md, each variant's defaults
table), and the options a path cannot honour are refused at construction.

The expected values are written out here, independently of the config classes: a default that drifts
from the paper fails the variant's row.
"""

from __future__ import annotations

import warnings

import pytest

from grpo_variants import ConfigError, GRPOVariantConfig, get_variant

# What each paper / reference recipe computes (GRPO: DeepSeekMath; DAPO: paper + verl's recipe; Dr.GRPO;
# GSPO; µ-GRPO; iGRPO; FIPO: DAPO's recipe plus its launcher). Derived names: advantage / ratio / aggregation
# are the resolved building blocks; updates_per_rollout = steps_per_generation / gradient_accumulation_steps.
PAPER_DEFAULTS = {
    "grpo": dict(advantage="group_std", ratio="token", aggregation="seq_mean_token_mean", epsilon=0.2,
                 epsilon_high=0.2, clip_ratio_c=None, beta=0.04, kl_estimator="k3", kl_in_reward=False,
                 use_bias_correction_kl=False, learning_rate=1e-6, updates_per_rollout=1, dynamic_sampling=False),
    "dapo": dict(advantage="group_std", ratio="token", aggregation="token_mean", epsilon=0.2, epsilon_high=0.28,
                 clip_ratio_c=10.0, beta=0.0, num_generations=16, updates_per_rollout=16, learning_rate=1e-6,
                 lr_scheduler_type="constant_with_warmup", warmup_steps=20, weight_decay=0.1, max_grad_norm=1.0,
                 dynamic_sampling=True, dynamic_sampling_filter="nonzero_std", max_num_gen_batches=10,
                 overlong_penalty=True, overlong_buffer=4096, mask_truncated_completions=True, temperature=1.0),
    "dr_grpo": dict(advantage="group_mean", ratio="token", aggregation="constant", epsilon=0.2, epsilon_high=0.2,
                    beta=0.0, learning_rate=1e-6, lr_scheduler_type="constant", num_generations=8,
                    updates_per_rollout=1),
    "gspo": dict(advantage="group_std", ratio="sequence", aggregation="seq_mean_token_mean", epsilon=3e-4,
                 epsilon_high=4e-4, beta=0.0, updates_per_rollout=4),
    "gspo_token": dict(advantage="group_std", ratio="sequence_token", aggregation="seq_mean_token_mean",
                       epsilon=3e-4, epsilon_high=4e-4, beta=0.0, updates_per_rollout=4),
    "mu_grpo": dict(advantage="group_std", ratio="token", aggregation="seq_mean_token_mean", beta=0.0,
                    veto_scope="H_kappa", veto_threshold=1e-4, updates_per_stage=1024, clip_bounds=(0.0, 5.0),
                    learning_rate=1e-6),
    "igrpo": dict(advantage="group_std", ratio="token", aggregation="seq_mean_token_mean", epsilon=0.2, beta=0.0,
                  num_drafts=4, num_generations=4, learning_rate=1e-6, lr_scheduler_type="cosine", temperature=0.7,
                  updates_per_rollout=1),
    "fipo": dict(advantage="group_std", ratio="token", aggregation="token_mean", epsilon=0.2, epsilon_high=0.28,
                 clip_ratio_c=10.0, beta=0.0, fipo=True, fipo_tau=32.0, fipo_c=10.0, fipo_clip_low=1.0,
                 fipo_clip_high=1.2, fipo_safety_ratio=10.0, fipo_drop_multi_dual_clip=True, num_generations=16,
                 updates_per_rollout=16, learning_rate=1e-6, lr_scheduler_type="constant_with_warmup",
                 warmup_steps=20, weight_decay=0.1, dynamic_sampling=True, overlong_penalty=True,
                 mask_truncated_completions=True),
}


def _resolved(args, key):
    if key == "advantage":
        return args.resolved_advantage_estimator
    if key == "ratio":
        return args.resolved_ratio_level
    if key == "aggregation":
        return args.resolved_aggregation
    if key == "updates_per_rollout":
        return args.steps_per_generation * args.num_iterations // args.gradient_accumulation_steps
    if key == "overlong_buffer":
        return args.resolved_overlong_buffer_len
    if key == "clip_bounds":
        return (round(1 - args.epsilon, 9), round(1 + args.epsilon_high, 9))
    value = getattr(args, key)
    return value.value if hasattr(value, "value") else value  # enums (lr_scheduler_type)


@pytest.mark.parametrize("variant", sorted(PAPER_DEFAULTS))
def test_defaults_equal_the_papers_algorithm(variant, tmp_path):
    spec = get_variant(variant)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FIPO warns when on-policy; not with its defaults, but keep the test quiet
        args = spec.config_cls(output_dir=str(tmp_path), report_to="none", max_completion_length=20480)
    got = {key: _resolved(args, key) for key in PAPER_DEFAULTS[variant]}
    expected = {k: (pytest.approx(v) if isinstance(v, float) else v) for k, v in PAPER_DEFAULTS[variant].items()}
    assert got == expected


def test_every_registered_variant_has_a_defaults_row():
    from grpo_variants import list_variants

    assert {spec.name for spec in list_variants()} <= set(PAPER_DEFAULTS)


def test_overridden_defaults_are_announced_in_one_line(tmp_path):
    dapo = get_variant("dapo").config_cls(output_dir=str(tmp_path), report_to="none")
    line = dapo.announce_defaults()
    assert "\n" not in line and line.startswith("grpo-variants dapo: defaults differing from TRL's:")
    for fragment in ("num_generations=16", "weight_decay=0.1", "lr_scheduler_type='constant_with_warmup'",
                     "warmup_steps=20", "epsilon_high=0.28", "steps_per_generation=16"):
        assert fragment in line
    assert "learning_rate" not in line  # 1e-6 is TRL's default too
    # values the user sets are not announced as our defaults
    custom = get_variant("dapo").config_cls(output_dir=str(tmp_path), report_to="none", num_generations=8,
                                           mini_batches_per_rollout=None)
    assert "num_generations" not in custom.announce_defaults()
    assert "steps_per_generation" not in custom.announce_defaults()


def test_mini_batches_per_rollout_maps_onto_steps_per_generation(tmp_path):
    args = GRPOVariantConfig(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=8,
                             gradient_accumulation_steps=2, mini_batches_per_rollout=4)
    assert args.steps_per_generation == 8 and args.generation_batch_size == 64  # 4 updates of 2 micro-batches
    explicit = GRPOVariantConfig(output_dir=str(tmp_path), report_to="none", steps_per_generation=3,
                                 mini_batches_per_rollout=4)
    assert explicit.steps_per_generation == 3  # an explicit steps_per_generation wins
    with pytest.raises(ConfigError, match="mini_batches_per_rollout"):
        GRPOVariantConfig(output_dir=str(tmp_path), report_to="none", mini_batches_per_rollout=0)


# ------------------------------------------------------------------------------------------------
# Options a path cannot honour
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("option", [dict(clip_ratio_c=10.0), dict(veto_scope="H_kappa"), dict(fipo=True),
                                    dict(kl_estimator="k1"), dict(ratio_level="sequence_token"),
                                    dict(aggregation="token_mean", use_adaptive_entropy=True)])
@pytest.mark.parametrize("loss_type", ["cispo", "sapo"])
def test_variant_only_options_on_a_trl_loss_are_refused(option, loss_type, tmp_path):
    name = next(iter(option))
    with pytest.raises(ConfigError, match=name) as err:
        GRPOVariantConfig(output_dir=str(tmp_path), report_to="none", loss_type=loss_type, **option)
    assert "cannot honour" in str(err.value)


def test_adaptive_entropy_refuses_composed_options(tmp_path):
    with pytest.raises(ConfigError, match="use_adaptive_entropy=True defers to TRL's own loss.*clip_ratio_c"):
        GRPOVariantConfig(output_dir=str(tmp_path), report_to="none", use_adaptive_entropy=True, clip_ratio_c=10.0)


def test_kl_is_never_counted_twice(tmp_path):
    with pytest.raises(ConfigError, match="counted twice"):
        GRPOVariantConfig(output_dir=str(tmp_path), report_to="none", loss_type="cispo", beta=0.04, kl_in_reward=True)
    # on a composed loss, KL in the reward removes it from the loss
    from grpo_variants.trainer import GRPOVariantTrainer

    args = GRPOVariantConfig(output_dir=str(tmp_path), report_to="none", loss_type="grpo", beta=0.04,
                             kl_in_reward=True)
    spec = GRPOVariantTrainer._build_loss_spec(type("T", (), {"args": args})())
    assert spec.beta == 0.0
    # TRL's own fields on a TRL loss stay accepted
    GRPOVariantConfig(output_dir=str(tmp_path), report_to="none", loss_type="cispo", beta=0.04,
                      ratio_level="token")


@pytest.mark.parametrize("variant", ["igrpo", "mu_grpo"])
def test_variants_that_rewrite_the_rollout_refuse_dynamic_sampling(variant, toy_model_path, small_train_dataset,
                                                                   tmp_path):
    spec = get_variant(variant)
    extra = dict(stage_prompts=8, updates_per_stage=4) if variant == "mu_grpo" else {}
    args = spec.config_cls(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=8,
                           num_generations=4, max_completion_length=6, dynamic_sampling=True, **extra)
    with pytest.raises(ConfigError, match="dynamic_sampling=True composes with variants that keep TRL's rollout"):
        spec.trainer_cls(model=toy_model_path, reward_funcs="toy_accuracy", args=args,
                         train_dataset=small_train_dataset)
