"""Activation checkpointing (`deepspeed_c.checkpointing`, DeepSpeed's names and signatures).

checkpoint(function, *args) runs `function` without keeping its activations and runs it again in
backward. The recompute must draw the same random numbers as the forward (dropout masks), so the
CPU RNG, the accelerator RNG and the model-parallel tracker's named RNG states are captured before
the forward and reinstated around the recompute, then put back as backward found them.

Memory-layout options change only where saved inputs live, never the numbers: with a model-parallel `mpu`
(configure(mpu, ...)) `partition_activations` keeps each rank's 1/mp slice of the saved inputs and gathers
them for the recompute, `cpu_checkpointing` keeps the slices in host memory and
`contiguous_memory_optimization` in preallocated buffers of `number_checkpoints` slots (partition.py);
without a model-parallel group `checkpoint_in_cpu` moves the whole saved inputs to host memory."""
from __future__ import annotations

import contextlib
import json
import time
from typing import Any, Callable, Iterator, Optional

import torch

from deepspeed_c.runtime.activation_checkpointing import partition
from deepspeed_c.runtime.autograd_paths import transforms_active
from deepspeed_c.utils.logging import logger

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"

mpu: Any = None
num_layers: Optional[int] = None
PARTITION_ACTIVATIONS = False
CONTIGUOUS_CHECKPOINTING = False
CPU_CHECKPOINT = False
SYNCHRONIZE = False
PROFILE_TIME = False
_configured = False


# -- RNG -------------------------------------------------------------------------------------------
def _device_rng_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _get_device_rng_state() -> Optional[torch.Tensor]:
    return torch.cuda.get_rng_state() if _device_rng_available() else None


def _set_device_rng_state(state: Optional[torch.Tensor]) -> None:
    if state is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state)


def _device_generator_state() -> torch.Tensor:
    """The RNG the tracker forks: the accelerator's where there is one, else the CPU's."""
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()


def _set_device_generator_state(state: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class CudaRNGStatesTracker:
    """Named RNG states that code can fork into (model-parallel regions draw from their own stream)."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self.seeds_.add(seed)
        original = _device_generator_state()
        if torch.cuda.is_available():
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states_[name] = _device_generator_state()
        _set_device_generator_state(original)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        original = _device_generator_state()
        _set_device_generator_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _device_generator_state()
            _set_device_generator_state(original)


_CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    return _CUDA_RNG_STATE_TRACKER


def _tensor_rank() -> int:
    """The configured mpu's tensor-parallel rank, by DeepSpeed's preference: Megatron's
    get_tensor_model_parallel_rank, then get_slice_parallel_rank, then get_model_parallel_rank (under
    pipeline parallelism the model-parallel rank also counts stages, which share one tracker seed)."""
    if mpu is None:
        return 0
    for name in ("get_tensor_model_parallel_rank", "get_slice_parallel_rank", "get_model_parallel_rank"):
        if hasattr(mpu, name):
            return int(getattr(mpu, name)())
    return 0


def _seed_device(seed: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Default RNG: `seed` (same across the tensor-parallel group); tracker RNG: seed + 2718 + tensor
    rank (different within the tensor-parallel group, same across data parallel and pipeline stages)."""
    model_parallel_seed = seed + 2718 + _tensor_rank()
    _CUDA_RNG_STATE_TRACKER.reset()
    _seed_device(seed)
    _CUDA_RNG_STATE_TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, model_parallel_seed)


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    """Reseeds only the tracker's model-parallel stream with seed + 2718 + tensor rank (the default RNG is
    left as it is); Megatron-DeepSpeed calls it after loading a universal checkpoint at another degree."""
    with _CUDA_RNG_STATE_TRACKER.fork():
        _seed_device(seed + 2718 + _tensor_rank())


class _RNGSnapshot:
    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.device = _get_device_rng_state()
        self.tracker = _CUDA_RNG_STATE_TRACKER.get_states()

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        _set_device_rng_state(self.device)
        _CUDA_RNG_STATE_TRACKER.set_states(self.tracker)


# -- checkpoint --------------------------------------------------------------------------------------
_CONTIGUOUS = partition.ContiguousSlots()


def _partitioning() -> bool:
    """partition_activations acts with a model-parallel group of more than one rank (else a no-op)."""
    return bool(PARTITION_ACTIVATIONS and mpu is not None and mpu.get_model_parallel_world_size() > 1)


def _sync() -> None:
    if SYNCHRONIZE and torch.cuda.is_available():
        torch.cuda.synchronize()


class CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run_function: Callable, *args: Any) -> Any:
        _sync()
        start = time.perf_counter()
        ctx.run_function = run_function
        ctx.rng = _RNGSnapshot()
        ctx.devices = [a.device if torch.is_tensor(a) else None for a in args]
        ctx.partitioned = None
        if _partitioning():  # each model-parallel rank keeps its slice of the inputs (partition.py)
            saved, ctx.partitioned = partition.partition(list(args), mpu, CPU_CHECKPOINT,
                                                         _CONTIGUOUS if CONTIGUOUS_CHECKPOINTING else None, num_layers)
        else:
            saved = [a.detach().to("cpu") if CPU_CHECKPOINT and torch.is_tensor(a) else a for a in args]
        ctx.tensor_idx = [i for i, a in enumerate(saved) if torch.is_tensor(a)]
        ctx.others = [None if torch.is_tensor(a) else a for a in saved]
        ctx.save_for_backward(*[saved[i] for i in ctx.tensor_idx])
        with torch.no_grad():
            outputs = run_function(*args)
        if PROFILE_TIME:
            logger.info(f"activation checkpoint forward: {1e3 * (time.perf_counter() - start):.3f} ms")
        _sync()
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        # The recompute runs its own backward from detached inputs into the parameters' .grad: right only in a
        # backward that accumulates everything (as DeepSpeed's and torch's reentrant checkpoints)
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("deepspeed checkpointing.checkpoint (reentrant) is not compatible with "
                               "torch.autograd.grad() or when an `inputs` parameter is passed to .backward(); use "
                               ".backward() without inputs, or checkpointing.non_reentrant_checkpoint")
        if torch.is_grad_enabled():
            # its gradients would carry no graph back through the checkpointed inputs: missing second-order terms
            raise RuntimeError("deepspeed checkpointing.checkpoint (reentrant) does not support create_graph=True "
                               "(double backward, gradient penalties); use checkpointing.non_reentrant_checkpoint")
        start = time.perf_counter()
        args = list(ctx.others)
        for i, t in zip(ctx.tensor_idx, ctx.saved_tensors):
            args[i] = t
        if ctx.partitioned is not None:
            args = partition.gather(args, ctx.partitioned, mpu)
            if CONTIGUOUS_CHECKPOINTING:
                _CONTIGUOUS.release()
        for i in ctx.tensor_idx:
            t = args[i].to(ctx.devices[i]) if ctx.devices[i] is not None else args[i]
            args[i] = t.detach().requires_grad_(t.requires_grad or t.is_floating_point())
        now = _RNGSnapshot()
        ctx.rng.restore()
        try:
            with torch.enable_grad():
                outputs = ctx.run_function(*args)
        finally:
            now.restore()
        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad]
        if not pairs:
            raise RuntimeError("none of the checkpointed function's outputs requires grad")
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = tuple(a.grad if torch.is_tensor(a) else None for a in args)
        if PROFILE_TIME:
            logger.info(f"activation checkpoint backward: {1e3 * (time.perf_counter() - start):.3f} ms")
        return (None,) + input_grads


def checkpoint(function: Callable, *args: Any) -> Any:
    """Checkpoint a model or part of the model (reentrant, like DeepSpeed's and torch's original: its backward
    must be a plain `.backward()`; `autograd.grad`, `backward(inputs=...)` and `create_graph` raise). Under a
    torch.func transform it runs `function` as it is (no recompute). Inside a graph torch.compile is capturing
    it is torch's non-reentrant checkpoint, which dynamo captures whole: a reentrant recomputation would run
    after the compiled forward, outside the parameters its graph bound (DeepCompile's gathered units)."""
    if torch.compiler.is_compiling():
        from torch.utils.checkpoint import checkpoint as torch_checkpoint

        return torch_checkpoint(function, *args, use_reentrant=False)
    if transforms_active():  # torch.func (vmap, grad): the function itself, its activations kept
        return function(*args)
    return CheckpointFunction.apply(function, *args)


def non_reentrant_checkpoint(function: Callable, *args: Any) -> Any:
    """The same through torch's non-reentrant checkpoint (works when no input requires grad); the
    tracker's named RNG states are replayed as well as the CPU/accelerator ones."""
    before = _CUDA_RNG_STATE_TRACKER.get_states()
    ran = [False]

    def run(*a: Any) -> Any:
        if not ran[0]:
            ran[0] = True
            return function(*a)
        current = _CUDA_RNG_STATE_TRACKER.get_states()
        _CUDA_RNG_STATE_TRACKER.set_states(before)
        try:
            return function(*a)
        finally:
            _CUDA_RNG_STATE_TRACKER.set_states(current)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)


# -- configuration -----------------------------------------------------------------------------------
def _config_section(deepspeed_config: Any) -> Any:
    from deepspeed_c.runtime.config.sections import ActivationCheckpointingConfig

    if isinstance(deepspeed_config, str):
        with open(deepspeed_config) as f:
            deepspeed_config = json.load(f)
    if isinstance(deepspeed_config, dict):
        return ActivationCheckpointingConfig(**(deepspeed_config.get("activation_checkpointing") or {}))
    section = getattr(deepspeed_config, "activation_checkpointing_config", None)
    if section is None:
        raise TypeError(f"configure: deepspeed_config must be a path, a dict or a DeepSpeedConfig, "
                        f"got {type(deepspeed_config).__name__}")
    return section


def configure(mpu_: Any, deepspeed_config: Any = None, partition_activations: Optional[bool] = None,
              contiguous_checkpointing: Optional[bool] = None, num_checkpoints: Optional[int] = None,
              checkpoint_in_cpu: Optional[bool] = None, synchronize: Optional[bool] = None,
              profile: Optional[bool] = None) -> None:
    """Configure activation checkpointing; explicit arguments override `deepspeed_config`."""
    global mpu, num_layers, PARTITION_ACTIVATIONS, CONTIGUOUS_CHECKPOINTING, CPU_CHECKPOINT, SYNCHRONIZE
    global PROFILE_TIME, _configured
    # Validate the whole new setting first so a refused call leaves the previous one in force.
    cur = {"partition": PARTITION_ACTIVATIONS, "contiguous": CONTIGUOUS_CHECKPOINTING, "layers": num_layers,
           "cpu": CPU_CHECKPOINT, "sync": SYNCHRONIZE, "profile": PROFILE_TIME}
    if deepspeed_config is not None:
        section = _config_section(deepspeed_config)
        cur = {"partition": section.partition_activations, "contiguous": section.contiguous_memory_optimization,
               "layers": section.number_checkpoints, "cpu": section.cpu_checkpointing,
               "sync": section.synchronize_checkpoint_boundary, "profile": section.profile}
    for key, value in (("partition", partition_activations), ("contiguous", contiguous_checkpointing),
                       ("layers", num_checkpoints), ("cpu", checkpoint_in_cpu), ("sync", synchronize),
                       ("profile", profile)):
        if value is not None:
            cur[key] = value
    if cur["contiguous"] and not cur["partition"]:
        raise ValueError("contiguous_checkpointing (contiguous_memory_optimization) requires "
                         "partition_activations")
    if cur["contiguous"] and cur["layers"] is None:
        raise ValueError("contiguous_checkpointing requires num_checkpoints (number_checkpoints)")
    if cur["cpu"] and not cur["partition"]:
        raise ValueError("checkpoint_in_cpu (cpu_checkpointing) requires partition_activations")
    if cur["partition"] and (mpu_ is None or mpu_.get_model_parallel_world_size() <= 1):
        logger.warning("activation_checkpointing.partition_activations: no model-parallel group of more than one "
                       "rank was given to checkpointing.configure(mpu, ...), so the saved activations are not "
                       "partitioned (cpu_checkpointing still moves them to host memory)")
    mpu = mpu_
    PARTITION_ACTIVATIONS, CONTIGUOUS_CHECKPOINTING, num_layers = cur["partition"], cur["contiguous"], cur["layers"]
    CPU_CHECKPOINT, SYNCHRONIZE, PROFILE_TIME = cur["cpu"], cur["sync"], cur["profile"]
    _configured = True


def is_configured() -> bool:
    return _configured


def reset() -> None:
    """Drop buffers kept between a forward and its backward (call between evaluation forwards)."""


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    global PARTITION_ACTIVATIONS
    PARTITION_ACTIVATIONS = partition_activation


def set_num_layers(nlayers: int) -> None:
    global num_layers
    num_layers = nlayers
