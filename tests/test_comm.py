"""fshard.comm's choice of transport: which transfers go through host memory."""

import pytest
import torch
import torch.distributed as dist

from fshard import comm
from fshard.testing import run_on_ranks


def _staging(device_types):
    group = dist.group.WORLD
    return comm.backend_of(group, "cpu"), [comm.p2p_via_host(group, torch.device(d)) for d in device_types]


def test_gloo_point_to_point_of_cuda_tensors_goes_through_the_host():
    # gloo's send/recv read the data pointer as host memory: a CUDA tensor must be staged.
    # torch.device("cuda") needs no GPU, so the decision is checked here; the transfer
    # itself runs in bench/gpu_checks (several ranks on one GPU through gloo).
    (result,) = run_on_ranks(_staging, ["cpu", "cuda", "cuda:0"], world_size=1)
    assert result == ("gloo", [False, True, True])


@pytest.mark.parametrize("name, device, backend, via_host", [
    ("cpu:gloo,cuda:nccl", "cuda", "nccl", False),
    ("cpu:gloo,cuda:nccl", "cpu", "gloo", False),
    ("cpu:gloo,cuda:gloo", "cuda", "gloo", True),
    ("nccl", "cuda", "nccl", False),
])
def test_backend_per_device_type(monkeypatch, name, device, backend, via_host):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: name)
    assert comm.backend_of(object(), torch.device(device).type) == backend
    assert comm.p2p_via_host(object(), torch.device(device)) is via_host
