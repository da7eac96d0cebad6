"""The Hugging Face Trainer through its `--deepspeed ds_config.json` path, launched by the `deepspeed`
command of the opt-in alias distribution (compat/deepspeed), 2 CPU ranks on gloo, ZeRO stage 2 with
"auto" values filled in by transformers:
- the final weights match the same Trainer script without DeepSpeed on one process with the global
  batch (HF's own torch AdamW, same clipping, constant LR): 1e-5 norm-wise relative per tensor
  (weight decay 0: with a DeepSpeed optimizer HF hands every parameter to it, so biases and norms
  would decay too, unlike HF's own optimizer groups);
- the checkpoints the Trainer saves have DeepSpeed's layout (global_stepN/, `latest`, zero_to_fp32.py
  at the top), and zero_to_fp32 recovers exactly the weights the Trainer saved; the copied
  zero_to_torch.py writes them cast to bf16;
- `--resume_from_checkpoint` continues bit-exactly: resumed at step 4, step 8 equals the straight run;
- AutoTP (`tensor_parallel.autotp_size` 2, ZeRO 1) through the same Trainer path equals the plain Trainer.
Without a GPU, accelerate needs `--use_cpu` to run several processes (its rule, not ours)."""
from __future__ import annotations

import json
import pathlib
import runpy
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is in requirements-lock.txt; install it to run this test")
pytest.importorskip("accelerate", reason="accelerate is in requirements-lock.txt; install it to run this test")
from safetensors.torch import load_file  # noqa: E402

from tests.distributed.hf_launch import run_user_command  # noqa: E402
from tests.harness import free_port  # noqa: E402

from deepspeed_c.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "distributed" / "hf_train_script.py"
COMMON = ["--max_steps", "8", "--learning_rate", "1e-3", "--weight_decay", "0.0", "--max_grad_norm", "0.5",
          "--lr_scheduler_type", "constant", "--seed", "42", "--report_to", "none", "--use_cpu",
          "--save_strategy", "steps", "--save_steps", "4", "--logging_steps", "1"]
DS_CONFIG = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                          "reduce_bucket_size": "auto", "allgather_bucket_size": 2e8},
    "steps_per_print": 2000, "wall_clock_breakdown": False,
}


@pytest.fixture(scope="module")
def alias(compat_alias) -> pathlib.Path:
    return compat_alias


_run = run_user_command


@pytest.fixture(scope="module")
def runs(alias, tmp_path_factory) -> dict[str, pathlib.Path]:
    work = tmp_path_factory.mktemp("hf")
    (work / "ds_config.json").write_text(json.dumps(DS_CONFIG))
    def launcher() -> list[str]:  # a free port each: the default (29500) may be taken by a job running beside
        return [str(alias / "bin" / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), str(SCRIPT),
                "--deepspeed", "ds_config.json", "--per_device_train_batch_size", "4"]

    _run([sys.executable, str(SCRIPT), "--output_dir", "ref", "--per_device_train_batch_size", "8", *COMMON],
         alias, work)
    _run([*launcher(), "--output_dir", "ds", *COMMON], alias, work)
    _run([*launcher(), "--output_dir", "resumed", "--resume_from_checkpoint", "ds/checkpoint-4", *COMMON], alias, work)
    return {name: work / name for name in ("ref", "ds", "resumed")}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def test_zero2_trainer_matches_plain_trainer(runs):
    ds = load_file(str(runs["ds"] / "final" / "model.safetensors"))
    ref = load_file(str(runs["ref"] / "final" / "model.safetensors"))
    # DeepSpeed's clone_tensors_for_torch_save unties tied weights, so the tied lm_head is saved too
    assert set(ref) <= set(ds) and set(ds) - set(ref) <= {"lm_head.weight"}
    if "lm_head.weight" in ds:
        assert torch.equal(ds["lm_head.weight"], ds["transformer.wte.weight"])
    for k in ref:
        a, b = ds[k], ref[k]
        if k.endswith("attn.c_attn.bias"):
            # the key third of this bias has a gradient that is zero in exact arithmetic (softmax ignores a
            # shift shared by all keys), so Adam turns rounding noise into +-lr steps there: compare the
            # query and value thirds, each on its own
            q, _, v = a.chunk(3)
            qr, _, vr = b.chunk(3)
            assert _rel(q, qr) < 1e-5 and _rel(v, vr) < 1e-5, (k, _rel(q, qr), _rel(v, vr))
            continue
        assert _rel(a, b) < 1e-5, (k, _rel(a, b))
    # it trained: the weights moved (compared with the step-4 checkpoint's)
    init = load_file(str(runs["ds"] / "checkpoint-4" / "model.safetensors"))
    assert any(not torch.equal(init[k], ds[k]) for k in ds)


def test_trainer_checkpoints_have_deepspeed_layout(runs):
    ckpt = runs["ds"] / "checkpoint-8"
    assert (ckpt / "latest").read_text().strip() == "global_step8"
    tag = ckpt / "global_step8"
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                 "zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        assert (tag / name).is_file(), name
    assert (ckpt / "zero_to_fp32.py").is_file()
    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    saved = load_file(str(runs["ds"] / "final" / "model.safetensors"))
    for k, v in saved.items():
        assert torch.equal(fp32[k], v), k


def test_copied_zero_to_torch_writes_cast_weights(runs, tmp_path, monkeypatch):
    """DeepSpeed 0.19.8 also copies zero_to_torch.py (a --dtype converter importing its sibling
    zero_to_fp32.py) into the checkpoint; run there as a script, bf16 out equals the Trainer's saved
    weights cast by torch."""
    ckpt = runs["ds"] / "checkpoint-8"
    monkeypatch.syspath_prepend(str(ckpt))  # what `python zero_to_torch.py` gives the script
    monkeypatch.setattr(sys, "argv", ["zero_to_torch.py", str(ckpt), str(tmp_path), "--dtype", "bf16",
                                      "--safe_serialization"])
    try:
        runpy.run_path(str(ckpt / "zero_to_torch.py"), run_name="__main__")
    finally:
        sys.modules.pop("zero_to_fp32", None)
    out = load_file(str(tmp_path / "model.safetensors"))
    for k, v in load_file(str(runs["ds"] / "final" / "model.safetensors")).items():
        assert out[k].dtype == torch.bfloat16 and torch.equal(out[k], v.to(torch.bfloat16)), k
    with pytest.raises(ValueError, match="dtype 'int8'"):
        from deepspeed_c.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict
        convert_zero_checkpoint_to_state_dict(str(ckpt), str(tmp_path), dtype="int8")


def test_resume_from_checkpoint_is_exact(runs):
    straight = load_file(str(runs["ds"] / "final" / "model.safetensors"))
    resumed = load_file(str(runs["resumed"] / "final" / "model.safetensors"))
    for k in straight:
        assert torch.equal(resumed[k], straight[k]), (k, _rel(resumed[k], straight[k]))
    state = json.loads((runs["resumed"] / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["global_step"] == 8


@pytest.fixture(scope="module")
def tp_runs(alias, tmp_path_factory) -> dict[str, pathlib.Path]:
    """AutoTP through the Trainer: the same config with tensor_parallel.autotp_size 2 on the 2 ranks (one
    data-parallel rank: accelerate hands both tensor-parallel ranks the same batches); accelerate needs
    stage3_gather_16bit_weights_on_model_save to save a tensor-parallel model. Reference: the plain Trainer on
    one process with the same global batch (4)."""
    work = tmp_path_factory.mktemp("hf_tp")
    cfg = dict(DS_CONFIG, tensor_parallel={"autotp_size": 2},
               zero_optimization=dict(DS_CONFIG["zero_optimization"], stage=1,
                                      stage3_gather_16bit_weights_on_model_save=True))
    (work / "ds_tp.json").write_text(json.dumps(cfg))
    _run([sys.executable, str(SCRIPT), "--output_dir", "ref", "--per_device_train_batch_size", "4", *COMMON],
         alias, work)
    _run([str(alias / "bin" / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), str(SCRIPT),
          "--deepspeed", "ds_tp.json", "--per_device_train_batch_size", "4", "--output_dir", "tp", *COMMON], alias, work)
    return {name: work / name for name in ("ref", "tp")}


def test_autotp_trainer_matches_plain_trainer(tp_runs):
    """The Trainer's 'auto' train_batch_size counts every rank (DeepSpeed's arithmetic under AutoTP), its
    optimizer steps the shards AutoTP puts in place, and save_model writes the whole weights (accelerate calls
    engine._consolidated_16bit_state_dict): the final weights equal the plain Trainer's within 1e-4 (the
    row-parallel layers sum partial products in another order, and Adam's normalised steps carry that rounding
    into every weight: observed up to 1.1e-5 after 8 steps, as test_tp_autotp's tolerance)."""
    tp = load_file(str(tp_runs["tp"] / "final" / "model.safetensors"))
    ref = load_file(str(tp_runs["ref"] / "final" / "model.safetensors"))
    assert set(ref) <= set(tp) and set(tp) - set(ref) <= {"lm_head.weight"}
    for k in ref:
        a, b = tp[k], ref[k]
        assert a.shape == b.shape, (k, tuple(a.shape), tuple(b.shape))
        if k.endswith("attn.c_attn.bias"):  # its key third: see test_zero2_trainer_matches_plain_trainer
            (q, _, v), (qr, _, vr) = a.chunk(3), b.chunk(3)
            assert _rel(q, qr) < 1e-4 and _rel(v, vr) < 1e-4, (k, _rel(q, qr), _rel(v, vr))
            continue
        assert _rel(a, b) < 1e-4, (k, _rel(a, b))
    init = load_file(str(tp_runs["tp"] / "checkpoint-4" / "model.safetensors"))
    assert any(not torch.equal(init[k], tp[k]) for k in tp)  # it trained past the step-4 checkpoint
    assert (tp_runs["tp"] / "checkpoint-8" / "global_step8" / "mp_rank_00_model_states.pt").is_file()


SP_SCRIPT = ROOT / "tests" / "distributed" / "hf_sp_script.py"
SP_COMMON = ["--max_steps", "6", "--learning_rate", "1e-3", "--weight_decay", "0.0", "--max_grad_norm", "0",
             "--lr_scheduler_type", "constant", "--seed", "42", "--report_to", "none", "--use_cpu",
             "--save_strategy", "no", "--logging_steps", "1", "--per_device_train_batch_size", "2"]


def test_alst_trainer_matches_plain_trainer(alias, tmp_path):
    """ALST/Ulysses through accelerate's ParallelismConfig(sp_backend="deepspeed", sp_size=2) on 2 ranks (one
    data-parallel rank): every step's loss equals the plain Trainer's on one process (the same batches, the whole
    sequences) within 1e-4 relative. (Each rank's loss is the whole sequence's, aggregated by the Trainer's
    differentiable all_gather; with DeepSpeed's reduction (summed over the sequence-parallel ranks) the
    gradients come out sp_size times the single-process ones, as with DeepSpeed itself; Adam's updates do not
    see that scale beyond its eps.)"""
    (tmp_path / "ds.json").write_text(json.dumps(dict(DS_CONFIG, zero_optimization={"stage": 2})))
    _run([sys.executable, str(SP_SCRIPT), "--output_dir", "ref", *SP_COMMON], alias, tmp_path)
    _run([str(alias / "bin" / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), str(SP_SCRIPT),
          "--sp_size", "2", "--deepspeed", "ds.json", "--output_dir", "sp", *SP_COMMON], alias, tmp_path)
    ref = json.loads((tmp_path / "ref" / "losses.json").read_text())
    sp = json.loads((tmp_path / "sp" / "losses.json").read_text())
    assert len(ref) == len(sp) == 6, (ref, sp)
    assert ref[0] != ref[-1]  # it trained
    for i, (a, b) in enumerate(zip(sp, ref)):
        assert abs(a - b) <= 1e-4 * abs(b), (i, sp, ref)
