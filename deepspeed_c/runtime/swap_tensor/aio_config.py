"""The typed `aio` section. DeepSpeed's config exposes it as a dict (`config.aio_config[key]`),
so the model also answers item lookups by key."""
from __future__ import annotations

from typing import Any

from pydantic import Field

from deepspeed_c.runtime.config.utils import DeepSpeedConfigModel, parse_section, unbuilt
from deepspeed_c.runtime.swap_tensor.constants import (AIO, AIO_BLOCK_SIZE_DEFAULT, AIO_INTRA_OP_PARALLELISM_DEFAULT,
                                                       AIO_OVERLAP_EVENTS_DEFAULT, AIO_QUEUE_DEPTH_DEFAULT,
                                                       AIO_SINGLE_SUBMIT_DEFAULT, AIO_USE_GDS_DEFAULT)

ALIGNMENT = 4096


class AioConfig(DeepSpeedConfigModel):
    block_size: int = Field(AIO_BLOCK_SIZE_DEFAULT, gt=0, multiple_of=ALIGNMENT)
    queue_depth: int = Field(AIO_QUEUE_DEPTH_DEFAULT, ge=1)
    intra_op_parallelism: int = Field(AIO_INTRA_OP_PARALLELISM_DEFAULT, ge=1, le=1024, alias="thread_count")
    single_submit: bool = AIO_SINGLE_SUBMIT_DEFAULT
    overlap_events: bool = AIO_OVERLAP_EVENTS_DEFAULT
    use_gds: bool = AIO_USE_GDS_DEFAULT

    def __getitem__(self, key: str) -> Any:
        """DeepSpeed reads `aio_config["block_size"]`."""
        if key == "thread_count":
            key = "intra_op_parallelism"
        if key not in type(self).model_fields:
            raise KeyError(key)
        return getattr(self, key)

    def handle_kwargs(self) -> dict[str, Any]:
        """The aio_handle constructor's arguments."""
        return {"block_size": self.block_size, "queue_depth": self.queue_depth, "single_submit": self.single_submit,
                "overlap_events": self.overlap_events, "intra_op_parallelism": self.intra_op_parallelism}


def get_aio_config(param_dict: dict[str, Any]) -> AioConfig:
    cfg = parse_section(AioConfig, param_dict.get(AIO), AIO)
    if cfg.use_gds:
        raise unbuilt(f"{AIO}.use_gds", "GPUDirect Storage (cuFile)")
    return cfg
