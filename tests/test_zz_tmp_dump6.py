from test_jit_overlap import _inductor_body, _code_structure
from fshard.testing import run_on_ranks


def _body():
    import logging
    import torch._inductor.config as c
    logging.getLogger("fshard").setLevel(logging.INFO)
    logging.basicConfig(level=logging.INFO)
    old = c.reorder_for_peak_memory
    c.reorder_for_peak_memory = False
    try:
        return _inductor_body()
    finally:
        c.reorder_for_peak_memory = old


def test_dump():
    res = run_on_ranks(_body, world_size=2, timeout_s=600)
    for i, (err, code) in enumerate(res):
        open(f"/tmp/s27p2p/codeB{i}.py", "w").write(code)
        print(i, err, _code_structure(code))
