"""weights_only loading of checkpoint files with DeepSpeed's few pickled classes allow-listed.

DeepSpeed 0.19.8 pickles its LossScaler object, ZeroStageEnum and fragment_address records into its
ZeRO files; those load as stand-ins. Any other global in a file is refused before anything runs."""
from __future__ import annotations

import os

import pytest
import torch

from deepspeed_c.checkpoint import safe_load, store

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "deepspeed_written",
                       "z2_bf16_frozen_w2", "ckpt")


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_untrusted_pickle_is_refused_without_running(tmp_path) -> None:
    marker = str(tmp_path / "ran")
    torch.save({"module": {"w": torch.ones(2)}, "payload": _Evil(marker)}, str(tmp_path / "f.pt"))
    with pytest.raises(safe_load.UntrustedPickleError, match="weights_only"):
        store.load_file(str(tmp_path), "f.pt", None)
    assert not os.path.exists(marker)


def test_deepspeed_zero_file_loads_with_stand_ins() -> None:
    """DeepSpeed's ZeRO file: loss_scaler is an object with cur_scale, zero_stage an enum, slice
    mappings fragment_address(numel, start) per parameter."""
    sd = store.load_file(FIXTURE, "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", None)["optimizer_state_dict"]
    assert safe_load.scaler_state(sd["loss_scaler"]) == {"cur_scale": 1.0}
    assert int(sd["zero_stage"]) == 2
    mapping = sd["param_slice_mappings"][0]
    assert sum(a.numel for a in mapping.values()) == sd["single_partition_of_fp32_groups"][0].numel()


def test_config_with_enum_and_path_values_resumes(tmp_path) -> None:
    # DeepSpeed's own tests put OffloadDeviceEnum members (and scripts pathlib paths) in config dicts; the
    # checkpoint keeps the config as plain values, so our weights_only loader takes it back
    import pathlib

    import deepspeed_c
    from deepspeed_c.runtime.zero.offload_config import OffloadDeviceEnum

    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 1, "offload_optimizer": {"device": OffloadDeviceEnum.none,
                                                                  "nvme_path": pathlib.Path(tmp_path)}}}
    engine, *_ = deepspeed_c.initialize(model=torch.nn.Linear(2, 2), config=cfg)
    engine.save_checkpoint(str(tmp_path / "ck"), tag="t")
    path, _ = engine.load_checkpoint(str(tmp_path / "ck"), tag="t")
    assert path is not None
    saved = safe_load.load(str(tmp_path / "ck" / "t" / "mp_rank_00_model_states.pt"))["ds_config"]
    assert saved["zero_optimization"]["offload_optimizer"] == {"device": "none", "nvme_path": str(tmp_path)}
    engine.destroy()
