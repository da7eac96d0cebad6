"""Float64 single-process simulations of the 1-bit optimizers, every rank at once, written from
the algorithms' descriptions (DeepSpeed 0.19.6's semantics) and independent of deepspeed_c's code.

Each simulation replays the gradients each rank's optimizer received (recorded by the test run:
all-reduced by the engine in uncompressed steps, local in compressed ones) and returns every
rank's parameters after every step, so the run can be compared step by step."""
from __future__ import annotations

import math

import numpy as np


def sign(x: np.ndarray) -> np.ndarray:
    return np.where(x < 0, -1.0, 1.0)  # a 1-bit code has no zero


class Compressor:
    """DeepSpeed's compressed_allreduce over W simulated ranks for one tensor of n elements, with
    each rank's worker error (padded size) and server error (one chunk)."""

    def __init__(self, n: int, world: int) -> None:
        unit = world * (world * 8 // math.gcd(world, 8))
        self.n, self.W = n, world
        self.padded = -(-n // unit) * unit
        self.chunk = self.padded // world
        self.werr = [np.zeros(self.padded) for _ in range(world)]
        self.serr = [np.zeros(self.chunk) for _ in range(world)]

    def reset(self) -> None:
        for e in self.werr + self.serr:
            e[:] = 0.0

    def __call__(self, bufs: list[np.ndarray], pad: np.ndarray | None = None) -> np.ndarray:
        """bufs: each rank's n values; pad: the padded tail's values (zeros when None). Returns the
        padded result, the same on every rank."""
        W, C = self.W, self.chunk
        signs, wscale = [], []
        for r in range(W):
            x = np.zeros(self.padded)
            x[:self.n] = bufs[r]
            if pad is not None:
                x[self.n:] = pad
            x += self.werr[r]
            s = np.linalg.norm(x) / math.sqrt(self.padded)
            self.werr[r] = x - s * sign(x)
            signs.append(sign(x))
            wscale.append(s)
        out = np.zeros(self.padded)
        for r in range(W):  # rank r serves chunk r
            m = sum(signs[j][r * C:(r + 1) * C] * wscale[j] / W for j in range(W)) + self.serr[r]
            s = np.linalg.norm(m) / math.sqrt(C)
            self.serr[r] = m - s * sign(m)
            out[r * C:(r + 1) * C] = s * sign(m)
        return out


def onebit_adam(p0, grads, lr, freeze_step, betas=(0.9, 0.999), eps=1e-8, wd=0.0, reset_at=()):
    """p0: list of initial params; grads[t][r][i]; returns params[t][r][i] after step t (0-based).
    reset_at: steps (1-based call counts) after which the error buffers restart at zero."""
    b1, b2 = betas
    W = len(grads[0])
    p = [[x.astype(np.float64).copy() for x in p0] for _ in range(W)]
    m = [np.zeros_like(x, dtype=np.float64) for x in p0]
    v = [np.zeros_like(x, dtype=np.float64) for x in p0]
    comp = [Compressor(x.size, W) for x in p0]
    frozen, out = False, []
    for t, g in enumerate(grads):
        step = t + 1
        if step > 1:
            for i in range(len(p0)):
                if not frozen:
                    m[i] = b1 * m[i] + (1 - b1) * g[0][i]
                    v[i] = b2 * v[i] + (1 - b2) * g[0][i] ** 2
                    new_m = m[i]
                else:
                    local = [(b1 * m[i] + (1 - b1) * g[r][i]).ravel() for r in range(W)]
                    new_m = comp[i](local)[:m[i].size].reshape(m[i].shape) if W > 1 else local[0].reshape(m[i].shape)
                    m[i] = new_m
                for r in range(W):
                    upd = m[i] / (np.sqrt(v[i]) + eps) + wd * p[r][i]
                    p[r][i] = p[r][i] - lr * upd
            if not frozen and step >= freeze_step:
                frozen = True
        if step in reset_at:
            for c in comp:
                c.reset()
        out.append([[x.copy() for x in pr] for pr in p])
    return out


def zero_one_adam(p0, grads, lr, var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper,
                  betas=(0.9, 0.999), eps=1e-8, wd=0.0):
    """0/1 Adam for every rank; also returns, per step, whether the engine was to all-reduce the
    gradients of that step (the policy's decision made one step before)."""
    b1, b2 = betas
    W, n = len(grads[0]), len(p0)
    p = [[x.astype(np.float64).copy() for x in p0] for _ in range(W)]
    m = [[np.zeros(x.shape) for x in p0] for _ in range(W)]
    v = [np.zeros(x.shape) for x in p0]
    acc = [[np.zeros(x.shape) for x in p0] for _ in range(W)]
    comp = [Compressor(x.size, W) for x in p0]
    var_interval, var_counter, local_interval, local_counter, lrs = 1, 0, 1, 0, 0.0
    frozen, reinit = False, False
    allreduce_next, out, allreduced = True, [], []
    for t, g in enumerate(grads):
        step = t + 1
        allreduced.append(allreduce_next)
        if step == 1:
            out.append([[x.copy() for x in pr] for pr in p])
            continue
        if frozen:
            lrs += lr
        for i in range(n):
            if frozen:
                for r in range(W):
                    m[r][i] = b1 * m[r][i] + (1 - b1) * g[r][i]
            elif step % var_interval == 0:
                v[i] = b2 * v[i] + (1 - b2) * g[0][i] ** 2
                for r in range(W):
                    m[r][i] = b1 * m[r][i] + (1 - b1) * g[0][i]
            elif W > 1:
                g1 = comp[i]([g[r][i].ravel() for r in range(W)])[:g[0][i].size].reshape(g[0][i].shape)
                for r in range(W):
                    m[r][i] = b1 * m[r][i] + (1 - b1) * g1
            for r in range(W):
                upd = m[r][i] / (np.sqrt(v[i]) + eps) + wd * p[r][i]
                p[r][i] = p[r][i] - lr * upd
                if frozen:
                    acc[r][i] = acc[r][i] - lr * upd
            if frozen and step % local_interval == 0:
                bufs = []
                for r in range(W):
                    p[r][i] = p[r][i] - acc[r][i]
                    bufs.append((acc[r][i] * (np.sqrt(v[i]) + eps)).ravel())
                avg = comp[i](bufs)[:p0[i].size].reshape(p0[i].shape) if W > 1 else bufs[0].reshape(p0[i].shape)
                for r in range(W):
                    m[r][i] = -avg / lrs
                    p[r][i] = p[r][i] + avg / (np.sqrt(v[i]) + eps)
                    acc[r][i] = np.zeros(p0[i].shape)
        if frozen and step % local_interval == 0:
            lrs = 0.0
        if not frozen:
            if step % var_interval == 0:
                var_counter += 1
                if var_counter == var_update_scaler:
                    var_counter, var_interval = 0, var_interval * 2
            allreduce_next = (step + 1) % var_interval == 0
        else:
            local_counter += 1
            if local_counter == local_step_scaler:
                local_counter, local_interval = 0, min(local_step_clipper, local_interval * 2)
        if step > var_freeze_step:
            frozen, allreduce_next = True, False
        if frozen and not reinit:
            for c in comp:
                c.reset()
            reinit = True
        out.append([[x.copy() for x in pr] for pr in p])
    return out, allreduced


def onebit_lamb(p0, grads, lr, freeze_step, betas=(0.9, 0.999), eps=1e-8, wd=0.0, max_coeff=10.0, min_coeff=0.01,
                coeff_beta=0.9, factor_max=4.0, factor_min=0.5, factor_threshold=0.1):
    b1, b2 = betas
    W, n = len(grads[0]), len(p0)
    p = [x.astype(np.float64).copy() for x in p0]
    m = [np.zeros(x.shape) for x in p0]
    v = [np.zeros(x.shape) for x in p0]
    fresh = [np.zeros(x.shape) for x in p0]
    lcf, last = [0.0] * n, [1.0] * n
    total = sum(x.size for x in p0)
    comp = Compressor(total, W)
    pad = np.zeros(comp.padded - total)
    scaling = None
    frozen, out = False, []
    for t, g in enumerate(grads):
        step = t + 1
        if step > 1 and not frozen:
            for i in range(n):
                m[i] = b1 * m[i] + (1 - b1) * g[0][i]
                v[i] = b2 * v[i] + (1 - b2) * g[0][i] ** 2
                if step == freeze_step:
                    fresh[i] = v[i].copy()
                upd = m[i] / (np.sqrt(v[i]) + eps) + wd * p[i]
                wn, un = np.linalg.norm(p[i]), np.linalg.norm(upd)
                c = 1.0 if wn == 0 or un == 0 else min(max(wn / un, min_coeff), max_coeff)
                if c != 1.0:
                    lcf[i] = coeff_beta * lcf[i] + (1 - coeff_beta) * c
                p[i] = p[i] - lr * c * upd
            if step >= freeze_step:
                frozen = True
        elif step > 1:
            if scaling is None:
                rms = [np.linalg.norm(x) / math.sqrt(x.size) for x in m]
                scaling = [np.mean(rms) / r for r in rms]
            prev = [x.copy() for x in m]
            local = [np.concatenate([((b1 * m[i] + (1 - b1) * g[r][i]) * scaling[i]).ravel() for i in range(n)])
                     for r in range(W)]
            if W > 1:
                res = comp(local, pad)
                flat, pad = res[:total], res[total:]
            else:
                flat = local[0]
            off = 0
            for i in range(n):
                m[i] = flat[off:off + p0[i].size].reshape(p0[i].shape) / scaling[i]
                off += p0[i].size
                gr = (m[i] - b1 * prev[i]) / (1 - b1)
                fresh[i] = b2 * fresh[i] + (1 - b2) * gr ** 2
                denom = np.sqrt(v[i]) + eps
                prelim = m[i] / denom
                upd = prelim + wd * p[i]
                factor = float(np.max(denom / (np.sqrt(fresh[i]) + eps)))
                if wd > 0:
                    ratio = min(1.0, np.linalg.norm(prelim) / np.linalg.norm(upd))
                    factor = factor * ratio + (1 - ratio)
                factor = min(max(factor, factor_min), factor_max)
                factor = min(max(factor, last[i] * (1 - factor_threshold)), last[i] * (1 + factor_threshold))
                last[i] = factor
                p[i] = p[i] - lr * lcf[i] * factor * upd
        out.append([[x.copy() for x in p] for _ in range(W)])
    return out
