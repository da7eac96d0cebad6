"""DeepSpeed's public import paths that the foundation provides."""
import logging

import deepspeed_c
from deepspeed_c.ops.op_builder import ALL_OPS


def test_logger_is_a_logging_logger():
    from deepspeed_c.utils import logger

    assert isinstance(logger, logging.Logger)
    assert deepspeed_c.utils.logger is logger


def test_compatible_ops_maps_every_op_to_a_bool():
    import deepspeed_c.ops as ops

    compat = ops.__compatible_ops__
    assert set(compat) == set(ALL_OPS)
    assert all(isinstance(v, bool) for v in compat.values())
    for name, ok in compat.items():
        assert ok == ALL_OPS[name]().is_compatible()


def test_op_builder_import_path_and_version():
    from deepspeed_c.ops import op_builder

    assert op_builder.UtilsBuilder.NAME == "utils"
    assert isinstance(deepspeed_c.__version__, str)
    assert deepspeed_c.__version_major__ == int(deepspeed_c.__version__.split(".")[0])


def test_unknown_attribute_raises_attribute_error():
    import pytest

    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
        deepspeed_c.no_such_thing
