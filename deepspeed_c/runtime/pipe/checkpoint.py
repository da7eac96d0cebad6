"""Per-layer pipeline checkpoint files in DeepSpeed's layout: `layer_XX[-model_YY]-model_states.pt`
holding one layer's state_dict (keys relative to the layer), so any pipeline degree (or a plain
model of the same layers) can load them: each stage reads the files of the layers it owns."""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import torch


def save_layer_files(module: Any, save_dir: str, exclude_frozen_params: bool = False,
                     parallel_write: bool = False) -> None:
    """Data-parallel rank 0 of each stage writes its layers that have a state_dict (a tied module
    used through a forward_fn is saved by the stage where it appears as a plain module); with
    checkpoint.parallel_write.pipeline_stage the stage's data-parallel ranks split the layers."""
    dp_rank, dp = module._grid.data_parallel_id, module._grid.data_parallel_size
    n = len(module.forward_funcs)
    if parallel_write:
        from .partition import partition_uniform

        bounds = partition_uniform(n, dp)
        start, stop = bounds[dp_rank], bounds[dp_rank + 1]
    elif dp_rank != 0:
        return
    else:
        start, stop = 0, n
    os.makedirs(save_dir, exist_ok=True)
    for idx in range(start, stop):
        layer = module.forward_funcs[idx]
        if not hasattr(layer, "state_dict"):
            continue
        sd = layer.state_dict()
        if exclude_frozen_params:
            for n, p in layer.named_parameters():
                if not p.requires_grad:
                    sd.pop(n, None)
        # clone: a view would drag its whole storage into the file
        sd = {k: v.detach().clone().cpu() for k, v in sd.items()}
        path = module.ckpt_layer_path(save_dir, idx)
        tmp = path + ".tmp"
        torch.save(sd, tmp)
        os.replace(tmp, path)


def load_layer_files(module: Any, load_dir: str, strict: bool = True) -> None:
    for idx, layer in enumerate(module.forward_funcs):
        if not hasattr(layer, "load_state_dict"):
            continue
        files = module.ckpt_layer_path_list(load_dir, idx)
        if not files:
            layer_id = module._layer_ids[idx]
            raise FileNotFoundError(f"no checkpoint file for layer {layer_id} in {load_dir} "
                                    f"(expected layer_{layer_id:02d}-*model_states.pt)")
        rank = module._grid.get_slice_parallel_rank()
        path = files[rank] if len(files) > 1 else files[0]
        sd = torch.load(path, map_location="cpu", weights_only=True)
        layer.load_state_dict(sd, strict=strict)


def state_dict_from_layer_files(ckpt_dir: str) -> dict:
    """The layer files of a pipeline checkpoint as one state_dict keyed like torch.nn.Sequential's
    ('<layer index>.<name>'), for loading into a non-pipeline model of the same layers."""
    import glob
    import re

    out: dict = {}
    for path in sorted(glob.glob(os.path.join(str(ckpt_dir), "layer_*-model_states.pt"))):
        m = re.match(r"layer_(\d+)-", os.path.basename(path))
        if m is None:
            continue
        for k, v in torch.load(path, map_location="cpu", weights_only=True).items():
            out[f"{int(m.group(1))}.{k}"] = v
    return out


def _state_file(stage: int) -> str:
    return f"mp_rank_{stage:02d}_model_states.pt"


class PipeCheckpointer:
    """engine.save_checkpoint / load_checkpoint of a PipelineEngine, in DeepSpeed's pipeline layout:
    tag/layer_XX-model_states.pt (weights, per layer, so another pipeline degree can read them),
    tag/mp_rank_{stage}_model_states.pt (module None; the stage's optimizer state, LR scheduler and
    counters), ZeRO-1 tag/[bf16_]zero_pp_rank_{dp}_mp_rank_{stage}_optim_states.pt, each rank's own
    optimizer file where the optimizer keeps one (1-bit: onebit_errors_rank_R_of_W.pt), and `latest`.
    Optimizer states come back when the number of stages matches what was saved (ZeRO-1 from the
    stage's ZeRO files, re-cut if the data-parallel degree differs); with another number of stages
    the layers are re-partitioned and the optimizer states (and fp32 masters) found by parameter name
    (optim_reshard.py), for fp32, bf16/fp16 and ZeRO-1 alike."""

    def save(self, engine: Any, save_dir: str, tag: Any, client_state: dict, save_latest: bool,
             exclude_frozen_parameters: bool) -> bool:
        import torch.distributed as dist

        from deepspeed_c.version import DEEPSPEED_API_VERSION

        if not isinstance(save_dir, (str, os.PathLike)):
            raise TypeError(f"save_checkpoint: save_dir must be a path, got {type(save_dir).__name__}")
        if not isinstance(client_state, dict):
            raise TypeError(f"save_checkpoint: client_state must be a dict, got {type(client_state).__name__}")
        tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
        if not tag or os.sep in tag:
            raise ValueError(f"save_checkpoint: tag {tag!r} must be a non-empty name without '{os.sep}'")
        tag_dir = os.path.join(str(save_dir), tag)
        os.makedirs(tag_dir, exist_ok=True)
        module, stepper = engine.module, engine.stepper
        save_layer_files(module, tag_dir, exclude_frozen_parameters,
                         parallel_write=bool(engine._config.checkpoint_parallel_write_pipeline))
        names = {id(p): n for n, p in module.named_parameters()}
        part = stepper.partition_checkpoint_state(lambda p: names[id(p)]) if stepper is not None else None
        stage, dp_rank = engine.stage_id, engine.grid.get_data_parallel_rank()
        if part is not None:
            prefix = "bf16_" if engine.precision.bf16.enabled else ""
            _save(os.path.join(tag_dir, f"{prefix}zero_pp_rank_{part[0]}_mp_rank_{stage:02d}_optim_states.pt"),
                  {"optimizer_state_dict": part[1], "ds_config": engine._config._param_dict,
                   "ds_version": DEEPSPEED_API_VERSION})
        own = stepper.rank_checkpoint_file() if stepper is not None else None
        if own is not None:  # state that differs between ranks (the 1-bit optimizers' compression errors)
            _save(os.path.join(tag_dir, own[0]), own[1])
        if dp_rank == 0:
            # DeepSpeed's param_shapes: per param group, the names the optimizer's positions stand for
            # (what lets another pipeline degree find each layer's optimizer state, optim_reshard.py)
            groups = stepper.model_param_groups() if stepper is not None else []
            state = {
                "module": None,
                "optimizer": stepper.model_file_state() if stepper is not None and part is None else None,
                "param_shapes": [OrderedDict((names[id(p)], p.shape) for p in ps if id(p) in names) for ps in groups],
                "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
                "sparse_tensor_module_names": set(),
                "skipped_steps": engine.skipped_steps,
                "global_steps": engine.global_steps,
                "global_samples": engine.global_samples,
                "dp_world_size": engine.dp_world_size,
                "mp_world_size": engine.num_stages,
                "ds_config": engine._config._param_dict,
                "ds_version": DEEPSPEED_API_VERSION,
                **client_state,
            }
            _save(os.path.join(tag_dir, _state_file(stage)), state)
        dist.barrier()
        if save_latest and dist.get_rank() == 0:
            with open(os.path.join(str(save_dir), "latest"), "w") as f:
                f.write(tag)
        dist.barrier()
        return True

    def load(self, engine: Any, load_dir: str, tag: Any, load_module_strict: bool, load_optimizer_states: bool,
             load_lr_scheduler_states: bool, load_module_only: bool, custom_load_fn: Any) -> tuple:
        from deepspeed_c.utils.logging import logger

        if custom_load_fn is not None:
            raise ValueError("custom_load_fn not supported w. pipeline parallelism")
        if tag is None:
            latest = os.path.join(str(load_dir), "latest")
            if not os.path.isfile(latest):
                logger.warning(f"Unable to find latest file at {latest}, if trying to load latest checkpoint please "
                               "ensure this file exists or pass an explicit checkpoint tag when loading a checkpoint.")
                return None, None
            with open(latest) as f:
                tag = f.read().strip()
        tag_dir = os.path.join(str(load_dir), str(tag))
        if not os.path.isdir(tag_dir):
            raise FileNotFoundError(f"load_checkpoint: checkpoint tag {tag!r} not found in {load_dir}")
        engine.module.load_state_dir(tag_dir, strict=load_module_strict)
        path = os.path.join(tag_dir, _state_file(engine.stage_id))
        if not os.path.isfile(path):
            path = os.path.join(tag_dir, _state_file(0))  # fewer stages saved than now: counters are shared
        state = torch.load(path, map_location="cpu", weights_only=False)
        stepper = engine.stepper
        if stepper is not None:
            if load_module_only or not load_optimizer_states:
                stepper.refresh_masters()
            else:
                self._load_optimizer(engine, tag_dir, state)
        if not load_module_only:
            if load_lr_scheduler_states and engine.lr_scheduler is not None and state.get("lr_scheduler"):
                engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
            engine.global_steps = state["global_steps"]
            engine.global_samples = state.get("global_samples", 0)
            engine.skipped_steps = state["skipped_steps"]
        ds_keys = {"module", "optimizer", "param_shapes", "lr_scheduler", "sparse_tensor_module_names", "skipped_steps",
                   "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version"}
        return path, {k: v for k, v in state.items() if k not in ds_keys}

    @staticmethod
    def _load_optimizer(engine: Any, tag_dir: str, state: dict) -> None:
        """The optimizer states: from this stage's files when the stage holds the layers it held when
        saved (ZeRO-1: the zero_pp_rank_{dp}_mp_rank_{stage} files, re-cut if the data-parallel degree
        differs); with another number of stages or partition, by parameter name (optim_reshard.py);
        where that cannot be done the optimizer starts fresh, with a warning."""
        from deepspeed_c.runtime.optimizer_seam import PlainOptimizer, SavedCheckpoint
        from deepspeed_c.runtime.precision import MixedPrecisionOptimizer
        from deepspeed_c.utils.logging import logger

        stepper, saved_stages = engine.stepper, state.get("mp_world_size")
        zero = engine.zero_optimization_stage() > 0
        saved_zero = state.get("optimizer") is None and any(
            n.endswith("_mp_rank_00_optim_states.pt") and "zero_pp_rank_" in n for n in os.listdir(tag_dir))
        if zero != saved_zero:
            raise ValueError(f"load_checkpoint: {tag_dir} was saved with {'ZeRO' if saved_zero else 'no ZeRO'} "
                             f"optimizer states, this engine runs zero_optimization.stage "
                             f"{engine.zero_optimization_stage()}; pass load_optimizer_states=False")
        names = {id(p): n for n, p in engine.module.named_parameters()}
        groups = [[names[id(p)] for p in ps] for ps in stepper.model_param_groups()]
        saved_names = state.get("param_shapes")
        # positions mean the same parameters when the stage holds the same layers as when saved (same
        # number of stages and, where the file names them, the same partition)
        if saved_stages == engine.num_stages and (saved_names is None or [list(g) for g in saved_names] == groups):
            saved = SavedCheckpoint(tag_dir=tag_dir, manifest=None, model_state=state,
                                    bf16=engine.precision.bf16.enabled,
                                    load_from_fp32_weights=bool(engine._config.zero_config.load_from_fp32_weights),
                                    node_local=False, mp_rank=engine.stage_id)
            stepper.load_checkpoint_state(saved, True)
            stepper.load_rank_checkpoint_file(saved)
            return
        from .optim_reshard import restore_by_name, restore_zero_by_name

        if zero:
            why = restore_zero_by_name(stepper, groups, tag_dir, int(saved_stages), engine.precision.bf16.enabled)
        elif isinstance(stepper, (PlainOptimizer, MixedPrecisionOptimizer)):
            why = restore_by_name(stepper, groups, tag_dir, int(saved_stages))
        else:
            why = f"{type(stepper).__name__} states cannot be re-partitioned by parameter name"
        if why is None:
            return
        logger.warning(f"load_checkpoint: {tag_dir} was saved with {saved_stages} pipeline stages, this engine has "
                       f"{engine.num_stages} (or another partition): weights re-partitioned, optimizer states not "
                       f"restored ({why})")
        stepper.refresh_masters()


def _save(path: str, obj: Any) -> None:
    from deepspeed_c.checkpoint import ds_pickle

    # a ZeRO file's loss scaler and stage are DeepSpeed objects: written under DeepSpeed's class names,
    # which the weights_only loaders (DeepSpeed's and checkpoint_zero's) accept
    pickler = {"pickle_module": ds_pickle} if ds_pickle.contains_stand_ins(obj) else {}
    tmp = path + ".tmp"
    torch.save(obj, tmp, **pickler)
    os.replace(tmp, path)
