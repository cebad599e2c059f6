"""The interpolated weights built once per launch, not once per process: each of N processes
computes 1/N of every group's rows and all-gathers assemble them.

Without it every data-parallel process builds all of every layer's interpolated weights (both
endpoints' maps applied to every weight, three times a step with layer checkpointing), work
that does not depend on the tokens, so more processes add tokens per step but no speed. With
it, for a group of canonical tensors at a point ``sum_k w_k T_k(m_k)``:

1. every process reads the endpoints' tensors whole (FSDP2's gather of the frozen layer, as
   without it: no gradient, prefetched, in the gather dtype);
2. it computes only its rows of each merged tensor, ``sum_k w_k T_k(W_k)[rows]``
   (:meth:`~hf_lmc.Transform.apply_rows`: the first axis's map for those rows, the other axes
   within them), its share being ``torch.chunk``'s (the rows FSDP2 would hold);
3. all-gathers assemble the merged tensors, each issued as soon as its rows are computed so
   that it travels while the next tensor is built, and in backward their adjoints,
   reduce-scatters summing every process's gradient, hand each process the gradient of its rows.

Each process's transforms then hold the gradient its rows contribute to the *sum* of the
processes' losses; DDP's mean of those over the processes is the mean of the processes'
gradients, exactly as when every process builds everything (in exact arithmetic; the sums run
in another order, so to rounding). The collectives are c10d's ``all_gather_single`` and
``reduce_scatter_single`` around a small autograd function: DTensor's ``full_tensor`` with a
``Partial`` gradient computes the same and was measured slower (docs/decisions.md#d-shared-build).
Every process must build the same groups in the same order, as the data-parallel loop does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

#: Groups whose largest tensor has fewer elements are built whole by every process: a shared
#: build's collectives there cost more than the arithmetic they save (docs/decisions.md#d-shared-build).
SHARED_MIN_NUMEL = 1 << 20


def share_of(size: int, rank: int, count: int) -> slice:
    """Process ``rank``'s rows of ``size`` split ``count`` ways as ``torch.chunk`` (and FSDP2)
    split them: ``ceil(size / count)`` each, the last ones shorter or empty."""
    chunk = -(-size // count)
    return slice(min(rank * chunk, size), min((rank + 1) * chunk, size))


def owner_of(row: int, size: int, count: int) -> int:
    """The process whose :func:`share_of` of ``size`` rows split ``count`` ways holds ``row``."""
    return row // -(-size // count)


class _Assembled(torch.autograd.Function):
    """The whole tensors a group's all-gathers are filling (issued on the rows as each was
    computed), once they are waited on; backward, a summing reduce-scatter of every tensor's
    gradient, all issued before any is waited on: one synchronisation per group, not one per
    tensor, so processes that run a little out of step wait once."""

    @staticmethod
    def forward(ctx, gathering: dict, *parts: Tensor):
        ctx.group, ctx.count = gathering["group"], gathering["count"]
        with gathering["waiting"]():
            for work in gathering["pending"]:
                work.wait()
        return tuple(gathering["wholes"])

    @staticmethod
    def backward(ctx, *grads: Tensor):
        shares, works = [], []
        for grad in grads:
            share = grad.new_empty((grad.shape[0] // ctx.count, *grad.shape[1:]))
            works.append(
                dist.reduce_scatter_single(
                    share, grad.contiguous(), op=dist.ReduceOp.SUM, group=ctx.group, async_op=True
                )
            )
            shares.append(share)
        for work in works:
            work.wait()
        return (None, *shares)


class RowSharing:
    """Build each process's rows of a group and gather the group whole, over ``mesh``'s processes.

    ``mesh``: a one-dimensional device mesh over the launch's processes (the one the endpoints
    are sharded over).
    """

    def __init__(self, mesh):
        self.group = mesh.get_group()
        self.rank, self.count = mesh.get_local_rank(), mesh.size()

    def rows(self, size: int) -> slice:
        """This process's rows of a tensor of ``size`` rows (its first axis)."""
        return share_of(size, self.rank, self.count)

    def gather_rows(self, part: Tensor, size: int) -> Tensor:
        """The whole ``size``-row tensor from every process's rows of it (``part``, its
        :meth:`rows`-share), differentiable as :meth:`gather` is: for the transforms'
        parameterisation, whose batched maps each process computes a share of."""
        return self.gather([("", part, torch.Size((size, *part.shape[1:])))])[""]

    def gather(
        self, parts: Iterable[tuple[str, Tensor, torch.Size]], waiting=contextlib.nullcontext
    ) -> dict[str, Tensor]:
        """The whole tensors from every process's rows of each: ``parts`` yields ``(name, rows,
        whole shape)``, and each tensor's all-gather is issued as soon as it is yielded, so it
        travels while the next one is computed (on GPUs, NCCL's stream beside the compute);
        all are waited on before the tensors are returned. Differentiable: backward, one
        reduce-scatter per tensor, all in flight together. A tensor whose rows do not split
        evenly travels padded. ``waiting()``: a context the wait runs in (the interpolant's
        clock times it)."""
        names, shapes, shares, wholes, pending = [], [], [], [], []
        for name, part, shape in parts:
            chunk = -(-shape[0] // self.count)
            if part.shape[0] < chunk:  # the last shares of an uneven split
                part = torch.cat([part, part.new_zeros((chunk - part.shape[0], *part.shape[1:]))])
            whole = part.new_empty((self.count * chunk, *part.shape[1:]))
            pending.append(dist.all_gather_single(whole, part.detach().contiguous(), group=self.group, async_op=True))
            names.append(name)
            shapes.append(shape)
            shares.append(part)
            wholes.append(whole)
        if not shares:
            return {}
        gathering = {"group": self.group, "count": self.count, "pending": pending, "wholes": wholes, "waiting": waiting}
        assembled = _Assembled.apply(gathering, *shares)
        return {
            name: whole if whole.shape[0] == shape[0] else whole[: shape[0]]
            for name, whole, shape in zip(names, assembled, shapes)
        }


def sharing_mesh(mesh) -> RowSharing | None:
    """The row sharing over ``mesh``, or ``None`` where there is nothing to share (no mesh, or
    a mesh of one process: an offload-only launch)."""
    if mesh is None or not dist.is_initialized() or mesh.size() == 1:
        return None
    return RowSharing(mesh)
