"""engine.save_checkpoint / load_checkpoint of a PipelineEngine, in DeepSpeed's pipeline layout,
written and read through the engine's crash-safe store (checkpoint/store.py): every rank writes its
files into the tag's staging directory, rank 0 adds the manifest of all of them, moves the directory
into place and replaces `latest` last, so a crash at any point leaves the previous checkpoint (and
`latest`) whole. Loading reads every file weights_only (checkpoint/safe_load.py: a file that names
any other Python object is refused, nothing is executed) and verifies it against the manifest. Each
step that only some ranks do, or that can fail on one rank, runs under collective_guard's
rank_local_step, so a failure on any rank raises on every rank instead of leaving the others in a
collective until the process group times out. The checkpointer sees the stage's states
(PipeCheckpointStates) and its CheckpointOptions, never the engine."""
from __future__ import annotations

import os
import re
from collections import OrderedDict
from typing import Any, Optional

import torch.distributed as dist

from deepspeed_c.checkpoint import store
from deepspeed_c.runtime.checkpointing import run_state, universal_load
from deepspeed_c.runtime.checkpointing.options import CheckpointOptions
from deepspeed_c.runtime.checkpointing.states import PipeCheckpointStates
from deepspeed_c.runtime.checkpointing.zero import load_partition, save_partition
from deepspeed_c.runtime.checkpointing.collective_guard import check_dir_arg, rank_local_step, tags_agree, validate_tag

from deepspeed_c.runtime.checkpointing.pipeline_layers import apply_layer_states, layer_file_states, read_layer_files

# keys of the stage files that are DeepSpeed's; everything else is client state
DS_KEYS = frozenset({"module", "optimizer", "param_shapes", "lr_scheduler", "sparse_tensor_module_names",
                     "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
                     "ds_config", "ds_version"})


def _state_file(stage: int) -> str:
    return f"mp_rank_{stage:02d}_model_states.pt"


def _check_tag(tag: str) -> None:
    # a leading '.' is the store's (.tag.partial staging, .tag.old during a re-save)
    if not tag or os.sep in tag or tag.startswith("."):
        raise ValueError(f"save_checkpoint: tag {tag!r} must be a non-empty name without '{os.sep}' or a "
                         "leading '.'")


def _tag_dir(load_dir: str, tag: str) -> str:
    """The tag's directory; its previous copy when a re-save of the tag was interrupted between the
    store's two renames (the old copy is whole then)."""
    from deepspeed_c.utils.logging import logger

    tag_dir = os.path.join(load_dir, tag)
    previous = os.path.join(load_dir, f".{tag}.old")
    if not os.path.isdir(tag_dir) and os.path.isdir(previous):
        logger.warning(f"checkpoint {tag_dir} is missing; loading the previous copy {previous}")
        return previous
    if not os.path.isdir(tag_dir):
        raise FileNotFoundError(f"load_checkpoint: checkpoint tag {tag!r} not found in {load_dir} "
                                f"(directory holds: {store.listing(load_dir)})")
    return tag_dir


class PipeCheckpointer:
    """The files of a tag: layer_XX-model_states.pt (weights, per layer, so another pipeline degree
    can read them), mp_rank_{stage}_model_states.pt (module None; the stage's optimizer state, LR
    scheduler and counters), ZeRO-1 [bf16_]zero_pp_rank_{dp}_mp_rank_{stage}_optim_states.pt, each
    rank's own optimizer file where the optimizer keeps one (1-bit: onebit_errors_rank_R_of_W.pt),
    the store's dsc_manifest.json, and `latest` beside the tag. Optimizer states come back when the
    number of stages matches what was saved (ZeRO-1 from the stage's ZeRO files, re-cut if the
    data-parallel degree differs); with another number of stages the layers are re-partitioned and the
    optimizer states (and fp32 masters) found by parameter name (pipeline_reshard.py), for fp32, bf16/fp16
    and ZeRO-1 alike."""

    def __init__(self, options: CheckpointOptions) -> None:
        from deepspeed_c.runtime.checkpointing.async_writer import BackgroundWriter, at_exit

        self.options = options
        # checkpoint.writer: each rank's files staged and written in the background; the commit (every rank's
        # manifest entries gathered, rank 0 commits) at the next commit point, as for the other engines
        self.writer = BackgroundWriter(options.writer) if options.writer is not None else None
        self._pending: Optional[tuple] = None
        if self.writer is not None:
            at_exit(self)

    @property
    def has_pending(self) -> bool:
        return self._pending is not None

    def commit_pending(self) -> bool:
        """Waits for this rank's background write of the last save and commits it (collective). A failed
        write raises on every rank and its staging directory is removed. False when no save is pending."""
        pending, self._pending = self._pending, None
        if pending is None or self.writer is None:
            return False
        save_dir, tag, save_latest, mine = pending
        leader = dist.get_rank() == 0
        try:
            with rank_local_step("checkpoint_commit (this rank's background write)"):
                mine = {**mine, **self.writer.wait()}
            self._commit(save_dir, tag, save_latest, mine, commit=self.writer.writes)
        except BaseException:
            if leader:
                store.abort(save_dir, tag)
            raise
        return True

    def _commit(self, save_dir: str, tag: str, save_latest: bool, mine: dict[str, dict], commit: bool = True) -> None:
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        files: dict[str, dict] = {}
        for theirs in every:
            files.update(theirs)
        with rank_local_step("save_checkpoint (committing the checkpoint)"):
            if dist.get_rank() == 0:
                if commit:
                    store.commit(save_dir, tag, files, save_latest)
                else:  # the mock writer: nothing was written, nothing is committed
                    store.abort(save_dir, tag)

    def save(self, st: PipeCheckpointStates, save_dir: str, tag: Any, client_state: dict, save_latest: bool,
             exclude_frozen_parameters: bool) -> bool:
        # every check before the first collective, on every rank: a bad argument raises everywhere
        save_dir = check_dir_arg("save_checkpoint", "save_dir", save_dir)
        if not isinstance(client_state, dict):
            raise TypeError(f"save_checkpoint: client_state must be a dict, got {type(client_state).__name__}")
        clash = sorted(set(client_state) & DS_KEYS)
        if clash:
            raise ValueError(f"save_checkpoint: client_state keys {clash} collide with DeepSpeed's own keys")
        store.check_plain(client_state, "client_state")
        tag = f"global_step{st.train_state.global_steps}" if tag is None else str(tag)
        _check_tag(tag)
        agree = validate_tag(tag, self.options.tag_validation, self.options.tag_validation_fail)
        if not (agree if agree is not None else tags_agree(tag)):  # the same outcome on every rank
            # DeepSpeed writes each rank's layer files under its own tag; here one staged tag holds every stage's
            raise NotImplementedError(f"save_checkpoint: the ranks pass different tags (this rank {tag!r}); a "
                                      "pipeline-parallel checkpoint takes one tag on every rank")
        self.commit_pending()  # the previous background save first: its failure is raised here
        writer = dist.get_rank() == 0
        with rank_local_step("save_checkpoint (creating the checkpoint directory)"):
            if writer:
                # what saves killed mid-way left behind: staging directories, the temporary of `latest`
                store.remove_stale_staging(save_dir, keep=tag)
                store.remove_stale_temporaries(os.path.join(save_dir, store.LATEST_NAME))
                store.begin(save_dir, tag)
        try:
            return self._save_staged(st, save_dir, tag, client_state, save_latest, exclude_frozen_parameters,
                                     writer)
        except BaseException:
            # every rank raised at the same step (rank_local_step), so none writes into the staging
            # directory any more: its partial files would only hold the space
            if writer:
                store.abort(save_dir, tag)
            if self.writer is not None:
                self.writer.discard()
            raise

    def _save_staged(self, st: PipeCheckpointStates, save_dir: str, tag: str, client_state: dict, save_latest: bool,
                     exclude_frozen_parameters: bool, writer: bool) -> bool:
        """Every rank's files into the staging directory, then rank 0 commits it."""
        staging = store.staging_dir(save_dir, tag)
        module, stepper = st.module, st.stepper
        names = {id(p): n for n, p in module.named_parameters()}
        # ZeRO-1: building this rank's partition is collective, so it happens outside the rank-local step
        part = save_partition(stepper, lambda p: names[id(p)]) if stepper is not None else None
        if part is not None and "clip_grad" in part[1]:
            # the stage's optimizer runs unclipped (the executor clips with the pipeline-wide norm); DeepSpeed's
            # files carry the configured value, and its loader sets its clipping from them
            part[1]["clip_grad"] = self.options.gradient_clipping
        mine: dict[str, dict] = {}

        def write(name: str, obj: dict) -> None:
            if name in mine:
                raise ValueError(f"save_checkpoint: two files of this rank are named {name!r}")
            if self.writer is None:
                mine[name] = store.save_file(obj, os.path.join(staging, name))
            else:  # staged into host memory now, written by the background writer
                self.writer.stage(name, obj, os.path.join(staging, name))
                mine[name] = None

        with rank_local_step("save_checkpoint (writing this rank's files)"):
            for name, sd in layer_file_states(module, exclude_frozen_parameters,
                                              self.options.parallel_write_pipeline).items():
                write(name, sd)
            if part is not None:
                from deepspeed_c.checkpoint.deepspeed_format import zero_file_name
                from deepspeed_c.version import DEEPSPEED_API_VERSION

                write(zero_file_name(part[0], self.options.bf16, st.mp_rank),
                      {"optimizer_state_dict": part[1], "ds_config": self.options.ds_config,
                       "ds_version": DEEPSPEED_API_VERSION})
            own = stepper.rank_checkpoint_file() if stepper is not None else None
            if own is not None:  # state that differs between ranks (the 1-bit optimizers' compression errors)
                if os.sep in own[0] or own[0].startswith("."):
                    raise ValueError(f"save_checkpoint: the optimizer's rank file name {own[0]!r} is not a plain "
                                     "file name")
                write(own[0], own[1])
            if st.stage_dp_rank == 0:
                write(_state_file(st.mp_rank), self._stage_state(st, names, part is None, client_state))
            write(*run_state.rng_file(dist.get_rank(), dist.get_world_size()))  # an exact resume's RNG
        if self.writer is not None:
            self.writer.start()
            self._pending = (save_dir, tag, save_latest, {k: v for k, v in mine.items() if v is not None})
            return True
        self._commit(save_dir, tag, save_latest, mine)
        return True

    def _stage_state(self, st: PipeCheckpointStates, names: dict[int, str], optimizer_here: bool,
                     client_state: dict) -> dict:
        """mp_rank_{stage}_model_states.pt as DeepSpeed's pipeline engine writes it (module None: the
        weights are in the layer files), less `sparse_tensor_module_names` (a set, which the store's
        plain-data check refuses; the engine's model file leaves it out too, and DeepSpeed's loader reads
        it only where it is present)."""
        from deepspeed_c.version import DEEPSPEED_API_VERSION

        stepper = st.stepper
        counters = st.train_state.state_dict()
        # DeepSpeed's param_shapes: per param group, the names the optimizer's positions stand for
        # (what lets another pipeline degree find each layer's optimizer state, pipeline_reshard.py)
        groups = stepper.model_param_groups() if stepper is not None else []
        return {
            "module": None,
            "optimizer": stepper.model_file_state() if stepper is not None and optimizer_here else None,
            "param_shapes": [OrderedDict((names[id(p)], p.shape) for p in ps if id(p) in names) for ps in groups],
            "lr_scheduler": st.lr_scheduler.state_dict() if st.lr_scheduler is not None else None,
            "data_sampler": run_state.data_sampler_state(st.data_loader),
            "skipped_steps": counters["skipped_steps"],
            "global_steps": counters["global_steps"],
            "global_samples": counters["global_samples"],
            "dp_world_size": st.dp_world_size,
            "mp_world_size": st.mp_world_size,  # the stages (x tensor slices: 3D)
            "ds_config": self.options.ds_config,
            "ds_version": DEEPSPEED_API_VERSION,
            **client_state,
        }

    def load(self, st: PipeCheckpointStates, load_dir: str, tag: Any, load_module_strict: bool,
             load_optimizer_states: bool, load_lr_scheduler_states: bool, load_module_only: bool,
             custom_load_fn: Any) -> tuple:
        from deepspeed_c.utils.logging import logger

        load_dir = check_dir_arg("load_checkpoint", "load_dir", load_dir)
        if custom_load_fn is not None:
            raise ValueError("custom_load_fn not supported w. pipeline parallelism")
        self.commit_pending()  # a save still being written is committed first: it may be the one loaded
        if tag is None:
            with rank_local_step("load_checkpoint (reading latest)"):  # an empty `latest` raises on every rank
                tag = (universal_load.read_latest if self.options.load_universal else store.read_latest)(load_dir)
            if tag is None:
                logger.warning(f"Unable to find latest file at {os.path.join(load_dir, store.LATEST_NAME)} "
                               f"(directory holds: {store.listing(load_dir)}); pass an explicit tag or save a "
                               "checkpoint with save_latest=True")
                return None, None
        module = st.module
        # read everything this rank needs before anything is applied: a bad file on any rank leaves
        # every rank's model as it was
        with rank_local_step("load_checkpoint (reading this stage's checkpoint files)"):
            if not str(tag):
                raise ValueError("load_checkpoint: tag must be a non-empty name (or None: the tag `latest` names)")
            tag_dir = _tag_dir(load_dir, str(tag))
            if self.options.load_universal:  # a folder ds_to_universal wrote, or a clear error
                universal_load.check_folder(tag_dir)
            manifest = store.read_manifest(tag_dir)
            layers = read_layer_files(module, tag_dir, manifest)
            name = _state_file(st.mp_rank)
            if not os.path.isfile(os.path.join(tag_dir, name)):
                name = _state_file(0)  # fewer stages saved than now: counters are shared
            state = store.load_file(tag_dir, name, manifest)
        with rank_local_step("load_checkpoint (applying the layer weights)"):
            apply_layer_states(module, layers, load_module_strict)
        module.synchronize_tied_weights()
        with rank_local_step("load_checkpoint (restoring the optimizer and training state)"):
            stepper = st.stepper
            if stepper is not None:
                if load_module_only or not load_optimizer_states:
                    stepper.refresh_masters()
                else:
                    self._load_optimizer(st, tag_dir, manifest, state)
            if not load_module_only:
                if load_lr_scheduler_states and st.lr_scheduler is not None and state.get("lr_scheduler"):
                    st.lr_scheduler.load_state_dict(state["lr_scheduler"])
                st.train_state.load_state_dict(state)  # a file without global_samples: 0, as before
                run_state.restore(st.data_loader, state, tag_dir, manifest, dist.get_rank(), dist.get_world_size())
        return os.path.join(tag_dir, name), {k: v for k, v in state.items() if k not in DS_KEYS}

    def _load_optimizer(self, st: PipeCheckpointStates, tag_dir: str, manifest: Optional[dict], state: dict) -> None:
        """The optimizer states: from this stage's files when the stage holds the layers it held when
        saved (ZeRO-1: the zero_pp_rank_{dp}_mp_rank_{stage} files, re-cut if the data-parallel degree
        differs); with another number of stages or partition, by parameter name (pipeline_reshard.py);
        where that cannot be done the optimizer starts fresh, with a warning."""
        from deepspeed_c.runtime.optimizer_seam import PlainOptimizer, SavedCheckpoint
        from deepspeed_c.runtime.precision import MixedPrecisionOptimizer
        from deepspeed_c.utils.logging import logger

        stepper, saved_stages = st.stepper, state.get("mp_world_size")
        zero = self.options.zero
        if self.options.load_universal:  # per parameter name, from zero/<param>/: any stage count and degree
            names = {id(p): n for n, p in st.module.named_parameters()}
            saved = SavedCheckpoint(tag_dir=tag_dir, manifest=manifest, model_state=state, bf16=self.options.bf16,
                                    load_from_fp32_weights=True, node_local=False, mp_rank=st.mp_rank)
            universal_load.load(stepper, saved, lambda p: names[id(p)], True, st.module)
            return
        saved_zero = state.get("optimizer") is None and any(
            n.endswith("_mp_rank_00_optim_states.pt") and "zero_pp_rank_" in n for n in os.listdir(tag_dir))
        if zero != saved_zero:
            raise ValueError(f"load_checkpoint: {tag_dir} was saved with {'ZeRO' if saved_zero else 'no ZeRO'} "
                             f"optimizer states, this engine runs zero_optimization.stage "
                             f"{self.options.zero_stage}; pass load_optimizer_states=False")
        names = {id(p): n for n, p in st.module.named_parameters()}
        groups = [[names[id(p)] for p in ps] for ps in stepper.model_param_groups()]
        saved_names = state.get("param_shapes")
        # positions mean the same parameters when the stage holds the same layers as when saved (same
        # number of stages and, where the file names them, the same partition)
        if saved_stages == st.mp_world_size and (saved_names is None or [list(g) for g in saved_names] == groups):
            saved = SavedCheckpoint(tag_dir=tag_dir, manifest=manifest, model_state=state,
                                    bf16=self.options.bf16, load_from_fp32_weights=self.options.load_from_fp32_weights,
                                    node_local=False, mp_rank=st.mp_rank)
            load_partition(stepper, saved, True)
            stepper.load_rank_checkpoint_file(saved)
            return
        sliced = any(re.match(r"layer_\d+-model_\d+-", n) for n in os.listdir(tag_dir))  # tensor-sliced layer files
        if st.mp_world_size != st.num_stages or sliced:
            raise NotImplementedError(f"load_checkpoint: {tag_dir} holds {saved_stages} model-parallel ranks' files and "
                                      f"this 3D engine has {st.mp_world_size} (pipeline x tensor slices) or another "
                                      "partition: re-partitioning a tensor-sliced pipeline checkpoint is not built; "
                                      "load it at the degrees it was saved with, or pass load_optimizer_states=False")
        from deepspeed_c.runtime.checkpointing.pipeline_reshard import restore_by_name, restore_zero_by_name

        if zero:
            why = restore_zero_by_name(stepper, groups, tag_dir, manifest, int(saved_stages),
                                       self.options.bf16)
        elif isinstance(stepper, (PlainOptimizer, MixedPrecisionOptimizer)):
            why = restore_by_name(stepper, groups, tag_dir, manifest, int(saved_stages))
        else:
            why = f"{type(stepper).__name__} states cannot be re-partitioned by parameter name"
        if why is None:
            return
        logger.warning(f"load_checkpoint: {tag_dir} was saved with {saved_stages} pipeline stages, this engine has "
                       f"{st.num_stages} (or another partition): weights re-partitioned, optimizer states not "
                       f"restored ({why})")
        stepper.refresh_masters()
