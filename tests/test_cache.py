"""Cache entries are built by one process at a time (grpo_variants.tasks.cache.build_lock).

``make test`` runs two pytest workers that share one cache: both may ask for the same uncached toy policy.
The first builds it under the entry's lock; the second waits, then finds it built and reuses it.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

CACHE_MODULE = Path(__file__).resolve().parents[1] / "grpo_variants" / "tasks" / "cache.py"

# The pattern every builder follows (toy warm start, random init, chain task, SmolLM2 conversion): check,
# lock, check again, build. Loaded by path: no torch import, so the test costs about a second.
BUILDER = textwrap.dedent("""
    import importlib.util, os, sys, time
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("cache", sys.argv[1])
    cache = importlib.util.module_from_spec(spec); spec.loader.exec_module(cache)
    entry = Path(sys.argv[2])
    if not (entry / "done").exists():
        with cache.build_lock(entry):
            if not (entry / "done").exists():
                with open(entry.parent / "builds.log", "a") as log:
                    log.write(f"{os.getpid()}\\n")
                time.sleep(1.0)  # a slow build: the other process arrives while it runs
                entry.mkdir()
                (entry / "done").write_text("ok")
    print((entry / "done").read_text())
""")


def test_two_processes_build_an_entry_once(tmp_path):
    entry = tmp_path / "toy" / "warm-abc"
    procs = [subprocess.Popen([sys.executable, "-c", BUILDER, str(CACHE_MODULE), str(entry)],
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outputs == ["ok", "ok"]  # both read the one built entry
    assert len((tmp_path / "toy" / "builds.log").read_text().split()) == 1  # built once


def test_lock_is_released_when_the_holder_is_killed(tmp_path):
    """A killed builder leaves no stale lock: the kernel drops a flock with its holder."""
    entry = tmp_path / "entry"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import importlib.util, sys, time
        spec = importlib.util.spec_from_file_location("cache", sys.argv[1])
        cache = importlib.util.module_from_spec(spec); spec.loader.exec_module(cache)
        with cache.build_lock(sys.argv[2]):
            print("held", flush=True)
            time.sleep(60)
    """), str(CACHE_MODULE), str(entry)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait(timeout=10)
    spec = importlib.util.spec_from_file_location("cache_under_test", CACHE_MODULE)
    cache = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cache)
    with cache.build_lock(entry):  # would block forever if the lock had outlived its holder (pytest-timeout)
        pass
