"""The shipped accelerate / DeepSpeed configs are consistent and resolve into DeepSpeed plugins (no launch)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from grpo_variants.errors import ConfigError
from grpo_variants.runtime.scale import ACCELERATE_CONFIGS, accelerate_config_path

REPO = Path(__file__).resolve().parents[1]
EXPECTED_STAGE = {"zero3": 3, "zero3_offload": 3, "zero2": 2}


@pytest.mark.parametrize("name", ACCELERATE_CONFIGS)
def test_accelerate_config(name):
    path = Path(accelerate_config_path(name))
    assert path == REPO / "recipes" / "accelerate" / f"{name}.yaml"
    config = yaml.safe_load(path.read_text())
    if name == "single":
        assert config["distributed_type"] == "NO" and config["num_processes"] == 1
        return
    assert config["distributed_type"] == "DEEPSPEED"
    assert "mixed_precision" not in config, "precision comes from the DeepSpeed JSON ('auto' <- the GRPO config)"
    ds_file = REPO / config["deepspeed_config"]["deepspeed_config_file"]  # relative to the repository root
    ds = json.loads(ds_file.read_text())
    zero = ds["zero_optimization"]
    assert zero["stage"] == EXPECTED_STAGE[name]
    # what the HF Trainer fills in from the config: one source of truth
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping"):
        assert ds[key] == "auto", key
    assert ds["bf16"]["enabled"] == "auto" and ds["fp16"]["enabled"] == "auto"
    if zero["stage"] == 3:
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True
        assert config["deepspeed_config"]["zero3_init_flag"] is True
    offload = name.endswith("offload")
    assert ("offload_optimizer" in zero) == offload and ("offload_param" in zero) == offload
    assert ("optimizer" in ds) == offload  # offloaded optimizer states need DeepSpeed's CPU Adam


@pytest.mark.parametrize("name", ["zero3", "zero3_offload", "zero2"])
def test_deepspeed_plugin_reads_the_json(name, monkeypatch):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'grpo-variants[deepspeed]')")
    from accelerate.utils import DeepSpeedPlugin

    config = yaml.safe_load(Path(accelerate_config_path(name)).read_text())
    monkeypatch.chdir(REPO)
    plugin = DeepSpeedPlugin(hf_ds_config=config["deepspeed_config"]["deepspeed_config_file"])
    assert plugin.zero_stage == EXPECTED_STAGE[name]
    assert plugin.is_auto("train_micro_batch_size_per_gpu")


def test_unknown_accelerate_config():
    with pytest.raises(ConfigError, match="zero3"):
        accelerate_config_path("zero4")


def test_a_stale_deepspeed_build_lock_is_removed_and_a_live_one_kept(tmp_path, caplog):
    """A CPU ZeRO-3 launch loads DeepSpeed's shm_comm op under torch's bare `lock` file; a launch killed while
    holding it made every later launch wait forever. A lock older than any build is removed (one warning);
    a fresh one (a build under way) and other users' files are left alone."""
    import logging
    import os
    import time

    from grpo_variants.runtime.distributed import STALE_LOCK_BUILT_S, STALE_LOCK_UNBUILT_S, clear_stale_build_locks

    built, unbuilt, fresh = (tmp_path / "py311_cpu" / name for name in ("deepspeed_shm_comm", "deepspeed_x", "deepspeed_y"))
    for folder in (built, unbuilt, fresh):
        folder.mkdir(parents=True)
        (folder / "lock").touch()
    (built / "deepspeed_shm_comm.so").touch()
    now = time.time()
    os.utime(built / "lock", (now - STALE_LOCK_BUILT_S - 5,) * 2)  # stale: the op is built, loading takes seconds
    os.utime(unbuilt / "lock", (now - STALE_LOCK_BUILT_S - 5,) * 2)  # a first build may still be running
    with caplog.at_level(logging.WARNING, logger="grpo_variants.runtime.distributed"):
        assert clear_stale_build_locks(tmp_path) == [str(built / "lock")]
    assert not (built / "lock").exists() and (unbuilt / "lock").exists() and (fresh / "lock").exists()
    assert "stale DeepSpeed build lock" in caplog.text and str(built / "lock") in caplog.text
    os.utime(unbuilt / "lock", (now - STALE_LOCK_UNBUILT_S - 5,) * 2)
    assert clear_stale_build_locks(tmp_path) == [str(unbuilt / "lock")]
    assert clear_stale_build_locks(tmp_path / "missing") == []
