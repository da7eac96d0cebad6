"""Tensor-parallel layers under the ways users call autograd (tests/unit/autograd_calls.py: autograd.grad,
backward(inputs=), create_graph penalties on the input and on a sharded weight, torch.func grad and per-sample
vmap, accumulation), on 2 gloo ranks against one float64 process computing the unsharded MLP
tanh(x W1^T + b1) W2^T + b2 (each rank compares its shard of every gradient):
- AutoTP: LinearLayer (column) -> LinearAllreduce (row); LinearLayer with gather_output -> a replicated Linear
- compression: ColumnParallelLinear_Compress -> RowParallelLinear_Compress (input parallel, and the
  gathered-output / scattered-input pair)
- Domino: _Wait_bwd_comm -> DominoAsyncColumnParallelLinear (asynchronous input-gradient all-reduce) ->
  RowParallelLinearNoComm summed over the group
- a whole one-layer DominoTransformer (both overlap schedules: the row-parallel sums in flight, _Pending)
  against the unsplit, unsharded float64 transformer of tests/distributed/domino_models.py (torch's math
  attention kernel: its fused ones have no double backward)."""
from __future__ import annotations

import types

import torch

from tests.harness import run_distributed

IN, MID, OUT = 8, 8, 4


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"w1": torch.randn(MID, IN, generator=g, dtype=torch.float64) / 2,
            "b1": torch.randn(MID, generator=g, dtype=torch.float64),
            "w2": torch.randn(OUT, MID, generator=g, dtype=torch.float64) / 2,
            "b2": torch.randn(OUT, generator=g, dtype=torch.float64)}


def _mlp(p: dict, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ p["w1"].t() + p["b1"]) @ p["w2"].t() + p["b2"]


class _Sum(torch.nn.Module):
    """Partial outputs summed over the group (differentiable), then the replicated bias."""

    def __init__(self, group, bias: torch.Tensor) -> None:
        super().__init__()
        self.group, self.bias = group, torch.nn.Parameter(bias)

    def forward(self, partial: torch.Tensor) -> torch.Tensor:
        from deepspeed_c.module_inject.layers import TPReduce

        return TPReduce.apply(self.group, partial) + self.bias


class _First(torch.nn.Module):
    """The first element of a layer's (output, bias) pair."""

    def __init__(self, layer: torch.nn.Module, *args) -> None:
        super().__init__()
        self.layer, self.args = layer, args

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, *self.args)[0]


class _Wait(torch.nn.Module):
    def __init__(self, dic: dict) -> None:
        super().__init__()
        self.dic = dic

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from deepspeed_c.runtime.domino.handles import _Wait_bwd_comm

        return _Wait_bwd_comm(x, self.dic, "BATCH0")


def _cases(rank: int, world: int, group):
    """(name, module, {our parameter name: name in _full()}) per case."""
    from deepspeed_c.compression.parallel_layer import ColumnParallelLinear_Compress, RowParallelLinear_Compress
    from deepspeed_c.module_inject.layers import LinearAllreduce, LinearLayer
    from deepspeed_c.runtime.domino.async_linear import DominoAsyncColumnParallelLinear, RowParallelLinearNoComm

    full = {k: v.float() for k, v in _full().items()}

    def linear(w: str, b: str) -> torch.nn.Linear:
        lin = torch.nn.Linear(full[w].shape[1], full[w].shape[0])
        lin.weight.data.copy_(full[w])
        lin.bias.data.copy_(full[b])
        return lin

    def cut(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(world, dim=dim)[rank].clone()

    autotp = torch.nn.Sequential(LinearLayer(linear("w1", "b1"), group), torch.nn.Tanh(),
                                 LinearAllreduce(linear("w2", "b2"), group))
    yield "autotp", autotp, {"0.weight": "w1", "0.bias": "b1", "2.weight": "w2", "2.bias": "b2"}
    # gather_output: the first layer's shards all-gathered; the second layer replicated (its gradients equal)
    gathered = torch.nn.Sequential(LinearLayer(linear("w1", "b1"), group, gather_output=True), torch.nn.Tanh(),
                                   linear("w2", "b2"))
    yield "autotp_gather", gathered, {"0.weight": "w1", "0.bias": "b1", "2.weight": "w2", "2.bias": "b2"}

    mpu = types.SimpleNamespace(get_model_parallel_world_size=lambda: world, get_model_parallel_group=lambda: group)
    for gather in (False, True):
        col = ColumnParallelLinear_Compress(mpu, IN, MID, gather_output=gather)
        row = RowParallelLinear_Compress(mpu, MID, OUT, input_is_parallel=not gather)
        with torch.no_grad():
            col.weight.copy_(cut(full["w1"], 0))
            col.bias.copy_(cut(full["b1"], 0))
            row.weight.copy_(cut(full["w2"], 1))
            row.bias.copy_(full["b2"])
        module = torch.nn.Sequential(_First(col), torch.nn.Tanh(), _First(row))
        yield f"compress_gather{int(gather)}", module, {"0.layer.weight": "w1", "0.layer.bias": "b1",
                                                        "2.layer.weight": "w2", "2.layer.bias": "b2"}

    config = types.SimpleNamespace(params_dtype=torch.float32, perform_initialization=False)
    dic = {"BATCH0": None, "BATCH1": None}
    col = DominoAsyncColumnParallelLinear(IN, MID // world, group, config, None)
    row = RowParallelLinearNoComm(MID // world, OUT, config, None, bias=False)  # b2 added after the sum
    with torch.no_grad():
        col.weight.copy_(cut(full["w1"], 0))
        col.bias.copy_(cut(full["b1"], 0))
        row.weight.copy_(cut(full["w2"], 1))
    domino = torch.nn.Sequential(_Wait(dic), _First(col, dic, "BATCH0"), torch.nn.Tanh(), _First(row),
                                 _Sum(group, full["b2"].clone()))
    yield "domino", domino, {"1.layer.weight": "w1", "1.layer.bias": "b1", "3.layer.weight": "w2", "4.bias": "b2"}


S, DH, HEADS, FFN = 2, 8, 2, 16  # the Domino transformer: sequence, hidden, heads, ffn


def _halves(x: torch.Tensor) -> torch.Tensor:
    """[n, 2*S*DH] -> [S, 2n, DH]: row i holds the sequences of batch entries i and n + i (one in each half of
    Domino's micro-batch), so a per-sample (vmap) gradient still runs an even micro-batch."""
    n = x.shape[0]
    return x.reshape(n, 2, S, DH).permute(2, 1, 0, 3).reshape(S, 2 * n, DH)


def _rows(h: torch.Tensor) -> torch.Tensor:
    n = h.shape[1] // 2
    return h.reshape(S, 2, n, DH).permute(2, 1, 0, 3).reshape(n, 2 * S * DH)


class _DominoNet(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rows(self.model(_halves(x), None))


def _domino_cases(rank: int, world: int):
    """(name, module, full float64 weights by our names, reference) for each overlap schedule."""
    from deepspeed_c.runtime.domino import DominoConfig, DominoTransformer, ModelType
    from tests.distributed import domino_models as dm

    weights = dm.full_weights(11, layers=1, hidden=DH, ffn=FFN)
    mpu = dm.MPU(world)

    def ref(p: dict, x: torch.Tensor) -> torch.Tensor:
        w = {k[len("model."):]: v for k, v in p.items()}
        return _rows(dm.dense_forward(w, _halves(x), heads=HEADS, layers=1))

    for intra in (False, True):
        config = DominoConfig(num_layers=1, hidden_size=DH, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                              perform_initialization=False, domino_intra_layer_overlap=intra)
        model = DominoTransformer(config, mpu, None, ModelType.encoder_or_decoder)
        dm.load_shards(model, weights, world, rank)
        yield f"domino_layer_intra{int(intra)}", _DominoNet(model), {f"model.{k}": v for k, v in weights.items()}, ref


def _shard_of(ours: dict, rank: int, world: int):
    """Our rank's piece of a full parameter-shaped tensor: cut along the dimension where our shape differs."""
    def shard(k: str, t: torch.Tensor) -> torch.Tensor:
        for dim, (a, b) in enumerate(zip(ours[k], t.shape)):
            if a != b:
                return t.chunk(world, dim=dim)[rank]
        return t

    return shard


def body(rank: int, world: int) -> dict[str, dict[str, float]]:
    import torch.distributed as dist
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from deepspeed_c.module_inject.layers import TPReduce
    from tests.unit.autograd_calls import Case, run

    torch.manual_seed(0)  # the same batch on every rank: the input is replicated
    x = torch.randn(3, IN)
    full = _full()
    shape = {k: tuple(v.shape) for k, v in full.items()}
    out = {}
    group = dist.new_group(list(range(world)))
    for name, module, names in _cases(rank, world, group):
        ours = {k: tuple(p.shape) for k, p in module.named_parameters()}
        shard = _shard_of(ours, rank, world)
        sharded = frozenset(k for k in ours if ours[k] != shape[names[k]])
        case = Case(module, lambda p, xx, names=names: _mlp({names[k]: v for k, v in p.items()}, xx),
                    {k: full[names[k]] for k in ours}, x, next(k for k in ours if names[k] == "w1"),
                    shard=shard, sharded=sharded, reduce=lambda t, g=group: TPReduce.apply(g, t))
        out[name] = run(case)
    for name, module, full_named, ref in _domino_cases(rank, world):
        ours = {k: tuple(p.shape) for k, p in module.named_parameters()}
        torch.manual_seed(1)
        xd = torch.randn(3, 2 * S * DH)
        case = Case(module, ref, full_named, xd, "model.layers.0.self_attention.query_key_value.weight",
                    shard=_shard_of(ours, rank, world),
                    sharded=frozenset(k for k in ours if ours[k] != tuple(full_named[k].shape)),
                    reduce=lambda t, g=group: TPReduce.apply(g, t))
        # torch's fused CPU/CUDA attention kernels have no double backward (a create_graph penalty through them
        # raises in torch); its math kernel is plain differentiable ops
        with sdpa_kernel(SDPBackend.MATH):
            out[name] = run(case)
    return out


def test_tensor_parallel_layers_autograd_calls() -> None:
    from tests.unit.autograd_calls import failures

    for rank, errs in enumerate(run_distributed(body, 2)):
        assert len(errs) == 7
        for name, e in errs.items():
            bad = failures(e)
            assert not bad, f"rank {rank} {name}: {bad} (all: {e})"
