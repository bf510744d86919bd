"""Runs the selected conformance programs once per session: JAX in a subprocess, fshard on 4 gloo ranks.

The JAX subprocess starts as soon as a test first asks for any result and runs while the
fshard batches run on the ranks. JAX's results are also kept on disk (pytest's cache dir),
keyed by the hash of every file that defines them and the jax version, so that a rerun
with unchanged programs skips JAX altogether; ``FSHARD_CONFORMANCE_CACHE=0`` turns that off.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

from conf_compare import mismatch
from conf_programs import Program, programs

HERE = Path(__file__).resolve().parent
WORLD = 4
JAX_TIMEOUT_S = float(os.environ.get("FSHARD_CONFORMANCE_JAX_TIMEOUT_S", "1200"))
BATCH = 64  # programs per rank task


def _cache_key() -> str:
    h = hashlib.sha256()
    for name in sorted(os.listdir(HERE)):
        if name.startswith(("conf_programs", "conf_ops_jax", "conf_jax_worker", "conf_compare")):
            h.update(name.encode() + (HERE / name).read_bytes())
    try:
        h.update(importlib.metadata.version("jax").encode())
    except importlib.metadata.PackageNotFoundError:
        pass
    return h.hexdigest()[:16]


class Conformance:
    """Lazily computed, cached records of both frameworks for the wanted programs."""

    def __init__(self, wanted: list[str], cache_dir: Path | None) -> None:
        self.programs: dict[str, Program] = programs()
        self._wanted = self._closure(wanted)
        self._cache_path = (cache_dir / f"jax-{_cache_key()}.pkl") if cache_dir is not None else None
        self._jax: dict[str, dict] = self._load_cache()
        self._proc: subprocess.Popen | None = None
        self._proc_names: list[str] = []
        self._tmp = tempfile.mkdtemp(prefix="fshard-conformance-")
        self._fs: dict[str, dict] = {}

    def _closure(self, names: list[str]) -> list[str]:
        """The names plus the oracles they compare against, in order, without repeats."""
        out, seen = [], set()
        for n in names:
            while n is not None and n not in seen:
                seen.add(n)
                out.append(n)
                n = self.programs[n].oracle
        return out

    # --- JAX -----------------------------------------------------------------------
    def _load_cache(self) -> dict[str, dict]:
        if self._cache_path is None or not self._cache_path.exists():
            return {}
        try:
            with open(self._cache_path, "rb") as f:
                return pickle.load(f)
        except Exception:
            return {}

    def _save_cache(self) -> None:
        if self._cache_path is None:
            return
        self._cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._cache_path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            pickle.dump(self._jax, f)
        os.replace(tmp, self._cache_path)

    def start_jax(self, extra: list[str] = ()) -> None:
        """Starts the JAX subprocess for every wanted program JAX has not run yet."""
        if self._proc is not None:
            return
        todo = [n for n in self._closure(list(self._wanted) + list(extra)) if n not in self._jax]
        if not todo:
            return
        names_path = os.path.join(self._tmp, "names.json")
        with open(names_path, "w") as f:
            json.dump(todo, f)
        self._out_path = os.path.join(self._tmp, "jax.pkl")
        self._log = open(os.path.join(self._tmp, "jax.log"), "w+")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
        env.update(OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
        self._proc = subprocess.Popen([sys.executable, str(HERE / "conf_jax_worker.py"), names_path, self._out_path],
                                      env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=str(HERE))
        self._proc_names = todo

    def _finish_jax(self) -> None:
        proc, self._proc = self._proc, None
        try:
            rc = proc.wait(timeout=JAX_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = "timeout"
        self._log.seek(0)
        log = self._log.read()[-5000:]
        self._log.close()
        if rc != 0:
            raise RuntimeError(f"the JAX conformance worker failed (exit {rc}) on {len(self._proc_names)} "
                               f"programs; its output:\n{log}")
        with open(self._out_path, "rb") as f:
            self._jax.update(pickle.load(f))
        self._save_cache()

    def jax(self, name: str) -> dict:
        if name not in self._jax:
            if self._proc is not None and name in self._proc_names:
                self._finish_jax()
            else:
                if self._proc is not None:
                    self._finish_jax()
                self.start_jax(extra=[name])
                if self._proc is not None:
                    self._finish_jax()
        return self._jax[name]

    # --- fshard --------------------------------------------------------------------
    def fshard(self, name: str) -> dict:
        if name not in self._fs:
            self.start_jax()  # JAX runs while the ranks do
            todo = [n for n in self._closure(list(self._wanted) + [name])
                    if n not in self._fs and "jax_only" not in self.programs[n].tags]
            self._run_fshard(todo + ([name] if name not in todo else []))
        return self._fs[name]

    def _run_fshard(self, names: list[str], retry: bool = True) -> None:
        from conf_ops_fshard import merge_ranks, run_batch
        from fshard.testing import run_on_ranks

        plain = [n for n in names if "vmap" not in self.programs[n].tags]
        # vmap programs may fail inside a collective; alone, they cannot take the others down.
        batches = [plain[i:i + BATCH] for i in range(0, len(plain), BATCH)]
        batches += [[n] for n in names if "vmap" in self.programs[n].tags]
        for batch in batches:
            try:
                self._fs.update(merge_ranks(run_on_ranks(run_batch, batch, world_size=WORLD)))
            except Exception as e:  # a hang or a crash: the whole batch carries the error
                if "start-up" in str(e):
                    # The ranks did not even start (a loaded machine): the batch, as it was,
                    # once more; no program ran, so splitting it would only start more pools.
                    if retry:
                        self._run_fshard(batch, retry=False)
                    else:
                        for n in batch:
                            self._fs[n] = {"status": "error", "error": f"the ranks did not start: {e}"[:4000],
                                           "ranks_disagree": f"the ranks did not start: {e}"[:2000]}
                elif len(batch) > 1:
                    for n in batch:  # one at a time, to name the program that breaks the ranks
                        self._run_fshard([n], retry=False)
                else:
                    self._fs[batch[0]] = {"status": "error", "error": f"the rank task failed: {type(e).__name__}: {e}"[:4000],
                                          "ranks_disagree": f"rank task failed: {e}"[:2000]}

    # --- comparison ----------------------------------------------------------------
    def oracle_of(self, name: str) -> str:
        """The program whose JAX result fshard's ``name`` must equal (its oracle chain's end)."""
        while self.programs[name].oracle is not None:
            name = self.programs[name].oracle
        return name

    def mismatch(self, name: str) -> str | None:
        """Why fshard's result for ``name`` differs from JAX's, or None."""
        oracle = self.oracle_of(name)
        fs_rec = self.fshard(name)
        label = name if oracle == name else f"{name} (oracle: JAX on {oracle})"
        return mismatch(label, fs_rec, self.jax(oracle))
