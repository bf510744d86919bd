"""What every GPU check shares: its result record, device assertions, and process set-up.

A check is a script with ``run(ck, args)``; :func:`main` gives it the command line
(``--cpu-dry-run``, ``--result PATH``), runs it and writes one JSON record:

    {"check", "status": "passed" | "failed" | "skipped", "passed", "seconds",
     "mode": "gpu" | "cpu-dry-run", "device", "figures": {...},
     "assertions": {"checked": [...], "skipped_on_cpu": [...]},
     "parts": {name: {"passed", "seconds", "error"}}, "reason", "error"}

Two kinds of assertion: :meth:`Checker.require` holds everywhere (values, parity,
memory bounds computed on the host); :meth:`Checker.require_on_device` is about the
device itself (tensors on CUDA, NCCL picked, pinned copies, CUDA memory) and is skipped,
and listed as skipped, in a CPU dry run. The code paths are the same in both modes:
only the device (``cuda`` or ``cpu``) and the backend (``nccl`` or ``gloo``) differ.

Fork safety: checks that start ranks with ``fs.run_local`` (forked children) must not
initialize CUDA in the parent before forking; ``torch.cuda.is_available()`` is made to
ask NVML (which does not initialize CUDA) by setting ``PYTORCH_NVML_BASED_CUDA_CHECK``
before torch is imported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import attrs  # noqa: E402
import torch  # noqa: E402

__all__ = ["Checker", "CheckFailed", "CheckSkipped", "main", "one_rank_group", "synchronize",
           "free_port", "median", "REPO"]


class CheckFailed(AssertionError):
    """An assertion of a check did not hold; the message says which and by how much."""


# What a broken assertion raises, as opposed to a CUDA API on a CPU-only build.
_SCRIPT_ERRORS = (NameError, KeyError, TypeError, AttributeError, IndexError, ZeroDivisionError)


class CheckSkipped(Exception):
    """The check cannot run here; the message is the reason the summary shows."""


@attrs.define
class Checker:
    """One check's assertions and figures.

    Attributes:
      name: the check's name in the summary.
      dry_run: True on the CPU (``--cpu-dry-run``): device assertions are skipped.
      figures: key numbers for the summary (JSON-serializable).
      checked: the assertions that held.
      skipped: the device assertions a dry run skipped.
      parts: per sub-check, whether it passed, its seconds and its error.
    """

    name: str
    dry_run: bool
    figures: dict[str, Any] = attrs.Factory(dict)
    checked: list[str] = attrs.Factory(list)
    skipped: list[str] = attrs.Factory(list)
    parts: dict[str, dict[str, Any]] = attrs.Factory(dict)

    @property
    def device_type(self) -> str:
        """``"cuda"``, or ``"cpu"`` in a dry run. Touches no CUDA API (fork-safe)."""
        return "cpu" if self.dry_run else "cuda"

    @property
    def backend(self) -> str:
        """The backend a one-rank group of this mode uses: ``"nccl"``, or ``"gloo"`` in a dry run."""
        return "gloo" if self.dry_run else "nccl"

    def require(self, what: str, ok: bool, detail: Any = "") -> None:
        """Asserts ``ok`` in every mode.

        Raises:
          CheckFailed: ``ok`` is false; the message is ``what`` and ``detail``.
        """
        if not ok:
            raise CheckFailed(f"{self.name}: {what}" + (f": {detail}" if detail != "" else ""))
        self.checked.append(what)

    def require_on_device(self, what: str, test: Callable[[], bool | tuple[bool, Any]]) -> None:
        """Asserts ``test()`` on a GPU; in a dry run records ``what`` as skipped.

        ``test`` returns a bool or ``(bool, detail)``; it may use CUDA APIs freely. In a
        dry run it still runs, unasserted, so that its own code cannot rot: an error that
        only a broken script raises (NameError, KeyError, TypeError, ...) fails the check;
        a CUDA API refusing to run on a CPU-only build does not.

        Raises:
          CheckFailed: on a GPU, ``test()`` is false; in a dry run, ``test`` is broken.
        """
        if self.dry_run:
            self.skipped.append(what)
            try:
                _unpack(test())
            except _SCRIPT_ERRORS as e:
                raise CheckFailed(f"{self.name}: the device assertion {what!r} is broken: {e!r}") from e
            except Exception:  # noqa: BLE001 - e.g. "Torch not compiled with CUDA enabled"
                pass
            return
        ok, detail = _unpack(test())
        self.require(what, bool(ok), detail)

    def figure(self, **values: Any) -> None:
        """Records key numbers (rounded floats read better in the summary)."""
        for k, v in values.items():
            self.figures[k] = round(v, 6) if isinstance(v, float) else v

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Runs a sub-check; a failure is recorded and the check goes on with the next part."""
        t0 = time.perf_counter()
        entry: dict[str, Any] = {"passed": False, "seconds": None, "error": None}
        self.parts[name] = entry
        try:
            yield
            entry["passed"] = True
        except Exception as e:  # noqa: BLE001 - a failed part must not stop the others
            entry["error"] = _short_error(e)
            print(f"[{self.name}/{name}] FAILED\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        finally:
            entry["seconds"] = round(time.perf_counter() - t0, 3)

    def failed_parts(self) -> list[str]:
        return [k for k, v in self.parts.items() if not v["passed"]]


def _unpack(out: Any) -> tuple[Any, Any]:
    """A device test's ``bool`` or ``(bool, detail)``."""
    if isinstance(out, tuple):
        if len(out) != 2:
            raise TypeError(f"a device assertion returns a bool or (bool, detail), got a {len(out)}-tuple")
        return out
    return out, ""


def _short_error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= 2000 else text[:2000] + " ..."


def synchronize(device: torch.device | str) -> None:
    """Waits for the device's queued work (no-op on the CPU), so that timings are real."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_rank_group() -> str:
    """Starts a one-rank world as ``torchrun --nproc-per-node 1`` would, through ``fs.init()``.

    Returns:
      The backend ``fs.init()`` picked (nccl on a CUDA machine, gloo otherwise).
    """
    import torch.distributed as dist

    import fshard as fs

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    fs.init()
    return dist.get_backend()


def _destroy_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def device_description(dry_run: bool) -> dict[str, Any]:
    """Which machine ran the check (called after the check: it initializes CUDA)."""
    info: dict[str, Any] = {"torch": torch.__version__}
    if dry_run or not torch.cuda.is_available():
        info["device"] = "cpu"
        return info
    props = torch.cuda.get_device_properties(0)
    info.update(device=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                memory_gib=round(props.total_memory / 2**30, 1), n_gpus=torch.cuda.device_count())
    with contextlib.suppress(Exception):
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info


def main(run: Callable[[Checker, argparse.Namespace], None], name: str,
         add_args: Callable[[argparse.ArgumentParser], None] | None = None,
         doc: str | None = None) -> None:
    """The command line of a check: runs ``run`` and writes its JSON record.

    Exit status: 0 passed or skipped, 1 failed.
    """
    ap = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="no GPU: run the same logic on the CPU (gloo), skipping the device assertions")
    ap.add_argument("--result", default=None, help="write the JSON record here")
    if add_args is not None:
        add_args(ap)
    args = ap.parse_args()
    ck = Checker(name, args.cpu_dry_run)
    t0 = time.perf_counter()
    status, reason, error = "passed", None, None
    try:
        if not ck.dry_run and not torch.cuda.is_available():
            raise CheckFailed(f"{name}: no CUDA device (torch.cuda.is_available() is False); "
                              f"on a machine without a GPU pass --cpu-dry-run")
        run(ck, args)
        if ck.failed_parts():
            status = "failed"
            error = "; ".join(f"{k}: {ck.parts[k]['error']}" for k in ck.failed_parts())
    except CheckSkipped as e:
        status, reason = "skipped", str(e)
    except BaseException as e:  # noqa: BLE001 - the record must be written whatever happened
        status, error = "failed", _short_error(e)
        traceback.print_exc()
    finally:
        _destroy_group()
    seconds = time.perf_counter() - t0
    record = {
        "check": name, "status": status, "passed": status == "passed", "seconds": round(seconds, 3),
        "mode": "cpu-dry-run" if ck.dry_run else "gpu", "device": device_description(ck.dry_run),
        "figures": ck.figures,
        "assertions": {"checked": ck.checked, "skipped_on_cpu": ck.skipped},
        "parts": ck.parts, "reason": reason, "error": error,
    }
    text = json.dumps(record, indent=1, default=str)
    if args.result:
        Path(args.result).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result).write_text(text)
    print(f"[{name}] {status.upper()} in {seconds:.1f} s" + (f": {reason}" if reason else "")
          + (f": {error}" if error else ""), flush=True)
    print(text, flush=True)
    sys.exit(1 if status == "failed" else 0)
