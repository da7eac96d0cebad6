"""PyTorch Lightning's DeepSpeed strategy with the alias distribution installed (script:
client_lightning_script.py; one script start runs every training in turn, Lightning starting the second
rank on the first fit):

- strategy="deepspeed_stage_1" | "deepspeed_stage_2" | "deepspeed_stage_2_offload" | "deepspeed_stage_3" |
  "deepspeed_stage_3_offload" and DeepSpeedStrategy(config={...}) (stage 2, AdamW in the config) train a
  LightningModule whose layers configure_model builds (at stage 3 inside Lightning's deepspeed.zero.Init,
  partitioned as constructed; the model summary reads partition_numel()): our engine ran each, at the
  stage and offload the name asks for, and every rank's 10 losses equal those of strategy="ddp" within
  fp32 rounding (1e-5 relative); the loss falls;
- trainer.save_checkpoint at step 6 writes a DeepSpeed checkpoint directory that Lightning's
  convert_zero_checkpoint_to_fp32_state_dict turns into the weights the model had then (bit for bit, ZeRO-3
  included) plus Lightning's own state; trainer.fit(ckpt_path=...) from it continues with the straight run's
  losses (at stages 2 and 3, as DDP's own checkpoint does);
- DeepSpeedStrategy(stage=2, offload_parameters=True) trains as stage 2 (DeepSpeed reads offload_param at
  stage 3 only; we warn that it has no effect), with the same losses.

Lightning refuses its DeepSpeed strategy unless the accelerator is CUDA ("The DeepSpeed strategy is only
supported on CUDA GPUs", with DeepSpeed itself too). On CPU (CI) the strategies are a DeepSpeedStrategy
subclass that skips only that check and the check that device indices are local ranks, built with the
arguments Lightning's registry gives each name: every other Lightning path (config building, init_distributed,
initialize, backward/step through the precision plugin, save/load_checkpoint, zero.GatheredParameters,
the converter) runs as shipped. On a machine with CUDA the stock strategy names run (test_lightning_on_gpu)."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                reason="lightning (in requirements-lock.txt) is not installed")

from tests.distributed.hf_launch import run_user_command  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "distributed" / "client_lightning_script.py")
DEEPSPEED_RUNS = {"stage_1": (1, False, "AdamW"), "stage_2": (2, False, "AdamW"),
                  "stage_2_offload": (2, True, "DeepSpeedCPUAdam"), "stage_3": (3, False, "AdamW"),
                  "stage_3_offload": (3, True, "DeepSpeedCPUAdam"), "config": (2, False, "FusedAdam"),
                  "param_offload_2": (2, False, "AdamW")}  # offload_param below stage 3: ignored, as DeepSpeed does
RESUMED = ("ddp", "stage_2", "stage_3")
RUNS = ",".join(["ddp", "resume_ddp", *DEEPSPEED_RUNS, *(f"resume_{r}" for r in RESUMED[1:])])


def _run(alias: pathlib.Path, work: pathlib.Path, *flags: str) -> pathlib.Path:
    run_user_command([sys.executable, SCRIPT, str(work), RUNS, *flags], alias, work)
    return work


def _rank(work: pathlib.Path, run: str, r: int) -> dict:
    return json.loads((work / run / f"rank{r}.json").read_text())


def check(work: pathlib.Path, world: int, rel: float) -> None:
    def close(a: list, b: list) -> bool:
        return len(a) == len(b) and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))

    for r in range(world):
        ref = _rank(work, "ddp", r)
        assert ref["engine"] == "torch.nn.parallel.distributed" and ref["world"] == world, ref
        assert len(ref["losses"]) == 10 and sum(ref["losses"][-3:]) < 0.6 * sum(ref["losses"][:3]), ref["losses"]
        for run, (stage, offload, optimizer) in DEEPSPEED_RUNS.items():
            got = _rank(work, run, r)
            assert got["engine"] == "deepspeed_c.runtime.engine", (run, got)
            assert (got["zero_stage"], got["offload"], got["optimizer"]) == (stage, offload, optimizer), (run, got)
            assert got["global_step"] == 10 and got["saved"], (run, got)
            assert got["built_partitioned"] == (stage == 3), (run, got)  # configure_model under zero.Init
            assert close(got["losses"], ref["losses"]), (run, r, got["losses"], ref["losses"])
        for run in RESUMED:
            straight, resumed = _rank(work, run, r), _rank(work, f"resume_{run}", r)
            assert resumed["global_step"] == 10
            assert close(resumed["losses"], straight["losses"][6:]), (run, r, resumed["losses"], straight["losses"])
    for run in DEEPSPEED_RUNS:
        live = torch.load(work / run / "live6.pt")
        converted = torch.load(work / run / "fp32.pt", weights_only=False)
        assert set(converted["state_dict"]) == set(live), run
        for k, v in live.items():
            assert torch.equal(converted["state_dict"][k].cpu(), v.cpu()), (run, k)
        assert converted["global_step"] == 6 and "loops" in converted and "module" not in converted, run


def test_lightning_strategies_on_cpu_ranks(compat_alias, tmp_path):
    check(_run(compat_alias, tmp_path, "--cpu-gate-lifted"), world=2, rel=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="Lightning refuses its DeepSpeed strategy without CUDA ('The DeepSpeed strategy is only "
                           "supported on CUDA GPUs', with DeepSpeed itself too); the CPU test covers its code paths")
def test_lightning_on_gpu(compat_alias, tmp_path):
    devices = min(2, torch.cuda.device_count())
    check(_run(compat_alias, tmp_path, "--accelerator", "gpu", "--devices", str(devices)), world=devices, rel=1e-4)
