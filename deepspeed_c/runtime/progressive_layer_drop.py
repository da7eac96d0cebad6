"""Progressive layer dropping (PLD, https://arxiv.org/abs/2010.13369): the keep-probability theta that the
engine hands the model's forward (`progressive_layer_drop=True, pld_theta=...`) while training.

theta(step) = (1 - theta_final) * exp(-gamma * step) + theta_final: 1.0 at the start, decaying towards
`theta` at rate `gamma`. numpy's exp, as DeepSpeed uses, so the values are DeepSpeed's to the last bit."""
from __future__ import annotations

import numpy as np


class ProgressiveLayerDrop:
    """theta: the final keep probability (lower trains faster); gamma: how fast theta decays towards it."""

    def __init__(self, theta: float = 0.5, gamma: float = 0.001) -> None:
        self.theta = theta
        self.gamma = gamma
        self.current_theta = 1.0

    def get_state(self) -> dict:
        """The keywords the engine passes to the model's forward."""
        return {"progressive_layer_drop": True, "pld_theta": self.get_theta()}

    def get_theta(self) -> float:
        return self.current_theta

    def update_state(self, global_step: int) -> None:
        self.current_theta = (1.0 - self.theta) * np.exp(-self.gamma * global_step) + self.theta

    def state_dict(self) -> dict:
        return {"current_theta": float(self.current_theta)}

    def load_state_dict(self, state: dict) -> None:
        self.current_theta = state["current_theta"]
