"""AutoTP checkpoints: saved as the unsharded model's, so they load at any tensor-parallel degree.

Around engine.save_checkpoint / load_checkpoint every tensor-parallel parameter -- with its stage-0 fp32
master (bf16) and each optimizer state tensor shaped like it (Adam's moments) -- is swapped, in place, for
the whole tensor gathered over its TP group, in the original model's layout (GPT-2's Conv1D weights
transposed back); the engine's checkpointer then writes or reads exactly what it would for the unsharded
model (DeepSpeed's layout: mp_rank_00_model_states.pt, and at ZeRO 1/2 the unsharded model's
zero_pp_rank_{d}_mp_rank_00 files, which tensor_parallel.zero_checkpoint builds from and cuts into the
partitions). Afterwards each rank keeps its own slice again -- of the values just loaded, when loading --
copied back into the parameter's original storage (ZeRO's parameters view its flat buffers). Parameter
objects never change, so the optimizer's state stays keyed to them. ZeRO-3 raises before a file is touched.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch

from deepspeed_c.module_inject.layers import TensorParallel_Layer


def check_supported(tp_size: int, zero_stage: int, what: str) -> None:
    if zero_stage > 2:
        raise NotImplementedError(
            f"{what} with tensor_parallel.autotp_size={tp_size} and zero_optimization.stage="
            f"{zero_stage} is not built (ZeRO stages 0, 1 and 2 are); save_16bit_model writes "
            "the whole weights at any stage")


def _sharded(module: torch.nn.Module) -> list[tuple[TensorParallel_Layer, str, torch.nn.Parameter]]:
    out = []
    for layer in module.modules():
        if isinstance(layer, TensorParallel_Layer) and layer.tp_world_size > 1:
            for key in ("weight", "bias"):
                p = getattr(layer, key)
                if p is not None and getattr(p, "ds_is_tensor_model_parallel", False):
                    out.append((layer, key, p))
    return out


def _to_full(layer: TensorParallel_Layer, key: str, t: torch.Tensor, dim: int) -> torch.Tensor:
    full = layer.gather_whole(t, dim)
    return full.t().contiguous() if key == "weight" and getattr(layer, "conv1d", False) else full


def _to_shard(layer: TensorParallel_Layer, key: str, t: torch.Tensor, dim: int) -> torch.Tensor:
    if key == "weight" and getattr(layer, "conv1d", False):
        t = t.t()
    return layer.cut_shard(t.contiguous(), dim, layer.label())


class UnshardedZeroFiles:
    """ZeRO 1/2 inside full_view, as the checkpointer sees the optimizer protocol: its checkpoint methods read
    and write the unsharded model's ZeRO files (tensor_parallel.zero_checkpoint); every other attribute is the
    optimizer's own. Loads are queued in `pending` and applied after the view (the optimizer's load writes
    the model's shards from the masters)."""

    def __init__(self, opt: Any, tp_rank: int, entries: list, pending: list[Callable[[], None]]) -> None:
        from deepspeed_c.runtime.tensor_parallel import zero_checkpoint as zc

        self._zc, self._opt, self._pending = zc, opt, pending
        self._tp = zc.TPParams(
            to_whole={id(p): functools.partial(_to_full, lay, key, dim=p.partition_dim) for lay, key, p in entries},
            to_shard={id(p): functools.partial(_to_shard, lay, key, dim=p.partition_dim) for lay, key, p in entries},
            shard_shape={id(p): p.shape for _, _, p in entries}, tp_rank=tp_rank)

    def __getattr__(self, name: str) -> Any:
        opt = self.__dict__.get("_opt")
        if opt is None:  # not built yet (copy, pickle): nothing to delegate to
            raise AttributeError(name)
        return getattr(opt, name)

    def partition_export(self) -> contextlib.AbstractContextManager:
        """None: the checkpointer then calls the methods below instead of converting an export."""
        return contextlib.nullcontext(None)

    def partition_checkpoint_state(self, param_name: Callable[[torch.nn.Parameter], str]) -> Any:
        return self._zc.save_state(self._opt, self._tp, param_name)

    def load_checkpoint_state(self, saved: Any, load_optimizer_states: bool) -> None:
        self._pending.append(self._zc.load_state(self._opt, self._tp, saved, load_optimizer_states))

    def load_checkpoint_weights(self, saved: Any) -> None:  # load_module_only: masters re-cut from the loaded shards
        self._pending.append(functools.partial(self._opt.load_checkpoint_weights, saved))


@contextlib.contextmanager
def full_view(module: torch.nn.Module, stepper: Any, basic_optimizer: Any, zero_stage: int,
              tp_rank: int) -> Iterator[Any]:
    """Inside: every TP parameter, its master and its same-shaped optimizer states whole (collective on entry
    and exit). `stepper`: the optimizer protocol (None without one); `basic_optimizer`: the torch optimizer
    whose per-parameter state (Adam's moments) is swapped too; `tp_rank`: this rank's in its TP group.
    Yields the optimizer protocol the checkpointer is to use meanwhile (ZeRO 1/2: an UnshardedZeroFiles)."""
    def opt_state() -> Any:  # re-read on exit: torch's load_state_dict replaces the state dict as a whole
        return basic_optimizer.state if basic_optimizer is not None else {}

    entries = _sharded(module)
    masters = stepper.master_params() if stepper is not None else {}
    zero = zero_stage in (1, 2) and stepper is not None
    # (layer, key, tensor, dim): each parameter, then its fp32 master where a stage-0 optimizer keeps one
    targets = []
    for layer, key, p in entries:
        targets.append((layer, key, p, p.partition_dim))
        if id(p) in masters:
            targets.append((layer, key, masters[id(p)], p.partition_dim))
    shard_shapes = {id(t): t.shape for _, _, t, _ in targets}
    originals: dict[int, torch.Tensor] = {}
    pending: list[Callable[[], None]] = []
    view = UnshardedZeroFiles(stepper, tp_rank, entries, pending) if zero else stepper
    try:
        with torch.no_grad():
            state = opt_state()
            for layer, key, t, dim in targets:
                for name, value in list(state.get(t, {}).items()):
                    if isinstance(value, torch.Tensor) and value.shape == t.shape:
                        state[t][name] = _to_full(layer, key, value, dim)
                originals[id(t)] = t.data
                t.data = _to_full(layer, key, t.data, dim)
        yield view
    finally:
        state = opt_state()
        with torch.no_grad():
            for layer, key, t, dim in targets:
                if id(t) not in originals:
                    continue
                full_shape = t.shape
                shard = _to_shard(layer, key, t.data, dim)
                assert shard.shape == shard_shapes[id(t)], (layer.label(), shard.shape, shard_shapes[id(t)])
                original = originals[id(t)]
                original.copy_(shard)  # its storage: ZeRO's parameters view the optimizer's flat buffers
                t.data = original
                for name, value in list(state.get(t, {}).items()):
                    if isinstance(value, torch.Tensor) and value.shape == full_shape:
                        state[t][name] = _to_shard(layer, key, value, dim)
    for apply in pending:  # ZeRO loads: into the partitions, then the model's shards from the masters
        apply()
