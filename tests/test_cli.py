"""The grpo-variants command line."""

from __future__ import annotations

import json
import subprocess
import sys

from grpo_variants.cli import main


def test_list_shows_variants_and_rewards(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("grpo", "toy_accuracy"):
        assert name in out


def test_train_toy_two_steps_leaves_a_record(tmp_path, toy_model_path, capsys):
    """A CLI run with report_to none still leaves metrics.jsonl, trainer_state.json, a plot and a model card."""
    out_dir = tmp_path / "run"
    code = main(["train", "--variant", "dapo", "--model", "toy", "--dataset", "toy", "--max_steps", "2",
                 "--output_dir", str(out_dir), "--per_device_train_batch_size", "16", "--num_generations", "4",
                 "--report_to", "none", "--learning_rate", "3e-4"])
    assert code == 0
    assert (out_dir / "config.json").exists() and (out_dir / "model.safetensors").exists()
    state = json.loads((out_dir / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert (out_dir / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    card = (out_dir / "README.md").read_text()
    assert "Variant **dapo**" in card and "arxiv.org/abs/2503.14476" in card
    assert "| `learning_rate` | `0.0003` | `1e-06` |" in card  # a non-default hyper-parameter with its defaults


def test_train_reads_yaml_and_flags_override(tmp_path, toy_model_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("variant: grpo\nmodel: toy\ndataset: toy\nmax_steps: 5\nper_device_train_batch_size: 8\n"
                   "num_generations: 4\ndisable_tqdm: true\n")
    code = main(["train", "--config", str(cfg), "--max_steps", "1", "--output_dir", str(tmp_path / "y")])
    assert code == 0
    assert (tmp_path / "y" / "model.safetensors").exists()


def test_clear_errors(capsys, tmp_path):
    assert main(["train", "--variant", "nope", "--model", "toy", "--dataset", "toy"]) == 2
    assert "Unknown variant 'nope'" in capsys.readouterr().err
    assert main(["train", "--model", str(tmp_path / "missing"), "--dataset", "toy", "--reward", "toy_accuracy",
                 "--output_dir", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["train", "--model", "toy", "--dataset", "toy", "--reward", "nosuch", "--output_dir",
                 str(tmp_path / "o")]) == 2
    assert "Unknown reward 'nosuch'" in capsys.readouterr().err


def test_console_script_entry_point():
    proc = subprocess.run([sys.executable, "-m", "grpo_variants.cli", "list"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "Variants:" in proc.stdout
