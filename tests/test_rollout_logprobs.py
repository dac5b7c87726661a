"""Behaviour log-probs recorded during HF generate (``behaviour_logprobs``): the recorder on hand-built
logits, equality with TRL's recomputed forward pass, one forward pass fewer per rollout, identical
training, and the fallbacks."""

from __future__ import annotations

import types

import pytest
import torch
from trl import GRPOTrainer

from grpo_variants import ConfigError, GRPOVariantConfig, GRPOVariantTrainer, MuGRPOConfig, MuGRPOTrainer
from grpo_variants.rollout.logprobs import SampledLogprobRecorder

STAGE = dict(stage_prompts=8, updates_per_stage=4)  # 32 completions, 2 mini-batches, 2 passes


# ---- the recorder on hand-built logits --------------------------------------------------------------
def _feed(recorder, logits_steps, fed_tokens):
    """Simulate HF generate: a prefill (3 prompt tokens), then one decoding call per fed-back token."""
    rows = logits_steps[0].size(0)
    out = types.SimpleNamespace(logits=logits_steps[0].unsqueeze(1))
    recorder(None, (), {"input_ids": torch.zeros(rows, 3, dtype=torch.long)}, out)
    for logits, token in zip(logits_steps[1:], fed_tokens, strict=True):
        recorder(None, (), {"input_ids": token.view(rows, 1)}, types.SimpleNamespace(logits=logits.unsqueeze(1)))


def test_recorder_gathers_each_sampled_token_at_temperature():
    logits = [torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]]), torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 5.0]]),
              torch.tensor([[0.5, 0.0, 0.0], [0.0, 2.0, 0.0]])]
    completions = [[2, 0, 1], [0, 2]]  # row 1 stopped after 2 tokens (its third position is padding)
    fed = [torch.tensor([2, 0]), torch.tensor([0, 2])]
    recorder = SampledLogprobRecorder(temperature=0.5)
    _feed(recorder, logits, fed)
    got = recorder.finish(completions)
    assert got.shape == (2, 3) and recorder.failure is None
    for row, ids in enumerate(completions):
        for step, token in enumerate(ids):
            expected = torch.log_softmax(logits[step][row] / 0.5, dim=-1)[token]
            assert torch.isclose(got[row, step], expected, atol=1e-7), (row, step)


@pytest.mark.parametrize(
    ("completions", "reason"),
    [([[1, 1, 1], [1]], "completions longer"), ([[1, 1]], "recorded rows")],
)
def test_recorder_refuses_inconsistent_records(completions, reason):
    recorder = SampledLogprobRecorder(temperature=1.0)
    _feed(recorder, [torch.zeros(2, 3), torch.zeros(2, 3)], [torch.tensor([1, 1])])
    assert recorder.finish(completions) is None
    assert reason in recorder.failure


def test_recorder_refuses_completions_that_are_not_the_sampled_tokens():
    recorder = SampledLogprobRecorder(temperature=1.0)
    _feed(recorder, [torch.zeros(2, 3)] * 3, [torch.tensor([2, 0]), torch.tensor([1, 2])])
    assert recorder.finish([[2, 1, 0], [0, 1]]) is None  # row 1 sampled 0 then 2, the completion says 0, 1
    assert "differ from the tokens generate sampled" in recorder.failure


def test_recorder_refuses_a_second_prefill():
    recorder = SampledLogprobRecorder(temperature=1.0)
    _feed(recorder, [torch.zeros(2, 3), torch.zeros(2, 3)], [torch.tensor([1, 1])])
    recorder(None, (), {"input_ids": torch.zeros(2, 4, dtype=torch.long)}, types.SimpleNamespace(logits=torch.zeros(2, 4, 3)))
    assert "decoding input" in recorder.failure


# ---- inside a trainer -------------------------------------------------------------------------------
TRL_LOGPS = GRPOTrainer._get_per_token_logps_and_entropies  # TRL's forward pass, unpatched


def _count_trl_passes(monkeypatch) -> list:
    """Record every log-prob forward pass from now on (the model it ran): TRL's padded one, or the packed one
    that replaces it under padding_free (the default "auto" packs the toy model)."""
    from grpo_variants.rollout.packed_forward import PaddingFreeMixin

    calls = []
    forward = PaddingFreeMixin._get_per_token_logps_and_entropies  # packed, or TRL's through super()

    def counting(self, model, *args, **kwargs):
        calls.append(model)
        return forward(self, model, *args, **kwargs)

    monkeypatch.setattr(PaddingFreeMixin, "_get_per_token_logps_and_entropies", counting)
    return calls


def _stage_rollout(trainer, dataset) -> dict:
    """One training-mode rollout of 8 prompts x 4 (one µ-GRPO stage of STAGE)."""
    trainer.model.train()
    return trainer._generate_and_score_completions([dataset[i] for i in range(8) for _ in range(4)])


@torch.no_grad()
def _recompute(trainer, output) -> torch.Tensor:
    """TRL's forward pass over a rollout's sequences: the log-probs the record must match."""
    ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
    return TRL_LOGPS(trainer, trainer.model, ids, attention, output["completion_ids"].size(1))[0]


def _mu_trainer(toy_model_path, dataset, make_args, tmp_path, name, **overrides):
    args = make_args(MuGRPOConfig, output_dir=str(tmp_path / name), max_steps=4, temperature=0.7,
                     **{**STAGE, **overrides})
    return MuGRPOTrainer(model=toy_model_path, reward_funcs="toy_accuracy", args=args, train_dataset=dataset)


def test_recorded_equals_recomputed_and_skips_the_forward_pass(
    toy_model_path, small_train_dataset, make_args, tmp_path, monkeypatch
):
    trainer = _mu_trainer(toy_model_path, small_train_dataset, make_args, tmp_path, "r", behaviour_logprobs="rollout")
    assert trainer._record_rollout_logprobs
    calls = _count_trl_passes(monkeypatch)
    output = _stage_rollout(trainer, small_train_dataset)
    assert calls == []  # no behaviour forward pass: the log-probs came from generate
    recorded = output["old_per_token_logps"]
    recomputed = _recompute(trainer, output)
    mask = output["completion_mask"].bool()
    assert recorded.shape == recomputed.shape and mask.sum() > 20
    difference = (recorded - recomputed).abs()[mask]
    assert difference.max().item() < 1e-5, difference.max().item()
    assert not torch.equal(recorded[mask], torch.zeros_like(recorded[mask]))  # real values, not a placeholder


def test_training_identical_with_recorded_and_recomputed_logprobs(
    toy_model_path, small_train_dataset, make_args, tmp_path
):
    runs = {}
    for mode in ("rollout", "recompute"):
        trainer = _mu_trainer(toy_model_path, small_train_dataset, make_args, tmp_path, mode, behaviour_logprobs=mode)
        trainer.train()
        runs[mode] = trainer
    losses = {m: [r["loss"] for r in t.state.log_history if "loss" in r] for m, t in runs.items()}
    assert len(losses["rollout"]) == 4
    assert losses["rollout"] == pytest.approx(losses["recompute"], abs=1e-5)
    recorded = [r for r in runs["rollout"].state.log_history if "rollout_logprobs/recorded" in r]
    assert recorded and not any("rollout_logprobs/recorded" in r for r in runs["recompute"].state.log_history)
    for name, value in runs["rollout"].model.named_parameters():
        assert torch.allclose(value, dict(runs["recompute"].model.named_parameters())[name], atol=1e-5), name
    assert runs["rollout"].rollout_logprob_failures == []


def test_on_policy_steps_record_nothing(toy_model_path, small_train_dataset, make_args):
    trainer = GRPOVariantTrainer(model=toy_model_path, reward_funcs="toy_accuracy",
                                 args=make_args(GRPOVariantConfig, max_steps=1), train_dataset=small_train_dataset)
    assert trainer._record_rollout_logprobs and not trainer._trl_needs_old_logps()
    trainer.train()
    assert not any("rollout_logprobs/recorded" in r for r in trainer.state.log_history)


def test_failed_record_falls_back_to_trl(toy_model_path, small_train_dataset, make_args, tmp_path, monkeypatch):
    trainer = _mu_trainer(toy_model_path, small_train_dataset, make_args, tmp_path, "f")
    monkeypatch.setattr(SampledLogprobRecorder, "finish", lambda self, ids: setattr(self, "failure", "forced") or None)
    calls = _count_trl_passes(monkeypatch)
    output = _stage_rollout(trainer, small_train_dataset)
    assert calls == [trainer.model] and output["old_per_token_logps"] is not None
    assert trainer.rollout_logprob_failures == ["forced"]


def test_mode_selection(toy_model_path, small_train_dataset, make_args, monkeypatch):
    def build(**overrides):
        return GRPOVariantTrainer(model=toy_model_path, reward_funcs="toy_accuracy",
                                  args=make_args(GRPOVariantConfig, **overrides), train_dataset=small_train_dataset)

    assert build(behaviour_logprobs="auto")._record_rollout_logprobs
    assert not build(behaviour_logprobs="recompute")._record_rollout_logprobs
    with pytest.raises(ConfigError, match="behaviour_logprobs='maybe' is not valid"):
        make_args(GRPOVariantConfig, behaviour_logprobs="maybe")
    # bf16 generation differs from a full forward: auto recomputes (checked on the flag, no bf16 run on CPU)
    trainer = build()
    monkeypatch.setattr(trainer.args, "bf16", True)
    assert not trainer._rollout_logprobs_supported()
    trainer.args.bf16 = False
    trainer.rollout_func = lambda prompts, t: None
    assert not trainer._rollout_logprobs_supported()
    trainer.args.behaviour_logprobs = "rollout"
    with pytest.raises(ConfigError, match=r"\['rollout_func'\] bypasses"):
        trainer._rollout_logprobs_supported()


def test_rewritten_completions_fall_back_to_trl(toy_model_path, small_train_dataset, make_args, tmp_path):
    """A wrapper that replaces the sampled completions (as tests/_zero3_worker.py does) must not get the
    log-probs of tokens it threw away: the record is refused and TRL's pass runs."""
    trainer = _mu_trainer(toy_model_path, small_train_dataset, make_args, tmp_path, "w")
    original = trainer._generate_single_turn

    def rewritten(prompt_ids, *args, **kwargs):
        ids, logprobs = original(prompt_ids, *args, **kwargs)
        return [[5, 6, 7, trainer.processing_class.eos_token_id][: len(x) or 1] for x in ids], logprobs

    trainer._generate_single_turn = rewritten
    output = _stage_rollout(trainer, small_train_dataset)
    assert trainer.rollout_logprob_failures and "differ" in trainer.rollout_logprob_failures[0]
    expected = _recompute(trainer, output)
    assert torch.equal(output["old_per_token_logps"], expected)


def test_recorded_under_lora(toy_model_path, small_train_dataset, make_args, tmp_path, monkeypatch):
    """With a PEFT adapter, generate runs the base causal LM inside PeftModel: the hook sits there, and the
    record equals TRL's recomputed pass through the adapted model."""
    from grpo_variants.runtime.scale import lora_config

    args = make_args(MuGRPOConfig, output_dir=str(tmp_path / "lora"), max_steps=4, temperature=0.7, **STAGE)
    trainer = MuGRPOTrainer(model=toy_model_path, reward_funcs="toy_accuracy", args=args,
                            train_dataset=small_train_dataset, peft_config=lora_config(r=4))
    with torch.no_grad():  # a non-zero adapter, so that the record must see it
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    calls = _count_trl_passes(monkeypatch)
    output = _stage_rollout(trainer, small_train_dataset)
    assert calls == [] and trainer.rollout_logprob_failures == []
    recomputed = _recompute(trainer, output)
    with trainer.model.disable_adapter():
        base = _recompute(trainer, output)
    mask = output["completion_mask"].bool()
    assert (output["old_per_token_logps"] - recomputed).abs()[mask].max().item() < 1e-5
    assert (base - recomputed).abs()[mask].max().item() > 1e-3  # the adapter matters: the check above could fail


# ---- the training loader fetches a generation batch once -------------------------------------------
class _CountingRows(torch.utils.data.Dataset):
    """A map-style dataset that counts the rows it is asked for."""

    def __init__(self, dataset):
        self.dataset, self.fetched = dataset, 0

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        self.fetched += 1
        return self.dataset[index]


def test_train_loader_fetches_each_generation_batch_once(toy_model_path, small_train_dataset, make_args, tmp_path):
    trainer = _mu_trainer(toy_model_path, small_train_dataset, make_args, tmp_path, "loader")  # 32-row stages
    rows = trainer.train_dataset = _CountingRows(small_train_dataset)  # TRL checks the type only when built
    assert trainer.args.steps_per_generation * trainer.num_iterations == 4
    batches = []
    for batch in trainer.get_train_dataloader():
        batches.append(batch)
        if len(batches) == 8:  # two stages, four micro-steps each
            break
    # TRL's sampler asks for each stage's 32 rows at all 4 micro-steps; they are fetched once. accelerate
    # reads one batch ahead, so the third stage's rows were fetched too: 3 x 32, not 9 x 32 = 288.
    assert rows.fetched == 3 * 32
    assert all(len(b) == 32 for b in batches)
    assert [b[0] for b in batches[:4]] == [batches[0][0]] * 4 and batches[4][0] is not batches[0][0]
    trainer.model.train()
    assert isinstance(trainer._prepare_inputs(batches[0]), dict)  # the wrapped rows reach TRL as a list
