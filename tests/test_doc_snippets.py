"""Every command and code block the Markdown docs show is run as written (issue #26).

The blocks are extracted from the committed Markdown files (README.md, docs/, recipes/, benchmarks/,
any other ``*.md``), so a doc cannot drift from the code: change an API or a flag and the block that
shows it fails here.

**Which blocks run.** A fenced block's language decides its runner:

* ``python``: executed in a fresh namespace; the blocks of one file and tier share one interpreter
  (torch and TRL are imported once), each block in its own namespace, in document order.
* ``bash`` / ``sh`` / ``shell``: the whole block runs with ``bash -euo pipefail``; ``console``: the lines
  that start with ``$ `` are the commands (the rest is their output, not checked).
* ``yaml`` / ``json`` / ``toml`` / ``text``: data or a layout listing, not executed.

Any other language, or a fence without one, fails :func:`test_every_fenced_block_has_a_runner`: give the
block a language above, or make an illustrative fragment plain indented text.

**The one convention for a block that cannot run in the fast tier** is an HTML comment on the line
just before its fence (invisible on GitHub)::

    <!-- snippet: slow -->     minutes or several processes: runs in the slow tier (`pytest -m slow`)
    <!-- snippet: gpu -->      needs a CUDA GPU: skipped with that reason on a machine without one
    <!-- snippet: excerpt of examples/leave_one_out.py -->
                               a quoted fragment of a committed file: checked to appear in it verbatim

Nothing is shrunk: a block runs exactly as written. Two things are arranged around it, both said in
the test's output:

* **Where.** Blocks run from a scratch folder that links every top-level entry of the checkout
  (``recipes/``, ``benchmarks/``, the ``Makefile``, ...), so relative paths work as from the repository
  root and every ``out`` / ``outputs/`` folder a block writes is thrown away. ``python``,
  ``grpo-variants`` and ``accelerate`` are the interpreter's environment's, the package is this
  checkout's (``PYTHONPATH``), and ``make`` targets use ``.venv`` when ``make setup`` made it for this
  checkout (the fresh-clone set-up CI runs); otherwise a ``.venv`` that points at the running
  interpreter's environment, marked as installed, so ``make`` never installs anything from a test.
* **No recursion.** A ``make test`` / ``make test-fast`` / ``make test-portable`` / ``make test-vllm`` line (a suite)
  runs as ``make -n TARGET`` (the target exists and its recipe is printed), since running the suite from
  inside the suite would never end. CI runs ``make test`` itself (``.ci/run``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

RUNNERS = {"python": "python", "bash": "bash", "sh": "bash", "shell": "bash", "console": "console"}
DATA_LANGUAGES = {"yaml", "json", "toml", "text"}
MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(?P<tags>.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
SUITE_TARGETS = re.compile(r"^(\s*)make\s+(test|test-fast|test-portable|test-vllm)\b")

# Blocks that fail on main because of a bug another change fixes: (file, a line of the block) -> reason.
# Strict: the test fails once the bug is fixed, so the entry is removed then.
KNOWN_FAILURES: dict[tuple[str, str], str] = {}  # (path, a line of the block) -> issue; strict xfail


@dataclass
class Block:
    path: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    tags: dict = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def tier(self) -> str:
        if "run_by" in self.tags:
            return "delegated"  # run as written by the named test file, which asserts more about its output
        if "gpu" in self.tags:
            return "gpu"
        if "excerpt" in self.tags:
            return "excerpt"
        return "slow" if "slow" in self.tags else "fast"


def parse_tags(text: str) -> dict:
    """``slow``, ``gpu``, ``excerpt of PATH``, ``run by PATH`` (comma-separated) -> ``{"slow": True, "excerpt":
    "PATH", "run_by": "PATH"}``. ``run by tests/x.py``: that test file runs the block as written (it takes the block
    from :data:`BLOCKS` with :func:`delegated_blocks`) and checks its output, so this file does not run it again."""
    tags: dict = {}
    for part in (p.strip() for p in text.split(",")):
        if part in ("slow", "gpu"):
            tags[part] = True
        elif part.startswith("excerpt of "):
            tags["excerpt"] = part[len("excerpt of "):].strip()
        elif part.startswith("run by "):
            tags["run_by"] = part[len("run by "):].strip()
        else:
            raise ValueError(f"unknown snippet tag {part!r} (known: slow, gpu, excerpt of PATH, run by PATH)")
    return tags


def _closes(line: str, fence: str) -> bool:
    stripped = line.strip()
    return bool(stripped) and set(stripped) == {fence[0]} and len(stripped) >= len(fence)


def extract_blocks(text: str, path: str) -> list[Block]:
    """Every fenced block of a Markdown text, with the tags of a ``<!-- snippet: ... -->`` line above it."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence = match["indent"], match["fence"]
        language = match["info"].strip().split(" ")[0].lower() if match["info"].strip() else ""
        j = i + 1
        body = []
        while j < len(lines) and not _closes(lines[j], fence):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
            j += 1
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = MARKER.match(lines[k]) if k >= 0 else None
        tags = parse_tags(marker["tags"]) if marker else {}
        blocks.append(Block(path, i + 1, language, "\n".join(body) + "\n", tags))
        i = j + 1
    return blocks


def doc_files(root: Path = ROOT) -> list[Path]:
    """The committed Markdown files (git's list when there is one, else every ``*.md`` outside hidden
    folders, virtual environments and outputs)."""
    try:
        listed = subprocess.run(["git", "ls-files", "*.md", "**/*.md"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.split()
        if listed:
            return sorted({root / p for p in listed if (root / p).exists()})
    except (OSError, subprocess.CalledProcessError):
        pass
    skip = {"outputs", "node_modules", "build", "dist"}
    return sorted(p for p in root.rglob("*.md")
                  if not any(part.startswith(".") or part in skip for part in p.relative_to(root).parts[:-1]))


def all_blocks(root: Path = ROOT) -> list[Block]:
    blocks = []
    for path in doc_files(root):
        blocks += extract_blocks(path.read_text(encoding="utf-8"), str(path.relative_to(root)))
    return blocks


BLOCKS = all_blocks()


def delegated_blocks(test_file: str) -> list[Block]:
    """The blocks tagged ``run by <test_file>``: that file runs them (with :func:`run_shell_block`)."""
    return [block for block in BLOCKS if block.tags.get("run_by") == test_file]


def test_every_delegated_block_is_run_by_its_test_file():
    """A block tagged ``run by PATH`` is skipped here: PATH must exist and take its blocks from delegated_blocks."""
    problems = []
    for block in BLOCKS:
        path = block.tags.get("run_by")
        if path is None:
            continue
        target = ROOT / path
        if not target.is_file() or f'delegated_blocks("{path}")' not in target.read_text():
            problems.append(f"{block.where}: tagged 'run by {path}', which does not call delegated_blocks(\"{path}\")")
        if RUNNERS.get(block.language) not in ("bash", "console"):
            problems.append(f"{block.where}: only shell blocks can be delegated")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- the convention itself

def test_every_fenced_block_has_a_runner():
    problems = []
    for block in BLOCKS:
        if block.language not in RUNNERS and block.language not in DATA_LANGUAGES:
            problems.append(f"{block.where}: fenced block with language {block.language or '(none)'!r}: use one "
                            f"of {sorted(RUNNERS)} (run by this test) or {sorted(DATA_LANGUAGES)} (data), or "
                            "make an illustrative fragment plain indented text")
        if block.tags and block.language not in RUNNERS:
            problems.append(f"{block.where}: a snippet tag on a {block.language!r} block, which never runs")
    assert not problems, "\n".join(problems)


def test_a_new_block_without_a_runner_is_caught():
    doc = textwrap.dedent("""\
        Text.

        ```ruby
        puts 1
        ```

        <!-- snippet: slow -->
        ```bash
        echo slow
        ```

        ```
        no language
        ```

            indented text is never run
        """)
    blocks = extract_blocks(doc, "x.md")
    assert [(b.line, b.language, b.tier) for b in blocks] == [(3, "ruby", "fast"), (8, "bash", "slow"),
                                                            (12, "", "fast")]
    assert blocks[1].code == "echo slow\n"
    unknown = [b for b in blocks if b.language not in RUNNERS and b.language not in DATA_LANGUAGES]
    assert [b.line for b in unknown] == [3, 12]
    with pytest.raises(ValueError, match="unknown snippet tag 'fast'"):
        extract_blocks("<!-- snippet: fast -->\n```bash\ntrue\n```\n", "y.md")


def test_the_docs_have_runnable_blocks_in_every_tier():
    """The extraction finds the README's blocks (a broken parser would make every other test vacuous)."""
    readme = [b for b in BLOCKS if b.path == "README.md"]
    assert any(b.language == "python" for b in readme) and any(b.language == "bash" for b in readme)
    assert {b.tier for b in BLOCKS} >= {"fast", "slow", "excerpt"}


def test_known_failures_name_existing_blocks():
    for (path, line), reason in KNOWN_FAILURES.items():
        assert any(b.path == path and line in b.code for b in BLOCKS), f"{reason}: no block of {path} has {line!r}"


def test_excerpts_are_verbatim():
    for block in (b for b in BLOCKS if b.tier == "excerpt"):
        source = (ROOT / block.tags["excerpt"]).read_text(encoding="utf-8")
        assert is_excerpt(block.code, source), f"{block.where}: the excerpt is not in {block.tags['excerpt']} as shown"


def is_excerpt(code: str, source: str) -> bool:
    """``code`` appears in ``source`` line for line, shifted right by one common indentation."""
    lines = textwrap.dedent(code).strip("\n").splitlines()
    return any("\n".join((" " * indent + line) if line else "" for line in lines) in source for indent in range(0, 17))


def test_is_excerpt():
    source = "class A:\n    def f(self):\n        return 1\n\n    def g(self):\n        pass\n"
    assert is_excerpt("def f(self):\n    return 1\n", source)
    assert not is_excerpt("def f(self):\n    return 2\n", source)
    assert not is_excerpt("def f(self):\nreturn 1\n", source)


# ---------------------------------------------------------------- running the blocks

def _venv_for_make(scratch: Path) -> Path:
    """``.venv`` made by ``make setup`` for this checkout, else one that points at this interpreter's."""
    own = ROOT / ".venv"
    stamp = own / ".installed"
    if stamp.exists() and stamp.stat().st_mtime >= (ROOT / "pyproject.toml").stat().st_mtime:
        return own
    shim = scratch / ".venv"
    shim.mkdir()
    for entry in Path(sys.prefix).iterdir():
        if entry.name != ".installed":
            (shim / entry.name).symlink_to(entry)
    (shim / ".installed").touch()
    print(f"make targets use {sys.prefix} through {shim} (no .venv from `make setup` in this checkout)")
    return shim


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A folder that looks like the repository root, where blocks write their outputs."""
    folder = tmp_path_factory.mktemp("docs")
    for entry in ROOT.iterdir():
        if entry.name in (".git", ".venv", ".cache", "outputs", "out") or entry.name.startswith(".pytest"):
            continue
        (folder / entry.name).symlink_to(entry)
    venv = _venv_for_make(folder)
    if venv != folder / ".venv":
        (folder / ".venv").symlink_to(venv)
    return folder


def _env(scratch: Path) -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["VENV"] = str(scratch / ".venv")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("PYTEST_CURRENT_TEST", None)
    env.pop("GRPO_VARIANTS_PREBUILD", None)  # the tier's caches are built; a block's own pytest builds on demand
    return env


_DRIVER = r"""
import json, sys, traceback
for block in json.load(open(sys.argv[1])):
    print(f"== {block['where']}", flush=True)
    try:
        exec(compile(block["code"], block["where"], "exec"), {"__name__": "__main__"})
    except BaseException:
        traceback.print_exc()
        print(f"== FAILED: the python block at {block['where']}", flush=True)
        sys.exit(1)
"""


def _run_python(blocks: list[Block], scratch: Path, timeout: int) -> None:
    spec = scratch / f"blocks-{os.getpid()}-{id(blocks)}.json"
    spec.write_text(json.dumps([{"where": b.where, "code": b.code} for b in blocks]))
    result = subprocess.run([sys.executable, "-c", _DRIVER, str(spec)], cwd=scratch, env=_env(scratch),
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{result.stdout[-6000:]}\n{result.stderr[-6000:]}"


def _shell_code(block: Block) -> str:
    lines = block.code.splitlines()
    if block.language == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    return "\n".join(SUITE_TARGETS.sub(r"\1make -n \2", line) for line in lines) + "\n"


def _run_shell(block: Block, scratch: Path, timeout: int) -> str:
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", _shell_code(block)], cwd=scratch,
                            env=_env(scratch), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (f"the {block.language} block at {block.where} exited {result.returncode}:\n"
                                    f"{result.stdout[-6000:]}\n{result.stderr[-6000:]}")
    return result.stdout + result.stderr


run_shell_block = _run_shell  # for test files that run their delegated blocks: (block, scratch, timeout) -> output


def _known_failure(block: Block):
    for (path, line), reason in KNOWN_FAILURES.items():
        if block.path == path and line in block.code:
            return pytest.mark.xfail(strict=True, reason=reason)
    return None


def _params(tier: str, languages: set[str]):
    params = []
    for block in BLOCKS:
        if block.tier != tier or RUNNERS.get(block.language) not in languages:
            continue
        marks = [pytest.mark.slow] if tier == "slow" else []
        known = _known_failure(block)
        if known is not None:
            marks.append(known)
        params.append(pytest.param(block, id=block.where, marks=marks))
    return params


def _python_groups(tier: str):
    groups: dict[str, list[Block]] = {}
    for block in BLOCKS:
        if block.tier == tier and block.language == "python":
            groups.setdefault(block.path, []).append(block)
    params = []
    for path, blocks in groups.items():
        marks = [pytest.mark.slow] if tier == "slow" else []
        marks += [known for known in map(_known_failure, blocks) if known is not None][:1]
        params.append(pytest.param(blocks, id=path, marks=marks))
    return params


@pytest.mark.parametrize("blocks", _python_groups("fast"))
def test_python_blocks(blocks, scratch):
    _run_python(blocks, scratch, timeout=600)


@pytest.mark.parametrize("blocks", _python_groups("slow"))
def test_python_blocks_slow(blocks, scratch):
    _run_python(blocks, scratch, timeout=1800)


@pytest.mark.parametrize("block", _params("fast", {"bash", "console"}))
def test_shell_blocks(block, scratch):
    _run_shell(block, scratch, timeout=600)


@pytest.mark.parametrize("block", _params("slow", {"bash", "console"}))
def test_shell_blocks_slow(block, scratch):
    _run_shell(block, scratch, timeout=3600)


@pytest.mark.parametrize("block", [pytest.param(b, id=b.where) for b in BLOCKS if b.tier == "gpu"])
def test_gpu_blocks(block, scratch):
    import torch

    if not torch.cuda.is_available():
        pytest.skip(f"{block.where} needs a CUDA GPU (marked <!-- snippet: gpu -->)")
    if block.language == "python":
        _run_python([block], scratch, timeout=1800)
    else:
        _run_shell(block, scratch, timeout=3600)


def test_suite_lines_become_dry_runs():
    block = Block("x.md", 1, "bash", "make demo\nmake test   # all\n  make test-fast\nmake tests\n")
    assert _shell_code(block) == "make demo\nmake -n test   # all\n  make -n test-fast\nmake tests\n"
    console = Block("x.md", 1, "console", "$ grpo-variants list\ngrpo  GRPO\n$ make test-portable\n")
    assert _shell_code(console) == "grpo-variants list\nmake -n test-portable\n"


def test_the_readme_stays_a_five_minute_read():
    """Under 12 kB, and its set-up is exactly the two commands (issue #26); details live in docs/ and
    benchmarks/README.md."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.encode("utf-8")) < 12 * 1024, f"README.md is {len(text.encode()):,} bytes"
    setup = [b for b in BLOCKS if b.path == "README.md" and b.language == "bash"][0]
    assert [line.split("#")[0].strip() for line in setup.code.splitlines()] == ["make demo", "make test"]
