"""Hugging Face's ZeRO-3 paths, run as users run them: the alias distribution (compat/deepspeed) installed,
2 CPU ranks on gloo started by its `deepspeed` command, a stage-3 config with
stage3_param_persistence_threshold 0 (every parameter really partitioned). Script: hf_zero3_script.py.

- `HfDeepSpeedConfig(cfg)` kept alive + `AutoModelForCausalLM.from_pretrained(dir)` of a small GPT-2 saved
  with save_pretrained builds it under zero.Init and loads it through transformers'
  `_load_state_dict_into_zero3_model` (GatheredParameters(modifier_rank=0), rank 0 copying): placeholders
  with DeepSpeed's ds_* attributes, each rank holding half the elements, and gathered values equal to a
  plain from_pretrained's, bit for bit;
- `from_config` under ZeRO-3 (transformers' initialize_weights_zero3: rank 0 initializes, inside
  GatheredParameters(modifier_rank=0)) gives every rank the same, properly initialized model;
- `resize_token_embeddings` (GatheredParameters around the copy, the new embedding a plain parameter, as
  with DeepSpeed) keeps the old rows and the tie; `deepspeed.initialize` partitions the new embedding
  with rank 0's values (the added rows were drawn on each rank);
- the Trainer with `--deepspeed` stage 3 on that from_pretrained model: losses, eval loss and final weights
  equal the plain Trainer's (one process, global batch) within fp32 rounding (1e-5 norm-wise relative per
  tensor, the attention bias's key third excepted as in test_hf_trainer.py); `trainer.save_model` writes
  the consolidated weights (stage3_gather_16bit_weights_on_model_save, through accelerate's get_state_dict
  and engine._zero3_consolidated_16bit_state_dict), which a plain from_pretrained loads back equal to the
  live model's gathered weights.
The Trainer runs with `--save_strategy no`: engine.save_checkpoint at stage 3 does not write DeepSpeed's
stage-3 layout yet (its module states hold the placeholders; zero_to_fp32 refuses the directory)."""
from __future__ import annotations

import json
import pathlib
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is in requirements-lock.txt; install it to run this test")
pytest.importorskip("accelerate", reason="accelerate is in requirements-lock.txt; install it to run this test")
from safetensors.torch import load_file  # noqa: E402

from tests.distributed.hf_launch import run_user_command  # noqa: E402
from tests.harness import free_port  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "distributed" / "hf_zero3_script.py"
VOCAB, HIDDEN = 100, 64
COMMON = ["--max_steps", "8", "--learning_rate", "1e-3", "--weight_decay", "0.0", "--max_grad_norm", "0.5",
          "--lr_scheduler_type", "constant", "--seed", "42", "--report_to", "none", "--use_cpu",
          "--save_strategy", "no", "--logging_steps", "1"]
# the Trainer's config: "auto" values filled in by transformers
DS_TRAIN = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": 0,
                          "stage3_gather_16bit_weights_on_model_save": True},
    "steps_per_print": 2000, "wall_clock_breakdown": False,
}
# the config HfDeepSpeedConfig holds while loading (also the one the load script initializes an engine with)
DS_LOAD = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "fp16": {"enabled": False},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "steps_per_print": 2000}
_run = run_user_command


@pytest.fixture(scope="module")
def work(compat_alias, tmp_path_factory) -> pathlib.Path:
    alias = compat_alias
    work = tmp_path_factory.mktemp("hfz3")
    (work / "ds_train.json").write_text(json.dumps(DS_TRAIN))
    (work / "ds_load.json").write_text(json.dumps(DS_LOAD))

    def launcher() -> list[str]:
        return [str(alias / "bin" / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), str(SCRIPT)]

    # the model, then the plain reference Trainer on it, in one process (one interpreter start and import less)
    _run([sys.executable, str(SCRIPT), "make", "model", "train", "model", "--output_dir", "ref",
          "--per_device_train_batch_size", "8", *COMMON], alias, work)
    train = ["train", "model", "--deepspeed", "ds_train.json", "--per_device_train_batch_size", "4", *COMMON,
             "--save_strategy", "steps", "--save_steps", "4"]
    # the loads, then the ZeRO-3 Trainer, in the same 2 ranks (a launch less); the resumed run in fresh ones
    _run([*launcher(), "load", "model", "load", "ds_load.json", *train, "--output_dir", "ds"], alias, work)
    _run([*launcher(), *train, "--output_dir", "resumed", "--resume_from_checkpoint", "ds/checkpoint-4"], alias, work)
    return work


@pytest.fixture(scope="module")
def reports(work) -> list[dict]:
    return [json.loads((work / f"load.rank{r}.json").read_text()) for r in range(2)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def test_from_pretrained_loads_partitioned(reports):
    full = reports[0]["plain_total"]
    for rep in reports:
        assert rep["world"] == 2
        assert rep["full_total"] == full
        for name, p in rep["params"].items():
            assert p["numel"] == 0 and p["has_ds_id"], name  # a placeholder with DeepSpeed's attributes
            assert p["ds_numel"] == int(torch.Size(p["ds_shape"]).numel()) and p["gathered_shape"] == p["ds_shape"]
            assert p["status"] == "NOT_AVAILABLE" and p["status_after"] == "NOT_AVAILABLE", name
            assert p["gathered_status"] == "AVAILABLE", name
            assert p["equal_to_plain"], name  # bit-exact with the plain from_pretrained
        assert rep["all_equal_at_once"] and rep["not_available"]
        # each rank holds about half the elements (a bucket's chunks are equal; padding is not counted)
        assert abs(rep["shard_total"] - full / 2) <= 0.01 * full, (rep["shard_total"], full)
    assert sum(rep["shard_total"] for rep in reports) == full  # each element on exactly one rank


def test_from_config_initializes_once_for_every_rank(reports):
    a, b = reports[0]["from_config"], reports[1]["from_config"]
    assert a["partitioned"] and b["partitioned"]
    assert a["checksum"] == b["checksum"]
    assert a["ln_weights_one"] and a["biases_zero"]
    assert 0.015 < a["wte_std"] < 0.025  # initializer_range 0.02: initialized, not left empty or zero


def test_resize_token_embeddings_keeps_old_rows(reports):
    new = VOCAB + 28
    for rep in reports:
        r = rep["resize"]
        assert r["shape"] == [new, HIDDEN] and r["num_embeddings"] == new and r["config_vocab"] == new
        assert r["head_tied"] and r["head_shape"] == [new, HIDDEN]
        assert r["old_rows_equal"] and r["new_rows_finite"]
        assert r["partitioned_after_initialize"] and r["old_rows_equal_after_initialize"]
        assert r["logits_shape"] == [2, 8, new]
        assert r["leaf_modules"] == 2  # deepspeed.utils.set_z3_leaf_modules flagged both MLPs
        # initialize partitioned rank 0's values of the new (plain) embedding on every rank
        assert r["checksum_after_initialize"] == reports[0]["resize"]["checksum_before_initialize"]


def test_zero3_trainer_matches_plain_trainer(work):
    ds_log = json.loads((work / "ds" / "losses.json").read_text())
    ref_log = json.loads((work / "ref" / "losses.json").read_text())
    assert ds_log["partitioned_at_load"] and not ref_log["partitioned_at_load"]
    assert len(ds_log["losses"]) == len(ref_log["losses"]) == 8
    for a, b in zip(ds_log["losses"], ref_log["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (ds_log["losses"], ref_log["losses"])
    assert abs(ds_log["eval_loss"] - ref_log["eval_loss"]) <= 1e-5 * abs(ref_log["eval_loss"])
    ds = torch.load(work / "ds" / "live.pt")
    ref = torch.load(work / "ref" / "live.pt")
    assert set(ds) == set(ref)
    for k in ref:
        a, b = ds[k], ref[k]
        if k.endswith("attn.c_attn.bias"):
            # the key third of this bias has a gradient that is zero in exact arithmetic (softmax ignores a
            # shift shared by all keys), so Adam turns rounding noise into +-lr steps there
            q, _, v = a.chunk(3)
            qr, _, vr = b.chunk(3)
            assert _rel(q, qr) < 1e-5 and _rel(v, vr) < 1e-5, (k, _rel(q, qr), _rel(v, vr))
            continue
        assert _rel(a, b) < 1e-5, (k, _rel(a, b))
    init = load_file(str(work / "model" / "model.safetensors"))
    assert any(not torch.equal(init[k], ds[k]) for k in init)  # it trained


def test_save_model_writes_consolidated_weights(work):
    from transformers import GPT2LMHeadModel

    saved = load_file(str(work / "ds" / "final" / "model.safetensors"))
    live = torch.load(work / "ds" / "live.pt")
    assert all(t.numel() > 0 for t in saved.values())  # real weights, not the placeholders
    model = GPT2LMHeadModel.from_pretrained(str(work / "ds" / "final"))
    params = dict(model.named_parameters())
    assert set(params) == set(live)
    for k, p in params.items():
        assert torch.equal(p.detach(), live[k]), k
    assert model.lm_head.weight is model.transformer.wte.weight


def test_z3_leaf_modules_api():
    # accelerate's set_moe_leaf_modules: deepspeed.utils.set_z3_leaf_modules(model, [classes])
    from deepspeed_c.utils import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module

    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert set_z3_leaf_modules(m, [torch.nn.Linear]) == [m[0], m[2][0]]
    assert get_z3_leaf_modules(m) == [m[0], m[2][0]] and z3_leaf_module(m[0]) and not z3_leaf_module(m[1])
    assert unset_z3_leaf_modules(m, ["Linear"]) == [m[0], m[2][0]] and get_z3_leaf_modules(m) == []
    with pytest.raises(ValueError, match="No modules of type"):
        set_z3_leaf_modules(m, [torch.nn.Conv1d])
    assert set_z3_leaf_modules(m, [torch.nn.Conv1d], raise_if_not_found=False) == []
    with pytest.raises(TypeError, match="leaf_module_classes"):
        set_z3_leaf_modules(m, [3])


def test_tensor_constructor_wrapper_names():
    # transformers' prevent_arange_dtype_change swaps pp.zero_wrapper_for_fp_tensor_constructor around
    # zero.Init and compares with pp._orig_torch_arange
    from deepspeed_c.runtime.zero import partition_parameters as pp

    assert pp._orig_torch_arange is torch.arange
    ones = pp.zero_wrapper_for_fp_tensor_constructor(torch.ones, torch.bfloat16, "cpu")
    assert ones(3).dtype == torch.bfloat16 and ones(3).device.type == "cpu"
    arange = pp.zero_wrapper_for_fp_tensor_constructor(torch.arange, torch.bfloat16, "cpu")
    assert arange(4).dtype == torch.int64  # only floating-point results change dtype


def test_trainer_checkpoint_resumes_exactly_at_stage3(work):
    """--save_strategy steps writes DeepSpeed's stage-3 layout; --resume_from_checkpoint at step 4 ends
    bit-equal to the straight run, and zero_to_fp32 recovers the step-4 weights."""
    from deepspeed_c.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    step_dir = work / "ds" / "checkpoint-4"
    tag = (step_dir / "latest").read_text().strip()
    names = sorted(p.name for p in (step_dir / tag).iterdir())
    assert "zero_pp_rank_0_mp_rank_00_model_states.pt" in names and "zero_pp_rank_1_mp_rank_00_model_states.pt" in names
    assert "mp_rank_00_model_states.pt" not in names
    straight = torch.load(work / "ds" / "live.pt")
    resumed = torch.load(work / "resumed" / "live.pt")
    assert set(straight) == set(resumed)
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k
    a = json.loads((work / "ds" / "losses.json").read_text())["losses"]
    b = json.loads((work / "resumed" / "losses.json").read_text())["losses"]
    # the resumed run carries steps 1-4 over from the checkpoint's trainer state and computes 5-8 anew
    assert len(a) == 8 and b == a, (a, b)
    sd = get_fp32_state_dict_from_zero_checkpoint(str(step_dir))
    assert set(sd) >= {k for k in straight if not k.startswith("lm_head")}
    assert all(t.numel() > 0 and torch.isfinite(t).all() for t in sd.values())
