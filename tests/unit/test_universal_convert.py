"""ds_to_universal on DeepSpeed-written checkpoints, and its and load_universal's bad input.

Tensor parallelism: DeepSpeed 0.19.8's TP 2 x DP 2 ZeRO-1 checkpoint of the tests' Megatron-style GPT
(tests/fixtures/deepspeed_megatron) with the client's universal_checkpoint_info patterns (what
Megatron-DeepSpeed saves) merges into whole parameters equal to the weights DeepSpeed itself loaded from
that checkpoint and gathered (`loaded_weights`): column-parallel shards joined on dim 0, row-parallel on
dim 1, replicated ones kept once; the vocabulary pattern trims padded rows."""
from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
import torch

from deepspeed_c.checkpoint import ds_pickle, safe_load
from deepspeed_c.checkpoint.ds_to_universal import main, parse_arguments

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
MEGATRON = os.path.join(FIXTURES, "deepspeed_megatron", "tp2_dp2_z1")
# the client's patterns: the position table, layer norms and the row-parallel layers' biases are replicated
REPLICATED = [r"pos$", r".*ln", r".*\.proj\.bias", r".*\.fc2\.bias"]
ROW = [r".*\.proj\.weight", r".*\.fc2\.weight"]


def _args(src: str, out: str, *extra: str) -> Any:
    return parse_arguments(["--input_folder", src, "--output_folder", out, "--num_extract_workers", "1",
                            "--num_merge_workers", "1", *extra])


def _with_info(tmp_path: Any, info: dict) -> str:
    src = str(tmp_path / "src")
    shutil.copytree(os.path.join(MEGATRON, "ckpt"), src)
    for name in ("mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"):
        path = os.path.join(src, name)
        state = safe_load.load(path)
        state["universal_checkpoint_info"] = info
        torch.save(state, path, **({"pickle_module": ds_pickle} if ds_pickle.contains_stand_ins(state) else {}))
    return src


def _param(out: str, name: str, state: str = "fp32") -> dict:
    return safe_load.load(os.path.join(out, "zero", name, f"{state}.pt"))


def test_tensor_parallel_merge_matches_deepspeed_loaded_weights(tmp_path: Any) -> None:
    info = {"universal_checkpoint_version": 0.4, "tp_replicated_parameter_patterns": REPLICATED,
            "parameter_with_row_parallelism_patterns": ROW}
    out = str(tmp_path / "out")
    main(_args(_with_info(tmp_path, info), out, "--num_merge_workers", "2"))  # a worker pool too
    want = torch.load(os.path.join(MEGATRON, "expected.pt"), weights_only=True)["loaded_weights"]
    for name, ref in want.items():
        rec = _param(out, name)
        assert rec["param"].shape == ref.shape, name
        torch.testing.assert_close(rec["param"], ref.to(rec["param"].dtype), rtol=0, atol=0, msg=name)
    assert _param(out, "blocks.0.fc2.weight")["cat_dim"] == 1 and _param(out, "blocks.0.fc1.weight")["cat_dim"] == 0
    assert _param(out, "blocks.0.qkv.weight", "exp_avg")["param"].shape == (48, 16)


def test_vocabulary_rows_are_trimmed(tmp_path: Any) -> None:
    info = {"tp_replicated_parameter_patterns": REPLICATED,
            "parameter_with_row_parallelism_patterns": ROW, "vocabulary_parameter_patterns": [r"embed\.weight"],
            "original_vocab_size": 30}
    out = str(tmp_path / "out")
    main(_args(_with_info(tmp_path, info), out))
    rec = _param(out, "embed.weight")
    assert rec["vocab_tensor"] is True and rec["param"].shape == (30, 16)


def test_pattern_matching_nothing_is_named(tmp_path: Any) -> None:
    info = {"tp_replicated_parameter_patterns": REPLICATED + [r"no_such_param"],
            "parameter_with_row_parallelism_patterns": ROW}
    src = _with_info(tmp_path, info)
    with pytest.raises(ValueError, match="no_such_param"):
        main(_args(src, str(tmp_path / "out")))
    main(_args(src, str(tmp_path / "out2"), "--no_strict"))  # a warning only


def test_checkpoint_without_universal_info_needs_the_flag(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="--inject_missing_state"):
        main(_args(os.path.join(MEGATRON, "ckpt"), str(tmp_path / "out")))


def test_non_zero_checkpoint_is_refused(tmp_path: Any) -> None:
    src = os.path.join(FIXTURES, "deepspeed_written", "z0_fp32_train_w1", "ckpt")
    with pytest.raises(FileNotFoundError, match="optim_states"):
        main(_args(src, str(tmp_path / "out"), "--inject_missing_state"))


def test_load_universal_checks() -> None:
    from deepspeed_c.runtime.checkpointing import universal_load

    with pytest.raises(universal_load.UniversalCheckpointError, match="ds_to_universal"):
        universal_load.check_folder(os.path.join(MEGATRON, "ckpt"))
    with pytest.raises(ValueError, match="latest_universal"):
        universal_load.read_latest(MEGATRON)


# -- DeepSpeedCheckpoint ---------------------------------------------------------------------------------
def test_deepspeed_checkpoint_reads_deepspeeds_layout() -> None:
    from deepspeed_c.checkpoint import DeepSpeedCheckpoint

    ckpt = DeepSpeedCheckpoint(os.path.join(MEGATRON, "ckpt"))
    assert (ckpt.tp_degree, ckpt.pp_degree, ckpt.dp_degree, ckpt.world_size) == (2, 1, 2, 4)
    assert ckpt.get_checkpoint_info("universal_checkpoint_info") is None
    shapes = safe_load.load(os.path.join(MEGATRON, "ckpt", "mp_rank_01_model_states.pt"))["param_shapes"]
    total = sum(s.numel() for group in shapes for s in group.values())
    held = sum(t.numel() for dp in range(2) for t in ckpt.get_zero_checkpoint_state(0, 1, dp)["optimizer_state_dict"][
        "single_partition_of_fp32_groups"])
    assert held == total  # the paddings stripped: the tp rank's parameters exactly
    with pytest.raises(NotImplementedError, match="ds_to_universal"):
        DeepSpeedCheckpoint(os.path.join(MEGATRON, "ckpt"), tp_degree=1)
    with pytest.raises(FileNotFoundError, match="pp 0, tp 2"):
        ckpt.get_zero_checkpoint_state(0, 2, 0)


# -- 3D: DeepSpeed's PP 2 x TP 2 pipeline checkpoint of the same GPT (issue 54's fixture) ------------------
PP3D = os.path.join(FIXTURES, "deepspeed_megatron", "pp3d_tp2")


def _gpt_name(name: str) -> str:
    """The pipeline layer name of the GPT's parameter: 0 the tied embedding, 1 the positions, 2.. the blocks,
    4 the final norm."""
    if name == "tied_modules.embed.weight":
        return "embed.weight"
    layer, rest = name.split(".", 1)
    return {"1": rest, "4": f"ln_f.{rest}"}.get(layer, f"blocks.{int(layer) - 2}.{rest}")


def test_pipeline_and_tensor_parallel_merge_matches_deepspeed_loaded_weights(tmp_path: Any) -> None:
    src = str(tmp_path / "src")
    shutil.copytree(os.path.join(PP3D, "ckpt"), src)
    info = {"tp_replicated_parameter_patterns": [r"1\.pos$", r"\d+\.ln", r"4\.(weight|bias)$", r".*\.proj\.bias",
                                                 r".*\.fc2\.bias"],
            "parameter_with_row_parallelism_patterns": ROW,
            "pipeline_replicated_parameter_patterns": [r"tied_modules\.embed\.weight"]}
    for mp in range(4):
        path = os.path.join(src, f"mp_rank_{mp:02d}_model_states.pt")
        state = safe_load.load(path)
        state["universal_checkpoint_info"] = info
        torch.save(state, path, **({"pickle_module": ds_pickle} if ds_pickle.contains_stand_ins(state) else {}))
    out = str(tmp_path / "out")
    main(_args(src, out))
    want = torch.load(os.path.join(PP3D, "expected.pt"), weights_only=True)["loaded_weights"]
    names = sorted(d for d in os.listdir(os.path.join(out, "zero")) if d != "optimizer_state.pt")
    assert sorted(_gpt_name(n) for n in names) == sorted(want)
    for name in names:
        ref = want[_gpt_name(name)]
        got = _param(out, name)["param"]
        assert got.shape == ref.shape, name
        torch.testing.assert_close(got, ref.to(got.dtype), rtol=0, atol=0, msg=name)


def test_command_line_with_worker_processes(tmp_path: Any) -> None:
    """`python -m deepspeed_c.checkpoint.ds_to_universal` with DeepSpeed's default worker counts (4 extract,
    2 merge processes) writes what the in-process conversion writes."""
    import subprocess
    import sys

    src = os.path.join(FIXTURES, "deepspeed_written", "z2_fp32_train_w2", "ckpt")
    cli, serial = str(tmp_path / "cli" / "u"), str(tmp_path / "serial" / "u")
    run = subprocess.run([sys.executable, "-m", "deepspeed_c.checkpoint.ds_to_universal", "--input_folder", src,
                          "--output_folder", cli, "--inject_missing_state"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    main(_args(src, serial, "--inject_missing_state"))
    with open(os.path.join(tmp_path, "cli", "latest_universal")) as f:
        assert f.read() == "u"
    for name in sorted(os.listdir(os.path.join(serial, "zero"))):
        if name == "optimizer_state.pt":
            continue
        for f in os.listdir(os.path.join(serial, "zero", name)):
            a = safe_load.load(os.path.join(cli, "zero", name, f))
            b = safe_load.load(os.path.join(serial, "zero", name, f))
            a, b = (a["param"], b["param"]) if isinstance(a, dict) else (a, b)
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), (name, f)


def test_bad_worker_count_is_named(tmp_path: Any) -> None:
    with pytest.raises(SystemExit):
        parse_arguments(["--input_folder", "x", "--output_folder", "y", "--num_merge_workers", "0"])


# -- ZeROCheckpoint and the reshape helpers (deepspeed.checkpoint's) --------------------------------------------
def test_zero_checkpoint_merges_dp_ranks_of_deepspeeds_checkpoint(tmp_path: Any) -> None:
    from deepspeed_c.checkpoint import ZeROCheckpoint, get_model_3d_descriptor, model_3d_desc

    ckpt = os.path.join(MEGATRON, "ckpt")
    src = get_model_3d_descriptor(ckpt)
    assert (src.pp_degree, src.tp_degree, src.dp_degree) == (1, 2, 2)
    zc = ZeROCheckpoint(ckpt)
    assert (zc.get_src_tp_degree(), zc.get_src_dp_degree(), zc.get_src_world_size()) == (2, 2, 4)
    # the file list is in (dp, mp) order: index = dp * tp + tp_index
    assert [os.path.basename(f)[:25] for f in zc.file_list] == [
        f"zero_pp_rank_{dp}_mp_rank_0{mp}" for dp in range(2) for mp in range(2)]
    assert zc.get_files_for_rank(0, 1, 1) == [zc.file_list[3]]
    zc.reshape(model_3d_desc(pp_degree=1, tp_degree=2, dp_degree=1))
    assert zc.get_file_indices_for_rank(0, 1, 0) == [1, 3]
    for tp in range(2):
        merged = zc.get_state_for_rank(0, tp, 0)["optimizer_state_dict"]
        parts = [safe_load.load(os.path.join(ckpt, f"zero_pp_rank_{dp}_mp_rank_0{tp}_optim_states.pt"))
                 ["optimizer_state_dict"] for dp in range(2)]
        for g, m in enumerate(merged["single_partition_of_fp32_groups"]):
            # reference: each dp rank's partition without its padding, concatenated in dp order
            want = torch.cat([p["single_partition_of_fp32_groups"][g][:p["single_partition_of_fp32_groups"][g].numel()
                                                                       - p["group_paddings"][g]] for p in parts])
            assert torch.equal(m, want)
            moments = [p["base_optimizer_state"]["state"][g]["exp_avg"] for p in parts]
            assert torch.equal(merged["base_optimizer_state"]["state"][g]["exp_avg"], torch.cat(
                [m[:m.numel() - p["group_paddings"][g]] for m, p in zip(moments, parts)]))
        assert merged["partition_count"] == [1] * len(merged["partition_count"])
        assert merged["group_paddings"] == [0] * len(merged["group_paddings"])
    with pytest.raises(AssertionError, match="Expansion reshape not supported - DP"):
        zc.reshape(model_3d_desc(1, 2, 4))
    with pytest.raises(AssertionError, match="No ZeRO files"):
        ZeROCheckpoint(str(tmp_path))


def test_reshape_maps_match_a_rank_enumeration() -> None:
    """model_3d_desc.reshape against a brute-force reference: source rank r = dp * (pp*tp) + pp * tp_deg + tp;
    a target cell takes, pp-major then tp, dp-major in consecutive runs, the source ranks whose cells contract
    onto it."""
    from deepspeed_c.checkpoint import model_3d_desc, reshape_meg_2d_parallel
    from deepspeed_c.checkpoint.reshape_meg_2d import get_mpu_ranks

    src, tgt = model_3d_desc(2, 2, 2), model_3d_desc(1, 1, 1)
    assert src.reshape(tgt)[0].get_data(0, 0) == [0, 4, 1, 5, 2, 6, 3, 7]
    maps = src.reshape(model_3d_desc(2, 1, 1))
    assert maps[0].get_data(0, 0) == [0, 4, 1, 5] and maps[0].get_data(1, 0) == [2, 6, 3, 7]
    grid = reshape_meg_2d_parallel(old_pp_degree=4, old_tp_degree=2, new_pp_degree=2, new_tp_degree=1)
    assert grid.get_data(0, 0) == [0, 1, 2, 3] and grid.get_data(1, 0) == [4, 5, 6, 7]
    assert src.can_reshape(model_3d_desc(4, 1, 1)) == (False, ["Expansion reshape not supported - PP: 2 ---> 4"])
    assert src.is_valid(1, 2, 0) == (False, ["TP indexing error: index 2 >= degree 2"])
    tp, pp, dp = get_mpu_ranks(tp_size=2, pp_size=4, dp_size=2)  # Megatron's 16-GPU example
    assert dp == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert pp == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    assert tp[:2] == [[0, 1], [2, 3]] and len(tp) == 8


def test_zero_checkpoint_strips_each_ranks_padding_before_merging(tmp_path: Any) -> None:
    from deepspeed_c.checkpoint import ZeROCheckpoint, model_3d_desc

    torch.save({"checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1}},
               tmp_path / "mp_rank_00_model_states.pt")
    parts = [torch.arange(6.0), torch.arange(10.0, 16.0)]
    for dp, pad in enumerate((0, 2)):  # the last rank's partition ends in 2 padding elements
        osd = {"group_paddings": [pad], "partition_count": [2], "single_partition_of_fp32_groups": [parts[dp]],
               "base_optimizer_state": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": parts[dp] * 2}}}}
        torch.save({"optimizer_state_dict": osd}, tmp_path / f"zero_pp_rank_{dp}_mp_rank_00_optim_states.pt")
    zc = ZeROCheckpoint(str(tmp_path))
    zc.reshape(model_3d_desc(1, 1, 1))
    osd = zc.get_state_for_rank(0, 0, 0)["optimizer_state_dict"]
    state = osd["base_optimizer_state"]["state"][0]
    assert torch.equal(state["exp_avg"], torch.cat([parts[0], parts[1][:4]]) * 2) and state["step"].item() == 3
    assert osd["partition_count"] == [1] and osd["group_paddings"] == [0]
    # as DeepSpeed's: the fp32 partitions are concatenated whole (their padding is the consumer's to drop)
    assert torch.equal(osd["single_partition_of_fp32_groups"][0], torch.cat(parts))
    whole = zc.get_state_for_rank(0, 0, 0, strip_tensor_paddings=False)["optimizer_state_dict"]
    assert torch.equal(whole["base_optimizer_state"]["state"][0]["exp_avg"], torch.cat(parts) * 2)


def test_merge_state_and_zero_file_order(tmp_path: Any) -> None:
    from collections import OrderedDict

    from deepspeed_c.checkpoint import merge_state
    from deepspeed_c.checkpoint.reshape_utils import get_zero_files, partition_data

    a = OrderedDict(w=torch.ones(2), n=[torch.zeros(1), 3], s="x")
    b = OrderedDict(w=torch.full((1,), 2.0), n=[torch.ones(1), 4], extra=5)
    out = merge_state(a, b)
    assert list(out) == ["w", "n", "extra"] and isinstance(out, OrderedDict)
    assert torch.equal(out["w"], torch.tensor([1.0, 1.0, 2.0])) and out["n"][1] == 3 and out["extra"] == 5
    with pytest.raises(ValueError, match="at n"):
        merge_state({"n": [1, 2]}, {"n": [1]})
    with pytest.raises(ValueError, match="types"):
        merge_state(torch.ones(1), 1.0)
    assert partition_data(list(range(6)), 3) == [[0, 1], [2, 3], [4, 5]]
    for dp in (10, 9, 0):  # ranks read as numbers; a ZeRO-3 folder's model-states files are not ZeRO files
        (tmp_path / f"bf16_zero_pp_rank_{dp}_mp_rank_00_optim_states.pt").write_bytes(b"")
        (tmp_path / f"zero_pp_rank_{dp}_mp_rank_00_model_states.pt").write_bytes(b"")
    assert [os.path.basename(f)[18:20] for f in get_zero_files(str(tmp_path))] == ["0_", "9_", "10"]
