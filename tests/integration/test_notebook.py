"""examples/notebook.ipynb executes top to bottom in a fresh kernel (so the tour cannot rot)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="pip install fshard[test] (nbformat, nbclient, ipykernel)")
nbclient = pytest.importorskip("nbclient", reason="pip install fshard[test] (nbformat, nbclient, ipykernel)")
pytest.importorskip("ipykernel", reason="pip install fshard[test] (nbformat, nbclient, ipykernel)")
from traitlets.config import Config  # noqa: E402  (nbclient's dependency)

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "examples" / "notebook.ipynb"


@pytest.mark.timeout(300)
def test_notebook_executes(tmp_path, monkeypatch):
    # The kernel starts in tmp_path: make fshard importable there even when it is not installed.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel talks over Unix sockets, not TCP: jupyter_client picks TCP ports by binding
    # port 0 and closing it before the kernel binds them, a race with the gloo groups of the
    # tests that run beside this one (pytest-xdist) for the same ephemeral ports.
    config = Config()
    config.KernelManager.transport = "ipc"
    config.KernelManager.ip = str(tmp_path / "kernel")
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", config=config,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError naming the cell if any cell fails

    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "shape (8, 8), P('dp', 'tp') on Mesh(dp=2, tp=2; cpu)" in text     # visualize_sharding
    assert "is not divisible by 4" in text                                    # a spec error names the fix
    assert "max grad error" in text and "('psum', ('tp',)): 1" in text       # shard_map + gradients
    assert "fsdp: loss" in text and "replicate: loss" in text                 # comm counts side by side
    assert "makespan 33 (ideal 24)" in text                                   # 1F1B simulated
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1                                                   # the schedule plot
    assert "pp rank 1 holds stages [1, 2]" in text                            # a real pipelined step
    assert "GPT-2 on fsdp=2: loss 4.158299 (one process: 4.158299)" in text   # fsdp_apply on an HF module
    assert "calls {'all_gather': 5, 'psum': 1, 'psum_scatter': 3}" in text
