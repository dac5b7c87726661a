"""vLLM rollouts executed for real, on CPU: the engine tier (``make setup-vllm``, then ``make test-vllm``).

vLLM's CPU build lives in its own environment (.venv-vllm: it pins transformers<5.18 and its own torch build),
so in the main environment this module is skipped, saying so. Every toy trainer here uses one shared engine
(``vllm_reuse_engine=True``: one engine per model and process, each trainer syncs its weights into it before
its first rollout) in float32, eager (``vllm_enforce_eager=True``: ~3 s to start instead of ~45 s). The
reference for "exact" is a fresh engine (same dtype) loaded from the trained weights, started for the check
and dropped after it. Server mode has one test of its own (slow, so it runs first): it starts one
``grpo-variants vllm-serve`` process, trains against it and stops it.
"""

from __future__ import annotations

import gc
import math
import os
import shutil
import weakref

import pytest
import torch

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed in this environment: the engine tier runs in its own, "
    "`make setup-vllm` then `make test-vllm` (docs/vllm.md)"
)

from conftest import position_reward, tiny_args

from grpo_variants import ConfigError, GRPOVariantConfig, get_variant
from grpo_variants.rollout import vllm_engine
from grpo_variants.variants.igrpo import TOY_DRAFT_TEMPLATE

KV_BYTES = 128 << 20  # each toy engine's KV cache (vllm_kv_cache_memory_bytes): the toy needs far less
ENGINE = dict(use_vllm=True, vllm_mode="colocate", vllm_dtype="float32", vllm_enforce_eager=True,
              vllm_reuse_engine=True, vllm_kv_cache_memory_bytes=KV_BYTES)
EXACT = 1e-3  # the bound on |synced engine - fresh engine| log-probs; measured: 0 (bit-identical)
NOISE = 1e-4  # TRL's sampling/sampling_logp_difference/mean right after a sync, float32 engine
_REFERENCE_ENGINES: list = []  # the fresh engines of the exactness checks (see _fresh_engine_logps)


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------
def _prompt_logps(llm, sequences) -> list[torch.Tensor]:
    """The engine's log-probs of each token of each sequence given its prefix (vLLM prompt log-probs)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    outputs = llm.generate([{"prompt_token_ids": list(s)} for s in sequences], params, use_tqdm=False)
    result = []
    for seq, out in zip(sequences, outputs, strict=True):
        result.append(torch.tensor([entry[tok].logprob for tok, entry in zip(seq[1:], out.prompt_logprobs[1:],
                                                                            strict=True)]))
    return result


def _gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    gap = max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))
    print(f"max |log-prob difference| over {sum(len(x) for x in a)} tokens: {gap:.3g}")  # shown with -s / -rP
    return gap


def _fresh_engine_logps(model, source_dir, target_dir, sequences) -> list[torch.Tensor]:
    """Log-probs from a fresh engine (float32, eager) loaded from ``model``'s weights saved to ``target_dir``."""
    shutil.copytree(source_dir, target_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    model.save_pretrained(target_dir)
    saved = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override the small KV cache asked here
    try:
        llm = vllm_engine.start_engine(str(target_dir), dtype="float32", enforce_eager=True, max_num_seqs=16,
                                       kv_cache_memory_bytes=256 << 20)
    finally:
        if saved is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = saved
    # kept alive until the module ends: shutting an engine down tears down vLLM's process-wide parallel state,
    # which the shared engine still uses
    _REFERENCE_ENGINES.append(llm)
    return _prompt_logps(llm, sequences)


def _sequences(trainer, dataset, n=4):
    """Fixed token sequences: toy prompts followed by an answer-like completion (deterministic)."""
    tok = trainer.processing_class
    texts = [dataset[i]["prompt"] + str(10 + 7 * i) for i in range(n)]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def _logged(trainer, key):
    return [r[key] for r in trainer.state.log_history if key in r]


def _toy_trainer(name, tmp_path, kit, reward_funcs=position_reward, trainer_cls=None, peft_config=None,
                 **overrides):
    spec = get_variant(name)
    values = dict(ENGINE, max_steps=2, per_device_train_batch_size=8, num_generations=4, reward_cache=False,
                  output_dir=str(tmp_path / name), report_to="none")
    values.update(overrides)
    args = tiny_args(spec.config_cls, **values)
    cls = trainer_cls or spec.trainer_cls
    return cls(model=kit.model_path, reward_funcs=reward_funcs, args=args, train_dataset=kit.train,
               peft_config=peft_config)


class _Kit:
    def __init__(self, kit):
        self.model_path = kit.model_path
        self.train = kit.train_dataset.select(range(128))


@pytest.fixture(scope="module")
def kit(toy_kit):
    return _Kit(toy_kit)


_FIRST: dict = {}  # what the shared engine's first trainer saw (test_kv_cache_is_the_size_asked_for)


@pytest.fixture(scope="module")
def shared_engine(kit, tmp_path_factory):
    """The module's one toy engine: started by a first trainer, reused by every other one (asserted there).
    VLLM_CPU_KVCACHE_SPACE is set while it starts: vllm_kv_cache_memory_bytes must win over it."""
    saved = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "2"
    try:
        trainer = _toy_trainer("grpo", tmp_path_factory.mktemp("first"), kit, max_steps=1)
    finally:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE")
        if saved is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = saved
    _FIRST.update(announcement=trainer.vllm_generation.announcement(), env_after=saved)
    assert not trainer.vllm_generation.engine_reused
    trainer.train()
    yield trainer.vllm_generation.llm
    _REFERENCE_ENGINES.clear()
    vllm_engine.release_engines()
    gc.collect()


# ---------------------------------------------------------------------------------------------------------------
# Construction: sleep mode, models vLLM cannot load here, dtype
# ---------------------------------------------------------------------------------------------------------------
def test_sleep_mode_refused_on_cpu_in_one_line():
    with pytest.raises(ConfigError, match="vllm_enable_sleep_mode") as info:
        GRPOVariantConfig(output_dir="o", use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True)
    assert "\n" not in str(info.value)


def _torchvision_loads() -> bool:
    try:
        import torchvision.ops  # noqa: F401  (PyPI's CUDA build fails here beside a CPU torch)
    except Exception:
        return False
    return True


def _tiny_gemma3(folder, tokenizer_source):
    """A Gemma3 vision-language model (random, a few thousand parameters) with a processor, saved to ``folder``."""
    from transformers import AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    image_tokens = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer.add_tokens(list(image_tokens.values()), special_tokens=True)
    tokenizer._set_model_specific_special_tokens(special_tokens=image_tokens)
    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in image_tokens.items()}
    config = Gemma3Config(
        text_config=dict(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=8, intermediate_size=16, vocab_size=len(tokenizer), layer_types=None),
        vision_config=dict(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=16,
                           image_size=28, patch_size=14),
        boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"], image_token_index=ids["image_token"],
        mm_tokens_per_image=4)
    Gemma3ForConditionalGeneration(config).save_pretrained(folder)
    Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 28, "width": 28}), tokenizer=tokenizer,
                    image_seq_length=4).save_pretrained(folder)
    return folder


def test_a_model_vllm_cannot_load_here_is_refused_at_construction_in_one_line(kit, tmp_path, monkeypatch):
    """vLLM's vision-language models import torchvision, which no CPU machine fed from PyPI can load: a trainer with
    use_vllm=True and such a model is refused at construction, in one line naming the model, the module and the
    package, before any engine starts (vLLM itself fails deep in its start-up with "failed to be inspected")."""
    import trl.generation.vllm_generation as trl_generation

    model = _tiny_gemma3(tmp_path / "gemma3", kit.model_path)
    if _torchvision_loads():  # a machine with a working torchvision: vLLM can load it, nothing to refuse
        from transformers import AutoConfig

        vllm_engine.check_vllm_can_load(type("M", (), {"config": AutoConfig.from_pretrained(model)})())
        return

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was started before the model was checked")

    monkeypatch.setattr(trl_generation, "LLM", no_engine)
    engines = dict(vllm_engine._ENGINES)
    args = tiny_args(get_variant("grpo").config_cls, **{**ENGINE, "vllm_reuse_engine": False},
                     max_steps=2, per_device_train_batch_size=2, num_generations=2, output_dir=str(tmp_path / "o"),
                     report_to="none")
    with pytest.raises(ConfigError) as info:
        get_variant("grpo").trainer_cls(model=str(model), reward_funcs=position_reward, args=args,
                                        train_dataset=kit.train)
    message = str(info.value)
    assert "\n" not in message
    assert "Gemma3ForConditionalGeneration" in message and "gemma3_mm" in message and "'torchvision'" in message
    assert "use_vllm=False" in message
    assert vllm_engine._ENGINES == engines


def test_vllm_serve_refuses_a_model_vllm_cannot_load_here_before_starting(kit, tmp_path, capsys, monkeypatch):
    """The same check in `grpo-variants vllm-serve`: one line and exit 2, before vLLM's server is started."""
    from grpo_variants.rollout import vllm_server

    model = _tiny_gemma3(tmp_path / "gemma3", kit.model_path)
    import vllm.entrypoints.cli.main as vllm_cli

    def no_server():
        raise AssertionError("vLLM's server was started before the model was checked")

    monkeypatch.setattr(vllm_cli, "main", no_server)
    if _torchvision_loads():
        assert vllm_server._load_problem(str(model)) is None
        return
    assert vllm_server.main(["--model", str(model)]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("grpo-variants vllm-serve: error: vLLM cannot load Gemma3ForConditionalGeneration")
    assert "'torchvision'" in error


def test_engine_dtype_is_announced_in_one_line_and_chosen(shared_engine, kit, tmp_path, caplog):
    trainer = _toy_trainer("grpo", tmp_path, kit)
    generation = trainer.vllm_generation
    assert generation.llm is shared_engine and generation.engine_reused
    assert vllm_engine.engine_dtype(generation.llm) == torch.float32
    line = generation.announcement()
    assert "\n" not in line and "dtype float32" in line and "vllm_dtype='float32'" in line and "reused" in line
    with pytest.raises(ConfigError, match="vllm_dtype"):
        GRPOVariantConfig(output_dir="o", use_vllm=True, vllm_dtype="float64")


def test_kv_cache_is_the_size_asked_for_and_wins_over_the_environment(shared_engine):
    """vllm_kv_cache_memory_bytes sizes the engine's KV cache (its blocks fill the bytes asked, no more), wins over
    VLLM_CPU_KVCACHE_SPACE (set to 2 GiB while the shared engine started) and is said in the announcement."""
    cache = shared_engine.llm_engine.vllm_config.cache_config
    hf = shared_engine.llm_engine.vllm_config.model_config.hf_config
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    per_token = 2 * hf.num_hidden_layers * kv_heads * head_dim * 4  # keys and values, float32
    held = cache.num_gpu_blocks * cache.block_size * per_token
    assert cache.kv_cache_memory_bytes == KV_BYTES and KV_BYTES // 2 < held <= KV_BYTES, (held, KV_BYTES)
    line = _FIRST["announcement"]
    assert "\n" not in line and "KV cache 128 MiB (vllm_kv_cache_memory_bytes; VLLM_CPU_KVCACHE_SPACE=2 ignored)" in line
    assert os.environ.get("VLLM_CPU_KVCACHE_SPACE") == _FIRST["env_after"]  # the environment is given back
    with pytest.raises(ConfigError, match="vllm_kv_cache_memory_bytes=0 must be a positive") as info:
        GRPOVariantConfig(output_dir="o", use_vllm=True, vllm_kv_cache_memory_bytes=0)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="-- --kv-cache-memory-bytes 1024"):
        GRPOVariantConfig(output_dir="o", use_vllm=True, vllm_mode="server", vllm_kv_cache_memory_bytes=1024)


# ---------------------------------------------------------------------------------------------------------------
# Exact sync
# ---------------------------------------------------------------------------------------------------------------
def test_sync_is_exact_with_tied_embeddings_after_many_updates_at_a_large_learning_rate(shared_engine, kit,
                                                                                         tmp_path):
    trainer = _toy_trainer("grpo", tmp_path, kit, max_steps=6, learning_rate=1e-2, lr_scheduler_type="constant")
    model = trainer.model
    assert model.config.tie_word_embeddings  # the toy model ties lm_head to the embeddings, like SmolLM2
    embed_before = model.get_input_embeddings().weight.detach().clone()
    trainer.train()
    assert trainer.vllm_generation.llm is shared_engine
    assert trainer.vllm_generation.sync_count == 6  # one sync before each step's rollout
    moved = (model.get_input_embeddings().weight - embed_before).abs().max().item()
    assert moved > 1e-2  # the tied weight moved: a stale output layer would show
    # float32 engine, synced before every rollout: TRL's sampling log-prob gap is float noise at every step
    gaps = _logged(trainer, "sampling/sampling_logp_difference/mean")
    assert len(gaps) == 6 and max(gaps) < NOISE, gaps

    trainer.vllm_generation.sync_weights()  # the last update is not synced yet
    sequences = _sequences(trainer, kit.train)
    synced = _prompt_logps(shared_engine, sequences)
    fresh = _fresh_engine_logps(model, kit.model_path, tmp_path / "fresh", sequences)
    assert _gap(synced, fresh) <= EXACT

    # the check is sensitive: vLLM's reload alone (no re-processing of the tied output layer) is not exact
    runner = shared_engine.llm_engine.model_executor.driver_worker.model_runner
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)  # any update; the reload below re-processes every layer but the tied one
    runner.reload_weights(weights_iterator=trainer.vllm_generation._iter_named_params())
    shared_engine.reset_prefix_cache()
    stale = _prompt_logps(shared_engine, sequences)
    trainer.vllm_generation.sync_weights()
    exact = _prompt_logps(shared_engine, sequences)
    assert _gap(stale, exact) > EXACT


def test_sync_is_exact_with_lora(shared_engine, kit, tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"], task_type="CAUSAL_LM")
    trainer = _toy_trainer("grpo", tmp_path, kit, peft_config=lora, max_steps=3, learning_rate=2e-2,
                           lr_scheduler_type="constant")
    assert trainer.vllm_generation.llm is shared_engine
    trainer.train()
    gaps = _logged(trainer, "sampling/sampling_logp_difference/mean")
    assert len(gaps) == 3 and max(gaps) < NOISE, gaps
    trainer.vllm_generation.sync_weights()
    sequences = _sequences(trainer, kit.train)
    synced = _prompt_logps(shared_engine, sequences)
    merged = trainer.model.merge_and_unload()
    fresh = _fresh_engine_logps(merged, kit.model_path, tmp_path / "fresh", sequences)
    assert _gap(synced, fresh) <= EXACT


# ---------------------------------------------------------------------------------------------------------------
# Every variant trains with the engine
# ---------------------------------------------------------------------------------------------------------------
VARIANTS = {
    "grpo": {},
    "dapo": {},
    "dr_grpo": {},
    "gspo": {},
    "gspo_token": {},
    "mu_grpo": dict(stage_prompts=4, updates_per_stage=2),
    "igrpo": dict(num_drafts=3, num_generations=4, draft_template=TOY_DRAFT_TEMPLATE),
    "fipo": {},
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_variant_trains_two_steps_with_the_engine(name, shared_engine, kit, tmp_path):
    trainer = _toy_trainer(name, tmp_path, kit, learning_rate=1e-3, **VARIANTS[name])
    assert trainer.vllm_generation.llm is shared_engine and trainer.vllm_generation.engine_reused
    engine_calls = []
    generate = trainer.vllm_generation.generate

    def counting(*args, **kwargs):
        engine_calls.append(1)
        return generate(*args, **kwargs)

    trainer.vllm_generation.generate = counting
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    result = trainer.train()
    assert trainer.state.global_step == 2 and math.isfinite(result.training_loss)
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.named_parameters())
    assert engine_calls  # the rollouts came from the engine
    gaps = _logged(trainer, "sampling/sampling_logp_difference/mean")
    assert gaps and max(gaps) < NOISE, gaps


# ---------------------------------------------------------------------------------------------------------------
# The variants' machinery with the engine
# ---------------------------------------------------------------------------------------------------------------
def test_mu_grpo_veto_acts_on_ratios_to_recomputed_behaviour_logprobs(shared_engine, kit, tmp_path, monkeypatch):
    """µ-GRPO with vLLM: the behaviour log-probs are recomputed by the trainer's model when the stage is generated
    (TRL's forward pass; ``behaviour_logprobs='auto'`` resolves to recompute with vLLM); the engine's sampling
    log-probs enter only TRL's importance-sampling weight. The veto triggers on r = exp(logp - behaviour), A < 0."""
    from grpo_variants import trainer as base_trainer
    from grpo_variants.variants.mu_grpo import MuGRPOTrainer

    class Crafted(MuGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            captured_rollouts.append({k: out[k].clone() for k in ("old_per_token_logps", "sampling_per_token_logps",
                                                                   "importance_sampling_ratio")})
            rows = out["advantages"].shape[0]
            out["advantages"] = torch.tensor([-1.0, 1.0, 0.0, -0.5] * (rows // 4))
            old = out["old_per_token_logps"].clone()
            old[:, 0] += 30.0  # ratio ~ e^-30 at every first token: triggers wherever A < 0, by construction
            out["old_per_token_logps"] = old
            return out

    captured, captured_rollouts = [], []
    original = base_trainer.compute_policy_loss

    def capture(spec, logp, old_logp, advantages, mask, **kwargs):
        out = original(spec, logp, old_logp, advantages, mask, **kwargs)
        captured.append((logp.detach(), old_logp, advantages, mask, kwargs.get("token_weights"), out))
        return out

    monkeypatch.setattr(base_trainer, "compute_policy_loss", capture)
    trainer = _toy_trainer("mu_grpo", tmp_path, kit, trainer_cls=Crafted, reward_funcs="toy_accuracy",
                           stage_prompts=4, updates_per_stage=2, max_steps=2, veto_scope="T")
    assert trainer.args.behaviour_logprobs == "auto" and trainer.vllm_generation.llm is shared_engine
    trainer.train()
    assert len(captured_rollouts) == 1 and len(captured) == 2  # one stage, two updates
    rollout = captured_rollouts[0]
    mask_all = torch.isfinite(rollout["sampling_per_token_logps"])
    # behaviour = the trainer's recomputation, not the engine's numbers (which differ in the last bits) ...
    assert not torch.equal(rollout["old_per_token_logps"][mask_all], rollout["sampling_per_token_logps"][mask_all])
    # ... and the float32 engine sampled from the same policy: TRL's IS weight is 1 up to float noise
    for logp, old, adv, mask, weights, out in captured:
        adv = adv.view(-1, 1)
        ratio = torch.exp(logp - old)
        triggers = (mask > 0) & (ratio < trainer.args.veto_threshold) & (adv < 0)
        assert triggers.any()
        assert torch.equal(out.stats["veto_triggers"], triggers)
        assert torch.equal(out.stats["vetoed"], triggers)  # scope T: exactly the triggers
        assert torch.all(out.per_token_loss[triggers] == 0)
        assert weights is not None  # TRL's IS weight (per token or per sequence, by vllm_importance_sampling_mode)
        assert (weights.expand_as(mask)[mask > 0] - 1).abs().max().item() < 1e-3


def test_dynamic_sampling_carried_groups_keep_their_own_behaviour_logprobs(shared_engine, kit, tmp_path):
    """DAPO's carried groups, generated by the engine one step earlier, keep their behaviour and sampling
    log-probs and TRL's IS ratio from that generation (float32: IS ratio 1 up to noise on every row), while the
    policy has moved since (recomputing them now would differ)."""
    from test_dynamic_sampling_topup import three_of_every_four_groups

    trainer = _toy_trainer("dapo", tmp_path, kit, reward_funcs=three_of_every_four_groups, max_steps=2,
                           per_device_train_batch_size=16, dynamic_sampling_topup="full", learning_rate=1e-2,
                           mini_batches_per_rollout=1,  # one rollout per step (DAPO's default: 16 steps per rollout)
                           lr_scheduler_type="constant")
    assert trainer.args.dynamic_sampling and trainer.vllm_generation.llm is shared_engine
    checks = []

    def on_batch(batch, info):
        carried = batch["carried_rows"] > 0
        mask = batch["completion_mask"] > 0
        diff = (batch["old_per_token_logps"] - batch["sampling_per_token_logps"]) * mask
        diff = torch.nan_to_num(diff, nan=0.0)
        if batch["importance_sampling_ratio"].size(1) == 1:  # TRL's sequence-level modes (its default)
            diff = diff.sum(dim=1, keepdim=True)
        ratio_rebuilt = torch.exp(diff)
        now = None
        if carried.any():  # what the current policy gives for the carried rows
            rows = carried.nonzero().flatten()
            ids = torch.cat([batch["prompt_ids"][rows], batch["completion_ids"][rows]], dim=1)
            attn = torch.cat([batch["prompt_mask"][rows], batch["completion_mask"][rows]], dim=1)
            with torch.no_grad():
                now, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attn,
                                                                        batch["completion_ids"].size(1))
        checks.append((info.groups_carried_in, carried, mask, batch, ratio_rebuilt, now))

    trainer._on_dynamic_sampling_batch = on_batch
    trainer.train()
    assert [c[0] for c in checks] == [0, 2]  # 3 of 4 groups qualify per round: 3 + 3 -> 2 carried into step 2
    _, carried, mask, batch, ratio_rebuilt, now = checks[1]
    assert carried.sum().item() == 8
    is_ratio = batch["importance_sampling_ratio"].expand_as(mask)[mask]
    assert torch.allclose(is_ratio, ratio_rebuilt.expand_as(mask)[mask])  # each row's ratio from its own log-probs
    assert (is_ratio - 1).abs().max().item() < 1e-3
    moved = ((now - batch["old_per_token_logps"][carried]) * mask[carried]).abs().max().item()
    assert moved > 1e-2  # the policy moved: a carried row re-scored now would not be its own behaviour


def test_igrpo_drafts_come_from_the_engine(shared_engine, kit, tmp_path):
    trainer = _toy_trainer("igrpo", tmp_path, kit, max_steps=1, **VARIANTS["igrpo"])
    calls = []
    generate = trainer.vllm_generation.generate

    def recording(*args, **kwargs):
        prompts = kwargs.get("prompts", args[0] if args else None)
        calls.append(len(prompts))
        return generate(*args, **kwargs)

    def no_hf_generate(*args, **kwargs):
        raise AssertionError("HF generate called with use_vllm=True")

    trainer.vllm_generation.generate = recording
    trainer.model.generate = no_hf_generate
    trainer.train()
    prompts = trainer.args.per_device_train_batch_size // trainer.args.num_generations
    # stage 1: N drafts per prompt; stage 2: G refinements per prompt; both from the engine
    assert calls == [prompts * trainer.args.num_drafts, prompts * trainer.args.num_generations], calls


@pytest.mark.parametrize("setting", ["padding_free", "process_supervision"])
def test_padding_free_and_process_supervision_with_engine_rollouts(setting, shared_engine, kit, tmp_path):
    from test_process_rewards import digit_steps

    if setting == "padding_free":
        trainer = _toy_trainer("grpo", tmp_path, kit, padding_free=True)
    else:
        trainer = _toy_trainer("dapo", tmp_path, kit, reward_funcs=["toy_accuracy", digit_steps])
    assert trainer.vllm_generation.llm is shared_engine
    result = trainer.train()
    assert trainer.state.global_step == 2 and math.isfinite(result.training_loss)
    gaps = _logged(trainer, "sampling/sampling_logp_difference/mean")
    assert gaps and max(gaps) < NOISE, gaps
    if setting == "process_supervision":
        assert trainer.process_supervision
        assert _logged(trainer, "process/nonzero_advantage_fraction")


# ---------------------------------------------------------------------------------------------------------------
# A finished trainer is freed; the shared engine serves the next one
# ---------------------------------------------------------------------------------------------------------------
def _reload_records_refer_to_their_layers(llm) -> list[str]:
    """Names of the engine's layers whose vLLM reload record (LAYERWISE_INFO) refers back to the layer."""
    from types import MethodType

    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    linked = []
    for name, layer in vllm_engine.engine_model(llm).named_modules():
        info = LAYERWISE_INFO.get(layer)
        for tensors in (info.restore_metadata if info is not None else ()):
            for tensor in tensors.values():
                for value in tensor.__dict__.values():
                    while callable(value) and getattr(value, "__name__", "") == "online_process_loader":
                        value = value.__wrapped__
                        linked.append(name)
                    if isinstance(value, MethodType) and value.__self__ is layer:
                        linked.append(name)
    return sorted(set(linked))


def test_a_trained_trainer_is_freed_and_the_shared_engine_serves_the_next(shared_engine, kit, tmp_path):
    """After ``del`` and ``gc.collect()`` a trainer that trained (and synced) with the shared engine is gone, its
    model with it: the engine's start left no frozen heap (vLLM's gc.freeze() is undone) and its reload records
    do not keep the engine's layers alive. The next trainer's rollouts from the same engine are its own policy's."""
    trainer = _toy_trainer("grpo", tmp_path / "first", kit, learning_rate=1e-2, lr_scheduler_type="constant")
    assert trainer.vllm_generation.llm is shared_engine
    trainer.train()
    assert trainer.vllm_generation.sync_count == 2
    refs = [weakref.ref(x) for x in (trainer, trainer.model, trainer.vllm_generation, trainer.accelerator)]
    del trainer
    gc.collect()
    assert [r() for r in refs] == [None] * 4
    assert gc.get_freeze_count() == 0
    assert _reload_records_refer_to_their_layers(shared_engine) == []

    following = _toy_trainer("grpo", tmp_path / "next", kit, learning_rate=1e-2, lr_scheduler_type="constant")
    assert following.vllm_generation.llm is shared_engine and following.vllm_generation.engine_reused
    following.train()
    gaps = _logged(following, "sampling/sampling_logp_difference/mean")
    assert len(gaps) == 2 and max(gaps) < NOISE, gaps  # each rollout sampled from this trainer's policy
    following.vllm_generation.sync_weights()
    sequences = _sequences(following, kit.train)
    synced = _prompt_logps(shared_engine, sequences)
    with torch.no_grad():
        local = []
        for seq in sequences:
            logits = following.model(torch.tensor([seq])).logits[0, :-1].float().log_softmax(-1)
            local.append(logits.gather(1, torch.tensor(seq[1:]).view(-1, 1)).flatten())
    assert _gap(synced, local) <= EXACT  # float32 engine vs transformers: float noise


# ---------------------------------------------------------------------------------------------------------------
# vLLM's default engine (compiled: torch.compile on CPU), as a user who sets only use_vllm=True gets it
# ---------------------------------------------------------------------------------------------------------------
def test_sync_is_exact_with_the_default_compiled_engine(shared_engine, kit, tmp_path):
    """The compiled engine (~45 s to start on CPU, kept to the module's end) after 4 updates at a large learning
    rate equals a fresh engine loaded from the trained weights (float32; the fresh one is eager: in float32 the
    compiled and eager kernels differ by float noise only, far below the bound)."""
    trainer = _toy_trainer("grpo", tmp_path, kit, max_steps=4, learning_rate=1e-2, lr_scheduler_type="constant",
                           vllm_enforce_eager=False)
    generation = trainer.vllm_generation
    assert generation.llm is not shared_engine and not generation.engine_reused
    assert "eager" not in generation.announcement()
    trainer.train()
    gaps = _logged(trainer, "sampling/sampling_logp_difference/mean")
    assert len(gaps) == 4 and max(gaps) < NOISE, gaps
    generation.sync_weights()
    sequences = _sequences(trainer, kit.train)
    synced = _prompt_logps(generation.llm, sequences)
    fresh = _fresh_engine_logps(trainer.model, kit.model_path, tmp_path / "fresh", sequences)
    assert _gap(synced, fresh) <= EXACT
    # the trainer that started this engine is freed with its last reference (vLLM froze the heap, with the trainer
    # in it, when the engine started: undone), while the engine stays kept for reuse
    refs = [weakref.ref(trainer), weakref.ref(trainer.model)]
    del trainer, generation
    gc.collect()
    assert [r() for r in refs] == [None, None]


# ---------------------------------------------------------------------------------------------------------------
# Server mode on CPU, last: its server started with the module (see _server_starts_with_the_module)
# ---------------------------------------------------------------------------------------------------------------
SERVER_TEST = "test_server_mode_trains_two_steps_with_an_exact_loopback_sync_and_the_server_stops"
_SERVER: dict = {}


def _start_server(model_path, log_path):
    """``grpo-variants vllm-serve`` (float32, eager) on a free port of 127.0.0.1, in its own process group."""
    from grpo_variants.rollout.vllm_server import ServerProcess

    return ServerProcess(model_path, log_path=log_path,
                         extra=("--max-num-seqs", "16", "--kv-cache-memory-bytes", str(KV_BYTES)))


@pytest.fixture(scope="module", autouse=True)
def _server_starts_with_the_module(request, kit, tmp_path_factory):
    """When the server test is selected, its server starts with the module: its start (about a minute of one core)
    runs beside the other tests, which use one core, and the server test runs last. The test stops it; this only
    makes sure no server outlives the module."""
    if any(item.name == SERVER_TEST for item in request.session.items):
        _SERVER["started"] = _start_server(kit.model_path, tmp_path_factory.mktemp("server") / "server.log")
    yield
    started = _SERVER.pop("started", None)
    if started is not None:
        started.kill()


@pytest.mark.slow
def test_server_mode_trains_two_steps_with_an_exact_loopback_sync_and_the_server_stops(kit, tmp_path):
    """One server (our command, float32, eager) on a free port of 127.0.0.1; a variant trains 2 steps against it,
    each rollout after a sync streamed over loopback; the synced server's log-probs of fixed sequences equal a fresh
    engine's loaded from the trained weights (as in colocate); then the server is stopped, every process of it."""
    import requests

    server = _SERVER.get("started") or _start_server(kit.model_path, tmp_path / "server.log")
    url = server.url
    try:
        server.wait_ready(timeout=600)

        trainer = _toy_trainer("gspo", tmp_path, kit, vllm_mode="server", vllm_server_base_url=url,
                               vllm_kv_cache_memory_bytes=None,  # the server's (set where it starts)
                               vllm_reuse_engine=False, vllm_enforce_eager=False, learning_rate=1e-2,
                               lr_scheduler_type="constant", mini_batches_per_rollout=1)  # a rollout (and sync) per step
        generation = trainer.vllm_generation
        client = generation.vllm_client
        assert type(client).__name__ == "LoopbackVLLMClient"
        line = generation.announcement()
        assert "\n" not in line and "server mode" in line and "loopback" in line
        trainer.train()
        assert trainer.state.global_step == 2 and generation.sync_count == 2
        # the float32 server sampled from the policy being trained at both steps
        gaps = _logged(trainer, "sampling/sampling_logp_difference/mean")
        assert len(gaps) == 2 and max(gaps) < NOISE, gaps
        sent = client.last_sync
        weights = {name: p for name, p in trainer.model.named_parameters()}
        assert sent["tensors"] == len(weights) == sent["server"]["tensors"]
        assert sent["bytes"] == sum(p.numel() * p.element_size() for p in weights.values()) == sent["server"]["bytes"]
        assert "lm_head" in sent["server"]["tied_reprocessed"]  # the tied output layer rebuilt after the reload
        print(f"loopback sync: {sent['bytes'] / 1e6:.1f} MB, {sent['seconds']:.3f} s")

        sequences = _sequences(trainer, kit.train)

        def served_logps():
            out = client.get_sequence_logprobs(sequences, [1] * len(sequences), top_logprobs=1)
            return [torch.tensor([row[0] for row in seq]) for seq in out["actual_logprobs"]]

        stale = served_logps()  # the last update is not synced yet
        generation.sync_weights()
        synced = served_logps()
        fresh = _fresh_engine_logps(trainer.model, kit.model_path, tmp_path / "fresh", sequences)
        assert _gap(synced, fresh) <= EXACT
        assert _gap(stale, fresh) > EXACT  # the check sees a server one update behind

        # TRL's weight_update() context: per-tensor update_named_param calls make one stream, loaded as one update
        with torch.no_grad():
            for p in weights.values():
                p.mul_(1.01)
        with client.weight_update():
            for name, tensor in generation._iter_named_params():
                client.update_named_param(name, tensor)
        client.reset_prefix_cache()
        assert client.last_sync["tensors"] == len(weights) == client.last_sync["server"]["tensors"]
        moved = served_logps()
        with torch.no_grad():
            local = []
            for seq in sequences:
                logits = trainer.model(torch.tensor([seq])).logits[0, :-1].float().log_softmax(-1)
                local.append(logits.gather(1, torch.tensor(seq[1:]).view(-1, 1)).flatten())
        assert _gap(moved, synced) > EXACT and _gap(moved, local) <= EXACT  # float32 engine vs transformers: noise

        # a vllm_dtype that is not the server's is refused when the trainer is built, in one line
        with pytest.raises(ConfigError, match="vllm_dtype='bfloat16'.*computes in float32") as info:
            _toy_trainer("grpo", tmp_path / "bf16", kit, vllm_mode="server", vllm_server_base_url=url,
                         vllm_kv_cache_memory_bytes=None,
                         vllm_reuse_engine=False, vllm_enforce_eager=False, vllm_dtype="bfloat16")
        assert "\n" not in str(info.value)
    finally:
        server.stop(timeout=60)  # SIGTERM to its process group, SIGKILL after 60 s
    assert server.process.returncode is not None and not server.live_members()
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{url}/health", timeout=2)
