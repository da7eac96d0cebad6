"""utils/zero_to_fp32.py on ZeRO stage-3 checkpoints in DeepSpeed's layout: checkpoints written here by
hand from known weights at world sizes 1-4 (per-parameter shards of ceil(numel / world) elements, the
last rank's zero-padded; frozen parameters as per-rank fragments; a tied weight; buffers; two param
groups split into sub-groups) recovered exactly through all three public functions and the standalone
copy; and, where the real DeepSpeed is importable, a checkpoint DeepSpeed itself wrote on 2 gloo ranks
recovered as DeepSpeed's own zero_to_fp32 recovers it."""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from collections import OrderedDict

import pytest
import torch

from deepspeed_c.utils import zero_to_fp32 as z

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DS_REAL = os.environ.get("DSC_DEEPSPEED_REAL", "/tmp/ds_real")
DS_DEPS = os.environ.get("DSC_DEEPSPEED_DEPS", "/tmp/ds_deps")
TAG = "global_step5"


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.fc1 = torch.nn.Linear(6, 7)  # 42 and 7 elements: not divisible by 4 (nor 7 by 2 or 3)
        self.fc2 = torch.nn.Linear(7, 5)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.frozen = torch.nn.Linear(5, 3)
        self.frozen.requires_grad_(False)
        self.register_buffer("steps", torch.tensor([3, 1, 4], dtype=torch.long))
        self.register_buffer("running", torch.linspace(0, 1, 5))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


def known_model() -> Net:
    torch.manual_seed(11)
    m = Net()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p))
        m.running.copy_(torch.randn(5))
    return m


# optimizer groups (weights / biases) and their sub-groups, in DeepSpeed's order of named parameters
SUB_GROUPS = [["emb.weight", "fc1.weight"], ["fc2.weight"], ["fc1.bias", "fc2.bias"]]
FROZEN = ["frozen.weight", "frozen.bias"]
BUFFERS = ["steps", "running"]


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s piece of `t`: ceil(numel / world) elements, zero-padded on the last rank."""
    flat = t.detach().reshape(-1)
    s = math.ceil(flat.numel() / world)
    piece = flat[rank * s:(rank + 1) * s]
    return torch.cat([piece, piece.new_zeros(s - piece.numel())])


def write_checkpoint(root, model: Net, world: int, bf16_names: bool = False, frozen_dtype=torch.float32,
                     regroup=None) -> None:
    """A stage-3 checkpoint as DeepSpeed writes it. `regroup(rank_flat) -> list of tensors` re-cuts each
    rank's concatenated flat groups differently (sub-group tensors a shard may straddle)."""
    tag = os.path.join(root, TAG)
    os.makedirs(tag)
    with open(os.path.join(root, "latest"), "w") as f:
        f.write(TAG)
    named = dict(model.named_parameters())
    module = OrderedDict()
    for k, v in model.state_dict().items():  # params are empty placeholders under ZeRO-3
        module[k] = v.clone() if k in BUFFERS else torch.empty(0, dtype=v.dtype)
    param_shapes = [OrderedDict((n, named[n].shape) for n in group) for group in SUB_GROUPS]
    for r in range(world):
        states = {
            "module": module, "buffer_names": list(BUFFERS), "optimizer": None, "param_shapes": param_shapes,
            "frozen_param_shapes": OrderedDict((n, named[n].shape) for n in FROZEN),
            "frozen_param_fragments": OrderedDict((n, shard(named[n], r, world).to(frozen_dtype)) for n in FROZEN),
            "shared_params": {"head.weight": "emb.weight"} if r == 0 else {},  # only rank 0 records ties
            "lr_scheduler": None, "data_sampler": None, "random_ltd": None, "skipped_steps": 0, "global_steps": 5,
            "global_samples": 40, "dp_world_size": world, "mp_world_size": 1, "ds_config": {}, "ds_version": "0.19.8"}
        torch.save(states, os.path.join(tag, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"))
        flat_groups = [torch.cat([shard(named[n], r, world) for n in group]).float() for group in SUB_GROUPS]
        if regroup is not None:
            flat_groups = regroup(torch.cat(flat_groups))
        inner = {"state": {i: {"step": torch.tensor(5.0), "exp_avg": torch.zeros_like(t),
                               "exp_avg_sq": torch.zeros_like(t)} for i, t in enumerate(flat_groups)},
                 "param_groups": [{"lr": 0.1, "params": list(range(len(flat_groups)))}]}
        optim = {"optimizer_state_dict": {"zero_stage": 3, "loss_scaler": None, "dynamic_loss_scale": False,
                                          "overflow": False, "partition_count": world,
                                          "optimizer_state_dict": inner, "fp32_flat_groups": flat_groups},
                 "ds_config": {}, "ds_version": "0.19.8"}
        prefix = "bf16_" if bf16_names else ""
        torch.save(optim, os.path.join(tag, f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))


def expected_state(model: Net) -> "OrderedDict[str, torch.Tensor]":
    sd = model.state_dict()
    order = BUFFERS + FROZEN + [n for g in SUB_GROUPS for n in g] + ["head.weight"]  # DeepSpeed's order
    return OrderedDict((k, sd[k].float() if sd[k].is_floating_point() else sd[k]) for k in order)


def assert_exact(sd, want):
    assert list(sd) == list(want)
    for k, v in want.items():
        assert sd[k].dtype == v.dtype and sd[k].shape == v.shape and torch.equal(sd[k], v), k


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_exact_recovery(tmp_path, world):
    model = known_model()
    write_checkpoint(tmp_path, model, world, bf16_names=world == 2)
    sd = z.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    assert_exact(sd, expected_state(model))
    assert sd["head.weight"] is sd["emb.weight"]  # tied names share one tensor, as DeepSpeed's do
    assert z.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag=TAG, lazy_mode=True)["fc1.bias"] \
        .contiguous().equal(model.fc1.bias)

    loaded = z.load_state_dict_from_zero_checkpoint(Net(), str(tmp_path))
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert loaded.head.weight is loaded.emb.weight

    z.convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path), str(tmp_path / "out"))
    written = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    assert_exact(written, expected_state(model))


@pytest.mark.parametrize("world", [2, 3])
def test_exclude_frozen_parameters(tmp_path, world):
    model = known_model()
    write_checkpoint(tmp_path, model, world)
    sd = z.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), exclude_frozen_parameters=True)
    want = expected_state(model)
    for n in FROZEN:
        del want[n]
    assert_exact(sd, want)
    z.convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path), str(tmp_path / "out"), exclude_frozen_parameters=True)
    assert set(torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)) == set(want)


def test_frozen_fragments_in_model_dtype_come_back_fp32(tmp_path):
    model = known_model()
    with torch.no_grad():  # values bf16 holds exactly
        for n in FROZEN:
            p = dict(model.named_parameters())[n]
            p.copy_(p.to(torch.bfloat16).float())
    write_checkpoint(tmp_path, model, 3, frozen_dtype=torch.bfloat16)
    assert_exact(z.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path)), expected_state(model))


@pytest.mark.parametrize("world", [2, 4])
def test_shards_straddling_sub_group_tensors(tmp_path, world):
    """A rank's fp32_flat_groups are read as one concatenation: cut it into uneven tensors."""
    model = known_model()
    write_checkpoint(tmp_path, model, world, regroup=lambda flat: list(flat.split([5, 1, 17, flat.numel() - 23])))
    assert_exact(z.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path)), expected_state(model))


def test_missing_rank_and_mismatched_files_are_named(tmp_path):
    model = known_model()
    write_checkpoint(tmp_path / "a", model, 3)
    os.remove(tmp_path / "a" / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(ValueError, match=r"saved by 3 ranks.*ranks \[0, 2\]"):
        z.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "a"))

    write_checkpoint(tmp_path / "b", model, 2)
    write_checkpoint(tmp_path / "c", model, 3)
    shutil.copy(tmp_path / "c" / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                tmp_path / "b" / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(ValueError):
        z.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "b"))


def test_standalone_copy_converts_stage3(tmp_path):
    model = known_model()
    write_checkpoint(tmp_path / "ckpt", model, 3)
    copy = tmp_path / "ckpt" / "zero_to_fp32.py"
    shutil.copy(z.__file__, copy)
    out = tmp_path / "out"
    guard = ("import sys, runpy\n"
             "class Block:\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             "        if name.split('.')[0] in ('deepspeed_c', 'deepspeed'): raise ImportError(name)\n"
             "sys.meta_path.insert(0, Block())\n"
             f"sys.argv = ['zero_to_fp32.py', {str(tmp_path / 'ckpt')!r}, {str(out)!r}]\n"
             f"runpy.run_path({str(copy)!r}, run_name='__main__')\n")
    subprocess.run([sys.executable, "-I", "-c", guard], check=True, cwd=str(tmp_path), timeout=300)
    assert_exact(torch.load(out / "pytorch_model.bin", weights_only=True), expected_state(model))


# -- a checkpoint the real DeepSpeed wrote ---------------------------------------------------------------------
def _ds_env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([DS_REAL, DS_DEPS]), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")


def _deepspeed_importable() -> bool:
    if not os.path.isdir(os.path.join(DS_REAL, "deepspeed")):
        return False
    return subprocess.run([sys.executable, "-c", "import deepspeed.runtime.zero.stage3"], env=_ds_env(),
                          capture_output=True, timeout=300).returncode == 0


@pytest.mark.parametrize("world,bf16", [(2, False), (2, True)])
def test_matches_deepspeed_on_a_real_deepspeed_checkpoint(tmp_path, world, bf16):
    """Against checkpoints the real DeepSpeed 0.19.8 wrote (committed under tests/fixtures/deepspeed_written
    by scripts/make_deepspeed_zero3_checkpoint.py, with what its own zero_to_fp32 recovers); with
    DSC_DEEPSPEED_REAL set, a fresh one is written by the DeepSpeed installed there."""
    if os.environ.get("DSC_DEEPSPEED_REAL"):
        if not _deepspeed_importable():
            pytest.fail(f"DSC_DEEPSPEED_REAL={DS_REAL}: the real DeepSpeed is not importable there")
        cmd = [sys.executable, os.path.join(REPO, "scripts", "make_deepspeed_zero3_checkpoint.py"), str(tmp_path),
               "--world", str(world)] + (["--bf16"] if bf16 else [])
        res = subprocess.run(cmd, env=_ds_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
        assert res.returncode == 0, res.stderr[-4000:]
    else:
        src = os.path.join(REPO, "tests", "fixtures", "deepspeed_written", f"z3_{'bf16' if bf16 else 'fp32'}_w{world}")
        shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    theirs = torch.load(tmp_path / "deepspeed_fp32.pt", weights_only=True)
    gathered = torch.load(tmp_path / "gathered.pt", weights_only=True)
    ckpt = str(tmp_path / "ckpt")
    ours = z.get_fp32_state_dict_from_zero_checkpoint(ckpt)
    assert list(ours) == list(theirs)
    assert "frozen.weight" in ours and "head.weight" in ours and "steps" in ours
    for k, v in theirs.items():
        # DeepSpeed keeps frozen fragments in the model's dtype; deepspeed_c returns them in fp32
        assert torch.equal(ours[k], v.float() if v.is_floating_point() else v), k
        if not bf16:
            assert torch.equal(ours[k], gathered[k].to(ours[k].dtype)), k
    assert ours["head.weight"] is ours["emb.weight"]
    trainable = z.get_fp32_state_dict_from_zero_checkpoint(ckpt, exclude_frozen_parameters=True)
    assert list(trainable) == [k for k in theirs if not k.startswith("frozen.")]
