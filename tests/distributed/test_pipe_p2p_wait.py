"""How a pipeline receive waits (runtime/pipe/p2p.py), on 2 real ranks: the sender sleeps before its
second send; the receiver times its recv() call, then checks the data.

Over NCCL (DSC_TEST_BACKEND=nccl) a receive only orders the CUDA streams: recv() returns while the sender is
still asleep (the host goes on queueing kernels; a host-side wait cost ~8% of a 4-stage 1F1B step on H100s),
and the data is right once the stream has it. With DSC_PIPE_RECV_TIMEOUT set, and always over gloo, the
host waits for the data (the receive can then time out naming the stage: test_pipe_parity's shape-change
case)."""
from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from tests.harness import backend_choice, rank_device, run_distributed

SLEEP = 2.0


def body(rank: int, world: int, env_timeout: bool) -> dict[str, Any]:
    import torch.distributed as dist

    from deepspeed_c.runtime.pipe.p2p import PipeLink

    if env_timeout:
        os.environ["DSC_PIPE_RECV_TIMEOUT"] = "60"
    dev = rank_device()
    peer = 1 - rank
    link = PipeLink(peer, peer, rank, "activations", dev, dynamic_shape=False)
    first = torch.arange(12, dtype=torch.float32, device=dev).view(3, 4)
    second = first * -2.5 + 1.0
    out: dict[str, Any] = {"stream_ordered": link.stream_ordered}
    if rank == 0:
        link.send(first)  # the handshake and a first payload
        link.wait_sends()
        dist.barrier()
        time.sleep(SLEEP)
        link.send(second)
        link.wait_sends()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    else:
        (got_first,) = link.recv()
        out["first_ok"] = torch.equal(got_first, first)
        dist.barrier()
        t0 = time.perf_counter()
        (got,) = link.recv()
        out["recv_s"] = time.perf_counter() - t0
        out["second_ok"] = torch.equal(got, second)  # reads the tensor: waits for the stream
    dist.barrier()
    return out


@pytest.mark.parametrize("env_timeout", [False, True], ids=["default", "DSC_PIPE_RECV_TIMEOUT"])
def test_receive_orders_streams_over_nccl_and_waits_on_the_host_otherwise(env_timeout: bool) -> None:
    res = run_distributed(body, 2, (env_timeout,), timeout=120)
    recv = res[1]
    assert recv["first_ok"] and recv["second_ok"], recv
    host_waits = env_timeout or backend_choice() != "nccl"
    assert recv["stream_ordered"] is (not host_waits), recv
    if host_waits:
        assert recv["recv_s"] > SLEEP * 0.7, recv  # the host waited for the sender's data
    else:
        assert recv["recv_s"] < SLEEP * 0.5, recv  # returned while the sender slept
