"""The toy kit round-trips through from_pretrained and gives a usable, unsaturated policy."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_variants import toy


def test_tokenizer_round_trip(tmp_path):
    toy.build_tokenizer(save_to=tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    ids = tok("37+45=")["input_ids"]
    assert len(ids) == 6  # character level
    assert tok.decode(ids) == "37+45="
    assert tok.eos_token == "</s>" and tok.pad_token_id != tok.eos_token_id
    rendered = tok.apply_chat_template([{"role": "user", "content": "1+2="}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<user>1+2=<assistant>"


def test_model_round_trip(tmp_path):
    tok = toy.build_tokenizer(save_to=tmp_path)
    model = toy.build_model(tok)
    assert model.config.model_type == "qwen2"
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 2e6
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    x = torch.tensor([tok("12+3=")["input_ids"]])
    torch.testing.assert_close(model(x).logits, loaded(x).logits)


def test_tokenizer_reloaded_from_model_folder_matches(tmp_path):
    """AutoTokenizer on a qwen2 model folder builds a Qwen2Tokenizer: it must encode like ours."""
    tok = toy.build_tokenizer(save_to=tmp_path)
    toy.build_model(tok).save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in ("37+45=", "84 31=(7)", "<user>1+2=<assistant>12</s>", "9-3= 6"):
        assert reloaded(text)["input_ids"] == tok(text)["input_ids"], text
        assert reloaded.decode(reloaded(text)["input_ids"]) == text


def test_datasets_are_disjoint_and_verifiable():
    train = toy.make_dataset("addition", "train")
    heldout = toy.make_dataset("addition", "eval")
    warm = toy.make_dataset("addition", "warmstart")
    assert set(train.column_names) >= {"prompt", "answer", "difficulty"}
    assert len(heldout) == 500 and len(warm) == 2000 and len(train) == 8100 - 2500
    assert not set(train["prompt"]) & set(heldout["prompt"])
    assert not set(warm["prompt"]) & set(heldout["prompt"])
    for prompt, answer in zip(heldout["prompt"][:50], heldout["answer"][:50]):
        a, b = prompt.rstrip("=").split("+")
        assert int(a) + int(b) == int(answer)
    sub = toy.make_dataset("subtraction", "eval", n=20)
    for prompt, answer in zip(sub["prompt"], sub["answer"]):
        a, b = prompt.rstrip("=").split("-")
        assert int(a) - int(b) == int(answer) >= 0
    conv = toy.make_dataset("addition", "eval", n=2, conversational=True)
    assert conv["prompt"][0][0]["role"] == "user"


def test_bad_task_and_difficulty():
    with pytest.raises(ValueError, match="Unknown toy task"):
        toy.make_dataset("division")
    with pytest.raises(ValueError, match="difficulty"):
        toy.make_dataset("addition", difficulty=7)


def test_toy_reward_values():
    score = toy.make_toy_accuracy()
    assert score(["1+1="] * 4, ["2", " 2</s>", "3", "abc"], answer=["2"] * 4) == [1.0, 1.0, 0.0, 0.0]
    pm1 = toy.make_toy_accuracy(wrong=-1.0)
    assert pm1(["1+1="], [[{"role": "assistant", "content": "2"}]], answer=["2"]) == [1.0]
    assert pm1(["1+1="], ["22"], answer=["2"]) == [-1.0]


def test_warm_start_is_in_band_and_cached(toy_kit):
    meta = json.loads((__import__("pathlib").Path(toy_kit.model_path) / "warmstart.json").read_text())
    assert 0.10 <= meta["probe_accuracy"] <= 0.60
    heldout = toy.evaluate(toy_kit.model_path, toy_kit.eval_dataset)
    assert 0.10 <= heldout <= 0.60, heldout  # non-trivial and unsaturated: GRPO has a signal
    again = toy.prepare(verbose=False)
    assert again.model_path == toy_kit.model_path  # reused from cache, not retrained
