"""A TRL user's first hour (issue #26): paths accepted, nothing silent, metrics that read right, early errors.

Each test states what is true by construction: a path is a path whatever its type; a refused value is
refused before any model is loaded or evaluated (the evaluation is replaced by a function that fails the
test); a +1 / -1 reward with a known fraction right gives that fraction; a shaping bonus does not make a
wrong answer right.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grpo_variants.cli import main

REPO = Path(__file__).resolve().parents[1]


def _no_evaluation(monkeypatch):
    """Any held-out evaluation fails the test: the error must come first."""
    from grpo_variants.tasks import toy

    def fail(*args, **kwargs):
        raise AssertionError("evaluated before the error")

    monkeypatch.setattr(toy, "evaluate", fail)


def _one_line_error(capsys, code) -> str:
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


# ------------------------------------------------------------------------------------------------
# 1. str and os.PathLike wherever a model or dataset path is taken
# ------------------------------------------------------------------------------------------------
def test_a_pathlib_model_is_accepted_by_the_trainer(toy_model_path, small_train_dataset, make_args):
    from grpo_variants import GRPOVariantTrainer
    from grpo_variants.tasks.models import resolve_model

    assert resolve_model(Path(toy_model_path)) == str(toy_model_path)
    trainer = GRPOVariantTrainer(model=Path(toy_model_path), reward_funcs="toy_accuracy", args=make_args(),
                                 train_dataset=small_train_dataset)
    assert trainer.model.config.model_type == "qwen2"


def test_paths_for_datasets_evaluation_and_recipes(toy_kit, tmp_path):
    from grpo_variants.inputs import load_dataset
    from grpo_variants.tasks import toy

    data = tmp_path / "prompts.jsonl"
    toy_kit.eval_dataset.select(range(8)).to_json(str(data))
    assert len(load_dataset(data)) == 8 and len(load_dataset(str(data))) == 8
    accuracy = toy.evaluate(Path(toy_kit.model_path), toy_kit.eval_dataset.select(range(8)))
    assert 0.0 <= accuracy <= 1.0

    import sys

    sys.path.insert(0, str(REPO / "recipes"))
    try:
        from _common import DatasetSpec, load_prompts
    finally:
        sys.path.remove(str(REPO / "recipes"))
    rows = load_prompts(DatasetSpec(data, prompt="prompt", answer="answer"))
    assert len(rows) == 8 and set(rows.column_names) == {"prompt", "answer"}


# ------------------------------------------------------------------------------------------------
# 5. construction-time, one-line errors
# ------------------------------------------------------------------------------------------------
BAD_VALUES = [
    (["--max_completion_length", "0"], "max_completion_length=0"),
    (["--max_completion_length", "-3"], "max_completion_length=-3"),
    (["--learning_rate", "-1"], "learning_rate=-1"),
    (["--temperature", "0"], "temperature=0"),
    (["--top_p", "1.5"], "top_p=1.5"),
    (["--top_k", "-2"], "top_k=-2"),
    (["--per_device_train_batch_size", "0"], "per_device_train_batch_size=0"),
    (["--gradient_accumulation_steps", "0"], "gradient_accumulation_steps=0"),
    (["--num_iterations", "0"], "num_iterations=0"),
    (["--max_grad_norm", "-1"], "max_grad_norm=-1"),
    (["--repetition_penalty", "0"], "repetition_penalty=0"),
    (["--max_steps", "-1", "--num_train_epochs", "0"], "0 steps"),
    (["--beta", "-1"], "beta=-1"),
    (["--weight_decay", "-1"], "weight_decay=-1"),
    (["--save_strategy", "steps", "--save_steps", "0"], "save_steps=0"),
    (["--dataset", "toy:nosuch"], "Unknown toy task 'nosuch'"),
    (["--output_dir", "/proc/no-such-folder/run"], "cannot be created"),
]


@pytest.mark.parametrize("flags,named", BAD_VALUES, ids=[" ".join(f) for f, _ in BAD_VALUES])
def test_bad_values_fail_in_one_line_before_anything_loads(flags, named, tmp_path, capsys, monkeypatch):
    _no_evaluation(monkeypatch)
    code = main(["train", "--model", "toy", "--dataset", "toy", "--output_dir", str(tmp_path / "o"), *flags])  # last wins
    assert named in _one_line_error(capsys, code)


def test_a_misspelt_local_dataset_path(tmp_path, capsys, monkeypatch):
    _no_evaluation(monkeypatch)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1="}\n')
    code = main(["train", "--model", "toy", "--dataset", str(tmp_path / "promts.jsonl"), "--output_dir",
                 str(tmp_path / "o")])
    err = _one_line_error(capsys, code)
    assert "no such file or folder" in err and "prompts.jsonl" in err  # what is there, to spot the typo


def test_an_unreachable_hub_dataset(tmp_path, capsys, monkeypatch):
    _no_evaluation(monkeypatch)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    code = main(["train", "--model", "toy", "--dataset", "no-such-org/no-such-data", "--output_dir",
                 str(tmp_path / "o")])
    err = _one_line_error(capsys, code)
    assert "cannot be reached" in err and "local json/jsonl/csv/parquet file" in err


def test_an_unreachable_hub_model(monkeypatch):
    """Online mode but no network: the model is named as unreachable, with what to pass instead."""
    import huggingface_hub

    from grpo_variants.errors import ModelPathError
    from grpo_variants.validation import check_model_path

    def offline(*args, **kwargs):
        raise ConnectionError("Name or service not known")

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub, "model_info", offline)
    with pytest.raises(ModelPathError, match="cannot be reached.*Pass the folder of a saved model"):
        check_model_path("no-such-org/no-such-model-26")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelPathError, match="HF_HUB_OFFLINE"):
        check_model_path("no-such-org/no-such-model-26")


def test_resume_with_no_checkpoint_fails_before_the_evaluation(tmp_path, capsys, monkeypatch):
    _no_evaluation(monkeypatch)
    code = main(["train", "--model", "toy", "--dataset", "toy", "--output_dir", str(tmp_path / "empty"),
                 "--resume_from_checkpoint", "true"])
    assert "holds no complete checkpoint" in _one_line_error(capsys, code)


def test_recipes_read_resume_like_the_cli(tmp_path, capsys):
    import sys

    sys.path.insert(0, str(REPO / "recipes"))
    try:
        from _common import resume_checkpoint
    finally:
        sys.path.remove(str(REPO / "recipes"))
    config = SimpleNamespace(resume_from_checkpoint="true", output_dir=str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        resume_checkpoint(config)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "holds no complete checkpoint" in err and len(err.splitlines()) == 1
    (tmp_path / "checkpoint-3").mkdir()
    with pytest.raises(SystemExit):  # an incomplete checkpoint is not resumed from either
        resume_checkpoint(config)
    assert resume_checkpoint(SimpleNamespace(resume_from_checkpoint=None, output_dir=str(tmp_path))) is None
    assert resume_checkpoint(SimpleNamespace(resume_from_checkpoint="false", output_dir=str(tmp_path))) is None


# ------------------------------------------------------------------------------------------------
# 3. nothing changes silently
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["dapo", "gspo", "dr_grpo", "fipo", "mu_grpo", "grpo"])
def test_the_demo_keeps_the_variants_beta_and_names_what_it_overrides(variant, tmp_path):
    from grpo_variants import get_variant
    from grpo_variants.demo import _parser, demo_config

    spec = get_variant(variant)
    config, line = demo_config(spec, _parser().parse_args([]), tmp_path)
    paper_beta = spec.config_cls.__dataclass_fields__["beta"].default
    assert config.beta == paper_beta
    assert f"beta={paper_beta!r} as the variant sets it" in line and "\n" not in line
    assert f"learning_rate=0.0001 (variant: {spec.config_cls.__dataclass_fields__['learning_rate'].default!r})" \
        in line
    config, line = demo_config(spec, _parser().parse_args(["--beta", "0.5"]), tmp_path)
    assert config.beta == 0.5 and "beta=0.5" in line


def test_the_start_up_line_names_the_behaviour_changes(toy_model_path, small_train_dataset, make_args, caplog):
    from grpo_variants import GRPOVariantTrainer, get_variant

    spec = get_variant("dapo")
    args = make_args(spec.config_cls, steps_per_generation=None, per_device_train_batch_size=16,
                     gradient_accumulation_steps=1)
    with caplog.at_level(logging.WARNING, logger="grpo_variants.trainer"):
        trainer = spec.trainer_cls(model=toy_model_path, reward_funcs="toy_accuracy_pm1", args=args,
                                   train_dataset=small_train_dataset)
    line = trainer.announce_behaviour()
    for what in ("dynamic sampling", "an extra reward 'overlong_penalty'", "dual clip"):
        assert what in line
    assert line in caplog.text and "\n" not in line
    plain = GRPOVariantTrainer(model=toy_model_path, reward_funcs="toy_accuracy", args=make_args(padding_free=False),
                               train_dataset=small_train_dataset)
    assert plain.announce_behaviour() is None  # TRL's GRPO with our defaults: nothing to announce
    packed = GRPOVariantTrainer(model=toy_model_path, reward_funcs="toy_accuracy", args=make_args(),
                                train_dataset=small_train_dataset)
    assert packed.args.padding_free is True  # padding_free="auto": the toy Qwen2 passes the probe
    assert "padding-free training forward" in packed.announce_behaviour()
    assert "padding_free='auto': qwen2 honours packed position_ids" in packed.announce_behaviour()


def test_the_per_sample_re_call_of_a_failed_reward_is_announced_once(caplog):
    from grpo_variants.rewards.robust import RobustReward

    calls = []

    def judge(prompts, completions, **kwargs):
        calls.append(len(completions))
        if len(completions) > 1:
            raise RuntimeError("batch endpoint down")
        return [1.0]

    reward = RobustReward(judge, on_error="none")
    with caplog.at_level(logging.WARNING, logger="grpo_variants.rewards.robust"):
        assert reward(prompts=["p"] * 3, completions=["a", "b", "c"]) == [1.0, 1.0, 1.0]
        assert reward(prompts=["p"] * 3, completions=["a", "b", "c"]) == [1.0, 1.0, 1.0]
    assert calls == [3, 1, 1, 1, 3, 1, 1, 1]
    said = [r for r in caplog.records if "one sample at a time" in r.getMessage()]
    assert len(said) == 1 and "'judge'" in said[0].getMessage()


def _signal_fake(advantages):
    from collections import defaultdict

    return SimpleNamespace(
        _buffered_inputs=[{"advantages": a} for a in advantages],
        accelerator=SimpleNamespace(device=torch.device("cpu"), reduce=lambda t, reduction: t,
                                    is_main_process=True),
        _metrics={"train": defaultdict(list)},
        state=SimpleNamespace(global_step=3),
        num_generations=4,
    )


def test_a_rollout_with_no_signal_warns_once_and_is_logged(caplog):
    from grpo_variants.trainer import GRPOVariantTrainer

    fake = _signal_fake([torch.zeros(4), torch.zeros(4)])
    with caplog.at_level(logging.WARNING, logger="grpo_variants.trainer"):
        GRPOVariantTrainer._check_rollout_signal(fake)
        GRPOVariantTrainer._check_rollout_signal(fake)
    assert sum("every group of this rollout had zero reward variance" in r.getMessage() for r in caplog.records) == 1
    assert fake._metrics["train"]["rollout/zero_signal"] == [1.0, 1.0]
    some = _signal_fake([torch.zeros(4), torch.tensor([0.0, 0.5, -0.5, 0.0])])
    GRPOVariantTrainer._check_rollout_signal(some)
    assert some._metrics["train"]["rollout/zero_signal"] == [0.0]


def test_training_with_a_constant_reward_warns(toy_model_path, small_train_dataset, make_args, caplog):
    """Every completion scores 1: every group has zero variance in every variant's sense, by construction."""
    from grpo_variants import GRPOVariantTrainer

    def constant(prompts, completions, **kwargs):
        return [1.0] * len(completions)

    trainer = GRPOVariantTrainer(model=toy_model_path, reward_funcs=constant, args=make_args(max_steps=1),
                                 train_dataset=small_train_dataset)
    with caplog.at_level(logging.WARNING, logger="grpo_variants.trainer"):
        trainer.train()
    assert "every group of this rollout had zero reward variance" in caplog.text


# ------------------------------------------------------------------------------------------------
# 4. metrics that read right
# ------------------------------------------------------------------------------------------------
def test_accuracy_of_a_pm1_reward_is_the_fraction_right():
    from grpo_variants.console import summary_rows
    from grpo_variants.mechanisms import outcome_rewards, right_fraction

    pm1 = torch.tensor([1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 1.0])  # 2 of 8 right: mean reward -0.5
    assert right_fraction(pm1) == 0.25
    assert outcome_rewards(pm1.view(-1, 1), ["toy_accuracy_pm1"]).tolist() == pm1.tolist()
    rows = summary_rows([{"reward": -0.5, "rewards/toy_accuracy_pm1/mean": -0.5,
                          "rewards/toy_accuracy_pm1/right_fraction": 0.25}])
    assert ("train accuracy (toy_accuracy_pm1)", "25.0%", "25.0%") in rows


def test_a_shaping_bonus_does_not_count_as_right():
    """Accuracy 1 / 0 plus a 0.5 format bonus on every completion: the reward sum is > 0 everywhere."""
    from collections import defaultdict

    from grpo_variants.trainer import GRPOVariantTrainer

    per_func = torch.tensor([[1.0, 0.5], [0.0, 0.5], [0.0, 0.5], [0.0, 0.5]])
    fake = SimpleNamespace(
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t),
        model=SimpleNamespace(training=True),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        reward_func_names=["toy_accuracy", "format_bonus"],
        _last_rewards_per_func=per_func,
        weighted_rewards=lambda: per_func.sum(dim=1),
    )
    GRPOVariantTrainer._log_lengths_by_outcome(fake, [[1, 2], [1, 2, 3], [1, 2, 3], [1, 2, 3]])
    logged = fake._metrics["train"]
    assert logged["completions/right_fraction"] == [0.25]
    assert logged["rewards/toy_accuracy/right_fraction"] == [0.25]
    assert logged["completions/mean_length_right"] == [2.0] and logged["completions/mean_length_wrong"] == [3.0]
    fake.reward_func_names = ["length_bonus", "format_bonus"]  # no accuracy reward: right / wrong undefined
    GRPOVariantTrainer._log_lengths_by_outcome(fake, [[1]] * 4)
    assert logged["completions/right_fraction"] == [0.25]


def test_evaluation_rollouts_are_not_training_time():
    from grpo_variants.trainer import GRPOVariantTrainer

    fake = SimpleNamespace(model=SimpleNamespace(training=False), _phase_time={"generation": 0.0})
    with GRPOVariantTrainer._timed(fake, "generation"):
        pass
    assert fake._phase_time["generation"] == 0.0
    fake.model.training = True
    with GRPOVariantTrainer._timed(fake, "generation"):
        torch.ones(1000).sum()
    assert fake._phase_time["generation"] > 0.0


def test_throughput_excludes_an_evaluation(toy_model_path, small_train_dataset, make_args, toy_kit):
    """After a training rollout the phase timers are reset; an evaluation (TRL's eval rollouts) adds nothing to
    them, so the next training rollout's tokens/s divides by training seconds only."""
    from grpo_variants import GRPOVariantTrainer

    args = make_args(max_steps=1, per_device_eval_batch_size=16)
    trainer = GRPOVariantTrainer(model=toy_model_path, reward_funcs="toy_accuracy", args=args,
                                 train_dataset=small_train_dataset, eval_dataset=toy_kit.eval_dataset.select(range(16)))
    trainer.train()
    assert set(trainer._phase_time.values()) == {0.0}
    metrics = trainer.evaluate()
    assert "eval_reward" in metrics  # the evaluation generated and scored completions
    assert set(trainer._phase_time.values()) == {0.0}


def test_the_lab_takes_a_pathlib_model(toy_model_path, small_train_dataset, tmp_path):
    from grpo_variants import lab

    result = lab.compare(["grpo"], task="toy-as-a-custom-task", model=Path(toy_model_path),
                         train_dataset=small_train_dataset, reward_funcs="toy_accuracy", budget_completions=16,
                         config=dict(per_device_train_batch_size=16, num_generations=4, max_completion_length=6,
                                     max_steps=1, learning_rate=1e-4, bf16=False),
                         output_dir=tmp_path / "lab", verbose=False)
    assert [row["variant"] for row in result.summary_rows] == ["grpo"]


def _recipes():
    import importlib
    import sys

    sys.path.insert(0, str(REPO / "recipes"))
    try:
        return importlib.import_module("_common"), importlib.import_module("grpo_qwen")
    finally:
        sys.path.remove(str(REPO / "recipes"))


@pytest.mark.parametrize("flags,named", [
    (["--dataset", "./no-such-prompts.jsonl", "--model", "{toy}"], "no such file or folder"),
    (["--dataset", "./no-such-prompts.jsonl"], "does not exist"),  # the recipe's hub model, offline: first
    (["--toy", "--learning_rate", "-1"], "learning_rate=-1"),
    (["--toy", "--model", "/no/such/model"], "--toy runs the toy kit"),
    (["--dataset", "{questions}", "--model", "/no/such/model"], "does not exist"),
    (["--toy", "--resume_from_checkpoint", "true"], "holds no complete checkpoint"),
])
def test_recipes_fail_in_one_line_before_anything_loads(flags, named, tmp_path, capsys, monkeypatch, toy_model_path):
    _no_evaluation(monkeypatch)
    questions = tmp_path / "questions.jsonl"
    questions.write_text('{"question": "1+1?", "answer": "2"}\n')
    flags = [f.format(questions=questions, toy=toy_model_path) for f in flags]
    common, grpo_qwen = _recipes()
    with pytest.raises(SystemExit) as exit_info:
        common.main(grpo_qwen.RECIPE, [*flags, "--output_dir", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and named in err and len(err.splitlines()) == 1, err


def test_an_unreachable_reward_model(tmp_path, capsys, monkeypatch):
    _no_evaluation(monkeypatch)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main(["train", "--model", "toy", "--dataset", "toy", "--reward", "no-such-org/no-such-reward-model",
                 "--output_dir", str(tmp_path / "o")])
    err = _one_line_error(capsys, code)
    assert "not a registered reward name" in err and "HF_HUB_OFFLINE" in err


def test_a_run_shorter_than_its_warm_up_or_one_rollout_warns_at_construction(toy_model_path, small_train_dataset,
                                                                             make_args, caplog):
    """The README's first DAPO example once ran max_steps=5 with DAPO's 20 warm-up steps and 16 updates per rollout:
    in warm-up the whole run, on one rollout, silently. Both are said at construction; a run that fits says nothing."""
    from grpo_variants import get_variant

    spec = get_variant("dapo")
    with caplog.at_level(logging.WARNING, logger="grpo_variants.trainer"):
        short = spec.trainer_cls(model=toy_model_path, reward_funcs="toy_accuracy_pm1",
                                 args=make_args(spec.config_cls, max_steps=5, per_device_train_batch_size=16,
                                                gradient_accumulation_steps=1, steps_per_generation=None,
                                                mini_batches_per_rollout=16, warmup_steps=20,
                                                lr_scheduler_type="constant_with_warmup"),  # DAPO's schedule
                                 train_dataset=small_train_dataset)
    notes = short.short_run_warnings()
    assert len(notes) == 2 and all(note in caplog.text for note in notes)
    assert "warmup_steps=20 covers all max_steps=5" in notes[0] and "never reaches learning_rate" in notes[0]
    assert "max_steps=5 is shorter than one rollout: each rollout feeds 16 optimizer steps" in notes[1]
    fits = spec.trainer_cls(model=toy_model_path, reward_funcs="toy_accuracy_pm1",
                            args=make_args(spec.config_cls, max_steps=20, per_device_train_batch_size=16,
                                           gradient_accumulation_steps=1, steps_per_generation=None,
                                           mini_batches_per_rollout=1, warmup_steps=0),
                            train_dataset=small_train_dataset)
    assert fits.short_run_warnings() == []
    ratio = spec.trainer_cls(model=toy_model_path, reward_funcs="toy_accuracy_pm1",  # a warm-up ratio (0.5 of 20)
                             args=make_args(spec.config_cls, max_steps=20, per_device_train_batch_size=16,
                                            gradient_accumulation_steps=1, steps_per_generation=None,
                                            mini_batches_per_rollout=1, warmup_steps=0.5),
                             train_dataset=small_train_dataset)
    assert ratio.short_run_warnings() == []
