"""The toy kit round-trips through from_pretrained and gives a usable, unsaturated policy."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_variants.tasks import toy


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
    assert meta["in_band"], toy.out_of_band_message(meta)  # the warm start reached its band (or says why not)
    low, high = meta["config"]["target_low"], meta["config"]["target_high"]
    assert low <= meta["probe_accuracy"] <= high and meta["steps_taken"] <= meta["config"]["max_steps"]
    heldout = toy.evaluate(toy_kit.model_path, toy_kit.eval_dataset)
    assert 0.10 <= heldout <= 0.60, heldout  # non-trivial and unsaturated: GRPO has a signal
    again = toy.prepare(verbose=False)
    assert again.model_path == toy_kit.model_path  # reused from cache, not retrained


# ---- the warm start's band search, on scripted accuracy curves (no model) ----------------------------
class _ScriptedRun:
    """A stand-in for the warm-start model: ``progress`` grows by lr / base lr per step; accuracy is a
    function of it. Snapshots hold the progress, so a replay repeats exactly what it replays."""

    def __init__(self, curve, base_lr):
        self.curve, self.base_lr, self.progress, self.probes = curve, base_lr, 0.0, 0

    def train_step(self, lr):
        self.progress += lr / self.base_lr
        return 1.0

    def probe(self):
        self.probes += 1
        return self.curve(self.progress)

    def get_state(self):
        return self.progress

    def set_state(self, value):
        self.progress = value


def _search(curve, **overrides):
    config = toy.WarmStartConfig(init_seed=0, **overrides)
    run = _ScriptedRun(curve, config.lr)
    result = toy._train_to_band(config, train_step=run.train_step, probe=run.probe, get_state=run.get_state,
                                set_state=run.set_state)
    return result, run, config


def test_band_search_stops_at_the_first_check_in_band():
    result, run, _ = _search(lambda p: min(0.9, p / 1000))  # 20% at step 200
    assert (result.status, result.step, result.steps_taken, result.replays) == ("in_band", 200, 200, 0)
    assert result.accuracy == 0.2 and run.progress == 200


def test_band_search_replays_an_overshoot_checking_every_step():
    # 10% at step 300, then +5 points a step: the check at 320 sees 90%, far past the band
    result, run, _ = _search(lambda p: 0.1 if p <= 300 else min(0.9, 0.1 + 0.05 * (p - 300)))
    assert result.status == "in_band" and result.replays == 1
    assert result.step == 302 and result.accuracy == pytest.approx(0.2)  # the first step inside the band
    assert result.steps_taken == 320 + 2 and run.progress == 302  # the replay started from step 300's state


def test_band_search_halves_the_lr_when_one_step_jumps_over_the_band():
    # a jump from 10% to 60% inside one step at full lr (at progress 310.6), a ramp through the band below it
    curve = lambda p: 0.1 if p < 310.4 else (0.3 if p < 310.6 else 0.6)  # noqa: E731
    result, run, _ = _search(curve)
    assert result.status == "in_band" and result.accuracy == 0.3
    assert result.replays >= 2 and result.history[-1]["lr"] < toy.WarmStartConfig().lr


def test_band_search_gives_up_at_the_cap_and_returns_the_closest_model():
    result, run, config = _search(lambda p: 0.05 + p / 100_000, max_steps=400)  # never reaches 20%
    assert result.status == "below" and result.steps_taken == 400 and result.step == 400
    assert result.accuracy == pytest.approx(0.054)
    # a curve that only jumps: it cannot land in the band, the closest model is handed back
    result, run, config = _search(lambda p: 0.15 if p < 310.5 else 0.9, max_replays=2)
    assert result.status == "below" and result.replays == 2 and result.accuracy == 0.15
    assert run.progress < 310.5 and result.steps_taken <= config.max_steps


def test_out_of_band_warning_names_the_accuracy_and_what_to_do():
    config = __import__("dataclasses").asdict(toy.WarmStartConfig(init_seed=3))
    meta = {"in_band": False, "probe_accuracy": 0.123, "steps_taken": 1600, "config": config}
    message = toy.out_of_band_message(meta)
    assert "12.3% of 200 problems after 1600 optimizer steps" in message and "below" in message
    assert "GRPO_VARIANTS_TOY_SEED=3" in message and "GRPO_VARIANTS_TOY_SEED=1" in message and "max_steps" in message
    assert toy.out_of_band_message({**meta, "in_band": True}) is None


def test_toy_seed_variable(monkeypatch):
    monkeypatch.delenv(toy.TOY_SEED_ENV, raising=False)
    assert toy.toy_seed() == 0 and toy.WarmStartConfig().init_seed == 0
    monkeypatch.setenv(toy.TOY_SEED_ENV, "7")
    assert toy.toy_seed() == 7 and toy.WarmStartConfig().init_seed == 7
    assert toy.WarmStartConfig().key() != toy.WarmStartConfig(init_seed=0).key()  # its own cache entry
    assert toy.WarmStartConfig().seed == 0  # the problem split does not move: no eval problem leaks in
    monkeypatch.setenv(toy.TOY_SEED_ENV, "one")
    with pytest.raises(toy.ConfigError, match="GRPO_VARIANTS_TOY_SEED='one' is not an integer"):
        toy.toy_seed()


def test_warm_start_replays_an_overshoot_on_the_real_model(tmp_path, monkeypatch):
    """The real loop's snapshots: after an overshoot it replays from the last check below the band, and the
    replayed steps reproduce the first pass bit for bit (same weights, optimizer state and batches)."""
    scripted = iter([0.1, 0.9, 0.1, 0.3])  # checks at steps 2 (below), 4 (past the band), then 3 and 4 again
    seen = []

    def fake_evaluate(model, dataset, tokenizer, **kwargs):
        seen.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return next(scripted)

    monkeypatch.setattr(toy, "evaluate", fake_evaluate)
    tiny = toy.ToyModelConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                              intermediate_size=32)
    config = toy.WarmStartConfig(model=tiny, min_steps=2, check_every=2, max_steps=20, batch_size=8, init_seed=0)
    path = toy.warm_start(tmp_path / "warm", config, verbose=False)
    meta = json.loads((path / "warmstart.json").read_text())
    assert (meta["status"], meta["steps"], meta["replays"], meta["steps_taken"]) == ("in_band", 4, 1, 6)
    assert [h["step"] for h in meta["history"]] == [2, 4, 3, 4] and meta["probe_accuracy"] == 0.3
    first_step4, replayed_step4 = seen[1], seen[3]
    assert all(torch.equal(first_step4[k], replayed_step4[k]) for k in first_step4)  # an exact replay
    assert not all(torch.equal(seen[0][k], first_step4[k]) for k in first_step4)  # and the steps did train


def test_warm_start_out_of_band_warns_fresh_and_cached(tmp_path, monkeypatch):
    scripted = iter([0.05, 0.06])
    monkeypatch.setattr(toy, "evaluate", lambda *args, **kwargs: next(scripted))
    tiny = toy.ToyModelConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                              intermediate_size=32)
    config = toy.WarmStartConfig(model=tiny, min_steps=2, check_every=2, max_steps=4, batch_size=8, init_seed=0)
    expected = r"ended below its accuracy band: probe greedy accuracy 6\.0% of 200 problems after 4 optimizer steps"
    with pytest.warns(UserWarning, match=expected):
        path = toy.warm_start(tmp_path / "warm", config, verbose=False)
    meta = json.loads((path / "warmstart.json").read_text())
    assert (meta["in_band"], meta["status"], meta["steps"]) == (False, "below", 4)
    with pytest.warns(UserWarning, match=expected):  # said again whenever the cached policy is used
        toy.warm_start(tmp_path / "warm", config, verbose=False)
