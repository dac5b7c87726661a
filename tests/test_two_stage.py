"""The two-stage (draft -> rewrite) rollout as a component (grpo_variants.rollout.two_stage), composed by a variant
that is not iGRPO: it rewrites each prompt with *all* its drafts, whatever they scored.

iGRPO composes the same component (tests/test_igrpo.py: best-draft selection, a 2-process run).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from grpo_variants import ConfigError, GRPOVariantConfig, GRPOVariantTrainer
from grpo_variants.rollout.two_stage import Drafts, TwoStageRolloutMixin, draft_text


@dataclass
class _AllDraftsConfig(GRPOVariantConfig):
    num_drafts: int = field(default=2)


class _AllDraftsTrainer(TwoStageRolloutMixin, GRPOVariantTrainer):
    """q' = q + "(" + every draft of q, joined by "," + ")" + q."""

    config_class = _AllDraftsConfig
    draft_metric_prefix = "all_drafts"

    def _rewrite_prompts(self, inputs: list[dict], drafts: Drafts) -> list[dict]:
        N = drafts.num_drafts
        out = []
        for j, row in enumerate(inputs):
            u = self.prompt_index(j, len(inputs))
            assert drafts.unique_rows[u]["prompt"] == row["prompt"]  # the row's own prompt's drafts
            joined = ",".join(drafts.texts[u * N : (u + 1) * N])
            out.append({**row, "prompt": f"{row['prompt']}({joined}){row['prompt']}"})
        return out


class _Recorder:
    __name__ = "recorded_length"

    def __init__(self):
        self.calls = []

    def __call__(self, prompts, completions, **kwargs):
        self.calls.append((list(prompts), [draft_text(c) for c in completions]))
        return [float(len(draft_text(c))) for c in completions]


def test_another_variant_composes_the_draft_rewrite_rollout(toy_model_path, small_train_dataset, make_args):
    reward = _Recorder()
    args = make_args(_AllDraftsConfig, max_steps=1, reward_cache=False)
    trainer = _AllDraftsTrainer(model=toy_model_path, reward_funcs=reward, args=args,
                                train_dataset=small_train_dataset)
    trained_rows = []
    original_loss = trainer._compute_loss
    trainer._compute_loss = lambda model, inputs: (trained_rows.append(inputs["completion_ids"].size(0)),
                                                  original_loss(model, inputs))[1]
    trainer.train()

    (draft_prompts, drafts), (refine_prompts, _) = reward.calls  # one rollout: the drafts, then the trained stage
    N, G = 2, trainer.num_generations
    unique = draft_prompts[::N]
    assert len(unique) == 16 // G and draft_prompts == [q for q in unique for _ in range(N)]
    expected = [f"{q}({','.join(drafts[u * N : (u + 1) * N])}){q}" for u, q in enumerate(unique) for _ in range(G)]
    assert refine_prompts == expected  # every trained row's prompt holds exactly its own prompt's drafts
    assert trained_rows == [16]  # only the rewritten stage reaches the loss
    logged = {k for record in trainer.state.log_history for k in record}
    assert "all_drafts/draft_completions/mean_length" in logged  # the drafts' TRL metrics set aside


def test_two_stage_refuses_a_stage_rollout(toy_model_path, small_train_dataset, make_args):
    args = make_args(_AllDraftsConfig, stage_prompts=8, updates_per_stage=2)
    with pytest.raises(ConfigError, match="does not compose with stage rollouts"):
        _AllDraftsTrainer(model=toy_model_path, reward_funcs="toy_accuracy", args=args,
                          train_dataset=small_train_dataset)


def test_two_stage_needs_num_drafts_on_its_config(toy_model_path, small_train_dataset, make_args):
    class NoDrafts(_AllDraftsTrainer):
        config_class = GRPOVariantConfig

    with pytest.raises(ConfigError, match="needs a config with an integer num_drafts"):
        NoDrafts(model=toy_model_path, reward_funcs="toy_accuracy", args=make_args(GRPOVariantConfig),
                 train_dataset=small_train_dataset)
