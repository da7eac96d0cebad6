"""The `aio` section: DeepSpeed 0.19.8's keys and defaults (read from its constants module when
the real DeepSpeed is importable), dict-style lookups, the legacy thread_count name."""
from __future__ import annotations

import warnings

import pytest

from deepspeed_c.runtime.config import DeepSpeedConfig
from deepspeed_c.runtime.swap_tensor import constants as C

BASE = {"train_batch_size": 2}


def test_defaults_and_keys_match_deepspeed():
    cfg = DeepSpeedConfig(dict(BASE)).aio_config
    expected = {C.AIO_BLOCK_SIZE: 1048576, C.AIO_QUEUE_DEPTH: 8, C.AIO_INTRA_OP_PARALLELISM: 1,
                C.AIO_SINGLE_SUBMIT: False, C.AIO_OVERLAP_EVENTS: True, C.AIO_USE_GDS: False}
    assert {k: cfg[k] for k in expected} == expected
    try:  # the real DeepSpeed's defaults, when it can be imported here
        import importlib

        real = importlib.import_module("deepspeed.runtime.swap_tensor.aio_config").AIO_DEFAULT_DICT
    except Exception:
        real = None
    if real is not None and not getattr(importlib.import_module("deepspeed"), "__name__", "").startswith("deepspeed_c"):
        assert {k: cfg[k] for k in real} == real


def test_values_aliases_and_errors():
    cfg = DeepSpeedConfig({**BASE, "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 4,
                                           "single_submit": True, "overlap_events": False}}).aio_config
    assert cfg.handle_kwargs() == {"block_size": 262144, "queue_depth": 32, "single_submit": True,
                                   "overlap_events": False, "intra_op_parallelism": 4}
    assert cfg["thread_count"] == 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="queue_dept.*queue_depth"):
            DeepSpeedConfig({**BASE, "aio": {"queue_dept": 4}})
        with pytest.raises(ValueError, match="aio.intra_op_parallelism|aio.thread_count"):
            DeepSpeedConfig({**BASE, "aio": {"intra_op_parallelism": 0}})
