"""Input resolution shared by the command line (:mod:`grpo_variants.cli`) and the recipes (``recipes/``).

The model, the datasets and ``--resume_from_checkpoint`` are resolved the same way whichever door a run
comes in by, and bad input is one line (:class:`UsageError`) before any model is loaded:

* :func:`resolve_model_path`: a folder, a hub id, or a registered name (``smollm2``), checked;
* :func:`load_dataset`: ``toy[:task]``, a ``save_to_disk`` folder, a json/jsonl/csv/parquet file or a hub id;
* :func:`parse_resume` / :func:`resume_checkpoint`: ``true`` / ``latest`` / a folder / ``false``, resolved to
  the checkpoint to resume from (or ``None`` for a fresh run).
"""

from __future__ import annotations

import os
from pathlib import Path

from grpo_variants.errors import GRPOVariantsError

_TRUE = {"true", "yes", "1", "latest"}
_FALSE = {"false", "no", "0", "none", ""}


class UsageError(GRPOVariantsError):
    """A bad command line: unknown flag, bad value, missing argument."""


DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def looks_local(text: str) -> bool:
    """A spec written as a path (``./x``, ``/x``, ``~/x``, ``x.jsonl``, ``a/b/c``), not as a hub id ``org/name``."""
    from grpo_variants.validation import _HUB_ID

    return (text.startswith((os.sep, ".", "~")) or Path(text).suffix.lower() in DATA_SUFFIXES
            or (os.sep in text.strip(os.sep) and not _HUB_ID.match(text)))


def load_dataset(spec, split: str = "train", config_name: str | None = None, streaming: bool = False):
    """``toy``, ``toy:subtraction``, a ``save_to_disk`` folder, a json/jsonl/csv/parquet file, or a hub id.

    ``spec`` is a ``str`` or an ``os.PathLike`` (a ``pathlib.Path``). A path that does not exist and a hub id
    that cannot be loaded (no network, offline mode, no such dataset) raise a one-line :class:`UsageError`.
    """
    from grpo_variants.tasks import toy

    spec = os.fspath(spec)
    if spec == "toy" or spec.startswith("toy:"):
        task = spec.split(":", 1)[1] if ":" in spec else "addition"
        try:
            return toy.make_dataset(task, "train" if split == "train" else "eval")
        except ValueError as err:
            raise UsageError(f"dataset {spec!r}: {err}") from err
    path = Path(os.path.expanduser(spec))
    if path.is_dir():
        from datasets import DatasetDict, load_from_disk

        data = load_from_disk(str(path))
        if isinstance(data, DatasetDict):
            if split not in data:
                raise UsageError(f"dataset {spec!r} has no split {split!r} (splits: {sorted(data)}).")
            return data[split]
        return data
    if path.is_file():
        from datasets import load_dataset

        kind = DATA_SUFFIXES.get(path.suffix.lower())
        if kind is None:
            raise UsageError(f"dataset {spec!r}: unsupported file type {path.suffix!r} (json, jsonl, csv, parquet).")
        return load_dataset(kind, data_files=str(path), split="train")
    if looks_local(spec):
        parent = path.parent if str(path.parent) not in ("", ".") else Path(".")
        near = sorted(p.name for p in parent.iterdir() if p.suffix.lower() in DATA_SUFFIXES or (
            p.is_dir() and any((p / f).exists() for f in ("dataset_info.json", "dataset_dict.json")))
        )[:8] if parent.is_dir() else []
        raise UsageError(
            f"dataset {spec!r}: no such file or folder" + (f" (in {str(parent)!r}: {near})" if near else "")
            + ". Pass a json/jsonl/csv/parquet file, a save_to_disk folder, a hub id (org/name) or toy."
        )
    from datasets import load_dataset

    try:
        return load_dataset(spec, name=config_name, split=split, streaming=streaming)
    except Exception as err:  # noqa: BLE001 - any hub failure becomes one line (the cause stays chained)
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        offline = "offline" in first.lower()
        unreachable = offline or isinstance(err, (ConnectionError, TimeoutError)) or "reach" in first.lower()
        hint = ("the Hugging Face Hub cannot be reached" + (" (offline mode is set)" if offline else "")
                + " and it is not in the local cache; pass a local json/jsonl/csv/parquet file or save_to_disk "
                "folder, or toy, or connect and retry" if unreachable
                else f"{type(err).__name__}: {first}")
        raise UsageError(f"dataset {spec!r} (split {split!r}) could not be loaded: {hint}.") from err


def parse_resume(value):
    """``--resume_from_checkpoint`` as written: ``true`` / ``yes`` / ``1`` / ``latest`` -> ``True`` (the newest
    complete checkpoint in ``output_dir``), ``false`` / ``no`` / ``none`` / absent -> ``None``, else an existing
    folder (a :class:`UsageError` in one line when it does not exist)."""
    if value is None or isinstance(value, bool):
        return value or None
    text = str(value).strip()
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return None
    if not Path(text).is_dir():
        raise UsageError(
            f"--resume_from_checkpoint {text!r}: no such folder. Pass a checkpoint-N folder, or true for the newest "
            "complete checkpoint in --output_dir."
        )
    return text


def resume_checkpoint(value, output_dir: str):
    """The checkpoint ``--resume_from_checkpoint value`` resumes from (``None``: a fresh run); a resume with
    nothing to resume from raises one line, before any model is loaded."""
    from grpo_variants.reliability import resolve_resume_checkpoint

    value = parse_resume(value)
    return None if value is None else resolve_resume_checkpoint(value, output_dir)


def resolve_model_path(model: str | os.PathLike) -> str:
    """The policy to load: a folder, a hub id, or a registered name such as ``smollm2``, checked to exist
    (:func:`grpo_variants.validation.check_model_path`) so that a wrong model fails before any dataset loads."""
    from grpo_variants.tasks.models import resolve_model
    from grpo_variants.validation import check_model_path

    path = resolve_model(model)
    check_model_path(path)
    return path
