"""No import cycles in the package, and every module imports on its own.

Two checks:

* a static one: the import graph of ``grpo_variants`` read from the source with ``ast`` — every
  ``import`` / ``from ... import`` statement, at module level *and* inside functions (a lazy import
  only hides a cycle until the function runs), plus ``importlib.import_module("grpo_variants...")``
  calls with a literal name — must be acyclic. A module's implicit import of its parent packages is
  not an edge (Python runs ``grpo_variants/__init__.py`` before any submodule; the package's
  ``__init__`` importing its submodules is how it assembles the built-ins).
* a dynamic one: each module is imported first, alone, in a process that has never imported the
  package (forked from one that has loaded only torch / transformers / TRL, so it costs milliseconds
  instead of a fresh interpreter's ten seconds), which is what a user's ``import grpo_variants.x``
  does. A cycle that Python cannot resolve fails there with "partially initialized module".
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "grpo_variants"


def package_modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> source file, for every module of ``package`` under ``root``."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _owner(name: str, modules: dict) -> str | None:
    """The package module that ``import name`` loads last (``a.b.func`` -> ``a.b``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path, package: str) -> dict[str, dict[str, int]]:
    """module -> {imported package module: line of the first such import}."""
    modules = package_modules(root, package)
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        here = module if is_package else module.rpartition(".")[0]
        targets: dict[str, int] = {}

        def add(name: str, line: int) -> None:
            target = _owner(name, modules)
            if target is None or target == module:
                return
            if module.startswith(target + "."):  # a parent package: imported implicitly anyway
                return
            targets.setdefault(target, line)

        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if not (source == package or source.startswith(package + ".")):
                    continue
                for alias in node.names:  # `from pkg import submodule` imports the submodule
                    full = f"{source}.{alias.name}"
                    add(full if full in modules else source, node.lineno)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, (ast.Attribute, ast.Name))
                and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
                and node.args[0].value.startswith(package)
            ):
                add(node.args[0].value, node.lineno)
        graph[module] = targets
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (as a closed path) per strongly connected component with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def connect(node: str) -> None:  # Tarjan's algorithm (the graph is small: recursion is fine)
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)

    cycles = []
    for component in components:  # a shortest closed path through the component's first module
        members, start = set(component), component[0]
        paths, seen = [[start]], {start}
        found = None
        while paths and found is None:
            extended = []
            for path in paths:
                for nxt in sorted(graph[path[-1]]):
                    if nxt == start:
                        found = path + [start]
                        break
                    if nxt in members and nxt not in seen:
                        seen.add(nxt)
                        extended.append(path + [nxt])
                if found:
                    break
            paths = extended
        cycles.append(found or component)
    return cycles


def _describe(cycle: list[str], graph) -> str:
    steps = [f"{a} (line {graph[a][b]}) -> {b}" for a, b in zip(cycle, cycle[1:])]
    return " ; ".join(steps)


def test_the_package_import_graph_has_no_cycle():
    graph = import_graph(ROOT, PACKAGE)
    assert f"{PACKAGE}.trainer" in graph and graph[f"{PACKAGE}.trainer"], "the graph found no imports at all"
    assert f"{PACKAGE}.losses" in graph[f"{PACKAGE}.trainer"]
    cycles = find_cycles(graph)
    assert not cycles, "import cycles (lazy imports inside functions count):\n" + "\n".join(
        _describe(c, graph) for c in cycles
    )


def test_the_cycle_check_finds_lazy_relative_and_importlib_cycles(tmp_path):
    pkg = tmp_path / "demo_pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from demo_pkg import a\n")  # a package importing its modules: no cycle
    (pkg / "a.py").write_text("import demo_pkg.b\n")
    (pkg / "b.py").write_text("def f():\n    from .sub import c\n")  # lazy and relative
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("import importlib\nimportlib.import_module('demo_pkg.a')\n")
    (pkg / "d.py").write_text("from demo_pkg import a\n")  # depends on the cycle, is not part of it
    graph = import_graph(tmp_path, "demo_pkg")
    assert graph["demo_pkg.b"] == {"demo_pkg.sub.c": 2}
    assert graph["demo_pkg.sub"] == {}
    cycles = find_cycles(graph)
    assert cycles == [["demo_pkg.a", "demo_pkg.b", "demo_pkg.sub.c", "demo_pkg.a"]]
    (pkg / "sub" / "c.py").write_text("import json\n")
    assert find_cycles(import_graph(tmp_path, "demo_pkg")) == []


_IMPORT_EACH = textwrap.dedent(
    """
    import importlib, json, os, sys, traceback
    def ours(m):
        return m == "grpo_variants" or m.startswith("grpo_variants.")

    # Preload every third-party module the package pulls in (listed by a throwaway child), so each
    # child below pays only for the package's own modules.
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        for name in sys.argv[1:]:
            try:
                importlib.import_module(name)
            except BaseException:
                pass
        os.write(write, " ".join(m for m in list(sys.modules) if not ours(m)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        third_party = pipe.read().decode().split()
    os.waitpid(pid, 0)
    for name in third_party:
        if name not in sys.modules and not name.startswith("__"):
            try:
                importlib.import_module(name)
            except BaseException:
                pass
    assert not any(ours(m) for m in sys.modules), "a third-party module imported the package"
    failures = {}
    for name in sys.argv[1:]:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: a process that has never imported the package
            os.close(read)
            try:
                importlib.import_module(name)
                message = b""
            except BaseException:
                message = traceback.format_exc().encode()
            os.write(write, message[-4000:])
            os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            message = pipe.read()
        os.waitpid(pid, 0)
        if message:
            failures[name] = message.decode(errors="replace")
    print(json.dumps(failures))
    """
)


def test_every_module_imports_alone_in_a_fresh_process():
    modules = sorted(package_modules(ROOT, PACKAGE))
    assert len(modules) > 20
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH, *modules],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    failures = json.loads(done.stdout.strip().splitlines()[-1])
    assert not failures, "modules that fail to import on their own:\n" + "\n".join(
        f"--- {name}\n{trace}" for name, trace in failures.items()
    )


def test_the_trainer_s_former_contents_are_still_importable_from_it():
    """validation.py, loader.py and metrics.py came out of trainer.py; the old import paths keep working."""
    from grpo_variants import metrics, trainer, validation
    from grpo_variants.rollout import loader

    assert trainer.check_model_path is validation.check_model_path
    assert trainer.check_dataset is validation.check_dataset
    assert trainer.resolve_reward_funcs is validation.resolve_reward_funcs
    assert trainer._RepeatedFetchCache is loader.RepeatedFetchCache and trainer._RowBatch is loader.RowBatch
    assert issubclass(trainer.GRPOVariantTrainer, metrics.TrainerMetrics)
    for name in ("_log_loss_metrics", "_global_mean", "_global_sequence_fraction", "_log_reward_health"):
        assert getattr(trainer.GRPOVariantTrainer, name) is getattr(metrics.TrainerMetrics, name)


_OLD_PATHS_FIRST = r"""
import importlib, json, sys
from grpo_variants._aliases import OLD_TO_NEW
wrong = {}
for old, new in OLD_TO_NEW.items():
    module = importlib.import_module(old)          # the old path first, before anything imported the new one
    if module is not importlib.import_module(new) or sys.modules[old] is not sys.modules[new]:
        wrong[old] = new
    parent, _, leaf = old.rpartition(".")
    exec(f"from {parent} import {leaf} as _via_from")
    if _via_from is not module:
        wrong[f"from {parent} import {leaf}"] = new
print(json.dumps(wrong))
"""


def test_old_flat_import_paths_are_the_moved_modules():
    """``grpo_variants.toy``, ``.sampling``, ``.models`` ... name the same module objects as the new paths
    (so patches, ``isinstance`` checks and pickles see one module), and every moved module has its alias."""
    from grpo_variants._aliases import OLD_TO_NEW

    modules = package_modules(ROOT, PACKAGE)
    moved = {name for name in modules
             if name.split(".")[1:2] in (["rollout"], ["tasks"], ["runtime"]) and name.count(".") == 2}
    assert set(OLD_TO_NEW.values()) <= moved  # every alias names a module that exists (modules added to these
    # folders after the move, e.g. rollout/packing.py, never had a flat path and need no alias)
    assert len(set(OLD_TO_NEW.values())) == len(OLD_TO_NEW) == 14  # the 14 modules the layout change moved
    assert not set(OLD_TO_NEW) & set(modules), "an alias shadows a module that exists"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _OLD_PATHS_FIRST], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {}

    import grpo_variants
    import grpo_variants.sampling
    import grpo_variants.toy
    from grpo_variants.rollout import sampling
    from grpo_variants.tasks import toy

    assert grpo_variants.toy is toy and grpo_variants.sampling is sampling
    assert sampling.DynamicSamplingMixin.__module__ == "grpo_variants.rollout.sampling"


def test_no_one_borrows_private_helpers_of_the_cli_or_the_trainer():
    """Input resolution (model, datasets, resume) lives in ``grpo_variants.inputs`` and the model card in
    ``grpo_variants.card``: the recipes and the package's other modules import those, never a private
    ``_name`` of ``cli`` or the card helpers from ``trainer`` (issue #38, "two rooms of the house")."""
    import re

    borrowed = re.compile(r"from grpo_variants\.cli import[^\n]*\b_\w+|grpo_variants\.cli\._\w+|cli\._(resume_value|"
                          r"load_dataset)|from grpo_variants\.trainer import[^\n]*\b(model_card_\w+|describe_\w+|"
                          r"non_default_hyperparameters|deepspeed_settings|lora_settings)")
    files = [*sorted((ROOT / "recipes").glob("*.py")), *sorted((ROOT / PACKAGE).rglob("*.py"))]
    offenders = [f"{path.relative_to(ROOT)}: {m.group(0)}" for path in files
                 if path.name != "cli.py" for m in [borrowed.search(path.read_text())] if m]
    assert offenders == []
    import grpo_variants.card
    import grpo_variants.inputs
    import grpo_variants.trainer

    assert grpo_variants.trainer.model_card_section is grpo_variants.card.model_card_section  # old name kept
    assert "def model_card_section" not in (ROOT / PACKAGE / "trainer.py").read_text()
