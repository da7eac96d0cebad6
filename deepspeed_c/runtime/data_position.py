"""Where DeepSpeedDataLoader stands in its pass over the data, saved with each checkpoint (the model-states
file's `data_sampler`, DeepSpeed's key for its data sampler's state) and restored by load_checkpoint, so a
resumed run is fed exactly the batches the uninterrupted run would have been fed next.

The loader counts the batches it has handed out since its current pass began. On restore, the next pass
it starts skips that many batches at the sampler (indices are dropped, no sample is loaded) and leaves the
global torch RNG as it found it: the DataLoader iterator draws its workers' base seed from that RNG, a
draw the uninterrupted run made before the saved RNG state was taken. A shuffling sampler's order comes
back with it: a DistributedSampler's epoch is restored (its order is a function of seed and epoch), and
the RandomSampler the loader builds itself draws one seed per pass, which is saved."""
from __future__ import annotations

from typing import Any, Iterator, Mapping, Optional

import torch
from torch.utils.data import RandomSampler, Sampler

from deepspeed_c.utils.logging import logger


class SkippingSampler(Sampler):
    """`inner`'s indices less the first `skip`: the rest of a pass that was interrupted."""

    def __init__(self, inner: Any, skip: int) -> None:
        self.inner = inner
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        for i, index in enumerate(self.inner):
            if i >= self.skip:
                yield index

    def __len__(self) -> int:
        return max(0, len(self.inner) - self.skip)


class SeededRandomSampler(RandomSampler):
    """The RandomSampler a loader builds for itself (no data_sampler given, not distributed): each pass draws
    its order from a generator seeded with that pass's seed, which checkpoints record."""

    def reseed(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)


class ResumableLoader:
    """The position half of DeepSpeedDataLoader: state_dict / load_state_dict and the hooks the loader
    calls when it hands out a batch (_advance) and when it starts a pass (_pass_sampler)."""
    data_sampler: Any
    batch_size: int
    data: Any

    def _init_position(self, owns_random_sampler: bool, data_parallel_world_size: Optional[int]) -> None:
        self._batches = 0  # batches handed out in the current pass
        self._resume: Optional[dict[str, Any]] = None  # a loaded position, applied by the next pass
        self._owns_random_sampler = owns_random_sampler
        self._pass_seed: Optional[int] = None
        self._dp_world = int(data_parallel_world_size or 1)

    def _advance(self) -> None:
        self._batches += 1

    def _pass_sampler(self) -> tuple[Any, int, Optional[Any]]:
        """(sampler for the pass starting now, batches to discard by drawing them (an iterable dataset,
        which cannot be cut at the sampler), the torch RNG state to put back once the iterator exists
        (None: leave the RNG as the iterator leaves it))."""
        resume, self._resume = self._resume, None
        skip = int(resume["batches"]) if resume is not None else 0
        if self._owns_random_sampler:
            seed = resume.get("sampler_seed") if resume is not None else None
            if seed is None:
                seed = int(torch.empty((), dtype=torch.int64).random_().item())
            self._pass_seed = int(seed)
            self.data_sampler.reseed(self._pass_seed)
        self._batches = skip
        rng = torch.get_rng_state() if resume is not None else None
        if skip == 0 or self.data_sampler is None:
            return self.data_sampler, skip, rng
        return SkippingSampler(self.data_sampler, skip * self.batch_size), 0, rng

    def state_dict(self) -> dict[str, Any]:
        """The position: batches handed out in the current pass, the batch size and data-parallel degree
        they were cut with, the sampler's epoch (set_epoch) and the pass's shuffling seed."""
        return {"batches": self._batches, "batch_size": self.batch_size, "dp_world_size": self._dp_world,
                "epoch": getattr(self.data_sampler, "epoch", None), "sampler_seed": self._pass_seed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Takes effect at the next pass the loader starts (its next `iter()` or `next()`; a pass under
        way is dropped). Saved with another batch size or data-parallel degree, the pass resumes at the
        batch holding the first sample not yet consumed over all ranks (the order itself differs then)."""
        if not isinstance(state, Mapping) or "batches" not in state:
            raise ValueError(f"DeepSpeedDataLoader.load_state_dict: expected a dict with 'batches' (a saved "
                             f"loader position), got {state!r}")
        resume = dict(state)
        saved_bs, saved_dp = int(state.get("batch_size", self.batch_size)), int(state.get("dp_world_size", 1))
        if (saved_bs, saved_dp) != (self.batch_size, self._dp_world):
            consumed = int(state["batches"]) * saved_bs * saved_dp
            resume["batches"] = consumed // (self.batch_size * self._dp_world)
            logger.warning(f"data loader position saved with batch size {saved_bs} x {saved_dp} data-parallel ranks, "
                           f"loaded with {self.batch_size} x {self._dp_world}: resuming the pass after "
                           f"{resume['batches']} batches (not the same sample order as the saving run)")
        epoch = state.get("epoch")
        if epoch is not None and hasattr(self.data_sampler, "set_epoch"):
            self.data_sampler.set_epoch(int(epoch))
        self._resume = resume
        self.data = None  # the next next() starts the resumed pass
