"""PipelineModule, LayerSpec, TiedLayerSpec (`deepspeed.runtime.pipe.module`).

A PipelineModule is a sequence of layers cut into stages; each rank builds only its own stage's
layers (a LayerSpec is built lazily, so the whole model never exists on one rank). Tied layers
(TiedLayerSpec with the same key) share one module per stage; their weights start equal
(broadcast from the first stage that holds them) and their gradients are all-reduced among those
stages before each step, so they stay equal.
"""
from __future__ import annotations

import os
from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from deepspeed_c.runtime.activation_checkpointing import checkpointing

from .partition import partition_layers
from .topology import PipeDataParallelTopology, PipelineParallelGrid, ProcessTopology


class LayerSpec:
    """A layer to build later: LayerSpec(torch.nn.Linear, 4, 8, bias=False)."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs
        if not isinstance(typename, type) or not issubclass(typename, nn.Module):
            raise RuntimeError("LayerSpec only supports torch.nn.Module types.")
        self.global_rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else -1

    def __repr__(self) -> str:
        return f"{self.typename.__name__}({self.module_args!r}, {self.module_kwargs!r})"

    def build(self, log: bool = False) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer whose `tied_weight_attr` parameters are shared by every TiedLayerSpec of `key`
    (e.g. input embedding and output projection); forward_fn(module, x) replaces module(x)."""

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Optional[Callable] = None,
                 tied_weight_attr: Any = ["weight"], **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


def _recursive_getattr(module: nn.Module, attr: str) -> Any:
    for part in attr.split("."):
        module = getattr(module, part)
    return module


class PipelineModule(nn.Module):
    """Layers to run as a pipeline of `num_stages` stages (or the 'pipe' axis of `topology`).
    forward() runs this stage's layers only; the PipelineEngine moves data between stages."""

    def __init__(self, layers: Any, num_stages: Optional[int] = None, topology: Optional[ProcessTopology] = None,
                 loss_fn: Optional[Callable] = None, seed_layers: bool = False, seed_fn: Optional[Callable] = None,
                 base_seed: int = 1234, partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable = checkpointing.checkpoint,
                 checkpointable_layers: Optional[list] = None, dynamic_shape: bool = False) -> None:
        super().__init__()
        if num_stages is None and topology is None:
            raise RuntimeError("must provide num_stages or topology")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("PipelineModule needs torch.distributed initialised first "
                               "(call deepspeed.init_distributed())")
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
            raise TypeError(f"checkpointable_layers must be a list, got {type(checkpointable_layers).__name__}")
        if not isinstance(activation_checkpoint_interval, int) or activation_checkpoint_interval < 0:
            raise ValueError(f"activation_checkpoint_interval must be an int >= 0, got {activation_checkpoint_interval!r}")
        self.micro_offset = 0
        self.loss_fn = loss_fn
        self.checkpointable_layers = checkpointable_layers
        self.seed_layers = seed_layers
        self.seed_fn = seed_fn
        self.base_seed = base_seed
        self.world_group = dist.new_group(ranks=list(range(dist.get_world_size())))
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if topology is not None:
            self._topo = topology
            self.num_stages = topology.get_dim("pipe")
        else:
            if not isinstance(num_stages, int) or num_stages < 1:
                raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
            if self.world_size % num_stages != 0:
                raise RuntimeError(f"num_stages ({num_stages}) must divide distributed world size ({self.world_size})")
            self.num_stages = num_stages
            self._topo = PipeDataParallelTopology(num_pp=num_stages, num_dp=self.world_size // num_stages)
        self._grid = PipelineParallelGrid(process_group=self.world_group, topology=self._topo)
        self.stage_id = self._topo.get_coord(self.global_rank).pipe
        self._layer_specs = list(layers)
        self._num_layers = len(self._layer_specs)
        if self.num_stages > self._num_layers:
            raise ValueError(f"num_stages ({self.num_stages}) is more than the {self._num_layers} layers: "
                             "every stage needs at least one layer")
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.dynamic_shape = dynamic_shape
        self.virtual_stages = 1
        self._partition_and_build(1)

    def _partition_and_build(self, virtual_stages: int) -> None:
        """Cut the layers into stages x virtual_stages parts and build this rank's: chunk c is
        virtual stage c * stages + stage_id (one chunk without interleaving)."""
        parts_n = self.num_stages * virtual_stages
        if parts_n > self._num_layers:
            raise ValueError(f"num_stages ({self.num_stages}) x virtual_stages ({virtual_stages}) is more than the "
                             f"{self._num_layers} layers: every stage needs at least one layer")
        self.parts = partition_layers(self._layer_specs, parts_n, self.partition_method, self._count_params)
        self.virtual_stages = virtual_stages
        # only what the previous build registered goes: a loss module (loss_fn=torch.nn.CrossEntropyLoss(),
        # as DeepSpeed's tutorial passes it) or modules a subclass registered stay
        for name in getattr(self, "_built_module_names", ()):
            self._modules.pop(name, None)
        self.forward_funcs: list = []
        self.fwd_map: dict[str, int] = {}
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self._built_module_names: list[str] = ["tied_modules"]  # _add_layer appends each layer's name
        self._layer_ids: list[int] = []  # global layer index of each forward_funcs entry
        self._chunk_ranges: list[tuple[int, int]] = []  # per chunk, its slice of forward_funcs
        for c in range(virtual_stages):
            vs = c * self.num_stages + self.stage_id
            first = len(self.forward_funcs)
            self._build(self.parts[vs], self.parts[vs + 1])
            self._chunk_ranges.append((first, len(self.forward_funcs)))
        self._local_start, self._local_stop = self.parts[self.stage_id], self.parts[self.stage_id + 1]
        from deepspeed_c.accelerator import get_accelerator

        self.to(get_accelerator().device_name(self.local_rank))
        self.tied_comms = self._index_tied_modules()
        self._synchronize_tied_weights()

    def set_virtual_stages(self, virtual_stages: int) -> None:
        """Re-partition for an interleaved schedule (every rank calls it, as the engine does at
        initialize): this rank then holds `virtual_stages` chunks, built anew from the layer specs."""
        if not isinstance(virtual_stages, int) or virtual_stages < 1:
            raise ValueError(f"pipeline.virtual_stages must be an int >= 1, got {virtual_stages!r}")
        if virtual_stages != self.virtual_stages:
            self._partition_and_build(virtual_stages)

    # -- building -------------------------------------------------------------------------------
    @staticmethod
    def _count_params(layer: Any) -> int:
        """Trainable elements of a layer (a LayerSpec is built, counted and dropped)."""
        if isinstance(layer, LayerSpec):
            layer = layer.build()
        if isinstance(layer, nn.Module):
            return sum(p.numel() for p in layer.parameters() if p.requires_grad)
        return 0

    def _set_seed(self, seed: int) -> None:
        if self.seed_fn:
            self.seed_fn(seed)
        else:
            torch.manual_seed(seed)

    def _build(self, start: int, stop: int) -> None:
        for local_idx, layer in enumerate(self._layer_specs[start:stop]):
            idx = local_idx + start
            self._layer_ids.append(idx)
            if self.seed_layers:
                self._set_seed(self.base_seed + idx)
            if isinstance(layer, PipelineModule):
                raise NotImplementedError("RECURSIVE BUILD NOT YET IMPLEMENTED")
            if isinstance(layer, nn.Module):
                self._add_layer(str(idx), layer)
            elif isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                module = self.tied_modules[layer.key]
                self.forward_funcs.append(module if layer.forward_fn is None else partial(layer.forward_fn, module))
            elif isinstance(layer, LayerSpec):
                self._add_layer(str(idx), layer.build())
            elif callable(layer):
                self.forward_funcs.append(layer)
            else:
                raise TypeError(f"layer {idx} must be a LayerSpec, an nn.Module or a callable, got {type(layer).__name__}")
        for p in self.parameters():
            p.ds_pipe_replicated = False

    def _add_layer(self, name: str, module: nn.Module) -> None:
        self.forward_funcs.append(module)
        self.fwd_map[name] = len(self.forward_funcs) - 1
        self.add_module(name, module)
        self._built_module_names.append(name)

    def _index_tied_modules(self) -> dict:
        """Per tie key held here: the ranks (one per stage holding it, same data index) and their group.
        Every rank creates every group, in the same order."""
        comms: dict = {}
        if self._topo.get_dim("pipe") == 1:
            return comms
        keys = sorted({s.key for s in self._layer_specs if isinstance(s, TiedLayerSpec)})
        mp = self._grid.get_slice_parallel_world_size()
        for key in keys:
            stages = sorted({self.stage_owner(i) for i, s in enumerate(self._layer_specs)
                             if isinstance(s, TiedLayerSpec) and s.key == key})
            for dp in range(self._grid.data_parallel_size):
                for m in range(mp):
                    extra = {"data": dp, "model": m} if mp > 1 else {"data": dp}
                    ranks = [self._grid.stage_to_global(stage_id=s, **extra) for s in stages]
                    group = dist.new_group(ranks=ranks)
                    if self.global_rank in ranks:
                        comms[key] = {"ranks": ranks, "group": group, "weight_attr": self.tied_weight_attrs[key],
                                      "module": self.tied_modules[key]}
                        if self.global_rank != ranks[0]:
                            for p in self.tied_modules[key].parameters():
                                p.ds_pipe_replicated = True
        return comms

    def _synchronize_tied_weights(self) -> None:
        for comm in self.tied_comms.values():
            for attr in comm["weight_attr"]:
                dist.broadcast(_recursive_getattr(comm["module"], attr).data, src=min(comm["ranks"]),
                               group=comm["group"])

    def allreduce_tied_weight_gradients(self) -> None:
        """Sum the tied weights' gradients over the stages that hold them."""
        for comm in self.tied_comms.values():
            for attr in comm["weight_attr"]:
                weight = _recursive_getattr(comm["module"], attr)
                if weight.grad is not None:
                    dist.all_reduce(weight.grad, group=comm["group"])

    def get_tied_weights_and_groups(self) -> list:
        return [(_recursive_getattr(c["module"], a), c["group"]) for c in self.tied_comms.values()
                for a in c["weight_attr"]]

    # -- forward --------------------------------------------------------------------------------
    def _exec_range(self, start: int, end: int) -> Callable:
        offset = self.micro_offset + 1

        def run(*inputs: Any) -> Any:
            x = inputs[0] if len(inputs) == 1 else inputs
            for i, layer in enumerate(self.forward_funcs[start:end]):
                self.curr_layer = self._layer_ids[i + start]
                if self.seed_layers:
                    self._set_seed(self.base_seed * offset + self.curr_layer)
                x = layer(x)
            return x

        return run

    def forward(self, forward_input: Any) -> Any:
        return self.forward_chunk(forward_input, 0)

    def forward_chunk(self, forward_input: Any, chunk_id: int) -> Any:
        """Run model chunk `chunk_id` of this rank (the whole stage without interleaving)."""
        self.micro_offset += 1
        lo, hi = self._chunk_ranges[chunk_id]
        k = self.activation_checkpoint_interval
        if k == 0:
            return self._exec_range(lo, hi)(forward_input)
        x = forward_input
        for start in range(lo, hi, k):
            end = min(start + k, hi)
            if not isinstance(x, tuple):
                x = (x,)
            if self._is_checkpointable(self.forward_funcs[start:end]):
                x = self.activation_checkpoint_func(self._exec_range(start, end), *x)
            else:
                x = self._exec_range(start, end)(*x)
        return x

    def _is_checkpointable(self, funcs: list) -> bool:
        if self.checkpointable_layers is not None:
            return all(f.__class__.__name__ in self.checkpointable_layers for f in funcs)
        return any(len(list(f.parameters())) > 0 for f in funcs if isinstance(f, nn.Module))

    # -- queries --------------------------------------------------------------------------------
    def partitions(self) -> list[int]:
        return self.parts

    def stage_owner(self, layer_idx: int) -> int:
        if not 0 <= layer_idx < self._num_layers:
            raise ValueError(f"layer_idx {layer_idx} out of range [0, {self._num_layers})")
        for vs in range(len(self.parts) - 1):
            if self.parts[vs] <= layer_idx < self.parts[vs + 1]:
                return vs % self.num_stages
        raise RuntimeError(f"Layer {layer_idx} not owned? parts={self.parts}")

    def set_checkpoint_interval(self, interval: int) -> None:
        if interval < 0:
            raise ValueError(f"activation_checkpoint_interval must be >= 0, got {interval}")
        self.activation_checkpoint_interval = interval

    def set_activation_checkpoint_func(self, fn: Callable) -> None:
        """The function that runs each checkpointed range (the engine's pipeline.use_reentrant choice)."""
        self.activation_checkpoint_func = fn

    def set_checkpoint_parallel_write(self, enabled: bool) -> None:
        """checkpoint.parallel_write.pipeline_stage: a stage's data-parallel ranks split its layer files."""
        self.checkpoint_parallel_write_pipeline = bool(enabled)

    def layer_id(self, local_layer_idx: int) -> int:
        """The global index of this stage's local layer `local_layer_idx` (names its checkpoint file)."""
        return self._layer_ids[local_layer_idx]

    def topology(self) -> ProcessTopology:
        return self._topo

    def mpu(self) -> PipelineParallelGrid:
        return self._grid

    def num_pipeline_stages(self) -> int:
        return self._topo.get_dim("pipe")

    def get_additional_losses(self) -> Optional[dict]:
        return None

    # -- checkpoints (DeepSpeed's layout: one file per layer) -----------------------------------
    def ckpt_prefix(self, checkpoints_path: str, tag: Any) -> str:
        name = "module"
        coord = self._topo.get_coord(rank=self.global_rank)
        for axis in self._topo.get_axis_names():
            if axis != "data":
                name += f"-{axis}_{getattr(coord, axis):02d}"
        return os.path.join(checkpoints_path, str(tag), name)

    def ckpt_layer_path(self, ckpt_dir: str, local_layer_idx: int) -> str:
        path = os.path.join(ckpt_dir, f"layer_{self._layer_ids[local_layer_idx]:02d}")
        rank_repr = self._topo.get_rank_repr(rank=self.global_rank)
        if rank_repr:
            path += f"-{rank_repr}"
        return path + "-model_states.pt"

    def ckpt_layer_path_list(self, ckpt_dir: str, local_layer_idx: int) -> list[str]:
        import glob

        layer = self._layer_ids[local_layer_idx]
        return sorted(glob.glob(os.path.join(ckpt_dir, f"layer_{layer:02d}-*model_states.pt")))

    def save_state_dict(self, save_dir: str, checkpoint_engine: Any = None, exclude_frozen_params: bool = False) -> None:
        """Data-parallel rank 0 of each stage writes one file per layer that has a state_dict."""
        from deepspeed_c.runtime.checkpointing.pipeline_layers import layer_file_states, save_layer_files

        parallel = bool(getattr(self, "checkpoint_parallel_write_pipeline", False))
        if not _native_engine(checkpoint_engine):  # a user's CheckpointEngine writes each layer file
            for name, sd in layer_file_states(self, exclude_frozen_params, parallel).items():
                checkpoint_engine.save(sd, os.path.join(save_dir, name))
            return
        save_layer_files(self, save_dir, exclude_frozen_params, parallel_write=parallel)

    def load_state_dir(self, load_dir: str, checkpoint_engine: Any = None, strict: bool = True) -> None:
        """Loads every local layer from its layer file (whatever stage wrote it; weights_only, verified
        against the directory's manifest where it has one), then re-ties."""
        import contextlib

        from deepspeed_c.checkpoint import store
        from deepspeed_c.runtime.checkpointing.pipeline_layers import apply_layer_states, manifest_if_any, read_layer_files

        # a user's CheckpointEngine reads each layer file
        native = _native_engine(checkpoint_engine)
        reads = contextlib.nullcontext() if native else store.through_engine(checkpoint_engine)
        with reads:
            apply_layer_states(self, read_layer_files(self, load_dir, manifest_if_any(load_dir)), strict)
        self._synchronize_tied_weights()

    def synchronize_tied_weights(self) -> None:
        """Every stage's copy of a tied module takes the first holder's weights (collective over the
        stages holding it); the engine's load_checkpoint calls it after the layer files are applied."""
        self._synchronize_tied_weights()


def _native_engine(checkpoint_engine: Any) -> bool:
    """None or a built-in engine: the layer files are this package's own crash-safe, verified files."""
    if checkpoint_engine is None:
        return True
    from deepspeed_c.runtime.checkpointing.engine_hooks import check_engine, native_writer

    check_engine(checkpoint_engine)
    return native_writer(checkpoint_engine)[0]
