"""Console output: a progress bar with a few live metrics instead of a dict per step; a summary table."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

from transformers.trainer_callback import PrinterCallback, ProgressCallback

from grpo_variants import GRPOVariantTrainer
from grpo_variants.console import CompactPrinterCallback, LiveProgressCallback, live_metrics, summary_rows


def _kinds(trainer):
    return {type(cb) for cb in trainer.callback_handler.callbacks}


def test_live_metrics_pick_a_handful():
    logs = {"reward": 0.25, "rewards/toy_accuracy/mean": 0.25, "rewards/toy_accuracy/right_fraction": 0.25,
            "kl": 0.0012, "clip_ratio/region_mean": 0.1,
            "throughput/generated_tokens_per_s": 812.4, "loss": 0.3, "grad_norm": 2.0, "eval_toy_accuracy": 0.5}
    assert live_metrics(logs, beta=0.04) == {"reward": "0.25", "held-out acc": "50.0%", "train acc": "25.0%",
                                             "kl": "0.0012", "tok/s": "812"}
    assert "clip" in live_metrics(logs, beta=0.0) and "kl" not in live_metrics(logs, beta=0.0)
    assert live_metrics({"loss": 1.0}) == {}


def test_summary_rows_first_and_last():
    records = [{"step": 0, "eval_toy_accuracy": 0.2},
               {"step": 1, "reward": 0.1, "rewards/toy_accuracy/mean": 0.1, "rewards/toy_accuracy/right_fraction": 0.1},
               {"step": 2, "reward": 0.4, "rewards/toy_accuracy/mean": 0.4, "rewards/toy_accuracy/right_fraction": 0.4,
                "eval_toy_accuracy": 0.6}]
    assert summary_rows(records) == [("reward (train rollouts)", "0.1", "0.4"),
                                     ("train accuracy (toy_accuracy)", "10.0%", "40.0%"),
                                     ("held-out accuracy", "20.0%", "60.0%")]


def test_callbacks_swapped_unless_verbose(make_args, toy_model_path, small_train_dataset):
    bar = GRPOVariantTrainer(model=toy_model_path, reward_funcs="toy_accuracy", train_dataset=small_train_dataset,
                             args=make_args(disable_tqdm=False))
    assert LiveProgressCallback in _kinds(bar) and ProgressCallback not in _kinds(bar)
    quiet = GRPOVariantTrainer(model=toy_model_path, reward_funcs="toy_accuracy", train_dataset=small_train_dataset,
                               args=make_args(disable_tqdm=True))
    assert CompactPrinterCallback in _kinds(quiet) and PrinterCallback not in _kinds(quiet)
    verbose = GRPOVariantTrainer(model=toy_model_path, reward_funcs="toy_accuracy", train_dataset=small_train_dataset,
                                 args=make_args(disable_tqdm=True, verbose=True))
    assert PrinterCallback in _kinds(verbose) and CompactPrinterCallback not in _kinds(verbose)


def test_run_prints_short_lines_and_a_summary(make_args, toy_model_path, small_train_dataset, capsys, monkeypatch):
    import grpo_variants.callbacks as callbacks

    titles = []
    plot = callbacks.plot_reward_curve
    monkeypatch.setattr(callbacks, "plot_reward_curve", lambda records, path, title, heldout=None: (
        titles.append(title), plot(records, path, title, heldout))[1])
    trainer = GRPOVariantTrainer(model=toy_model_path, reward_funcs="toy_accuracy", train_dataset=small_train_dataset,
                                 args=make_args(disable_tqdm=True, max_steps=2))
    trainer.train()
    out = capsys.readouterr().out
    # no variant: TRL's GRPO with TRL's defaults, not the `grpo` variant (the DeepSeekMath paper's defaults)
    assert "TRL GRPO (no variant): 2 optimizer steps" in out and "grpo: " not in out
    assert f"the model is not saved: trainer.save_model({trainer.args.output_dir!r})" in out  # nothing saved yet
    assert titles == ["TRL GRPO (no variant): reward during training"]
    card = (Path(trainer.args.output_dir) / "README.md").read_text()
    assert "Variant **TRL GRPO (no variant)**: TRL's GRPO loss" in card and "trained with TRL GRPO (no variant)" in card
    assert "{'loss'" not in out and "'grad_norm'" not in out  # no per-step dicts
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/2", "2/2"] and all("reward" in line for line in lines)
    assert "2 optimizer steps" in out and "metrics.jsonl" in out and "reward (train rollouts)" in out


def test_no_warning_from_our_checkpointing_field(recwarn):
    from grpo_variants import GRPOVariantConfig

    warnings.simplefilter("always")
    for value in (None, False, True):
        args = GRPOVariantConfig(output_dir="unused", report_to="none", gradient_checkpointing=value)
        expected = value if value is not None else False  # CPU: off unless set
        assert args.gradient_checkpointing is expected
        # the new name exists only in recent transformers (not 5.17, the vLLM tier's)
        assert getattr(args, "activation_checkpointing", expected) is expected
    assert not [w for w in recwarn if "checkpointing" in str(w.message)]


def test_deepspeed_cpu_line_filtered():
    import grpo_variants  # noqa: F401  (installs the filters)

    record = logging.LogRecord("DeepSpeed", logging.WARNING, __file__, 1,
                               "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable "
                               "to detect it.", None, None)
    assert not all(f.filter(record) for f in logging.getLogger("DeepSpeed").filters)
    other = logging.LogRecord("DeepSpeed", logging.WARNING, __file__, 1, "something else", None, None)
    assert all(f.filter(other) for f in logging.getLogger("DeepSpeed").filters)


def test_torch_c10d_deprecations_filtered_only_from_torch():
    """torch's FutureWarning on the c10d collectives DeepSpeed's ZeRO-3 calls is dropped when it comes from
    ``torch.distributed.c10d_logger``; the same words from another module, and another FutureWarning from
    that module, still show (the filter is by message, category and module, never global)."""
    from grpo_variants.runtime.noise import install_warning_filters

    def shown(message, module, category=FutureWarning):
        with warnings.catch_warnings(record=True) as caught:
            warnings.resetwarnings()  # pytest's own "ignore::FutureWarning" (pyproject) out of the way
            warnings.simplefilter("default")
            install_warning_filters()
            warnings.warn_explicit(message, category, "c10d_logger.py", 83, module=module, registry={})
        return len(caught)

    torch_says = ("`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
                  "`torch.distributed.all_gather_single` instead.")
    assert shown(torch_says, "torch.distributed.c10d_logger") == 0
    assert shown(torch_says.replace("all_gather", "reduce_scatter"), "torch.distributed.c10d_logger") == 0
    assert shown(torch_says, "my_module") == 1
    assert shown("`x` is deprecated and will be removed", "torch.distributed.c10d_logger") == 1
