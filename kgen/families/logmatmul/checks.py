"""logmatmul's argument checks: dtypes, shapes, devices, block-sparse structure. They read
shapes and dtypes only (safe on fake tensors, no host wait); index values of a
block-sparse pattern are the caller's promise (see block_sparse_logmatmul)."""

from __future__ import annotations

import torch

X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)


# (x dtype, w dtype) pairs the dense op takes: one set lookup on the common path
_DENSE_PAIRS = frozenset((t, u) for t in X_DTYPES for u in (torch.float32, t))


def check_dense(x, w, name: str = "logmatmul") -> None:
    """x [B, K] log-values (float32, bfloat16, float16), w [N, K] non-negative weights
    (float32 or x's dtype), one device."""
    if (type(x) is torch.Tensor and type(w) is torch.Tensor and (x.dtype, w.dtype) in _DENSE_PAIRS
            and x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1] and x.device == w.device):
        return  # the common case, checked in one expression (host cost of small calls)
    for arg, t in (("x", x), ("w", w)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a tensor, got {type(t).__name__}")
    if x.dtype not in X_DTYPES:
        raise TypeError(f"{name}: x has dtype {x.dtype}; supported: float32, bfloat16, float16")
    if w.dtype not in (torch.float32, x.dtype):
        raise TypeError(f"{name}: w has dtype {w.dtype}; expected float32 or x's dtype ({x.dtype})")
    if x.dim() != 2:
        raise ValueError(f"{name}: x must be 2-D [B, K], got shape {tuple(x.shape)}")
    if w.dim() != 2:
        raise ValueError(f"{name}: w must be 2-D [N, K], got shape {tuple(w.shape)}")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"{name}: x is [B, K] = {tuple(x.shape)} and w [N, K] = {tuple(w.shape)}; "
                         "their K must match")
    if w.device != x.device:
        raise ValueError(f"{name}: w is on {w.device}, x on {x.device}; both must be on one device")


def check_pattern_values(row_ptr, col_idx, K: int, block_size: int) -> None:
    """The block-CSR pattern's values, where the CPU path reads them anyway: row_ptr from 0
    to nnz, nondecreasing; col_idx in [0, K / block_size), no repeat within a block row.
    ValueError naming the first bad entry (a wrapped negative index or a block dropped would
    otherwise give a plausible wrong result)."""
    name = "block_sparse_logmatmul"
    ptr, cols = row_ptr.tolist(), col_idx.tolist()
    if ptr[0] != 0 or ptr[-1] != len(cols):
        raise ValueError(f"{name}: row_ptr must run from 0 to nnz = {len(cols)}; got {ptr[0]} .. {ptr[-1]}")
    for r in range(len(ptr) - 1):
        if ptr[r] > ptr[r + 1]:
            raise ValueError(f"{name}: row_ptr must be nondecreasing; row_ptr[{r}] = {ptr[r]} > "
                             f"row_ptr[{r + 1}] = {ptr[r + 1]}")
    C = K // block_size
    for r in range(len(ptr) - 1):
        seen = set()
        for j in range(ptr[r], ptr[r + 1]):
            c = cols[j]
            if not 0 <= c < C:
                raise ValueError(f"{name}: col_idx[{j}] = {c} is outside [0, K / block_size = {C})")
            if c in seen:
                raise ValueError(f"{name}: col_idx[{j}] = {c} repeats a column of block row {r}")
            seen.add(c)


def check_block_sparse(x, blocks, row_ptr, col_idx, block_size) -> None:
    """blocks [nnz, bs, bs] (float32 or x's dtype), row_ptr [N/bs + 1], col_idx [nnz]
    (int32 or int64), block_size a power of two >= 32 dividing K."""
    name = "block_sparse_logmatmul"
    if isinstance(block_size, bool) or not isinstance(block_size, (int, torch.SymInt)):  # (SymInt: compile)
        raise TypeError(f"{name}: block_size must be an int, got {type(block_size).__name__}")
    if block_size < 32 or block_size & (block_size - 1):
        raise ValueError(f"{name}: block_size must be a power of two >= 32, got {block_size}")
    for arg, t in (("x", x), ("blocks", blocks), ("row_ptr", row_ptr), ("col_idx", col_idx)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a tensor, got {type(t).__name__}")
    if x.dtype not in X_DTYPES:
        raise TypeError(f"{name}: x has dtype {x.dtype}; supported: float32, bfloat16, float16")
    if blocks.dtype not in (torch.float32, x.dtype):
        raise TypeError(f"{name}: blocks has dtype {blocks.dtype}; expected float32 or x's dtype ({x.dtype})")
    for arg, t in (("row_ptr", row_ptr), ("col_idx", col_idx)):
        if t.dtype not in _INDEX_DTYPES:
            raise TypeError(f"{name}: {arg} has dtype {t.dtype}; expected int32 or int64")
        if t.dim() != 1:
            raise ValueError(f"{name}: {arg} must be 1-D, got shape {tuple(t.shape)}")
    if x.dim() != 2:
        raise ValueError(f"{name}: x must be 2-D [B, K], got shape {tuple(x.shape)}")
    bs = block_size
    if blocks.dim() != 3 or blocks.shape[1:] != (bs, bs):
        raise ValueError(f"{name}: blocks must be [nnz, {bs}, {bs}], got shape {tuple(blocks.shape)}")
    if x.shape[1] % bs:
        raise ValueError(f"{name}: K = {x.shape[1]} is not a multiple of block_size {bs}")
    if row_ptr.shape[0] < 1:
        raise ValueError(f"{name}: row_ptr must hold N / block_size + 1 >= 1 entries")
    if col_idx.shape[0] != blocks.shape[0]:
        raise ValueError(f"{name}: col_idx has {col_idx.shape[0]} entries for {blocks.shape[0]} blocks")
    for arg, t in (("blocks", blocks), ("row_ptr", row_ptr), ("col_idx", col_idx)):
        if t.device != x.device:
            raise ValueError(f"{name}: {arg} is on {t.device}, x on {x.device}; all must be on one device")
