"""Runs fuzz programs in JAX, in a process of its own: ``python jax_worker.py`` (a server).

Protocol: each line on stdin is the path of a JSON list of programs; the worker writes
``{id: record}`` (pickle) to that path + ``.pkl`` and answers one line, ``done``, on
stdout (everything else it prints goes to stderr). One process serves a whole run,
shrinking included, so JAX is imported once. Like ``conf_jax_worker.py``: 4 forced host
CPU devices, x64, one thread; XLA's flags never reach the pytest process or the ranks.

The programs of one mesh are traced into one ``jax.jit`` per chunk (one XLA compilation
for many programs: the dominant cost). A program that JAX refuses while tracing is caught
inside the trace, so it costs the others nothing; a chunk that fails later (lowering) is
rerun one program at a time. A checked program refused for a replication promise its types
do not prove also gets its unchecked twin's result (``twin``): docs/jax.md's first row says
that is what fshard computes.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time

CHUNK = 24  # programs per jit


def configure_env() -> None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
                               " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
                               # Compile time dominates (tiny programs): halves it.
                               " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["JAX_ENABLE_X64"] = "1"


class Runner:
    def __init__(self) -> None:
        import jax

        jax.config.update("jax_enable_x64", True)
        import conf_ops_jax  # noqa: F401  (registers ragged_all_to_all's CPU lowering)

        self.jax = jax
        self.meshes: dict = {}

    def mesh(self, prog: dict):
        import numpy as np
        from jax.sharding import AxisType, Mesh

        key = tuple(map(tuple, prog["mesh"]))
        if key not in self.meshes:
            devices = np.array(self.jax.devices()[:4]).reshape(tuple(s for _, s in key))
            self.meshes[key] = Mesh(devices, tuple(a for a, _ in key), axis_types=(AxisType.Auto,) * len(key))
        return self.meshes[key]

    def run_many(self, progs: list[dict]) -> dict:
        """``{id: record}`` for every program (records as in conf_compare)."""
        from fuzz.labels import is_promise_refusal, promise_unproven

        out: dict = {}
        by_mesh: dict = {}
        for p in progs:
            by_mesh.setdefault(tuple(map(tuple, p["mesh"])), []).append(p)
        for group in by_mesh.values():
            for i in range(0, len(group), CHUNK):
                out.update(self._chunk(group[i:i + CHUNK]))
        for p in progs:
            rec = out[p["id"]]
            if rec["status"] == "error" and p["check"] and (is_promise_refusal(rec["error"]) or promise_unproven(p)):
                rec["twin"] = self._chunk([dict(p, check=False)])[p["id"]]
        return out

    def _chunk(self, progs: list[dict]) -> dict:
        import numpy as np
        from conf_compare import error, ok, tree_map

        from fuzz.emit import compile_program, make_inputs

        t0 = time.perf_counter()
        runs, errors = {}, {}
        for p in progs:
            try:
                runs[p["id"]] = compile_program(p, "jax", self.mesh(p))
            except Exception as e:  # noqa: BLE001 - recorded as JAX's refusal
                errors[p["id"]] = error(e)
        inputs = {p["id"]: make_inputs(p) for p in progs if p["id"] in runs}

        def all_programs(ins):
            res = {}
            for s, fn in runs.items():
                try:
                    res[s] = fn(*ins[s])
                except Exception as e:  # noqa: BLE001 - a trace-time refusal; the rest still run
                    errors[s] = error(e)
            return res

        try:
            values = self.jax.jit(all_programs)(inputs)
        except Exception:  # noqa: BLE001 - lowering or compiling failed: one at a time names it
            if len(progs) == 1:
                return {progs[0]["id"]: error(sys.exc_info()[1])}
            out = {}
            for p in progs:
                out.update(self._chunk([p]))
            return out
        dt = (time.perf_counter() - t0) / max(1, len(progs))
        out = {s: errors[s] for s in errors}
        for s, v in values.items():
            if s not in errors:
                out[s] = ok(tree_map(lambda x: None if x is None else np.asarray(x), v)) | {"seconds": dt}
        return out


def serve() -> int:
    proto = sys.stdout
    sys.stdout = sys.stderr  # JAX's and numpy's chatter must not reach the protocol line
    configure_env()
    runner = Runner()
    for line in sys.stdin:
        path = line.strip()
        if not path:
            continue
        with open(path) as f:
            progs = json.load(f)
        results = runner.run_many(progs)
        tmp = path + ".pkl.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(results, f)
        os.replace(tmp, path + ".pkl")
        proto.write("done\n")
        proto.flush()
    return 0


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[0] = os.path.dirname(here)  # tests/conformance (conf_compare, this package), not fuzz/
    sys.exit(serve())
