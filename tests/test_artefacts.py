"""What a run leaves behind and what the package prints at import (issue #26, part A).

* ``reward_curve.png``: markers (a run with one logged point shows it), no label or legend outside the
  image, TRL's eval reward and the held-out accuracy before / after training as their own series.
* the model card: the base model named (never "[None]"), variant and paper, rewards with their weights,
  the dataset, LoRA / quantization / DeepSpeed settings, the non-default hyper-parameters.
* the ``notebooks`` extra installs Jupyter and ipywidgets, and the README names it.
* bitsandbytes' CPU kernel warning (printed by ``import peft`` with bitsandbytes on a CPU) is filtered.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from grpo_variants.callbacks import plot_reward_curve, reward_curve_figure

ROOT = Path(__file__).resolve().parent.parent


def _drawn(fig):
    fig.canvas.draw()
    return fig.canvas.get_renderer()


def _texts(fig):
    ax = fig.axes[0]
    texts = [ax.title, ax.xaxis.label, ax.yaxis.label]
    (x0, x1), (y0, y1) = sorted(ax.get_xlim()), sorted(ax.get_ylim())
    texts += [t for t in ax.get_xticklabels() if t.get_text() and x0 <= t.get_position()[0] <= x1]  # drawn ticks
    texts += [t for t in ax.get_yticklabels() if t.get_text() and y0 <= t.get_position()[1] <= y1]
    return texts


def _inside(inner, outer) -> bool:
    return inner.x0 >= outer.x0 - 0.5 and inner.y0 >= outer.y0 - 0.5 and inner.x1 <= outer.x1 + 0.5 and \
        inner.y1 <= outer.y1 + 0.5


def test_one_logged_point_is_visible(tmp_path):
    fig = reward_curve_figure([{"step": 1, "reward": 0.25}], "one step")
    (line,) = [line for line in fig.axes[0].lines if line.get_label().startswith("mean reward")]
    assert list(line.get_xdata()) == [1] and line.get_marker() not in (None, "", "None", " ")
    path = plot_reward_curve([{"step": 1, "reward": 0.25}], tmp_path / "curve.png", "one step")
    import matplotlib.image

    pixels = matplotlib.image.imread(path)[..., :3]
    blue = (abs(pixels[..., 0] - 0.12) < 0.08) & (abs(pixels[..., 1] - 0.47) < 0.08) & (abs(pixels[..., 2] - 0.71) < 0.08)
    assert blue.sum() >= 9, "the single point's marker is not drawn"


def test_no_label_or_legend_outside_the_image():
    records = [{"step": s, "reward": -0.75 + 0.01 * s, "rewards/toy_accuracy_pm1/mean": -0.75 + 0.01 * s,
                "rewards/format_bonus/mean": 0.5} for s in range(1, 121)]
    records += [{"step": 60, "eval_reward": -0.4}, {"step": 120, "eval_reward": -0.2}]
    fig = reward_curve_figure(records, "a long title for a variant: reward during training, 120 steps",
                              heldout={"before": 0.2, "after": 0.4, "after_step": 120,
                                       "label": "held-out greedy accuracy (500 problems)"})
    renderer = _drawn(fig)
    for text in _texts(fig):
        assert _inside(text.get_window_extent(renderer), fig.bbox), f"clipped: {text.get_text()!r}"
    assert _inside(fig.axes[0].get_legend().get_window_extent(renderer), fig.bbox)


def test_a_pm1_reward_mean_is_not_labelled_accuracy():
    # training accuracy is the accuracy reward's fraction right (rewards/<name>/right_fraction), never a ±1 mean
    records = [{"step": 1, "reward": -0.6, "rewards/toy_accuracy_pm1/mean": -0.6,
                "rewards/toy_accuracy_pm1/right_fraction": 0.2}]
    lines = {line.get_label(): line for line in reward_curve_figure(records).axes[0].lines}
    assert list(lines) == ["mean reward (train rollouts)", "training accuracy (toy_accuracy_pm1)"]
    assert list(lines["training accuracy (toy_accuracy_pm1)"].get_ydata()) == [0.2]
    records = [{"step": 1, "reward": 0.3, "rewards/toy_accuracy/mean": 0.3, "rewards/toy_accuracy/right_fraction": 0.3}]
    labels = [line.get_label() for line in reward_curve_figure(records).axes[0].lines]
    assert labels == ["mean reward = training accuracy (toy_accuracy)"]


def test_eval_reward_and_heldout_before_after_are_plotted():
    records = [{"step": 1, "reward": 0.1}, {"step": 2, "reward": 0.3}, {"step": 2, "eval_reward": 0.25}]
    fig = reward_curve_figure(records, heldout={"before": 0.2, "after": 0.45, "after_step": 2, "label": "held-out"})
    lines = {line.get_label(): line for line in fig.axes[0].lines}
    assert list(lines["eval reward (eval_dataset)"].get_ydata()) == [0.25]
    before = lines["held-out: before 20.0%"]
    after = lines["held-out: after 45.0%"]
    assert (list(before.get_xdata()), list(before.get_ydata())) == ([0], [0.2])
    assert (list(after.get_xdata()), list(after.get_ydata())) == ([2], [0.45])
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "held-out: before 20.0%" in legend and "eval reward (eval_dataset)" in legend


def test_model_card_section_names_setup():
    from grpo_variants.registry import get_variant
    from grpo_variants.trainer import model_card_section

    spec = get_variant("dapo")
    args = spec.config_cls(output_dir="unused", max_steps=3, learning_rate=3e-4)
    setup = {"base_model": "Qwen/Qwen2.5-0.5B-Instruct", "rewards": [("math_accuracy", 1.0), ("overlong_penalty", 0.5)],
             "train_dataset": "`trl-lib/DeepMath-103K`, 103,022 rows, columns `prompt`, `solution`",
             "eval_dataset": None, "lora": {"peft_type": "LORA", "r": 32, "lora_alpha": 64, "lora_dropout": 0.0},
             "quantization": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
             "deepspeed": {"zero_stage": 3, "processes": 8, "offload_optimizer_device": "cpu"}, "processes": 8}
    text = model_card_section(args, spec, "DAPO", "2503.14476", setup)
    assert "[Qwen/Qwen2.5-0.5B-Instruct](https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct)" in text
    assert "`math_accuracy` (weight 1), `overlong_penalty` (weight 0.5)" in text
    assert "trl-lib/DeepMath-103K" in text and "r=32" in text and "lora_alpha=64" in text
    assert "load_in_4bit=True" in text and "zero_stage=3" in text and "offload_optimizer_device='cpu'" in text
    assert "| `learning_rate` | `0.0003` |" in text and "| `max_steps` | `3` |" in text
    assert "https://arxiv.org/abs/2503.14476" in text


def test_deepspeed_settings_read_the_plugin():
    from grpo_variants.trainer import deepspeed_settings

    plugin = SimpleNamespace(zero_stage=3, deepspeed_config={"zero_optimization": {
        "stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "none"}}})
    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin), num_processes=2)
    assert deepspeed_settings(accelerator) == {"zero_stage": 3, "processes": 2, "offload_param_device": "cpu"}
    assert deepspeed_settings(SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=None))) is None


def _run_quick_start(card: str, folder: Path) -> None:
    """Run the card's Quick start as a reader would (fewer new tokens): it loads ``folder`` and generates."""
    snippet = re.search(r"## Quick start\n.*?```python\n(.*?)\n```", card, re.S).group(1)
    assert f"model={str(folder)!r}" in snippet, snippet
    snippet = snippet.replace("max_new_tokens=128", "max_new_tokens=4")
    out = {}
    exec(compile(snippet + "\n_out = output", "model card quick start", "exec"), out)  # noqa: S102
    assert isinstance(out["_out"]["generated_text"], str)


def test_a_lora_run_leaves_a_card_and_curve_that_name_everything(tmp_path, toy_kit, make_args):
    """One LoRA step on the toy kit: the card names the local base model (no "[None]"), the rewards, the
    dataset and the adapter; ``record_heldout`` redraws the curve with the before / after points."""
    from grpo_variants import GRPOVariantTrainer
    from grpo_variants.runtime.scale import lora_config

    args = make_args(max_steps=1, report_to="none")
    trainer = GRPOVariantTrainer(model=toy_kit.model_path, reward_funcs="toy_accuracy", args=args,
                                 train_dataset=toy_kit.train_dataset.select(range(64)), peft_config=lora_config(r=4))
    trainer.train()
    out = Path(args.output_dir)
    card = (out / "README.md").read_text()
    assert "[None]" not in card and 'model="None"' not in card
    name = Path(toy_kit.model_path).name
    assert f"fine-tuned version of `{name}` (a local folder)" in card and str(toy_kit.model_path) not in card
    # nothing saved yet: the Quick start says how to save the weights instead of naming a folder without them
    assert f"trainer.save_model({str(out)!r})" in card and not (out / "config.json").exists()
    assert "* Rewards: `toy_accuracy` (weight 1)" in card
    assert "* Training data: an in-memory dataset, 64 rows, columns `prompt`" in card
    assert re.search(r"\* LoRA: peft_type='LORA', r=4, lora_alpha=8, lora_dropout=0\.0", card), card
    assert "* DeepSpeed: none (1 process(es))" in card
    # save_model() after training rewrites the card: its Quick start names the saved folder, and loads it
    trainer.save_model(str(out / "final_model"))
    card = (out / "README.md").read_text()
    assert "trainer.save_model(" not in card
    _run_quick_start(card, out / "final_model")
    curve = out / "reward_curve.png"
    first = curve.read_bytes()
    trainer.run_record.record_heldout(0.25, 0.5, "held-out greedy accuracy (8 problems)")
    assert trainer.run_record.heldout == {"before": 0.25, "after": 0.5, "after_step": 1,
                                          "label": "held-out greedy accuracy (8 problems)"}
    assert curve.read_bytes() != first


def test_notebooks_extra_installs_jupyter_and_ipywidgets_and_the_readme_names_it():
    try:
        import tomllib
    except ImportError:  # Python 3.10: pytest's own dependency
        import tomli as tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.split(r"[<>=\[ ]", req)[0].lower() for req in extras["notebooks"]}
    assert {"jupyter", "ipywidgets", "ipykernel"} <= names
    assert ".[notebooks]" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("logger_name", ["bitsandbytes.backends.cpu.ops", "bitsandbytes"])
def test_bitsandbytes_cpu_kernel_warning_is_filtered(logger_name, caplog):
    import grpo_variants  # noqa: F401  (installs the filters)

    logger = logging.getLogger(logger_name)
    with caplog.at_level(logging.WARNING, logger=logger_name):
        logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you "
                       "already `pip install kernels` and the kernels >= 0.11.1", "No module named 'kernels'")
        logger.warning("something else bitsandbytes says")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["something else bitsandbytes says"]


def test_importing_the_package_then_peft_prints_no_bitsandbytes_kernel_warning():
    """End to end where bitsandbytes is installed (the ``quant`` extra): ``import peft`` alone prints the
    warning on CPUs with AVX512-BF16 and no ``kernels`` package; after ``import grpo_variants`` it does not."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes is not installed (the `quant` extra); the logger filter is tested above")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", "import grpo_variants, peft, bitsandbytes"], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "gemm_4bit_forward" not in done.stdout + done.stderr


def test_the_demos_card_loads_final_model(tmp_path, toy_kit, capsys):
    """The demo saves the weights in ``final_model/`` after training: its card's Quick start names that folder
    (not the output folder, which holds no weights) and loads it; the base model is named without its path."""
    from grpo_variants.demo import main as demo

    out = tmp_path / "demo"
    assert demo(["--output_dir", str(out), "--max_steps", "1", "--eval_every", "100"]) == 0
    card = (out / "README.md").read_text()
    assert not (out / "model.safetensors").exists() and (out / "final_model" / "model.safetensors").exists()
    assert str(Path(toy_kit.model_path).parent) not in card  # no absolute path of the base model
    _run_quick_start(card, out / "final_model")


def test_pyproject_reads_without_setuptools_deprecations():
    """``pip install -e .`` printed setuptools' "`project.license` as a TOML table is deprecated": the license is
    an SPDX string, and setuptools reads the whole [project] table without a deprecation warning."""
    import warnings

    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), str(ROOT / "pyproject.toml"))
    assert [str(w.message).splitlines()[0] for w in caught if "eprecat" in type(w.category).__name__ + str(w.message)] == []
    assert dist.metadata.license_expression == "Apache-2.0"
