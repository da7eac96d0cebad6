"""A Megatron-style tensor-parallel GPT written for the tests, with its own mpu (issue 54).

Column-parallel linears (output rows split), row-parallel linears (input columns split, the bias
replicated and added after the all-reduce), a vocab-parallel embedding whose weight also produces the
logits (tied), replicated layer norms and position embedding. Split parameters carry Megatron's
`tensor_model_parallel = True` and `partition_dim`. With no tensor-parallel group (tp = 1) the same
classes are the unsplit model that the single-process references train; `shard_from` cuts its weights
into a rank's shards and `full_state` gathers them back. Ranks are laid out tensor-fastest: with TP 2 on
4 ranks the tensor groups are {0,1},{2,3} and the data groups {0,2},{1,3} (Megatron's order)."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F

VOCAB, HIDDEN, HEADS, SEQ, LAYERS = 32, 16, 4, 8, 2  # the tests' sizes; benchmarks/megatron_3d.py resizes


def resize(vocab: int, hidden: int, heads: int, seq: int, layers: int) -> None:
    """Sets the sizes the classes below build with (module-wide: call before building a model)."""
    global VOCAB, HIDDEN, HEADS, SEQ, LAYERS
    VOCAB, HIDDEN, HEADS, SEQ, LAYERS = vocab, hidden, heads, seq, layers


class MegatronMPU:
    """Megatron's parallel_state, reduced to what DeepSpeed calls: tensor x data over the world."""

    def __init__(self, tp: int) -> None:
        import torch.distributed as dist

        world, rank = dist.get_world_size(), dist.get_rank()
        self.tp, self.rank = tp, rank
        self.dp = world // tp
        self._tp_group = self._dp_group = None
        for g in range(world // tp):  # every rank creates every group, in the same order
            ranks = list(range(g * tp, (g + 1) * tp))
            group = dist.new_group(ranks)
            if rank in ranks:
                self._tp_group = group
        for t in range(tp):
            ranks = list(range(t, world, tp))
            group = dist.new_group(ranks)
            if rank in ranks:
                self._dp_group = group

    def get_tensor_model_parallel_group(self) -> Any:
        return self._tp_group

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp

    def get_tensor_model_parallel_rank(self) -> int:
        return self.rank % self.tp

    get_model_parallel_group = get_tensor_model_parallel_group
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_rank = get_tensor_model_parallel_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_data_parallel_group(self) -> Any:
        return self._dp_group

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_rank(self) -> int:
        return self.rank // self.tp

    def context(self) -> "TP":
        return TP(self._tp_group, self.tp, self.rank % self.tp)


@dataclasses.dataclass(frozen=True)
class TP:
    """The tensor-parallel group a layer splits over (group None, size 1: the unsplit model)."""
    group: Any = None
    size: int = 1
    rank: int = 0


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        g = g.contiguous().clone()
        torch.distributed.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous().clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return g, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TP) -> torch.Tensor:
        ctx.tp = tp
        parts = [torch.empty_like(x) for _ in range(tp.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=tp.group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return g.chunk(ctx.tp.size, dim=-1)[ctx.tp.rank].contiguous(), None


def copy_to(x: torch.Tensor, tp: TP) -> torch.Tensor:
    return _CopyToTP.apply(x, tp.group) if tp.size > 1 else x


def reduce_from(x: torch.Tensor, tp: TP) -> torch.Tensor:
    return _ReduceFromTP.apply(x, tp.group) if tp.size > 1 else x


def gather_from(x: torch.Tensor, tp: TP) -> torch.Tensor:
    return _GatherFromTP.apply(x, tp) if tp.size > 1 else x


def _scale() -> float:
    """Weights' init scale: 0.2 at the tests' width, shrinking as 1/sqrt(width) for the benchmark's."""
    return 0.2 * (16 / HIDDEN) ** 0.5


def _split(p: torch.nn.Parameter, dim: int) -> torch.nn.Parameter:
    p.tensor_model_parallel, p.partition_dim = True, dim
    return p


class ColumnParallelLinear(torch.nn.Module):
    def __init__(self, n_in: int, n_out: int, tp: TP, bias: bool = True) -> None:
        super().__init__()
        self.tp = tp
        self.weight = _split(torch.nn.Parameter(torch.randn(n_out // tp.size, n_in) * _scale()), 0)
        self.bias = _split(torch.nn.Parameter(torch.randn(n_out // tp.size) * 0.1), 0) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to(x, self.tp), self.weight, self.bias)


class RowParallelLinear(torch.nn.Module):
    def __init__(self, n_in: int, n_out: int, tp: TP) -> None:
        super().__init__()
        self.tp = tp
        self.weight = _split(torch.nn.Parameter(torch.randn(n_out, n_in // tp.size) * _scale()), 1)
        self.bias = torch.nn.Parameter(torch.randn(n_out) * 0.1)  # replicated: added once, after the sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from(F.linear(x, self.weight), self.tp) + self.bias


class VocabParallelEmbedding(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int, tp: TP) -> None:
        super().__init__()
        self.tp, self.per = tp, vocab // tp.size
        self.weight = _split(torch.nn.Parameter(torch.randn(self.per, hidden) * 0.5), 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        start = self.tp.rank * self.per
        outside = (ids < start) | (ids >= start + self.per)
        local = (ids - start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from(out, self.tp)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return gather_from(F.linear(copy_to(h, self.tp), self.weight), self.tp)


class Block(torch.nn.Module):
    def __init__(self, tp: TP) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(HIDDEN), torch.nn.LayerNorm(HIDDEN)
        self.heads = HEADS // tp.size
        # rows head-major (head, q/k/v, head_dim): a contiguous split keeps whole heads on a rank. No bias:
        # a key bias has an exactly-zero true gradient, whose rounding noise Adam would amplify
        self.qkv = ColumnParallelLinear(HIDDEN, 3 * HIDDEN, tp, bias=False)
        self.proj = RowParallelLinear(HIDDEN, HIDDEN, tp)
        self.fc1 = ColumnParallelLinear(HIDDEN, 4 * HIDDEN, tp)
        self.fc2 = RowParallelLinear(4 * HIDDEN, HIDDEN, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        hd = HIDDEN // HEADS
        q, k, v = self.qkv(self.ln1(x)).view(b, t, self.heads, 3, hd).permute(3, 0, 2, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, self.heads * hd)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class MegatronGPT(torch.nn.Module):
    def __init__(self, tp: TP = TP(), seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = VocabParallelEmbedding(VOCAB, HIDDEN, tp)
        self.pos = torch.nn.Parameter(torch.randn(SEQ, HIDDEN) * 0.1)  # replicated
        self.blocks = torch.nn.ModuleList(Block(tp) for _ in range(LAYERS))
        self.ln_f = torch.nn.LayerNorm(HIDDEN)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, SEQ + 1]: inputs and shifted targets; returns the mean cross-entropy."""
        ids, targets = tokens[:, :-1], tokens[:, 1:]
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        logits = self.embed.logits(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batches(steps: int, rows: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g) for _ in range(steps)]


@torch.no_grad()
def shard_from(model: torch.nn.Module, full: torch.nn.Module, tp: TP) -> torch.nn.Module:
    """`model`'s parameters set to tensor rank tp.rank's shards of `full`'s (same names)."""
    whole = dict(full.named_parameters())
    for name, p in model.named_parameters():
        w = whole[name]
        if getattr(p, "tensor_model_parallel", False):
            w = w.chunk(tp.size, dim=p.partition_dim)[tp.rank]
        p.copy_(w)
    return model


def full_state(model: torch.nn.Module, tp: TP) -> dict[str, np.ndarray]:
    """Every parameter whole (split ones gathered over the TP group; ZeRO-3's gathered first)."""
    import deepspeed_c

    params = list(model.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        with deepspeed_c.zero.GatheredParameters(params):
            return _full_state(model, tp)
    return _full_state(model, tp)


def _full_state(model: torch.nn.Module, tp: TP) -> dict[str, np.ndarray]:
    out = {}
    for name, p in model.named_parameters():
        t = p.detach().float().clone()
        if getattr(p, "tensor_model_parallel", False) and tp.size > 1:
            parts = [torch.empty_like(t) for _ in range(tp.size)]
            torch.distributed.all_gather(parts, t.contiguous(), group=tp.group)
            t = torch.cat(parts, dim=p.partition_dim)
        out[name] = t.cpu().numpy()
    return out


def reference_training(data: list[torch.Tensor], lr: float, eps: float, clip: float,
                       seed: int = 0) -> tuple[list[float], dict[str, np.ndarray], list[float]]:
    """One process, the unsplit model, the whole global batch: (losses, final weights, grad norms)."""
    model = MegatronGPT(seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr, eps=eps)
    losses, norms = [], []
    for tokens in data:
        loss = model(tokens)
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else 1e30)))
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().numpy().copy() for n, p in model.named_parameters()}, norms


def rel_errors(state: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> dict[str, float]:
    """Per tensor: ||a - b|| / ||b|| (norm-wise relative error)."""
    return {k: float(np.linalg.norm(state[k] - v) / (np.linalg.norm(v) + 1e-30)) for k, v in ref.items()}


def sharded_model(mpu: Optional[MegatronMPU], seed: int = 0) -> torch.nn.Module:
    """Rank's shard of the seed's unsplit model."""
    full = MegatronGPT(seed=seed)
    if mpu is None:
        return full
    tp = mpu.context()
    return shard_from(MegatronGPT(tp, seed=seed), full, tp)


# -- the same GPT as pipeline layers (3D): embedding tied to the logits, first and last stage ------------
class EmbedPipe(VocabParallelEmbedding):
    def __init__(self, tp: TP) -> None:
        super().__init__(VOCAB, HIDDEN, tp)


class PosPipe(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = torch.nn.Parameter(torch.randn(SEQ, HIDDEN) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pos[: x.shape[1]].to(x.dtype)


def pipe_logits(module: EmbedPipe, h: torch.Tensor) -> torch.Tensor:
    return module.logits(h)


def pipe_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


def pipe_layers(pipe: Any, tp: TP) -> list:
    """LayerSpecs of MegatronGPT for a PipelineModule of `pipe` (deepspeed_c.pipe or DeepSpeed's):
    embedding (tied), position embedding, the blocks, the final norm, the logits (tied to the embedding)."""
    return ([pipe.TiedLayerSpec("embed", EmbedPipe, tp), pipe.LayerSpec(PosPipe)]
            + [pipe.LayerSpec(Block, tp) for _ in range(LAYERS)]
            + [pipe.LayerSpec(torch.nn.LayerNorm, HIDDEN), pipe.TiedLayerSpec("embed", EmbedPipe, tp, forward_fn=pipe_logits)])


def pipe_name(name: str) -> str:
    """A pipeline parameter's name in MegatronGPT (layer indices as pipe_layers lays them out)."""
    if name.startswith("tied_modules.embed."):
        return "embed." + name[len("tied_modules.embed."):]
    idx, rest = name.split(".", 1)
    i = int(idx)
    if i == 1:
        return rest
    if i == LAYERS + 2:
        return "ln_f." + rest
    return f"blocks.{i - 2}.{rest}"
