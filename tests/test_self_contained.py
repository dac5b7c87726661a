"""The repository is self-contained: no file refers to a path outside it, and the docs' links resolve.

A user who clones the project has only the repository. A docstring that sends them to a file of the
machine the project was built on (a spec folder, a home or work directory) is a dead end, and so is a
relative link in the docs to a file that does not exist.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Spelled in pieces so that this file does not match itself.
FORBIDDEN = [
    "shared" + "/spec",  # the build machine's specification folder
    "ALGORITHMS" + ".md",  # ... and the files in it
    "PEERS" + ".md",
    "TOY-FEASIBILITY" + ".md",
    "/" + "work/",  # absolute paths of build machines and home folders
    "/" + "root/",
    "/" + "home/",
    "/" + "Users/",
]
_SKIP_DIRS = {".git", ".venv", "venv", "outputs", "__pycache__", ".cache", ".pytest_cache", "build", "dist"}


def repository_files() -> list[Path]:
    """Files under version control (``git ls-files``), or every file outside build folders without git."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout.decode()
        files = [ROOT / name for name in listed.split("\0") if name]
        if files:
            return [f for f in files if f.is_file()]
    except (OSError, subprocess.SubprocessError):
        pass
    found = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.endswith(".egg-info")]
        found.extend(Path(folder) / n for n in names)
    return found


def _text(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None  # binary (images, ...)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_no_file_refers_to_a_path_outside_the_repository():
    offenders = []
    files = repository_files()
    assert any(f.name == "trainer.py" for f in files), "the file listing found no package source"
    for path in files:
        text = _text(path)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for pattern in FORBIDDEN:
                if pattern in line:
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {pattern!r} in {line.strip()[:120]!r}")
    assert not offenders, (
        "files refer to paths outside the repository (point to docs/algorithms.md or docs/architecture.md, "
        "or write the path relative to the repository):\n" + "\n".join(offenders)
    )


def test_the_check_catches_an_outside_path(tmp_path):
    """The patterns match what they are meant to catch (a check that can fail)."""
    line = 'see ``/' + 'work/shared' + '/spec/ALGORITHMS' + '.md``'
    assert sum(pattern in line for pattern in FORBIDDEN) >= 3
    assert not any(pattern in "see docs/algorithms.md and ~/.cache/grpo_variants" for pattern in FORBIDDEN)


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", ["README.md", *sorted(p.name for p in (ROOT / "docs").glob("*.md"))])
def test_relative_links_in_the_docs_resolve(doc):
    path = ROOT / doc if doc == "README.md" else ROOT / "docs" / doc
    missing = []
    for target in _LINK.findall(path.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        file_part = target.split("#", 1)[0]
        if not (path.parent / file_part).exists():
            missing.append(target)
    assert not missing, f"{doc} links to files that do not exist: {missing}"
