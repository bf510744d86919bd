"""Checkpoints of sharded pytrees through torch.distributed.checkpoint (DCP).

::

    fs.checkpoint.save(path, {"params": params, "opt": opt_state, "step": step,
                              "rng": torch.get_rng_state(), "data": {"epoch": 0, "index": 96}})
    restored = fs.checkpoint.load(path, like=template)   # template may live on another mesh

A checkpoint is a DCP directory: each rank writes the shards it holds, keyed by the
leaf's pytree path (``params.layers.3.wq``), so a pipeline stage's layers keep their
global indices and any other layout can read them back. ``load`` takes the layout from
the template: DTensors on any mesh and world size, plain tensors for full values.

Failure semantics: a save goes to a temporary directory next to ``path`` that is
renamed to ``path`` only when every rank has finished and every file it lists is
checked present and whole, so a crash during a save leaves the previous checkpoint
loadable. One save at a time per path: rank 0 holds a lock file next to it
(``.<name>.lock``) for the whole save, so a second job saving to the same path is
refused (:class:`CheckpointLockedError`, naming the holder) instead of deleting the
first one's files; a dead holder's lock is taken over. Every rank must pass the same
path (checked). ``fs.shutdown()`` waits for background saves (bounded by the groups'
timeout), and a background save that failed unwaited makes the process exit 1. ``load``
checks the checkpoint and template before reading, and a missing, partial or corrupt checkpoint, missing keys or a
shape mismatch raise on every rank with the path and keys in the message.

``save(..., blocking=False)`` copies the tensors to CPU memory and writes on a
background thread (``handle.wait()`` or :func:`wait`). ``torch.distributed.checkpoint
.async_save`` works on gloo too (checked), but the commit, a barrier and a rename,
has to follow its upload; so fshard runs staging, ``dcp.save`` and the commit itself
on one worker thread, which is what ``async_save`` does with its thread executor, with
all of it on a private gloo group so it never interleaves with training collectives.

Interop: :func:`export_state_dict` / :func:`import_state_dict` convert to and from a
plain ``{module name: full tensor}`` dict, and :func:`to_torch_save` turns a
checkpoint into a ``torch.save`` file named like the ``nn.Module``. :func:`load_hf` /
:func:`save_hf` read and write a model's own Hugging Face safetensors checkpoints (each
rank reads only its slices).
"""

from fshard.checkpoint._common import CheckpointError as CheckpointError
from fshard.checkpoint._common import CheckpointLockedError as CheckpointLockedError
from fshard.checkpoint._common import CheckpointMismatchError as CheckpointMismatchError
from fshard.checkpoint._common import CheckpointNotFoundError as CheckpointNotFoundError
from fshard.checkpoint._hf import load_hf as load_hf
from fshard.checkpoint._hf import save_hf as save_hf
from fshard.checkpoint._interop import (
    export_state_dict as export_state_dict,
)
from fshard.checkpoint._interop import (
    import_state_dict as import_state_dict,
)
from fshard.checkpoint._interop import (
    to_torch_save as to_torch_save,
)
from fshard.checkpoint._load import load as load
from fshard.checkpoint._load import read_metadata as read_metadata
from fshard.checkpoint._save import PendingSave as PendingSave
from fshard.checkpoint._save import save as save
from fshard.checkpoint._save import wait as wait

__all__ = [
    "CheckpointError",
    "CheckpointLockedError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "PendingSave",
    "export_state_dict",
    "import_state_dict",
    "load",
    "load_hf",
    "read_metadata",
    "save",
    "save_hf",
    "to_torch_save",
    "wait",
]
