"""One builder at a time for a cache entry, across processes.

Two pytest workers (``make test`` runs two), two notebooks or two runs that need the same uncached toy
policy would otherwise both train it, and the second to finish would replace the folder the first is
already loading from. ``build_lock(entry)`` holds an advisory ``flock`` on ``<entry>.lock`` beside the
entry: the first caller builds, the others wait, then find the entry built and reuse it. The lock file
stays (an empty file); the kernel drops the lock when its holder exits, even when it is killed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path


@contextlib.contextmanager
def build_lock(entry: str | os.PathLike):
    """Hold an exclusive lock on ``<entry>.lock`` (created beside ``entry``) for the ``with`` block."""
    entry = Path(entry)
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.with_name(entry.name + ".lock"), "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
