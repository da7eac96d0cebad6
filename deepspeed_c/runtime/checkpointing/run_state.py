"""The training state beyond weights, optimizer and counters that an exact resume needs, saved with each
checkpoint and restored by load_checkpoint unless `load_module_only`:

- the data loader's position: the model-states file's `data_sampler` (DeepSpeed's key, which its engine
  fills only for its curriculum sampler and reads back only with curriculum learning on, so a DeepSpeed
  engine loading our file ignores ours); the same on every data-parallel rank, written by the writer of
  the model-states file;
- each rank's random generators (runtime/rng_state.py): `dsc_rng_state_rank_R_of_W.pt`, one per global
  rank, beside the shared files (DeepSpeed's checkpoints have none; a checkpoint without one, or saved
  at another world size, leaves the generators as they are, with a warning).

The checkpointers call these with the stateful objects of CheckpointStates; nothing here reads an engine."""
from __future__ import annotations

import os
from typing import Any, Optional

from deepspeed_c.checkpoint import store
from deepspeed_c.runtime.rng_state import RNGStates
from deepspeed_c.utils.logging import logger

DATA_SAMPLER_KEY = "data_sampler"
# the legacy curriculum's and progressive layer drop's state (DeepSpeed saves neither; a resumed PLD restarts
# at theta 1.0 there), written only when one of them is on
SCHEDULES_KEY = "dsc_forward_schedules"


def rng_file_name(rank: int, world: int) -> str:
    return f"dsc_rng_state_rank_{rank:05d}_of_{world:05d}.pt"


def data_sampler_state(data_loader: Optional[Any]) -> Optional[dict]:
    """The loader's position for the model-states file; None without a loader that keeps one."""
    if data_loader is None or not callable(getattr(data_loader, "state_dict", None)):
        return None
    return data_loader.state_dict()


def schedules_state(schedules: Optional[Any]) -> Optional[dict]:
    """The forward schedules' state for the model-states file; None when none is on."""
    return schedules.state_dict() if schedules is not None else None


def random_ltd_state(schedules: Optional[Any]) -> Optional[dict]:
    """The random-LTD scheduler's state under DeepSpeed's `random_ltd` key; None when it is off."""
    return schedules.random_ltd_state_dict() if schedules is not None else None


def restore_schedules(schedules: Optional[Any], model_state: dict) -> None:
    if schedules is not None:
        schedules.load_state_dict(model_state.get(SCHEDULES_KEY), model_state.get("random_ltd"))


def rng_file(rank: int, world: int) -> tuple[str, dict]:
    """(name, payload) of this rank's RNG file."""
    return rng_file_name(rank, world), {"rank": rank, "world": world, "rng": RNGStates().state_dict()}


def restore(data_loader: Optional[Any], model_state: dict, tag_dir: str, manifest: Any, rank: int,
            world: int) -> None:
    """The loader's position and this rank's generators, where the checkpoint has them."""
    sampler = model_state.get(DATA_SAMPLER_KEY)
    # "batches": DeepSpeedDataLoader's position; "curriculum_step": the curriculum sampler's state
    if data_loader is not None and isinstance(sampler, dict) \
            and ("batches" in sampler or "curriculum_step" in sampler) \
            and callable(getattr(data_loader, "load_state_dict", None)):
        data_loader.load_state_dict(sampler)
    name = rng_file_name(rank, world)
    if os.path.isfile(os.path.join(tag_dir, name)):
        RNGStates().load_state_dict(store.load_file(tag_dir, name, manifest)["rng"])
        return
    saved = sorted(n for n in os.listdir(tag_dir) if n.startswith("dsc_rng_state_rank_"))
    if saved:
        logger.warning(f"load_checkpoint: {tag_dir} holds the RNG states of another world size ({saved[0]} ...), "
                       f"not {name}: the random generators are not restored (dropout draws differ from the saving "
                       "run's)")
