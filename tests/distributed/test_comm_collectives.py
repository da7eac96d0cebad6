"""deepspeed_c.comm collectives on 2 and 4 real gloo ranks, values checked against float64 sums
worked out here; then the same checks with every fallback forced (the native ops booby-trapped so
a silent native call fails), and a simulated backend refusal that must switch to the fallback."""
from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed


def _eq(got, want, what):
    import torch

    assert torch.equal(got, want), f"{what}: got {got.tolist()}, want {want.tolist()}"


def _device():
    import torch

    import deepspeed_c.comm as dc

    return torch.device("cuda", torch.cuda.current_device()) if dc.get_backend() == "nccl" else torch.device("cpu")


def _check_all(rank: int, w: int) -> None:
    import torch
    import torch.distributed as dist

    import deepspeed_c.comm as dc

    dev = _device()
    f64 = dict(dtype=torch.float64, device=dev)
    tri = w * (w - 1) / 2  # sum of ranks

    t = torch.full((3, ), float(rank), **f64)
    dc.broadcast(t, src=w - 1)
    _eq(t, torch.full((3, ), float(w - 1), **f64), "broadcast")

    t = torch.arange(5, **f64) + rank
    dc.all_reduce(t)
    _eq(t, torch.arange(5, **f64) * w + tri, "all_reduce sum")

    t = torch.full((4, ), rank + 1.0, **f64)
    dc.all_reduce(t, op=dc.ReduceOp.AVG)
    _eq(t, torch.full((4, ), (w + 1) / 2, **f64), "all_reduce avg")

    t = torch.tensor([float(rank), -float(rank)], **f64)
    dc.all_reduce(t, op=dist.ReduceOp.MAX)  # torch's ReduceOp is accepted too
    _eq(t, torch.tensor([w - 1.0, 0.0], **f64), "all_reduce max")

    t = torch.full((2, ), rank + 1.0, **f64)
    work = dc.all_reduce(t, async_op=True)
    work.wait()
    _eq(t, torch.full((2, ), w * (w + 1) / 2, **f64), "async all_reduce")

    t = torch.full((2, ), rank + 1.0, **f64)
    dc.reduce(t, dst=0)
    if rank == 0:
        _eq(t, torch.full((2, ), w * (w + 1) / 2, **f64), "reduce")
    t = torch.full((2, ), rank + 1.0, **f64)
    dc.reduce(t, dst=w - 1, op=dc.ReduceOp.AVG)
    if rank == w - 1:
        _eq(t, torch.full((2, ), (w + 1) / 2, **f64), "reduce avg")

    outs = [torch.zeros(2, **f64) for _ in range(w)]
    dc.all_gather(outs, torch.full((2, ), float(rank), **f64))
    for k, o in enumerate(outs):
        _eq(o, torch.full((2, ), float(k), **f64), "all_gather")

    inp = torch.full((2, 3), float(rank), **f64)
    want = torch.cat([torch.full((2, 3), float(k), **f64) for k in range(w)])
    out = torch.zeros(2 * w, 3, **f64)
    dc.all_gather_into_tensor(out, inp)
    _eq(out, want, "all_gather_into_tensor (concatenated)")
    out = torch.zeros(w, 2, 3, **f64)
    dc.all_gather_into_tensor(out, inp)
    _eq(out.view(2 * w, 3), want, "all_gather_into_tensor (stacked)")
    flat_in = inp.view(-1)  # flat tensors: the prebuilt call where it may serve (comm/direct.py)
    out = torch.zeros(6 * w, **f64)
    dc.all_gather_into_tensor(out, flat_in, async_op=True).wait()
    _eq(out, want.view(-1), "all_gather_into_tensor (flat, async)")
    outs = [torch.full((6 * w, ), float("nan"), **f64), torch.full((w, ), float("nan"), **f64)]
    dc.all_gather_coalesced(outs, [flat_in, torch.full((1, ), rank + 0.5, **f64)], async_op=True).wait()
    _eq(outs[0], want.view(-1), "all_gather_coalesced[0]")
    _eq(outs[1], torch.arange(w, **f64) + 0.5, "all_gather_coalesced[1]")
    outs = [torch.zeros(w, 2, 3, **f64), torch.zeros(w, **f64)]  # a stacked output: pair by pair
    assert dc.all_gather_coalesced(outs, [inp, torch.full((1, ), rank + 0.5, **f64)]) is None
    _eq(outs[0].view(2 * w, 3), want, "all_gather_coalesced (stacked)")
    _eq(outs[1], torch.arange(w, **f64) + 0.5, "all_gather_coalesced (stacked) [1]")
    outs = [torch.zeros(6 * w, **f64), torch.zeros(w, **f64)]  # a 0-d input among flat ones: pair by pair
    dc.all_gather_coalesced(outs, [flat_in, torch.tensor(rank + 0.5, **f64)], async_op=True).wait()
    _eq(outs[0], want.view(-1), "all_gather_coalesced (0-d) [0]")
    _eq(outs[1], torch.arange(w, **f64) + 0.5, "all_gather_coalesced (0-d) [1]")
    out = torch.zeros(2 * w, 3, **f64)
    dc.allgather_fn(out, inp)
    _eq(out, want, "allgather_fn")

    n = 4
    inp = torch.arange(w * n, **f64) * (rank + 1)
    keep = inp.clone()
    full_sum = torch.arange(w * n, **f64) * (w * (w + 1) / 2)
    out = torch.zeros(n, **f64)
    dc.reduce_scatter_tensor(out, inp)
    _eq(out, full_sum[rank * n:(rank + 1) * n], "reduce_scatter_tensor")
    _eq(inp, keep, "reduce_scatter_tensor leaves its input alone")
    out = torch.zeros(n, **f64)
    dc.reduce_scatter_tensor(out, inp, op=dc.ReduceOp.AVG)
    _eq(out, full_sum[rank * n:(rank + 1) * n] / w, "reduce_scatter_tensor avg")
    out = torch.zeros(n, **f64)
    dc.reduce_scatter_fn(out, inp)
    _eq(out, full_sum[rank * n:(rank + 1) * n], "reduce_scatter_fn")

    out = torch.zeros(3, **f64)
    dc.reduce_scatter(out, [torch.full((3, ), rank * 10.0 + j, **f64) for j in range(w)])
    _eq(out, torch.full((3, ), 10 * tri + w * rank, **f64), "reduce_scatter")

    inp = torch.arange(w * 2, **f64) + 100 * rank
    out = torch.zeros(w * 2, **f64)
    dc.all_to_all_single(out, inp)
    want = torch.cat([torch.arange(rank * 2, rank * 2 + 2, **f64) + 100 * j for j in range(w)])
    _eq(out, want, "all_to_all_single")
    # uneven: rank r sends j+1 values to rank j and so receives r+1 from everyone
    inp = torch.cat([torch.full((j + 1, ), 100.0 * rank + j, **f64) for j in range(w)])
    out = torch.zeros(w * (rank + 1), **f64)
    dc.all_to_all_single(out, inp, output_split_sizes=[rank + 1] * w, input_split_sizes=[j + 1 for j in range(w)])
    _eq(out, torch.cat([torch.full((rank + 1, ), 100.0 * j + rank, **f64) for j in range(w)]), "all_to_all_single v")

    outs = [torch.zeros(2, **f64) for _ in range(w)]
    dc.all_to_all(outs, [torch.full((2, ), 10.0 * rank + j, **f64) for j in range(w)])
    for j, o in enumerate(outs):
        _eq(o, torch.full((2, ), 10.0 * j + rank, **f64), "all_to_all")

    ts = [torch.full((2, 2), rank + 1.0, **f64), torch.full((3, ), 2 * rank, dtype=torch.int32, device=dev),
          torch.full((3, ), 2.0 * rank, **f64)]
    dc.all_reduce_coalesced(ts)
    _eq(ts[0], torch.full((2, 2), w * (w + 1) / 2, **f64), "all_reduce_coalesced[0]")
    _eq(ts[1], torch.full((3, ), int(2 * tri), dtype=torch.int32, device=dev), "all_reduce_coalesced[1] (int32)")
    _eq(ts[2], torch.full((3, ), 2 * tri, **f64), "all_reduce_coalesced[2]")

    t = torch.full((2, ), rank + 1.0, **f64)
    dc.inference_all_reduce(t)
    _eq(t, torch.full((2, ), w * (w + 1) / 2, **f64), "inference_all_reduce")


def _check_p2p_groups_objects(rank: int, w: int) -> None:
    import torch

    import deepspeed_c.comm as dc

    f64 = dict(dtype=torch.float64, device=_device())
    nxt, prv = (rank + 1) % w, (rank - 1) % w
    buf = torch.zeros(4, **f64)
    # NCCL runs a rank's point-to-point ops to one peer in order on one stream, and a send waits for its
    # receive: at 2 ranks (next == previous) "send then receive" on both ranks deadlocks, so odd ranks
    # receive first (gloo does not care)
    send = lambda: dc.isend(torch.full((4, ), float(rank), **f64), nxt)  # noqa: E731
    recv = lambda: dc.irecv(buf, prv)  # noqa: E731
    reqs = [send(), recv()] if rank % 2 == 0 else [recv(), send()]
    for r in reqs:
        r.wait()
    _eq(buf, torch.full((4, ), float(prv), **f64), "isend/irecv ring")

    pair = rank ^ 1  # 0<->1, 2<->3
    got = torch.zeros(2, **f64)
    if rank % 2 == 0:
        dc.send(torch.full((2, ), rank + 0.5, **f64), pair)
        dc.recv(got, pair)
    else:
        dc.recv(got, pair)
        dc.send(torch.full((2, ), rank + 0.5, **f64), pair)
    _eq(got, torch.full((2, ), pair + 0.5, **f64), "send/recv")

    members = list(range(1, w, 2))  # the odd ranks: [1] or [1, 3]
    g = dc.new_group(members)  # every rank must call new_group
    if rank in members:
        assert dc.get_all_ranks_from_group(g) == members
        assert dc.get_global_rank(g, len(members) - 1) == members[-1]
        assert dc.get_rank(g) == members.index(rank) and dc.get_world_size(g) == len(members)
        t = torch.full((1, ), float(rank), **f64)
        dc.all_reduce(t, group=g)
        _eq(t, torch.full((1, ), float(sum(members)), **f64), "all_reduce on a subgroup")
    assert dc.get_all_ranks_from_group() == list(range(w))
    assert dc.get_global_rank(None, w - 1) == w - 1

    if rank == 0:
        gathered = [torch.zeros(1, **f64) for _ in range(w)]
        dc.gather(torch.full((1, ), rank * 3.0, **f64), gathered, dst=0)
        assert [x.item() for x in gathered] == [3.0 * k for k in range(w)]
        got = torch.zeros(1, **f64)
        dc.scatter(got, [torch.full((1, ), 7.0 + k, **f64) for k in range(w)], src=0)
    else:
        dc.gather(torch.full((1, ), rank * 3.0, **f64), None, dst=0)
        got = torch.zeros(1, **f64)
        dc.scatter(got, None, src=0)
    assert got.item() == 7.0 + rank

    objs = [{"from": rank}] if rank == 0 else [None]
    dc.broadcast_object_list(objs, src=0)
    assert objs == [{"from": 0}]
    everyone = [None] * w
    dc.all_gather_object(everyone, ("r", rank))
    assert everyone == [("r", k) for k in range(w)]
    dc.barrier()
    if dc.get_backend() == "gloo":  # torch implements monitored_barrier for gloo only
        dc.monitored_barrier()


def _check_direct_path(rank: int, w: int) -> None:
    """reduce_scatter_tensor's prebuilt call (comm/direct.py) and the cases it hands to the general path."""
    import torch

    import deepspeed_c.comm as dc
    from deepspeed_c.comm import direct

    f64 = dict(dtype=torch.float64, device=_device())
    n = 3
    inp = torch.arange(w * n, **f64) * (rank + 1)
    want = (torch.arange(w * n, **f64) * (w * (w + 1) / 2))[rank * n:(rank + 1) * n]
    out = torch.zeros(n, **f64)
    work = dc.reduce_scatter_tensor(out, inp, group=None, async_op=True)
    work.wait()
    _eq(out, want, "reduce_scatter_tensor, async, prebuilt")
    entry = direct.REDUCE_SCATTERS[(None, dc.ReduceOp.SUM, True)]
    assert entry.world_size == w and entry.refused_keys == ((dc.get_backend(), "reduce_scatter_tensor"),)
    assert direct.ALL_GATHERS[(None, True)].op_names == ("all_gather_into_tensor",)  # made by _check_all's gathers
    out = torch.zeros(n, **f64)
    assert dc.reduce_scatter_tensor(out, inp) is None
    _eq(out, want, "reduce_scatter_tensor, sync, prebuilt")
    out = torch.zeros(n, **f64)  # the stacked input form: the general path's flat views
    dc.reduce_scatter_tensor(out, inp.view(w, n))
    _eq(out, want, "reduce_scatter_tensor, stacked input")
    out = torch.zeros(n, **f64)  # a strided input: the general path's contiguous copy
    dc.reduce_scatter_tensor(out, torch.stack([inp, inp]).t().reshape(-1)[::2])
    _eq(out, want, "reduce_scatter_tensor, strided input")
    for bad_out, bad_in, words in ((torch.zeros(2 * n, **f64)[::2], inp, "contiguous"),
                                   (torch.zeros(n + 1, **f64), inp, "expected")):
        try:
            dc.reduce_scatter_tensor(bad_out, bad_in)
        except ValueError as err:
            assert words in str(err), err
        else:
            raise AssertionError(f"reduce_scatter_tensor took a bad output ({words})")


def _body(rank: int, w: int, backend: str) -> list[str]:
    import torch.distributed as dist

    import deepspeed_c.comm as dc
    from deepspeed_c.comm.backend import FALLBACK_OPS

    # the harness built the group with torch: deepspeed_c.comm adopts it
    assert dc.is_initialized() and dc.get_rank() == rank and dc.get_world_size() == w
    assert dc.get_local_rank() == rank and dc.get_backend() == backend
    assert dc.has_all_gather_into_tensor() and dc.has_reduce_scatter_tensor()
    _check_all(rank, w)
    _check_p2p_groups_objects(rank, w)
    _check_direct_path(rank, w)
    refused_natively = sorted(op for _, op in dc.cdb._refused)

    # every fallback forced; native calls would now raise, so passing proves the fallbacks ran
    def trap(name):
        def boom(*args, **kwargs):
            raise AssertionError(f"native {name} called while its fallback is forced")
        return boom

    cdb = dc.cdb
    real_all_reduce = dist.all_reduce

    def all_reduce_without_avg(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        assert op != dist.ReduceOp.AVG, "native AVG called while its fallback is forced"
        return real_all_reduce(tensor, op=op, group=group, async_op=async_op)

    saved = (cdb.reduce_scatter_function, cdb.all_gather_function, dist.reduce_scatter, dist.all_to_all)
    cdb._forced = set(FALLBACK_OPS)
    cdb.reduce_scatter_function, cdb.all_gather_function = trap("reduce_scatter_tensor"), trap("all_gather_into_tensor")
    dist.reduce_scatter, dist.all_to_all, dist.all_reduce = trap("reduce_scatter"), trap("all_to_all"), \
        all_reduce_without_avg
    try:
        _check_all(rank, w)
    finally:
        cdb._forced = set()
        cdb.reduce_scatter_function, cdb.all_gather_function, dist.reduce_scatter, dist.all_to_all = saved
        dist.all_reduce = real_all_reduce

    # a backend that refuses reduce_scatter_tensor: the refusal is caught, remembered, and routed
    def refuse(*args, **kwargs):
        raise RuntimeError("ProcessGroupGloo does not support reduce_scatter")

    cdb.reduce_scatter_function = refuse
    import torch

    f64 = dict(dtype=torch.float64, device=_device())
    for _ in range(2):
        out = torch.zeros(2, **f64)
        dc.reduce_scatter_tensor(out, torch.arange(2.0 * w, **f64))
        _eq(out, torch.arange(2.0 * rank, 2.0 * rank + 2, **f64) * w, "refused reduce_scatter_tensor")
    assert (backend, "reduce_scatter_tensor") in cdb._refused

    # any other error is the caller's to see, not swallowed by a fallback
    def broken(*args, **kwargs):
        raise RuntimeError("connection reset by peer")

    cdb._refused.clear()
    cdb.reduce_scatter_function = broken
    try:
        dc.reduce_scatter_tensor(torch.zeros(2, **f64), torch.zeros(2 * w, **f64))
    except RuntimeError as err:
        assert "connection reset" in str(err)
    else:
        raise AssertionError("a real backend error was swallowed")
    cdb.reduce_scatter_function = saved[0]
    try:
        dc.reduce_scatter_tensor(torch.zeros(3, **f64), torch.zeros(2 * w, **f64))
    except ValueError as err:
        assert "expected" in str(err)
    else:
        raise AssertionError("a size mismatch was not reported")
    return refused_natively


@pytest.mark.parametrize("backend,world_size", [
    ("gloo", 2), ("gloo", 4),
    pytest.param("nccl", 2, marks=pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="NCCL run needs 2 GPUs")),
])
def test_collectives_native_and_fallback(backend, world_size):
    results = run_distributed(_body, world_size, args=(backend, ), backend=backend, timeout=240)
    # what the backend refused natively (gloo in torch 2.11: only the list all_to_all); every
    # rank must agree, or ranks would take different paths through the same collective
    assert all(r == results[0] for r in results)
    assert set(results[0]) <= {"all_to_all"}
