"""DeepSpeedDataSampler: the data-efficiency curriculum sampler. It yields each rank's micro-batch of sample
indices; with `data_sampling.curriculum_learning` on, the samples come from the clusters the curriculum has
opened so far, in DeepSpeed's order:

- each global batch is one curriculum step: every metric's CurriculumScheduler moves to the step; when a
  difficulty changes, the samples that became admissible form a new cluster (value-based: the index_to_metric
  rows in (previous, current]; percentile-based: that slice of the sorted index_to_sample rows; with several
  clustered metrics, the intersection of each metric's admissible set, minus the earlier clusters), shuffled
  and written to `data_cluster_path/cluster_<metric><difficulty>...` as an index file pair;
- the batch draws how many samples come from each cluster (with replacement, weighted by cluster size),
  takes them in order from each cluster (reshuffling a cluster when it runs out) and shuffles the batch;
- rank 0 computes the batch with a numpy Generator seeded by `data_efficiency.seed` and broadcasts it over
  the data-parallel group, so every rank sees the same global order; rank r takes its slice of each micro-batch.

Without the curriculum the sampler has nothing to draw from (as DeepSpeed's: it yields nothing).
`state_dict` carries DeepSpeed's keys plus the generator's own state (`dsc_np_rng_state`): DeepSpeed saves
numpy's global generator instead, so its resumed order differs from the uninterrupted one; ours resumes to the
identical order."""
from __future__ import annotations

import copy
import os
from typing import Any, Iterator, Optional

import numpy as np
import torch

from deepspeed_c.runtime.config.utils import DeepSpeedConfigError
from deepspeed_c.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
from deepspeed_c.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset
from deepspeed_c.runtime.data_pipeline.data_sampling.utils import (close_mmap_dataset_builder,
                                                                   create_mmap_dataset_builder, find_fit_int_dtype)
from deepspeed_c.utils.logging import logger

_CL = "data_efficiency.data_sampling.curriculum_learning"
VALUE, PERCENTILE, SINGLE_CLUSTER, SCHEDULE_BASED = "value", "percentile", "single_cluster", "schedule_based"


def validate_metric(name: str, cfg: dict) -> None:
    path = f"{_CL}.curriculum_metrics.{name}"
    if cfg.get("difficulty_type") not in (VALUE, PERCENTILE):
        raise DeepSpeedConfigError(f"Invalid value {cfg.get('difficulty_type')!r} for config key "
                                   f"'{path}.difficulty_type': expected 'value' or 'percentile'")
    if cfg.get("clustering_type") not in (SINGLE_CLUSTER, SCHEDULE_BASED):
        raise DeepSpeedConfigError(f"Invalid value {cfg.get('clustering_type')!r} for config key "
                                   f"'{path}.clustering_type': expected 'single_cluster' or 'schedule_based'")
    if cfg["clustering_type"] == SINGLE_CLUSTER:
        return
    needed = ["index_to_sample_path"] + (["index_to_metric_path"] if cfg["difficulty_type"] == VALUE else [])
    for key in needed:
        prefix = cfg.get(key)
        if not isinstance(prefix, str):
            raise DeepSpeedConfigError(f"Config key '{path}.{key}' is required (the prefix of an index file pair)")
        for ext in (".idx", ".bin"):
            if not os.path.isfile(prefix + ext):
                raise DeepSpeedConfigError(f"Config key '{path}.{key}': {prefix + ext} does not exist (the "
                                           "DataAnalyzer writes <prefix>.idx and <prefix>.bin)")


def _plain_np_state(state: tuple) -> list:
    """numpy's global generator state with its key array as a list (checkpoints hold no numpy arrays)."""
    name, key, pos, has_gauss, gauss = state
    return [name, [int(k) for k in key], int(pos), int(has_gauss), float(gauss)]


class DeepSpeedDataSampler:

    def __init__(self, data_efficiency_config: dict, one_epoch_total_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, data_parallel_group: Any,
                 gradient_accumulation_steps: int, global_rank: int, drop_last: bool = True) -> None:
        if one_epoch_total_samples <= 0 or micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ValueError(f"DeepSpeedDataSampler: one_epoch_total_samples ({one_epoch_total_samples}), "
                             f"micro_batch_size ({micro_batch_size}) and data_parallel_size ({data_parallel_size}) "
                             "must be > 0")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"DeepSpeedDataSampler: data_parallel_rank {data_parallel_rank} is not below "
                             f"data_parallel_size {data_parallel_size}")
        self.data_efficiency_config = data_efficiency_config
        sampling = data_efficiency_config["data_sampling"]
        self.cl_config: dict = sampling.get("curriculum_learning", {})
        self.one_epoch_total_samples = one_epoch_total_samples
        self.index_dtype = find_fit_int_dtype(0, one_epoch_total_samples)
        self.total_samples = one_epoch_total_samples * sampling.get("num_epochs", 1000)
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.data_parallel_group = data_parallel_group
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.global_batch_size = self.micro_batch_times_data_parallel_size * gradient_accumulation_steps
        self.global_rank = global_rank
        self.drop_last = drop_last
        self.np_rng = np.random.default_rng(data_efficiency_config.get("seed", 1234))
        self.batch: list[int] = []
        self.consumed_samples = 0
        self.curriculum_step = 0
        self.current_difficulties: dict[str, Any] = {}
        self.data_cluster_paths: list[str] = []
        self.data_cluster_current_position: list[int] = []
        self.data_clusters: list[MMapIndexedDataset] = []
        self.data_cluster_sizes: list[int] = []
        self.curriculum_schedulers: dict[str, CurriculumScheduler] = {}
        self.index_to_sample: dict[str, MMapIndexedDataset] = {}
        self.index_to_metric: dict[str, MMapIndexedDataset] = {}
        self.difficulty_type: dict[str, str] = {}
        self.clustering_type: dict[str, str] = {}
        self.data_1epoch_size: Optional[int] = None
        if self.cl_config.get("enabled", False):
            self._setup_curriculum()

    def _setup_curriculum(self) -> None:
        metrics = self.cl_config.get("curriculum_metrics")
        if not isinstance(metrics, dict) or not metrics:
            raise DeepSpeedConfigError(f"Config key '{_CL}.curriculum_metrics' must name at least one metric")
        if not isinstance(self.cl_config.get("data_cluster_path"), str):
            raise DeepSpeedConfigError(f"Config key '{_CL}.data_cluster_path' is required (where the clusters go)")
        if self.global_rank == 0:
            os.makedirs(self.cl_config["data_cluster_path"], exist_ok=True)
        for name, cfg in metrics.items():
            validate_metric(name, cfg)
            self.curriculum_schedulers[name] = CurriculumScheduler(cfg, key_path=f"{_CL}.curriculum_metrics.{name}")
            self.difficulty_type[name] = cfg["difficulty_type"]
            self.clustering_type[name] = cfg["clustering_type"]
            if self.global_rank == 0 and cfg["clustering_type"] != SINGLE_CLUSTER:
                self.index_to_sample[name] = MMapIndexedDataset(cfg["index_to_sample_path"])
                if cfg["difficulty_type"] == VALUE:
                    self.index_to_metric[name] = MMapIndexedDataset(cfg["index_to_metric_path"])

    def __len__(self) -> int:
        return self.total_samples

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: dict) -> None:
        for name, sched in self.curriculum_schedulers.items():
            if name in schedule_func_dict:
                sched.set_custom_get_difficulty(schedule_func_dict[name])

    def get_start_end_idx(self, batch_len: Optional[int] = None) -> tuple[int, int]:
        """This rank's [start, end) in a micro-batch of batch_len samples over the data-parallel ranks."""
        n = batch_len or self.micro_batch_times_data_parallel_size
        bound = lambda r: round(r * n / self.data_parallel_size)  # noqa: E731
        return bound(self.data_parallel_rank), bound(self.data_parallel_rank + 1)

    # -- cluster contents ----------------------------------------------------------------------------
    def get_sample_based_on_metric_value(self, metric: str, lo: float, hi: float) -> Optional[np.ndarray]:
        """The samples of the index_to_metric rows whose value is in (lo, hi], in row order."""
        metric_values, samples = self.index_to_metric[metric], self.index_to_sample[metric]
        rows = [np.copy(samples[r]) for r in range(len(samples)) if lo < metric_values[r][0] <= hi]
        return np.concatenate(rows) if rows else None

    def get_sample_based_on_metric_percentile(self, metric: str, lo: int, hi: int) -> Optional[np.ndarray]:
        """Samples lo..hi percentiles into the metric-sorted order (the last percentile takes the remainder)."""
        samples = self.index_to_sample[metric]
        if self.data_1epoch_size is None:
            self.data_1epoch_size = int(sum(int(s) for s in samples.sizes))
        top = self.cl_config["curriculum_metrics"][metric]["max_difficulty"]
        per = self.data_1epoch_size // top
        start, end = per * lo, (self.data_1epoch_size if hi == top else per * hi)
        flat = np.concatenate(samples[0:len(samples)]) if len(samples) else np.zeros(0, samples.dtype)
        part = np.copy(flat[start:end])
        return part if part.size else None

    def _admissible(self, metric: str, lo: Any, hi: Any) -> Optional[np.ndarray]:
        if self.difficulty_type[metric] == VALUE:
            return self.get_sample_based_on_metric_value(metric, lo, hi)
        return self.get_sample_based_on_metric_percentile(metric, lo, hi)

    def _cluster_name(self) -> str:
        return "cluster" + "".join(f"_{m}{self.current_difficulties[m]}" for m in self.curriculum_schedulers)

    def get_new_cluster(self, previous_difficulties: dict) -> None:
        name = self._cluster_name()
        path = os.path.join(self.cl_config["data_cluster_path"], name)
        if self.global_rank == 0:
            clustered = [m for m in self.clustering_type if self.clustering_type[m] != SINGLE_CLUSTER]
            new: Optional[np.ndarray] = None
            if len(clustered) > 1:
                for m in self.curriculum_schedulers:
                    if self.clustering_type[m] == SINGLE_CLUSTER:
                        part = np.arange(self.one_epoch_total_samples, dtype=self.index_dtype)
                    else:
                        part = self._admissible(m, float("-inf") if self.difficulty_type[m] == VALUE else 0,
                                                self.current_difficulties[m])
                    new = part if new is None else np.intersect1d(new, part, assume_unique=True)
                for cluster in self.data_clusters:
                    new = np.setdiff1d(new, cluster[0], assume_unique=True)
            else:
                if not self.data_clusters:
                    new = np.arange(self.one_epoch_total_samples, dtype=self.index_dtype)
                for m in clustered:
                    new = self._admissible(m, previous_difficulties[m], self.current_difficulties[m])
            if new is not None and len(new) > 0:
                self.np_rng.shuffle(new)
                builder = create_mmap_dataset_builder(path, self.index_dtype)
                builder.add_item_numpy(new)
                close_mmap_dataset_builder(builder, path)
                self.data_clusters.append(MMapIndexedDataset(path))
                self.data_cluster_sizes.append(len(self.data_clusters[-1][0]))
            else:
                logger.info(f"data sampler: no sample matches difficulties {self.current_difficulties}: no cluster")
        self._barrier()
        if os.path.isfile(f"{path}.bin"):
            self.data_cluster_paths.append(name)
            self.data_cluster_current_position.append(0)

    # -- drawing a batch -----------------------------------------------------------------------------
    def sample_from_clusters(self) -> np.ndarray:
        total = sum(self.data_cluster_sizes)
        weights = [s / total for s in self.data_cluster_sizes]
        picks = self.np_rng.choice(len(self.data_clusters), self.global_batch_size, replace=True, p=weights)
        return np.bincount(picks, minlength=len(self.data_clusters))

    def reshuffle_clusters(self, cidx: int) -> None:
        path = os.path.join(self.cl_config["data_cluster_path"], self.data_cluster_paths[cidx])
        cluster = np.copy(self.data_clusters[cidx][0])
        self.np_rng.shuffle(cluster)
        self.data_clusters[cidx] = None  # type: ignore[call-overload]  # release the map before rewriting
        builder = create_mmap_dataset_builder(path, self.index_dtype)
        builder.add_item_numpy(cluster)
        close_mmap_dataset_builder(builder, path)
        self.data_clusters[cidx] = MMapIndexedDataset(path)

    def get_sample_from_cluster(self, cidx: int, num_samples: int) -> list:
        start = self.data_cluster_current_position[cidx]
        samples = list(np.copy(self.data_clusters[cidx][0][start:start + num_samples]))
        self.data_cluster_current_position[cidx] += num_samples
        if len(samples) < num_samples:
            rest = num_samples - len(samples)
            self.reshuffle_clusters(cidx)
            samples += list(np.copy(self.data_clusters[cidx][0][:rest]))
            self.data_cluster_current_position[cidx] = rest
        return samples

    def get_next_global_batch(self) -> None:
        if not self.cl_config.get("enabled", False):
            return
        self.curriculum_step += 1
        changed, previous = False, {}
        for m, sched in self.curriculum_schedulers.items():
            nxt = sched.update_difficulty(self.curriculum_step)
            if m not in self.current_difficulties or nxt != self.current_difficulties[m]:
                changed = True
            previous[m] = self.current_difficulties.get(m, float("-inf") if self.difficulty_type[m] == VALUE else 0)
            self.current_difficulties[m] = nxt
        if changed:
            self.get_new_cluster(previous)
        batch = torch.full((self.global_batch_size, ), -1, dtype=torch.long)
        if self.global_rank == 0:
            counts = self.sample_from_clusters()
            drawn: list = []
            for cidx in range(len(counts)):
                drawn += self.get_sample_from_cluster(cidx, int(counts[cidx]))
            self.np_rng.shuffle(drawn)
            batch[:len(drawn)] = torch.tensor([int(s) for s in drawn], dtype=torch.long)
        batch = self._broadcast(batch)
        self.batch = batch[batch != -1].tolist()

    # -- communication -------------------------------------------------------------------------------
    def _distributed(self) -> bool:
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized() and self.data_parallel_size > 1

    def _barrier(self) -> None:
        if self._distributed():
            import torch.distributed as dist

            dist.barrier(group=self.data_parallel_group)

    def _broadcast(self, batch: torch.Tensor) -> torch.Tensor:
        if not self._distributed():
            return batch
        import torch.distributed as dist

        device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend(self.data_parallel_group) == "nccl" else torch.device("cpu")
        batch = batch.to(device)
        dist.broadcast(batch, src=0, group=self.data_parallel_group)
        return batch.cpu()

    def __iter__(self) -> Iterator[list]:
        width = self.micro_batch_times_data_parallel_size
        while self.consumed_samples <= self.total_samples:
            if not self.batch:
                self.get_next_global_batch()
                if not self.batch:
                    return  # nothing to draw from (curriculum off)
            current, self.batch = self.batch[:width], self.batch[width:]
            if len(current) == width or (current and not self.drop_last):
                start, end = self.get_start_end_idx(len(current))
                yield current[start:end]
                self.consumed_samples += len(current)

    # -- checkpoint ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"batch": list(self.batch), "consumed_samples": self.consumed_samples,
                "curriculum_step": self.curriculum_step, "current_difficulties": dict(self.current_difficulties),
                "data_cluster_paths": list(self.data_cluster_paths),
                "data_cluster_current_position": list(self.data_cluster_current_position),
                "np_rng_state": _plain_np_state(np.random.get_state()),
                "dsc_np_rng_state": copy.deepcopy(self.np_rng.bit_generator.state),
                "dsc_curriculum_schedulers": {m: s.state_dict() for m, s in self.curriculum_schedulers.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.batch = list(state["batch"])
        self.consumed_samples = state["consumed_samples"]
        self.curriculum_step = state["curriculum_step"]
        self.current_difficulties = dict(state["current_difficulties"])
        self.data_cluster_paths = [p.split("/")[-1] for p in state["data_cluster_paths"]]
        self.data_cluster_current_position = list(state["data_cluster_current_position"])
        if "dsc_np_rng_state" in state:
            self.np_rng.bit_generator.state = copy.deepcopy(state["dsc_np_rng_state"])
        else:  # a DeepSpeed checkpoint: it carries numpy's global generator, as DeepSpeed restores it
            np.random.set_state(tuple(state["np_rng_state"]))
        for m, s in state.get("dsc_curriculum_schedulers", {}).items():
            if m in self.curriculum_schedulers:
                self.curriculum_schedulers[m].load_state_dict(s)
        self.data_clusters, self.data_cluster_sizes = [], []
        if self.global_rank == 0:
            root = self.cl_config["data_cluster_path"]
            for name in self.data_cluster_paths:
                self.data_clusters.append(MMapIndexedDataset(os.path.join(root, name)))
                self.data_cluster_sizes.append(len(self.data_clusters[-1][0]))
