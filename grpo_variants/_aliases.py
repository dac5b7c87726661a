"""Old import paths of modules that moved into sub-packages, kept working.

The package was flat until the layout that shows the architecture (``rollout/``, ``tasks/``,
``runtime/``). ``import grpo_variants.sampling`` (or ``from grpo_variants import toy_reasoning``)
still works: this finder answers the old name with the *same module object* as the new one, so
``grpo_variants.sampling is grpo_variants.rollout.sampling``, patches and ``isinstance`` checks
see one module, and checkpoints pickled under an old path load.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

OLD_TO_NEW = {
    "grpo_variants.sampling": "grpo_variants.rollout.sampling",
    "grpo_variants.stages": "grpo_variants.rollout.stages",
    "grpo_variants.two_stage": "grpo_variants.rollout.two_stage",
    "grpo_variants.adaptive_clip": "grpo_variants.rollout.adaptive_clip",
    "grpo_variants.rollout_batch": "grpo_variants.rollout.batch",
    "grpo_variants.rollout_logprobs": "grpo_variants.rollout.logprobs",
    "grpo_variants.loader": "grpo_variants.rollout.loader",
    "grpo_variants.toy": "grpo_variants.tasks.toy",
    "grpo_variants.toy_reasoning": "grpo_variants.tasks.toy_reasoning",
    "grpo_variants.word_problems": "grpo_variants.tasks.word_problems",
    "grpo_variants.models": "grpo_variants.tasks.models",
    "grpo_variants.distributed": "grpo_variants.runtime.distributed",
    "grpo_variants.noise": "grpo_variants.runtime.noise",
    "grpo_variants.scale": "grpo_variants.runtime.scale",
}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module):  # the target module is already executed
        pass


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = OLD_TO_NEW.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(new))


def install() -> None:
    if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())
