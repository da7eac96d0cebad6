"""The package logger (`deepspeed_c.utils.logger`), named and formatted like DeepSpeed's."""
from __future__ import annotations

import logging
import os
import sys
from typing import Iterable

LOG_LEVEL_ENV = "DSC_LOG_LEVEL"


def _create_logger(name: str = "DeepSpeed") -> logging.Logger:
    log = logging.getLogger(name)
    log.setLevel(os.environ.get(LOG_LEVEL_ENV, "INFO").upper())
    log.propagate = False
    if not log.handlers:
        handler = logging.StreamHandler(stream=sys.stdout)
        handler.setFormatter(logging.Formatter(
            "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"))
        log.addHandler(handler)
    return log


logger = _create_logger()


def _current_rank() -> int:
    import sys as _sys

    dist = _sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log on the given ranks only (None or [-1] means every rank), prefixed with the rank."""
    rank = _current_rank()
    wanted = list(ranks) if ranks is not None else [-1]
    if -1 in wanted or rank in wanted:
        logger.log(level, f"[Rank {rank}] {message}")
