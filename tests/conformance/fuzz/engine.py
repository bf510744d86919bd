"""Runs programs in both frameworks and classifies them: the JAX server and the rank pool.

JAX runs in ``jax_worker.py`` (one server process per job, started on first use, fed
requests while the ranks work); fshard runs on one 4-rank pool
(``fshard.testing.run_on_ranks``), ``BATCH`` programs per rank task. JAX's results for
generated seeds are cached on disk, keyed by the hash of every file that defines a
program or its JAX run and the jax version; shrinking's variants are not cached.
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

from .compare import Verdict, classify

HERE = Path(__file__).resolve().parent
CONF = HERE.parent
WORLD = 4
BATCH = 100  # programs per rank task
RANK_TIMEOUT_S = 120.0
_KEYED = ("gen.py", "grammar.py", "grammar_lax.py", "emit.py", "ops_src.py", "jax_worker.py", "labels.py")  # labels: which twins JAX runs


def cache_key() -> str:
    h = hashlib.sha256()
    for name in _KEYED:
        h.update(name.encode() + (HERE / name).read_bytes())
    h.update((CONF / "conf_compare.py").read_bytes())
    try:
        h.update(importlib.metadata.version("jax").encode())
    except importlib.metadata.PackageNotFoundError:
        pass
    return h.hexdigest()[:16]


class JaxServer:
    """One ``jax_worker.py`` process; ``submit`` a list of programs, then ``result``."""

    def __init__(self, tmp: str, tag: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
        env.update(OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
        self.log = open(os.path.join(tmp, f"jax-{tag}.log"), "w+")  # noqa: SIM115 - closed by close()
        self.proc = subprocess.Popen([sys.executable, str(HERE / "jax_worker.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=str(CONF), env=env)
        self.tmp, self.tag, self.n = tmp, tag, 0
        self.pending: str | None = None

    def submit(self, progs: list[dict]) -> None:
        self.n += 1
        path = os.path.join(self.tmp, f"req-{self.tag}-{self.n}.json")
        with open(path, "w") as f:
            json.dump(progs, f)
        self.proc.stdin.write(path + "\n")
        self.proc.stdin.flush()
        self.pending = path

    def result(self) -> dict:
        line = self.proc.stdout.readline()
        path, self.pending = self.pending, None
        if line.strip() != "done":
            self.log.seek(0)
            raise RuntimeError(f"the JAX fuzz worker failed; its log:\n{self.log.read()[-5000:]}")
        with open(path + ".pkl", "rb") as f:
            return pickle.load(f)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Engine:
    """Both frameworks' records for lists of programs, and their verdicts."""

    def __init__(self, cache_dir: Path | None = None, jobs: int = 1) -> None:
        self.tmp = tempfile.mkdtemp(prefix="fshard-fuzz-")
        self.jobs = max(1, jobs)
        self.servers: list[JaxServer] = []
        self.cache_path = cache_dir / f"jax-{cache_key()}.pkl" if cache_dir is not None else None
        self.cache: dict = self._load_cache()

    def _load_cache(self) -> dict:
        if self.cache_path is None or not self.cache_path.exists():
            return {}
        try:
            with open(self.cache_path, "rb") as f:
                return pickle.load(f)
        except Exception:  # noqa: BLE001 - a broken cache is recomputed
            return {}

    def _save_cache(self) -> None:
        if self.cache_path is None:
            return
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.cache_path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            pickle.dump(self.cache, f)
        os.replace(tmp, self.cache_path)

    def close(self) -> None:
        for s in self.servers:
            s.close()
        self.servers = []

    # --- JAX ---
    def _jax_start(self, progs: list[dict], cached: bool) -> list[JaxServer]:
        todo = [p for p in progs if not (cached and p["id"] in self.cache)]
        while len(self.servers) < min(self.jobs, max(1, len(todo))):
            self.servers.append(JaxServer(self.tmp, str(len(self.servers))))
        used = []
        if todo:
            k = -(-len(todo) // len(self.servers))
            for i, s in enumerate(self.servers):
                part = todo[i * k:(i + 1) * k]
                if part:
                    s.submit(part)
                    used.append(s)
        return used

    def _jax_finish(self, used: list[JaxServer], cached: bool) -> dict:
        out: dict = {}
        for s in used:
            out.update(s.result())
        if cached and out:
            self.cache.update(out)
            self._save_cache()
        return out

    # --- fshard ---
    def fshard(self, progs: list[dict]) -> dict:
        from fshard.testing import run_on_ranks

        from .fs_worker import merge_ranks, run_batch

        out: dict = {}
        for i in range(0, len(progs), BATCH):
            batch = progs[i:i + BATCH]
            try:
                out.update(merge_ranks(run_on_ranks(run_batch, batch, world_size=WORLD, timeout_s=RANK_TIMEOUT_S)))
            except Exception as e:  # noqa: BLE001 - a hang or a crash: split to name the program
                if len(batch) > 1:
                    out.update(self.fshard(batch[:len(batch) // 2]))
                    out.update(self.fshard(batch[len(batch) // 2:]))
                else:
                    msg = f"the rank task failed: {type(e).__name__}: {e}"[:3000]
                    out[batch[0]["id"]] = {"status": "error", "error": msg, "ranks_disagree": msg}
        return out

    # --- both ---
    def records(self, progs: list[dict], cached: bool = True) -> tuple[dict, dict]:
        """``(jax, fshard)`` records by id; JAX runs while the ranks do."""
        used = self._jax_start(progs, cached)
        fs_recs = self.fshard(progs)
        jax_recs = self._jax_finish(used, cached)
        if cached:
            jax_recs = {p["id"]: self.cache[p["id"]] for p in progs}
        return jax_recs, fs_recs

    def verdicts(self, progs: list[dict], cached: bool = True) -> dict[str, tuple[Verdict, dict, dict]]:
        jax_recs, fs_recs = self.records(progs, cached)
        return {p["id"]: (classify(p, jax_recs[p["id"]], fs_recs[p["id"]]), jax_recs[p["id"]], fs_recs[p["id"]])
                for p in progs}
