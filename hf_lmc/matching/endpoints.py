"""The frozen endpoints of an interpolant: moved with it, and optionally sharded across processes.

The endpoints' canonical tensors are neither parameters nor buffers of the matcher. As buffers,
DDP would broadcast them from rank 0 before every forward (the whole models, every step, and
over any per-process shard), and state dicts and ``accelerator.save_state`` would hold them. So
an :class:`EndpointStore` keeps them, and the interpolant's ``nn.Module._apply`` maps them with
its own parameters: ``.to(device)`` (what ``accelerator.prepare`` calls), ``.double()`` and so on
move the endpoints too.

Sharding (the ZeRO-3 pattern for frozen weights): with a process group of N processes, each
process keeps a 1/N slice of every layer tensor (flattened and zero-padded to a multiple of N).
A layer's full tensors are all-gathered when it is built, and again when gradient checkpointing
rebuilds it in backward; they are dropped after use. Embedding and head stay whole (their
tensors are needed through the whole step). Memory per process: 1/N of the endpoints' layers,
their embeddings and heads, and the gathered tensors of the layer in flight. All processes must build the
same groups in the same order, which the data-parallel loop does (and which makes
``merge()`` a collective: call it on every process).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ..canonical import CanonicalModel
from ..devices import launched_count
from ..spec import Group


def shard_group(shard: bool):
    """The process group to shard endpoints over, or ``None`` (one process: nothing to shard)."""
    if not shard:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        if launched_count() > 1:
            raise RuntimeError(
                "shard_endpoints=True in a multi-process launch needs torch.distributed set up first: "
                "create the Accelerator (or call torch.distributed.init_process_group) before the matcher"
            )
        return None
    if dist.get_world_size() == 1:
        return None
    # A group of its own: endpoint gathers never queue behind (or between) DDP's gradient all-reduces.
    return dist.new_group()


def _all_gather(out: Tensor, shard: Tensor, group) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather(out, shard, group=group)


class EndpointStore:
    """One endpoint's canonical tensors, whole or as this process's shard.

    ``canonical()`` is a :class:`CanonicalModel` over the store; with a ``process_group`` each
    of its ``group()`` calls is a collective (an all-gather per tensor).
    """

    def __init__(self, model: CanonicalModel, process_group=None):
        self.spec, self.config = model.spec, model.config
        self.process_group = process_group
        self.world = dist.get_world_size(process_group) if process_group is not None else 1
        self.rank = dist.get_rank(process_group) if process_group is not None else 0
        self.shapes: dict[str, torch.Size] = {}
        self.tensors: dict[Group, dict[str, Tensor]] = {}
        for group, tensors in model.groups():
            # Only layers are sharded: the embedding and head groups are used (and kept for the
            # residual map's gradient) through the whole step, so a gathered copy of them would
            # be alive at the peak beside the shard, and sharding them would save nothing.
            self.tensors[group] = {name: self._shard(name, t) if self.sharded(group) else t for name, t in tensors.items()}

    def sharded(self, group: Group) -> bool:
        """Whether this process holds only a slice of ``group``: layers, when N > 1."""
        return isinstance(group, int) and self.world > 1

    def _shard(self, name: str, t: Tensor) -> Tensor:
        self.shapes[name] = t.shape  # the whole tensor's: gathers restore it
        flat = t.detach().reshape(-1)
        chunk = -(-flat.numel() // self.world)
        padded = torch.nn.functional.pad(flat, (0, chunk * self.world - flat.numel()))
        return padded[self.rank * chunk : (self.rank + 1) * chunk].clone()  # a copy: the full tensor can go

    def _gather(self, name: str, shard: Tensor) -> Tensor:
        out = torch.empty(shard.numel() * self.world, dtype=shard.dtype, device=shard.device)
        _all_gather(out, shard, self.process_group)
        shape = self.shapes[name]
        return out[: shape.numel()].view(shape)

    def load(self, group: Group, rows: slice | None = None) -> dict[str, Tensor]:
        tensors = self.tensors[group]
        if self.sharded(group):
            tensors = {name: self._gather(name, t) for name, t in tensors.items()}
        else:
            tensors = dict(tensors)  # a fresh dict: callers may empty it
        if rows is not None:
            token_rows = self.spec.token_row_names()
            tensors = {name: t[rows] if name in token_rows else t for name, t in tensors.items()}
        return tensors

    def canonical(self) -> CanonicalModel:
        return CanonicalModel(self.spec, self.config, self.load)

    def apply(self, fn: Callable[[Tensor], Tensor]) -> None:
        """Map every stored tensor (or shard) through ``fn``, as ``nn.Module._apply`` does parameters."""
        for tensors in self.tensors.values():
            for name, t in tensors.items():
                tensors[name] = fn(t)

    def local_numel(self) -> int:
        """Elements this process holds (sharded over N: 1/N of the layers plus padding, and the
        whole embedding and head)."""
        return sum(t.numel() for tensors in self.tensors.values() for t in tensors.values())
