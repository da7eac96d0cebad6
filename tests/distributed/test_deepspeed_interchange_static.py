"""deepspeed_c's checkpoints hold what DeepSpeed 0.19.8 writes, key for key and type for type, so the
real DeepSpeed loads them (the live check, scripts/deepspeed_interchange_check.py, needs DeepSpeed;
this one does not). The reference is DeepSpeed's own files for the same case
(tests/fixtures/deepspeed_written, written by DeepSpeed 0.19.8's engine from the same model, data and
config): for every case we save a deepspeed_c checkpoint and compare both files' structure.

Checked per file: every key DeepSpeed writes is there with the same type (tensors: same dtype and
shape; DeepSpeed's pickled objects: the same class and attributes); deepspeed_c's extra keys are the
listed ones; the pickle names exactly the globals DeepSpeed's names (its LossScaler, ZeroStageEnum,
fragment_address under their DeepSpeed module paths); the partition records (zero_stage,
partition_count, group_paddings, param_alignment_paddings, param_slice_mappings, loss scaler
attributes) are equal, as the layout is the same. Documented deviations: `param_shapes` at stage 0
(DeepSpeed: None; ours names the groups so zero_to_fp32 can name the masters), ds_config contents
(DeepSpeed writes its parsed config), and ZeRO partitions kept padded (equal here: no padding)."""
from __future__ import annotations

import os
import pickletools
import sys
import zipfile
from typing import Any

import pytest
import torch

from tests.harness import run_distributed

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "deepspeed_written")
sys.path.insert(0, HERE)
import common  # noqa: E402

# keys deepspeed_c adds to a ZeRO file's optimizer_state_dict (its own loader's layout records)
OUR_ZERO_EXTRAS = {"rank", "layout", "group_numels", "ds_partition_sizes"}
# keys deepspeed_c adds to the stage-0 fp16/bf16 optimizer state (its scaler/overflow/clip state)
OUR_MIXED_EXTRAS = {"loss_scaler", "overflow", "clip_grad"}
# values that must be equal, not just of one type: the ZeRO partition layout and scaler records
EQUAL_KEYS = {"zero_stage", "partition_count", "group_paddings", "param_alignment_paddings", "param_slice_mappings",
              "loss_scaler", "dynamic_loss_scale", "dp_world_size", "mp_world_size", "global_steps",
              "checkpoint_parallel_dimensions", "buffer_names", "param_shapes", "frozen_param_shapes"}


def _save(rank: int, world: int, todo: list, root: str) -> None:
    import deepspeed_c

    for stage, bf16, frozen, _, exclude in todo:
        model = common.build_model(frozen)
        engine, *_ = deepspeed_c.initialize(model=model,
                                            model_parameters=[p for p in model.parameters() if p.requires_grad],
                                            config=common.config(stage, bf16, world))
        for step in range(common.STEPS_BEFORE_SAVE):
            x, y = common.batch(step, rank, world)
            loss = engine(x.to(torch.bfloat16 if bf16 else torch.float32), y)
            engine.backward(loss)
            engine.step()
        name = common.case_name(stage, bf16, frozen, world) + ("_excl" if exclude else "")
        engine.save_checkpoint(os.path.join(root, name), tag=common.TAG, exclude_frozen_parameters=exclude)
        engine.destroy()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("ours"))
    for world in (1, 2):
        todo = [(*c, False) for c in common.cases() if c[3] == world]
        todo += [(2, True, True, world, True)]  # exclude_frozen_parameters at a stage that writes frozen ones
        run_distributed(_save, world, args=(todo, root), timeout=240)
    return root


def _load(path: str) -> Any:
    from deepspeed_c.checkpoint import safe_load

    return safe_load.load(path)


def _sig(v: Any) -> Any:
    """Structure and types of a loaded checkpoint value (tensors by dtype and shape)."""
    from deepspeed_c.checkpoint import safe_load

    if isinstance(v, torch.Tensor):
        return ("tensor", str(v.dtype), tuple(v.shape))
    if isinstance(v, torch.Size):
        return ("Size", tuple(v))
    if isinstance(v, safe_load.ZeroStageStandIn):
        return ("ZeroStageEnum", int(v))
    if isinstance(v, (safe_load.LossScalerStandIn, safe_load.FragmentAddressStandIn)):
        return (type(v).__name__, _sig(dict(vars(v))))
    if isinstance(v, dict):
        return {k: _sig(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_sig(x) for x in v]
    return type(v).__name__


def _values(v: Any) -> Any:
    from deepspeed_c.checkpoint import safe_load

    if isinstance(v, (safe_load.LossScalerStandIn, safe_load.FragmentAddressStandIn)):
        return (type(v).__name__, _values(dict(vars(v))))
    if isinstance(v, dict):
        return {k: _values(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_values(x) for x in v]
    if isinstance(v, torch.Size):
        return tuple(v)
    return int(v) if isinstance(v, safe_load.ZeroStageStandIn) else v


def _compare(ours: dict, theirs: dict, where: str, extras: set[str], problems: list[str]) -> None:
    for key, ref in theirs.items():
        if key not in ours:
            problems.append(f"{where}: DeepSpeed writes {key!r}, ours lacks it")
        elif key == "ds_config":
            if not isinstance(ours[key], dict):
                problems.append(f"{where}.ds_config is {type(ours[key]).__name__}")
        elif key in EQUAL_KEYS and _values(ours[key]) != _values(ref):
            problems.append(f"{where}.{key}: ours {_values(ours[key])!r}, DeepSpeed {_values(ref)!r}")
        elif key == "optimizer" and isinstance(ref, dict) and "fp32_groups" in ref:
            _compare(ours[key], ref, f"{where}.optimizer", OUR_MIXED_EXTRAS, problems)
        elif key == "optimizer_state_dict":
            _compare(ours[key], ref, f"{where}.optimizer_state_dict", OUR_ZERO_EXTRAS, problems)
        elif _sig(ours[key]) != _sig(ref):
            problems.append(f"{where}.{key}: ours {_sig(ours[key])!r}, DeepSpeed {_sig(ref)!r}")
    extra = set(ours) - set(theirs) - extras
    if extra:
        problems.append(f"{where}: keys DeepSpeed does not write: {sorted(extra)}")


def _globals(path: str) -> set[str]:
    """The globals a torch.save file's pickle names (classes and functions it rebuilds from)."""
    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    out, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("GLOBAL", "INST"):
            out.add(arg.replace(" ", "."))
        elif op.name == "STACK_GLOBAL":
            out.add(".".join(strings[-2:]))
        if isinstance(arg, str):
            strings.append(arg)
    return out


CASES = common.cases()


@pytest.mark.parametrize("case", CASES, ids=[common.case_name(*c) for c in CASES])
def test_files_hold_what_deepspeed_writes(saved: str, case: tuple) -> None:
    stage, bf16, frozen, world = case
    name = common.case_name(*case)
    ours_dir, ds_dir = os.path.join(saved, name, common.TAG), os.path.join(HERE, name, common.TAG)
    ds_files = sorted(f for f in os.listdir(ds_dir) if f.endswith(".pt"))
    # deepspeed_c's own per-rank additions (dsc_*: RNG states, reducer order) are not DeepSpeed's files
    ours_files = sorted(f for f in os.listdir(ours_dir) if f.endswith(".pt") and not f.startswith("dsc_"))
    assert ours_files == ds_files
    problems: list[str] = []
    for f in ds_files:
        ours, theirs = _load(os.path.join(ours_dir, f)), _load(os.path.join(ds_dir, f))
        extras: set[str] = set()
        if stage == 0:  # the documented deviation: DeepSpeed writes None here
            assert theirs["param_shapes"] is None and ours["param_shapes"]
            theirs = dict(theirs, param_shapes=ours["param_shapes"])
        _compare(ours, theirs, f, extras, problems)
        ours_g, ds_g = _globals(os.path.join(ours_dir, f)), _globals(os.path.join(ds_dir, f))
        if stage == 0:  # the stage-0 param_shapes hold torch.Size values
            ds_g.add("torch.Size")
        if ours_g != ds_g:
            problems.append(f"{f}: pickle names {sorted(ours_g)}, DeepSpeed's {sorted(ds_g)}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world", [1, 2])
def test_exclude_frozen_parameters_writes_no_frozen_state(saved: str, world: int) -> None:
    """DeepSpeed with exclude_frozen_parameters=True: no frozen weights in `module`, and no
    frozen_param_shapes / frozen_param_fragments even at stage 2 (its _save_checkpoint)."""
    sd = _load(os.path.join(saved, common.case_name(2, True, True, world) + "_excl", common.TAG,
                            "mp_rank_00_model_states.pt"))
    assert "fc1.bias" not in sd["module"] and "fc1.weight" in sd["module"]
    assert sd["frozen_param_shapes"] is None and sd["frozen_param_fragments"] is None
    assert list(sd["param_shapes"][0]) == ["fc1.weight", "fc2.weight", "fc2.bias"]


def test_pickled_objects_resolve_to_working_classes_under_the_deepspeed_alias(saved: str) -> None:
    """With `import deepspeed` served by deepspeed_c (compat/deepspeed), a plain torch.load(weights_only=False)
    of our ZeRO file builds real objects from DeepSpeed's names, as DeepSpeed's loader does with its own."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(saved, common.case_name(2, True, True, 2), common.TAG,
                        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    code = ("import sys, torch, deepspeed\n"
            f"sd = torch.load({path!r}, weights_only=False)['optimizer_state_dict']\n"
            "s = sd['loss_scaler']\n"
            "print(type(s).__module__, type(s).__name__, float(s.scale_loss(torch.tensor(3.0))), s.dynamic,\n"
            "      int(sd['zero_stage']), [(k, v.numel, v.start) for k, v in sd['param_slice_mappings'][0].items()])\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.path.join(root, "compat", "deepspeed")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    ds = _load(os.path.join(HERE, common.case_name(2, True, True, 2), common.TAG,
                            "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"))["optimizer_state_dict"]
    want = [(k, v.numel, v.start) for k, v in ds["param_slice_mappings"][0].items()]
    assert out.stdout.strip().splitlines()[-1] == (
        f"deepspeed_c.runtime.fp16.loss_scaler LossScaler 3.0 False 2 {want}")
