"""Models for the flops profiler tests, each with its forward FLOP/MAC count worked out from the
layer shapes (no profiler involved), under the counting conventions DeepSpeed's profiler uses:
a multiply-accumulate is 2 flops; F.linear's bias add is not counted, a convolution's is;
ReLU/GELU/softmax/pooling cost 1 flop per input element; LayerNorm with affine 5 per element;
BatchNorm in eval with affine 2 per element; Python `+` residuals are not counted.

Also importable by a subprocess that runs the real DeepSpeed profiler on the same models."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepspeed_c.profiling.toy_models import GPTBlock  # noqa: F401  (counted below; shared with the benchmarks)


def linear_case(b: int = 3, fin: int = 7, fout: int = 5) -> tuple[nn.Module, tuple, int, int]:
    macs = b * fin * fout
    return nn.Linear(fin, fout), (b, fin), 2 * macs, macs


def _conv_out(size: int, k: int, s: int, p: int, d: int = 1) -> int:
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def conv_case() -> tuple[nn.Module, tuple, int, int]:
    b, cin, cout, h, w, k, s, p, g = 2, 4, 6, 9, 7, 3, 2, 1, 2
    ho, wo = _conv_out(h, k, s, p), _conv_out(w, k, s, p)
    macs = b * cout * ho * wo * (cin // g) * k * k
    flops = 2 * macs + b * cout * ho * wo  # bias: one add per output element
    return nn.Conv2d(cin, cout, k, stride=s, padding=p, groups=g), (b, cin, h, w), flops, macs


def gpt_block_counts(b: int, t: int, d: int, heads: int) -> tuple[int, int]:
    tokens = b * t
    dh = d // heads
    matmul_macs = tokens * d * (3 * d + d + 4 * d + 4 * d)
    attn_macs = 2 * b * heads * t * t * dh  # Q K^T and P V (the causal mask does not change the count)
    macs = matmul_macs + attn_macs
    flops = 2 * macs + 2 * 5 * tokens * d + tokens * 4 * d  # two LayerNorms, GELU
    return flops, macs


class BERTBlock(nn.Module):
    """Post-LN bidirectional block with attention written out: matmul, softmax, matmul."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        dh = d // self.heads

        def split(z: torch.Tensor) -> torch.Tensor:
            return z.view(b, t, self.heads, dh).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        p = F.softmax(torch.matmul(q, k.transpose(-1, -2)) / dh ** 0.5, dim=-1)
        a = torch.matmul(p, v).transpose(1, 2).reshape(b, t, d)
        x = self.ln1(x + self.o(a))
        return self.ln2(x + self.fc2(F.gelu(self.fc1(x))))


def bert_block_counts(b: int, t: int, d: int, heads: int) -> tuple[int, int]:
    tokens = b * t
    dh = d // heads
    macs = tokens * d * (4 * d + 4 * d + 4 * d) + 2 * b * heads * t * t * dh
    flops = 2 * macs + b * heads * t * t + 2 * 5 * tokens * d + tokens * 4 * d  # softmax, 2 LN, GELU
    return flops, macs


class BasicBlock(nn.Module):

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idt = x if self.down is None else self.down(x)
        y = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(y)) + idt)


class ResNet18(nn.Module):

    def __init__(self, classes: int = 10, width: int = 64) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        layers, cin = [], width
        for i, cout in enumerate((width, 2 * width, 4 * width, 8 * width)):
            stride = 1 if i == 0 else 2
            layers.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18_counts(b: int, hw: int, classes: int = 10, width: int = 64) -> tuple[int, int]:
    flops = macs = 0

    def conv(c_in: int, c_out: int, size: int, k: int, s: int, p: int) -> int:
        nonlocal flops, macs
        out = _conv_out(size, k, s, p)
        m = b * c_out * out * out * c_in * k * k
        macs += m
        flops += 2 * m
        return out

    def bn_relu(c: int, size: int, relu: bool = True) -> None:
        nonlocal flops
        flops += 2 * b * c * size * size + (b * c * size * size if relu else 0)

    size = conv(3, width, hw, 7, 2, 3)
    bn_relu(width, size)
    flops += b * width * size * size  # max pool: per input element
    size = _conv_out(size, 3, 2, 1)
    cin = width
    for i, cout in enumerate((width, 2 * width, 4 * width, 8 * width)):
        for j in range(2):
            stride = 2 if (i > 0 and j == 0) else 1
            c_in = cin if j == 0 else cout
            if stride != 1 or c_in != cout:
                down = conv(c_in, cout, size, 1, stride, 0)
                bn_relu(cout, down, relu=False)
            s1 = conv(c_in, cout, size, 3, stride, 1)
            bn_relu(cout, s1)
            s2 = conv(cout, cout, s1, 3, 1, 1)
            bn_relu(cout, s2)  # bn2, then the relu after the residual add
            size = s2
        cin = cout
    flops += b * cin * size * size  # adaptive average pool
    macs += b * cin * classes
    flops += 2 * b * cin * classes
    return flops, macs


class OpZoo(nn.Module):
    """Every patched op family once, for the cross-check against DeepSpeed's profiler."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.c1 = nn.Conv1d(8, 6, 3, padding="same")
        self.c3 = nn.Conv3d(2, 3, 2, stride=(1, 2, 1), dilation=1)
        self.t2 = nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2)
        self.gn, self.inorm = nn.GroupNorm(2, 6), nn.InstanceNorm2d(6, affine=True)
        self.bn = nn.BatchNorm1d(6)
        self.prelu = nn.PReLU()

    def forward(self, ids: torch.Tensor, img: torch.Tensor, vol: torch.Tensor) -> torch.Tensor:
        e = self.emb(ids)  # [b, t, 8]
        s = self.bn(self.c1(e.transpose(1, 2)))  # [b, 6, t]
        s = F.elu(F.leaky_relu(F.relu6(F.silu(self.prelu(s)))))
        s = F.max_pool1d(F.avg_pool1d(s, 2), 1) + F.adaptive_max_pool1d(s, 3).sum()
        y = self.inorm(self.gn(self.t2(img)))
        y = F.interpolate(y, scale_factor=2, mode="nearest").mean() + F.upsample(y, size=(5, 5)).mean()
        z = F.adaptive_avg_pool3d(self.c3(vol), 1).flatten()
        m = torch.bmm(e, e.transpose(1, 2)) + torch.einsum("bij,bjk->bik", e, e.transpose(1, 2))
        m = torch.baddbmm(m, e, e.transpose(1, 2))
        w = torch.addmm(torch.ones(4), torch.ones(3, 5), torch.ones(5, 4)).addmm(torch.ones(3, 4), torch.ones(4, 4))
        v = torch.mul(m, 2.0).add(torch.add(m, m)).mul(torch.ones(m.shape[-1]))
        return s.sum() + y + z.sum() + v.sum() + w.sum() + F.softmax(e @ e.transpose(1, 2), -1).sum()


def zoo_inputs() -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, 11, (2, 6), generator=g), torch.randn(2, 4, 5, 5, generator=g),
            torch.randn(1, 2, 4, 6, 4, generator=g))


class RNNZoo(nn.Module):
    """The recurrent modules (counted from their weights) for the cross-check."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 6, num_layers=2, bidirectional=True, batch_first=True)
        self.gru, self.rnn = nn.GRU(8, 5), nn.RNN(8, 4, bias=False)
        self.lc, self.gc, self.rc = nn.LSTMCell(8, 3), nn.GRUCell(8, 3), nn.RNNCell(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [self.lstm(x)[0].sum(), self.gru(x)[0].sum(), self.rnn(x)[0].sum()]
        outs += [self.lc(x[:, 0])[0].sum(), self.gc(x[:, 0]).sum(), self.rc(x[:, 0]).sum()]
        return sum(outs)


def lstm_counts(b: int, t: int, fin: int, h: int) -> int:
    """One unidirectional single-layer LSTM: per step and sample, the input and hidden matmuls
    (2*4h*in - 4h, 2*4h*h - 4h: a sum of `cols` products has cols-1 adds), the gates' 10h
    elementwise ops and the two 4h bias vectors."""
    per = (2 * 4 * h * fin - 4 * h) + (2 * 4 * h * h - 4 * h) + 10 * h + 8 * h
    return b * t * per
