"""Newton-Schulz orthogonalisation for Muon: the quintic iteration X <- a X + (b A + c A^2) X, A = X X^T,
which pushes every singular value of a normalised matrix towards ~1 (U S' V^T with S' near identity).

Two forms, as DeepSpeed 0.19.8's `ns_method`: "standard" iterates on the (short side x long side) matrix
itself; "gram" iterates on its small Gram matrix R = X X^T and the accumulated left factor Q (X_k = Q_k X_0),
touching the long side only at a restart and at the end, which saves FLOPs on rectangular matrices.
Both are the same polynomial in exact arithmetic.

On a GPU the iteration runs in 16 bits (bf16 for "standard", fp16 for "gram", as DeepSpeed's) with batched
GEMMs: matrices of one oriented shape are stacked and go through baddbmm together (a 1.3B GPT has only four
weight shapes, and a (m, n) and an (n, m) matrix share one after orientation). On the host it runs in fp32.
`newton_schulz_reference` is the float64 host version of the standard iteration, the reference of the tests
and the benchmark."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

# the quintic's coefficients (Keller Jordan's Muon, as DeepSpeed's): maximal slope at zero
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_METHODS = ("standard", "gram")
NORM_EPS = 1e-7
GRAM_RESTART = 2  # the gram form re-forms X and R from Q after this many iterations (half-precision drift)
# elements of one batched iteration: large enough that the GEMMs of a 1.3B GPT's layers go 16 at a time,
# small enough that its few 16-bit temporaries stay near 2 GiB whatever the model size
BATCH_ELEMENTS = 1 << 28


def compute_dtype(device: torch.device, ns_method: str) -> torch.dtype:
    """16 bits on an accelerator (DeepSpeed: bf16 for standard, fp16 for gram); fp32 on the host, where
    16-bit GEMMs are slow and the tests compare against float64."""
    if device.type == "cpu":
        return torch.float32
    return torch.float16 if ns_method == "gram" else torch.bfloat16


def _normalise(x: torch.Tensor) -> torch.Tensor:
    # spectral norm <= Frobenius norm: dividing by the latter puts every singular value in [0, 1]
    return x / (torch.linalg.matrix_norm(x, keepdim=True) + NORM_EPS)


def _standard(x: torch.Tensor, steps: int) -> torch.Tensor:
    """x: (batch, n, m) with n <= m, normalised."""
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a, alpha=1.0)
    return x


def _gram(x: torch.Tensor, steps: int) -> torch.Tensor:
    """x: (batch, n, m) with n < m, normalised. With P_k = a I + b R_k + c R_k^2: Q_{k+1} = P_k Q_k and
    R_{k+1} = P_k R_k P_k (P_k commutes with R_k); X = Q X_0 at the end."""
    a, b, c = NS_COEFFICIENTS
    r = torch.bmm(x, x.mT)
    q: Optional[torch.Tensor] = None
    a_eye = a * torch.eye(x.shape[-2], dtype=x.dtype, device=x.device)
    for k in range(steps):
        if k == GRAM_RESTART and q is not None:
            x = torch.bmm(q, x)
            r = torch.bmm(x, x.mT)
            q = None
        poly = torch.baddbmm(r, r, r, beta=b, alpha=c).add_(a_eye)
        q = poly if q is None else torch.bmm(poly, q)
        if k < steps - 1 and k + 1 != GRAM_RESTART:
            r = torch.bmm(poly, torch.bmm(r, poly))
    assert q is not None
    return torch.bmm(q, x)


def orthogonalize_stack(g: torch.Tensor, steps: int = NS_STEPS, ns_method: str = "gram",
                        dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Newton-Schulz of every matrix of g (..., rows, cols), batched; returns g's shape in `dtype` (the compute
    dtype by default: see compute_dtype). No aspect-ratio scale is applied here."""
    if g.ndim < 2:
        raise ValueError(f"Newton-Schulz needs matrices (ndim >= 2), got a tensor of shape {tuple(g.shape)}")
    if ns_method not in NS_METHODS:
        raise ValueError(f"ns_method must be one of {NS_METHODS}, got {ns_method!r}")
    work = dtype or compute_dtype(g.device, ns_method)
    lead, (rows, cols) = g.shape[:-2], g.shape[-2:]
    x = g.reshape(-1, rows, cols)
    tall = rows > cols
    if tall:
        x = x.mT
    # normalised before the cast (DeepSpeed casts first): a small update's entries would fall into fp16's
    # subnormals, while after normalisation they are O(1 / sqrt(numel))
    x = _normalise(x.to(torch.promote_types(x.dtype, torch.float32))).to(work)
    x = _gram(x, steps) if ns_method == "gram" and x.shape[-2] < x.shape[-1] else _standard(x, steps)
    if tall:
        x = x.mT
    return x.reshape(*lead, rows, cols)


def aspect_scale(shape: Sequence[int]) -> float:
    """DeepSpeed's post-orthogonalisation scale sqrt(max(1, rows / cols)), from the tensor's last two dims."""
    return max(1.0, shape[-2] / shape[-1]) ** 0.5


def matrix_view_shape(shape: Sequence[int], is_expert_group: bool = False) -> tuple[int, ...]:
    """The shape Newton-Schulz sees: a 4-D (conv) weight as (out, in*kh*kw) unless it is a stack of expert
    matrices; a 3-D tensor is a batch of matrices."""
    if len(shape) == 4 and not is_expert_group:
        return (shape[0], int(torch.Size(shape[1:]).numel()))
    return tuple(shape)


def orthogonalize_many(updates: Sequence[torch.Tensor], shapes: Sequence[Sequence[int]], ns_method: str = "gram",
                       steps: int = NS_STEPS, expert: Optional[Sequence[bool]] = None,
                       out_dtype: Optional[torch.dtype] = None) -> list[torch.Tensor]:
    """Muon's orthogonalised, aspect-scaled update of each tensor (viewed with its parameter's shape), in
    out_dtype (the input's by default). Matrices of one oriented (short, long) shape on one device are
    stacked and orthogonalised by one batched iteration."""
    expert = list(expert) if expert is not None else [False] * len(updates)
    buckets: dict[tuple, list[tuple[int, torch.Tensor, bool]]] = {}
    for k, (u, shape) in enumerate(zip(updates, shapes)):
        view = matrix_view_shape(shape, expert[k])
        if len(view) < 2:
            raise ValueError(f"Muon needs parameters with ndim >= 2, got shape {tuple(shape)}; put it in a "
                             f"use_muon=False (Adam) group")
        mats = u.reshape(-1, view[-2], view[-1])
        tall = view[-2] > view[-1]
        key = (u.device, min(view[-2:]), max(view[-2:]))
        buckets.setdefault(key, []).append((k, mats.mT if tall else mats, tall))
    results: list[Optional[torch.Tensor]] = [None] * len(updates)
    for items in buckets.values():
        for chunk in _chunks(items):
            stacked = torch.cat([m for _, m, _ in chunk]) if len(chunk) > 1 else chunk[0][1]
            ortho = orthogonalize_stack(stacked, steps, ns_method)
            offset = 0
            for k, mats, tall in chunk:
                part = ortho[offset:offset + mats.shape[0]]
                offset += mats.shape[0]
                out = torch.empty(updates[k].shape, dtype=out_dtype or updates[k].dtype, device=part.device)
                # the cast to the update's dtype and the aspect scale in one pass
                torch.mul(part.mT if tall else part, aspect_scale(shapes[k]),
                          out=out.view(mats.shape[0], *_matrix_dims(mats, tall)))
                results[k] = out
    return [r for r in results if r is not None]


def _matrix_dims(mats: torch.Tensor, tall: bool) -> tuple[int, int]:
    """The (rows, cols) of the parameter's matrix view, from the oriented stack."""
    return (mats.shape[-1], mats.shape[-2]) if tall else (mats.shape[-2], mats.shape[-1])


def _chunks(items: list) -> list[list]:
    """One bucket's matrices in runs of at most BATCH_ELEMENTS elements (a matrix alone may exceed it)."""
    runs: list[list] = [[]]
    size = 0
    for item in items:
        n = item[1].numel()
        if runs[-1] and size + n > BATCH_ELEMENTS:
            runs.append([])
            size = 0
        runs[-1].append(item)
        size += n
    return runs


@torch.no_grad()
def newton_schulz_reference(g: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """Float64 host reference of the standard iteration on g (..., rows, cols): no batching, no orientation
    tricks beyond the transpose of a tall matrix, plain matmuls."""
    a, b, c = NS_COEFFICIENTS
    x = g.detach().to("cpu", torch.float64)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + NORM_EPS)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x
