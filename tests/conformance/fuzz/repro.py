"""A program as two short standalone scripts (JAX and fshard), for a mismatch's report.

The body of each script is exactly the source the fuzzer ran (``emit.program_source``);
around it: the mesh, the inputs (each from its own numpy seed) and a print.
"""

from __future__ import annotations

import textwrap

from .emit import PREAMBLE, program_source


def _inputs(prog: dict, wrap: str = "{}") -> list[str]:
    return [f"{name} = " + wrap.format(f"np.random.default_rng([{prog['seed']}, {int(name[1:])}])"
                                       f".standard_normal({tuple(shape)!r})")
            for name, shape, _ in prog["inputs"]]


def _call(prog: dict) -> str:
    return "run(" + ", ".join(n for n, _, _ in prog["inputs"]) + ")"


def jax_script(prog: dict) -> str:
    axes = [a for a, _ in prog["mesh"]]
    shape = tuple(s for _, s in prog["mesh"])
    mesh = (f"mesh = Mesh(np.array(jax.devices()[:4]).reshape({shape!r}), {tuple(axes)!r}, "
            f"axis_types=(AxisType.Auto,) * {len(axes)})")
    main = "\n".join([mesh, *_inputs(prog),
                      program_source(prog, "jax").rstrip(),
                      f"print(jax.tree.map(np.asarray, jax.jit(run)({_call(prog)[4:-1]})))"])
    return "\n".join([
        "import os",
        'os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"',
        'os.environ["JAX_ENABLE_X64"] = "1"',
        "import numpy as np",
        "from jax.sharding import AxisType, Mesh",
        PREAMBLE["jax"].rstrip(),
        "", "", "def main():", textwrap.indent(main, "    "), "", "", "main()", ""])


def fshard_script(prog: dict) -> str:
    axes = {a: s for a, s in prog["mesh"]}
    main = "\n".join([f"mesh = fs.make_mesh({axes!r})", *_inputs(prog, "torch.from_numpy({})"),
                      program_source(prog, "fshard").rstrip(),
                      f"print(f'rank {{torch.distributed.get_rank()}}:', {_call(prog)})"])
    return "\n".join([
        "import numpy as np", PREAMBLE["fshard"].rstrip(), "", "",
        "def main():", textwrap.indent(main, "    "), "", "",
        'if __name__ == "__main__":', "    fs.run_local(main, world_size=4)", ""])
