"""examples/notebook.ipynb executes top to bottom in a fresh kernel (so the tour cannot rot)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="pip install fshard[test] (nbformat, nbclient, ipykernel)")
nbclient = pytest.importorskip("nbclient", reason="pip install fshard[test] (nbformat, nbclient, ipykernel)")
pytest.importorskip("ipykernel", reason="pip install fshard[test] (nbformat, nbclient, ipykernel)")
from _harness.optional import requires  # noqa: E402
from traitlets.config import Config  # noqa: E402  (nbclient's dependency)

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "examples" / "notebook.ipynb"
pytestmark = requires("transformers")  # the notebook's GPT-2 section


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

    # Printed text, and the plain-text form of displays (rich's tables, a cell's last value).
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    text = "\n".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in outputs)
    assert "fs.simulate(4; active)" in text                                   # one simulation for the session
    assert "P('dp', 'tp') on Mesh(dp=2," in text and "[0:4, 4:8] rank 1" in text  # visualize_sharding, simulated
    assert "is not divisible by 4" in text                                    # a spec error names the fix
    # fs.inspect outside and inside a body: every rank's row with its coordinate, type and spec.
    assert "fs.inspect(params[\"w1\"]): outside a body, on Mesh(dp=2, tp=2; cpu); 4 simulated ranks" in text
    assert "fs.inspect(inside the body): inside a shard_map body on Mesh(dp=2, tp=2; cpu), checked" in text
    assert "3     dp=1,tp=1  (8, 8)  float64  {tp}  P('tp')  (16, 8)  min " in text
    assert "step 10: loss 0.102992" in text                                   # state kept across cells, new lr
    assert "max grad error" in text and "('psum', ('tp',)): 1" in text       # shard_map + gradients
    assert "restored step 10 on Mesh(dp=4, tp=1; cpu)" in text and "step 13: loss" in text  # resharded, trained on
    assert "fsdp: loss 4.167681" in text and "replicate: loss 4.167681" in text  # comm counts side by side
    assert "GPT-2 on fsdp=4: loss 4.158299 (one process: 4.158299)" in text   # fsdp_apply on an HF module
    assert "calls {'all_gather': 5, 'psum': 1, 'psum_scatter': 3}" in text   # the counts real ranks log
    assert "makespan 33 (ideal 24)" in text                                   # 1F1B simulated
    assert "zbv on pp=4: loss 1.138062418688 (one device 1.138062418688)" in text  # a pipeline, simulated
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1                                                   # the schedule plot
    # After sim.__exit__(): the first step on 4 real ranks equals the simulated one (the cell asserts it).
    assert "first step on 4 real ranks: loss 0.6766469748114765, simulated 0.6766469748114765: equal" in text
    assert "pp rank 1 holds stages [1, 2]" in text                            # a real pipelined step
