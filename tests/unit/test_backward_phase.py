"""The engine's backward phase (runtime/backward_phase.py): transitions of EngineBackward on a real autograd
backward, with a recording report and reducer standing in for the engine's."""
import pytest
import torch

from deepspeed_c.runtime.backward_phase import BackwardPhase, EngineBackward


class Recorder:
    def __init__(self) -> None:
        self.events: list[str] = []

    def claim_round(self) -> None:
        self.events.append("claim")

    def end_backward(self) -> None:
        self.events.append("end")

    def start(self, names: tuple) -> None:
        pass

    def stop(self, names: tuple) -> None:
        pass

    def record_loss(self, loss: torch.Tensor) -> None:
        self.events.append("loss")


class Precision:
    def __init__(self, needs_scaler: bool) -> None:
        self.needs_scaler = needs_scaler

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss


def _setup(needs_scaler: bool = False, gas: int = 1):
    rec = Recorder()
    w = torch.nn.Parameter(torch.ones(3))
    state = EngineBackward(Precision(needs_scaler), rec, lambda: rec, lambda: gas)
    seen: list[BackwardPhase] = []

    def forward() -> torch.Tensor:
        state.forward_started()
        out = (w * 2.0).sum()
        out.register_hook(lambda g: (state.outputs_reached([w]), seen.append(state.phase))[1] and None)
        return out

    return state, rec, w, forward, seen


def test_engine_backward_drives_its_round():
    state, rec, w, forward, seen = _setup(gas=2)
    assert state.phase is BackwardPhase.IDLE
    scaled = state.backward(forward())
    assert seen == [BackwardPhase.DRIVEN_ROUND] and state.phase is BackwardPhase.IDLE
    # drive() claims, the outputs' hook opens the round (claims again), autograd's callback closes it, drive() ends
    assert rec.events == ["claim", "loss", "claim", "end", "end"]
    assert torch.equal(w.grad, torch.full((3,), 1.0)) and float(scaled.detach()) == 3.0  # loss / gas


def test_direct_backward_opens_and_closes_a_round():
    state, rec, w, forward, seen = _setup()
    forward().backward()
    assert seen == [BackwardPhase.DIRECT_ROUND] and state.phase is BackwardPhase.IDLE
    assert rec.events == ["claim", "end"]


def test_autograd_grad_opens_no_round():
    state, rec, w, forward, seen = _setup()
    torch.autograd.grad(forward(), [w])
    assert seen == [BackwardPhase.IDLE] and rec.events == []


def test_unscaled_direct_backward_refused_under_loss_scaling():
    state, rec, w, forward, seen = _setup(needs_scaler=True)
    with pytest.raises(RuntimeError, match="Loss scaling is required"):
        forward().backward()
    state.user_scaled_loss()
    forward().backward()  # allowed once
    with pytest.raises(RuntimeError, match="Loss scaling is required"):
        forward().backward()


def test_a_raised_round_is_forgotten_at_the_next_forward():
    state, rec, w, forward, seen = _setup()
    handle = w.register_hook(lambda g: (_ for _ in ()).throw(ValueError("raised inside backward")))
    with pytest.raises(ValueError):
        forward().backward()
    handle.remove()
    assert state.phase is BackwardPhase.DIRECT_ROUND  # autograd's final callback never ran
    forward()
    assert state.phase is BackwardPhase.IDLE and rec.events == ["claim"]
