"""Construction-time input checks of the trainers: the model path, the datasets, the reward functions.

Each check raises a :mod:`grpo_variants.errors` type whose message names what is wrong and how to fix
it, before any model is loaded or any completion generated. :class:`~grpo_variants.GRPOVariantTrainer`
runs them first thing in ``__init__``; they are importable from :mod:`grpo_variants.trainer` too.
"""

from __future__ import annotations

import os
import re

from grpo_variants.errors import ConfigError, DatasetError, ModelPathError, UnknownRewardError

__all__ = ["check_dataset", "check_model_path", "check_output_dir", "check_prompts_per_round", "resolve_reward_funcs"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def check_model_path(model) -> None:
    """Fail early, and clearly, for a model path that does not exist."""
    if not isinstance(model, (str, os.PathLike)):
        return
    path = os.path.expanduser(str(model))
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")) and not os.path.exists(
            os.path.join(path, "adapter_config.json")
        ):
            raise ModelPathError(
                f"model={str(model)!r} is a folder but holds no config.json: it is not a saved model. "
                "Save one with model.save_pretrained(path), or use grpo_variants.tasks.toy.prepare().model_path."
            )
        return
    looks_local = path.startswith((os.sep, ".", "~")) or os.sep in path.strip(os.sep) and not _HUB_ID.match(path)
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    if looks_local or not _HUB_ID.match(path) or offline and not _in_hf_cache(path):
        raise ModelPathError(
            f"model={str(model)!r} does not exist: it is neither a local folder nor "
            + ("a hub id in the local cache (HF_HUB_OFFLINE is set)." if offline else "a hub id of the form org/name.")
            + " Pass the folder of a saved model (e.g. grpo_variants.tasks.toy.prepare().model_path) or a hub id."
        )
    if not offline and not _in_hf_cache(path):
        problem = _hub_problem(path)
        if problem is not None:
            raise ModelPathError(
                f"model={str(model)!r} is not in the local Hugging Face cache and {problem}. Pass the folder of a "
                "saved model (e.g. grpo_variants.tasks.toy.prepare().model_path, or --model toy on the command "
                "line), or connect and retry."
            )


def _hub_problem(repo_id: str) -> str | None:
    """Why ``repo_id`` cannot be downloaded (the hub is unreachable, or has no such model), or None when it can
    (or when the hub answered otherwise, e.g. a gated model: TRL's loading then says what to do)."""
    try:
        from huggingface_hub import model_info
        from huggingface_hub.errors import RepositoryNotFoundError
    except ImportError:  # pragma: no cover - very old huggingface_hub
        return None
    try:
        model_info(repo_id, timeout=10)
    except RepositoryNotFoundError:
        return "the Hugging Face Hub has no such model (or it is private: log in with `hf auth login`)"
    except Exception as err:  # noqa: BLE001 - network errors differ between requests / httpx versions
        kinds = " ".join(c.__name__ for c in type(err).__mro__)
        if isinstance(err, (ConnectionError, TimeoutError)) or any(
                word in kinds for word in ("Connect", "Timeout", "Network", "Offline")):
            return f"the Hugging Face Hub cannot be reached ({type(err).__name__}: {str(err).splitlines()[0][:120]})"
        return None
    return None


def check_output_dir(output_dir) -> None:
    """``output_dir`` must be a folder this process can create and write (transformers creates it while the
    trainer is built and fails there with a bare OSError)."""
    if output_dir is None:
        return
    path = os.path.expanduser(os.fspath(output_dir))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"output_dir={str(output_dir)!r} cannot be created ({err.strerror or err}): pass a folder "
                          "you can write to.") from err
    if not os.access(path, os.W_OK):
        raise ConfigError(f"output_dir={str(output_dir)!r} is not writable: pass a folder you can write to.")


def _in_hf_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # pragma: no cover - very old huggingface_hub
        return False


def check_dataset(dataset, name: str, environment: bool = False) -> None:
    """A dataset must exist, be non-empty and carry a ``prompt`` column.

    With an ``environment_factory`` (``environment=True``) the environment may own the data (TRL 1.16: no
    dataset with ``max_steps``, or rows that only name their ``environment``): TRL's own checks decide then.
    Where TRL would raise, the message starts with TRL's words.
    """
    if dataset is None:
        if name == "train_dataset" and not environment:
            raise DatasetError(
                "`train_dataset` is required unless an `environment_factory` is provided. Pass a datasets.Dataset "
                "with a 'prompt' column."
            )
        return
    if isinstance(dataset, dict):  # several eval datasets
        for key, value in dataset.items():
            check_dataset(value, f"{name}[{key!r}]", environment)
        return
    columns = getattr(dataset, "column_names", None)
    if columns is not None and "prompt" not in columns and not environment:
        raise DatasetError(
            f"{name} has no 'prompt' column (columns: {columns}). Rename the column holding the prompts, e.g. "
            "dataset.rename_column('question', 'prompt')."
        )
    try:
        size = len(dataset)
    except TypeError:  # IterableDataset
        return
    if size == 0:
        raise DatasetError(f"{name} is empty: it needs at least one row with a 'prompt'.")


def check_prompts_per_round(dataset, args) -> None:
    """A map-style train_dataset must hold the distinct prompts of one generation round.

    TRL's sampler hands out ``generation_batch_size / num_generations`` distinct prompts per round and
    drops an incomplete round, so a smaller dataset yields no batch at all: ``train()`` would stop at
    step 0 with only a transformers warning. Raise instead, before the model is loaded.
    """
    try:
        size = len(dataset)
    except TypeError:  # IterableDataset: its length is unknown until it is read
        return
    if getattr(args, "stage_prompts", None):  # a stage rollout draws its own prompts and checks them itself
        return
    batch, group = args.generation_batch_size, args.num_generations
    if not batch or not group:
        return
    needed = batch // group
    if size < needed:
        raise DatasetError(
            f"train_dataset has {size} prompt(s) but one generation round takes {needed} distinct prompts "
            f"(generation_batch_size {batch} / num_generations {group}; generation_batch_size = "
            "per_device_train_batch_size x world_size x steps_per_generation): training would stop at step 0. "
            f"Use at least {needed} prompts, or lower per_device_train_batch_size / steps_per_generation."
        )


_NO_REWARD_SOURCE = (  # TRL's words (GRPOTrainer.__init__), then ours
    "No reward source provided. Pass `reward_funcs`, or an `environment_factory` whose environment defines a "
    "`get_reward` method. reward_funcs takes a callable, a registered reward name (see `grpo-variants list`) or a "
    "list of them."
)


def resolve_reward_funcs(reward_funcs, environment: bool = False) -> list:
    """Turn registered reward names into callables; keep callables, reward-model paths and hub ids.

    None or an empty list is an error (TRL's message) unless an ``environment_factory`` is given
    (``environment=True``): its environment may supply the reward, which TRL checks itself.
    """
    from grpo_variants.rewards.registry import get_reward

    items = [] if reward_funcs is None else reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not items:
        if environment:
            return []
        raise ConfigError(_NO_REWARD_SOURCE)
    resolved = []
    for item in items:
        if isinstance(item, str):
            try:
                resolved.append(get_reward(item))
                continue
            except UnknownRewardError:
                if os.path.isdir(os.path.expanduser(item)) or _HUB_ID.match(item):
                    try:
                        check_model_path(item)  # a reward *model*: TRL loads it; it must exist or be reachable
                    except ModelPathError as err:
                        raise ModelPathError(f"reward_funcs entry {item!r} is not a registered reward name, and as a "
                                             f"reward model: {err}") from err
                    resolved.append(item)
                    continue
                raise
        elif not callable(item):
            raise ConfigError(f"reward_funcs entry {item!r} is neither callable nor a registered reward name.")
        resolved.append(item)
    return resolved
