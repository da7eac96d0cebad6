"""ZeRO stage-3 checkpoints in DeepSpeed's stage-3 layout (per-rank model-states files, per-parameter
ceil(n/W) shards in fp32_flat_groups sub-groups, frozen_param_fragments), on real gloo ranks: exact resume,
resharding 2 -> 4 -> 2, stage 3 -> stage 2 -> stage 3, zero_to_fp32 against the live weights, and a
checkpoint the real DeepSpeed wrote loading into deepspeed_c's stage-3 engine."""
from __future__ import annotations

import glob
import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

from deepspeed_c.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from tests.harness import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DS_REAL = os.environ.get("DSC_DEEPSPEED_REAL", "/tmp/ds_real")
DS_DEPS = os.environ.get("DSC_DEEPSPEED_DEPS", "/tmp/ds_deps")
STEPS = 6


def _model():
    from tests.distributed.zero3_models import make_tied

    m = make_tied(7)
    m.head = torch.nn.Linear(12, 23, bias=False)  # a second name for the embedding (the forward's tied head)
    m.head.weight = m.emb.weight
    m.blocks[1].ln.requires_grad_(False)  # frozen: stored outside the optimizer's groups
    with torch.no_grad():
        m.blocks[1].ln.weight.mul_(1.5)  # not the init value, so a wrong load shows
        m.blocks[1].ln.bias.add_(0.25)
    return m


def _engine(stage: int, world: int, sub_group_size: int = 40):
    import deepspeed_c

    # 8 samples a step at any world size: micro-batches of 2, accumulated 4 / world times
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4 // world, "gradient_clipping": 0.5,
           "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                 "sub_group_size": sub_group_size, "reduce_bucket_size": 200}}
    engine, *_ = deepspeed_c.initialize(model=_model(), config=cfg)
    return engine


def _train(engine, rank: int, world: int, first: int, last: int) -> list[float]:
    from tests.distributed.zero3_models import tied_batches, tied_loss

    batches = tied_batches(STEPS, 8, 3)
    losses = []
    for s in range(first, last):
        engine.module.step_no = s
        for k in range(4 // world):
            i = 2 * (k * world + rank)
            ids = batches[s][i:i + 2]
            loss = tied_loss(engine(ids), ids)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    return losses


def _weights(engine) -> dict:
    """Every parameter's full value (gathered) and every buffer, by state_dict name."""
    import deepspeed_c

    params = list(engine.module.parameters())
    with deepspeed_c.zero.GatheredParameters(params):
        return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}


def body(rank: int, world: int, stage: int, src: str | None, dst: str | None, first: int, last: int,
         load_kwargs: dict | None = None) -> dict:
    engine = _engine(stage, world)
    if src is not None:
        engine.load_checkpoint(src, **(load_kwargs or {}))
    loaded = _weights(engine) if stage == 3 else {k: v.detach().float().clone()
                                                  for k, v in engine.module.state_dict().items()}
    steps_after_load = engine.global_steps
    losses = _train(engine, rank, world, first, last)
    if dst is not None:
        engine.save_checkpoint(dst)
    live = _weights(engine) if stage == 3 else {k: v.detach().float().clone()
                                                for k, v in engine.module.state_dict().items()}
    return {"losses": losses, "loaded": _np(loaded), "live": _np(live), "steps": steps_after_load}


def _np(d: dict) -> dict:
    """Tensors cross the process boundary as numpy arrays (torch's shared-memory handles die with the rank)."""
    return {k: v.numpy() for k, v in d.items()}


def _t(d: dict) -> dict:
    return {k: torch.from_numpy(v) if not isinstance(v, torch.Tensor) else v for k, v in d.items()}


# -- consolidating the Adam moments of a checkpoint by parameter name (both layouts) ---------------------------
def _files(tag_dir: str, pattern: str) -> list[str]:
    return sorted(glob.glob(os.path.join(tag_dir, pattern)), key=lambda f: int(re.search(r"rank_(\d+)_", f).group(1)))


def moments(ckpt: str) -> dict[str, dict[str, torch.Tensor]]:
    from deepspeed_c.checkpoint import safe_load

    tag_dir = os.path.join(ckpt, open(os.path.join(ckpt, "latest")).read().strip())
    parts = [safe_load.load(f)["optimizer_state_dict"] for f in _files(tag_dir, "*zero_pp_rank_*_optim_states.pt")]
    out: dict[str, dict[str, torch.Tensor]] = {"exp_avg": {}, "exp_avg_sq": {}}
    model3 = _files(tag_dir, "zero_pp_rank_*_mp_rank_00_model_states.pt")
    if model3:  # stage 3: per-parameter shards, sub-group after sub-group
        shapes = safe_load.load(model3[0])["param_shapes"]
        world = len(parts)
        for key in out:
            flats = [torch.cat([p["optimizer_state_dict"]["state"][i][key] for i in range(len(shapes))])
                     for p in parts]
            off = 0
            for sub in shapes:
                for name, shape in sub.items():
                    n = math.prod(shape)
                    s = -(-n // world)
                    out[key][name] = torch.cat([f[off:off + s] for f in flats])[:n]
                    off += s
        return out
    shapes = safe_load.load(os.path.join(tag_dir, "mp_rank_00_model_states.pt"))["param_shapes"]
    for key in out:
        for g, group in enumerate(shapes):
            flat = torch.cat([p["base_optimizer_state"]["state"][g][key] for p in parts])
            off = 0
            for name, shape in group.items():
                n = math.prod(shape)
                out[key][name] = flat[off:off + n]
                off += n
    return out


def _same(a: dict, b: dict, what: Any) -> None:
    a, b = _t(a), _t(b)
    assert set(a) == set(b), (what, sorted(set(a) ^ set(b)))
    for k in a:
        assert torch.equal(a[k], b[k]), (what, k)


def _close(a: dict, b: dict) -> None:
    a, b = _t(a), _t(b)
    assert set(a) == set(b)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5, rtol=1e-4), k


# -- runs several tests start from (each a launch of its own; no test writes into their checkpoints) ----------
@pytest.fixture(scope="module")
def saved_w2(tmp_path_factory) -> tuple[str, list]:
    """Stage 3 on 2 ranks, 3 steps from the start, saved: the checkpoint's path and the run's results."""
    ckpt = str(tmp_path_factory.mktemp("z3_w2") / "ckpt")
    return ckpt, run_distributed(body, 2, args=(3, None, ckpt, 0, 3), timeout=300)


@pytest.fixture(scope="module")
def resumed_w2(saved_w2) -> list:
    """Stage 3 on 2 ranks loading saved_w2 and training on to STEPS."""
    return run_distributed(body, 2, args=(3, saved_w2[0], None, 3, STEPS), timeout=300)


@pytest.fixture(scope="module")
def stage2_copy(saved_w2, tmp_path_factory) -> tuple[str, list]:
    """saved_w2 loaded at stage 2 on 2 ranks and saved again (no training): the same state in a stage-2
    checkpoint. Its path and the run's results."""
    out = str(tmp_path_factory.mktemp("z2_w2") / "ckpt")
    return out, run_distributed(body, 2, args=(2, saved_w2[0], out, 3, 3), timeout=300)


# -- tests ---------------------------------------------------------------------------------------------------
def test_exact_resume_and_layout(saved_w2, resumed_w2):
    ckpt, first = saved_w2
    whole = run_distributed(body, 2, args=(3, None, None, 0, STEPS), timeout=300)
    resumed = resumed_w2
    assert resumed[0]["steps"] == 3
    assert first[0]["losses"] + resumed[0]["losses"] == whole[0]["losses"]
    for r in range(2):
        _same(resumed[r]["loaded"], first[r]["live"], "loaded")
        _same(resumed[r]["live"], whole[r]["live"], "resumed")
    # DeepSpeed's stage-3 layout on disk
    tag_dir = os.path.join(ckpt, "global_step3")
    names = sorted(os.listdir(tag_dir))
    for r in range(2):
        assert f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" in names
        assert f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" in names
    assert "mp_rank_00_model_states.pt" not in names
    assert os.path.isfile(os.path.join(ckpt, "zero_to_fp32.py"))
    from deepspeed_c.checkpoint import safe_load

    m0 = safe_load.load(os.path.join(tag_dir, "zero_pp_rank_0_mp_rank_00_model_states.pt"))
    m1 = safe_load.load(os.path.join(tag_dir, "zero_pp_rank_1_mp_rank_00_model_states.pt"))
    assert all(v.numel() == 0 for k, v in m0["module"].items() if k in dict(first[0]["live"]) and
               k not in m0["buffer_names"])
    assert list(m0["frozen_param_shapes"]) == ["blocks.1.ln.weight", "blocks.1.ln.bias"]
    assert [t.numel() for t in m1["frozen_param_fragments"].values()] == [6, 6]
    assert m0["shared_params"] == {"head.weight": "emb.weight"} and m1["shared_params"] == {}
    assert len(m0["param_shapes"]) > 2  # sub_group_size 40 splits the groups
    o0 = safe_load.load(os.path.join(tag_dir, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))["optimizer_state_dict"]
    assert int(o0["zero_stage"]) == 3 and o0["partition_count"] == 2
    assert len(o0["fp32_flat_groups"]) == len(m0["param_shapes"])
    for i, sub in enumerate(m0["param_shapes"]):
        want = sum(-(-math.prod(s) // 2) for s in sub.values())
        assert o0["fp32_flat_groups"][i].numel() == want
        assert o0["optimizer_state_dict"]["state"][i]["exp_avg"].numel() == want
    # zero_to_fp32 (ours) recovers exactly the live weights
    sd = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    live = _t(first[0]["live"])
    assert set(sd) == set(live)
    for k in live:
        assert torch.equal(sd[k].float(), live[k]), k


@pytest.mark.parametrize("n,m", [(2, 4), (4, 2)])
def test_reshard(tmp_path, request, n, m):
    b = str(tmp_path / "b")
    if n == 2:
        a, saved = request.getfixturevalue("saved_w2")
    else:
        a = str(tmp_path / "a")
        saved = run_distributed(body, n, args=(3, None, a, 0, 3), timeout=300)
    got = run_distributed(body, m, args=(3, a, b, 3, 3), timeout=300)  # load, save again, no training
    for r in range(m):
        assert got[r]["steps"] == 3
        _same(got[r]["loaded"], saved[0]["live"], f"loaded on rank {r}")
    _same(get_fp32_state_dict_from_zero_checkpoint(a), get_fp32_state_dict_from_zero_checkpoint(b), "fp32")
    ma, mb = moments(a), moments(b)
    assert ma["exp_avg_sq"]["emb.weight"].abs().sum() > 0
    for key in ma:
        _same(ma[key], mb[key], key)
    if n > m:
        return
    # and training goes on from the resharded state as from the original (same global batches)
    on_n = request.getfixturevalue("resumed_w2")  # n == 2 here
    on_m = run_distributed(body, m, args=(3, b, None, 3, STEPS), timeout=300)
    _close(on_n[0]["live"], on_m[0]["live"])


def test_stage3_to_stage2_and_back(tmp_path, saved_w2, resumed_w2, stage2_copy):
    (a, saved), (b, on2), c = saved_w2, stage2_copy, str(tmp_path / "c")
    for r in range(2):
        assert on2[r]["steps"] == 3
        _same(on2[r]["loaded"], saved[0]["live"], "stage 2 loaded")
    back = run_distributed(body, 4, args=(3, b, c, 3, 3), timeout=300)
    for r in range(4):
        _same(back[r]["loaded"], saved[0]["live"], "stage 3 loaded from stage 2")
    ref = get_fp32_state_dict_from_zero_checkpoint(a)
    for other in (b, c):
        _same(ref, get_fp32_state_dict_from_zero_checkpoint(other), other)
    ma = moments(a)
    for other in (b, c):
        mo = moments(other)
        for key in ma:
            _same(ma[key], mo[key], (other, key))
    # training on from each gives the same weights
    w3 = resumed_w2[0]["live"]
    w2 = run_distributed(body, 2, args=(2, a, None, 3, STEPS), timeout=300)[0]["live"]
    _close(w3, w2)


def test_module_only_and_no_optimizer_states(saved_w2, stage2_copy):
    (a, saved), b = saved_w2, stage2_copy[0]  # b: the same weights in a stage-2 checkpoint
    only = {"load_module_only": True}
    for src, kwargs, stage, world in ((a, only, 3, 4), (a, only, 2, 2), (b, only, 3, 2),
                                      (a, {"load_optimizer_states": False}, 3, 2)):
        got = run_distributed(body, world, args=(stage, src, None, 3, 4, kwargs), timeout=300)
        _same(got[0]["loaded"], saved[0]["live"], (src, kwargs, stage, world))
        assert got[0]["steps"] == (0 if kwargs.get("load_module_only") else 3)
        assert all(np.isfinite(x) for x in got[0]["losses"])


# -- a checkpoint the real DeepSpeed wrote --------------------------------------------------------------------
def _deepspeed_importable() -> bool:
    if not os.path.isdir(DS_REAL):
        return False
    env = dict(os.environ, PYTHONPATH=f"{DS_REAL}:{DS_DEPS}", DS_ACCELERATOR="cpu")
    probe = subprocess.run([sys.executable, "-c", "import deepspeed"], env=env, capture_output=True, timeout=300)
    return probe.returncode == 0


@pytest.fixture(scope="module")
def deepspeed_zero3(tmp_path_factory):
    """A stage-3 checkpoint the real DeepSpeed 0.19.8 wrote: the committed fixture
    (tests/fixtures/deepspeed_written/z3_fp32_w2, from scripts/make_deepspeed_zero3_checkpoint.py), or,
    with DSC_DEEPSPEED_REAL set, a fresh one from the DeepSpeed installed there."""
    out = str(tmp_path_factory.mktemp("ds_zero3"))
    if not os.environ.get("DSC_DEEPSPEED_REAL"):
        shutil.copytree(os.path.join(ROOT, "tests", "fixtures", "deepspeed_written", "z3_fp32_w2"), out,
                        dirs_exist_ok=True)
        return out
    if not _deepspeed_importable():
        pytest.fail(f"DSC_DEEPSPEED_REAL={DS_REAL}: the real DeepSpeed is not importable there")
    env = dict(os.environ, PYTHONPATH=f"{DS_REAL}:{DS_DEPS}", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_deepspeed_zero3_checkpoint.py"), out,
                    "--world", "2"], env=env, check=True, capture_output=True, timeout=600)
    return out


def ds_body(rank: int, world: int, out: str) -> dict:
    import deepspeed_c

    spec = importlib.util.spec_from_file_location("make_ds_z3", os.path.join(ROOT, "scripts",
                                                                             "make_deepspeed_zero3_checkpoint.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(123)  # other initial weights than DeepSpeed's run: the load must replace them all
    model = mod.Net()
    decay = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and not n.endswith("weight")]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=0.05)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed_c.initialize(model=model, optimizer=optimizer, config=config)
    engine.load_checkpoint(os.path.join(out, "ckpt"))
    params = list(engine.module.parameters())
    with deepspeed_c.zero.GatheredParameters(params):
        weights = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    g = torch.Generator().manual_seed(100 + rank)
    loss = engine(torch.randint(0, 11, (2, 3), generator=g))  # trains on from the loaded state
    engine.backward(loss)
    engine.step()
    return {"weights": _np(weights), "steps": engine.global_steps, "loss": float(loss)}


@pytest.mark.parametrize("world", [2, 3])
def test_loads_deepspeed_written_stage3(deepspeed_zero3, world):
    got = run_distributed(ds_body, world, args=(deepspeed_zero3,), timeout=300)
    gathered = torch.load(os.path.join(deepspeed_zero3, "gathered.pt"))
    ds_fp32 = torch.load(os.path.join(deepspeed_zero3, "deepspeed_fp32.pt"))
    for r in range(world):
        assert got[r]["steps"] == 3
        w = _t(got[r]["weights"])
        assert set(w) == set(gathered)
        for k in gathered:
            assert torch.equal(w[k], gathered[k].float()), k
        for k in ds_fp32:
            assert torch.equal(w[k], ds_fp32[k].float()), k
    assert all(math.isfinite(got[r]["loss"]) for r in range(world))


def test_deepspeed_zero_to_fp32_reads_ours(tmp_path):
    if not os.environ.get("DSC_DEEPSPEED_REAL") or not _deepspeed_importable():
        pytest.skip("runs the real DeepSpeed's zero_to_fp32 when DSC_DEEPSPEED_REAL names a directory it is "
                    "installed in (not a project dependency); our reading of its layout is tested with the "
                    "committed DeepSpeed-written fixture above")
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "ds_fp32.pt")
    saved = run_distributed(body, 2, args=(3, None, ckpt, 0, 3), timeout=300)
    env = dict(os.environ, PYTHONPATH=f"{DS_REAL}:{DS_DEPS}", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    code = ("import sys, torch; from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint; "
            "sd = get_fp32_state_dict_from_zero_checkpoint(sys.argv[1]); "
            "torch.save({k: v.clone() for k, v in sd.items()}, sys.argv[2])")
    subprocess.run([sys.executable, "-c", code, ckpt, out], env=env, check=True, capture_output=True, timeout=600)
    _same(torch.load(out), saved[0]["live"], "DeepSpeed's zero_to_fp32")
