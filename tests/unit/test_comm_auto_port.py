"""A world of one without a launcher (`python train.py`) picks a free port for its store itself; a port found free
is only reserved once the store listens on it, so another process can take it in between (CI saw EADDRINUSE in
`initialize` of a unit test while other workers' tests started stores). The port deepspeed_c picked is replaced
by a fresh one then (and when a later group of one would reuse it); a port the user or a launcher set never is."""
from __future__ import annotations

import os
import socket
from typing import Iterator

import pytest
import torch.distributed as dist

from deepspeed_c.comm import bootstrap

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture()
def no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    assert not dist.is_initialized()
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _listening() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((bootstrap.LOCALHOST, 0))
    s.listen(1)
    return s


def test_own_port_taken_meanwhile_is_picked_again(no_launcher_env, monkeypatch: pytest.MonkeyPatch) -> None:
    with _listening() as taken:
        port = taken.getsockname()[1]
        picks = iter([port])  # the first "free" port is the one another process now listens on
        real = bootstrap._free_port
        monkeypatch.setattr(bootstrap, "_free_port", lambda: next(picks, None) or real())
        bootstrap.init_distributed(dist_backend="gloo", verbose=False)
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert os.environ["MASTER_PORT"] != str(port) and os.environ["MASTER_PORT"] == bootstrap._auto_port
    dist.destroy_process_group()
    # a later group of one does not reuse the port this process picked before (now taken): it picks afresh
    with _listening() as taken:
        old = str(taken.getsockname()[1])
        monkeypatch.setattr(bootstrap, "_auto_port", old)
        monkeypatch.setenv("MASTER_PORT", old)
        bootstrap.init_distributed(dist_backend="gloo", verbose=False)
        assert dist.is_initialized() and os.environ["MASTER_PORT"] != old


def test_user_port_is_never_replaced(no_launcher_env, monkeypatch: pytest.MonkeyPatch) -> None:
    with _listening() as taken:
        port = str(taken.getsockname()[1])
        for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                            ("MASTER_ADDR", bootstrap.LOCALHOST), ("MASTER_PORT", port)):
            monkeypatch.setenv(name, value)
        with pytest.raises(RuntimeError, match="EADDRINUSE|address already in use"):
            bootstrap.init_distributed(dist_backend="gloo", verbose=False)
        assert os.environ["MASTER_PORT"] == port and not dist.is_initialized()
