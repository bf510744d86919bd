"""Runs conformance programs in JAX: ``python conf_jax_worker.py NAMES.json OUT.pkl``.

A process of its own (started by ``conf_oracle``), so that XLA's flags, threads and
devices never touch the pytest process or the gloo ranks: 4 forced host CPU devices,
float64, one thread. The programs of one ``group`` are compiled in one ``jax.jit`` (one
XLA compilation instead of one per program: the dominant cost); a group that fails to
trace falls back to one program at a time, so that each failure is recorded on its own.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time


def _configure_env() -> None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
                               " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["JAX_ENABLE_X64"] = "1"


def run(names: list[str]) -> dict[str, dict]:
    import jax
    import numpy as np

    jax.config.update("jax_enable_x64", True)
    from conf_compare import error, ok, tree_map
    from conf_ops_jax import JaxOps, make_mesh
    from conf_programs import programs

    progs = programs()
    meshes = {}

    def ops_of(p):
        if p.mesh not in meshes:
            meshes[p.mesh] = make_mesh(p.mesh_axes)
        return JaxOps(meshes[p.mesh], p.check)

    def to_np(tree):
        return tree_map(lambda x: None if x is None else np.asarray(x), tree)

    groups: dict[str, list[str]] = {}
    for n in names:
        p = progs[n]
        groups.setdefault(p.group or f"solo:{n}", []).append(n)

    results: dict[str, dict] = {}
    for members in groups.values():
        t0 = time.perf_counter()
        if len(members) > 1:
            inputs = {n: progs[n].make_inputs() for n in members}
            try:
                out = jax.jit(lambda ins: {n: progs[n].fn(ops_of(progs[n]), *ins[n]) for n in members})(inputs)
                dt = (time.perf_counter() - t0) / len(members)
                for n in members:
                    results[n] = ok(to_np(out[n])) | {"seconds": dt}
                continue
            except Exception:
                pass  # one by one below: each program's own error is recorded
        for n in members:
            t0 = time.perf_counter()
            p = progs[n]
            try:
                rec = ok(to_np(jax.jit(lambda *a, p=p: p.fn(ops_of(p), *a))(*p.make_inputs())))
            except Exception as e:
                rec = error(e)
            results[n] = rec | {"seconds": time.perf_counter() - t0}
    return results


def main(argv: list[str]) -> int:
    names_path, out_path = argv[1], argv[2]
    with open(names_path) as f:
        names = json.load(f)
    _configure_env()
    results = run(names)
    tmp = out_path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(results, f)
    os.replace(tmp, out_path)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main(sys.argv))
