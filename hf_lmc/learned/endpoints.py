"""The frozen endpoints of an interpolant: moved with it, and optionally sharded across processes by FSDP2.

The endpoints' canonical tensors are neither parameters nor buffers of the matcher. As buffers,
DDP would broadcast them from rank 0 before every forward (the whole models, every step, and
over any per-process shard), and state dicts and ``accelerator.save_state`` would hold them. So
an :class:`EndpointStore` keeps them, and the interpolant's ``nn.Module._apply`` maps them with
its own parameters: ``.to(device)`` (what ``accelerator.prepare`` calls), ``.double()`` and so on
move the endpoints too.

Sharding (the ZeRO-3 pattern for frozen weights) is PyTorch's FSDP2: each endpoint layer's
tensors are the frozen parameters of a small holder module passed to
:func:`torch.distributed.fsdp.fully_shard`, so each of N processes keeps a 1/N slice of them
(dim 0, padded) as FSDP2 keeps any parameter, optionally offloaded to CPU memory
(``CPUOffloadPolicy``) and gathered in a lower precision (``MixedPrecisionPolicy``). A layer is
gathered with the holder's explicit ``unshard()`` when the layer is built, and again when
gradient checkpointing rebuilds it in backward; the next layer in the direction of travel is
prefetched (``unshard(async_op=True)``) while this one computes. Embeddings and heads stay whole
(their tensors are needed through the whole step). Memory per process: 1/N of the endpoints'
layers, their embeddings and heads, and the gathered layer in flight beside the prefetched one.

The gathered tensors are copied out of FSDP2's buffer before it is resharded: FSDP2 frees that
buffer's storage in place on ``reshard()``, and a layer rebuilt in backward (or one that is not
checkpointed) is read by autograd after the call that built it, which only FSDP2's own module
hooks could time. FSDP2's hooks run on a module's ``forward``; the endpoints' holders have none
(the interpolant computes with the merged tensors, not with either endpoint's), so the copy is
the one place the store departs from FSDP2's usual path (docs/design.md §5).

All processes must build the same groups in the same order, which the data-parallel loop does
(and which makes ``merge()`` a collective: call it on every process).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from hf_lmc.canonical.form import CanonicalModel
from hf_lmc.canonical.spec import Group
from hf_lmc.learned.sharing import SHARED_MIN_NUMEL
from hf_lmc.utils.devices import launch_device, launched_count


@dataclass(frozen=True)
class EndpointSharding:
    """How the frozen endpoints are sharded across the processes of a launch (FSDP2's policies).

    Args:
        offload: keep each process's shards in CPU memory; a layer is copied to the device when
            it is gathered (``CPUOffloadPolicy``). Device memory then holds only embeddings,
            heads and the layers in flight. It works in a single process too (a mesh of one,
            on a one-process group that :func:`shard_mesh` sets up when there is none).
        dtype: gather the endpoint layers in this dtype, e.g. ``torch.bfloat16``: half the
            traffic of float32 (``MixedPrecisionPolicy``'s ``param_dtype``); the gathered
            tensors are cast back to the endpoints' dtype, so only their rounding changes.
            ``None``: the endpoints' own dtype.
        prefetch: gather the next layer while the current one computes.
        build: each of the N processes builds 1/N of the rows of every interpolated weight
            (layers, embeddings and heads) and all-gathers assemble them
            (:mod:`hf_lmc.learned.sharing`), instead of every process building all of them.
        share_from: with ``build``, the groups whose largest tensor has fewer elements are
            built whole by every process (their collectives would cost more than they save).
        layers: shard the endpoints' layers (off: every process keeps them whole, and with
            ``build`` only the build is shared: no gathers of the endpoints, where memory allows).
        vocab_parallel: with ``build``, a causal LM's head stays in each process's vocabulary
            rows and the loss runs vocabulary-parallel (:class:`~hf_lmc.evaluation.head_loss.VocabShard`)
            instead of the head being gathered: ``None`` decides per batch by which moves fewer
            bytes (:meth:`~hf_lmc.learned.interpolant.Interpolant._vocab_parallel`), ``True``
            and ``False`` always and never.
        tensor_parallel: with ``build``, a causal LM's layers run tensor-parallel where that
            moves fewer bytes: each process runs every linear at its built rows alone, on the
            launch's whole batch, and the attention on its heads and the MLP on its units with
            one sum after each (where the heads split evenly and the family allows), or the
            linears' outputs gathered instead of their weights
            (:mod:`hf_lmc.learned.tensor_parallel`): ``None`` decides per batch by bytes
            (:meth:`~hf_lmc.learned.interpolant.Interpolant._tensor_parallel`), ``True``
            wherever the processes' batches have one shape, ``False`` never.
    """

    offload: bool = False
    dtype: torch.dtype | None = None
    prefetch: bool = True
    build: bool = True
    layers: bool = True
    share_from: int = SHARED_MIN_NUMEL
    vocab_parallel: bool | None = None
    tensor_parallel: bool | None = None


def sharding_of(shard: bool | EndpointSharding) -> EndpointSharding | None:
    """``shard_endpoints`` as given to a matcher: ``True`` is the default :class:`EndpointSharding`."""
    if isinstance(shard, EndpointSharding):
        return shard
    return EndpointSharding() if shard else None


def shard_mesh(sharding: EndpointSharding | None):
    """The device mesh FSDP2 shards the endpoints over, or ``None`` (no sharding asked, or one
    process and nothing to offload).

    Offloading in a single process needs a mesh of one: without a process group, a one-process
    group is set up on an in-memory store (no network, no launcher).
    """
    if sharding is None:
        return None
    device_type = launch_device().type
    if not (dist.is_available() and dist.is_initialized()):
        if launched_count() > 1:
            raise RuntimeError(
                "shard_endpoints in a multi-process launch needs torch.distributed set up first: "
                "create the Accelerator (or call torch.distributed.init_process_group) before the matcher"
            )
        if not sharding.offload:
            return None
        dist.init_process_group(
            "nccl" if device_type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
        )
    if dist.get_world_size() == 1 and not sharding.offload:
        return None
    # A group of its own: endpoint gathers never queue behind (or between) DDP's gradient all-reduces.
    return DeviceMesh.from_group(dist.new_group(), device_type)


class _FrozenLayer(nn.Module):
    """One endpoint layer's canonical tensors as frozen parameters: what ``fully_shard`` shards.

    Canonical names hold dots, which parameter names cannot; ``names`` maps them to slots.
    """

    def __init__(self, tensors: dict[str, Tensor]):
        super().__init__()
        self.names = {name: f"t{i}" for i, name in enumerate(tensors)}
        self.dtypes = {name: t.dtype for name, t in tensors.items()}
        for name, t in tensors.items():
            self.register_parameter(self.names[name], nn.Parameter(t.detach(), requires_grad=False))

    def gathered(self) -> dict[str, Tensor]:
        """The layer's full tensors in their stored dtype, copied out of FSDP2's buffer (call
        between ``unshard`` and ``reshard``)."""
        return {
            name: getattr(self, slot).detach().to(self.dtypes[name], copy=True) for name, slot in self.names.items()
        }


class EndpointStore:
    """One endpoint's canonical tensors, whole or (with a ``mesh``) its layers sharded by FSDP2.

    ``canonical()`` is a :class:`CanonicalModel` over the store; with a mesh each layer's
    ``group()`` call is a collective (FSDP2's all-gather).
    """

    def __init__(self, model: CanonicalModel, mesh=None, sharding: EndpointSharding | None = None):
        self.spec, self.config = model.spec, model.config
        self.mesh, self.sharding = mesh, (sharding if mesh is not None else None)
        self.tensors: dict[Group, dict[str, Tensor]] = {}  # whole groups
        self.layers: dict[int, nn.Module] = {}  # sharded layers, as FSDP2 modules
        self._prefetched: int | None = None  # the layer whose gather is in flight (``_handle``)
        self._handle = None
        self._last: int | None = None  # the layer loaded last: gives the direction of travel
        for group, tensors in model.groups():
            # Only layers are sharded: the embedding and head groups are used (and kept for the
            # residual map's gradient) through the whole step, so a gathered copy of them would
            # be alive at the peak beside the shard, and sharding them would save nothing.
            if self.sharded(group):
                self.layers[group] = self._shard(tensors)
            else:
                self.tensors[group] = tensors

    def largest(self, group: Group) -> int:
        """Elements of ``group``'s largest tensor (the whole tensor's, also when sharded)."""
        return max(shape.numel() for shape in self.shapes(group).values())

    def shapes(self, group: Group) -> dict[str, torch.Size]:
        """The whole shapes of ``group``'s tensors (also when sharded: no gather)."""
        if self.sharded(group):
            layer = self.layers[group]
            return {name: getattr(layer, slot).shape for name, slot in layer.names.items()}
        return {name: t.shape for name, t in self.tensors[group].items()}

    def sharded(self, group: Group) -> bool:
        """Whether FSDP2 keeps ``group``: layers, when sharded across processes (or offloaded)."""
        return isinstance(group, int) and self.mesh is not None

    def _shard(self, tensors: dict[str, Tensor]) -> nn.Module:
        sharding = self.sharding
        layer = _FrozenLayer(tensors)
        tensors.clear()  # the holder has the only reference: sharding frees the whole tensors
        offload = CPUOffloadPolicy(pin_memory=self.mesh.device_type == "cuda") if sharding.offload else OffloadPolicy()
        fully_shard(
            layer,
            mesh=self.mesh,
            reshard_after_forward=True,
            offload_policy=offload,
            mp_policy=MixedPrecisionPolicy(param_dtype=sharding.dtype),
        )
        return layer

    def _gather(self, group: int) -> dict[str, Tensor]:
        """Layer ``group``'s full tensors: its gather waited on (or started), copied, resharded; the
        next layer's gather started."""
        layer = self.layers[group]
        if self._prefetched == group:
            self._handle.wait()
            self._prefetched = None
        else:
            self._settle()  # a wrong guess (or none): let it go
            layer.unshard()
        tensors = layer.gathered()
        layer.reshard()
        step = 1 if self._last is None or group > self._last else -1  # backward rebuilds the layers in reverse
        self._last = group
        if self.sharding.prefetch and group + step in self.layers:
            self._handle = self.layers[group + step].unshard(async_op=True)
            self._prefetched = group + step
        return tensors

    def load(self, group: Group, rows: slice | None = None) -> dict[str, Tensor]:
        if self.sharded(group):
            tensors = self._gather(group)
        else:
            tensors = dict(self.tensors[group])  # a fresh dict: callers may empty it
        if rows is not None:
            token_rows = self.spec.token_row_names()
            tensors = {name: t[rows] if name in token_rows else t for name, t in tensors.items()}
        return tensors

    def canonical(self) -> CanonicalModel:
        return CanonicalModel(self.spec, self.config, self.load)

    def apply(self, fn: Callable[[Tensor], Tensor]) -> None:
        """Map every stored tensor through ``fn``, as ``nn.Module._apply`` does parameters.

        Sharded layers take only the dtype ``fn`` gives (re-sharded in it: a collective): FSDP2
        placed them (on this process's device, or in CPU memory when offloaded) and gathers them
        onto the device.
        """
        for tensors in self.tensors.values():
            for name, t in tensors.items():
                tensors[name] = fn(t)
        self._settle()
        for group, layer in self.layers.items():
            moved = {
                dtype: fn(torch.empty(0, dtype=dtype)).dtype for dtype in set(layer.dtypes.values())
            }  # what fn makes of each dtype
            if any(new != old for old, new in moved.items()):
                # Sharded afresh in the new dtype: FSDP2 keeps its gather buffers in the dtype it
                # first gathered in. A collective, one layer at a time.
                layer.unshard()
                tensors = {name: t.to(moved[t.dtype]) for name, t in layer.gathered().items()}
                layer.reshard()
                self.layers[group] = self._shard(tensors)

    def _settle(self) -> None:
        """Finish and drop a prefetched gather (before the shards change)."""
        if self._prefetched is not None:
            self._handle.wait()
            self.layers[self._prefetched].reshard()
            self._prefetched = None

    def local_numel(self) -> int:
        """Elements this process holds (sharded over N: 1/N of the layers' rows plus padding,
        and the whole embedding and head)."""
        whole = sum(t.numel() for tensors in self.tensors.values() for t in tensors.values())
        return whole + sum(p.to_local().numel() for layer in self.layers.values() for p in layer.parameters())
