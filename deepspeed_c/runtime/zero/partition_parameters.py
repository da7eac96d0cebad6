"""ZeRO-3 parameter partitioning: DeepSpeed's `zero.Init`, `GatheredParameters`, the partitioned
parameter contract and external parameters.

A partitioned parameter stays the same `nn.Parameter` object; its data is an empty placeholder
(`numel() == 0`) except while gathered, and it carries DeepSpeed's attributes: `ds_id`, `ds_numel`,
`ds_shape`, `ds_status` (ZeroParamStatus), `ds_tensor` (this rank's shard, a view into the flat
storage of runtime/zero/param_store.ParamStore), `ds_persist`, and the methods `all_gather()`,
`all_gather_coalesced(params)`, `partition()` and `partition_numel()`. Under `zero.Init` each module's
own parameters are partitioned as soon as its constructor returns (broadcast from rank 0 first, so every
rank holds the same model), so the whole model never exists on one rank; `deepspeed_c.initialize` then
moves the shards into the engine's layout (runtime/zero/stage3.py)."""
from __future__ import annotations

import functools
import itertools
import json
import os
import types
from typing import Any, Iterable, Optional

import torch

from deepspeed_c.runtime.zero.param_store import UNIT_ATTR, ParamStore, ZeroParamStatus

__all__ = ["ZeroParamStatus", "Init", "GatheredParameters", "register_external_parameter",
           "unregister_external_parameter", "is_zero_param"]

EXTERNAL_ATTR = "_dsc_external_params"
_ds_ids = itertools.count()


def is_zero_param(p: Any) -> bool:
    return isinstance(p, torch.Tensor) and hasattr(p, UNIT_ATTR)


def _home(p: torch.nn.Parameter) -> tuple[ParamStore, int]:
    store, unit = getattr(p, UNIT_ATTR)
    return store, unit


def adopt(store: ParamStore) -> None:
    """Gives every parameter of `store` DeepSpeed's attributes and points it at its shard."""
    status = ZeroParamStatus.AVAILABLE
    for u, members in enumerate(store.unit_params):
        for p, _ in members:
            if not hasattr(p, "ds_shape"):
                p.ds_shape, p.ds_numel = p.shape, p.numel()
            if not hasattr(p, "ds_id"):
                p.ds_id = next(_ds_ids)
                p.all_gather = functools.partial(_param_all_gather, p)
                p.all_gather_coalesced = functools.partial(_param_all_gather_coalesced, p)
                p.partition = functools.partial(_param_partition, p)
                p.partition_numel = functools.partial(_param_partition_numel, p)  # Lightning's model summary
            setattr(p, UNIT_ATTR, (store, u))
            p.ds_persist = store.persistent[u]
            p.ds_status = status if store.is_live(u) else ZeroParamStatus.NOT_AVAILABLE
    for g, params in enumerate(store.groups):
        for i, p in enumerate(params):
            pieces = store.local_pieces(g, i)
            ls, n = (pieces[0][1], pieces[0][2]) if pieces else (0, 0)
            p.ds_tensor = store.shards[g].narrow(0, ls, n)


def _param_all_gather(p: torch.nn.Parameter, param_list: Optional[list] = None, async_op: bool = False,
                      hierarchy: int = 0) -> None:
    _gather(param_list if param_list is not None else [p])


class GatheredHandle:
    """What `all_gather_coalesced` returns: the gather has completed by then (the store waits on it), so
    wait() has nothing left to do; it is there for code written against DeepSpeed's asynchronous handle."""

    def wait(self, handle_dependency: bool = True) -> None:
        return None


def _param_all_gather_coalesced(p: torch.nn.Parameter, params: Iterable[torch.nn.Parameter], safe_mode: bool = False,
                                quantize: bool = False) -> GatheredHandle:
    """DeepSpeed's `param.all_gather_coalesced(params)`: every parameter in `params` gathered (AVAILABLE
    until `partition()`), whichever parameter the method is called on."""
    _gather(list(params))
    return GatheredHandle()


def _param_partition_numel(p: torch.nn.Parameter) -> int:
    """This rank's share of the parameter's elements."""
    return int(p.ds_tensor.numel())


def _param_partition(p: torch.nn.Parameter, param_list: Optional[list] = None, hierarchy: int = 0,
                     has_been_updated: bool = False, free_data: bool = True) -> None:
    for q in (param_list if param_list is not None else [p]):
        store, u = _home(q)
        if has_been_updated and store.is_live(u):
            store.write_back(u)
        store.release([u])


def _units(params: Iterable[torch.nn.Parameter]) -> dict[ParamStore, list[int]]:
    by_store: dict[ParamStore, list[int]] = {}
    for p in params:
        store, u = _home(p)
        units = by_store.setdefault(store, [])
        if u not in units:
            units.append(u)
    return by_store


def _gather(params: Iterable[torch.nn.Parameter]) -> None:
    for store, units in _units(params).items():
        if store.early:
            store.drop_early(units)
        store.wait(units)


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """`parameter` (owned by another module) is used in `module`'s forward: gather it with module's own."""
    if not isinstance(parameter, torch.nn.Parameter):
        raise RuntimeError("Parameter is not a torch.nn.Parameter")
    external = module.__dict__.setdefault(EXTERNAL_ATTR, {})
    external[id(parameter)] = parameter


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    if not isinstance(parameter, torch.nn.Parameter):
        raise RuntimeError("Parameter is not a torch.nn.Parameter")
    external = module.__dict__.get(EXTERNAL_ATTR, {})
    if id(parameter) not in external:
        raise RuntimeError(f"Parameter {getattr(parameter, 'ds_id', '')} is not a registered external parameter "
                           f"of {type(module).__name__}")
    del external[id(parameter)]


def external_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return list(module.__dict__.get(EXTERNAL_ATTR, {}).values())


# -- GatheredParameters -----------------------------------------------------------------------------
class GatheredParameters:
    """Gathers ZeRO-3 parameters for the duration of the context (others pass through). With
    `modifier_rank`, that rank's values are broadcast to every rank on exit and re-partitioned."""

    def __init__(self, params: Any, modifier_rank: Optional[int] = None, fwd_module: Any = None,
                 enabled: bool = True) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        elif params is None:
            params = []
        self.params = [p for p in params if is_zero_param(p)]
        self.enabled = enabled and bool(self.params)
        self.modifier_rank = modifier_rank
        if self.enabled and modifier_rank is not None:
            world = self._world()
            if not isinstance(modifier_rank, int) or not 0 <= modifier_rank < world:
                raise ValueError(f"GatheredParameters: modifier_rank={modifier_rank!r} is not a rank of the "
                                 f"parameters' data-parallel group (0..{world - 1})")
        self._was_live: dict[ParamStore, set[int]] = {}

    def _world(self) -> int:
        store, _ = _home(self.params[0])
        return store.world_size

    def __enter__(self) -> "GatheredParameters":
        if not self.enabled:
            return self
        for store, units in _units(self.params).items():
            if store.early:
                store.drop_early(units)
            private = self.modifier_rank is None and store.aliased
            if private:  # a view of the shard would keep edits DeepSpeed drops: gather copies, drop them on exit
                store.release(units)
            self._was_live[store] = set() if private else {u for u in units if store.is_live(u)}
            store.wait(units, private)
            for u in units:
                store.pins[u] += 1
        return self

    @torch.no_grad()
    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        import torch.distributed as dist

        by_store = _units(self.params)
        failed = exc[0] is not None
        for store, units in by_store.items():
            for u in units:
                store.pins[u] -= 1
            if self.modifier_rank is not None and not failed:
                src = self.modifier_rank if store.group is None else dist.get_global_rank(store.group,
                                                                                            self.modifier_rank)
                for u in units:
                    _adopt_replaced_data(store, u)
                    full = store.full[u]
                    assert full is not None
                    if store.world_size > 1:
                        dist.broadcast(full, src, group=store.group)
                    store.write_back(u)
            store.release([u for u in units if u not in self._was_live[store] and store.pins[u] == 0])


def _adopt_replaced_data(store: ParamStore, u: int) -> None:
    """A parameter whose .data the user replaced inside the context: its value copied into the unit."""
    full = store.full[u]
    assert full is not None
    base = full.data_ptr()
    for p, off in store.unit_params[u]:
        if p.data.data_ptr() == base + off * full.element_size() and p.data.numel() == p.ds_numel:
            continue
        if p.data.numel() != p.ds_numel:
            raise ValueError(f"GatheredParameters: parameter {p.ds_id} of shape {tuple(p.ds_shape)} was given data of "
                             f"shape {tuple(p.data.shape)}; ZeRO-3 parameters keep their size")
        full[off:off + p.ds_numel].copy_(p.data.reshape(-1))
        p.data = full[off:off + p.ds_numel].view(p.ds_shape)


# -- zero.Init ------------------------------------------------------------------------------------
_init_depth = 0
_init_stack: list["Init"] = []
_patched: dict[type, Any] = {}

# DeepSpeed's Init also swaps torch's tensor constructors for wrappers made by the function below, so
# tensors a constructor creates land on the device in the config's dtype. Ours does not (it casts and
# moves parameters when their module is partitioned; buffers keep the dtype they were built with), but
# callers reach for these names: transformers' prevent_arange_dtype_change swaps the wrapper factory
# around zero.Init and compares against the original arange.
_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn: Any, target_fp_dtype: torch.dtype,
                                           target_device: Any = None) -> Any:
    """`fn` (a tensor constructor) returning its floating-point results in `target_fp_dtype` on
    `target_device` (default: the accelerator's current device) when no device was passed."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None:
            from deepspeed_c.accelerator import get_accelerator

            kwargs["device"] = torch.device(target_device if target_device is not None
                                            else get_accelerator().current_device_name())
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor

    return wrapped


def _config_dict(config_dict_or_path: Any, config: Any) -> Optional[dict]:
    cfg = config_dict_or_path if config_dict_or_path is not None else config
    if cfg is None:
        return None
    if isinstance(cfg, (str, os.PathLike)):
        with open(cfg) as f:
            return json.load(f)
    if isinstance(cfg, dict):
        return cfg
    raw = getattr(cfg, "user_dict", None)  # a DeepSpeedConfig: the config as the user gave it
    if isinstance(raw, dict):
        return raw
    raise TypeError(f"zero.Init: config_dict_or_path must be a dict, a JSON path or a DeepSpeedConfig, got "
                    f"{type(cfg).__name__}")


def _enabled(section: Any) -> bool:
    return isinstance(section, dict) and section.get("enabled") is True  # "auto" is not decided yet: off


def _init_dtype(cfg: Optional[dict], dtype: Optional[torch.dtype]) -> torch.dtype:
    """DeepSpeed's rule: the config's bf16/fp16 section, else fp32; without a config the given dtype, or
    the accelerator's 16-bit type."""
    from deepspeed_c.accelerator import get_accelerator

    if cfg is not None and dtype is None:
        bf16 = _enabled(cfg.get("bf16")) or _enabled(cfg.get("bfloat16"))
        fp16 = _enabled(cfg.get("fp16"))
        if bf16 and fp16:
            raise RuntimeError("bfloat16 and fp16 cannot be enabled at once")
        return torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32
    if dtype is not None:
        return dtype
    acc = get_accelerator()
    if acc.is_fp16_supported():
        return torch.float16
    return torch.bfloat16 if acc.is_bf16_supported() else torch.float32


class Init:
    """Builds modules with their parameters partitioned over the data-parallel group (DeepSpeed's
    signature). Also a decorator-free context for Hugging Face `from_pretrained`."""

    def __init__(self, module: Optional[torch.nn.Module] = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: Any = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: Optional[torch.dtype] = None, mpu: Any = None, zero_param_parallel_group: Any = None,
                 zero_quantized_weights: bool = False, zero_quantized_nontrainable_weights: bool = False,
                 sequence_data_parallel_group: Any = None, param_swapper: Any = None) -> None:
        self.enabled = enabled
        if not enabled:
            return
        # zero_quantized_weights / zero_quantized_nontrainable_weights: accepted; ZeRO++ quantizes the
        # gathers of the engine's gather-on-use (its config's keys decide, runtime/zero/zeropp.py), while
        # the gathers Init and GatheredParameters make stay exact, as DeepSpeed's do
        if param_swapper is not None:
            raise NotImplementedError("deepspeed_c: zero.Init(param_swapper=...) is not supported; NVMe parameter "
                                      "offload comes from the config's offload_param section")
        import deepspeed_c.comm as dist

        if not dist.is_initialized():
            dist.init_distributed()
        cfg = _config_dict(config_dict_or_path, config)
        self.dtype = _init_dtype(cfg, dtype)
        if data_parallel_group is None and mpu is not None:
            data_parallel_group = mpu.get_data_parallel_group()
        if data_parallel_group is None and zero_param_parallel_group is not None:
            data_parallel_group = zero_param_parallel_group
        self.group = data_parallel_group
        self.rank = dist.get_rank(group=self.group)
        self.world_size = dist.get_world_size(group=self.group)
        from deepspeed_c.accelerator import get_accelerator

        self.compute_device = torch.device(get_accelerator().current_device_name())
        offload = ((cfg or {}).get("zero_optimization") or {}).get("offload_param") or {}
        if remote_device is None and isinstance(offload, dict) and offload.get("device") in ("cpu", "nvme"):
            remote_device = offload["device"]  # DeepSpeed takes them from the config's offload_param
            pin_memory = pin_memory or offload.get("pin_memory") is True
        # DeepSpeed's own tests and scripts pass OffloadDeviceEnum members, whose str() is not their value
        remote_device = getattr(remote_device, "value", remote_device)
        if remote_device is not None and str(remote_device) == "nvme":
            # the shards wait in host memory until initialize moves them into the swap files (unpinned:
            # freed pinned memory would stay in torch's pinned-memory cache)
            remote_device, pin_memory = "cpu", False
        if remote_device is not None and str(remote_device) not in ("cpu", "none"):
            raise ValueError(f"zero.Init: remote_device must be None, 'cpu' or 'nvme', got {remote_device!r}")
        self.home_device = torch.device("cpu") if str(remote_device) == "cpu" else self.compute_device
        self.pin_memory = bool(pin_memory)
        if module is not None:
            for m in module.modules():
                self.partition_module(m)

    # -- the context: every nn.Module constructor partitions its own parameters when it returns -------
    def __enter__(self) -> "Init":
        global _init_depth
        if not self.enabled:
            return self
        _init_stack.append(self)
        if _init_depth == 0:
            _patch_module_classes()
        _init_depth += 1
        # As DeepSpeed's Init, tensors built without a device land on the accelerator: a seeded model
        # then gets the values it gets there without ZeRO (the accelerator's generator, not the host's)
        self._device_ctx = torch.device(self.compute_device) if self.compute_device.type != "cpu" else None
        if self._device_ctx is not None:
            self._device_ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        global _init_depth
        if not self.enabled:
            return
        if getattr(self, "_device_ctx", None) is not None:
            self._device_ctx.__exit__(*exc)
            self._device_ctx = None
        _init_depth -= 1
        _init_stack.pop()
        if _init_depth == 0:
            _unpatch_module_classes()

    @torch.no_grad()
    def partition_module(self, module: torch.nn.Module) -> None:
        for name, buf in module._buffers.items():  # buffers live on the compute device, as DeepSpeed's do
            if buf is not None and buf.device != self.compute_device and not buf.is_meta:
                module._buffers[name] = buf.to(self.compute_device)  # a meta one waits for to_empty
        self._swap_meta_params(module)
        params = [p for p in module._parameters.values() if p is not None and not is_zero_param(p)]
        if not params:
            return
        stand_ins = {id(p) for p in self.__dict__.get("_meta_swapped", {}).values()}
        import torch.distributed as dist

        for p in params:
            if id(p) in stand_ins:  # a meta parameter's stand-in: its shard is allocated, nothing to copy
                continue
            p.data = p.data.to(device=self.compute_device, dtype=self.dtype if p.is_floating_point() else p.dtype)
            if self.world_size > 1:  # every rank partitions the same values
                src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
                dist.broadcast(p.data, src, group=self.group)
        store = ParamStore([params], {}, rank=self.rank, world_size=self.world_size, group=self.group,
                           dtype=self.dtype, compute_device=self.compute_device, home_device=self.home_device,
                           pin_memory=self.pin_memory)
        for i, p in enumerate(params):
            if id(p) not in stand_ins:
                store.load_full(0, i, p.data)
        # the shards are cut: drop the whole values (adopt sees them as partitioned)
        for p in params:
            if id(p) not in stand_ins:
                p.ds_numel, p.ds_shape = p.numel(), p.shape
        for p in params:
            p.data = torch.empty(0, dtype=p.dtype, device=self.compute_device)
        adopt(store)
        guard_forward(module)

    def _swap_meta_params(self, module: torch.nn.Module) -> None:
        """A parameter on `meta` (skip_init, a model built under torch.device("meta")) has no values to
        cut, and torch will not point a meta tensor's .data at real memory: it is replaced by a Parameter
        of its shape holding the empty placeholder, whose shard is allocated (zeros) and never copied into.
        A parameter shared by several modules is replaced once, so ties survive."""
        swapped = self.__dict__.setdefault("_meta_swapped", {})
        for name, p in list(module._parameters.items()):
            if p is None or is_zero_param(p) or not p.is_meta:
                continue
            new = swapped.get(id(p))
            if new is None:
                dtype = self.dtype if p.is_floating_point() else p.dtype
                new = torch.nn.Parameter(torch.empty(0, dtype=dtype, device=self.compute_device),
                                         requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)  # user attributes (e.g. transformers' init flags)
                new.ds_numel, new.ds_shape = p.numel(), p.shape
                swapped[id(p)] = new
                self.__dict__.setdefault("_meta_originals", []).append(p)  # p's id stays p's while Init lives
            module._parameters[name] = new
        if swapped and _constructed_on_meta(module):
            _repoint_after_to_empty(module)


def _constructed_on_meta(module: torch.nn.Module) -> bool:
    return bool(module.__dict__.get("_dsc_built_on_meta"))


def _to_empty_keeping_shards(module: torch.nn.Module, *, device: Any, recurse: bool = True) -> torch.nn.Module:
    """skip_init's to_empty on a module whose parameters are already partitioned: torch gives each an
    empty tensor on `device`; the partitioned ones go back to their placeholder on the compute device."""
    module.__dict__.pop("to_empty", None)
    type(module).to_empty(module, device=device, recurse=recurse)
    for p in module.parameters(recurse=recurse):
        if is_zero_param(p) and p.ds_status is ZeroParamStatus.NOT_AVAILABLE:
            store, _ = _home(p)
            p.data = torch.empty(0, dtype=p.dtype, device=store.compute_device)
    return module


def _repoint_after_to_empty(module: torch.nn.Module) -> None:
    if "to_empty" not in module.__dict__:  # a bound method: deepcopy and pickle rebind it to the copy
        module.__dict__["to_empty"] = types.MethodType(_to_empty_keeping_shards, module)


def _unavailable_guard(module: torch.nn.Module, args: Any) -> None:
    for name, p in module._parameters.items():
        if p is not None and is_zero_param(p) and p.ds_status is not ZeroParamStatus.AVAILABLE:
            raise RuntimeError(
                f"{type(module).__name__}.{name} is a ZeRO-3 partitioned parameter (shape {tuple(p.ds_shape)}) and is "
                "not gathered: pass the model to deepspeed_c.initialize before calling it, or use "
                "deepspeed_c.zero.GatheredParameters around the call")


def guard_forward(module: torch.nn.Module) -> None:
    if "_dsc_guard" not in module.__dict__:
        module.__dict__["_dsc_guard"] = module.register_forward_pre_hook(_unavailable_guard)


def drop_guard(module: torch.nn.Module) -> None:
    handle = module.__dict__.pop("_dsc_guard", None)
    if handle is not None:
        handle.remove()


_meta_build_depth = 0  # constructors running with device="meta" (skip_init), outermost first


def _is_meta_device(device: Any) -> bool:
    try:
        return device is not None and torch.device(device).type == "meta"
    except (TypeError, RuntimeError):
        return False


def _wrap_init(cls: type) -> None:
    original = cls.__dict__["__init__"]

    @functools.wraps(original)
    def init(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        global _meta_build_depth
        depth = self.__dict__.get("_dsc_init_depth", 0)
        self.__dict__["_dsc_init_depth"] = depth + 1
        # skip_init builds its module with device="meta" and calls to_empty on that outermost one only
        on_meta = depth == 0 and _is_meta_device(kwargs.get("device"))
        outermost_meta = on_meta and _meta_build_depth == 0
        _meta_build_depth += on_meta
        try:
            original(self, *args, **kwargs)
        finally:
            self.__dict__["_dsc_init_depth"] -= 1
            _meta_build_depth -= on_meta
        if self.__dict__["_dsc_init_depth"] == 0:
            del self.__dict__["_dsc_init_depth"]
            if _init_stack:
                if outermost_meta:
                    self.__dict__["_dsc_built_on_meta"] = True
                try:
                    _init_stack[-1].partition_module(self)
                finally:
                    self.__dict__.pop("_dsc_built_on_meta", None)

    _patched[cls] = original
    cls.__init__ = init  # type: ignore[misc]


def _all_module_classes() -> list[type]:
    out, todo = [], [torch.nn.Module]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def _init_subclass(cls: type, **kwargs: Any) -> None:
    _ORIGINAL_INIT_SUBCLASS(**kwargs)
    if "__init__" in cls.__dict__ and cls not in _patched:
        _wrap_init(cls)


_ORIGINAL_INIT_SUBCLASS = torch.nn.Module.__init_subclass__
_OWN_INIT_SUBCLASS = "__init_subclass__" in torch.nn.Module.__dict__


def _patch_module_classes() -> None:
    for cls in _all_module_classes():
        if "__init__" in cls.__dict__ and cls not in _patched:
            _wrap_init(cls)
    torch.nn.Module.__init_subclass__ = classmethod(_init_subclass)  # type: ignore[assignment]


def _unpatch_module_classes() -> None:
    for cls, original in _patched.items():
        cls.__init__ = original  # type: ignore[misc]
    _patched.clear()
    if _OWN_INIT_SUBCLASS:
        torch.nn.Module.__init_subclass__ = _ORIGINAL_INIT_SUBCLASS  # type: ignore[assignment]
    else:
        del torch.nn.Module.__init_subclass__


