"""A program that searches its whole process for an expected value: the red-team probe of the code judge.

``SEARCH`` is program text (not code the tests run): it defines ``_search(want, skip=None)``, which looks
for ``want`` everywhere in the program's process (every module's globals, every frame of every thread,
every object the collector tracks and the attributes of each, every string and bytes there, its stdin and
every other descriptor) and returns what it finds, else None. The caller passes ``want`` only to name what
to look for (a value equal to it, or its repr inside a string): the value returned is the one found, so a
program built on it scores only if the expected value reached its process. Used by
tests/test_code_judge_python.py (plain values) and tests/test_code_judge_objects.py (linked-list nodes).
"""

from __future__ import annotations

SEARCH = r'''
import gc, os, sys

def _search(want, skip=None):
    text = repr(want).encode()
    seen = []
    for f in list(sys._current_frames().values()):
        while f is not None:
            seen += [f.f_locals, f.f_globals]
            f = f.f_back
    seen += [vars(m) for m in list(sys.modules.values()) if hasattr(m, "__dict__")]
    seen += gc.get_objects()
    for o in seen:
        try:
            items = list(o.values()) + list(o.keys()) if isinstance(o, dict) else list(o) if isinstance(
                o, (list, tuple, set, frozenset)) else [o] + list(vars(o).values()) if hasattr(
                o, "__dict__") and not isinstance(o, type) else [o]
        except Exception:
            continue
        for v in items:
            if v is skip or v is want or v is text:  # what it looks for is not what it finds
                continue
            try:
                if type(v) is type(want) and v == want:
                    return v
                if isinstance(v, (str, bytes, bytearray)) and text in (v.encode() if isinstance(v, str) else v):
                    return want
            except Exception:
                pass
    for fd in range(0, 256):
        try:
            os.set_blocking(fd, False)
            data = os.read(fd, 1 << 20)
        except Exception:
            continue
        if text in data:
            return want
    return None
'''
