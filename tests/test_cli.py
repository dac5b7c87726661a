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


TINY = ["--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "4",
        "--report_to", "none"]


def _toy_rows(kit, n):
    return "".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n"
                   for r in kit.train_dataset.select(range(n)))


def test_trl_grpo_style_yaml_runs(tmp_path, toy_kit, monkeypatch):
    """`trl grpo` keys: model_name_or_path, dataset_name, reward_funcs (a dotted import path), env."""
    data = tmp_path / "train.jsonl"
    data.write_text(_toy_rows(toy_kit, 32))
    cfg = tmp_path / "grpo.yaml"
    cfg.write_text(
        f"model_name_or_path: {toy_kit.model_path}\ndataset_name: {data}\n"
        "reward_funcs:\n  - grpo_variants.tasks.toy.toy_accuracy\n  - get_soft_overlong_punishment\n"
        "max_steps: 1\nper_device_train_batch_size: 8\nnum_generations: 4\nmax_completion_length: 4\n"
        "report_to: none\nenv:\n  GRPO_VARIANTS_TEST_ENV: set-by-yaml\n"
    )
    monkeypatch.delenv("GRPO_VARIANTS_TEST_ENV", raising=False)
    out_dir = tmp_path / "trlstyle"
    assert main(["train", "--config", str(cfg), "--output_dir", str(out_dir)]) == 0
    import os

    assert os.environ["GRPO_VARIANTS_TEST_ENV"] == "set-by-yaml"
    logged = json.loads((out_dir / "trainer_state.json").read_text())["log_history"][0]
    assert "rewards/toy_accuracy/mean" in logged and "rewards/soft_overlong_punishment_reward/mean" in logged


def test_toy_keeps_user_values_save_resume_true_and_eval_dataset(tmp_path, toy_kit, capsys, monkeypatch):
    """--model toy: no silent beta/save_strategy override (announced toy sizes only); --save_steps writes;
    --resume_from_checkpoint true resumes from the newest one; --eval_dataset is evaluated."""
    out_dir = tmp_path / "toyrun"
    evalset = tmp_path / "eval.jsonl"
    evalset.write_text(_toy_rows(toy_kit, 4))
    common = ["train", "--variant", "grpo", "--model", "toy", "--dataset", "toy", "--output_dir", str(out_dir),
              *TINY, "--toy_eval", "false"]
    assert main([*common, "--max_steps", "2", "--save_steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "--model toy: toy-sized defaults" in out and "beta" not in out.split("\n")[0]
    assert (out_dir / "checkpoint-2").is_dir()
    assert "| `beta` | `0.04` |" in (out_dir / "README.md").read_text()  # the variant's KL, not a toy 0.0
    import transformers.trainer

    warned = []
    monkeypatch.setattr(transformers.trainer.logger, "warning", lambda msg, *a, **k: warned.append(str(msg)))
    assert main([*common, "--max_steps", "3", "--resume_from_checkpoint", "true", "--eval_dataset", str(evalset),
                 "--eval_strategy", "steps", "--eval_steps", "3"]) == 0
    assert not [w for w in warned if "missing keys" in w], warned  # the tied lm_head is re-tied, not reported
    history = json.loads((out_dir / "trainer_state.json").read_text())["log_history"]
    assert [r["step"] for r in history if "loss" in r] == [1, 2, 3]  # resumed at 2, one more step
    assert any("eval_reward" in r for r in history)
    # the summary speaks of this run: 1 step (not 3), and its "first" reward is step 3's, not the original run's
    out = capsys.readouterr().out
    assert "grpo: 1 optimizer step in this run (resumed at step 2, now at step 3)" in out
    reward_row = next(line for line in out.splitlines() if line.strip().startswith("reward (train rollouts)"))
    step3 = next(r["reward"] for r in history if r.get("step") == 3 and "reward" in r)
    from grpo_variants.console import _fmt

    assert reward_row.split()[-2:] == [_fmt(step3), _fmt(step3)] and "first (this run)" in out


def test_one_line_errors(capsys):
    for argv, expected in (
        (["train", "--model", "toy", "--dataset", "toy", "--no_such_flag", "1"], "unrecognized arguments"),
        (["train", "--model", "toy", "--dataset", "toy", "--max_steps", "abc"], "invalid int value: 'abc'"),
        (["train", "--model", "toy", "--dataset", "toy", "--resume_from_checkpoint", "/no/such/dir"], "no such folder"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert expected in err and len(err.strip().splitlines()) == 1, err


def test_help_per_subcommand_and_variant(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: grpo-variants train")
    for flag in ("--model ", "--dataset ", "--reward ", "--config ", "--eval_dataset", "--model_name_or_path",
                 "--dataset_name", "--reward_funcs", "--resume_from_checkpoint", "--verbose"):
        assert flag in out, flag
    words = " ".join(out.split())
    assert "default variant 'grpo'" in words and "--variant NAME --help" in words
    assert main(["train", "--variant", "dapo", "--help"]) == 0
    out = capsys.readouterr().out
    assert "variant 'dapo' (DAPOConfig)" in " ".join(out.split()) and "--overlong_buffer_len" in out


def test_ctrl_c_prints_checkpoint_and_resume_command(tmp_path, toy_kit, monkeypatch, capsys):
    """SIGINT during training: the checkpoint is written, the path and the resume command printed, exit 130."""
    (tmp_path / "interrupting.py").write_text(
        "import os, signal\ncalls = []\n"
        "def reward(completions, **kwargs):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 2:\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "    return [float(len(c) % 2) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out_dir = tmp_path / "ctrlc"
    code = main(["train", "--model", "toy", "--dataset", "toy", "--reward", "interrupting.reward", "--max_steps", "5",
                 "--output_dir", str(out_dir), *TINY, "--toy_eval", "false"])
    assert code == 130
    err = capsys.readouterr().err
    assert f"checkpoint saved at {out_dir / 'checkpoint-2'}" in err
    assert "resume with: grpo-variants train" in err and f"--resume_from_checkpoint {out_dir / 'checkpoint-2'}" in err
    assert "Traceback" not in err


def test_verbose_restores_the_per_step_dicts(tmp_path, toy_model_path, capsys):
    common = ["train", "--model", "toy", "--dataset", "toy", "--max_steps", "1", *TINY, "--toy_eval", "false",
              "--disable_tqdm", "true"]
    assert main([*common, "--output_dir", str(tmp_path / "quiet")]) == 0
    quiet = capsys.readouterr().out
    assert "'grad_norm'" not in quiet and "step 1/1" in quiet and "1 optimizer step\n" in quiet
    assert main([*common, "--output_dir", str(tmp_path / "loud"), "--verbose"]) == 0
    assert "'grad_norm'" in capsys.readouterr().out


def _help_blocks(text: str) -> dict[str, str]:
    """argparse help -> {first option string: its whole entry (option line + help lines)}."""
    blocks, current = {}, None
    for line in text.splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            blocks[current] = line
        elif current and line.startswith("    "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    return blocks


def test_variant_help_shows_every_field_with_its_help_and_default(capsys):
    """`--variant X --help`: each field of X's config, the ones X redefines for its paper included, has a
    help text and its default; a default that differs from TRL's says so; negations carry no default."""
    import dataclasses

    from trl import GRPOConfig

    from grpo_variants import list_variants

    trl_fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    for spec in list_variants():
        assert main(["train", "--variant", spec.name, "--help"]) == 0
        blocks = _help_blocks(capsys.readouterr().out)
        init_fields = {f.name for f in dataclasses.fields(spec.config_cls) if f.init}
        redefined = [name for name in vars(spec.config_cls).get("__annotations__", {}) if name in init_fields]
        assert redefined, spec.name
        for name in redefined:
            entry = blocks.get(f"--{name}")
            assert entry is not None, (spec.name, name)
            assert "(default: " in entry and len(entry.split("(default: ")[0].split(maxsplit=2)) == 3, (spec.name, entry)
        for option, entry in blocks.items():
            if option.startswith("--no_"):
                assert "(default:" not in entry, entry
        if spec.name == "dapo":
            assert "[dapo's default; TRL's: 0.0]" in blocks["--weight_decay"]
            assert "(default: True)" in blocks["--dynamic_sampling"]
            assert all(f"--{n}" in blocks for n in redefined if n not in trl_fields)
