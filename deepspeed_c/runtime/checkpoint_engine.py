"""The engine's checkpoint collaborator: gathers the engine's state into plain dicts in DeepSpeed's
on-disk layout (tag dir, `latest`, mp_rank_00_model_states.pt, zero_pp_rank_*_optim_states.pt) and
hands them to deepspeed_c.checkpoint.store, which writes them crash-safely with a manifest."""
from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from deepspeed_c.checkpoint import deepspeed_format, store
from deepspeed_c.runtime import checkpoint_nodes as nodes
from deepspeed_c.runtime.collective_guard import check_dir_arg, rank_local_step
from deepspeed_c.runtime.checkpoint_zero import from_deepspeed_layout, to_deepspeed_layout
from deepspeed_c.utils.logging import logger
from deepspeed_c.version import DEEPSPEED_API_VERSION

MODEL_FILE = "mp_rank_00_model_states.pt"
# Keys DeepSpeed's loader keeps for itself; everything else in the model-states file is client state.
DS_KEYS = ("module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
           "lr_scheduler", "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples",
           "dp_world_size", "mp_world_size", "ds_config", "ds_version", "data_sampler", "random_ltd",
           "frozen_param_fragments", "ds_zero_stage", "checkpoint_parallel_dimensions")


def zero_file(engine: Any, dp_rank: int) -> str:
    # DeepSpeed names ZeRO files with a bf16_ prefix whenever bf16 is enabled (any stage).
    return deepspeed_format.zero_file_name(dp_rank, engine.precision.bf16.enabled)


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _param_names(module: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in module.named_parameters(remove_duplicate=True)}


class EngineCheckpointer:
    """save/load for engine.save_checkpoint / engine.load_checkpoint (DeepSpeed signatures)."""

    # -- save -----------------------------------------------------------------------------------
    def save(self, engine: Any, save_dir: str, tag: Any, client_state: dict, save_latest: bool,
             exclude_frozen_parameters: bool) -> bool:
        # every check before the first collective, on every rank: a bad argument raises everywhere
        save_dir = check_dir_arg("save_checkpoint", "save_dir", save_dir)
        tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
        if not tag or os.sep in tag or tag.startswith("."):
            raise ValueError(f"save_checkpoint: tag {tag!r} must be a non-empty name without '{os.sep}' or a "
                             "leading '.'")
        if not isinstance(client_state, dict):
            raise TypeError(f"save_checkpoint: client_state must be a dict, got {type(client_state).__name__}")
        clash = sorted(set(client_state) & set(DS_KEYS))
        if clash:
            raise ValueError(f"save_checkpoint: client_state keys {clash} collide with DeepSpeed's own keys")
        store.check_plain(client_state, "client_state")
        self._validate_tag(engine, tag)
        # the writer of this rank's directory: global rank 0, or its node's local rank 0 (node-local storage)
        scope = nodes.save_scope(engine, save_dir)
        zero = getattr(engine.optimizer, "is_zero_optimizer", False)
        with rank_local_step("save_checkpoint (creating the checkpoint directory)", distributed=_dist()):
            if scope.writer:
                store.begin(save_dir, tag)
        stage = store.staging_dir(save_dir, tag)
        my_files: dict[str, dict] = {}
        if zero:  # the layout conversion is collective: outside the rank-local step
            name = zero_file(engine, engine.optimizer.rank)
            state = {"optimizer_state_dict": to_deepspeed_layout(engine.optimizer),
                     "ds_config": engine._config._param_dict, "ds_version": DEEPSPEED_API_VERSION}
        with rank_local_step("save_checkpoint (writing this rank's files)", distributed=_dist()):
            if zero:
                my_files[name] = store.save_file(state, os.path.join(stage, name))
            if scope.writer:
                model_state = self._model_state(engine, client_state, exclude_frozen_parameters, zero)
                my_files[MODEL_FILE] = store.save_file(model_state, os.path.join(stage, MODEL_FILE))
        files = self._gather_files(my_files, scope.members)
        with rank_local_step("save_checkpoint (committing the checkpoint)", distributed=_dist()):
            if scope.writer:
                store.commit(save_dir, tag, files, save_latest)
                self._copy_recovery_script(save_dir)
        return True

    def _validate_tag(self, engine: Any, tag: str) -> None:
        if not _dist() or not engine.checkpoint_tag_validation_enabled():
            return
        from deepspeed_c.comm import collective_device

        digest = torch.tensor(list(hashlib.sha1(tag.encode()).digest()[:8]), dtype=torch.int64,
                              device=collective_device())
        lo, hi = digest.clone(), digest.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        if not torch.equal(lo, hi):
            msg = (f"[rank={dist.get_rank()}] The checkpoint tag name {tag!r} is not consistent across all ranks "
                   "(checkpoint.tag_validation); a rank-specific tag breaks restoring with another world size")
            if engine.checkpoint_tag_validation_fail():
                raise AssertionError(msg)  # DeepSpeed asserts here
            logger.warning(msg)

    def _gather_files(self, mine: dict[str, dict], members: tuple[int, ...]) -> dict[str, dict]:
        """The manifest entries of the files in this rank's directory (those of `members`)."""
        if not _dist():
            return mine
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        out: dict[str, dict] = {}
        for rank in members:
            out.update(parts[rank])
        return out

    def _model_state(self, engine: Any, client_state: dict, exclude_frozen: bool, zero: bool) -> dict:
        module = engine.module
        names = _param_names(module)
        sd = engine.module_state_dict(exclude_frozen_parameters=exclude_frozen)
        groups = engine.optimizer.param_groups if engine.optimizer is not None else []
        if zero:  # ZeRO groups hold flat masters; DeepSpeed's param_shapes name the model's params per group
            groups = [{"params": params} for params in engine.optimizer.bit16_groups]
        param_shapes = []
        for group in groups:
            shapes: OrderedDict = OrderedDict()
            for p in group["params"]:
                if id(p) in names:
                    shapes[names[id(p)]] = p.shape
            param_shapes.append(shapes)
        if engine.optimizer is not None and not any(param_shapes):
            # Optimizer groups hold fp32 masters (mixed precision): name them through the module.
            param_shapes = [OrderedDict((n, p.shape) for n, p in module.named_parameters() if p.requires_grad)]
        frozen = OrderedDict((n, p.shape) for n, p in module.named_parameters() if not p.requires_grad)
        shared: dict[str, str] = {}
        first: dict[int, str] = {}
        for n, p in module.named_parameters(remove_duplicate=False):
            if id(p) in first:
                shared[n] = first[id(p)]
            else:
                first[id(p)] = n
        persistent = set(sd)
        state = {
            "module": {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()},
            "buffer_names": [n for n, _ in module.named_buffers() if n in persistent],
            "optimizer": (engine.optimizer.state_dict() if engine.optimizer is not None and not zero else None),
            "param_shapes": param_shapes,
            "frozen_param_shapes": frozen if exclude_frozen else None,
            "shared_params": shared,
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "sparse_tensor_module_names": [],
            "skipped_steps": engine.skipped_steps,
            "global_steps": engine.global_steps,
            "global_samples": engine.global_samples,
            "dp_world_size": engine.dp_world_size,
            "mp_world_size": 1,
            "ds_config": engine._config._param_dict,
            "ds_version": DEEPSPEED_API_VERSION,
        }
        state.update(client_state)
        return state

    def _copy_recovery_script(self, save_dir: str) -> None:
        """zero_to_fp32.py into the top-level checkpoint directory, where DeepSpeed puts it (users run
        `python zero_to_fp32.py . out` there; it follows `latest`); written atomically."""
        src = os.path.join(os.path.dirname(os.path.dirname(__file__)), "utils", "zero_to_fp32.py")
        if os.path.isfile(src):
            with open(src, "rb") as f:
                store.write_bytes_atomic(os.path.join(save_dir, "zero_to_fp32.py"), f.read())

    # -- load -----------------------------------------------------------------------------------
    def load(self, engine: Any, load_dir: str, tag: Any, load_module_strict: bool, load_optimizer_states: bool,
             load_lr_scheduler_states: bool, load_module_only: bool,
             custom_load_fn: Optional[Callable]) -> tuple[Optional[str], Any]:
        load_dir = check_dir_arg("load_checkpoint", "load_dir", load_dir)
        if custom_load_fn is not None and not callable(custom_load_fn):
            raise TypeError(f"load_checkpoint: custom_load_fn must be callable, got {type(custom_load_fn).__name__}")
        if tag is None:
            tag = store.read_latest(load_dir)
            if nodes.node_local_enabled(engine):  # each node read its own `latest`
                tag = nodes.agree_on_latest(tag, load_dir)
            if tag is None:
                logger.warning(f"Unable to find latest file at {os.path.join(load_dir, store.LATEST_NAME)} "
                               f"(directory holds: {store.listing(load_dir)}); pass an explicit tag or save a "
                               "checkpoint with save_latest=True")
                return None, None
        tag = str(tag)
        # node-local: a node lacking the tag must fail every rank, not leave the others in a collective
        with rank_local_step("load_checkpoint (reading this node's checkpoint)",
                             distributed=nodes.node_local_enabled(engine)):
            tag_dir, manifest, state = self._open_tag(load_dir, tag)
        self._load_module(engine, state["module"], load_module_strict, custom_load_fn)
        if not load_module_only:
            self._load_optimizer(engine, state, tag_dir, manifest, load_optimizer_states)
            if load_lr_scheduler_states and engine.lr_scheduler is not None and state.get("lr_scheduler"):
                engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
            engine.global_steps = state["global_steps"]
            engine.global_samples = state.get("global_samples", engine.global_steps * engine.train_batch_size())
            engine.skipped_steps = state["skipped_steps"]
        elif engine.optimizer is not None:
            self._refresh_masters(engine)
        client = {k: v for k, v in state.items() if k not in DS_KEYS}
        return os.path.join(tag_dir, MODEL_FILE), client

    def _open_tag(self, load_dir: str, tag: str) -> tuple[str, Any, dict]:
        """The tag's directory, its manifest and its model-states file."""
        tag_dir = os.path.join(load_dir, tag)
        previous = os.path.join(load_dir, f".{tag}.old")
        if not os.path.isdir(tag_dir) and os.path.isdir(previous):
            # A re-save of this tag was interrupted between its two renames: the old copy is whole.
            logger.warning(f"checkpoint {tag_dir} is missing; loading the previous copy {previous}")
            tag_dir = previous
        if not os.path.isdir(tag_dir):
            raise FileNotFoundError(f"load_checkpoint: checkpoint tag {tag!r} not found in {load_dir} "
                                    f"(directory holds: {store.listing(load_dir)})")
        manifest = store.read_manifest(tag_dir)
        state = store.load_file(tag_dir, MODEL_FILE, manifest)
        return tag_dir, manifest, state

    def _load_module(self, engine: Any, saved: dict, strict: bool, custom_load_fn: Optional[Callable]) -> None:
        if custom_load_fn is not None:
            custom_load_fn(src=saved, dst=engine.module)
            return
        own = engine.module.state_dict()
        missing = sorted(set(own) - set(saved))
        unexpected = sorted(set(saved) - set(own))
        wrong = [f"{k}: checkpoint {tuple(saved[k].shape)} vs model {tuple(own[k].shape)}"
                 for k in sorted(set(own) & set(saved))
                 if isinstance(saved[k], torch.Tensor) and saved[k].shape != own[k].shape]
        if wrong or (strict and (missing or unexpected)):
            problems = []
            if missing:
                problems.append(f"missing in checkpoint: {missing}")
            if unexpected:
                problems.append(f"not in model: {unexpected}")
            if wrong:
                problems.append(f"shape mismatch: {wrong}")
            if strict or wrong:
                raise RuntimeError("load_checkpoint: checkpoint does not match the model (pass "
                                   "load_module_strict=False to skip missing/unexpected names); " + "; ".join(problems))
        engine.module.load_state_dict(saved, strict=strict)

    def _load_optimizer(self, engine: Any, state: dict, tag_dir: str, manifest: Any, load_states: bool) -> None:
        opt = engine.optimizer
        if opt is None:
            return
        if getattr(opt, "is_zero_optimizer", False) and nodes.node_local_enabled(engine):
            self._load_zero_node_local(engine, state, tag_dir, manifest, load_states)
            return
        if getattr(opt, "is_zero_optimizer", False):
            saved_world = state.get("dp_world_size") or 1
            bf16 = engine.precision.bf16.enabled
            files = [deepspeed_format.find_zero_file(tag_dir, r, bf16) for r in range(saved_world)]
            numels = deepspeed_format.group_numels_from_shapes(state.get("param_shapes"))
            parts = [deepspeed_format.normalize_zero_state(store.load_file(tag_dir, f, manifest)["optimizer_state_dict"],
                                                           numels, saved_world) for f in files]
            if any(p.get("layout") != "deepspeed" for p in parts):
                raise RuntimeError(f"load_checkpoint: ZeRO files in {tag_dir} are not in DeepSpeed's flat layout")
            opt.load_state_dict(from_deepspeed_layout(opt, parts), load_optimizer_states=load_states,
                                load_from_fp32_weights=bool(engine._config.zero_config.load_from_fp32_weights))
            return
        saved = state.get("optimizer")
        if saved is None:
            self._refresh_masters(engine)
            return
        if hasattr(opt, "fp32_groups"):
            if load_states:
                opt.load_state_dict(deepspeed_format.normalize_mixed_state(saved), load_optimizer_states=True)
            else:
                self._refresh_masters(engine)
        elif load_states:
            opt.load_state_dict(saved)

    def _load_zero_node_local(self, engine: Any, state: dict, tag_dir: str, manifest: Any,
                              load_states: bool) -> None:
        """ZeRO state when each node holds only its own ranks' files: a rank reads the files
        `zero_ranks_this_rank_reads` names and gets the other partitions from their owners."""
        opt = engine.optimizer
        saved_world = state.get("dp_world_size") or 1
        if saved_world != engine.dp_world_size:
            raise RuntimeError(f"load_checkpoint: checkpoint.use_node_local_storage: the checkpoint in {tag_dir} "
                               f"was saved by {saved_world} data-parallel ranks and {engine.dp_world_size} load it; "
                               "each node holds only its own ranks' ZeRO files, so resharding needs them all: copy "
                               "every node's files into one directory and load with use_node_local_storage off")
        bf16 = engine.precision.bf16.enabled
        numels = deepspeed_format.group_numels_from_shapes(state.get("param_shapes"))
        mine: dict[int, Any] = {}
        with rank_local_step("load_checkpoint (reading this rank's ZeRO file)"):
            for r in nodes.zero_ranks_this_rank_reads(engine, saved_world):
                name = deepspeed_format.find_zero_file(tag_dir, r, bf16)
                mine[r] = deepspeed_format.normalize_zero_state(store.load_file(tag_dir, name, manifest)
                                                                ["optimizer_state_dict"], numels, saved_world)
        parts = nodes.exchange_zero_parts(mine, saved_world)
        if any(p.get("layout") != "deepspeed" for p in parts):
            raise RuntimeError(f"load_checkpoint: ZeRO files in {tag_dir} are not in DeepSpeed's flat layout")
        opt.load_state_dict(from_deepspeed_layout(opt, parts), load_optimizer_states=load_states,
                            load_from_fp32_weights=bool(engine._config.zero_config.load_from_fp32_weights))

    def _refresh_masters(self, engine: Any) -> None:
        """Masters follow the loaded model weights when optimizer state is not loaded."""
        opt = engine.optimizer
        if getattr(opt, "is_zero_optimizer", False):
            opt.masters_from_model()
            return
        if hasattr(opt, "fp32_groups") and hasattr(opt, "lp_groups"):
            with torch.no_grad():
                for lps, masters in zip(opt.lp_groups, opt.fp32_groups):
                    for lp, m in zip(lps, masters):
                        m.copy_(lp.detach().to(m.dtype))
