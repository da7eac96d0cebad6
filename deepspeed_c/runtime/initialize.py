"""deepspeed_c.initialize and add_config_arguments, with DeepSpeed's signatures and rules."""
from __future__ import annotations

import argparse
from typing import Any, Callable, Optional, Union

import torch

from deepspeed_c.runtime.config import DeepSpeedConfig, _load
from deepspeed_c.utils.logging import log_dist, logger

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500

DeepSpeedOptimizerCallable = Callable[[Any], torch.optim.Optimizer]
DeepSpeedSchedulerCallable = Callable[[torch.optim.Optimizer], Any]


def initialize(args: Any = None,
               model: Optional[torch.nn.Module] = None,
               optimizer: Optional[Union[torch.optim.Optimizer, DeepSpeedOptimizerCallable]] = None,
               model_parameters: Any = None,
               training_data: Optional[torch.utils.data.Dataset] = None,
               lr_scheduler: Optional[Union[Any, DeepSpeedSchedulerCallable]] = None,
               distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
               mpu: Any = None,
               dist_init_required: Optional[bool] = None,
               collate_fn: Any = None,
               config: Any = None,
               mesh_param: Any = None,
               config_params: Any = None) -> tuple:
    """Build the training engine. Returns (engine, optimizer, training_dataloader, lr_scheduler);
    optimizer, dataloader and scheduler are None unless given or configured.

    The config comes from `args.deepspeed_config`, `config` or `config_params` (a dict, a JSON path,
    or base64 JSON); giving it both in args and as an argument is an error."""
    from deepspeed_c.version import __git_branch__, __git_hash__, __version__

    log_dist(f"DeepSpeed info: version={__version__}, git-hash={__git_hash__}, git-branch={__git_branch__}", ranks=[0])
    assert model is not None, "deepspeed.initialize requires a model"

    import deepspeed_c.comm as dist

    dist.init_distributed(dist_backend=None, distributed_port=distributed_port, dist_init_required=dist_init_required)

    if config is None and config_params is not None:
        config = config_params
    if getattr(args, "deepscale_config", None) is not None:
        logger.warning("************ --deepscale_config is deprecated, please use --deepspeed_config ************")
        if hasattr(args, "deepspeed_config"):
            assert args.deepspeed_config is None, \
                "Not sure how to proceed, we were given both a deepscale_config and deepspeed_config"
        args.deepspeed_config = args.deepscale_config
        args.deepscale_config = None
    if getattr(args, "deepspeed_config", None) is not None:
        assert config is None, ("Not sure how to proceed, we were given deepspeed configs in the deepspeed arguments "
                                "and deepspeed.initialize() function call")
        config = args.deepspeed_config
    assert config is not None, "DeepSpeed requires --deepspeed_config to specify configuration file"
    if not isinstance(config, dict):
        config = _load(config)
    if not _is_pipeline_module(model):  # a pipeline stage's parameters are the stage's, checked by its engine
        model_parameters = _require_trainable(model, model_parameters, optimizer, config)

    from deepspeed_c.runtime.sequence_parallel.engine_view import SequenceDataParallelView, sequence_parallel_mpu

    # Ulysses: an SP mpu (given, or built from mesh_param / data_parallel_size x sequence_parallel_size)
    sp_mpu = sequence_parallel_mpu(config, mpu, mesh_param)
    if (sp_mpu is not None or _is_pipeline_module(model)) and (config.get("hybrid_engine") or {}).get("enabled"):
        raise NotImplementedError("deepspeed_c: config key 'hybrid_engine.enabled' with a PipelineModule or Ulysses "
                                  "sequence parallelism is not built (the hybrid engine generates with a whole "
                                  "Hugging Face causal LM)")
    if sp_mpu is not None:
        if config.get("tensor_parallel", {}).get("autotp_size", 0) > 1 or _is_pipeline_module(model) or \
                any(hasattr(m, "set_deepspeed_parallelism") for m in model.modules()):
            raise NotImplementedError("deepspeed_c: Ulysses sequence parallelism combined with AutoTP "
                                      "(tensor_parallel.autotp_size), a PipelineModule or MoE layers is not built")
        from deepspeed_c.runtime.engine import DeepSpeedEngine

        config_class = DeepSpeedConfig(config, sp_mpu)  # batch arithmetic over world // sequence_parallel_size
        engine = DeepSpeedEngine(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                                 training_data=training_data, lr_scheduler=lr_scheduler,
                                 mpu=SequenceDataParallelView(sp_mpu), dist_init_required=dist_init_required,
                                 collate_fn=collate_fn, config=config, config_class=config_class)
        return (engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler)
    from deepspeed_c.runtime.tensor_parallel.autotp_setup import prepare_autotp

    # AutoTP (tensor_parallel.autotp_size / tp_model_init): shards the model, the engine gets the (data, tensor) mpu
    # the client's optimizer and parameter list follow the weights AutoTP replaces with their shards
    model, mpu, model_parameters = prepare_autotp(model, config, mpu, pipeline=_is_pipeline_module(model),
                                                  optimizer=optimizer, model_parameters=model_parameters)
    if _is_pipeline_module(model):
        from deepspeed_c.runtime.pipe.engine import DataParallelView, PipelineEngine

        assert mpu is None, "mpu must be None with pipeline parallelism"
        view = DataParallelView(model.mpu())  # the stage's data-parallel group
        engine = PipelineEngine(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                                training_data=training_data, lr_scheduler=lr_scheduler, mpu=view,
                                dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                                config_class=DeepSpeedConfig(config, view))
        return (engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler)

    from deepspeed_c.runtime.engine import DeepSpeedEngine

    # AutoTP: DeepSpeed builds the config without an mpu, so its batch arithmetic (train_batch_size = micro x
    # accumulation x world) counts every rank, as the Hugging Face Trainer's "auto" batch sizes do; the
    # engine's data-parallel size still comes from the AutoTP mpu
    config_class = DeepSpeedConfig(config, None if getattr(mpu, "autotp", False) else mpu)
    engine_class = DeepSpeedEngine
    if config_class.hybrid_engine.enabled:  # training and generation in one engine (RLHF)
        from deepspeed_c.runtime.hybrid_engine import DeepSpeedHybridEngine

        engine_class = DeepSpeedHybridEngine
    engine = engine_class(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                          training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                          dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                          config_class=config_class)
    return (engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler)


def _builds_optimizer(optimizer: Any, config: dict) -> bool:
    """Whether initialize will make an optimizer over model_parameters (from the config or a callable)."""
    if optimizer is not None:
        return callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer)
    section = config.get("optimizer")
    return isinstance(section, dict) and isinstance(section.get("type"), str) and section["type"] != "auto"


def _group_trains(item: Any) -> tuple[Any, bool]:
    """(item, whether it holds a tensor that requires grad) for one entry of model_parameters: a tensor,
    a (name, tensor) pair or a param-group dict (its "params" made a list so checking does not consume it)."""
    if isinstance(item, dict):
        params = item.get("params", [])
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        return dict(item, params=params), any(_group_trains(p)[1] for p in params)
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
        return item, item[1].requires_grad
    return item, isinstance(item, torch.Tensor) and item.requires_grad


def _require_trainable(model: torch.nn.Module, model_parameters: Any, optimizer: Any, config: dict) -> Any:
    """Refuses to build an optimizer over nothing trainable, naming the cause (torch would only say
    "optimizer got an empty parameter list", and a frozen list would train nothing, silently). Returns
    model_parameters, made a list when it was an iterator (checking must not use it up)."""
    if not _builds_optimizer(optimizer, config):
        return model_parameters  # no optimizer (evaluation, inference): a frozen model is fine
    given = model_parameters is not None
    if given:
        checked = [_group_trains(p) for p in model_parameters]
        model_parameters = [p for p, _ in checked]
        if any(trains for _, trains in checked):
            return model_parameters
        found = ("model_parameters is empty (did a requires_grad filter leave nothing?)" if not checked else
                 f"none of the {len(checked)} entries of model_parameters has requires_grad=True")
    else:
        params = list(model.parameters())
        if any(p.requires_grad for p in params):
            return model_parameters
        found = (f"{type(model).__name__} has no parameters" if not params else
                 f"all {len(params)} parameters of {type(model).__name__} have requires_grad=False")
    what = (f"the config's optimizer '{config['optimizer']['type']}'" if optimizer is None
            else "the optimizer callable")
    raise ValueError(
        f"deepspeed_c.initialize: the model has no trainable parameters: {found}, so {what} would have "
        "nothing to update. Expected at least one parameter with requires_grad=True: unfreeze what should "
        "train (param.requires_grad_(True)) before initialize, or, to evaluate only, give no optimizer (no "
        "'optimizer' section in the config, no optimizer argument).")


def _is_pipeline_module(model: Any) -> bool:
    return any(cls.__name__ == "PipelineModule" for cls in type(model).__mro__)


def _add_core_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="Deprecated DeepSpeed json configuration file.")
    return parser


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds --deepspeed and --deepspeed_config (and the deprecated --deepscale forms) to parser."""
    return _add_core_arguments(parser)
