"""A tensor-parallel DeepSpeed checkpoint through a universal checkpoint into other TP x DP shapes.

DeepSpeed 0.19.8's TP 2 x DP 2 ZeRO-1 checkpoint of the tests' Megatron-style GPT
(tests/fixtures/deepspeed_megatron/tp2_dp2_z1), with the client's universal_checkpoint_info patterns
(what Megatron-DeepSpeed saves), converted by our ds_to_universal, loads with checkpoint.load_universal
into deepspeed_c at TP 2 x DP 2, TP 2 x DP 1, TP 1 x DP 1 and TP 1 x DP 2 (ZeRO-1; ZeRO-2 and stage 0 at
TP 1): each rank's shards are cut from the whole parameters along the file's cat_dim, the loaded weights
equal those DeepSpeed's own engine loaded from the checkpoint (gathered whole), and training continues
with DeepSpeed's next losses (fp32, 1e-5). The global batch is the same at every shape."""
from __future__ import annotations

import os
import shutil
import sys
from typing import Any, Optional

import numpy as np
import pytest
import torch

from tests.distributed import megatron_models as mm
from tests.harness import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "deepspeed_megatron")
sys.path.insert(0, FIXTURES)
import make_fixture as fx  # noqa: E402

REPLICATED = [r"pos$", r".*ln", r".*\.proj\.bias", r".*\.fc2\.bias"]
ROW = [r".*\.proj\.weight", r".*\.fc2\.weight"]
GLOBAL = fx.MICRO * 2


@pytest.fixture(scope="module")
def universal(tmp_path_factory: Any) -> str:
    from deepspeed_c.checkpoint import ds_pickle, safe_load
    from deepspeed_c.checkpoint.ds_to_universal import main, parse_arguments

    root = tmp_path_factory.mktemp("tpu")
    src = str(root / "src")
    shutil.copytree(os.path.join(FIXTURES, fx.CASE, fx.TAG), src)
    info = {"universal_checkpoint_version": 0.4, "tp_replicated_parameter_patterns": REPLICATED,
            "parameter_with_row_parallelism_patterns": ROW}
    for name in ("mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"):
        state = safe_load.load(os.path.join(src, name))
        state["universal_checkpoint_info"] = info
        pickler = {"pickle_module": ds_pickle} if ds_pickle.contains_stand_ins(state) else {}
        torch.save(state, os.path.join(src, name), **pickler)
    out = str(root / "universal")
    main(parse_arguments(["--input_folder", src, "--output_folder", out, "--num_extract_workers", "1",
                          "--num_merge_workers", "1"]))
    return out


def resume(rank: int, world: int, folder: str, tp: int, stage: int) -> dict:
    import deepspeed_c

    mpu: Optional[mm.MegatronMPU] = mm.MegatronMPU(tp=tp) if tp > 1 else None
    dp = mpu.dp if mpu is not None else world
    d = mpu.get_data_parallel_rank() if mpu is not None else rank
    cfg = fx.config(dp)
    cfg.update(train_micro_batch_size_per_gpu=GLOBAL // dp, train_batch_size=GLOBAL)
    cfg["zero_optimization"] = {"stage": stage}
    cfg["checkpoint"] = {"load_universal": True}
    model = mm.sharded_model(mpu, seed=7)
    engine = deepspeed_c.initialize(model=model, config=cfg, mpu=mpu)[0]
    engine.load_checkpoint(os.path.dirname(folder), tag=os.path.basename(folder))
    ctx = mpu.context() if mpu is not None else mm.TP(None, 1, 0)
    loaded = mm.full_state(engine.module, ctx)
    batches = fx.data(2)
    losses = []
    n = GLOBAL // dp
    for i in range(fx.STEPS_AFTER_RESUME):
        tokens = batches[fx.STEPS_BEFORE_SAVE + i]
        loss = engine(tokens[d * n:(d + 1) * n])
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        if dp > 1:
            torch.distributed.all_reduce(t, group=mpu.get_data_parallel_group() if mpu is not None else None)
        losses.append(float(t) / dp)
    return {"loaded": loaded, "losses": losses}


@pytest.mark.parametrize("tp,world,stage", [(2, 4, 1), (2, 2, 1), (1, 1, 0), (1, 2, 2)])
def test_tp_checkpoint_resumes_at_other_shapes(universal: str, tp: int, world: int, stage: int) -> None:
    expected = torch.load(os.path.join(FIXTURES, fx.CASE, "expected.pt"), weights_only=True)
    want = {k: v.numpy() for k, v in expected["loaded_weights"].items()}
    for r in run_distributed(resume, world, args=(universal, tp, stage), timeout=300):
        errs = mm.rel_errors(r["loaded"], want)
        assert max(errs.values()) < 1e-6, errs
        assert np.max(np.abs(np.array(r["losses"]) - expected["next_losses"])) < 1e-5 * max(expected["next_losses"]), \
            (r["losses"], expected["next_losses"])
