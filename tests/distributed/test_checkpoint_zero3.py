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
from tests.shared_launch import run_worlds

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
    engine.destroy()  # the next case of the same launch builds its own
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


# -- every run of the module, in one launch (tests/shared_launch.py: a fresh process group per world) -------
ONLY = {"load_module_only": True}


def _cases(rank: int, world: int, cases: list) -> dict:
    """Each case (id, body or ds_body, its args) in turn on the same ranks; every case builds its own engine."""
    return {cid: fn(rank, world, *args) for cid, fn, args in cases}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, deepspeed_zero3) -> dict:
    """All runs the tests check, by id: a world of 2 saves (`a`: stage 3, 3 steps), resumes, copies `a` into a
    stage-2 checkpoint (`b`) and loads it every way; a world of 4 reshards `a` (2 -> 4), saves its own (`a4`)
    and brings `b` back to stage 3; a world of 2 reshards `a4` (4 -> 2); worlds of 2 and 3 load the
    DeepSpeed-written checkpoint. Each id's value: per rank, body's (or ds_body's) result."""
    root = tmp_path_factory.mktemp("z3")
    p = {k: str(root / k) for k in ("a", "b", "a4", "b24", "b42", "c")}
    first2 = [("whole", body, (3, None, None, 0, STEPS)),
              ("saved", body, (3, None, p["a"], 0, 3)),  # stage 3, 3 steps from the start, saved
              ("resumed", body, (3, p["a"], None, 3, STEPS)),  # and trained on to STEPS from it
              # the same state in a stage-2 checkpoint (loaded at stage 2, saved again, no training)
              ("stage2_copy", body, (2, p["a"], p["b"], 3, 3)),
              ("stage2_on", body, (2, p["a"], None, 3, STEPS)),
              ("only_a_s2_w2", body, (2, p["a"], None, 3, 4, ONLY)),
              ("only_b_s3_w2", body, (3, p["b"], None, 3, 4, ONLY)),
              ("no_optim_a_s3_w2", body, (3, p["a"], None, 3, 4, {"load_optimizer_states": False}))]
    four = [("reshard_2_4", body, (3, p["a"], p["b24"], 3, 3)),  # load, save again, no training
            ("on4", body, (3, p["b24"], None, 3, STEPS)),
            ("saved4", body, (3, None, p["a4"], 0, 3)),
            ("back_from_s2", body, (3, p["b"], p["c"], 3, 3)),
            ("only_a_s3_w4", body, (3, p["a"], None, 3, 4, ONLY))]
    last2 = [("reshard_4_2", body, (3, p["a4"], p["b42"], 3, 3)), ("ds_w2", ds_body, (deepspeed_zero3,))]
    three = [("ds_w3", ds_body, (deepspeed_zero3,))]
    phases = run_worlds([(2, _cases, (first2,)), (4, _cases, (four,)), (2, _cases, (last2,)), (3, _cases, (three,))],
                        timeout=600)
    out: dict = {"paths": p}
    for per_rank in phases:
        for cid in per_rank[0]:
            out[cid] = [r[cid] for r in per_rank]
    return out


# -- tests ---------------------------------------------------------------------------------------------------
def test_exact_resume_and_layout(runs):
    ckpt, first, whole, resumed = runs["paths"]["a"], runs["saved"], runs["whole"], runs["resumed"]
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
def test_reshard(runs, n, m):
    paths = runs["paths"]
    a, b = (paths["a"], paths["b24"]) if n == 2 else (paths["a4"], paths["b42"])
    saved = runs["saved" if n == 2 else "saved4"]
    got = runs[f"reshard_{n}_{m}"]  # loaded at m ranks, saved again, no training
    assert len(got) == m
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
    _close(runs["resumed"][0]["live"], runs["on4"][0]["live"])


def test_stage3_to_stage2_and_back(runs):
    a, b, c = (runs["paths"][k] for k in ("a", "b", "c"))
    saved, on2, back = runs["saved"], runs["stage2_copy"], runs["back_from_s2"]
    for r in range(2):
        assert on2[r]["steps"] == 3
        _same(on2[r]["loaded"], saved[0]["live"], "stage 2 loaded")
    assert len(back) == 4
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
    _close(runs["resumed"][0]["live"], runs["stage2_on"][0]["live"])


@pytest.mark.parametrize("case", ["only_a_s3_w4", "only_a_s2_w2", "only_b_s3_w2", "no_optim_a_s3_w2"])
def test_module_only_and_no_optimizer_states(runs, case):
    """load_module_only from the stage-3 checkpoint at stage 3 on 4 ranks and at stage 2, from its stage-2
    copy at stage 3; load_optimizer_states=False at stage 3: the saved weights, and training goes on."""
    saved, got = runs["saved"], runs[case]
    assert len(got) == int(case[-1])
    _same(got[0]["loaded"], saved[0]["live"], case)
    assert got[0]["steps"] == (3 if case.startswith("no_optim") else 0)
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
    engine.destroy()
    return {"weights": _np(weights), "steps": engine.global_steps, "loss": float(loss)}


@pytest.mark.parametrize("world", [2, 3])
def test_loads_deepspeed_written_stage3(runs, deepspeed_zero3, world):
    got = runs[f"ds_w{world}"]
    assert len(got) == world
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
