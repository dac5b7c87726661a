"""Shared fixtures: the toy kit (built once per cache), tiny configs, and a clean output folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("GRPO_VARIANTS_CACHE", str(REPO / ".cache" / "grpo_variants"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")


@pytest.fixture(scope="session")
def toy_kit():
    """The warm-started toy policy and its datasets (cached on disk across runs)."""
    from grpo_variants.tasks import toy

    return toy.prepare(task="addition", verbose=False)


@pytest.fixture(scope="session")
def toy_model_path(toy_kit):
    return toy_kit.model_path


@pytest.fixture(scope="session")
def small_train_dataset(toy_kit):
    return toy_kit.train_dataset.select(range(256))


def tiny_args(config_cls=None, output_dir="out", **overrides):
    """A config small enough for a CPU test step (16 completions, 4 per prompt, 6 new tokens)."""
    from grpo_variants import GRPOVariantConfig

    config_cls = config_cls or GRPOVariantConfig
    from grpo_variants.lab import TOY_CONFIG

    values = {**TOY_CONFIG, "output_dir": str(output_dir), "per_device_train_batch_size": 16, "num_generations": 4,
              "max_steps": 3, "seed": 0}
    values.update(overrides)
    return config_cls(**values)


@pytest.fixture
def make_args(tmp_path):
    def factory(config_cls=None, **overrides):
        overrides.setdefault("output_dir", str(tmp_path / "out"))
        return tiny_args(config_cls, **overrides)

    return factory


def position_reward(prompts, completions, **kwargs):
    """Reward ``i / n`` for the ``i``-th of the ``n`` completions of a call, whatever they say.

    TRL scores a group's completions side by side, so every group gets distinct rewards: non-zero reward
    variance, non-zero advantages and a policy gradient are true by construction, on any machine and for any
    toy warm-start seed (a test that needs the policy to move must not hope that some group of a ~30%-accurate
    policy happened to disagree). Train with ``reward_cache=False``: the cache would score identical
    completions once, and a group of identical completions would then have one reward again.
    """
    n = len(completions)
    return [i / n for i in range(n)]


def force_completions(trainer, completion_for) -> None:
    """Replace the sampled completions of every rollout by ``completion_for(prompt_text, k)`` (a string).

    ``k`` is the sample's index among the identical prompts of the call (its index in its group). The real
    generation still runs first; everything downstream (decoding, rewards, advantages, masks, the loss) is
    the trainer's own, on completions whose length and EOS a test chose. The record of behaviour log-probs
    made during generation is refused for these tokens, so TRL recomputes them.
    """
    tokenizer = trainer.processing_class
    original = trainer._generate_single_turn

    def _generate_single_turn(prompt_ids, *args, **kwargs):
        original(prompt_ids, *args, **kwargs)
        seen: dict = {}
        out = []
        for ids in prompt_ids:
            k = seen.get(tuple(ids), 0)
            seen[tuple(ids)] = k + 1
            text = completion_for(tokenizer.decode(ids, skip_special_tokens=True), k)
            out.append(tokenizer(text, add_special_tokens=False)["input_ids"][: trainer.max_completion_length])
        return out, None

    trainer._generate_single_turn = _generate_single_turn


def exit_without_teardown(code: int = 0) -> None:
    """End a multi-process test worker once its results are written, skipping interpreter teardown.

    On this machine about one 2-process CPU run in ten aborts *during* interpreter teardown, after all
    work is done and written ("terminate called without an active exception", exit -6; seen with the
    plain DDP/gloo workers, with or without destroy_process_group at exit). The tests check training,
    not torch's teardown, so workers leave with os._exit once their output is on disk.
    """
    import sys as _sys

    _sys.stdout.flush()
    _sys.stderr.flush()
    os._exit(code)


# ---------------------------------------------------------------------------------------------------------
# Suite cost: peak memory per pytest process, models released between tests, slow tests scheduled first.
# `make test` runs two xdist workers; each must stay under MEMORY_LIMIT_GB (docs/contributing.md).
MEMORY_LIMIT_GB = 4.0


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def _release_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc keeps them otherwise)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


_PEAK = {"rss": 0, "test": None}  # this process's peak RSS so far and the test during which it was reached


@pytest.fixture(autouse=True)
def _release_models_after_each_test(request):
    """A test's models, trainers and optimizers are garbage once it ends; free them before the next test.

    Trainers hold reference cycles (callbacks <-> trainer), so without a collection a worker carries the
    last tests' models into the next one and its peak grows with test order. Also notes which test raised
    the process's peak memory (printed in the summary).
    """
    yield
    peak = _peak_rss_bytes()
    if peak > _PEAK["rss"]:
        _PEAK.update(rss=peak, test=request.node.nodeid)
    import psutil

    if psutil.Process().memory_info().rss > 1 << 30:  # only when there is something worth freeing (>1 GB)
        _release_memory()


SHUFFLE_ENV = "GRPO_VARIANTS_TEST_SHUFFLE"  # an integer seed: run the tests in a shuffled order


WORKER_THREADS_ENV = "GRPO_VARIANTS_WORKER_THREADS"  # e.g. "2,1": torch threads of worker gw0, gw1, ...


def _worker_threads() -> int | None:
    """This xdist worker's torch thread count from ``$GRPO_VARIANTS_WORKER_THREADS`` (test-portable: one worker on
    2 threads, the other on 1, so the pass runs another thread count than the 1-thread tiers), else None."""
    spec, worker = os.environ.get(WORKER_THREADS_ENV), os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    if not spec or not worker.startswith("gw"):
        return None
    counts = [int(n) for n in spec.split(",")]
    return counts[int(worker[2:]) % len(counts)]


def pytest_configure(config):
    # pytest-xdist registers it; the engine tier's environment runs without xdist (one process)
    config.addinivalue_line("markers", "xdist_group(name): tests that run on one xdist worker (--dist loadgroup)")
    threads = _worker_threads()
    if threads is not None:  # subprocesses the tests start inherit it too
        os.environ["OMP_NUM_THREADS"] = str(threads)
        import torch

        torch.set_num_threads(threads)


# Caches the tiers build on a fresh clone, built side by side (one process per core) before the workers start
# (``$GRPO_VARIANTS_PREBUILD``, set by the Makefile's tiers): otherwise the first tests of both workers wait on the
# same build lock, one core idle, and the chat-format policy or SmolLM2 is built later by one worker while the other
# waits for it. Each build is the one the tests would run (same functions, same cache entry, same seed); a failed
# build is only reported here: the tests that need it then fail (or skip) with their own message.
PREBUILD_ENV = "GRPO_VARIANTS_PREBUILD"
_PREBUILDS = {
    "toy policy": "from grpo_variants.tasks import toy; toy.prepare(verbose=False)",
    "toy chat-format policy": "from grpo_variants.tasks import toy; toy.prepare(conversational=True, verbose=False)",
    "SmolLM2-135M": "from grpo_variants.tasks.models import smollm2; smollm2(verbose=False)",  # slow tiers only
}
_PREBUILD_LINES: list[str] = []


@pytest.hookimpl(tryfirst=True)  # before xdist starts its workers
def pytest_sessionstart(session):
    config = session.config
    if not os.environ.get(PREBUILD_ENV) or hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        return  # only a tier's xdist controller (a plain `pytest file.py`, e.g. run by a doc snippet, builds on demand)
    import subprocess
    import sys
    import tempfile
    import time

    names = [name for name in _PREBUILDS if name != "SmolLM2-135M" or "not slow" not in (config.option.markexpr or "")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                                                           os.environ.get("PYTHONPATH")]))}
    started = time.monotonic()
    procs = {}
    for name in names:
        log = tempfile.TemporaryFile(mode="w+")
        procs[name] = (subprocess.Popen([sys.executable, "-c", _PREBUILDS[name]], env=env, stdout=log,
                                        stderr=subprocess.STDOUT, text=True), log)
    took: dict = {}
    while len(took) < len(procs):
        for name, (proc, _) in procs.items():
            if name not in took and proc.poll() is not None:
                took[name] = time.monotonic() - started
        time.sleep(0.2)
    parts = []
    for name, (proc, log) in procs.items():
        if proc.returncode == 0:
            parts.append(f"{name} {took[name]:.0f} s")
        else:
            log.seek(0)
            parts.append(f"{name} FAILED (exit {proc.returncode})")
            _PREBUILD_LINES.append(f"prebuild of the {name} failed:\n" + "\n".join(log.read().splitlines()[-15:]))
        log.close()
    _PREBUILD_LINES.insert(0, f"caches ready before the tests ({PREBUILD_ENV}=1, side by side, "
                              f"{time.monotonic() - started:.0f} s): " + ", ".join(parts))


# $GRPO_VARIANTS_TIMELINE=<file>: one JSON line per test (worker, test, start, end: wall-clock seconds), setup and
# teardown included, appended by every worker: where each worker spent its time and when it idled.
TIMELINE_ENV = "GRPO_VARIANTS_TIMELINE"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get(TIMELINE_ENV)
    if not path:
        yield
        return
    import json
    import time

    start = time.time()
    yield
    line = json.dumps({"worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "test": item.nodeid,
                       "start": round(start, 3), "end": round(time.time(), 3)})
    with open(path, "a") as f:
        f.write(line + "\n")


def pytest_report_header(config):
    return _run_setting_lines()


def _run_setting_lines() -> list[str]:
    """The shuffle seed and per-worker threads, in the header and (since -q hides the header) the summary."""
    lines = []
    seed = os.environ.get(SHUFFLE_ENV)
    if seed:
        lines.append(f"test order shuffled with seed {seed} ({SHUFFLE_ENV}={seed} reproduces it)")
    if os.environ.get(WORKER_THREADS_ENV):
        lines.append(f"torch threads per xdist worker (gw0, gw1, ...): {os.environ[WORKER_THREADS_ENV]}")
    return lines


# Modules whose tests (or module fixtures) launch 2-rank trainings: their module fixtures then run once, on one
# worker, and no two launches oversubscribe the 2 cores side by side.
MULTIPROCESS_MODULES = {"test_zero3", "test_zero3_launch"}


def _launches_processes(item) -> bool:
    module = getattr(item, "module", None)
    if module is not None and module.__name__.rsplit(".", 1)[-1] in MULTIPROCESS_MODULES:
        return True
    if "two_processes" in item.name and item.get_closest_marker("slow"):
        return True
    block = getattr(getattr(item, "callspec", None), "params", {}).get("block")  # a doc snippet's command
    return "--num_processes" in str(getattr(block, "code", ""))


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads xdist_group (this conftest is registered first)
def pytest_collection_modifyitems(config, items):
    """Multi-process launches in one xdist group (see ``MULTIPROCESS_MODULES``). Slow tests first: with two workers, the long tests start early instead of one worker finishing last
    with a multi-minute test while the other idles. Order within each class is kept (stable sort).

    With ``$GRPO_VARIANTS_TEST_SHUFFLE`` set (CI's portability pass sets it), the order is a shuffle seeded by
    it (the same in every xdist worker, which xdist requires): a test that relies on another's leftovers
    fails there.
    """
    for item in items:
        if _launches_processes(item):  # one launch at a time across the workers (make test: --dist loadgroup)
            item.add_marker(pytest.mark.xdist_group("multiprocess"))
    seed = os.environ.get(SHUFFLE_ENV)
    if seed:
        import random

        random.Random(int(seed)).shuffle(items)
    items.sort(key=lambda item: 0 if item.get_closest_marker("slow") else 1)


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: hand its peak to the controller
        workeroutput["peak_rss"] = _peak_rss_bytes()
        workeroutput["peak_test"] = _PEAK["test"]


_WORKER_PEAKS: dict = {}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    output = getattr(node, "workeroutput", {})
    if output.get("peak_rss") is not None:
        _WORKER_PEAKS[node.gateway.id] = (output["peak_rss"], output.get("peak_test"))


def pytest_terminal_summary(terminalreporter):
    peaks = dict(_WORKER_PEAKS) or {"main": (_peak_rss_bytes(), _PEAK["test"])}
    parts = ", ".join(f"{name} {value / 2**30:.2f} GB" + (f" (reached in {test})" if test else "")
                      for name, (value, test) in sorted(peaks.items()))
    worst = max(value for value, _ in peaks.values()) / 2**30
    verdict = "within" if worst <= MEMORY_LIMIT_GB else "ABOVE"
    terminalreporter.write_line(f"peak RSS per pytest process: {parts} ({verdict} the {MEMORY_LIMIT_GB:.0f} GB limit)")
    for line in _PREBUILD_LINES + _run_setting_lines():
        terminalreporter.write_line(line)
