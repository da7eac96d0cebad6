"""DeepSpeed's objects written without DeepSpeed (deepspeed_c.checkpoint.ds_pickle): the fp16 dynamic
loss scaler, which the DeepSpeed-written fixtures (fp32/bf16: a static LossScaler) do not cover.

DeepSpeed 0.19.8's DynamicLossScaler.__init__ sets cur_scale, dynamic, cur_iter, last_overflow_iter,
scale_factor, scale_window, min_scale, delayed_shift, cur_hysteresis, consecutive_hysteresis,
raise_error_at_min_scale and dtype; its ZeRO loader takes the unpickled object as its scaler. Checked:
the record of a live deepspeed_c scaler holds exactly those attributes with the scaler's values, the
pickle names DeepSpeed's class path, deepspeed_c's weights_only loader reads it back equal, and a
scaler restored from it continues identically (the scale after overflows and clean steps)."""
from __future__ import annotations

import pickletools
import zipfile

import torch

from deepspeed_c.checkpoint import ds_pickle, safe_load, store
from deepspeed_c.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler


def _scaler() -> DynamicLossScaler:
    s = DynamicLossScaler(init_scale=2.0**16, scale_window=3, min_scale=1.0, delayed_shift=2,
                          consecutive_hysteresis=False)
    for overflow in (True, True, False, False, False, False, True):
        s.update_scale(overflow)
    return s


def _globals(path: str) -> set[str]:
    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    return {arg.replace(" ", ".") for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}


def test_dynamic_scaler_record_round_trip(tmp_path) -> None:
    live = _scaler()
    record = ds_pickle.loss_scaler_record(live)
    assert isinstance(record, safe_load.DynamicLossScalerStandIn)
    assert set(vars(record)) == set(ds_pickle.DYNAMIC_SCALER_ATTRS) == set(vars(live))
    assert all(getattr(record, k) == getattr(live, k) for k in vars(live))
    path = str(tmp_path / "f.pt")
    store.save_file({"optimizer_state_dict": {"loss_scaler": record, "zero_stage": ds_pickle.zero_stage_record(2)}},
                    path)
    assert {"deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
            "deepspeed.runtime.zero.config.ZeroStageEnum"} <= _globals(path)
    back = safe_load.load(path)["optimizer_state_dict"]
    assert back["loss_scaler"] == record and int(back["zero_stage"]) == 2
    restored = DynamicLossScaler(init_scale=2.0**16, scale_window=3, min_scale=1.0, delayed_shift=2,
                                 consecutive_hysteresis=False)
    restored.load_state_dict(back["loss_scaler"])
    for overflow in (False, False, False, True, True, False):
        live.update_scale(overflow)
        restored.update_scale(overflow)
        assert (restored.cur_scale, restored.cur_iter, restored.cur_hysteresis) == (
            live.cur_scale, live.cur_iter, live.cur_hysteresis)


def test_static_scaler_record_and_plain_files_keep_the_fast_pickler(tmp_path) -> None:
    record = ds_pickle.loss_scaler_record(LossScaler(scale=1.0))
    assert type(record) is safe_load.LossScalerStandIn and vars(record) == {"cur_scale": 1.0, "dynamic": False}
    assert vars(ds_pickle.loss_scaler_record(None)) == {"cur_scale": 1.0, "dynamic": False}  # fp32 ZeRO
    assert not ds_pickle.contains_stand_ins({"a": [torch.zeros(2), {"b": 1}]})
    assert ds_pickle.contains_stand_ins({"a": [{"b": record}]})
