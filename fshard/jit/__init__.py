"""``fs.jit``: the whole per-device step (forward, gradient, optimizer, collectives) as one
captured graph, compiled by Inductor or any ``torch.compile`` backend (``docs/jit.md``).

Modules: :mod:`~fshard.jit.api` (``jit`` and ``Jitted``: a call's trace, cache and run),
:mod:`~fshard.jit.capture` (signatures, the capture error), :mod:`~fshard.jit.compile` (the
compiled region), :mod:`~fshard.jit.donation` (donation's contract and the live aliases of
donated buffers), :mod:`~fshard.jit.recompile`
(the recompile limit and its messages), :mod:`~fshard.jit.p2p` (regions between
point-to-point transfers), :mod:`~fshard.jit.passes` (Inductor graph passes: ``bucket``,
``overlap``, ``memory``) and :mod:`~fshard.jit.fx` (the fx helpers they share).
"""

from fshard.jit.api import DonatedTensorError as DonatedTensorError
from fshard.jit.api import JitCaptureError as JitCaptureError
from fshard.jit.api import JitRecompileLimitError as JitRecompileLimitError
from fshard.jit.api import JitRecompileWarning as JitRecompileWarning
from fshard.jit.api import Jitted as Jitted
from fshard.jit.api import jit as jit

__all__ = ["DonatedTensorError", "JitCaptureError", "JitRecompileLimitError", "JitRecompileWarning", "Jitted", "jit"]
