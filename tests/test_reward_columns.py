"""Rewards name the dataset columns they read; the trainer checks them at construction, before generating."""

from __future__ import annotations

import pytest
from datasets import Dataset

from grpo_variants import GRPOVariantTrainer, toy
from grpo_variants.errors import DatasetError
from grpo_variants.rewards import code_pass, format_think_answer, make_math_accuracy, math_accuracy
from grpo_variants.rewards.columns import check_reward_columns, required_columns


def _ds(**columns):
    n = len(next(iter(columns.values())))
    return Dataset.from_dict({"prompt": ["1+1="] * n, **columns})


def test_required_columns_of_builtins_and_plain_functions():
    assert required_columns(math_accuracy) == [("answer", "solution")]
    assert required_columns(make_math_accuracy(answer_column="gold")) == [("gold",)]
    assert required_columns(code_pass) == [("tests",)]
    assert required_columns(format_think_answer) == []

    def needs_label(prompts, completions, label, completion_ids=None, **kwargs):
        return [0.0] * len(completions)

    def needs_nothing(completions, **kwargs):
        return [0.0] * len(completions)

    assert required_columns(needs_label) == [("label",)]
    assert required_columns(needs_nothing) == []
    assert required_columns("org/reward-model") == []  # reward models read no column


def test_check_names_reward_and_missing_column():
    check_reward_columns([math_accuracy], _ds(solution=["2"]))  # TRL's convention is enough
    check_reward_columns([math_accuracy], _ds(answer=["2"]))
    with pytest.raises(DatasetError) as err:
        check_reward_columns([format_think_answer, math_accuracy, code_pass], _ds(gold=["2"]))
    msg = str(err.value)
    assert "reward 'math_accuracy' needs the column 'answer' or 'solution'" in msg
    assert "reward 'code_pass' needs the column 'tests'" in msg
    assert "format_think_answer" not in msg  # it needs no column
    assert "'gold'" in msg  # lists what the dataset has


def test_the_fix_names_the_rewards_own_factory():
    """code_pass's missing column is fixed with make_code_reward(tests_column=...), never a math reward's
    factory; a plain function gets the rename only (it has no factory to point elsewhere)."""
    with pytest.raises(DatasetError) as err:
        check_reward_columns([code_pass], _ds(test_list=["assert True"]))
    msg = str(err.value)
    assert "rename_column('test_list', 'tests')" in msg and "make_code_reward(tests_column='test_list')" in msg
    assert "math" not in msg
    with pytest.raises(DatasetError, match=r"make_math_accuracy\(answer_column='gold'\)"):
        check_reward_columns([math_accuracy], _ds(gold=["2"]))

    def needs_label(prompts, completions, label, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(DatasetError) as err:
        check_reward_columns([needs_label], _ds(gold=["2"]))
    assert "rename_column('gold', 'label'))." in str(err.value) and "make_" not in str(err.value)


def test_trainer_rejects_missing_column_before_generating(toy_model_path, make_args, monkeypatch):
    from trl import GRPOTrainer

    called = []
    monkeypatch.setattr(GRPOTrainer, "__init__", lambda *a, **k: called.append(1))  # nothing may be built
    bad = toy.make_dataset(n=8).remove_columns("answer")
    with pytest.raises(DatasetError, match=r"reward 'math_accuracy' needs the column 'answer' or 'solution'"):
        GRPOVariantTrainer(model=toy_model_path, reward_funcs="math_accuracy", args=make_args(), train_dataset=bad)
    with pytest.raises(DatasetError, match=r"reward 'toy_accuracy' needs the column 'answer'"):
        GRPOVariantTrainer(model=toy_model_path, reward_funcs=["toy_accuracy"], args=make_args(), train_dataset=bad)
    assert called == []


def test_solution_only_dataset_trains_with_math_accuracy(toy_model_path, make_args):
    ds = toy.make_dataset(n=32).rename_column("answer", "solution")
    assert "answer" not in ds.column_names
    trainer = GRPOVariantTrainer(model=toy_model_path, reward_funcs="math_accuracy",
                                 args=make_args(max_steps=1, logging_steps=1), train_dataset=ds)
    trainer.train()
    logged = [row for row in trainer.state.log_history if "rewards/math_accuracy/mean" in row]
    assert logged, "math_accuracy was not scored"
    assert logged[-1]["rewards/math_accuracy/error_rate"] == 0.0
    assert 0.0 <= logged[-1]["rewards/math_accuracy/mean"] <= 1.0
