"""deepspeed.inference.engine.InferenceEngine: what init_inference returns.

Set-up order (each step a collaborator): dtype conversion (deferred to quantization when weights are
quantized) -> tensor-parallel group -> one of
  1. the user's injection_policy without kernel injection (AutoTP with the named row-parallel layers),
  2. kernel injection (module_inject.kernel_inject.inject: decoders whole, per TP rank; encoder layers;
     an architecture without kernels falls back to AutoTP with a warning naming it),
  3. AutoTP when tensor_parallel.tp_size > 1
-> checkpoint files loaded shard by shard (or a save_mp_checkpoint_path folder: the model prepared as
saved, then each rank's own files: mp_checkpoint) -> MoE experts sharded (moe_inference) -> weights
quantized (quant section / int8) -> sharded checkpoint written (save_mp_checkpoint_path) -> ZeRO-Inference
layer streaming (zero_inference) -> the module moved to the accelerator (unless keep_module_on_host).
`module` is the (sharded / injected) model; forward, __call__ and generate pass
through to it, so `pipeline("text-generation", model=engine.module, ...)` works on every rank."""
from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
from torch import nn

from deepspeed_c import comm as dist
from deepspeed_c.inference import moe_inference, mp_checkpoint, zero_inference
from deepspeed_c.inference.checkpoint_loader import checkpoint_files, load_checkpoint_shards
from deepspeed_c.inference.config import DeepSpeedInferenceConfig
from deepspeed_c.inference.quantize import COMPUTE_DTYPE, quantize_weights_int8
from deepspeed_c.module_inject import quant_linear
from deepspeed_c.module_inject.quant_linear import QuantSpec


class InferenceEngine(nn.Module):
    """DeepSpeed's inference wrapper: holds the prepared model as `module`."""

    inference_mp_group = None  # DeepSpeed's class attribute: the last TP group made
    # (default process group, tp_size) -> this rank's group (new_group is collective: make each once per
    # process group; a re-initialised torch.distributed gets new ones)
    _groups: dict[tuple[int, int], Any] = {}

    def __init__(self, model: nn.Module, config: DeepSpeedInferenceConfig) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"init_inference: model must be a torch.nn.Module, got {type(model).__name__}")
        self.module = model
        self._config = config
        self.injected = False
        # DeepSpeed's engine.config is the model's own config (config.config, "args", when given)
        self.config = getattr(model, "config", None) if config.config is None else config.config
        self.compute_dtype = COMPUTE_DTYPE if config.dtype == torch.int8 else config.dtype
        self._check_dtype(self.compute_dtype)
        self.quant = QuantSpec.from_config(config.quant, config.dtype)
        self._offload = zero_inference.parse(config.zero)
        self.streamer = None
        if config.dtype in (torch.float16, torch.bfloat16, torch.float32) and self.quant is None:
            model.to(config.dtype)  # floating tensors only: integer buffers keep their dtype
        self.mp_group = self._tp_group(config)
        self.mp_world_size = dist.get_world_size(self.mp_group) if self.mp_group is not None else 1
        desc = mp_checkpoint.read_description(config.checkpoint) if config.checkpoint is not None else None
        if mp_checkpoint.is_sharded(desc):
            self._prepare_sharded(desc)
        else:
            self._prepare(checkpoint_files(desc, config.base_dir) if desc is not None else None)
        if config.enable_cuda_graph and self.mp_world_size > 1:
            self._check_tp_graphs()
        moe = moe_inference.parse(config)
        if moe is not None:
            moe_inference.prepare(self.module, moe)
        self._quantize()
        save_to = config.save_mp_checkpoint_path or config.checkpoint_config.save_mp_checkpoint_path
        if save_to:
            mp_checkpoint.save(self.module, save_to, self.mp_group, config.dtype, self.injected)
        if self._offload is not None:
            self._stream_layers()
        self._to_device()
        if self.mp_world_size > 1:
            self._sync_rng()

    # ---- set-up --------------------------------------------------------------------------------------
    @staticmethod
    def _check_dtype(dtype: torch.dtype) -> None:
        from deepspeed_c.accelerator import get_accelerator

        acc = get_accelerator()
        if dtype not in acc.supported_dtypes():
            raise ValueError(f"init_inference: dtype={dtype} is not supported by the {acc.device_name()} accelerator "
                             f"(supported: {acc.supported_dtypes()})")

    def _tp_group(self, config: DeepSpeedInferenceConfig) -> Any:
        tp = config.tensor_parallel
        if tp.mpu is not None:
            group = tp.mpu.get_model_parallel_group()
            tp.tp_size = dist.get_world_size(group)
            return group
        if tp.tp_group is not None:
            tp.tp_size = dist.get_world_size(tp.tp_group)
            return tp.tp_group
        if tp.tp_size == 1:  # tensor_parallel.enabled is read by nothing in DeepSpeed's engine either
            return None
        if not dist.is_initialized():
            dist.init_distributed()
        world = dist.get_world_size()
        if world % tp.tp_size != 0:
            raise ValueError(f"init_inference: tensor_parallel.tp_size={tp.tp_size} does not divide the world size "
                             f"{world}: launch a multiple of tp_size processes (deepspeed --num_gpus N)")
        key = (id(torch.distributed.group.WORLD), tp.tp_size)
        if key not in InferenceEngine._groups:
            # consecutive ranks form a group (DeepSpeed makes ranks 0..tp_size-1 one group; with more ranks each
            # further block of tp_size ranks is a replica)
            mine = None
            for start in range(0, world, tp.tp_size):
                group = dist.new_group(list(range(start, start + tp.tp_size)))
                if start <= dist.get_rank() < start + tp.tp_size:
                    mine = group
            InferenceEngine._groups[key] = mine
        InferenceEngine.inference_mp_group = InferenceEngine._groups[key]
        tp.tp_group = InferenceEngine.inference_mp_group
        return tp.tp_group

    def _prepare(self, files: Optional[list[str]]) -> None:
        cfg = self._config
        if cfg.injection_policy and not cfg.replace_with_kernel_inject:
            self._autotp(cfg.injection_policy, files)
            return
        if cfg.injection_policy:
            _check_kernel_policy(self.module, cfg.injection_policy)
        if cfg.replace_with_kernel_inject:
            if files is not None:  # the fused blocks take their weights from the loaded Hugging Face modules
                load_checkpoint_shards(self.module, files, cfg.dtype)
                files = None
            injected = self._inject()
            if injected is not None:
                self.module, self.injected = injected, True
                return
            arch = _architecture(self.module)
            warnings.warn(f"init_inference: replace_with_kernel_inject=True, but deepspeed_c has no fused kernels for "
                          f"{arch}; running it with AutoTP (tensor_parallel.tp_size={self.mp_world_size}) instead",
                          stacklevel=4)
        if self.mp_world_size > 1:
            self._autotp(None, files)
        elif files is not None:
            load_checkpoint_shards(self.module, files, cfg.dtype)
        elif cfg.enable_cuda_graph and torch.cuda.is_available():
            raise NotImplementedError("init_inference: enable_cuda_graph=True is built for kernel-injected models only "
                                      "(replace_with_kernel_inject=True on a supported architecture)")

    def _check_tp_graphs(self) -> None:
        """enable_cuda_graph with tp_size > 1: the injected decoder captures its decode step with the two
        all-reduces of every block inside; only NCCL collectives can be captured in a CUDA graph."""
        tp = self.mp_world_size
        if not self.injected:
            raise ValueError(f"init_inference: enable_cuda_graph=True with tensor_parallel.tp_size={tp} needs "
                             "replace_with_kernel_inject=True on a supported decoder (the kernel-injected decode "
                             "step captures its all-reduces; AutoTP's sharded layers are not captured)")
        backend = str(torch.distributed.get_backend(self.mp_group)).lower()  # "nccl", or e.g. "cpu:gloo,cuda:nccl"
        if "nccl" not in backend:
            raise ValueError(f"init_inference: enable_cuda_graph=True with tensor_parallel.tp_size={tp} captures the "
                             f"tensor-parallel all-reduces in a CUDA graph, which needs the nccl backend; the group's "
                             f"backend is {backend!r}: use dist_backend='nccl' or enable_cuda_graph=False")

    def _stream_layers(self) -> None:
        """ZeRO-Inference: the layers' weights leave for the host / NVMe; the rest goes to the device."""
        if self.mp_world_size > 1:
            raise NotImplementedError("init_inference: zero (ZeRO-Inference) with tensor_parallel.tp_size > 1 is not "
                                      "built; it streams the layers of one model copy on one accelerator")
        if self._config.enable_cuda_graph:
            raise ValueError("init_inference: zero (ZeRO-Inference) and enable_cuda_graph=True cannot be combined: a "
                             "replayed graph would skip the hooks that stream each layer's weights in")
        if self._config.keep_module_on_host:
            raise ValueError("init_inference: zero (ZeRO-Inference) and keep_module_on_host=True contradict each "
                             "other: "
                             "ZeRO-Inference streams the layers to the accelerator")
        from deepspeed_c.accelerator import get_accelerator

        self.streamer = zero_inference.LayerStreamer(self.module, self._offload,
                                                     torch.device(get_accelerator().current_device_name()))

    def _quantize(self) -> None:
        """After sharding and loading (the weights are final), from the weights as loaded (fp32 or wider)."""
        spec, cfg = self.quant, self._config
        if spec is None:
            return
        if self.injected:
            quant_linear.quantize_blocks(self.module, spec, self.compute_dtype)
        elif not cfg.quant and cfg.dtype == torch.int8:
            quantize_weights_int8(self.module)  # dtype=torch.int8 alone: per-channel, TP-aware scales
        elif self.mp_world_size > 1:
            raise NotImplementedError("init_inference: the quant section with AutoTP (tensor_parallel.tp_size > 1, "
                                      "no kernel injection) is not built; use replace_with_kernel_inject=True, or "
                                      "dtype=torch.int8 alone")
        else:
            quant_linear.quantize_linears(self.module, spec, self.compute_dtype)

    def _inject(self):
        from deepspeed_c.module_inject import kernel_inject

        # quantized runs keep the loaded (fp32) weights until _quantize rounds them
        return kernel_inject.inject(self.module, self._config, self.mp_group,
                                    None if self.quant is not None else self._config.dtype)

    def _prepare_sharded(self, desc: dict) -> None:
        """A save_mp_checkpoint_path folder: the model is prepared as when it was saved (on the meta device it
        stays unallocated), then each rank reads only its own files."""
        cfg = self._config
        mp_checkpoint.check(desc, self.mp_world_size, cfg.replace_with_kernel_inject)
        mp_checkpoint.real_buffers(self.module)  # rotary tables (never saved; kernel injection reads them)
        if cfg.replace_with_kernel_inject:
            injected = self._inject()
            if injected is None:
                raise ValueError(f"init_inference: the checkpoint holds kernel-injected weights but deepspeed_c has no "
                                 f"fused kernels for {_architecture(self.module)}")
            self.module, self.injected = injected, True
        elif self.mp_world_size > 1 or cfg.injection_policy:
            self._autotp(cfg.injection_policy, None)
        if self.quant is not None:  # the files hold quantized weights: the model takes that form first
            self._quantize()
            self.quant = None
        rank = dist.get_rank(self.mp_group) if self.mp_group is not None else 0
        mp_checkpoint.load(self.module, desc, rank, cfg.base_dir, run_tp=self.mp_world_size)

    def _autotp(self, policy: Optional[dict], files: Optional[list[str]]) -> None:
        from deepspeed_c.module_inject.auto_tp_inference import shard_for_inference

        if self.mp_group is None:  # an injection_policy without tensor parallelism: nothing to split
            if policy:
                from deepspeed_c.module_inject.auto_tp_inference import policy_plan

                policy_plan(self.module, policy)  # still validated: a layer name that matches nothing raises
            if files is not None:
                load_checkpoint_shards(self.module, files, self._config.dtype)
            return
        shard_for_inference(self.module, self.mp_group, policy)
        if files is not None:
            load_checkpoint_shards(self.module, files, self._config.dtype)

    def _to_device(self) -> None:
        if self._config.keep_module_on_host:
            return
        from deepspeed_c.accelerator import get_accelerator

        device = get_accelerator().current_device_name()
        meta = [n for n, p in self.module.named_parameters() if p.is_meta]
        if meta:
            raise ValueError(f"init_inference: parameters {meta[:6]} are still on the meta device: give their values "
                             "with `checkpoint`")
        self.module.to(device)

    def _sync_rng(self) -> None:
        """Every rank of a TP group samples the same tokens: the group's first rank's RNG state is broadcast."""
        src = dist.get_global_rank(self.mp_group, 0)
        # NCCL moves device tensors only: there the host generator's state travels through the accelerator
        nccl = str(torch.distributed.get_backend(self.mp_group)).lower() == "nccl"
        state = torch.get_rng_state()
        state = state.to(torch.device("cuda", torch.cuda.current_device())) if nccl else state
        dist.broadcast(state, src, group=self.mp_group)
        torch.set_rng_state(state.cpu())
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            cuda_state = torch.cuda.get_rng_state().to(torch.cuda.current_device())
            dist.broadcast(cuda_state, src, group=self.mp_group)
            torch.cuda.set_rng_state(cuda_state.cpu())

    # ---- serving -------------------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        """Anything else is the model's (device, generation_config, can_generate...), so DeepSpeed's tutorial
        pattern `pipe.model = init_inference(pipe.model, ...)` keeps a Hugging Face pipeline working."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
            return getattr(module, name)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)

    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        if not hasattr(self.module, "generate"):
            raise AttributeError(f"{type(self.module).__name__} has no generate()")
        if hasattr(self.module, "reset_cache"):
            self.module.reset_cache()
        config = kwargs.get("generation_config")
        beams = kwargs.get("num_beams", getattr(config, "num_beams", 1) if config is not None else 1)
        if self.injected and beams and beams > 1:
            raise NotImplementedError(f"init_inference: num_beams={beams} with kernel injection: the fused blocks' "
                                      "KV cache serves greedy and sampled decoding (num_beams=1) only")
        ids = kwargs.get("input_ids", inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None)
        self._check_length(ids, kwargs, config)
        return self.module.generate(*inputs, **kwargs)

    def _check_length(self, ids: Optional[torch.Tensor], kwargs: dict, config: Any) -> None:
        limit = self._config.max_out_tokens
        if ids is None or ids.dim() != 2:
            return
        if ids.shape[-1] > limit:
            raise RuntimeError(f"Input with size {ids.shape[-1]} exceeds maximum length of {limit} (max_out_tokens="
                               f"{limit}). Please increase max_tokens in the DeepSpeed Inference Config.")
        new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None) if config is not None else None)
        total = ids.shape[-1] + new if new is not None else kwargs.get("max_length")
        if self.injected and total is not None and total > limit:
            # the fused blocks' KV cache holds max_out_tokens positions: past it a token would be wrong
            raise RuntimeError(f"init_inference: prompt ({ids.shape[-1]} tokens) plus generated tokens reach {total}, "
                               f"past the KV cache of max_out_tokens={limit}; raise max_out_tokens (max_tokens)")

    def destroy(self) -> None:
        """DeepSpeed releases its kernel workspace here; ours lives in the injected module."""


def _architecture(model: nn.Module) -> str:
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    return f"{type(model).__name__} (model_type={kind!r})" if kind else type(model).__name__


def _check_kernel_policy(model: nn.Module, policy: dict) -> None:
    """With replace_with_kernel_inject=True an injection_policy's keys name the layer classes to replace
    (its values, DeepSpeed policy classes or layer names, say how DeepSpeed maps them; ours are built in).
    Every key must be a layer class of the model that has kernels here."""
    from deepspeed_c.module_inject.fused_encoder import ENCODER_TYPES

    kind = getattr(getattr(model, "config", None), "model_type", None)
    for cls in policy:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(f"injection_policy: key {cls!r} is not a subclass of torch.nn.Module")
        if not any(isinstance(m, cls) for m in model.modules()):
            raise ValueError(f"injection_policy: {type(model).__name__} has no module of class {cls.__name__}")
        if kind not in ENCODER_TYPES and kind is not None:
            # decoders are injected whole: a key must be one of its blocks
            blocks = {type(m) for m in model.modules() if type(m).__name__.endswith(("Block", "DecoderLayer"))}
            if cls not in blocks:
                raise ValueError(f"injection_policy with replace_with_kernel_inject=True: {cls.__name__} is not a "
                                 f"transformer block of {type(model).__name__} (kernel injection replaces whole "
                                 "blocks)")
