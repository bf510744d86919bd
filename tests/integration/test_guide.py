"""docs/guide.md runs (issue 35): its ``python`` blocks, in order, are one program, run here on 2 ranks.

The program is the document itself with every line outside a ``python`` block left blank, so a
traceback's line numbers are the document's. It runs on the shared 2-rank pool (the guide's
``main``; its ``__main__`` part, ``fs.run_local`` or torchrun, is the reader's way to start the
same function). The guide asserts its own claims (the loss falls, the run resumed on another
mesh gives the same losses, the ``nn.Module`` gives the loop's validation loss); this test checks
them again on the values ``main`` returns, and that the output the guide shows is what it prints.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fshard.testing import run_on_ranks

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide.md"


def guide_program(text: str) -> str:
    """The ``python`` blocks of ``text`` as one program, every other line blank."""
    out, inside = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            inside = not inside and line.strip() == "```python"
            out.append("")
        else:
            out.append(line if inside else "")
    return "\n".join(out) + "\n"


def _run_guide(ckpt_dir: str) -> dict:
    namespace = {"__name__": "guide", "__file__": str(GUIDE)}  # not "__main__": the reader's launch is skipped
    exec(compile(guide_program(GUIDE.read_text()), str(GUIDE), "exec"), namespace)
    return namespace["main"](ckpt_dir)


def test_guide_program_keeps_line_numbers_and_only_python():
    text = "intro\n```python\na = 1\n```\n\n```bash\nls\n```\n```python\nb = a\n```\n"
    program = guide_program(text).splitlines()
    assert program[2] == "a = 1" and program[9] == "b = a"
    assert len(program) == len(text.splitlines()) and "ls" not in program
    assert "def main(" in guide_program(GUIDE.read_text())


@pytest.mark.timeout(300)
def test_guide_trains_and_resumes_on_another_mesh(tmp_path):
    result = run_on_ranks(_run_guide, str(tmp_path / "checkpoints"), world_size=2, timeout_s=240)[0]
    fsdp, ddp = result["fsdp"], result["ddp"]
    assert sorted(fsdp) == list(range(1, 13)) and sorted(ddp) == list(range(7, 13))
    assert fsdp[12] < fsdp[1] / 2, fsdp  # the loss falls
    assert result["fsdp_val"][12] < result["fsdp_val"][3], result["fsdp_val"]
    for s in ddp:  # FSDP's checkpoint of step 6, resumed on DDP: the same steps 7-12
        assert ddp[s] == pytest.approx(fsdp[s], rel=1e-5, abs=1e-6), (s, fsdp, ddp)
    assert result["ddp_val"] == pytest.approx({s: result["fsdp_val"][s] for s in (9, 12)}, rel=1e-5)
    assert result["module_val"] == pytest.approx(result["fsdp_val"][12], rel=1e-5)

    # The output the guide shows is the one it prints (to its 4 decimals).
    shown = re.search(r"It prints.*?```text\n(.*?)```", GUIDE.read_text(), flags=re.S).group(1)
    rows = re.findall(r"\[(\S+)\] step (\d+): loss ([\d.]+), val ([\d.]+)", shown)
    assert len(rows) == 6, shown
    for mesh, step, loss, val in rows:
        losses, vals = (fsdp, result["fsdp_val"]) if mesh == "fsdp=2" else (ddp, result["ddp_val"])
        assert (float(loss), float(val)) == pytest.approx((losses[int(step)], vals[int(step)]), abs=2e-4), (
            f"docs/guide.md shows [{mesh}] step {step}: loss {loss}, val {val}; the run gave "
            f"{losses[int(step)]:.4f}, {vals[int(step)]:.4f}"
        )
