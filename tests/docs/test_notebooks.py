"""The notebooks of docs/notebooks/ run headlessly from top to bottom, and are stored without outputs.

Each notebook runs in a fresh kernel of this interpreter (the project's virtualenv: a kernelspec pointing at
``sys.executable`` is registered for the test in a temporary ``JUPYTER_PATH``), from docs/notebooks/ as a
reader would open it, with its run folders under a temporary ``COMPOSER_NOTEBOOK_RUNS``. Any error in any
cell fails the test with that cell's traceback.

Strip the outputs before committing a notebook::

    python tests/docs/test_notebooks.py --strip docs/notebooks/*.ipynb
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = REPO / "docs" / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
KERNEL = "composer-replication-test"


def unstripped(path: Path) -> list[str]:
    """What keeps ``path`` from being stored stripped: code cells with outputs or an execution count."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    problems = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        if cell.get("outputs"):
            problems.append(f"{path.name} cell {i}: {len(cell['outputs'])} output(s)")
        if cell.get("execution_count") is not None:
            problems.append(f"{path.name} cell {i}: execution_count {cell['execution_count']}")
    return problems


def strip(path: Path) -> None:
    """Remove every output and execution count of ``path``, in place (the notebook's JSON layout is kept)."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nbformat.write(nb, path)


def test_the_notebooks_are_there():
    assert {p.name for p in NOTEBOOKS} >= {"01_meshes.ipynb", "02_training.ipynb", "03_diloco.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_stored_without_outputs(path):
    problems = unstripped(path)
    assert not problems, (
        "notebooks are stored without outputs; run `python tests/docs/test_notebooks.py --strip "
        f"{path.relative_to(REPO)}`:\n" + "\n".join(problems)
    )


def test_strip_removes_outputs(tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("print(1)")
    cell.outputs = [nbformat.v4.new_output("stream", text="1\n")]
    cell.execution_count = 3
    nb.cells = [nbformat.v4.new_markdown_cell("# t"), cell]
    path = tmp_path / "n.ipynb"
    nbformat.write(nb, path)
    assert len(unstripped(path)) == 2
    strip(path)
    assert unstripped(path) == [] and nbformat.read(path, as_version=4).cells[1].source == "print(1)"


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    """A kernelspec for this interpreter, found through a temporary JUPYTER_PATH; run folders under tmp_path."""
    spec = tmp_path / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": KERNEL, "language": "python"})
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("COMPOSER_NOTEBOOK_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    return KERNEL


@pytest.mark.slow
@pytest.mark.monarch
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, kernel):
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=600, kernel_name=kernel, resources={"metadata": {"path": str(NOTEBOOK_DIR)}}
    )
    try:
        client.execute()
    except CellExecutionError as exc:
        pytest.fail(f"{path.name} failed:\n{exc}", pytrace=False)
    ran = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in ran), "every code cell ran"


if __name__ == "__main__":
    if sys.argv[1:2] != ["--strip"] or len(sys.argv) < 3:
        sys.exit("usage: python tests/docs/test_notebooks.py --strip NOTEBOOK.ipynb ...")
    for name in sys.argv[2:]:
        strip(Path(name))
        print(f"stripped {name}")
