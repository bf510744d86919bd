"""Deliberate faults, one at a time, in a copy of the repository: each must make a test fail.

    python tools/mutations.py                    # every mutation, 2 at a time, 600 s in all
    python tools/mutations.py --only remat_ignored reshard_ignored --jobs 1
    python tools/mutations.py --list             # the table, no run
    python tools/mutations.py --check            # every snippet found exactly once; no run

For each entry of :data:`MUTATIONS` the repository (the working tree, as it is) is
copied to a temporary directory, the entry's ``old`` snippet is replaced by ``new`` in
its ``file`` there, and ``pytest -x`` runs the entry's tests in the copy (``PYTHONPATH``
at the copy, so the ranks import the mutated package). A test that fails *catches* the
mutation; a mutation whose tests all pass *survives*: that is a missing test, and the
tool exits 1. A snippet that is not found exactly once is an error naming the mutation
(exit 2): the code moved, refresh the entry. Mutations not started within
``--budget-s`` are reported as not run (exit 3). A failure that is only a rank pool
timing out at start-up (an overloaded machine) proves nothing: it is retried once, then
reported as an error.

The table is data: keep each ``old`` snippet short and unique, and list the cheapest
tests that should catch the fault first (``-x`` stops at the first failure).
``tests/integration/test_mutations_table.py`` checks that every snippet still exists exactly once.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parent.parent
_IGNORE = shutil.ignore_patterns(".git", ".venv", "venv", "__pycache__", ".pytest_cache", "*.egg-info",
                                 "build", "dist", ".mypy_cache", ".ruff_cache")

B = "tests/parallel/test_parallel_behaviour.py"
FSDP = "tests/parallel/test_parallel_fsdp.py"
SCEN = "tests/parallel/test_parallel_scenarios.py"
RUNTIME = "tests/sched/test_sched_runtime.py"


@attrs.frozen
class Mutation:
    """One deliberate fault.

    Attributes:
      name: short identifier (``--only``).
      file: path relative to the repository root.
      old: a snippet that occurs exactly once in ``file``.
      new: its replacement (the fault).
      tests: pytest node ids or files, relative to the root, cheapest catcher first.
      why: what the fault breaks, in words.
    """

    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    why: str


MUTATIONS: tuple[Mutation, ...] = (
    # --- the layer loop (fshard/parallel/scan.py, groups.py, layout.py) ----------------------
    Mutation(
        "prefetch_forced_to_0", "fshard/parallel/scan.py",
        "min(n_layers, i + 1 + prefetch)", "min(n_layers, i + 1 + 0)",
        (f"{B}::test_forward_prefetch_issues_gathers_ahead_of_compute",),
        "the prefetch argument is ignored: each layer's gather starts only when the layer does"),
    Mutation(
        "forward_prefetch_list_ignored", "fshard/parallel/scan.py",
        "fwd = forward_prefetch or [", "fwd = [",
        (f"{B}::test_forward_prefetch_issues_gathers_ahead_of_compute",),
        "explicit forward_prefetch lists are ignored"),
    Mutation(
        "backward_prefetch_dropped", "fshard/parallel/scan.py",
        "bwd = backward_prefetch or [[i - 1] if i > 0 else [] for i in range(n_layers)]",
        "bwd = [[] for i in range(n_layers)]",
        (f"{B}::test_backward_prefetch_issues_regathers_ahead_of_backward",),
        "no regather starts ahead of its layer's backward (default and explicit lists)"),
    Mutation(
        "remat_ignored", "fshard/parallel/scan.py",
        "        elif remat:\n            x = remat_fn(", "        elif False:\n            x = remat_fn(",
        (f"{B}::test_remat_recomputes_each_block_once_in_backward", f"{B}::test_remat_saves_fewer_activation_bytes"),
        "remat=True stores activations like remat=False"),
    Mutation(
        "reshard_ignored", "fshard/parallel/scan.py",
        "reshard = reshard and state.n > 1 and not remat", "reshard = False",
        (f"{B}::test_reshard_after_forward_frees_gathered_storage_and_regathers",
         f"{FSDP}::test_fsdp_transformer_loss_params_and_comm_counts"),
        "gathered parameters are kept for backward whatever reshard_after_forward says"),
    Mutation(
        "shard_dim_always_0", "fshard/parallel/scan.py",
        "dims.append(hits[0] if hits else 0)", "dims.append(0)",
        (f"{B}::test_fsdp_on_dim_1_and_uneven_dims",),
        "the layer loop assumes every leaf is sharded on dim 0"),
    Mutation(
        "partial_reshard_keeps_a_view", "fshard/parallel/groups.py",
        "return buf.view(self._pk, -1).select(0, self._pidx).clone()", "return buf.view(self._pk, -1).select(0, self._pidx)",
        (f"{B}::test_reshard_after_forward_frees_gathered_storage_and_regathers",),
        "reshard_after_forward=k keeps a view, so the whole gathered buffer stays alive"),
    Mutation(
        "reduce_scatter_doubled", "fshard/parallel/groups.py",
        "            flat = rs.wait()\n", "            flat = rs.wait() * 2\n",
        (f"{FSDP}::test_fsdp_transformer_loss_params_and_comm_counts",),
        "every FSDP gradient is twice what it should be"),
    Mutation(
        "hsdp_replicate_all_reduce_dropped", "fshard/parallel/groups.py",
        "            if self._rn > 1:  # HSDP", "            if False:  # HSDP",
        (f"{FSDP}::test_hsdp_2x2",),
        "HSDP gradients are not summed over the replicate axis"),
    Mutation(
        "split_leaf_summed_over_its_axis", "fshard/parallel/groups.py",
        "tuple(a for a in big if a not in _spec_axes(x))", "tuple(a for a in big)",
        ("tests/parallel/test_parallel_groups.py::test_leaf_split_over_a_replicate_axis_is_not_summed_over_it",
         "tests/recipes/test_recipes_step.py::test_the_moe_transformer_on_ep_layouts_gives_the_one_process_losses_and_params"),
        "a leaf split over a replicate axis (an expert on ep) has its blocks' gradients summed over it"),
    Mutation(
        "accumulation_sync_drops_accumulated", "fshard/parallel/groups.py",
        "                flat = flat + prev\n        # At most one", "                flat = flat\n        # At most one",
        (f"{SCEN}::test_scenario14_fsdp_accumulation_reduces_once",),
        "the sync=True microbatch reduces only its own gradient, not the accumulated ones"),
    Mutation(
        "uneven_rows_rounded_down", "fshard/parallel/flat.py",
        "if span else -(-shape[d] // n) if shape else 1", "if span else shape[d] // n if shape else 1",
        (f"{B}::test_fsdp_on_dim_1_and_uneven_dims", f"{SCEN}::test_scenario1_uneven_mlp_shards"),
        "uneven shards are not padded to ceil(N / n) rows in the flat buffer"),
    Mutation(
        "offload_copy_skipped", "fshard/parallel/groups.py",
        "flat = layout.to_compute(flat, self.device)  # queued", "pass  # queued",
        (f"{B}::test_offload_stages_each_gather_and_syncs_once_per_backward",),
        "offloaded shards are gathered without the copy to the mesh's device"),
    Mutation(
        "offload_sync_per_group", "fshard/parallel/groups.py",
        "flats = [None if f is None else layout.to_host(f) for f in flats]",
        "flats = [None if f is None else (layout.to_host(f), _wait_host_copies(self.device))[0] for f in flats]",
        (f"{B}::test_offload_stages_each_gather_and_syncs_once_per_backward",),
        "one host synchronization per group instead of one per backward"),
    # --- collectives (fshard/comm.py, fshard/lax.py, fshard/transforms/vma.py) ---------------
    Mutation(
        "collective_wait_skipped", "fshard/comm.py",
        "            self._tensor = _F.wait_tensor(self._tensor)\n", "            self._tensor = self._tensor\n",
        (f"{B}::test_rank_skew_in_the_collective_path_changes_no_bit_and_does_not_hang",),
        "an async collective's result is used without waiting for it"),
    Mutation(
        "psum_transpose_is_psum", "fshard/lax.py",
        "        return _apply(_Pvary, g, ctx.ax), None\n",
        "        return _psum_raw(g, ctx.ax), None\n",
        ("tests/transforms/test_shard_map.py::test_tensor_parallel_grads_checked_equal_unchecked_and_reference",),
        "psum's backward sums the cotangent again instead of passing it through"),
    Mutation(
        "pvary_insertion_skipped", "fshard/transforms/vma.py",
        "    return lax.pvary(x, axes) if axes else x\n", "    return x\n",
        ("tests/transforms/test_shard_map.py::test_data_parallel_grads_checked_implicit_equal_unchecked_explicit_and_reference",),
        "checked mode no longer sums an invariant value's gradient over the axes it meets"),
    Mutation(
        "inplace_lift_skipped", "fshard/transforms/vma.py",
        "            _lift_in_place(func, w, union, body)\n", "            pass\n",
        ("tests/transforms/test_transforms_vma.py::test_replicated_operands_get_summed_gradients",),
        "y += x on a replicated y keeps y's gradient per rank instead of summing it (JAX: y = y + x)"),
    Mutation(
        "lift_skipped_by_name", "fshard/transforms/vma.py",
        "        if not isinstance(x, torch.Tensor) or any(x is w for w in written):\n",
        "        if not isinstance(x, torch.Tensor) or (getattr(func, '__name__', '').endswith('_') and x is args[0]):\n",
        ("tests/transforms/test_transforms_vma.py::test_replicated_operands_get_summed_gradients",),
        "the old name rule: __getitem__/__rsub__ taken as in-place, so an embedding by indexing gets no pvary"),
    Mutation(
        "slice_bounds_untyped", "fshard/transforms/vma.py",
        "out.extend(b for b in (x.start, x.stop, x.step) if isinstance(b, torch.Tensor))", "pass",
        ("tests/transforms/test_transforms_vma.py::test_replicated_operands_get_summed_gradients",),
        "w[i:i + 1] with a varying i is typed invariant: its gradient is not summed"),
    Mutation(
        "written_tensors_not_retyped", "fshard/transforms/vma.py",
        "            _retype_written(x, m, union, body)\n", "            pass\n",
        ("tests/transforms/test_transforms_vma.py::test_values_that_leave_the_types_are_verified_at_run_time",),
        "memory written in place with varying values keeps its invariant type: ranks may disagree under P()"),
    Mutation(
        "escaped_values_trusted", "fshard/transforms/shard_map.py",
        "    escaped = frozenset().union(*body.escaped) if body.escaped else frozenset()\n",
        "    escaped = frozenset()\n",
        ("tests/transforms/test_transforms_vma.py::test_values_that_leave_the_types_are_verified_at_run_time",),
        "a varying value turned into a Python number (.item()) reaches a P() output unverified"),
    Mutation(
        "psum_jvp_is_identity", "fshard/lax.py",
        "        return _apply(_Psum, t, ctx.ax)  # linear", "        return t.view_as(t)  # linear",
        ("tests/transforms/test_grad_nested.py::test_sharded_hvp_matches_jax",),
        "forward mode (torch.func.jvp of a body) passes psum's tangent through unsummed"),
    Mutation(
        "create_graph_cut_at_dtensor_inputs", "fshard/transforms/shard_map.py",
        "    differentiable = g.requires_grad and torch.is_grad_enabled()", "    differentiable = False",
        ("tests/transforms/test_grad_nested.py::test_grad_grad_shard_map_of_dtensor_arguments_matches_jax",),
        "grad of grad(shard_map) over DTensor arguments is zero: the cotangent's DTensor leaves the graph"),
    Mutation(
        "nested_grad_detached", "fshard/transforms/grad.py",
        "        attach = (create_graph or _DEPTH.get() > 0) and torch.is_grad_enabled()",
        "        attach = create_graph and torch.is_grad_enabled()",
        ("tests/conformance/test_conformance_regress.py", "tests/transforms/test_grad_nested.py"),
        "an fs.grad inside another detaches its arguments: grad of grad is silently zero (the old behaviour)"),
    Mutation(
        "promise_decided_per_group", "fshard/transforms/shard_map.py",
        "        if rest:\n            # Every rank decides alike", "        if False:\n            # Every rank decides alike",
        ("tests/transforms/test_transforms_vma.py::test_broken_promise_raises_on_every_rank",),
        "a replication promise broken in one group only raises there: the other ranks hang in their next collective"),
    Mutation(
        "ppermute_transpose_not_inverted", "fshard/lax.py",
        "inverse = tuple((d, s) for s, d in ctx.perm)", "inverse = tuple(ctx.perm)",
        ("tests/test_lax.py::test_collective_values_and_grads_equal_global_functions",),
        "ppermute's backward sends cotangents the forward way"),
    Mutation(
        "ppermute_split_sizes_swapped", "fshard/comm.py",
        "_F.all_to_all_single(wire, recv_from, send_to, group.group_name)",
        "_F.all_to_all_single(wire, send_to, recv_from, group.group_name)",
        ("tests/test_comm.py::test_permute_values_zeros_and_log_on_4_ranks",
         "tests/jit/test_jit_p2p.py::test_jit_ppermute_values_grads_and_comm_log_equal_eager_float64"),
        "ppermute's all-to-all sends to the source and receives from the destination (a ring runs backwards)"),
    Mutation(
        "jit_donation_copy_dropped", "fshard/jit/api.py",
        "by_leaf[j].copy_(o.to_local() if isinstance(o, DTensor) else o)", "pass",
        ("tests/jit/test_jit_donate.py::test_donated_results_equal_undonated_and_are_the_arguments",),
        "fs.jit(donate_argnums=...) returns the donated arguments without computing the results into them"),
    Mutation(
        "jit_overlap_two_in_flight", "fshard/jit/passes/overlap.py",
        "s = max(ready_fixed[k], last_start, last_wait.get(g, 0))", "s = max(ready_fixed[k], last_start)",
        ("tests/jit/test_jit_overlap.py::test_overlap_moves_reduce_scatter_waits_behind_the_next_layers_backward",),
        "fs.jit's overlap scheduling starts a collective before the previous one on its gloo group was waited"),
    Mutation(
        "jit_overlap_waits_at_first_use", "fshard/jit/passes/overlap.py",
        "        if upto == k:  # every later one is due after this one\n",
        "        if True:\n",
        ("tests/jit/test_jit_overlap.py::test_overlap_moves_reduce_scatter_waits_behind_the_next_layers_backward",),
        "fs.jit's overlap scheduling waits for each collective at its first use, leaving none for the next"),
    Mutation(
        "jit_concat_in_place", "fshard/jit/passes/memory.py",
        '"post_grad_custom_pre_pass": LateConcat()', '"post_grad_custom_pre_pass": None',
        ("tests/jit/test_jit_memory.py::test_jit_inductor_allocates_a_collectives_flat_buffer_where_the_graph_concatenates_float64",),
        "fs.jit lets Inductor allocate a collective's flat buffer (the DDP bucket) before the backward"),
    Mutation(
        "jit_p2p_collective_split_from_wait", "fshard/jit/p2p.py",
        "if any(seg[f] != seg[n] for f in family):", "if False:",
        ("tests/jit/test_jit_p2p.py::test_jit_p2p_split_keeps_transfers_in_order_and_collectives_whole",),
        "fs.jit's Inductor path for pipelines compiles a collective in one region and its wait in a later one"),
    # --- pipelines (fshard/sched) -----------------------------------------------------------
    Mutation(
        "pipeline_dp_all_reduce_dropped", "fshard/sched/step.py",
        "handle = comm.all_reduce_async(flat, self.mesh.group(self.data), axes=self.data, inplace=True)",
        "handle = comm.Handle(flat)",
        (f"{RUNTIME}::test_dp_x_pp_grads_averaged_over_dp_equal_global_batch_reference",),
        "pipeline gradients of replicated leaves are not summed over the data axes"),
    Mutation(
        "pipeline_sends_reordered", "fshard/sched/runtime.py",
        "for a in (a for a in batch if a.kind in _SENDS):", "for a in reversed([a for a in batch if a.kind in _SENDS]):",
        (f"{RUNTIME}::test_every_generator_pp2_matches_unpipelined_model_and_simulated_peaks",),
        "the sends of one batch are posted in reverse list order"),
    # --- context parallelism (fshard/parallel/cp.py) ------------------------------------------
    Mutation(
        "cp_ring_skips_a_block", "fshard/parallel/_ring.py",
        "    for j in range(n):  # the block held at step j", "    for j in range(n - 1):  # the block held at step j",
        ("tests/parallel/test_parallel_cp.py::test_ring_attention_equals_one_process",),
        "the ring stops one step early: the last K/V block to arrive is never attended to"),
    Mutation(
        "cp_backward_keeps_the_travelling_gradient", "fshard/parallel/_ring.py",
        "        dkv = lax._permute_raw(dkv, ax, perm)\n", "        dkv = dkv\n",
        ("tests/parallel/test_parallel_cp.py::test_ring_attention_equals_one_process",),
        "the explicit backward's K/V gradients never travel on: each rank keeps the blocks' gradients it made"),
    Mutation(
        "cp_load_balancer_off", "fshard/parallel/cp.py",
        "    if not balance or n == 1:\n        return pos\n", "    if True:\n        return pos\n",
        ("tests/parallel/test_parallel_cp.py::test_ring_attention_equals_one_process",),
        "the head-tail order is the identity: the sequence is sharded in contiguous blocks"),
    Mutation(
        "cp_positions_ignored", "fshard/recipes/model.py",
        "            pos = cp_positions(tokens.shape[1], self.cp_axis).to(tokens.device)\n",
        "            pos = None\n",
        ("tests/integration/test_examples.py::test_loss_curve_is_the_same_on_every_mesh[cp=2,fsdp=2]",),
        "a cp rank embeds its tokens at positions 0..T/cp-1, not where head-tail sharding put them"),
    Mutation(
        "pipeline_seed_ignores_seq_axes", "fshard/sched/step.py",
        "            1.0 / (m * n_summed),", "            1.0 / (m * n_data),",
        ("tests/integration/test_examples.py::test_loss_curve_is_the_same_on_every_mesh[pp=2,cp=2]",),
        "a pipeline over cp seeds each microbatch's loss as if cp split no tokens: gradients cp times too large"),
    # --- optimizer, checkpoint, specs ---------------------------------------------------------
    Mutation(
        "adam_bias_correction_dropped", "fshard/optim/transforms.py",
        "torch.full((len(gl),), float(state.count), dtype=torch.float64)",
        "torch.full((len(gl),), float(state.count) + 1e9, dtype=torch.float64)",
        ("tests/optim/test_optim.py::test_matches_torch_optim_float64",),
        "Adam's step count is huge, so 1 - b^t = 1: no bias correction"),
    Mutation(
        "checkpoint_rename_skipped", "fshard/checkpoint/_save.py",
        "        _dirs.commit(tmp, path)\n",
        "        _dirs.commit(tmp, path) if not os.path.lexists(path) else None\n",
        ("tests/checkpoint/test_checkpoint.py::test_save_replaces_checkpoint_and_refuses_foreign_directories",),
        "a save over an existing checkpoint writes its temporary directory but never renames it into place"),
    Mutation(
        "checkpoint_temp_kept_on_failure", "fshard/checkpoint/_save.py",
        "        if rank == 0:\n            shutil.rmtree(tmp, ignore_errors=True)\n",
        "        if rank == 0:\n            pass\n",
        ("tests/checkpoint/test_checkpoint.py::test_exception_mid_write_keeps_previous_checkpoint",),
        "a failed save leaves its temporary directory behind"),
    Mutation(
        "spec_divisibility_check_disabled", "fshard/mesh/placement.py",
        "        if shape[d] % n:\n", "        if False:\n",
        ("tests/mesh/test_mesh_sharding.py::test_spec_errors_name_path_spec_axis_and_sizes",),
        "a dim the axes do not divide is accepted for an evenly sharded value"),
)


# --- applying ---------------------------------------------------------------------------------

class SnippetError(RuntimeError):
    """A mutation's snippet is not found exactly once."""


def mutated_source(m: Mutation, root: Path = ROOT) -> str:
    """``m.file``'s text with the fault applied.

    Raises:
      SnippetError: ``m.old`` occurs zero or several times (names the mutation and file).
    """
    text = (root / m.file).read_text()
    n = text.count(m.old)
    if n != 1:
        raise SnippetError(
            f"mutation {m.name!r}: its snippet occurs {n} times in {m.file} (expected exactly once); "
            f"the code changed: refresh the entry in tools/mutations.py.\n--- snippet ---\n{m.old}")
    return text.replace(m.old, m.new)


def copy_repo(dest: Path, root: Path = ROOT) -> Path:
    shutil.copytree(root, dest, ignore=_IGNORE, symlinks=True)
    return dest


# --- running ----------------------------------------------------------------------------------

@attrs.frozen
class Outcome:
    name: str
    status: str            # caught | SURVIVED | not run | error
    seconds: float
    caught_by: tuple[str, ...] = ()
    detail: str = ""


_PROCS: set[subprocess.Popen] = set()
_LOCK = threading.Lock()


def _failed_tests(xml_path: Path) -> tuple[list[str], str]:
    """The node ids of the failed tests in a JUnit report, and the first one's message."""
    if not xml_path.exists():
        return [], ""
    out, message = [], ""
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        bad = case.find("failure")
        bad = bad if bad is not None else case.find("error")
        if bad is not None:
            cls, name = case.get("classname", ""), case.get("name", "")
            out.append(f"{cls.replace('.', '/')}.py::{name}" if cls else name)
            message = message or " ".join((bad.get("message") or "").split())[:160]
    return out, message


# A rank pool that could not even start (the machine is overloaded) says nothing about the
# mutation: such a "catch" is retried once, then reported as an error.
_STARTUP_TIMEOUT = "start-up: ranks"


def run_one(m: Mutation, deadline: float, per_test_timeout: int, keep: bool, stop: threading.Event) -> Outcome:
    """Applies ``m`` to a fresh copy of the repository and runs its tests there."""
    t0 = time.monotonic()
    if stop.is_set() or t0 >= deadline:
        return Outcome(m.name, "not run", 0.0, detail="budget spent before it started")
    tmp = Path(tempfile.mkdtemp(prefix=f"fshard-mut-{m.name}-"))
    try:
        copy = copy_repo(tmp / "repo")
        (copy / m.file).write_text(mutated_source(m, copy))
        for attempt in (1, 2):
            o = _pytest(m, copy, tmp / f"try{attempt}", deadline, per_test_timeout, t0)
            if not (o.status == "caught" and _STARTUP_TIMEOUT in o.detail):
                return o
        return attrs.evolve(o, status="error", caught_by=(),
                            detail=f"rank start-up timed out twice (machine overloaded?): {o.detail}")
    except SnippetError as e:
        return Outcome(m.name, "error", time.monotonic() - t0, detail=str(e))
    finally:
        if keep:
            print(f"[{m.name}] kept {tmp}", flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _pytest(m: Mutation, copy: Path, out_dir: Path, deadline: float, per_test_timeout: int, t0: float) -> Outcome:
    """One pytest run of ``m.tests`` in the mutated ``copy``; its log and report go to ``out_dir``."""
    out_dir.mkdir()
    xml, log = out_dir / "junit.xml", out_dir / "pytest.log"
    env = dict(os.environ, PYTHONPATH=str(copy) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
           "-o", "addopts=", f"--timeout={per_test_timeout}", f"--junitxml={xml}", *m.tests]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=copy, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        with _LOCK:
            _PROCS.add(proc)
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill(proc)
            rc = None
        finally:
            with _LOCK:
                _PROCS.discard(proc)
    dt = time.monotonic() - t0
    failed, message = _failed_tests(xml)
    lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
    if rc is None:
        return Outcome(m.name, "not run", dt, tuple(failed), "killed: budget spent while it ran")
    if rc == 0:
        return Outcome(m.name, "SURVIVED", dt, detail=f"{lines[-1] if lines else ''}: no test failed")
    if rc in (1, 2) and (failed or rc == 1):  # 2: interrupted, e.g. a collection error it caused
        return Outcome(m.name, "caught", dt, tuple(failed) or ("(collection error)",), message)
    return Outcome(m.name, "error", dt, detail=f"pytest exit code {rc}\n" + "\n".join(lines[-15:]))


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the session pytest leads: it and its rank processes
    except ProcessLookupError:
        pass
    proc.wait()


def check_table(mutations=MUTATIONS, root: Path = ROOT) -> list[str]:
    """Problems with the table: duplicate names, snippets not found once, missing tests."""
    problems = []
    names = [m.name for m in mutations]
    problems += [f"duplicate mutation name {n!r}" for n in sorted({n for n in names if names.count(n) > 1})]
    for m in mutations:
        try:
            src = mutated_source(m, root)
            compile(src, m.file, "exec")
        except SnippetError as e:
            problems.append(str(e))
        except SyntaxError as e:
            problems.append(f"mutation {m.name!r}: the mutated {m.file} does not compile: {e}")
        if m.old == m.new:
            problems.append(f"mutation {m.name!r}: old and new are the same")
        for t in m.tests:
            path, _, test = t.partition("::")
            if not (root / path).exists():
                problems.append(f"mutation {m.name!r}: test file {path} does not exist")
            elif test and f"def {test.split('[')[0]}(" not in (root / path).read_text():
                problems.append(f"mutation {m.name!r}: no test {test} in {path}")
    return problems


def _table(outcomes: list[Outcome]) -> str:
    """One row per mutation; under a caught one, the first failure's message."""
    w = max(len(o.name) for o in outcomes)
    rows = [f"{'mutation':<{w}}  {'result':<8}  {'s':>6}  caught by (first failing test; -x stops there)",
            "-" * (w + 80)]
    for o in outcomes:
        by = ", ".join(o.caught_by) if o.caught_by else o.detail.splitlines()[0] if o.detail else ""
        rows.append(f"{o.name:<{w}}  {o.status:<8}  {o.seconds:6.1f}  {by}")
        if o.caught_by and o.detail:
            rows.append(f"{'':<{w + 20}}  {o.detail}")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=600.0, help="wall-clock limit for all mutations (default 600)")
    ap.add_argument("--jobs", type=int, choices=(1, 2), default=2, help="mutations run at once (default 2)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutations")
    ap.add_argument("--per-test-timeout", type=int, default=180, help="pytest-timeout per test, s (default 180)")
    ap.add_argument("--list", action="store_true", help="print the table and exit")
    ap.add_argument("--check", action="store_true", help="check every snippet and test exists, run nothing")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copies (for debugging)")
    args = ap.parse_args(argv)

    chosen = list(MUTATIONS)
    if args.only:
        unknown = sorted(set(args.only) - {m.name for m in MUTATIONS})
        if unknown:
            ap.error(f"unknown mutation(s) {unknown}; known: {[m.name for m in MUTATIONS]}")
        chosen = [m for m in MUTATIONS if m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.file}: {m.why}\n    tests: {', '.join(m.tests)}")
        return 0
    problems = check_table(chosen)
    if problems:
        print("mutation table errors:\n" + "\n".join(problems), file=sys.stderr)
        return 2
    if args.check:
        print(f"{len(chosen)} mutations: every snippet found once, every test exists")
        return 0

    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    stop = threading.Event()
    print(f"{len(chosen)} mutations, {args.jobs} at a time, budget {args.budget_s:.0f} s", flush=True)
    outcomes: dict[str, Outcome] = {}
    try:
        with cf.ThreadPoolExecutor(args.jobs) as pool:
            futures = {pool.submit(run_one, m, deadline, args.per_test_timeout, args.keep, stop): m for m in chosen}
            for fut in cf.as_completed(futures):
                o = fut.result()
                outcomes[o.name] = o
                print(f"  {o.name}: {o.status} ({o.seconds:.1f} s)"
                      + (f" by {o.caught_by[0]}" if o.caught_by else ""), flush=True)
    except KeyboardInterrupt:
        stop.set()
        with _LOCK:
            for p in list(_PROCS):
                _kill(p)
        raise
    ordered = [outcomes[m.name] for m in chosen]
    print()
    print(_table(ordered))
    for o in ordered:
        if o.status == "error" and o.detail:
            print(f"\n--- {o.name} ({o.status}) ---\n{o.detail}")
    total = time.monotonic() - t0
    counts = {s: sum(o.status == s for o in ordered) for s in ("caught", "SURVIVED", "not run", "error")}
    print(f"\n{counts['caught']}/{len(ordered)} caught, {counts['SURVIVED']} survived, "
          f"{counts['not run']} not run, {counts['error']} errors; {total:.0f} s")
    if counts["SURVIVED"]:
        return 1
    if counts["error"]:
        return 2
    if counts["not run"]:
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
