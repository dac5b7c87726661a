"""The tutorial notebooks: committed without outputs, and they execute top to bottom with their plots."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NAMES = ["01_quickstart.ipynb", "02_compare_variants.ipynb", "03_reasoning_study.ipynb"]


def test_notebooks_exist_and_have_no_outputs():
    found = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
    assert set(NAMES) <= set(found), found
    for name in found:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [], f"{name}: a code cell has outputs; strip them (python notebooks/_build.py)"
                assert cell.execution_count is None, f"{name}: a code cell has an execution count; strip it"


def test_notebooks_match_their_generator():
    """The committed notebooks are what notebooks/_build.py writes (edit the generator, not the .ipynb)."""
    sys.path.insert(0, str(NOTEBOOKS))
    try:
        import _build
    finally:
        sys.path.pop(0)
    for name, cells in (("01_quickstart.ipynb", _build.QUICKSTART), ("02_compare_variants.ipynb", _build.COMPARE),
                        ("03_reasoning_study.ipynb", _build.REASONING)):
        committed = nbformat.read(NOTEBOOKS / name, as_version=4)
        assert [c.source for c in committed.cells] == [c.source for c in cells], f"{name} differs from _build.py"


# The suite checks that each notebook runs top to bottom and renders its plots, not what a full run learns:
# it overrides the run's size right after the notebook's cell tagged "parameters" (papermill's convention),
# as `papermill -p MAX_STEPS 3 ...` would. The notebooks' text discusses the full run (the values in their
# parameters cell). Notebook 03 trains nothing: it runs as written.
SMALL_RUN = {
    "01_quickstart.ipynb": {"MAX_STEPS": 3, "EVAL_EVERY": 3, "EVAL_SIZE": 40},
    "02_compare_variants.ipynb": {"BUDGET_TOKENS": 1_500, "EVAL_EVERY": 2, "EVAL_SIZE": 40},
}


def _with_parameters(nb, values: dict):
    """Insert a cell assigning ``values`` right after the cell tagged ``parameters``; return the notebook."""
    import ast

    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, "the notebook needs exactly one cell tagged 'parameters'"
    declared = {t.id for node in ast.parse(nb.cells[tagged[0]].source).body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    assert set(values) <= declared, f"not in the parameters cell: {set(values) - declared}"
    source = "\n".join(f"{k} = {v!r}" for k, v in values.items())
    nb.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell(source))
    return nb


def test_training_notebooks_declare_their_size_in_a_parameters_cell():
    for name, values in SMALL_RUN.items():
        _with_parameters(nbformat.read(NOTEBOOKS / name, as_version=4), values)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # a few minutes on a quiet CPU; much longer on a shared one
@pytest.mark.parametrize("name", NAMES)
def test_notebook_executes_and_renders_plots(name, tmp_path):
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    if name in SMALL_RUN:
        nb = _with_parameters(nb, SMALL_RUN[name])
    # The kernel is this interpreter (jupyter_client maps the kernelspec's "python" to sys.executable).
    client = NotebookClient(nb, timeout=1800, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    env_before = os.environ.get("MPLBACKEND")
    os.environ.pop("MPLBACKEND", None)  # let the kernel use the inline backend
    start = time.perf_counter()
    try:
        client.execute()
    finally:
        if env_before is not None:
            os.environ["MPLBACKEND"] = env_before
    seconds = time.perf_counter() - start
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.get("output_type") == "error"]
    assert not errors, errors
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.get("output_type") in ("display_data", "execute_result") and "image/png" in o.get("data", {})]
    assert len(images) >= (1 if name.startswith("01") else 2), f"{name}: no rendered plots"
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    if name.startswith("01"):
        assert "held-out greedy accuracy:" in text
    elif name.startswith("03"):
        assert "budget per arm:" in text and "7+5+9=7+5=12,12+9=21>21" in text
    else:
        assert "[lab]" in text and "mu_grpo" in text
    print(f"{name}: executed in {seconds:.0f} s")
