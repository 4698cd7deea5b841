"""All-reduce (SUM) of sparse COO tensors over the engine, with ProcessGroupGloo's result.

Like gloo: a rank's input list is summed locally, then every rank gathers every rank's
(indices, values) and adds them up; the coalesced sum is copied into every input tensor.
Three engine all_gathers carry it: a fixed-size header (nnz, sparse dims, sizes), then the
indices and the values, each padded to the largest nnz so that every rank moves the same
number of bytes (the engine's fingerprints require equal counts).
"""

import numpy as np
import torch

__all__ = ["allreduce_sum"]


def _header(t):
    """int64 [nnz, sparse_dim, dense_dim, ndim, *sizes] of a coalesced sparse tensor."""
    return np.array([t._nnz(), t.sparse_dim(), t.dense_dim(), t.dim(), *t.shape], np.int64)


def _as_bytes(t):
    """Flat uint8 numpy view of a contiguous tensor (any dtype, bf16/bool included)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return flat.numpy()


def allreduce_sum(group, tensors, timeout_s, name="allreduce"):
    """Sum sparse COO `tensors` (one rank's list) over all ranks of the engine `group`,
    in place (every tensor gets the coalesced total). Runs inside the group's executor."""
    local = tensors[0].detach()
    for t in tensors[1:]:
        local = local + t.detach()
    local = local.coalesce()
    ws = group.world_size
    header = _header(local)
    headers = np.zeros((ws, header.size), np.int64)
    group.all_gather(headers, header, timeout_s)
    for r in range(ws):
        if not np.array_equal(headers[r, 1:], header[1:]):
            raise RuntimeError(
                f"ProcessGroupShm::{name}: invalid tensor size: rank {group.rank} has a sparse "
                f"tensor of size {list(local.shape)} (sparse dims {local.sparse_dim()}), rank "
                f"{r} has size {headers[r, 4:].tolist()} (sparse dims {int(headers[r, 1])})")
    nnzs = headers[:, 0]
    max_nnz = int(nnzs.max())
    sparse_dim = local.sparse_dim()
    dense_shape = tuple(local.shape[sparse_dim:])
    values = local._values()
    indices = local._indices()
    nnz = int(header[0])

    idx_pad = torch.zeros((sparse_dim, max_nnz), dtype=torch.int64, device="cpu")
    idx_pad[:, :nnz] = indices
    idx_all = torch.empty((ws, sparse_dim, max_nnz), dtype=torch.int64, device="cpu")
    group.all_gather(idx_all.numpy(), idx_pad.numpy(), timeout_s)

    val_pad = torch.zeros((max_nnz,) + dense_shape, dtype=values.dtype, device="cpu")
    val_pad[:nnz] = values
    val_all = torch.empty((ws, max_nnz) + dense_shape, dtype=values.dtype, device="cpu")
    group.all_gather(_as_bytes(val_all), _as_bytes(val_pad), timeout_s)

    all_idx = torch.cat([idx_all[r, :, :int(nnzs[r])] for r in range(ws)], dim=1)
    all_val = torch.cat([val_all[r, :int(nnzs[r])] for r in range(ws)], dim=0)
    total = torch.sparse_coo_tensor(all_idx, all_val, local.shape,
                                    dtype=values.dtype, device="cpu").coalesce()
    with torch.no_grad():
        for t in tensors:
            t.copy_(total)
    return total
