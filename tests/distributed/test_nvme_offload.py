"""ZeRO-Infinity optimizer offload (`offload_optimizer.device: nvme`) on 2 gloo ranks, against the same
run with `device: cpu` (ZeRO-Offload, itself tested against torch.optim.Adam in test_zero_offload):
- stage 2 (2 slots, gradient accumulation, clipping), stage 1 (one slot), stage 2 with a bf16 model,
  stage 2 fp16 with overflow-skipped steps, and stage 3, 12 steps each (fp16: 8 of them skipped, the scale
  grown again and overflowing once more in the 3 steps after the save): every step's weights equal bit for bit;
- the NVMe run's checkpoint is an ordinary one: its optimizer files hold the same tensors as the CPU
  run's, a `device: cpu` engine resumes from it and an NVMe engine resumes from the CPU run's, and both
  continue exactly as the uninterrupted CPU run;
- between steps the swap files hold the state (the masters in memory are empty);
- host memory (process RSS, one rank per process) with a model whose optimizer state is ~100 MB:
  the NVMe run holds at most its slots of that state;
- stage 3 with `offload_param.device: nvme` (and the optimizer state on NVMe too), 8 steps, two param
  groups, buffer_count 1, buffer_size above the largest module chunk, max_in_cpu holding the first group:
  bit for bit the run with both on the host, within 1e-5 of stage 3 without offload; the first group
  is never written to NVMe (the files' bytes are the second group's shard, and all of both with
  max_in_cpu 0), the swap files hold the shards' bytes, reads went through the one buffer, and the
  files' mappings hold no resident memory while the modules run or after a step (/proc/self/smaps,
  which does see them once touched); buffer_size below a chunk, buffer_count 0 and a negative
  max_in_cpu raise naming the key;
- a missing nvme_path is created (as DeepSpeed); bad values (a file, a folder under a file) fail at
  initialize naming the path and the bytes needed; two live NVMe engines
  on one path keep their own files (and remove them on destroy); a stage-2 checkpoint written by the
  real DeepSpeed 0.19.8 (tests/fixtures) resumes with NVMe offload and continues as DeepSpeed did;
- many small sub-groups under a low descriptor limit (RLIMIT_NOFILE, in the rank's process): a checkpoint
  save / load round trip, which reads and writes every sub-group's files at once, stays within it."""
from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from typing import Any

import numpy as np
import pytest
import torch

from tests.harness import run_distributed
from tests.shared_launch import run_worlds

MICRO = 2
STEPS = 12  # an exact comparison: each step swaps every sub-group the same way (was 20)
EXTRA = 3  # steps after a resume


class Wide(torch.nn.Module):
    """~26k parameters: several 4096-element sub-groups per rank."""

    def __init__(self, d_in: int = 64, hidden: int = 128, d_out: int = 8) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, hidden),
                                       torch.nn.Tanh(), torch.nn.Linear(hidden, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _config(stage: int, device: str, nvme_path: str, gas: int, clip: float, buffer_count: int,
            dtype: str = "fp32", param_device: str = "") -> dict[str, Any]:
    offload: dict[str, Any] = {"device": device}
    if device == "nvme":
        offload.update(nvme_path=nvme_path, buffer_count=4 * buffer_count)  # Adam: 4 tensor buffers a sub-group slot
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
           "steps_per_print": 10**9, "optimizer": {"type": "Adam", "params": {"lr": 2e-3, "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 5000, "sub_group_size": 4096,
                                 "offload_optimizer": offload},
           "aio": {"block_size": 65536, "queue_depth": 4, "intra_op_parallelism": 2}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":  # a first scale of 2**24 overflows: the first steps are skipped, the scale drops
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 24, "loss_scale_window": 4, "hysteresis": 1}
    if param_device:
        cfg["zero_optimization"]["offload_param"] = {"device": param_device, "nvme_path": nvme_path}
    return cfg


def _batches(n: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(MICRO * world, 64, generator=g), torch.randn(MICRO * world, 8, generator=g)) for _ in range(n)]


def _weights(engine: Any) -> np.ndarray:
    import deepspeed_c

    params = list(engine.module.parameters())
    with deepspeed_c.zero.GatheredParameters(params):  # stage 3: whole weights; else a no-op
        return torch.cat([p.detach().float().reshape(-1) for p in params]).numpy().copy()


def _train(engine: Any, rank: int, world: int, batches: list, gas: int, steps: int, first: int = 0) -> list:
    snaps = []
    dtype = next(engine.module.parameters()).dtype
    for step in range(first, first + steps):
        for k in range(gas):
            x, y = batches[step * gas + k]
            lo, hi = rank * MICRO, (rank + 1) * MICRO
            loss = torch.nn.functional.mse_loss(engine(x[lo:hi].to(dtype)).float(), y[lo:hi])
            engine.backward(loss)
            engine.step()
        snaps.append(_weights(engine))
    return snaps


def _engine(cfg: dict[str, Any], two_groups: bool = False) -> Any:
    import deepspeed_c

    torch.manual_seed(1234)
    model = Wide()
    groups = None
    if two_groups:  # the first layer, then the rest (max_in_cpu keeps whole groups on the host, in order)
        groups = [{"params": list(model.net[0].parameters())},
                  {"params": list(model.net[2].parameters()) + list(model.net[4].parameters())}]
    engine, _, _, _ = deepspeed_c.initialize(model=model, model_parameters=groups, config=cfg)
    return engine


def _mapped_rss(folder: str) -> int:
    """Resident bytes of this process's mappings of files under `folder` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if not head.endswith(":") or "-" in head:  # a mapping's header line: address range ... path
                inside = line.rstrip().endswith(".swp") and folder in line
            elif inside and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def _optim_tensors(ckpt_dir: str, rank: int) -> dict[str, np.ndarray]:
    """Every tensor of this rank's ZeRO optimizer file, flattened by key path."""
    tag_dir = os.path.join(ckpt_dir, "t")
    name = next(f for f in os.listdir(tag_dir) if f.startswith(f"bf16_zero_pp_rank_{rank}_") or
                f.startswith(f"zero_pp_rank_{rank}_") and "optim" in f)
    from deepspeed_c.checkpoint import safe_load  # the files hold DeepSpeed's pickled classes

    sd = safe_load.load(os.path.join(tag_dir, name))
    out: dict[str, np.ndarray] = {}

    def walk(obj: Any, path: str) -> None:
        if torch.is_tensor(obj):
            out[path] = obj.detach().float().numpy().copy()
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}/{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}/{i}")

    walk(sd, "")
    return out


def parity_body(rank: int, world: int, root: str) -> dict[str, Any]:
    torch.use_deterministic_algorithms(True)
    out: dict[str, Any] = {}
    for name, stage, gas, clip, slots, dtype in (("stage2", 2, 2, 0.05, 2, "fp32"), ("stage1", 1, 1, 0.0, 1, "fp32"),
                                                 ("stage2-bf16", 2, 1, 0.1, 3, "bf16"),
                                                 ("stage2-fp16", 2, 1, 0.1, 2, "fp16"),
                                                 ("stage3", 3, 2, 0.05, 2, "fp32")):
        nvme_path = os.path.join(root, name, "swap")
        if rank == 0:
            os.makedirs(nvme_path, exist_ok=True)
        torch.distributed.barrier()
        batches = _batches((STEPS + EXTRA) * gas, world)
        runs: dict[str, Any] = {}
        for device in ("cpu", "nvme"):
            engine = _engine(_config(stage, device, nvme_path, gas, clip, slots, dtype))
            snaps = _train(engine, rank, world, batches, gas, STEPS)
            runs[f"skipped_{device}"] = engine.skipped_steps
            if device == "nvme":  # between steps the state is in the files only
                opt = engine.optimizer
                folder = opt.offload.swapper.folder
                runs["emptied"] = all(m.numel() == 0 for m in opt.fp32_partitions)
                runs["files"] = len(os.listdir(folder))
                runs["file_bytes"] = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
                runs["state_bytes"] = sum(opt.partition_numels) * 4 * 3
            from deepspeed_c.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

            first = next(engine.module.parameters())  # the partitioned state by DeepSpeed's accessors
            runs[f"accessors_{device}"] = [safe_get_full_fp32_param(first).numpy().copy(),
                                           safe_get_full_optimizer_state(first, "exp_avg_sq").numpy().copy()]
            ckpt = os.path.join(root, name, f"ckpt_{device}")
            engine.save_checkpoint(ckpt, tag="t")
            snaps += _train(engine, rank, world, batches, gas, EXTRA, first=STEPS)
            runs[device] = snaps
            engine.destroy()
        # resume each checkpoint with the other device
        for device, src in (("cpu", "nvme"), ("nvme", "cpu")):
            engine = _engine(_config(stage, device, nvme_path, gas, clip, slots, dtype))
            engine.load_checkpoint(os.path.join(root, name, f"ckpt_{src}"), tag="t")
            runs[f"resume_{device}_from_{src}"] = [_weights(engine)] + _train(engine, rank, world, batches, gas,
                                                                              EXTRA, first=STEPS)
            engine.destroy()
        runs["optim_cpu"] = _optim_tensors(os.path.join(root, name, "ckpt_cpu"), rank)
        runs["optim_nvme"] = _optim_tensors(os.path.join(root, name, "ckpt_nvme"), rank)
        out[name] = runs
    out["params"] = _param_offload_runs(rank, world, os.path.join(root, "params"))
    return out


def _param_offload_runs(rank: int, world: int, root: str) -> dict[str, Any]:
    """Stage 3 with parameters (and optimizer state) on NVMe, with both on the host, and without offload; two
    param groups, the NVMe run keeping the first on the host (max_in_cpu) and swapping the second in
    through one buffer (buffer_count 1, buffer_size above its largest module's chunk)."""
    nvme_path = os.path.join(root, "swap")
    if rank == 0:
        os.makedirs(nvme_path, exist_ok=True)
    torch.distributed.barrier()
    gas, clip = 2, 0.05
    steps = 8
    batches = _batches(steps * gas, world)
    knobs = {"buffer_count": 1, "buffer_size": 9000, "max_in_cpu": 6000}  # rank shards: 4160, then 8772 elements
    runs: dict[str, Any] = {"knobs": knobs, "errors": {}}
    for key, value in (("buffer_size", 4000), ("buffer_count", 0), ("max_in_cpu", -1)):
        cfg = _config(3, "nvme", nvme_path, gas, clip, 2, param_device="nvme")
        cfg["zero_optimization"]["offload_param"].update(knobs, **{key: value})
        try:
            _engine(cfg, two_groups=True).destroy()
            runs["errors"][key] = "no error"
        except Exception as e:  # noqa: BLE001  (the message is what is checked)
            runs["errors"][key] = f"{type(e).__name__}: {e}"
    cfg = _config(3, "nvme", nvme_path, gas, clip, 2, param_device="nvme")
    cfg["zero_optimization"]["offload_param"].update(knobs, max_in_cpu=0)  # everything to NVMe
    engine = _engine(cfg, two_groups=True)
    store = engine.optimizer.store
    runs["all_nvme"] = [sum(os.path.getsize(os.path.join(store.folder, f)) for f in os.listdir(store.folder)),
                        sum(s.numel() * s.element_size() for s in store.shards)]
    engine.destroy()
    for name, opt_dev, param_dev in (("nvme", "nvme", "nvme"), ("cpu", "cpu", "cpu"), ("none", "none", "")):
        cfg = _config(3, opt_dev, nvme_path, gas, clip, 2, param_device=param_dev)
        if opt_dev == "none":
            del cfg["zero_optimization"]["offload_optimizer"]
        if name == "nvme":
            cfg["zero_optimization"]["offload_param"].update(knobs)
        engine = _engine(cfg, two_groups=True)
        rss: list[int] = []
        runs[name] = _train(engine, rank, world, batches, gas, steps - 2)
        if name == "nvme":  # host memory the swap files' mappings hold while the NVMe group's modules run
            store = engine.optimizer.store
            for m in (engine.module.net[2], engine.module.net[4]):  # (the last two steps: smaps is slow to read)
                m.register_forward_hook(lambda *_: rss.append(_mapped_rss(store.folder)))
        runs[name] += _train(engine, rank, world, batches, gas, 2, first=steps - 2)
        if name == "nvme":
            runs["rss_after_step"] = _mapped_rss(store.folder)  # before anything below reads the mapping
            files = sorted(os.listdir(store.folder))
            runs["files"] = {f: os.path.getsize(os.path.join(store.folder, f)) for f in files}
            runs["shard_bytes"] = [s.numel() * s.element_size() for s in store.shards]
            runs["on_nvme"] = list(store.on_nvme)
            runs["in_cpu_numel"] = store.in_cpu_numel
            runs["in_files"] = all(np.array_equal(np.fromfile(store.swap_path(g), dtype=np.float32), s.numpy())
                                   for g, s in enumerate(store.shards) if store.on_nvme[g] and s.numel())
            runs["readahead"] = store.readahead_bytes
            runs["bytes_read"] = store.bytes_read
            runs["pool"] = [store.buffers.count, store.buffers.peak_in_use, store.buffers.nbytes]
            runs["largest_chunk"] = max(e - s for u, (g, _) in enumerate(store.unit_of) if store.on_nvme[g]
                                        for s, e in [store.chunk_range(u)])
            runs["rss_forward"] = [max(rss), len(rss)]
            g = store.on_nvme.index(True)
            float(store.shards[g].sum())  # the mapping read whole: the measurement sees its pages
            runs["rss_touched"] = _mapped_rss(store.folder)
        engine.destroy()
    return runs


@functools.lru_cache(maxsize=None)
def _runs() -> tuple[list[dict[str, Any]], dict[str, Any], str]:
    """The parity run on 2 ranks, then the bad-path run on 1, in one launch (tests/shared_launch.py): the
    parity results per rank, the bad-path results, and the bad-path run's root (kept for its assertions)."""
    root = tempfile.mkdtemp(prefix="dsc_nvme_parity_")
    atexit.register(shutil.rmtree, root, True)
    bad_root = os.path.join(root, "bad")
    os.makedirs(bad_root)
    parity, bad = run_worlds([(2, parity_body, (os.path.join(root, "parity"),)), (1, bad_path_body, (bad_root,))],
                             timeout=600)
    return parity, bad[0], bad_root


def _parity() -> list[dict[str, Any]]:
    return _runs()[0]


CASES = ["stage2", "stage1", "stage2-bf16", "stage2-fp16", "stage3"]


@pytest.mark.parametrize("name", CASES)
def test_nvme_matches_cpu_offload_bit_for_bit(name: str) -> None:
    for rank, res in enumerate(_parity()):
        runs = res[name]
        assert len(runs["nvme"]) == STEPS + EXTRA
        for step, (got, want) in enumerate(zip(runs["nvme"], runs["cpu"])):
            assert np.array_equal(got, want), f"rank {rank} step {step}: nvme differs from cpu offload"
        assert not np.array_equal(runs["cpu"][0], runs["cpu"][-1])  # it trained
        assert runs["skipped_nvme"] == runs["skipped_cpu"] and (runs["skipped_cpu"] > 0) == (name == "stage2-fp16")
        assert runs["emptied"] and runs["files"] > 3
        for got, want in zip(runs["accessors_nvme"], runs["accessors_cpu"]):
            assert got.size > 0 and np.array_equal(got, want)
        assert runs["file_bytes"] == runs["state_bytes"]


@pytest.mark.parametrize("name", CASES)
def test_nvme_checkpoints_are_ordinary_checkpoints(name: str) -> None:
    for res in _parity():
        runs = res[name]
        assert runs["optim_cpu"].keys() == runs["optim_nvme"].keys()
        for key, want in runs["optim_cpu"].items():
            assert np.array_equal(runs["optim_nvme"][key], want), key
        straight = runs["cpu"][STEPS - 1:]  # the weights at the save, then EXTRA more steps
        for resumed in ("resume_cpu_from_nvme", "resume_nvme_from_cpu"):
            assert len(runs[resumed]) == len(straight)
            for got, want in zip(runs[resumed], straight):
                assert np.array_equal(got, want), resumed


# -- host memory ------------------------------------------------------------------------------------
BIG = 1024  # Linear(1024, 1024) x 4: ~4.2M parameters, ~50 MB of fp32 master + Adam moments


def memory_body(rank: int, world: int, root: str) -> dict[str, float]:
    """Rank 0 runs `device: cpu`, rank 1 `device: nvme`, each as a world of its own (own store)."""
    import psutil
    import torch.distributed as dist

    import deepspeed_c

    device = ("cpu", "nvme")[rank]
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.FileStore(os.path.join(root, f"store{rank}"), 1))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(BIG, BIG) for _ in range(4)])
    cfg = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2, "sub_group_size": 1 << 18,
                                 "offload_optimizer": {"device": device, "nvme_path": root, "buffer_count": 2}}}
    engine, _, _, _ = deepspeed_c.initialize(model=model, config=cfg)
    x = torch.randn(1, BIG)
    for _ in range(3):
        engine.backward(engine(x).square().mean())
        engine.step()
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)  # both runs: count live memory, not the allocator's free lists
    rss = psutil.Process().memory_info().rss
    n = sum(engine.optimizer.partition_numels)
    slots = engine.optimizer.offload.swapper.slot_bytes_total() if device == "nvme" else 0
    engine.destroy()
    dist.destroy_process_group()
    return {"rss": float(rss), "state_bytes": float(n * 4 * 3), "lp_bytes": float(n * 4), "slot_bytes": float(slots)}


def test_nvme_host_memory_holds_only_the_slots(tmp_path) -> None:
    cpu, nvme = run_distributed(memory_body, 2, args=(str(tmp_path),), timeout=300, backend="none",
                                start_method="spawn")
    # NVMe holds its slots plus a model-dtype output buffer (the CPU run steps the fp32 master in place
    # and gathers from it); everything else (model, gradients) is the same in both runs
    allowed = nvme["slot_bytes"] + nvme["lp_bytes"]
    saved = cpu["rss"] - nvme["rss"]
    print(f"RSS cpu {cpu['rss'] / 2**20:.1f} MiB, nvme {nvme['rss'] / 2**20:.1f} MiB; optimizer state "
          f"{cpu['state_bytes'] / 2**20:.1f} MiB, slots {nvme['slot_bytes'] / 2**20:.1f} MiB")
    # a run that kept the whole state resident would save nothing (less than nothing: it also holds
    # the slots and the output buffer); half the expected saving leaves room for allocator noise
    assert saved >= 0.5 * (cpu["state_bytes"] - allowed) > 0, (cpu, nvme)


# -- bad nvme_path ----------------------------------------------------------------------------------
def bad_path_body(rank: int, world: int, root: str) -> dict[str, str]:
    import deepspeed_c

    afile = os.path.join(root, "a_file")
    open(afile, "w").close()
    out = {}
    for name, path in (("missing", os.path.join(root, "missing", "swap")), ("file", afile),
                       ("under_file", os.path.join(afile, "swap")), ("none", None)):
        cfg = _config(2, "nvme", path, 1, 0.0, 2)
        try:
            _engine(cfg)
            out[name] = "no error"
        except Exception as e:  # noqa: BLE001  (the message is what is checked)
            out[name] = f"{type(e).__name__}: {e}"
    out["missing_created"] = os.path.isdir(os.path.join(root, "missing", "swap"))
    # two live engines on one nvme_path (an actor and a critic): separate files, the same training
    shared = os.path.join(root, "shared")
    os.makedirs(shared)
    a, b = (_engine(_config(2, "nvme", shared, 1, 0.0, 2)) for _ in range(2))
    batches = _batches(4, world)
    for step in range(4):  # interleaved steps: each engine's state must stay its own
        _train(a, rank, world, batches, 1, 1, first=step)
        _train(b, rank, world, batches, 1, 1, first=step)
    folders = {a.optimizer.offload.swapper.folder, b.optimizer.offload.swapper.folder}
    out["two_engines"] = [len(folders), bool(np.array_equal(_weights(a), _weights(b)))]
    out["cpu_weights_after"] = _train(_engine(_config(2, "cpu", shared, 1, 0.0, 2)), rank, world, batches, 1, 4)[-1]
    out["nvme_weights_after"] = _weights(a)
    a.destroy()
    b.destroy()
    out["left"] = sorted(os.listdir(os.path.join(shared, "zero_stage_2", "optimizer")))
    out["deepspeed_written"] = _resume_deepspeed_fixture(rank, world, shared)
    # one rank, stage 3, parameters on NVMe read through 2 swap-in buffers (each gathered unit is a copy,
    # never a view of the file) against parameters on the host: the same weights after 3 steps
    out["few_fds"] = _few_descriptors(shared)
    out["one_rank_params"] = []
    for dev in ("nvme", "cpu"):
        cfg = _config(3, "cpu", shared, 1, 0.0, 2, param_device=dev)
        cfg["zero_optimization"]["offload_param"].update(buffer_count=2, max_in_cpu=0)
        engine = _engine(cfg)
        out["one_rank_params"].append(_train(engine, rank, world, batches, 1, 3))
        if dev == "nvme":
            out["one_rank_read"] = engine.optimizer.store.bytes_read
        engine.destroy()
    return out


def _few_descriptors(nvme_path: str) -> dict[str, Any]:
    """Stage 3 with the optimizer state and the parameters on NVMe, 1024-element sub-groups (sub_group_size
    1 rounds up to that: ~18 of them, 3 files each), under a descriptor limit 24 above what this process
    holds: checkpoint save and load read or write every sub-group's files at once, which ran out of
    descriptors. The weights of the step after the save, and of the same step after loading it back."""
    import resource

    import deepspeed_c

    cfg = _config(3, "nvme", nvme_path, 1, 0.0, 2, param_device="nvme")
    cfg["zero_optimization"]["sub_group_size"] = 1
    x = torch.randn(MICRO, 128, generator=torch.Generator().manual_seed(3))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 24, hard))
    out: dict[str, Any] = {}
    try:
        torch.manual_seed(5)
        model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 8))
        engine, *_ = deepspeed_c.initialize(model=model, config=cfg)
        out["sub_groups"] = sum(len(b) for b in engine.optimizer.offload.swapper.bounds)

        def step() -> np.ndarray:
            engine.backward(engine(x).square().mean())
            engine.step()
            return _weights(engine)

        step()
        saved = _weights(engine)
        engine.save_checkpoint(os.path.join(nvme_path, "few_fds"), tag="t")
        after = step()
        engine.load_checkpoint(os.path.join(nvme_path, "few_fds"), tag="t")
        out["loaded_equal"] = bool(np.array_equal(_weights(engine), saved))
        out["resumed_equal"] = bool(np.array_equal(step(), after)) and not np.array_equal(after, saved)
        engine.destroy()
    except Exception as e:  # noqa: BLE001  (the message is what is checked)
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return out


def _resume_deepspeed_fixture(rank: int, world: int, nvme_path: str) -> list[float]:
    """A stage-2 checkpoint written by the real DeepSpeed 0.19.8 (tests/fixtures) resumed with the
    optimizer state on NVMe: the next losses, to compare with DeepSpeed's own continuation."""
    import sys

    import deepspeed_c

    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "deepspeed_written")
    sys.path.insert(0, here)
    import common

    cfg = common.config(2, False, world)
    cfg["optimizer"]["params"].pop("torch_adam")  # NVMe offload steps with the C CPU Adam (AdamW mode)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path}
    model = common.build_model(False)
    engine, *_ = deepspeed_c.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
    path, _ = engine.load_checkpoint(os.path.join(here, common.case_name(2, False, False, 1)), tag=common.TAG)
    assert path is not None
    losses = []
    for i in range(common.STEPS_AFTER_RESUME):
        x, y = common.batch(common.STEPS_BEFORE_SAVE + i, rank, world)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    engine.destroy()
    return losses


def test_bad_nvme_path_two_engines_and_a_deepspeed_checkpoint() -> None:
    """One single-rank run: bad nvme_path values fail at initialize naming the path and the bytes;
    two live engines on one path keep their own files; a DeepSpeed-written checkpoint resumes; stage 3
    with parameters on NVMe trains as with them on the host."""
    _, res, tmp_path = _runs()
    n = sum(p.numel() for p in Wide().parameters())
    # a missing folder is created, as DeepSpeed does; one that cannot be (a parent is a file) is refused
    assert res["missing"] == "no error" and res["missing_created"]
    for name in ("file", "under_file"):
        msg = res[name]
        assert str(tmp_path) in msg and "bytes" in msg, msg
        # this rank's master + 2 moments, fp32, padded partition: at least the model's size x 12
        need = int(msg.split(" need ")[1].split(" bytes")[0])
        assert n * 12 <= need < (n + 4096) * 12, msg
    assert "NotADirectoryError" in res["file"] and "cannot be created" in res["under_file"]
    assert "nvme_path" in res["none"]
    n_folders, same = res["two_engines"]
    assert n_folders == 2 and same
    assert np.array_equal(res["nvme_weights_after"], res["cpu_weights_after"])
    assert res["left"] == []  # each engine's swap folder goes with it
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "deepspeed_written")
    expected = torch.load(os.path.join(here, "z2_fp32_train_w1", "expected.pt"), weights_only=True)["next_losses"]
    assert len(res["deepspeed_written"]) == len(expected)
    for ours, theirs in zip(res["deepspeed_written"], expected):
        assert abs(ours - theirs) <= 1e-5 * abs(theirs), (res["deepspeed_written"], expected)
    nvme, cpu = res["one_rank_params"]
    assert res["one_rank_read"] > 0 and not np.array_equal(cpu[0], cpu[-1])
    for got, want in zip(nvme, cpu):
        assert np.array_equal(got, want)


def test_many_sub_groups_under_a_low_descriptor_limit() -> None:
    res = _runs()[1]["few_fds"]
    assert "error" not in res, res
    assert res["sub_groups"] >= 17 and res["loaded_equal"] and res["resumed_equal"], res


def test_nvme_parameters_match_stage3() -> None:
    for res in _parity():
        runs = res["params"]
        knobs = runs["knobs"]
        assert runs["in_files"] and runs["readahead"] > 0
        for got, cpu, none in zip(runs["nvme"], runs["cpu"], runs["none"]):
            assert np.array_equal(got, cpu)  # the same host path with the shards in files
            assert np.linalg.norm(got - none) / np.linalg.norm(none) < 1e-5  # stage 3 without offload
        assert not np.array_equal(runs["none"][0], runs["none"][-1])
        # max_in_cpu: the first group stays on the host (within max_in_cpu), the second alone is written
        assert runs["on_nvme"][:2] == [False, True]
        assert 0 < runs["in_cpu_numel"] <= knobs["max_in_cpu"]
        assert list(runs["files"].values()) == [runs["shard_bytes"][1]]
        assert sum(runs["files"].values()) == sum(runs["shard_bytes"]) - runs["in_cpu_numel"] * 4
        assert runs["all_nvme"][0] == runs["all_nvme"][1] > sum(runs["files"].values())  # max_in_cpu 0: all
        # swapped-in partitions live only in the buffers: buffer_count x (at most) buffer_size
        count, peak, nbytes = runs["pool"]
        assert count == knobs["buffer_count"] and 1 <= peak <= count
        assert 0 < nbytes <= knobs["buffer_count"] * knobs["buffer_size"] * 4
        assert runs["bytes_read"] > 0
        assert runs["rss_forward"][1] > 0 and runs["rss_forward"][0] == 0  # the mapping holds nothing in use
        assert runs["rss_after_step"] == 0
        assert runs["rss_touched"] >= runs["shard_bytes"][1]  # ...which the measurement would see
        errors = runs["errors"]
        assert "zero_optimization.offload_param.buffer_size" in errors["buffer_size"], errors["buffer_size"]
        assert f"at least {runs['largest_chunk']}" in errors["buffer_size"], errors["buffer_size"]
        assert "zero_optimization.offload_param.buffer_count" in errors["buffer_count"], errors["buffer_count"]
        assert "max_in_cpu" in errors["max_in_cpu"], errors["max_in_cpu"]
