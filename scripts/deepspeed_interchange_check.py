"""Checks that the real DeepSpeed 0.19.8 takes deepspeed_c's checkpoints as its own. Not part of CI:
run it where DeepSpeed is importable, e.g. on CPU

    PYTHONPATH=.:/tmp/ds_real:/tmp/ds_deps DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 \\
        python scripts/deepspeed_interchange_check.py [case-name ...]

(on a GPU box with CUDA it runs the same cases on the GPUs, NCCL). For every case (ZeRO stage 0/1/2/3 x
fp32/bf16 x frozen parameter or not, 1 and 2 ranks; frozen cases also saved with
exclude_frozen_parameters=True) it trains tests/fixtures/deepspeed_written/common.py's TinyNet with
deepspeed_c for a few steps, saves, and goes on training (the uninterrupted reference). Then:
  1. a real DeepSpeed engine with the same config loads the checkpoint: its fp32 masters and Adam
     moments must equal ours at the save and its next losses must equal our next losses;
  2. (stages 1-3) DeepSpeed's zero_to_fp32 consolidates the checkpoint: each tensor must equal
     deepspeed_c's zero_to_fp32 of it and the live model's, and it must give the names DeepSpeed gives
     its own checkpoints (trainable + buffers, frozen ones at stage 2 unless excluded).
Tolerances: the loaded state must be bit-exact (both keep fp32 masters); next losses relative 1e-5
(fp32) / 2e-2 (bf16, whose forward and gradients round differently in the two implementations).
Prints a table; exits 1 on any mismatch. DeepSpeed is imported here only, never by the package."""
from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import traceback
from typing import Any

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "fixtures", "deepspeed_written"))
sys.path.insert(0, ROOT)
import common  # noqa: E402

NEXT_STEPS = 3
LOSS_RTOL = {False: 1e-5, True: 2e-2}
STATE_TOL = 0.0  # loaded masters and moments: bit-exact


def cases() -> list[tuple[int, bool, bool, int, bool]]:
    """(stage, bf16, frozen, world, exclude_frozen_parameters)."""
    base = common.cases() + [(3, bf16, frozen, world) for bf16 in (False, True) for frozen in (False, True)
                              for world in (1, 2)]
    out = [(*c, False) for c in base]
    out += [(*c, True) for c in base if c[2]]
    return out


def name(case: tuple) -> str:
    return common.case_name(*case[:4]) + ("_excl" if case[4] else "")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _mean_loss(loss: torch.Tensor, world: int) -> float:
    mean = loss.detach().float().clone()
    torch.distributed.all_reduce(mean)
    return float(mean) / world


def _step(engine: Any, step: int, rank: int, world: int, bf16: bool) -> float:
    x, y = common.batch(step, rank, world)
    dev = _device()
    loss = engine(x.to(dev, torch.bfloat16 if bf16 else torch.float32), y.to(dev))
    engine.backward(loss)
    engine.step()
    return _mean_loss(loss, world)


def _trainable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _state(engine: Any, stage: int, bf16: bool, get_fp32: Any, get_opt: Any) -> dict[str, torch.Tensor]:
    """fp32 masters and Adam moments by parameter name (collective at stages 1/2): deepspeed_c's at any
    stage, DeepSpeed's at stage 0 (both name the wrapper's masters `fp32_groups`, its torch optimizer
    `optimizer`)."""
    out: dict[str, torch.Tensor] = {}
    params = _trainable(engine.module)
    if stage > 0:
        for n, p in params:
            out[n] = get_fp32(p).detach().float().cpu().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{n}:{key}"] = get_opt(p, key).detach().float().cpu().clone()
        return out
    opt = engine.optimizer
    base = getattr(opt, "optimizer", opt)  # the torch optimizer under a bf16/fp16 wrapper
    masters = [m for group in opt.fp32_groups for m in group] if bf16 else [p for _, p in params]
    state = base.state_dict()["state"]
    for i, ((n, _), m) in enumerate(zip(params, masters)):
        out[n] = m.detach().float().cpu().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{n}:{key}"] = state[i][key].detach().float().cpu().clone()
    return out


def _ours(case: tuple, rank: int, world: int, ckpt: str) -> tuple[list[float], dict, dict]:
    import deepspeed_c
    from deepspeed_c.utils.tensor_fragment import safe_get_full_fp32_param, safe_get_full_optimizer_state

    stage, bf16, frozen, _, exclude = case
    model = common.build_model(frozen).to(_device())
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed_c.initialize(model=model, model_parameters=trainable, config=common.config(stage, bf16, world))
    for step in range(common.STEPS_BEFORE_SAVE):
        _step(engine, step, rank, world, bf16)
    engine.save_checkpoint(ckpt, tag=common.TAG, exclude_frozen_parameters=exclude)
    state = _state(engine, stage, bf16, safe_get_full_fp32_param, safe_get_full_optimizer_state)
    live = {n: state[n] for n, _ in _trainable(engine.module)}
    frozen = [(n, p) for n, p in engine.module.named_parameters() if not p.requires_grad]
    with deepspeed_c.zero.GatheredParameters([p for _, p in frozen], enabled=stage == 3):
        live.update({n: p.detach().float().cpu().clone() for n, p in frozen})
    losses = [_step(engine, common.STEPS_BEFORE_SAVE + i, rank, world, bf16) for i in range(NEXT_STEPS)]
    _destroy(engine)
    return losses, state, live


def _theirs(case: tuple, rank: int, world: int, ckpt: str) -> tuple[list[float], dict]:
    import deepspeed

    stage, bf16, frozen, _, exclude = case
    model = common.build_model(frozen).to(_device())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=common.config(stage, bf16, world))
    path, _ = engine.load_checkpoint(ckpt, tag=common.TAG, load_module_strict=not exclude)
    if path is None:
        raise RuntimeError("DeepSpeed's load_checkpoint returned no path")
    if engine.global_steps != common.STEPS_BEFORE_SAVE:
        raise RuntimeError(f"DeepSpeed restored global_steps={engine.global_steps}")
    if stage == 3:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        state = _state(engine, stage, bf16, safe_get_full_fp32_param, safe_get_full_optimizer_state)
    else:
        state = _ds_zero_state(engine, world) if stage > 0 else _state(engine, stage, bf16, None, None)
    losses = [_step(engine, common.STEPS_BEFORE_SAVE + i, rank, world, bf16) for i in range(NEXT_STEPS)]
    _destroy(engine)
    return losses, state


def _ds_zero_state(engine: Any, world: int) -> dict[str, torch.Tensor]:
    """DeepSpeed's ZeRO-1/2 masters and moments by name, read from its flat partitions (its
    safe_get_full_optimizer_state only works once a step has linked the moments): every rank's equal
    partition all-gathered is the group's parameters in order, padded at the end."""
    opt = engine.optimizer
    names = {id(p): n for n, p in engine.module.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for g, flat in enumerate(opt.single_partition_of_fp32_groups):
        state = opt.optimizer.state[flat]
        for key, local in (("", flat), (":exp_avg", state["exp_avg"]), (":exp_avg_sq", state["exp_avg_sq"])):
            parts = [torch.empty_like(local) for _ in range(world)]
            torch.distributed.all_gather(parts, local.detach().contiguous())
            whole, offset = torch.cat(parts).float().cpu(), 0
            for p in opt.bit16_groups[g]:
                out[names[id(p)] + key] = whole[offset:offset + p.numel()].view(p.shape).clone()
                offset += p.numel()
    return out


def _destroy(engine: Any) -> None:
    if hasattr(engine, "destroy"):
        engine.destroy()


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for k in a:
        x, y = a[k].double(), b[k].double()
        if x.shape != y.shape:
            return float("inf")
        worst = max(worst, float((x - y).norm() / y.norm().clamp_min(1e-30)))
    return worst


def _consolidation(case: tuple, ckpt: str, live: dict) -> dict[str, Any]:
    """DeepSpeed's zero_to_fp32 on our checkpoint vs ours and the live model (rank 0 only)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as theirs

    from deepspeed_c.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as ours

    stage, _, frozen, _, exclude = case
    ds_sd = theirs(ckpt, tag=common.TAG)
    our_sd = ours(ckpt, tag=common.TAG)
    model = common.build_model(frozen)
    want = {n for n, p in model.named_parameters() if p.requires_grad}
    if frozen and stage >= 2 and not exclude:  # DeepSpeed keeps frozen parameters there only
        want |= {n for n, p in model.named_parameters() if not p.requires_grad}
    problems = []
    if set(ds_sd) != want:
        problems.append(f"DeepSpeed's zero_to_fp32 gave {sorted(ds_sd)}, DeepSpeed gives its own {sorted(want)}")
    missing = sorted(set(ds_sd) - set(our_sd))
    if missing:
        problems.append(f"ours lacks {missing}")
    common_keys = [k for k in ds_sd if k in our_sd]
    vs_ours = _max_rel({k: ds_sd[k].float() for k in common_keys}, {k: our_sd[k].float() for k in common_keys})
    vs_live = _max_rel({k: ds_sd[k].float() for k in ds_sd if k in live}, live)
    return {"vs_ours": vs_ours, "vs_live": vs_live, "names": len(ds_sd), "problems": problems}


def _run_case(case: tuple, rank: int, world: int, root: str) -> dict[str, Any]:
    ckpt = os.path.join(root, name(case))
    our_losses, our_state, live = _ours(case, rank, world, ckpt)
    torch.distributed.barrier()
    ds_losses, ds_state = _theirs(case, rank, world, ckpt)
    torch.distributed.barrier()
    result: dict[str, Any] = {"ours": our_losses, "theirs": ds_losses, "state": _max_rel(ds_state, our_state)}
    if rank == 0 and case[0] > 0:
        result["z2f"] = _consolidation(case, ckpt, live)
    torch.distributed.barrier()
    return result


def _rank_main(rank: int, world: int, port: int, todo: list, root: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    import deepspeed

    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    results = {}
    for case in todo:
        try:
            results[name(case)] = _run_case(tuple(case), rank, world, root)
        except Exception:  # noqa: BLE001 (report the case, go on with the next)
            results[name(case)] = {"error": traceback.format_exc()}
            torch.distributed.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    torch.distributed.destroy_process_group()


def _verdict(case: tuple, r: dict) -> tuple[list[str], list[str]]:
    if "error" in r:
        print(f"--- {name(case)}:\n{r['error']}")
        return ["-"] * 5, [r["error"].strip().splitlines()[-1]]
    problems = []
    rtol = LOSS_RTOL[case[1]]
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(r["ours"], r["theirs"]))
    if loss_err > rtol:
        problems.append(f"next losses ours {r['ours']} DeepSpeed {r['theirs']}")
    if r["state"] > STATE_TOL:
        problems.append(f"loaded masters/moments differ by {r['state']:.2e}")
    cells = [f"{loss_err:.1e}", f"{r['state']:.1e}"]
    z = r.get("z2f")
    if z is None:
        cells += ["-", "-", "-"]
    else:
        cells += [f"{z['vs_ours']:.1e}", f"{z['vs_live']:.1e}", str(z["names"])]
        problems += z["problems"]
        if z["vs_ours"] > STATE_TOL or z["vs_live"] > STATE_TOL:
            problems.append(f"zero_to_fp32 differs: vs ours {z['vs_ours']:.2e}, vs live {z['vs_live']:.2e}")
    return cells, problems


def main() -> int:
    only = set(sys.argv[1:])
    todo = [c for c in cases() if not only or name(c) in only]
    rows, failed = [], []
    with tempfile.TemporaryDirectory(prefix="dsc_interchange_") as root:
        results: dict[str, Any] = {}
        for world in sorted({c[3] for c in todo}):
            mine = [c for c in todo if c[3] == world]
            if torch.cuda.is_available() and torch.cuda.device_count() < world:
                results.update({name(c): {"error": f"needs {world} GPUs"} for c in mine})
                continue
            out = os.path.join(root, f"results_w{world}.json")
            mp.spawn(_rank_main, args=(world, _free_port(), mine, root, out), nprocs=world, join=True)
            with open(out) as f:
                results.update(json.load(f))
        for case in todo:
            cells, problems = _verdict(case, results[name(case)])
            rows.append([name(case), *cells, "ok" if not problems else "FAIL"])
            if problems:
                failed.append((name(case), problems))
    head = ["case", "loss rel", "state", "z2f vs ours", "z2f vs live", "names", "result"]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for row in [head, ["-" * w for w in widths], *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    for case_name, problems in failed:
        for p in problems:
            print(f"FAIL {case_name}: {p}")
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
