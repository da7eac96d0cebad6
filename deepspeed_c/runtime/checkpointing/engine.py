"""The engine's checkpoint collaborator: gathers the states the engine hands it (CheckpointStates) into
plain dicts in DeepSpeed's on-disk layout (tag dir, `latest`, mp_rank_00_model_states.pt,
zero_pp_rank_*_optim_states.pt, plus each rank's own optimizer file where the optimizer keeps one:
EngineOptimizer.rank_checkpoint_file) and hands them to deepspeed_c.checkpoint.store, which writes them
crash-safely with a manifest. Its settings come from CheckpointOptions, built once from the config; it
never sees the engine."""
from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from deepspeed_c.checkpoint import deepspeed_format, store
from deepspeed_c.runtime.checkpointing import (engine_hooks, nodes, reducer_order, run_state, universal_load, zero,
                                               zero3)
from deepspeed_c.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo
from deepspeed_c.runtime.checkpointing.options import CheckpointOptions
from deepspeed_c.runtime.checkpointing.states import CheckpointStates
from deepspeed_c.runtime.checkpointing.collective_guard import (check_dir_arg, dir_group, rank_local_step, save_group,
                                                                validate_tag)
from deepspeed_c.runtime.optimizer_seam import SavedCheckpoint
from deepspeed_c.utils.logging import logger
from deepspeed_c.version import DEEPSPEED_API_VERSION

MODEL_FILE = "mp_rank_00_model_states.pt"
# copied beside the tags, as DeepSpeed 0.19.8 does (zero_to_torch.py imports its sibling zero_to_fp32.py)
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # deepspeed_c/
# Keys DeepSpeed's loader keeps for itself; everything else in the model-states file is client state.
DS_KEYS = ("module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
           "lr_scheduler", "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples",
           "dp_world_size", "mp_world_size", "ds_config", "ds_version", "data_sampler", "random_ltd",
           "frozen_param_fragments", "ds_zero_stage", "checkpoint_parallel_dimensions", "num_experts",
           "dsc_forward_schedules")


def model_file(mp_rank: int = 0) -> str:
    """The model-states file of model-parallel rank `mp_rank` (a client mpu's; 00 otherwise)."""
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def zero3_model_file(dp_rank: int, mp_rank: int = 0) -> str:
    """ZeRO-3 writes one model-states file per data-parallel rank, named like DeepSpeed's."""
    return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_model_states.pt"


def zero_file(bf16: bool, dp_rank: int, mp_rank: int = 0) -> str:
    # DeepSpeed names ZeRO files with a bf16_ prefix whenever bf16 is enabled (any stage).
    return deepspeed_format.zero_file_name(dp_rank, bf16, mp_rank)


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _dist() else (0, 1)


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t` for torch.save, which writes whole storages: a contiguous view of part of a larger storage (ZeRO
    1/2 parameters inside their flat buffer) is re-based on a storage slice of just its bytes, which
    shares the memory (and keeps the whole alive), so the file holds only the tensor and nothing is
    copied; other partial views are copied. The file is written before training resumes, so the weights
    need no snapshot copy."""
    t = t.detach()
    nbytes = t.numel() * t.element_size()
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == nbytes:
        return t
    if not t.is_contiguous() or t.numel() == 0:
        return t.clone()
    start = t.storage_offset() * t.element_size()
    part = t.untyped_storage()[start:start + nbytes]
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(part, 0, t.shape, t.stride())


def _param_names(module: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in module.named_parameters(remove_duplicate=True)}


class EngineCheckpointer:
    """save/load for engine.save_checkpoint / engine.load_checkpoint (DeepSpeed signatures)."""

    def __init__(self, options: CheckpointOptions, checkpoint_engine: Any = None) -> None:
        self.options = options
        self.writer: Any = None
        self._pending: Optional[tuple] = None
        self._engine_pending: Optional[tuple] = None  # a decoupled user engine's save, committed later
        self._at_exit = False
        self.checkpoint_engine: Any = None
        self._native = True  # the files are written by this checkpointer (engine_hooks.native_writer)
        # checkpoint.writer: files written in the background, committed at the next commit point
        self.set_checkpoint_engine(checkpoint_engine if checkpoint_engine is not None
                                   else engine_hooks.builtin_engine(options.writer))

    def set_checkpoint_engine(self, checkpoint_engine: Any) -> None:
        """engine.checkpoint_engine = ...: a built-in one selects this checkpointer's writer, any other gets
        every file (runtime/checkpointing/engine_hooks.py). A save still pending is committed first."""
        engine_hooks.check_engine(checkpoint_engine)
        if self.checkpoint_engine is not None:
            self.commit_pending()
        self._native, config = engine_hooks.native_writer(checkpoint_engine)
        if config != (self.writer.config if self.writer is not None else None):
            from deepspeed_c.runtime.checkpointing.async_writer import BackgroundWriter, at_exit

            self.writer = BackgroundWriter(config) if config is not None else None
            if self.writer is not None and not self._at_exit:
                at_exit(self)  # exit waits for a background write (and commits it where that is rank-local)
                self._at_exit = True
        self.checkpoint_engine = checkpoint_engine

    # -- save -----------------------------------------------------------------------------------
    def save(self, st: CheckpointStates, save_dir: str, tag: Any, client_state: dict, save_latest: bool,
             exclude_frozen_parameters: bool) -> bool:
        # every check before the first collective, on every rank: a bad argument raises everywhere
        save_dir = check_dir_arg("save_checkpoint", "save_dir", save_dir)
        tag = f"global_step{st.train_state.global_steps}" if tag is None else str(tag)
        if not tag or os.sep in tag or tag.startswith("."):
            raise ValueError(f"save_checkpoint: tag {tag!r} must be a non-empty name without '{os.sep}' or a "
                             "leading '.'")
        if not isinstance(client_state, dict):
            raise TypeError(f"save_checkpoint: client_state must be a dict, got {type(client_state).__name__}")
        clash = sorted(set(client_state) & set(DS_KEYS))
        if clash:
            raise ValueError(f"save_checkpoint: client_state keys {clash} collide with DeepSpeed's own keys")
        store.check_plain(client_state, "client_state")
        self._validate_tag(tag)  # FAIL: raises on every rank when the tags differ
        # ranks told different directories (per-rank experiment names) or, past tag validation, different
        # tags: each (directory, tag) is saved by its ranks, as DeepSpeed writes each rank's files there
        if nodes.node_local_enabled(self.options.node_local_storage):
            split = None
            self._check_one_tag_node_local(tag)
        else:
            split = save_group(save_dir, tag)
        if st.mp_world_size > 1 and split is not None:
            raise NotImplementedError("save_checkpoint: ranks name different save_dir directories or tags with a "
                                      f"model-parallel mpu (model-parallel size {st.mp_world_size}); pass every "
                                      "rank the same save_dir and tag")
        if st.mp_world_size > 1 and self.options.node_local_storage:
            # each model-parallel rank's files would stay on the node of its data-parallel rank 0 only
            raise NotImplementedError("save_checkpoint: checkpoint.use_node_local_storage with a model-parallel mpu "
                                      f"(model-parallel size {st.mp_world_size}, mp_rank_XX files) is not built; "
                                      "save to shared storage")
        if split is not None:
            save_latest = save_latest and split.writes_latest  # `latest` names the lowest rank's tag
        self.commit_pending()  # the previous background save first: its failure is raised here
        # the writer of this rank's directory: global rank 0, or its node's local rank 0 (node-local storage)
        scope = (nodes.save_scope(save_dir, self.options.node_local_storage, st.local_rank) if split is None
                 else nodes.split_scope(split.members, warn=split.split_dirs))
        if not self._native:  # a user's checkpoint engine: DeepSpeed's create / save / commit protocol
            info = CheckpointCommitInfo(tag=tag, save_dir=save_dir, save_latest=save_latest)
            tag_dir = engine_hooks.begin(self.checkpoint_engine, info, scope, _dist())
            with store.through_engine(self.checkpoint_engine):  # every file of the save goes to its save()
                self._save_staged(st, save_dir, tag, client_state, save_latest, exclude_frozen_parameters, scope,
                                  into=tag_dir)
            self._engine_pending = engine_hooks.finish(self.checkpoint_engine, info, scope, _dist(),
                                                       self._copy_recovery_script)
            return True
        with rank_local_step("save_checkpoint (creating the checkpoint directory)", distributed=_dist()):
            if scope.writer:
                # what saves killed mid-way left behind: staging directories, temporaries of the replaced files
                store.remove_stale_staging(save_dir, keep=split.staging if split is not None else tag)
                for name in (store.LATEST_NAME, *RECOVERY_SCRIPTS):
                    store.remove_stale_temporaries(os.path.join(save_dir, name))
                store.begin(save_dir, tag)
        try:
            return self._save_staged(st, save_dir, tag, client_state, save_latest, exclude_frozen_parameters,
                                     scope)
        except BaseException:
            # every rank raised at the same step (rank_local_step), so none writes into the staging
            # directory any more: its partial files would only hold the space (a full disk stays full)
            if scope.writer:
                store.abort(save_dir, tag)
            if self.writer is not None:
                self.writer.discard()
            raise

    def _save_staged(self, st: CheckpointStates, save_dir: str, tag: str, client_state: dict, save_latest: bool,
                     exclude_frozen_parameters: bool, scope: nodes.StorageScope, into: Optional[str] = None) -> bool:
        """Every rank's files into the staging directory, then the writer commits it. `into`: write the files
        there and stop (a user's checkpoint engine commits them: engine_hooks.finish)."""
        stage = into if into is not None else store.staging_dir(save_dir, tag)
        my_files: dict[str, dict] = {}
        # a partitioned optimizer's state (ZeRO) goes to one file per rank; building it is collective,
        # so it happens outside the rank-local step
        names = _param_names(st.module)

        def name_of(p: torch.nn.Parameter) -> str:
            return names[id(p)]

        if st.has_moe_layers:  # DeepSpeed's MoE layout: experts and optimizer states in files of their own
            from deepspeed_c.runtime.checkpointing import moe

            moe.check_stage(self.options.zero_stage, st.module)
        part = zero.save_partition(st.stepper, name_of) if st.stepper is not None else None
        # ZeRO-3: every rank writes its own model-states file, with its shards of the frozen parameters
        shards = (zero3.partitioned_model_state(st.stepper, name_of, exclude_frozen_parameters)
                  if st.stepper is not None else None)
        # MiCS: the replicas of a partition hold what the first shard group writes
        writes_part = st.stepper is None or st.stepper.writes_partition_files()
        with rank_local_step("save_checkpoint (writing this rank's files)", distributed=_dist()):
            if st.has_moe_layers:
                my_files.update(moe.save_files(st.module, st.stepper, self.options.zero, stage))
            if part is not None and writes_part:
                name = zero_file(self.options.bf16, part[0], st.mp_rank)
                state = {"optimizer_state_dict": part[1], "ds_config": self.options.ds_config,
                         "ds_version": DEEPSPEED_API_VERSION}
                my_files[name] = self._write(state, stage, name)
            if shards is not None:
                if writes_part:
                    model_state = self._model_state(st, client_state, exclude_frozen_parameters, True, shards)
                    name = zero3_model_file(shards[0], st.mp_rank)
                    my_files[name] = self._write(model_state, stage, name)
            elif scope.writer if st.mp_world_size == 1 else st.dp_rank == 0:  # model parallel: each mp rank's
                model_state = self._model_state(st, client_state, exclude_frozen_parameters, part is not None)
                name = model_file(st.mp_rank)
                my_files[name] = self._write(model_state, stage, name)
            # state that differs between ranks (the 1-bit optimizers' compression errors): a file of its own
            own = st.stepper.rank_checkpoint_file() if st.stepper is not None else None
            if own is not None:
                name, state = own
                if name in my_files or os.sep in name or name.startswith("."):
                    raise ValueError(f"save_checkpoint: the optimizer's rank file name {name!r} is not a fresh file "
                                     "name in the tag directory")
                my_files[name] = self._write(state, stage, name)
            # the gradient reducers' re-planned bucket order: a resumed run reduces as this one does
            order = reducer_order.rank_file(st.reducer, *_rank_world())
            if order is not None:
                my_files[order[0]] = self._write(order[1], stage, order[0])
            rng = run_state.rng_file(*_rank_world())  # this rank's random generators: an exact resume
            my_files[rng[0]] = self._write(rng[1], stage, rng[0])
        if into is not None:
            return True
        if self.writer is not None:  # staged: written in the background, committed at the next commit point
            self.writer.start()
            self._pending = (save_dir, tag, save_latest, scope, {k: v for k, v in my_files.items() if v is not None})
            return True
        files = self._gather_files(my_files, scope.members)
        with rank_local_step("save_checkpoint (committing the checkpoint)", distributed=_dist()):
            if scope.writer:
                # the script first: a save that raises (a full disk) has then committed nothing
                self._copy_recovery_script(save_dir)
                store.commit(save_dir, tag, files, save_latest)
        return True

    def _write(self, obj: dict, stage: str, name: str) -> Optional[dict]:
        """The file's manifest entry once written; None when a background writer has staged it."""
        if self.writer is None:
            return store.save_file(obj, os.path.join(stage, name))
        self.writer.stage(name, obj, os.path.join(stage, name))
        return None

    @property
    def has_pending(self) -> bool:
        """A background save was started and not yet committed."""
        return self._pending is not None

    def commit_pending(self) -> bool:
        """Waits for this rank's background write of the last save and commits it (collective: every rank
        calls it at the same point). A failed write raises on every rank and its staging directory is
        removed. False when no save is pending."""
        if self._engine_pending is not None:  # a decoupled user engine's save
            (info, scope), self._engine_pending = self._engine_pending, None
            engine_hooks.commit(self.checkpoint_engine, info, scope, _dist(), self._copy_recovery_script)
            return True
        pending, self._pending = self._pending, None
        if pending is None or self.writer is None:
            return False
        save_dir, tag, save_latest, scope, mine = pending
        try:
            with rank_local_step("checkpoint_commit (this rank's background write)", distributed=_dist()):
                mine = {**mine, **self.writer.wait()}
            files = self._gather_files(mine, scope.members)
            with rank_local_step("checkpoint_commit (committing the checkpoint)", distributed=_dist()):
                if scope.writer and self.writer.writes:
                    self._copy_recovery_script(save_dir)
                    store.commit(save_dir, tag, files, save_latest)
                elif scope.writer:  # the mock writer: nothing was written, nothing is committed
                    store.abort(save_dir, tag)
        except BaseException:
            if scope.writer:
                store.abort(save_dir, tag)
            raise
        return True

    def _validate_tag(self, tag: str) -> None:
        validate_tag(tag, self.options.tag_validation, self.options.tag_validation_fail)

    def _check_one_tag_node_local(self, tag: str) -> None:
        """Node-local storage commits one tag per node directory: ranks passing different tags (let through
        by tag_validation WARN / IGNORE) raise on every rank."""
        if not _dist():
            return
        tags: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(tags, tag)
        if len(set(tags)) > 1:
            raise NotImplementedError(f"save_checkpoint: the ranks pass different tags {sorted(set(tags))} with "
                                      "checkpoint.use_node_local_storage (a node directory holds one tag per save); "
                                      "pass every rank the same tag")

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

    def _model_state(self, st: CheckpointStates, client_state: dict, exclude_frozen: bool, partitioned: bool,
                     shards: Optional[tuple[int, dict]] = None) -> dict:
        """The model-states file as DeepSpeed 0.19.8's engine writes it (_save_checkpoint), key for key.
        One addition: `param_shapes` at stage 0 too (DeepSpeed writes None there and ignores the key on
        load), so zero_to_fp32 can name a stage-0 checkpoint's fp32 masters. `shards`: ZeRO-3's
        (dp rank, per-rank fields) from partitioned_model_state; then `module` holds placeholders and
        shared_params is filled only in rank 0's file, as DeepSpeed's stage 3 writes them."""
        module = st.module
        names = _param_names(module)
        sd = st.module_state_dict(exclude_frozen_parameters=exclude_frozen)
        if st.has_moe_layers:
            from deepspeed_c.runtime.checkpointing.moe import non_expert_state

            sd = non_expert_state(module, sd)
        if shards is not None:
            # DeepSpeed's stage-3 engine loads `module` into its still-partitioned parameters, so each
            # parameter must be an empty placeholder there, also one that is whole here (one rank,
            # persistence): a whole value fails its load_state_dict with a size mismatch
            for n, p in module.named_parameters():
                if n in sd:
                    sd[n] = torch.empty(0, dtype=p.dtype)
        # DeepSpeed's param_shapes name, per param group, the model parameters the optimizer steps
        groups = st.stepper.model_param_groups() if st.stepper is not None else []
        param_shapes = [OrderedDict((names[id(p)], p.shape) for p in params if id(p) in names) for params in groups]
        # DeepSpeed writes the parameters its optimizer does not own (frozen ones) whole into the model
        # file at the stages that partition gradients, unless they are excluded
        stage = self.options.zero_stage
        save_frozen = partitioned and stage >= 2 and not exclude_frozen and shards is None
        owned = {id(p) for params in groups for p in params}
        frozen = [(n, p) for n, p in module.named_parameters() if id(p) not in owned]
        persistent = set(sd)
        counters = st.train_state.state_dict()
        state = {
            "module": {k: _own_storage(v) if isinstance(v, torch.Tensor) else v for k, v in sd.items()},
            "buffer_names": [n for n, _ in module.named_buffers() if n in persistent],
            "optimizer": st.stepper.model_file_state() if st.stepper is not None else None,
            "param_shapes": param_shapes,
            "frozen_param_shapes": OrderedDict((n, p.shape) for n, p in frozen) if save_frozen else None,
            "shared_params": self._shared_params(module) if partitioned else None,
            "frozen_param_fragments": (OrderedDict((n, p.detach().cpu().clone()) for n, p in frozen)
                                       if save_frozen else None),
            "lr_scheduler": st.lr_scheduler.state_dict() if st.lr_scheduler is not None else None,
            "data_sampler": run_state.data_sampler_state(st.data_loader),
            "random_ltd": run_state.random_ltd_state(st.data_schedules),
            "skipped_steps": counters["skipped_steps"],
            "global_steps": counters["global_steps"],
            "global_samples": counters["global_samples"],
            "dp_world_size": st.dp_world_size,
            "mp_world_size": st.mp_world_size,
            "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": st.mp_world_size},
            "ds_config": self.options.ds_config,
            "ds_version": DEEPSPEED_API_VERSION,
        }
        schedules = run_state.schedules_state(st.data_schedules)
        if schedules is not None:
            state[run_state.SCHEDULES_KEY] = schedules
        if st.sparse_names is not None:
            st.sparse_names.save_into(state)
        if st.has_moe_layers:
            from deepspeed_c.runtime.checkpointing.moe import autoep_layer_infos

            state["num_experts"] = st.num_experts
            state["optimizer"] = None  # in the expp_rank_* files
            state["ds_autoep_layers"] = autoep_layer_infos(module)
            taken = {"ds_autoep_layers", "autoep_layers"}.intersection(client_state)
            if taken:  # DeepSpeed refuses them too: its loader reads them
                raise KeyError(f"save_checkpoint: client_state contains reserved checkpoint keys {sorted(taken)}")
        if shards is not None:
            state.update(shards[1])
            if shards[0] != 0:
                state["shared_params"] = {}
        state.update(client_state)
        return state

    @staticmethod
    def _shared_params(module: torch.nn.Module) -> dict[str, str]:
        """name -> the name of the parameter it is the same tensor as (first occurrence)."""
        shared: dict[str, str] = {}
        first: dict[int, str] = {}
        for n, p in module.named_parameters(remove_duplicate=False):
            if id(p) in first:
                shared[n] = first[id(p)]
            else:
                first[id(p)] = n
        return shared

    def _copy_recovery_script(self, save_dir: str) -> None:
        """zero_to_fp32.py and zero_to_torch.py into the top-level checkpoint directory, where DeepSpeed
        puts them (users run `python zero_to_fp32.py . out` there; it follows `latest`); written atomically."""
        for name in RECOVERY_SCRIPTS:
            src = os.path.join(_PACKAGE_DIR, "utils", name)
            if not os.path.isfile(src):
                continue
            with open(src, "rb") as f:
                script = f.read()
            dst = os.path.join(save_dir, name)
            try:
                with open(dst, "rb") as f:
                    if f.read() == script:  # already there: no rewrite (nor its temporary's space) every save
                        continue
            except OSError:
                pass
            store.write_bytes_atomic(dst, script)

    # -- load -----------------------------------------------------------------------------------
    # load_checkpoint is collective, and a rank whose read fails (a damaged file, a missing tag on its
    # node) must not leave the others waiting in the load's collectives until the process group times
    # out. So every rank-local read runs under rank_local_step before the next collective, and the whole
    # load runs under one more: a failure after the last collective (the optimizer's state applied, the
    # reducers' order file) still raises on every rank.
    def load(self, st: CheckpointStates, load_dir: str, tag: Any, load_module_strict: bool, load_optimizer_states: bool,
             load_lr_scheduler_states: bool, load_module_only: bool,
             custom_load_fn: Optional[Callable]) -> tuple[Optional[str], Any]:
        load_dir = check_dir_arg("load_checkpoint", "load_dir", load_dir)
        self.commit_pending()  # a save still being written is committed first: it may be the one loaded
        if custom_load_fn is not None and not callable(custom_load_fn):
            raise TypeError(f"load_checkpoint: custom_load_fn must be callable, got {type(custom_load_fn).__name__}")
        reads = contextlib.nullcontext() if self._native else store.through_engine(self.checkpoint_engine)
        with rank_local_step("load_checkpoint", distributed=_dist()), reads:
            return self._load(st, load_dir, tag, load_module_strict, load_optimizer_states,
                              load_lr_scheduler_states, load_module_only, custom_load_fn)

    def _load(self, st: CheckpointStates, load_dir: str, tag: Any, load_module_strict: bool,
              load_optimizer_states: bool, load_lr_scheduler_states: bool, load_module_only: bool,
              custom_load_fn: Optional[Callable]) -> tuple[Optional[str], Any]:
        # node-local storage, or ranks told different directories (a split save): each rank sees its own files
        own_dirs = nodes.node_local_enabled(self.options.node_local_storage) or dir_group(load_dir) is not None
        if tag is None:
            with rank_local_step("load_checkpoint (reading the latest file)", distributed=_dist()):
                read_latest = universal_load.read_latest if self.options.load_universal else store.read_latest
                tag = read_latest(load_dir)
            if _dist():  # ranks resuming from different tags would silently diverge
                tag = nodes.agree_on_latest(tag, load_dir, nodes.node_local_enabled(self.options.node_local_storage))
            if tag is None:
                logger.warning(f"Unable to find latest file at {os.path.join(load_dir, store.LATEST_NAME)} "
                               f"(directory holds: {store.listing(load_dir)}); pass an explicit tag or save a "
                               "checkpoint with save_latest=True")
                return None, None
        tag = str(tag)
        dp_rank = st.dp_rank
        # every file this rank reads before the optimizer's collectives (ZeRO-3: its own model-states file)
        with rank_local_step("load_checkpoint (reading this rank's model states)", distributed=_dist()):
            if self.options.load_universal:  # a folder ds_to_universal wrote, or a clear error
                universal_load.check_folder(os.path.join(load_dir, tag))
            tag_dir, manifest, state, model_name, model_rank = self._open_tag(load_dir, tag, dp_rank, st.mp_rank,
                                                                              st.mp_world_size)
            saved = SavedCheckpoint(tag_dir=tag_dir, manifest=manifest, model_state=state,
                                    bf16=self.options.bf16, load_from_fp32_weights=self.options.load_from_fp32_weights,
                                    node_local=own_dirs, partitioned_weights=model_rank is not None, model_rank=model_rank,
                                    mp_rank=st.mp_rank)
            module_state = self._module_state(st, saved, custom_load_fn)
            if st.has_moe_layers and load_optimizer_states and not load_module_only:
                from deepspeed_c.runtime.checkpointing.autoep import check_optimizer_ep

                check_optimizer_ep(state, st.module, tag_dir)
            if self.options.load_universal:  # the trained weights come from zero/<param>/fp32.pt
                module_state, load_module_strict = universal_load.untrained_entries(st.stepper, st.module,
                                                                                    module_state), False
        # a mismatch with this rank's model raises on every rank (the guards must stay in step on all ranks)
        with rank_local_step("load_checkpoint (applying the module's weights)", distributed=_dist()):
            self._load_module(st, module_state, load_module_strict, custom_load_fn)
        if not load_module_only:
            if not st.has_moe_layers or self.options.zero:
                self._load_optimizer(st, saved, load_optimizer_states)
            elif load_optimizer_states and st.stepper is not None:  # stage 0: the expp_rank files
                from deepspeed_c.runtime.checkpointing import moe

                moe.load_optimizer(st.module, st.stepper, tag_dir, manifest)
            if load_optimizer_states and st.stepper is not None:  # this rank's own file, where it has one
                st.stepper.load_rank_checkpoint_file(saved)
            reducer_order.restore(st.reducer, tag_dir, manifest, *_rank_world())
            if load_lr_scheduler_states and st.lr_scheduler is not None and state.get("lr_scheduler"):
                st.lr_scheduler.load_state_dict(state["lr_scheduler"])
            st.train_state.load_state_dict(state, samples_per_step=st.samples_per_step)
            run_state.restore(st.data_loader, state, tag_dir, manifest, *_rank_world())
            run_state.restore_schedules(st.data_schedules, state)
            if st.sparse_names is not None:
                st.sparse_names.restore(state, st.module, load_module_strict)
        elif st.has_optimizer and st.stepper is not None and self.options.load_universal:
            self._load_optimizer(st, saved, False)  # the weights are the universal fp32 values
        elif st.has_optimizer and st.stepper is not None:
            # masters follow the loaded weights (a stage-3 checkpoint's weights are its fp32 partitions)
            zero.load_partition_weights(st.stepper, saved)
        client = {k: v for k, v in state.items() if k not in DS_KEYS}
        return os.path.join(tag_dir, model_name), client

    def _module_state(self, st: CheckpointStates, saved: SavedCheckpoint, custom_load_fn: Optional[Callable]) -> dict:
        """The module state_dict to apply: the model-states file's, plus this rank's experts (MoE) and, for an
        engine keeping whole parameters, a stage-3 checkpoint's frozen parameters from every rank's file."""
        module_state = saved.model_state["module"]
        if st.has_moe_layers:  # the experts this rank holds now, from the expert files
            from deepspeed_c.runtime.checkpointing import moe

            moe.check_stage(self.options.zero_stage, st.module)
            module_state = {**module_state, **moe.load_experts(st.module, saved.tag_dir, saved.manifest)}
        if saved.partitioned_weights:
            if not self.options.zero and not self.options.load_universal:  # universal: weights from zero/
                raise NotImplementedError(
                    f"load_checkpoint: {saved.tag_dir} is a ZeRO stage-3 checkpoint (its weights are partitioned over "
                    "its ZeRO files) and this engine runs without ZeRO; load it into a ZeRO engine, or recover whole "
                    "weights with zero_to_fp32 and load those")
            if not self.options.partition_weights and custom_load_fn is None:
                # an engine keeping whole parameters gets each frozen one from every rank's fragments
                from deepspeed_c.runtime.checkpointing.zero3 import whole_frozen_params

                module_state = dict(module_state)
                module_state.update(whole_frozen_params(saved.tag_dir, saved.manifest, saved.model_state,
                                                        saved.model_rank))
        return module_state

    def _open_tag(self, load_dir: str, tag: str, dp_rank: int = 0, mp_rank: int = 0,
                  mp_world_size: int = 1) -> tuple[str, Any, dict, str, Optional[int]]:
        """The tag's directory, its manifest, its model-states file, that file's name and, for a ZeRO-3
        checkpoint (per-rank model-states files), whose file it is (this rank's, else rank 0's)."""
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
        from deepspeed_c.runtime.checkpointing.zero3 import check_model_parallel_degree, is_stage3_checkpoint

        if is_stage3_checkpoint(tag_dir, dp_rank):
            check_model_parallel_degree(tag_dir, mp_world_size)
            rank = dp_rank if os.path.isfile(os.path.join(tag_dir, zero3_model_file(dp_rank, mp_rank))) else 0
            name = zero3_model_file(rank, mp_rank)
            return tag_dir, manifest, store.load_file(tag_dir, name, manifest), name, rank
        name = model_file(mp_rank)
        if mp_rank and not os.path.isfile(os.path.join(tag_dir, name)):
            raise FileNotFoundError(f"load_checkpoint: {tag_dir} has no {name} for model-parallel rank {mp_rank} "
                                    f"(directory holds: {store.listing(tag_dir)}); it was saved with fewer "
                                    "model-parallel ranks, and changing the tensor-parallel degree of a client "
                                    "mpu's checkpoint is not supported")
        return tag_dir, manifest, store.load_file(tag_dir, name, manifest), name, None

    def _load_module(self, st: CheckpointStates, saved: dict, strict: bool, custom_load_fn: Optional[Callable]) -> None:
        if custom_load_fn is not None:
            custom_load_fn(src=saved, dst=st.module)
            return
        # full shapes: a ZeRO-3 parameter's data is a placeholder, its ds_shape the real shape
        own = {k: torch.Size(v.shape) for k, v in st.module.state_dict().items()}
        for n, p in st.module.named_parameters(remove_duplicate=False):
            if n in own:
                own[n] = torch.Size(getattr(p, "ds_shape", p.shape))
        # a ZeRO-3 checkpoint's parameters are placeholders: their values come from its ZeRO files
        placeholders = {k for k, v in saved.items() if isinstance(v, torch.Tensor) and v.numel() == 0
                        and k in own and own[k].numel() > 0}
        missing = sorted(set(own) - set(saved))
        unexpected = sorted(set(saved) - set(own))
        wrong = [f"{k}: checkpoint {tuple(saved[k].shape)} vs model {tuple(own[k])}"
                 for k in sorted(set(own) & set(saved) - placeholders)
                 if isinstance(saved[k], torch.Tensor) and saved[k].shape != own[k]]
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
        values = {k: v for k, v in saved.items() if k not in placeholders}
        if st.stepper is not None:  # checked above: strict's complaints were raised already
            st.stepper.load_module_state(st.module, values)
        else:
            st.module.load_state_dict(values, strict=False)

    def _load_optimizer(self, st: CheckpointStates, saved: SavedCheckpoint, load_states: bool) -> None:
        if st.stepper is None:
            return
        if self.options.load_universal:
            names = _param_names(st.module)
            universal_load.load(st.stepper, saved, lambda p: names[id(p)], load_states, st.module, st.mp_rank,
                                st.mp_world_size)
            return
        zero.load_partition(st.stepper, saved, load_states)
