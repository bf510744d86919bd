"""Runs multi-rank test bodies many times in one worker pool and counts failed runs.

For hunting rare rank crashes (a rank dying with ``malloc(): unaligned tcache chunk
detected`` and its peer failing with gloo "Connection reset by peer"): the same bodies
as the tests, without pytest and without the CI's one rerun, so every failure shows.

    PYTHONPATH=. nice -n 19 python tools/stress_ranks.py --n 200 --case fsdp_remat_tie

Cases (``--case``, repeatable; default all): ``fsdp_remat_tie``, ``fsdp_remat``,
``fsdp_tie`` (tests/parallel/test_parallel_fsdp.py, 2 ranks), ``dp_pp``
(tests/sched/test_sched_runtime.py, 4 ranks), ``tp_transformer``
(tests/parallel/test_parallel_tp.py, 4 ranks).

The ranks inherit the environment, so glibc's checks can be switched on from outside
(``MALLOC_PERTURB_=165`` fills freed memory). ``--executable`` runs the ranks under
another interpreter command, e.g. a script that ends in
``exec valgrind --tool=memcheck --undef-value-errors=no --log-file=/tmp/vg.%p.log python "$@"``
(then also set FSHARD_TEST_TIMEOUT_S=3000 and PYTHONMALLOC=malloc).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

from fshard.testing import run_on_ranks, shutdown_pools


def _cases() -> dict:
    from tests.parallel import test_parallel_fsdp as t_fsdp
    from tests.parallel import test_parallel_tp as t_tp
    from tests.sched import test_sched_runtime as t_rt

    dp_pp = [("gpipe", {}, "plain"), ("one_f_one_b", {}, "dtensor"), ("zbv", {}, "dtensor"),
             ("one_f_one_b", {}, "fsdp"), ("zero_bubble", {"n_virtual": 2}, "fsdp"),
             ("one_f_one_b", {}, "scan")]
    return {  # name: (body, args, kwargs, world size)
        "fsdp_remat_tie": (t_fsdp._train, ({"fsdp": 2}, "fsdp", True, True, True, 2, True), {}, 2),
        "fsdp_remat": (t_fsdp._train, ({"fsdp": 2}, "fsdp", True, True, False, 2, True), {}, 2),
        "fsdp_tie": (t_fsdp._train, ({"fsdp": 2}, "fsdp", True, False, True, 2, True), {}, 2),
        "dp_pp": (t_rt._dp_pp_body, (dp_pp,), {}, 4),
        "tp_transformer": (t_tp._train, ("transformer", "fsdp_tp", True, 10), {}, 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100, help="iterations (each runs every case once)")
    ap.add_argument("--case", action="append", help="a case name (repeatable; default: all)")
    ap.add_argument("--executable", help="run the ranks under this interpreter command")
    ap.add_argument("--timeout", type=float, default=None, help="per-run limit, seconds")
    a = ap.parse_args()
    if a.executable:
        import multiprocessing

        multiprocessing.set_executable(a.executable)
    cases = _cases()
    names = a.case or list(cases)
    fails, runs, t0 = 0, 0, time.time()
    for it in range(a.n):
        for name in names:
            fn, args, kwargs, world = cases[name]
            runs += 1
            try:
                run_on_ranks(fn, *args, world_size=world, timeout_s=a.timeout, **kwargs)
            except Exception as e:  # noqa: BLE001 - count and show every kind of failure
                fails += 1
                msg = "".join(traceback.format_exception_only(type(e), e))
                print(f"[{it}] {name} FAILED: {msg[:4000]}", flush=True)
        if it % 10 == 9:
            print(f"{it + 1} iterations, {runs} runs, {fails} failed, {time.time() - t0:.0f}s", flush=True)
    print(f"DONE {runs} runs ({a.n} x {names}), {fails} failed, {time.time() - t0:.0f}s", flush=True)
    shutdown_pools()
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
