"""The CUDA path of SparseSelfAttention: the layout's block tables and the autograd Function over
the fused kernels of op `sparse_attn` (csrc/cuda/sparse_attn*.cu).

The kernels' backward is first-order only: a create_graph backward recomputes the attention through the plain
torch composition (reference.dense_sparse_attention, over the layout the tables keep) and differentiates that;
under a torch.func transform the call is that composition."""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from deepspeed_c.runtime.autograd_paths import tensor_hooks_paused, transforms_active

from .reference import dense_sparse_attention
from .work_plan import DEFAULT_FACTOR, WorkPlan, balance_enabled

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
KERNEL_BLOCKS = (16, 32, 64, 128)
MAX_KERNEL_HEAD_DIM = 128
_op: ModuleType | None = None


def cuda_op() -> ModuleType:
    """The built op (compiled on first use; OpBuildError quotes the compiler when that fails)."""
    global _op
    if _op is None:
        from op_builder.sparse_attn import SparseAttnBuilder

        _op = SparseAttnBuilder().load()
    return _op


@dataclass(frozen=True)
class BlockTables:
    """A layout [H, nb, nb] as CSR (each block row's key blocks) and CSC (each block column's query
    block rows), int32 on the kernels' device; with `balance`, the WorkPlans of the rows (forward,
    dQ) and the columns (dK/dV) that split long rows over several CTAs (work_plan.py)."""
    row_ptr: torch.Tensor
    cols: torch.Tensor
    col_ptr: torch.Tensor
    rows: torch.Tensor
    nnz: int
    row_plan: WorkPlan | None = None
    col_plan: WorkPlan | None = None
    layout: torch.Tensor | None = None  # the bool [H, nb, nb] layout on the host, for the plain composition

    @staticmethod
    def from_layout(layout: torch.Tensor, device: torch.device, balance: bool | None = None,
                    factor: float = DEFAULT_FACTOR, part: int | None = None) -> "BlockTables":
        """`balance` None: the DSC_SPARSE_ATTN_BALANCE environment switch (default on)."""
        layout = layout.detach().to("cpu", torch.bool)
        if balance is None:
            balance = balance_enabled()

        def csr(lay: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            counts = lay.sum(dim=-1).flatten()
            ptr = torch.zeros(counts.numel() + 1, dtype=torch.int64)
            torch.cumsum(counts, 0, out=ptr[1:])
            idx = lay.nonzero()[:, 2]  # nonzero walks (head, row, col) in order: row-major per head
            idx = torch.cat([idx, idx.new_zeros(1)])  # never empty: the kernels take a valid pointer
            return ptr, idx

        row_ptr, cols = csr(layout)
        col_ptr, rows = csr(layout.transpose(1, 2))
        row_plan = col_plan = None
        if balance:
            row_plan = WorkPlan.build(row_ptr, factor, part).to(device)
            col_plan = WorkPlan.build(col_ptr, factor, part).to(device)
        i32 = [t.to(device, torch.int32) for t in (row_ptr, cols, col_ptr, rows)]
        return BlockTables(*i32, int(layout.sum()), row_plan, col_plan, layout)

    def forward_part(self, q: torch.Tensor, block: int) -> torch.Tensor | None:
        """The forward's float32 scratch: B x slots x block x (D + 1) (o parts, lse parts)."""
        if self.row_plan is None or self.row_plan.slots == 0:
            return None
        B, _, _, D = q.shape
        return torch.empty(B * self.row_plan.slots * block * (D + 1), dtype=torch.float32, device=q.device)

    def backward_part(self, q: torch.Tensor, block: int) -> torch.Tensor | None:
        """The gradient passes' float32 scratch (dQ parts, then reused for dK and dV parts)."""
        slots = max(self.row_plan.slots if self.row_plan else 0, 2 * self.col_plan.slots if self.col_plan else 0)
        if slots == 0:
            return None
        B, _, _, D = q.shape
        return torch.empty(B * slots * block * D, dtype=torch.float32, device=q.device)


def _plan_args(plan: WorkPlan | None) -> tuple:
    if plan is None:
        return None, None, 0
    return plan.items, plan.merges if plan.merges.shape[0] else None, plan.slots


def kernel_supports(q: torch.Tensor, block: int) -> bool:
    return (q.is_cuda and q.dtype in KERNEL_DTYPES and block in KERNEL_BLOCKS and q.shape[-1] % 8 == 0
            and q.shape[-1] <= MAX_KERNEL_HEAD_DIM and torch.cuda.get_device_capability(q.device)[0] >= 8)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _layout(tables: BlockTables) -> torch.Tensor:
    if tables.layout is None:
        raise ValueError("SparseSelfAttention: a create_graph backward or a torch.func transform computes with the "
                         "layout; build the tables with BlockTables.from_layout, which keeps it")
    return tables.layout


class SparseAttentionFunction(torch.autograd.Function):
    """o = block-sparse softmax(scale q k^T + biases) v; gradients for q, k and v (the additive
    biases get none: DeepSpeed's kernels gave none either)."""

    @staticmethod
    def forward(ctx, q, k, v, tables: BlockTables, block: int, scale: float, kpm, am, rpe):
        q, k, v = _aligned(q), _aligned(k), _aligned(v)  # sparse_attention_cuda aligned them: no copies here
        B, H, L, _ = q.shape
        o = torch.empty_like(q)
        lse = torch.empty((B, H, L), dtype=torch.float32, device=q.device)
        cuda_op().forward(q, k, v, o, lse, tables.row_ptr, tables.cols, kpm, am, rpe, block, scale,
                          *_plan_args(tables.row_plan), tables.forward_part(q, block))
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.extras = (tables, block, scale, kpm, am, rpe)
        return o

    @staticmethod
    def backward(ctx, d_o):
        q, k, v, o, lse = ctx.saved_tensors
        tables, block, scale, kpm, am, rpe = ctx.extras
        if torch.is_grad_enabled():  # create_graph: gradients of the plain composition, recorded
            wanted = [t for t, need in zip((q, k, v), ctx.needs_input_grad) if need]
            out = dense_sparse_attention(q, k, v, _layout(tables), block, scale, kpm, am, rpe)
            with tensor_hooks_paused(wanted):  # the edges deliver these gradients: hooks run there, once
                found = iter(torch.autograd.grad(out, wanted, d_o, create_graph=True, allow_unused=True))
            dq, dk, dv = (next(found) if need else None for need in ctx.needs_input_grad[:3])
            return dq, dk, dv, None, None, None, None, None, None
        d_o = _aligned(d_o)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        delta = torch.empty_like(lse)
        cuda_op().backward(d_o, q, k, v, o, lse, delta, tables.row_ptr, tables.cols, tables.col_ptr, tables.rows,
                           kpm, am, rpe, dq, dk, dv, block, scale, *_plan_args(tables.row_plan),
                           *_plan_args(tables.col_plan), tables.backward_part(q, block))
        return dq, dk, dv, None, None, None, None, None, None


def sparse_attention_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: BlockTables, block: int,
                          scale: float, kpm: torch.Tensor | None = None, am: torch.Tensor | None = None,
                          rpe: torch.Tensor | None = None) -> torch.Tensor:
    """The kernels' entry for [B, H, L, D] fp16/bf16 CUDA tensors; the biases float32, contiguous."""
    if transforms_active():  # torch.func: the plain composition (the Function has no vmap rule)
        return dense_sparse_attention(q, k, v, _layout(tables), block, scale, kpm, am, rpe)
    # aligned here, where autograd records a copy, so the Function saves the caller's tensors with their history
    # (a create_graph backward differentiates through them)
    return SparseAttentionFunction.apply(_aligned(q), _aligned(k), _aligned(v), tables, block, scale, kpm, am, rpe)
