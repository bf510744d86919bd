"""Records JAX's dtype rules for the reducing collectives (run: ``python tests/faults/faults_jax_dtype_table.py``).

Runs ``jax.lax.psum`` / ``pmean`` / ``pmax`` / ``pmin`` / ``psum_scatter`` (tiled) and
``all_gather`` inside ``jax.shard_map`` on 2 CPU devices, with 64-bit types enabled (torch
has them natively), for every dtype below, and prints a JSON table: op -> dtype -> the
result's dtype and values, or the exception type JAX raised. ``tests/faults/
jax_dtype_table.json`` is its output; ``test_faults_dtypes.py`` holds fshard to it and
re-runs this script to check the record is still what JAX does.

The input on 2 ranks: rank 0 holds ``[1, 1, 0, 1]``, rank 1 ``[1, 0, 0, 1]`` (cast to
the dtype), so sums count the Trues and means are 1.0, 0.5, 0.0, 1.0.
"""

import json
import os
import sys

DTYPES = ("bool", "int8", "uint8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64")
OPS = ("psum", "pmean", "pmax", "pmin", "psum_scatter", "all_gather")
RANKS = ([1, 1, 0, 1], [1, 0, 0, 1])


def main() -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((2,), ("x",))
    bodies = {
        "psum": lambda a: jax.lax.psum(a, "x"),
        "pmean": lambda a: jax.lax.pmean(a, "x"),
        "pmax": lambda a: jax.lax.pmax(a, "x"),
        "pmin": lambda a: jax.lax.pmin(a, "x"),
        "psum_scatter": lambda a: jax.lax.psum_scatter(a, "x", tiled=True),
        "all_gather": lambda a: jax.lax.all_gather(a, "x", tiled=True),
    }
    table = {"jax": jax.__version__, "x64": True, "ranks": RANKS, "ops": {}}
    for op in OPS:
        row = table["ops"][op] = {}
        for name in DTYPES:
            x = jnp.asarray(np.array(RANKS[0] + RANKS[1])).astype(getattr(jnp, name if name != "bool" else "bool_"))
            x = jax.device_put(x, NamedSharding(mesh, P("x")))
            # Every rank's result, stacked: the untiled out_spec P("x") keeps both ranks'.
            f = jax.jit(jax.shard_map(bodies[op], mesh=mesh, in_specs=P("x"), out_specs=P("x")))
            try:
                y = f(x)
                row[name] = {"dtype": str(y.dtype), "values": np.asarray(y).astype(float).tolist()}
            except Exception as e:  # noqa: BLE001 - what JAX raises is the record
                row[name] = {"error": type(e).__name__, "message": str(e).splitlines()[0][:200]}
    json.dump(table, sys.stdout, indent=1, sort_keys=True)
    print()


if __name__ == "__main__":
    main()
