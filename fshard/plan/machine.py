"""A machine as data: its devices' memory and speed, and the links between them.

A :class:`Machine` says how fast one device multiplies matrices (per dtype), moves
memory and launches kernels, how much memory it has, how many devices share a node,
and per link level (``"intra"``: inside a node, e.g. NVLink; ``"inter"``: between
nodes, e.g. InfiniBand) the bandwidth and latency one rank sees. A mesh axis uses the
intra-node link when all its ranks share a node and the inter-node link otherwise
(:meth:`Machine.level`).

Machine files are JSON (:func:`load_machine`, :func:`save_machine`): ``h100`` and
``a100`` ship with fshard (``fshard/plan/machines/``, figures from the vendors' data
sheets, sources in the file); :func:`fshard.plan.calibrate` writes one for the machine it
runs on, with measured figures, including per collective kind ``(latency, bandwidth)``
fitted to the ring formulas.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import attrs

from fshard.plan.model import DescriptionError

__all__ = [
    "Link",
    "Machine",
    "MACHINES",
    "default_machine_path",
    "get_machine",
    "load_machine",
    "machine_from_dict",
    "save_machine",
]

_DIR = Path(__file__).resolve().parent / "machines"
COLLECTIVE_KINDS = ("all_gather", "psum_scatter", "psum", "ppermute")


def _positive(where: str, value: Any, *, allow_zero: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        sign = "non-negative" if allow_zero else "positive"
        raise DescriptionError(f"{where} must be a {sign} number, got {value!r}")
    return float(value)


@attrs.frozen
class Link:
    """One link level as a rank sees it.

    Attributes:
      bandwidth: bytes per second one rank sends (one direction).
      latency: seconds per message step (a ring of n ranks takes n - 1 steps).
    """

    bandwidth: float
    latency: float

    def check(self, where: str) -> None:
        _positive(f"{where}.bandwidth", self.bandwidth)
        _positive(f"{where}.latency", self.latency, allow_zero=True)


def _dict(d: Mapping[str, Any]) -> dict[str, Any]:
    """``dict(d)``, typed: mypy's attrs plugin cannot infer a generic ``converter=dict``."""
    return dict(d)


def _tuple(xs: Iterable[Any]) -> tuple[Any, ...]:
    """``tuple(xs)``, typed, as :func:`_dict`."""
    return tuple(xs)


@attrs.frozen
class Machine:
    """A cluster of identical devices, for the planner.

    Attributes:
      name: e.g. ``"h100"``.
      memory_bytes: memory per device.
      flops: peak FLOP/s of matrix products per dtype name (``"bfloat16"``, ``"float32"``).
      mem_bandwidth: bytes per second of device memory (memory-bound kernels).
      devices_per_node: devices that share the intra-node link.
      links: ``{"intra": Link, "inter": Link}``.
      matmul_efficiency: share of ``flops`` that a model's matrix products reach (vendor
        figures are peaks; a calibrated machine fits it on a real block, at most 1: a
        block faster than the square products raises ``flops`` instead).
      mem_efficiency: share of ``mem_bandwidth`` that elementwise kernels reach.
      op_overhead_s: fixed seconds per kernel (launch / dispatch), whatever its size.
      layer_overhead_s: fixed seconds per call of a layer's forward or backward besides
        its kernels' (eager autograd's and fshard's per-layer bookkeeping on the host);
        calibrated machines fit it from 1, 2 and 4 blocks per call (on a GPU whose host
        runs ahead of its kernels the fit reads host time the step hides: the shipped GPU
        files set 0).
      call_overhead_s: fixed host seconds per call of a flat step's body
        (``value_and_grad(shard_map(...))``: shard_map's entry and exit checks, the
        autograd graph's setup and teardown), once per microbatch, whatever the layer
        count; a pipeline's stage forward and its backward are calls of their own (plain
        autograd, no shard_map) and pay half of it each. Calibrated machines fit it with
        ``layer_overhead_s``; the shipped GPU files set 0.
      optimizer_leaf_overhead_s: host seconds per parameter leaf of the optimizer step
        (global norm, clipping, AdamW, apply) beyond its kernels' (the Python of the
        transforms and DTensor's dispatch of every op); calibrated machines measure it on
        DTensor leaves; the shipped GPU files set 0.
      optimizer_mem_efficiency: share of ``mem_bandwidth`` the optimizer step's kernels
        reach on the bytes the estimate traces for them (many elementwise passes over
        separate tensors, not one long copy); calibrated machines measure it on the update
        of large leaves; 1 by default.
      sync_overhead_s: seconds each blocking collective call (one on the critical path)
        costs beyond its link time when the ranks compute between such calls: CPU ranks
        sharing cores wait for peers the scheduler has preempted; calibrated machines
        measure it (small all-reduces between matrix-product bursts); the estimate charges
        it in flat steps, only when a node's ranks outnumber its cores; 0 on devices.
      collectives: measured ``{kind: {level: Link}}`` fitted per collective kind (kinds
        ``all_gather``, ``psum_scatter``, ``psum``, ``ppermute``); where present they
        replace ``links`` for that kind.
      overlap: share of the shorter of an overlappable collective (FSDP prefetch,
        gradient reductions) and the compute beside it that runs hidden, 0 to 1 (what
        ``calibrate`` measures: an all-gather beside a matmul loop as long as it).
      cores_per_node: CPU machines: cores the ranks of a node share (0: a device each).
        Non-zero also means the ranks post point-to-point transfers from their own thread
        (gloo): a pipeline estimate charges each posted send or receive its latency on the
        rank's timeline; devices (0) post asynchronously (NCCL), the latency is the edge's.
      calibrated_ranks: ranks per node when the figures were measured (CPU machines:
        compute rates scale by ``min(1, cores / ranks)`` relative to that).
      reserved_bytes: device memory the runtime keeps for itself (CUDA context, NCCL).
      comm_temporaries: buffers a collective in flight allocates besides its input and
        output, as a multiple of the larger of them (gloo's all-gather and reduce-scatter
        stage through one each: 1; NCCL works in place: 0).
      fit_residuals: calibrated machines: per fitted figure (``"flops[float32]"``,
        ``"mem_bandwidth"``, ``"block"``, ...) the fit's relative residual (root mean square
        of ``(fitted - measured) / measured`` over its sizes; the larger of it and the
        spread of repeated rounds where there were rounds); empty: not recorded (shipped
        files, or files older than the field).
      uncertain: the fitted figures whose residual stayed above the calibration's threshold
        after one repeat (:data:`fshard.plan.calibrate.NOISY_FIT`): used, but the estimate's
        interval widens and says so (:attr:`fshard.plan.estimate.Estimate.uncertain`).
      conditions: calibrated machines: what the calibration ran under (torch and fshard
        versions, core counts, load averages before and after, time; the keys
        :func:`fshard.plan.freshness.conditions` writes), which decides whether a stored file
        may be reused (:func:`fshard.plan.freshness.stale`); empty: unknown (shipped files,
        or files older than the field: treated as stale when reused as this host's).
      sources: where the figures come from.
      notes: assumptions, in words.
    """

    name: str
    memory_bytes: float
    flops: Mapping[str, float] = attrs.field(converter=_dict)
    mem_bandwidth: float
    devices_per_node: int
    links: Mapping[str, Link] = attrs.field(converter=_dict)
    matmul_efficiency: float = 1.0
    mem_efficiency: float = 1.0
    op_overhead_s: float = 0.0
    layer_overhead_s: float = 0.0
    call_overhead_s: float = 0.0
    optimizer_leaf_overhead_s: float = 0.0
    optimizer_mem_efficiency: float = 1.0
    sync_overhead_s: float = 0.0
    collectives: Mapping[str, Mapping[str, Link]] = attrs.field(
        factory=dict, converter=lambda d: {k: dict(v) for k, v in d.items()}
    )
    overlap: float = 0.9
    cores_per_node: int = 0
    calibrated_ranks: int = 0
    reserved_bytes: float = 0.0
    comm_temporaries: float = 0.0
    fit_residuals: Mapping[str, float] = attrs.field(factory=dict, converter=_dict)
    uncertain: tuple[str, ...] = attrs.field(default=(), converter=_tuple)
    conditions: Mapping[str, Any] = attrs.field(factory=dict, converter=_dict)
    sources: tuple[str, ...] = attrs.field(default=(), converter=_tuple)
    notes: str = ""

    def __attrs_post_init__(self) -> None:
        where = f"machine {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise DescriptionError(f"machine.name must be a non-empty string, got {self.name!r}")
        _positive(f"{where}: memory_bytes", self.memory_bytes)
        if not self.flops:
            raise DescriptionError(f"{where}: flops must name at least one dtype, e.g. {{'bfloat16': 989e12}}")
        for dtype, value in self.flops.items():
            _positive(f"{where}: flops[{dtype!r}]", value)
        _positive(f"{where}: mem_bandwidth", self.mem_bandwidth)
        if not isinstance(self.devices_per_node, int) or self.devices_per_node < 1:
            raise DescriptionError(f"{where}: devices_per_node must be an int >= 1, got {self.devices_per_node!r}")
        for level in ("intra", "inter"):
            if level not in self.links:
                raise DescriptionError(f"{where}: links[{level!r}] is missing (links need 'intra' and 'inter')")
        for level, link in self.links.items():
            if level not in ("intra", "inter"):
                raise DescriptionError(f"{where}: links has unknown level {level!r}; levels are 'intra', 'inter'")
            if not isinstance(link, Link):
                raise DescriptionError(f"{where}: links[{level!r}] must be a Link, got {type(link).__name__}")
            link.check(f"{where}: links[{level!r}]")
        for kind, levels in self.collectives.items():
            if kind not in COLLECTIVE_KINDS:
                raise DescriptionError(f"{where}: collectives has unknown kind {kind!r}; kinds are {COLLECTIVE_KINDS}")
            for level, link in levels.items():
                if level not in ("intra", "inter") or not isinstance(link, Link):
                    raise DescriptionError(
                        f"{where}: collectives[{kind!r}][{level!r}] must be a Link at level 'intra' or 'inter'"
                    )
                link.check(f"{where}: collectives[{kind!r}][{level!r}]")
        for f in ("matmul_efficiency", "mem_efficiency", "optimizer_mem_efficiency", "overlap"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v <= 1 or (f != "overlap" and v == 0):
                raise DescriptionError(f"{where}: {f} must be in {'[0, 1]' if f == 'overlap' else '(0, 1]'}, got {v!r}")
        _positive(f"{where}: op_overhead_s", self.op_overhead_s, allow_zero=True)
        _positive(f"{where}: layer_overhead_s", self.layer_overhead_s, allow_zero=True)
        _positive(f"{where}: call_overhead_s", self.call_overhead_s, allow_zero=True)
        _positive(f"{where}: optimizer_leaf_overhead_s", self.optimizer_leaf_overhead_s, allow_zero=True)
        _positive(f"{where}: sync_overhead_s", self.sync_overhead_s, allow_zero=True)
        _positive(f"{where}: reserved_bytes", self.reserved_bytes, allow_zero=True)
        _positive(f"{where}: comm_temporaries", self.comm_temporaries, allow_zero=True)
        for fit, r in self.fit_residuals.items():
            _positive(f"{where}: fit_residuals[{fit!r}]", r, allow_zero=True)
        if not all(isinstance(u, str) for u in self.uncertain):
            raise DescriptionError(f"{where}: uncertain must list figure names (strings), got {list(self.uncertain)!r}")
        for f in ("cores_per_node", "calibrated_ranks"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise DescriptionError(f"{where}: {f} must be an int >= 0, got {v!r}")

    # -- rates ------------------------------------------------------------------------------

    def flops_rate(self, dtype: str, ranks_per_node: int | None = None) -> float:
        """Sustained FLOP/s of matrix products in ``dtype`` on one rank.

        Raises:
          DescriptionError: the machine has no figure for ``dtype`` (the known ones are named).
        """
        if dtype not in self.flops:
            raise DescriptionError(
                f"machine {self.name!r}: no flops figure for dtype {dtype!r}; flops has {sorted(self.flops)}"
            )
        return self.flops[dtype] * self.matmul_efficiency * self.share(ranks_per_node)

    def bytes_rate(self, ranks_per_node: int | None = None) -> float:
        """Bytes per second memory-bound kernels move on one rank."""
        return self.mem_bandwidth * self.mem_efficiency * self.share(ranks_per_node)

    def optimizer_bytes_rate(self, ranks_per_node: int | None = None) -> float:
        """Bytes per second the optimizer step's kernels move on one rank."""
        return self.bytes_rate(ranks_per_node) * self.optimizer_mem_efficiency

    def overhead(self, ranks_per_node: int | None = None) -> float:
        """Seconds of fixed cost per kernel on one rank."""
        return self.op_overhead_s / self.share(ranks_per_node)

    def layer_overhead(self, ranks_per_node: int | None = None) -> float:
        """Seconds of fixed host cost per layer forward or backward call on one rank."""
        return self.layer_overhead_s / self.share(ranks_per_node)

    def call_overhead(self, ranks_per_node: int | None = None) -> float:
        """Seconds of fixed host cost per call of a flat step's body on one rank."""
        return self.call_overhead_s / self.share(ranks_per_node)

    def optimizer_leaf_overhead(self, ranks_per_node: int | None = None) -> float:
        """Seconds of the optimizer's host time per parameter leaf on one rank."""
        return self.optimizer_leaf_overhead_s / self.share(ranks_per_node)

    def sync_overhead(self, ranks_per_node: int | None = None) -> float:
        """Seconds a blocking collective call costs beyond its link time on one rank: the
        calibrated figure while a node's ranks outnumber its cores, if they did at
        calibration (else it timed nothing of the kind), or on a device; else zero."""
        if self.cores_per_node and ranks_per_node and ranks_per_node <= self.cores_per_node:
            return 0.0
        if self.cores_per_node and self.calibrated_ranks and self.calibrated_ranks <= self.cores_per_node:
            return 0.0
        return self.sync_overhead_s

    def share(self, ranks_per_node: float | None) -> float:
        """CPU machines: this rank's share of the speed timed at calibration (one on GPUs),
        when ``ranks_per_node`` ranks compute at once (a mean, so not always a whole number:
        a pipeline's ranks idle in its bubble)."""
        if not self.cores_per_node or not ranks_per_node:
            return 1.0
        cal = self.calibrated_ranks or self.cores_per_node

        def one(n: float) -> float:
            return min(1.0, self.cores_per_node / n)

        return one(ranks_per_node) / one(cal)

    # -- links ------------------------------------------------------------------------------

    def level(self, stride: int, size: int) -> str:
        """``"intra"`` when a mesh axis of ``size`` ranks ``stride`` apart stays in one node."""
        return "intra" if stride * size <= self.devices_per_node else "inter"

    def link(self, kind: str, level: str) -> Link:
        """The (latency, bandwidth) for collective ``kind`` at ``level``."""
        measured = self.collectives.get(kind, {})
        return measured[level] if level in measured else self.links[level]

    def to_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self, recurse=True)
        d["sources"] = list(self.sources)
        d["uncertain"] = list(self.uncertain)
        return d


def machine_from_dict(data: Mapping[str, Any], *, where: str = "machine") -> Machine:
    """A :class:`Machine` from plain data (JSON), naming the first bad or missing field.

    Raises:
      DescriptionError: a missing, unknown or invalid field.
    """
    if not isinstance(data, Mapping):
        raise DescriptionError(f"{where}: must be a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in attrs.fields(Machine)}
    name = data.get("name", "?")
    where = f"{where} {name!r}"
    for key in data:
        if key not in fields:
            raise DescriptionError(f"{where}: unknown field {key!r}; fields are {sorted(fields)}")
    for key, f in fields.items():
        if f.default is attrs.NOTHING and key not in data:
            raise DescriptionError(f"{where}: missing field {key!r}")

    def link(path: str, value: Any) -> Link:
        if not isinstance(value, Mapping) or set(value) != {"bandwidth", "latency"}:
            raise DescriptionError(f"{where}: {path} must be {{'bandwidth': bytes/s, 'latency': s}}, got {value!r}")
        return Link(value["bandwidth"], value["latency"])

    kw = dict(data)
    if not isinstance(kw["links"], Mapping):
        raise DescriptionError(f"{where}: links must be a mapping of level -> link, got {kw['links']!r}")
    kw["links"] = {level: link(f"links[{level!r}]", v) for level, v in kw["links"].items()}
    colls = kw.get("collectives", {})
    if not isinstance(colls, Mapping):
        raise DescriptionError(f"{where}: collectives must be a mapping, got {colls!r}")
    kw["collectives"] = {
        kind: {level: link(f"collectives[{kind!r}][{level!r}]", v) for level, v in levels.items()}
        for kind, levels in colls.items()
    }
    if not isinstance(kw["flops"], Mapping):
        raise DescriptionError(f"{where}: flops must be a mapping of dtype -> FLOP/s, got {kw['flops']!r}")
    return Machine(**kw)


def load_machine(path: str | os.PathLike) -> Machine:
    """Reads a machine file (JSON).

    Raises:
      DescriptionError: the file is not valid JSON or not a valid machine (the field is named).
      FileNotFoundError: no such file.
    """
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DescriptionError(f"machine file {path}: not valid JSON: {e}") from None
    return machine_from_dict(data, where=f"machine file {path}:")


def save_machine(machine: Machine, path: str | os.PathLike) -> None:
    """Writes ``machine`` as JSON (atomically)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f"{path.suffix}.{os.getpid()}.tmp")  # concurrent writers do not share it
    tmp.write_text(json.dumps(machine.to_dict(), indent=1) + "\n")
    os.replace(tmp, path)


MACHINES: tuple[str, ...] = tuple(sorted(p.stem for p in _DIR.glob("*.json")))


def default_machine_path() -> Path:
    """Where :func:`fshard.plan.calibrate` saves this host's machine file by default
    (``$FSHARD_MACHINE``, else ``~/.cache/fshard/machine-<host>.json``)."""
    env = os.environ.get("FSHARD_MACHINE")
    if env:
        return Path(env)
    import socket

    return Path.home() / ".cache" / "fshard" / f"machine-{socket.gethostname()}.json"


def get_machine(name: str | os.PathLike) -> Machine:
    """A shipped machine (:data:`MACHINES`, e.g. ``"h100"``) or a machine file path.

    Raises:
      DescriptionError: neither a shipped name nor an existing file (the names are listed).
    """
    p = _DIR / f"{str(name).lower()}.json"
    if p.exists():
        return load_machine(p)
    if Path(name).exists():
        return load_machine(name)
    raise DescriptionError(f"unknown machine {str(name)!r}: not one of {', '.join(MACHINES)} and not a file")
