"""The chain-of-thought toy task: traces, reward, splits, refinement rows, and the mechanism metric helpers."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import AutoTokenizer

from grpo_variants import toy, toy_reasoning as tr
from grpo_variants.errors import ConfigError
from grpo_variants.mechanisms import lengths_by_outcome
from grpo_variants.rewards.registry import get_reward


def test_traces_state_the_sum_and_grow_with_verbosity_and_difficulty():
    ops = [7, 5, 9]
    assert tr.make_trace(ops, "terse") == (">21", 21)
    assert tr.make_trace(ops, "short") == ("12,21>21", 21)
    assert tr.make_trace(ops, "full") == ("7+5=12,12+9=21>21", 21)
    assert tr.make_trace(ops, "verbose") == ("7+5=7+3+2=12,12+9=12+8+1=21>21", 21)  # "make ten" when crossing
    assert tr.make_trace([7, 3, 1], "verbose") == ("7+3=10,10+1=11>11", 11)  # no ten crossed: plain steps
    # a mistake is carried to the end
    assert tr.make_trace(ops, "full", mistake_at=0, delta=10) == ("7+5=22,22+9=31>31", 31)
    for form in ("short", "full", "verbose"):
        lengths = [len(tr.make_trace([9] * (2 * d + 1), form)[0]) for d in tr.LEVELS]
        assert lengths == sorted(lengths) and lengths[0] < lengths[-1]
    assert len(tr.make_trace([9] * 7, "verbose")[0]) > tr.MAX_COMPLETION_LENGTH  # the budget truncates some
    assert len(tr.make_trace([9] * 7, "full")[0]) < tr.MAX_COMPLETION_LENGTH


def test_reward_reads_the_answer_after_the_last_marker():
    score = get_reward("toy_chain_accuracy")
    completions = ["12,21>21", "12>12", "7+5=12,12+9=2", ">21", "21", "7+5=12>12,12+9=21>21"]
    assert score(None, completions, ["21"] * 6) == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    conversational = [[{"role": "assistant", "content": "12,21>21"}]]
    assert score(None, conversational, ["21"]) == [1.0]
    assert get_reward("toy_chain_accuracy_pm1")(None, ["1>2", ">3"], ["3", "3"]) == [-1.0, 1.0]


def test_splits_are_disjoint_and_levels_mixed():
    sets = {s: tr.make_dataset(s) for s in ("eval", "warmstart", "train")}
    prompts = {s: set(d["prompt"]) for s, d in sets.items()}
    assert not prompts["eval"] & prompts["train"] and not prompts["eval"] & prompts["warmstart"]
    assert not prompts["warmstart"] & prompts["train"]
    assert len(sets["eval"]) == 500 and set(sets["eval"]["difficulty"]) == set(tr.DEFAULT_LEVELS)
    row = sets["eval"][0]
    assert sum(int(x) for x in row["prompt"].rstrip("=").split("+")) == int(row["answer"])
    assert len(row["prompt"].split("+")) == 2 * row["difficulty"] + 1
    with pytest.raises(ConfigError):
        tr.make_dataset("eval", difficulty=9)


def test_refinement_rows_use_igrpos_template_and_target_the_correct_trace():
    from grpo_variants.lab import toy_preset

    rng = random.Random(0)
    for _ in range(50):
        ops = [rng.randint(1, 9) for _ in range(5)]
        prompt, target = tr.make_refinement_row(rng, ops)
        q = tr._prompt(ops)
        assert prompt.startswith(q + "(") and prompt.endswith(")" + q)
        assert tr.parse_answer(target) == sum(ops)
    assert toy_preset("igrpo", {"num_generations": 8})["draft_template"] == tr.DRAFT_TEMPLATE


def test_tokenizer_round_trips_the_new_characters(tmp_path):
    tok = tr.build_tokenizer(save_to=tmp_path)
    toy.build_model(tok, toy.ToyModelConfig(max_position_embeddings=tr.MAX_POSITIONS)).save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "7+5+9=(7+5=12,12+9=21>21)7+5+9="
    assert reloaded(text)["input_ids"] == tok(text)["input_ids"]
    assert len(tok(text)["input_ids"]) == len(text)  # one token per character
    assert reloaded.decode(reloaded(text)["input_ids"]) == text
    assert toy.build_tokenizer()("37+45=")["input_ids"] == reloaded("37+45=")["input_ids"]  # old ids unchanged


def test_greedy_evaluation_reports_lengths_and_truncation(tmp_path):
    tok = tr.build_tokenizer(save_to=tmp_path)
    model = toy.build_model(tok, toy.ToyModelConfig(hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                                                    max_position_embeddings=tr.MAX_POSITIONS))
    data = tr.make_dataset("eval", n=8)
    out = tr.evaluate_details(model, data, tok, max_new_tokens=5)
    assert out["problems"] == 8 and 0.0 <= out["accuracy"] <= 1.0
    assert 0.0 <= out["truncation_rate"] <= 1.0 and 1 <= out["mean_length"] <= 5
    assert set(out["accuracy_by_level"]) == {str(d) for d in set(data["difficulty"])}


def test_lengths_by_outcome_on_a_hand_built_batch():
    lengths = torch.tensor([10, 20, 30, 40, 50])
    rewards = torch.tensor([1.0, 0.0, 1.0, -1.0, float("nan")])
    out = lengths_by_outcome(lengths, rewards)
    assert out["mean_length_right"] == 20.0  # (10 + 30) / 2
    assert out["mean_length_wrong"] == 30.0  # (20 + 40) / 2, the unscored row left out
    assert out["right_fraction"] == 0.5
    none_right = lengths_by_outcome(torch.tensor([3, 5]), torch.tensor([0.0, 0.0]))
    assert math.isnan(none_right["mean_length_right"]) and none_right["mean_length_wrong"] == 4.0


def test_lab_rows_carry_the_mechanism_columns():
    from grpo_variants.lab import COLUMNS, MECHANISM_COLUMNS, _records_to_rows, _summarise

    records = [
        {"step": 1, "budget/generated_tokens": 100, "completions/mean_length_right": 12.0,
         "completions/mean_length_wrong": 30.0, "completions/clipped_ratio": 0.25, "dynamic_sampling/pass_rate": 0.75,
         "fipo/weight_mean": 1.05, "igrpo/draft_reward_mean": 0.3, "igrpo/refined_reward_mean": 0.5},
        {"step": 2, "budget/generated_tokens": 200, "completions/mean_length_right": 14.0,
         "completions/mean_length_wrong": 20.0, "completions/clipped_ratio": 0.05, "dynamic_sampling/pass_rate": 0.25},
    ]
    rows = _records_to_rows(records, "x", 0)
    assert set(MECHANISM_COLUMNS) <= set(COLUMNS) and set(COLUMNS) <= set(rows[0])
    assert rows[0]["ds_drop_rate"] == 0.25 and rows[1]["ds_drop_rate"] == 0.75
    summary = _summarise("x", rows, {0: 0.1}, {0: True})
    assert summary["mean_length_wrong"] == 25.0 and summary["truncation_rate_start"] == 0.25
    assert summary["truncation_rate"] == pytest.approx(0.15) and summary["ds_drop_rate"] == 0.5
    assert summary["igrpo_refined_accuracy"] == 0.5 and summary["fipo_weight_mean"] == 1.05


def test_trainer_logs_lengths_of_right_and_wrong_completions():
    """The base trainer's hook on a hand-built rollout: 3 completions of 2 / 4 / 9 tokens, rewards 1 / 0 / 0."""
    from collections import defaultdict
    from types import SimpleNamespace

    from grpo_variants.trainer import GRPOVariantTrainer

    fake = SimpleNamespace(
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t),
        model=SimpleNamespace(training=True),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        weighted_rewards=lambda: torch.tensor([1.0, 0.0, 0.0]),
    )
    GRPOVariantTrainer._log_lengths_by_outcome(fake, [[1, 2], [1, 2, 3, 4], list(range(9))])
    logged = fake._metrics["train"]
    assert logged["completions/mean_length_right"] == [2.0]
    assert logged["completions/mean_length_wrong"] == [6.5]
    assert logged["completions/right_fraction"] == [pytest.approx(1 / 3)]
    fake.weighted_rewards = lambda: torch.tensor([0.0, 0.0, 0.0])  # no right completion: that side logs nothing
    GRPOVariantTrainer._log_lengths_by_outcome(fake, [[1], [1], [1]])
    assert logged["completions/mean_length_right"] == [2.0] and len(logged["completions/mean_length_wrong"]) == 2


def test_toy_prepare_dispatches_the_chain_task():
    kit = toy.prepare(task="chain", warm=False, verbose=False)
    assert isinstance(kit, tr.ReasoningKit) and kit.reward == "toy_chain_accuracy"
    assert kit.max_completion_length == tr.MAX_COMPLETION_LENGTH and len(kit.eval_dataset) == 500
    assert AutoTokenizer.from_pretrained(kit.model_path)(">,")["input_ids"] == tr.build_tokenizer()(">,")["input_ids"]
    assert toy.prepare(task="addition", warm=False, verbose=False).eval_dataset[0]["difficulty"] == 2


def test_a_first_chain_warm_start_says_it_takes_minutes(tmp_path, monkeypatch, capsys):
    """Before the chain policy's first warm start (minutes) one line says what is happening and how long it
    takes; a cached entry and verbose=False print nothing. The training itself is stopped at its first call."""

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(tr, "build_tokenizer", stop)  # the first thing the warm start does after the note
    with pytest.raises(Stop):
        tr.warm_start(output_dir=tmp_path / "fresh", verbose=True)
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1 and out.startswith("[chain warm start] training the chain-task policy")
    assert "about 2 minutes" in out and str(tmp_path / "fresh") in out
    with pytest.raises(Stop):
        tr.warm_start(output_dir=tmp_path / "quiet", verbose=False)
    (tmp_path / "cached").mkdir()
    (tmp_path / "cached" / "warmstart.json").write_text("{}")
    assert tr.warm_start(output_dir=tmp_path / "cached", verbose=True) == tmp_path / "cached"
    assert capsys.readouterr().out == ""
