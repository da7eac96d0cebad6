"""Recurrent modules run through torch's fused kernels (no patched functional is called), so their
flops are computed from their weights by a forward hook, with DeepSpeed's per-gate estimate:
per time step and sample, each of the input and hidden matmuls costs 2*rows*cols - rows, plus the
gates' elementwise work (RNN h, GRU 7h, LSTM 10h) and the two bias vectors; times batch x sequence
length, twice when bidirectional. MACs are not counted for them (0), as in DeepSpeed."""
from __future__ import annotations

from typing import Any

from torch import nn

_GATE_WORK = {nn.RNN: 1, nn.RNNCell: 1, nn.GRU: 7, nn.GRUCell: 7, nn.LSTM: 10, nn.LSTMCell: 10}


def _gate_work(module: nn.Module) -> int:
    for kind, per_hidden in _GATE_WORK.items():
        if isinstance(module, kind):
            return per_hidden * module.hidden_size
    return 0


def _cell_flops(module: nn.Module, w_ih: Any, w_hh: Any) -> int:
    flops = 2 * w_ih.shape[0] * w_ih.shape[1] - w_ih.shape[0]
    flops += 2 * w_hh.shape[0] * w_hh.shape[1] - w_ih.shape[0]
    return flops + _gate_work(module)


def rnn_hook(module: nn.Module, inputs: Any, output: Any) -> None:
    x = inputs[0]
    flops = 0
    for layer in range(module.num_layers):
        flops += _cell_flops(module, getattr(module, f"weight_ih_l{layer}"), getattr(module, f"weight_hh_l{layer}"))
        if module.bias:
            flops += getattr(module, f"bias_ih_l{layer}").shape[0] + getattr(module, f"bias_hh_l{layer}").shape[0]
    flops *= x.shape[0] * x.shape[1]
    if module.bidirectional:
        flops *= 2
    module.__flops__ += int(flops)


def rnn_cell_hook(module: nn.Module, inputs: Any, output: Any) -> None:
    x = inputs[0]
    flops = _cell_flops(module, module.weight_ih, module.weight_hh)
    if module.bias:
        flops += module.bias_ih.shape[0] + module.bias_hh.shape[0]
    module.__flops__ += int(flops * x.shape[0])


MODULE_HOOKS = {nn.RNN: rnn_hook, nn.GRU: rnn_hook, nn.LSTM: rnn_hook,
                nn.RNNCell: rnn_cell_hook, nn.GRUCell: rnn_cell_hook, nn.LSTMCell: rnn_cell_hook}
