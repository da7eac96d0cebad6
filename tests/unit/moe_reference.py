"""Float64 references of DeepSpeed's MoE gating formulas (one-hot masks, cumulative sums, dense
combine weights), written from the behaviour for the MoE tests; shared by tests/unit and
tests/distributed."""
from __future__ import annotations

import math

import torch

def _softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.double(), dim=1)


def _cap(S: int, E: int, cf: float, min_cap: int) -> int:
    return max(math.ceil(S / E * cf), min_cap)


def _combine_from(S, E, C, routes):
    """routes: list of (s, e, loc, weight) -> dense combine weights [S, E, C] (float64)."""
    cw = torch.zeros(S, E, C, dtype=torch.float64)
    for s, e, loc, w in routes:
        cw[s, e, loc] += w
    return cw


def ref_top1(logits, cf, min_cap, used=None, drop=True, uniform=None):
    S, E = logits.shape
    gates = _softmax(logits)
    idx = gates.argmax(dim=1)
    mask = torch.nn.functional.one_hot(idx, E).double()
    if used is not None:
        mask = mask * used.double().unsqueeze(1)
    counts = mask.sum(0)
    cap = _cap(S, E, cf, min_cap) if drop else min(int(counts.max()), S)
    l_aux = float((gates.mean(0) * mask.mean(0)).sum() * E)
    kept = torch.zeros_like(mask)
    for e in range(E):
        members = [s for s in range(S) if mask[s, e] > 0]
        if uniform is not None:
            members.sort(key=lambda s: -float(uniform[s, e]))
        for s in members[:cap]:
            kept[s, e] = 1
    loc = kept.cumsum(0) - 1
    routes = [(s, int(idx[s]), int(loc[s, idx[s]]), float(gates[s, idx[s]])) for s in range(S) if kept[s, idx[s]]]
    return l_aux, _combine_from(S, E, cap, routes), counts.long()


def ref_top2(logits, cf, min_cap, drop=True, noise=None):
    S, E = logits.shape
    gates = _softmax(logits)
    idx1 = gates.argmax(1)
    mask1 = torch.nn.functional.one_hot(idx1, E).double()
    noisy = logits.double() + (0 if noise is None else noise.double())
    idx2 = noisy.masked_fill(mask1.bool(), float("-inf")).argmax(1)
    mask2 = torch.nn.functional.one_hot(idx2, E).double()
    loc1 = mask1.cumsum(0) - 1
    loc2 = mask2.cumsum(0) - 1 + mask1.sum(0, keepdim=True)
    l_aux = float((gates.mean(0) * mask1.mean(0)).mean() * E * E)
    counts = (mask1 + mask2).sum(0)
    cap = _cap(S, E, 2 * cf, min_cap) if drop else int(counts.max())
    mask1 = mask1 * (loc1 < cap)
    mask2 = mask2 * (loc2 < cap)
    routes = []
    for s in range(S):
        g1 = float(gates[s, idx1[s]] * mask1[s, idx1[s]])
        g2 = float(gates[s, idx2[s]] * mask2[s, idx2[s]])
        denom = max(g1 + g2, torch.finfo(torch.float32).eps)
        if g1:
            routes.append((s, int(idx1[s]), int(loc1[s, idx1[s]]), g1 / denom))
        if g2:
            routes.append((s, int(idx2[s]), int(loc2[s, idx2[s]]), g2 / denom))
    return l_aux, _combine_from(S, E, cap, routes), counts.long()


def ref_topk(logits, k, cf, min_cap, drop=True, policy="probs"):
    S, E = logits.shape
    gates = _softmax(logits)
    top = gates.argsort(dim=1, descending=True)[:, :k]
    mask = torch.zeros(S, E, dtype=torch.float64).scatter_(1, top, 1.0)
    counts = mask.sum(0)
    l_aux = float((gates.mean(0) * mask.mean(0)).mean() * E * E / k)
    cap = _cap(S, E, k * cf, min_cap) if drop else int(counts.max())
    if drop:
        for e in range(E):
            members = [s for s in range(S) if mask[s, e] > 0]
            if policy == "probs":
                members.sort(key=lambda s: -float(gates[s, e]))
            for s in members[cap:]:
                mask[s, e] = 0
    loc = mask.cumsum(0) - 1
    gm = gates * mask
    gm = gm / gm.sum(1, keepdim=True).clamp(min=torch.finfo(torch.float32).eps)
    routes = [(s, e, int(loc[s, e]), float(gm[s, e])) for s in range(S) for e in range(E) if mask[s, e]]
    return l_aux, _combine_from(S, E, cap, routes), counts.long()
