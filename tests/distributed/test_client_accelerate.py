"""accelerate with the alias distribution installed, run as users run it (script: client_accelerate_script.py,
one training loop with accumulate / backward / clip_grad_norm_ / save_state / load_state / get_state_dict):

- `accelerate launch --use_deepspeed --zero_stage 2 --gradient_accumulation_steps 2 --num_processes 2`
  (2 CPU ranks on gloo);
- `accelerate launch --use_deepspeed --deepspeed_config_file ds.json --num_processes 2` (the file: stage 2,
  optimizer offload to the CPU, small buckets so gradients reduce in several);
- `Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=2,
  offload_optimizer_device="cpu"))` built in the script, one process with the global batch;
- the reference: the same script without DeepSpeed (Accelerator(gradient_accumulation_steps=2), torch
  AdamW, one process with the global batch, which is the 2-rank DDP arithmetic).
Each DeepSpeed run: our engine ran it (accelerate's DistributedType.DEEPSPEED, the engine class from
deepspeed_c), its 20 micro-batch losses and the gradient norms clip_grad_norm_ returns (the engine's
get_global_grad_norm) equal the reference's within fp32 rounding (1e-5 relative), the
loss falls, the losses after load_state equal those the straight run had, get_state_dict equals the live
weights, and zero_to_fp32 recovers the weights at save_state from the directory accelerate wrote.
Bad input: a plugin option we have not built (parameter offload at stage 2) is refused with
NotImplementedError naming the DeepSpeed key it maps to."""
from __future__ import annotations

import json
import pathlib
import sys

import pytest
import torch

pytest.importorskip("accelerate", reason="accelerate is in requirements-lock.txt; install it to run this test")

from tests.distributed.hf_launch import run_user_command  # noqa: E402
from tests.harness import free_port  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
SAVE_AT = 6  # optimizer steps before save_state (client_accelerate_script.SAVE_AT)
SCRIPT = str(ROOT / "tests" / "distributed" / "client_accelerate_script.py")
DS_FILE = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0, "bf16": {"enabled": False}, "fp16": {"enabled": False},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "overlap_comm": True,
                          "contiguous_gradients": True, "reduce_bucket_size": 400, "allgather_bucket_size": 400},
}


@pytest.fixture(scope="module")
def runs(compat_alias, tmp_path_factory) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("acc")
    (work / "ds.json").write_text(json.dumps(DS_FILE))
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision",
                  "no", "--dynamo_backend", "no"]
    cmds = {
        # the reference and the in-script plugin run one after the other in one process (saves a start-up)
        "single": [sys.executable, SCRIPT, "--mode", "plain,plugin", "--batch", "8"],
        "flags": [*accelerate, "--use_deepspeed", "--zero_stage", "2", "--gradient_accumulation_steps", "2",
                  "--num_processes", "2", "--main_process_port", str(free_port()), SCRIPT, "--mode", "launch"],
        "file": [*accelerate, "--use_deepspeed", "--deepspeed_config_file", "ds.json", "--num_processes", "2",
                 "--main_process_port", str(free_port()), SCRIPT, "--mode", "launch"],
    }
    out = {}
    for name, cmd in cmds.items():
        run_user_command([*cmd, "--out", name], compat_alias, work)
    for name, mode in (("ref", "single/plain"), ("plugin", "single/plugin"), ("flags", "flags/launch"),
                       ("file", "file/launch")):
        out[name] = json.loads((work / mode / "result.json").read_text())
        out[name]["dir"] = str(work / mode)
    return out


def _close(a: list, b: list, rel: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))


def test_reference_is_plain_and_learns(runs):
    ref = runs["ref"]
    assert ref["distributed_type"] == "DistributedType.NO" and ref["engine"] is None
    losses = ref["losses"]
    assert len(losses) == 20 and sum(losses[-4:]) < 0.7 * sum(losses[:4]), losses
    assert ref["resumed"] == losses[12:] and ref["consolidated_equal"]


@pytest.mark.parametrize("name,procs,offload,optimizer", [("flags", 2, "none", "AdamW"),
                                                          ("file", 2, "cpu", "DeepSpeedCPUAdam"),
                                                          ("plugin", 1, "cpu", "DeepSpeedCPUAdam")])
def test_deepspeed_run_matches_plain(runs, name, procs, offload, optimizer):
    run, ref = runs[name], runs["ref"]
    assert run["distributed_type"] == "DistributedType.DEEPSPEED", run
    assert run["engine"] == "deepspeed_c.runtime.engine", run  # `import deepspeed` gave accelerate our engine
    assert run["num_processes"] == procs and run["zero_stage"] == 2 and run["gradient_accumulation_steps"] == 2
    assert run["offload_optimizer"] == offload and run["optimizer"] == optimizer, run
    assert _close(run["losses"], ref["losses"]), (run["losses"], ref["losses"])
    # clip_grad_norm_ returns the engine's get_global_grad_norm(): the norm before clipping, as torch's
    assert len(ref["grad_norms"]) == SAVE_AT and _close(run["grad_norms"], ref["grad_norms"]), \
        (run["grad_norms"], ref["grad_norms"])
    assert max(ref["grad_norms"]) > 1.0  # clipping at 1.0 acted
    # load_state brings back the step-6 model and optimizer: steps 7-10 again give the same losses
    assert run["resumed"] == run["losses"][12:], (run["resumed"], run["losses"][12:])
    assert run["consolidated_equal"]


def test_save_state_is_a_deepspeed_checkpoint(runs):
    from deepspeed_c.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    for name in ("flags", "file"):
        state = pathlib.Path(runs[name]["dir"]) / "state" / "pytorch_model"
        names = {p.name for p in state.iterdir()}
        assert names >= {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                         "zero_pp_rank_1_mp_rank_00_optim_states.pt"}, names
        recovered = get_fp32_state_dict_from_zero_checkpoint(str(state.parent), tag="pytorch_model")
        live = torch.load(pathlib.Path(runs[name]["dir"]) / "at_save.pt")
        assert set(recovered) == set(live)
        for k, v in live.items():
            assert torch.equal(recovered[k], v), (name, k)


def test_plugin_param_offload_below_stage_3_is_ignored_as_in_deepspeed():
    # parameter offload below stage 3: DeepSpeed reads offload_param at stage 3 only, so the config accelerate
    # builds from the plugin trains at stage 2 with the parameters on the device; we say the key has no effect
    from accelerate.utils import DeepSpeedPlugin

    from deepspeed_c.runtime.config import DeepSpeedConfig

    plugin = DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=1, gradient_clipping=1.0,
                             offload_param_device="cpu")
    config = dict(plugin.deepspeed_config, train_micro_batch_size_per_gpu=1, train_batch_size=1)
    with pytest.warns(UserWarning, match=r"zero_optimization\.offload_param.*no effect"):
        parsed = DeepSpeedConfig(config)
    assert parsed.zero_optimization_stage == 2
