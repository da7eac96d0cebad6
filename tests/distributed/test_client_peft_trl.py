"""PEFT LoRA under the HF Trainer and TRL's SFTTrainer, with the alias distribution installed and the
alias's `deepspeed` command starting 2 CPU ranks (script: client_hf_script.py; one launch runs every
training in turn, references first):

- LoRA (peft.get_peft_model on a small GPT-2 built from a config) trained by the Trainer with
  `--deepspeed` at ZeRO stage 2 and 3: the logged losses equal those of the same Trainer without DeepSpeed
  (plain DDP over the same 2 ranks) within fp32 rounding (1e-5 relative), and so do the trained adapter
  weights (1e-5 norm-wise relative per tensor); the loss falls;
- the adapter trainer.save_model writes (through engine._zero3_consolidated_16bit_state_dict at stage 3)
  loads back with PeftModel.from_pretrained equal, bit for bit, to the live adapter weights;
- `--resume_from_checkpoint` at step 6 (a DeepSpeed checkpoint written with exclude_frozen_parameters, as
  the Trainer does for PEFT models, loaded with load_module_strict=False) ends bit-equal to the straight
  run, at stages 2 and 3;
- TRL's SFTTrainer with `--deepspeed` (stage 2) on a small in-memory text dataset: losses equal the same
  SFTTrainer without DeepSpeed within 1e-5 relative, and fall (bf16=False on both: TRL defaults to bf16,
  autocast without DeepSpeed and bf16 weights with it, which round differently)."""
from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest
import torch

# found, not imported: the clients run in the launched processes, and importing them here costs seconds
_MISSING = [m for m in ("transformers", "accelerate", "peft", "trl", "datasets") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"{_MISSING} (in requirements-lock.txt) not installed")

from tests.distributed.hf_launch import run_user_command  # noqa: E402
from tests.harness import free_port  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "distributed" / "client_hf_script.py"
# references first: after a DeepSpeed run accelerate leaves ACCELERATE_USE_DEEPSPEED set in the process
ORDER = "lora,sft,lora_z2,lora_z2r,lora_z3,lora_z3r,sft_z2"
DDP = "torch.nn.parallel.distributed"
OURS = "deepspeed_c.runtime.engine"


@pytest.fixture(scope="module")
def work(compat_alias, tmp_path_factory) -> pathlib.Path:
    work = tmp_path_factory.mktemp("peft")
    run_user_command([str(compat_alias / "bin" / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
                      str(SCRIPT), str(work), ORDER], compat_alias, work)
    return work


def _result(work: pathlib.Path, name: str) -> dict:
    return json.loads((work / name / "result.json").read_text())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _close(a: list, b: list, rel: float = 1e-5) -> bool:
    return len(a) == len(b) == 10 and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))


def _falls(losses: list) -> bool:
    return len(losses) == 10 and sum(losses[-3:]) < 0.98 * sum(losses[:3])


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_under_deepspeed_matches_plain_trainer(work, stage):
    ref, ds = _result(work, "lora"), _result(work, f"lora_z{stage}")
    assert ref["engine"] == DDP and ds["engine"] == OURS, (ref["engine"], ds["engine"])
    assert ds["trainable"] == ref["trainable"] > 0  # only the adapters train
    assert _falls(ref["losses"]), ref["losses"]
    assert _close(ds["losses"], ref["losses"]), (ds["losses"], ref["losses"])
    live, want = torch.load(work / f"lora_z{stage}" / "adapter.pt"), torch.load(work / "lora" / "adapter.pt")
    assert set(live) == set(want) and len(want) == 2 * 2 * 4  # A and B of c_attn, c_proj x2, c_fc per layer
    for k in want:
        assert _rel(live[k], want[k]) < 1e-5, (k, _rel(live[k], want[k]))


@pytest.mark.parametrize("name", ["lora", "lora_z2", "lora_z3", "lora_z2r", "lora_z3r"])
def test_saved_adapter_loads_back_equal(work, name):
    r = _result(work, name)
    assert r["adapter_keys_equal"] and r["adapter_load_equal"], r
    assert (work / name / "final" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_resume_from_checkpoint_is_exact(work, stage):
    straight, resumed = _result(work, f"lora_z{stage}"), _result(work, f"lora_z{stage}r")
    ckpt = work / f"lora_z{stage}" / "checkpoint-6"
    assert (ckpt / "latest").read_text().strip() == "global_step6"
    shards = {p.name for p in (ckpt / "global_step6").iterdir()}
    assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= shards
    assert resumed["losses"] == straight["losses"], (resumed["losses"], straight["losses"])
    a, b = torch.load(work / f"lora_z{stage}" / "adapter.pt"), torch.load(work / f"lora_z{stage}r" / "adapter.pt")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_sft_trainer_with_deepspeed_matches_plain(work):
    ref, ds = _result(work, "sft"), _result(work, "sft_z2")
    assert ref["engine"] == DDP and ds["engine"] == OURS, (ref["engine"], ds["engine"])
    assert _falls(ref["losses"]) and _falls(ds["losses"]), (ref["losses"], ds["losses"])
    assert _close(ds["losses"], ref["losses"]), (ds["losses"], ref["losses"])
