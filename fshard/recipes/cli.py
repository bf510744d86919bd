"""The command line that training scripts share: config files, threads, checkpoints, logs, output.

A script builds its own ``argparse.ArgumentParser`` with its model and layout flags, calls
:func:`add_common_flags` for the rest, and parses with :func:`parse`:

- ``--config FILE.toml`` sets any flag (flags on the command line override the file);
  ``--print-config`` prints the resolved settings as TOML and exits, so that a run's
  settings can be saved and replayed.
- ``--threads N``: torch's intra-op threads. Without it, and without ``OMP_NUM_THREADS``,
  one thread per rank: torch's default (one per core) makes the ranks of a job, or the
  threads of one process on a shared machine, fight for the cores (README: the main
  command's time). ``fs.run_local``, ``fs.simulate`` and torchrun already use one.
- The checkpoint flags: ``--checkpoint-dir``, ``--resume [auto]``, ``--overwrite``, ...
  (:func:`checkpoint_config`).
- The logging flags: ``--log-json``, ``--log-every``, ``--quiet``, ``--tensorboard``,
  ``--plot``, ``--val-every``, ``--val-batches`` (``fs.recipes.sinks.Logs.from_flags``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any, Callable, Sequence

from fshard.parallel.layout import LayoutError, parse_mesh
from fshard.recipes.trainer import CheckpointConfig, ConfigError, _quiet

__all__ = ["HelpFormatter", "add_common_flags", "checkpoint_config", "parse", "printer", "set_threads"]


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` with each flag's default said once: appended as ``(default: X)`` unless the
    help text already names its default (``(default`` or ``default:``), or there is none to
    name (None, False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        named = "(default" in text or "default:" in text
        if named or action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def add_common_flags(p: argparse.ArgumentParser) -> None:
    """Adds the shared flags to ``p``, in groups "run", "checkpoints" and "logging"."""
    run = p.add_argument_group("run")
    run.add_argument(
        "--config",
        default=None,
        metavar="FILE.toml",
        help="read settings from a TOML file (keys: the flags' names, e.g. batch-size = 32, at "
        "the top or in tables named after the groups); flags given here override it",
    )
    run.add_argument("--print-config", action="store_true", help="print the resolved settings as TOML and exit")
    run.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="torch intra-op threads per process (default: $OMP_NUM_THREADS if set, else 1)",
    )
    run.add_argument(
        "--all-ranks",
        action="store_true",
        help="every rank prints, its lines prefixed with its rank (default: rank 0 only)",
    )
    ck = p.add_argument_group("checkpoints")
    ck.add_argument("--checkpoint-dir", default=None, help="save params, optimizer state and step here")
    ck.add_argument("--checkpoint-every", type=int, default=0, help="also save every N steps (0: at the end only)")
    ck.add_argument(
        "--async-checkpoint",
        action="store_true",
        help="write the --checkpoint-every checkpoints in "
        "the background (the last one is complete before the script exits)",
    )
    ck.add_argument(
        "--resume",
        nargs="?",
        const="yes",
        default=None,
        choices=["yes", "auto"],
        help="continue from --checkpoint-dir (an error if it holds none); --resume auto: continue "
        "if it holds one, else start from step 0",
    )
    ck.add_argument(
        "--overwrite",
        action="store_true",
        help="start from step 0 and replace the checkpoint in "
        "--checkpoint-dir (without it, or --resume, an existing checkpoint is an error)",
    )
    ck.add_argument(
        "--stop-at",
        type=int,
        default=None,
        metavar="STEP",
        help="end this run after STEP (saving a checkpoint), as a preempted job would; --resume goes on to --steps",
    )
    _add_logging_flags(p)


class _TooSmall(argparse.ArgumentTypeError, ValueError):
    """argparse shows its message as it is; a config file's check (ValueError) too."""


def _at_least(minimum: int) -> Any:
    def parse_int(text: str) -> int:
        n = int(text)
        if n < minimum:
            raise _TooSmall(f"{n}: must be >= {minimum}")
        return n

    parse_int.__name__ = "int"  # argparse's "invalid int value" for a non-number
    return parse_int


def _add_logging_flags(p: argparse.ArgumentParser) -> None:
    """The "logging" group: where the per-step records go, how often a line is printed,
    and validation (the records' ``val_loss``)."""
    log = p.add_argument_group("logging")
    log.add_argument(
        "--log-json",
        default=None,
        metavar="PATH",
        help="write the records as JSON lines (one per step, then a summary), each as soon as it is made: a run "
        "killed at any point leaves every record up to the last step",
    )
    log.add_argument(
        "--log-every",
        type=_at_least(1),
        default=25,
        metavar="N",
        help="print a progress line every N steps (with a tqdm bar too when stderr is a terminal)",
    )
    log.add_argument("--quiet", action="store_true", help="no progress output and no sample")
    log.add_argument(
        "--tensorboard",
        default=None,
        metavar="DIR",
        help="write the records' numbers as TensorBoard scalars to DIR (needs: pip install tensorboard)",
    )
    log.add_argument(
        "--plot",
        default=None,
        metavar="PATH.png",
        help="draw the loss and validation curves into PATH.png at the end (needs matplotlib)",
    )
    log.add_argument(
        "--val-every",
        type=_at_least(0),
        default=0,
        metavar="N",
        help="validation loss on the held-out split every N steps and at the end (0: none)",
    )
    log.add_argument(
        "--val-batches",
        type=_at_least(1),
        default=1,
        metavar="N",
        help="held-out batches each validation averages over (the same ones every time)",
    )


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parses ``argv`` with ``p``, after the ``--config`` file's values (flags win).

    Checks the shared flags' combinations, sets the threads (:func:`set_threads`), and with
    ``--print-config`` prints the settings and exits. Errors are argparse's (exit code 2),
    naming the flag or the file's key.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config:
        p.set_defaults(**_read_config(p, known.config))
    args = p.parse_args(argv)
    for need, flag in (
        (args.checkpoint_every, "--checkpoint-every"),
        (args.resume, "--resume"),
        (args.overwrite, "--overwrite"),
        (args.async_checkpoint, "--async-checkpoint"),
    ):
        if need and not args.checkpoint_dir:
            p.error(f"{flag} needs --checkpoint-dir")
    if args.resume and args.overwrite:
        p.error("--resume and --overwrite: give one (--resume continues the checkpoint, --overwrite replaces it)")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads {args.threads}: must be >= 1")
    if args.print_config:
        print(config_toml(p, args), end="")
        sys.exit(0)
    set_threads(args.threads)
    return args


def mesh_flag(text: str | None, world_size: int, axes: Sequence[str], script: str) -> dict[str, int]:
    """``--mesh``: ``"dp=2,fsdp=2"`` -> ``{"dp": 2, "fsdp": 2}`` in ``axes``' order (None: every
    rank on fsdp).

    Raises:
      ConfigError: bad syntax, an axis not in ``axes`` or given twice, or sizes whose product
        is not ``world_size`` (naming the torchrun command that launches ``script`` on that many).
    """
    if not text:
        return {"fsdp": world_size}
    try:
        shape = parse_mesh(text, axes)
    except LayoutError as e:
        raise ConfigError(f"--mesh {e}") from None
    n = math.prod(shape.values())
    if n != world_size:
        raise ConfigError(
            f"--mesh {text}: the sizes multiply to {n}, but {world_size} rank(s) run this; "
            f"launch {n} with `torchrun --nproc-per-node {n} {script} --mesh {text}`"
        )
    return shape


def checkpoint_config(args: argparse.Namespace, hint: str) -> CheckpointConfig:
    """The checkpoint flags as a ``CheckpointConfig`` (``hint``: what to give for another model)."""
    modes: dict[str | None, bool | str] = {None: False, "yes": True, "auto": "auto"}
    resume = modes[args.resume]
    return CheckpointConfig(
        args.checkpoint_dir, args.checkpoint_every, args.async_checkpoint, resume, hint, overwrite=args.overwrite
    )


def printer(args: argparse.Namespace) -> Callable[..., None]:
    """Where a script's messages go: ``print`` on rank 0; with ``--all-ranks`` on every rank,
    each line prefixed ``[rank R]``; with ``--quiet``, nowhere. Call it after the process
    group started (``fs.init`` / ``fs.runtime.started``)."""
    import torch.distributed as dist

    from fshard.runtime.process import is_rank0
    from fshard.runtime.simulation import active

    if getattr(args, "quiet", False):
        return _quiet
    if getattr(args, "all_ranks", False) and dist.is_initialized() and active() is None:
        prefix = f"[rank {dist.get_rank()}] "

        def say(*parts: Any, **kw: Any) -> None:
            text = " ".join(map(str, parts))
            print("\n".join(prefix + line for line in text.splitlines() or [""]), flush=True, **kw)

        return say
    return print if is_rank0() else _quiet


def set_threads(n: int | None) -> int:
    """Sets torch's intra-op threads: ``n``, else ``$OMP_NUM_THREADS``, else 1; returns the number."""
    import torch

    if n is None:
        env = os.environ.get("OMP_NUM_THREADS", "")
        n = int(env) if env.isdigit() and int(env) > 0 else 1
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


# Flags that describe the invocation, not the run: never read from or written to a config file.
_NOT_SETTINGS = {"config", "print_config", "help"}


def _settings(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in p._actions if a.dest not in _NOT_SETTINGS and a.option_strings}


def _read_config(p: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        p.error(f"--config {path}: reading TOML needs Python 3.11 or later")
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as e:
        p.error(f"--config {path}: {e.strerror}")
    except tomllib.TOMLDecodeError as e:
        p.error(f"--config {path}: not valid TOML: {e}")
    flat: dict[str, Any] = {}
    for key, value in doc.items():  # tables (a group's title, any name) hold flags too
        for k, v in value.items() if isinstance(value, dict) else [(key, value)]:
            flat[k] = v
    actions, values = _settings(p), {}
    for key, value in flat.items():
        dest = key.replace("-", "_")
        if dest not in actions:
            known = ", ".join(sorted(d.replace("_", "-") for d in actions))
            p.error(f"--config {path}: no flag --{key.replace('_', '-')}; the settings are: {known}")
        values[dest] = _checked(p, path, key, actions[dest], value)
    return values


def _checked(p: argparse.ArgumentParser, path: str, key: str, action: argparse.Action, value: Any) -> Any:
    """A file value as the flag would have parsed it: the flag's type and choices, or an error."""
    flag = f"--config {path}: {key} = {value!r}"
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            p.error(f"{flag}: must be true or false")
        return value
    if isinstance(value, (dict, list)) or isinstance(value, bool) and action.type is not None:
        p.error(f"{flag}: must be a single {getattr(action.type, '__name__', 'value')}")
    try:
        value = action.type(value) if callable(action.type) and value is not None else value
    except (TypeError, ValueError) as e:
        p.error(f"{flag}: {e}")
    if action.choices is not None and value not in action.choices:
        p.error(f"{flag}: must be one of {', '.join(map(str, action.choices))}")
    return value


def config_toml(p: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The settings of ``args`` as TOML, one table per argument group; unset (None) flags are
    written as comments, since TOML has no null."""
    out = []
    for group in p._action_groups:
        rows = [a for a in group._group_actions if a.dest in _settings(p)]
        if not rows:
            continue
        out.append(f"[{_table(group.title or 'options')}]")
        for a in rows:
            key, value = a.dest.replace("_", "-"), getattr(args, a.dest)
            out.append(f"# {key} =  (not set)" if value is None else f"{key} = {_toml_value(value)}")
        out.append("")
    return "\n".join(out)


def _table(title: str) -> str:
    return title if title.replace("_", "").replace("-", "").isalnum() else '"' + title.replace('"', "'") + '"'


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    s = str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{s}"'
