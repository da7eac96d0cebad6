"""The package logger (`deepspeed_c.utils.logger`), named and formatted like DeepSpeed's."""
from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Iterable, Optional

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


LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
              "critical": logging.CRITICAL}


def _initialized_rank() -> Optional[int]:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return None


def get_dist_msg(message: str, ranks: Optional[Iterable[int]] = None) -> Optional[str]:
    """The message prefixed with the rank, or None where it is not to be logged. As DeepSpeed: before the
    process group exists every process logs (as rank -1); after, only the ranks listed ([-1]: all of them),
    and none when `ranks` is None or empty."""
    rank = _initialized_rank()
    if rank is None:
        return f"[Rank -1] {message}"
    wanted = list(ranks or [])
    if wanted and (wanted[0] == -1 or rank in wanted):
        return f"[Rank {rank}] {message}"
    return None


def log_dist(message: str, ranks: Optional[Iterable[int]] = None, level: int = logging.INFO) -> None:
    """Log on the ranks get_dist_msg picks."""
    final = get_dist_msg(message, ranks)
    if final is not None:
        logger.log(level, final)


def print_dist(message: str, ranks: Optional[Iterable[int]] = None) -> None:
    """log_dist's choice of ranks, printed whatever the log level."""
    final = get_dist_msg(message, ranks)
    if final is not None:
        print(final)


@functools.lru_cache(None)
def _log_dist_once(message: str, ranks: Optional[tuple], level: int) -> None:
    log_dist(message, ranks=list(ranks) if ranks is not None else None, level=level)


def log_dist_once(message: str, ranks: Optional[Iterable[int]] = None, level: int = logging.INFO) -> None:
    """log_dist, each distinct (message, ranks, level) once per process."""
    _log_dist_once(message, tuple(ranks) if ranks is not None else None, level)


def get_log_level_from_string(log_level_str: str) -> int:
    level = LOG_LEVELS.get(str(log_level_str).lower())
    if level is None:
        raise ValueError(f"{log_level_str!r} is not a log level; valid levels: {sorted(LOG_LEVELS)}")
    return level


def set_log_level_from_string(log_level_str: str, custom_logger: Optional[logging.Logger] = None) -> None:
    """Sets the level of `custom_logger` (default: the package logger) and of its handlers."""
    level = get_log_level_from_string(log_level_str)
    target = logger if custom_logger is None else custom_logger
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


logger.log_dist_once = log_dist_once  # DeepSpeed's scripts call it on the logger too
