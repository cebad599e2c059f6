"""The cross-entropy of a language model's head, taken over slices of positions (docs/design.md §5).

A point of the path predicts ``softmax(h W^T)`` at every position, from its last hidden states
``h`` (T x d, after the final norm) and its output embedding ``W`` (V x d). Computed whole, the
T x V logits are held several times over (the logits, their log-softmax, its gradient, and for
the ensemble objective each endpoint's logits and their mixture): at a vocabulary of 128256 and
4096 tokens a step, most of a step's memory. Here the positions are taken in slices of at most
:data:`SLICE_BYTES` of float32 logits. Each slice's gradient with respect to ``h`` and ``W`` is
computed in the forward, where the slice's softmax is at hand (``dL/dz = (softmax(z) - t) m / n``),
so no T x V tensor is ever alive and no slice is recomputed in backward.

The path's losses (:mod:`hf_lmc.learned.paths`) and the held-out evaluation
(:func:`hf_lmc.evaluation.loss.evaluate`) both take it.

This is the fused linear cross-entropy of Liger Kernel and Apple's Cut Cross-Entropy. Both are
Triton kernels for GPUs with one-hot labels; the path's losses must also run on CPUs, under
autocast, and against a soft target (the endpoints' mixture), hence this version in torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

#: The most bytes one slice's float32 logits take: the slice is ``SLICE_BYTES // (4 V)``
#: positions (at least one), 261 at a vocabulary of 128256, all of them at a character vocabulary.
#: The loss holds three such buffers at most. Smaller slices would save little more and make a
#: GPU's product of a slice with the head (which reads the whole head each time) wait on memory
#: bandwidth rather than arithmetic.
SLICE_BYTES = 1 << 27

#: ``target(start, stop, logits)``: the slice's targets, either distributions (``(stop - start) x V``,
#: float) or class indices (``stop - start``, integer). It must not keep ``logits``, whose memory
#: the loss reuses.
Target = Callable[[int, int, Tensor], Tensor]


def _wide_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def compute_dtype(hidden: Tensor, head: Tensor) -> torch.dtype:
    """The dtype of the head's products: autocast's where autocast is on (what the stock head's
    ``nn.Linear`` would use), otherwise the inputs'."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, head.dtype)


def _shifted_exp_(z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(e, sums, top)``: ``e = exp(z - max z)`` row by row, in ``z``'s memory, its row sums and
    the row maxima; ``softmax(z) = e / sums`` and ``logsumexp(z) = log(sums) + top``."""
    top = z.amax(-1, keepdim=True)
    e = z.sub_(top).exp_()
    return e, e.sum(-1, keepdim=True), top


def _slice(
    h: Tensor,
    weight: Tensor,
    target: Target,
    rows: slice,
    m: Tensor,
    count: Tensor,
    wide: torch.dtype,
    grads: tuple[Tensor | None, Tensor | None],
) -> Tensor:
    """One slice: its share of the loss's numerator, its gradients written into ``grads`` (the
    rows of ``dL/dh``, the sum ``dL/dW``). A function of its own so that the slice's buffers are
    freed when it returns, before the next slice allocates."""
    z = (h @ weight.T).to(wide)
    t = target(rows.start, rows.stop, z)
    if t.is_floating_point():  # distributions: <t, z> row by row, without a product the size of z
        dot = (t.unsqueeze(1) @ z.unsqueeze(2)).view(-1)
    else:  # class indices
        dot = z.gather(1, t[:, None]).view(-1)
    e, sums, top = _shifted_exp_(z)  # in z's memory: z is not needed again
    numerator = (m * (sums.log().add_(top).view(-1) - dot)).sum()  # log-normaliser minus <t, z>
    grad_hidden, grad_head = grads
    if grad_hidden is None and grad_head is None:
        return numerator
    g = e.div_(sums)  # softmax(z)
    if t.is_floating_point():
        g.sub_(t)
    else:
        g.scatter_add_(1, t[:, None], torch.full_like(dot[:, None], -1))
    del t
    g = g.mul_((m / count)[:, None]).to(weight.dtype)
    if grad_hidden is not None:
        grad_hidden.copy_(g @ weight)
    if grad_head is not None:  # accumulated in place where the dtypes allow: no second V x d buffer
        if g.dtype == grad_head.dtype:
            grad_head.addmm_(g.T, h)
        else:
            grad_head += g.T @ h
    return numerator


class _SlicedCrossEntropy(torch.autograd.Function):
    """``sum_i m_i CE(t_i, softmax(h_i W^T)) / sum_i m_i``, its gradients computed slice by slice in the forward."""

    @staticmethod
    def forward(ctx, hidden: Tensor, head: Tensor, row_weights: Tensor, target: Target, rows: int) -> Tensor:
        compute = compute_dtype(hidden, head)
        wide = _wide_dtype(compute)
        wants_hidden, wants_head = ctx.needs_input_grad[:2]
        grad_hidden = torch.zeros(hidden.shape, dtype=wide, device=hidden.device) if wants_hidden else None
        grad_head = torch.zeros(head.shape, dtype=wide, device=head.device) if wants_head else None
        total = torch.zeros((), dtype=wide, device=hidden.device)
        count = row_weights.sum(dtype=wide)
        with torch.autocast(hidden.device.type, enabled=False):  # the dtypes are explicit here
            weight = head.to(compute)  # cast once, not once a slice
            for start in range(0, hidden.shape[0], rows):
                stop = min(start + rows, hidden.shape[0])
                grads = (grad_hidden[start:stop] if wants_hidden else None, grad_head)
                total += _slice(
                    hidden[start:stop].to(compute),
                    weight,
                    target,
                    slice(start, stop),
                    row_weights[start:stop].to(wide),
                    count,
                    wide,
                    grads,
                )
        ctx.save_for_backward(*(x for x in (grad_hidden, grad_head) if x is not None))
        ctx.wants = (wants_hidden, wants_head)
        ctx.dtypes = (hidden.dtype, head.dtype)
        return total / count

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        return *_forward_gradients(ctx, grad_output), None, None, None


def _forward_gradients(ctx, grad_output: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """The hidden states' and the head's gradients, computed in the forward and saved on ``ctx``
    (``None`` where not wanted), scaled by ``grad_output`` and cast to their inputs' dtypes."""
    saved = iter(ctx.saved_tensors)
    hidden, head = (
        (next(saved) * grad_output).to(dtype) if wants else None for wants, dtype in zip(ctx.wants, ctx.dtypes)
    )
    return hidden, head


@dataclass(frozen=True)
class VocabShard:
    """This process's rows of a head whose vocabulary is split over a process group: rows
    ``start`` to ``start + len(weight)`` of the ``size x d`` head, the others held by the
    group's other processes (as ``torch.chunk`` splits them).

    A loss given one (:func:`next_token_loss`, :func:`mixture_loss`) is *vocabulary-parallel*:
    every process takes the logits of its vocabulary rows at every process's positions, the
    softmax's normalisers are combined across the group, and each process's loss and gradients
    are those of the whole head on its own positions, while the head itself is never gathered
    (its rows' gradient is their gradient summed over the processes' losses, as a shared
    build's reduce-scatter gives it). Every process of ``group`` must call the loss together,
    with losses the caller scales alike (as data-parallel training does).
    """

    weight: Tensor
    start: int
    size: int
    group: object
    rank: int
    count: int

    def rows_of(self, head: Tensor | VocabShard) -> Tensor:
        """The same rows of another head (an endpoint's): of a whole ``size x d`` one, or of
        this process's share of it in the same split."""
        if isinstance(head, VocabShard):
            if (head.start, head.size, head.weight.shape) != (self.start, self.size, self.weight.shape):
                raise ValueError("the heads are split differently over the processes")
            return head.weight
        return head[self.start : self.start + self.weight.shape[0]]

    @property
    def slice_vocabulary(self) -> int:
        """The most vocabulary rows any process holds: every process slices its positions by it,
        so all take the same slices (each is a collective)."""
        return -(-self.size // self.count)


def _gather_positions(x: Tensor, longest: int, shard: VocabShard) -> Tensor:
    """Every process's ``x`` (positions first) stacked in rank order, each padded with zeros to
    ``longest`` positions: ``count * longest`` rows."""
    if x.shape[0] < longest:
        x = torch.cat([x, x.new_zeros((longest - x.shape[0], *x.shape[1:]))])
    out = x.new_empty((shard.count * longest, *x.shape[1:]))
    dist.all_gather_single(out, x.contiguous(), group=shard.group)
    return out


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """:class:`_SlicedCrossEntropy` with the head's vocabulary split over processes
    (:class:`VocabShard`): each slice of every process's positions against this process's
    rows, the log-normalisers combined by an all-gather of each row's local ``logsumexp``,
    the per-process loss sums by one all-reduce, the hidden states' gradient by a
    reduce-scatter. ``plan(longest, compute, wide)`` gathers what the targets need (every
    process's labels, or its endpoints' hidden states) and returns ``targets(start, stop,
    logits)``: the slice's target over this process's vocabulary rows, a distribution (each
    endpoint normalised over the whole vocabulary) or an index into them (-1 where the label
    lies in another process's rows)."""

    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, row_weights: Tensor, shard: VocabShard, plan, rows: int | None
    ) -> Tensor:
        compute = compute_dtype(hidden, weight)
        wide = _wide_dtype(compute)
        wants_hidden, wants_head = ctx.needs_input_grad[:2]
        sizes = torch.tensor([hidden.shape[0]], device=hidden.device)
        every = sizes.new_empty(shard.count)
        dist.all_gather_single(every, sizes, group=shard.group)
        longest = int(every.max())
        with torch.autocast(hidden.device.type, enabled=False):
            h = _gather_positions(hidden.detach().to(compute), longest, shard)
            m = _gather_positions(row_weights.detach().to(wide), longest, shard)
            counts = m.view(shard.count, longest).sum(1)
            owner = torch.arange(shard.count, device=h.device).repeat_interleave(longest)
            scale = m / counts[owner]  # each position weighed within its own process's loss
            targets = plan(longest, compute, wide)
            w = weight.detach().to(compute)
            grad_h = torch.zeros(h.shape, dtype=wide, device=h.device) if wants_hidden else None
            grad_head = torch.zeros(weight.shape, dtype=wide, device=weight.device) if wants_head else None
            losses = torch.zeros(shard.count, dtype=wide, device=h.device)
            rows = rows or max(1, SLICE_BYTES // (4 * shard.slice_vocabulary))
            for start in range(0, h.shape[0], rows):
                stop = min(start + rows, h.shape[0])
                z = (h[start:stop] @ w.T).to(wide)
                t = targets(start, stop, z)
                if t.is_floating_point():
                    dot = (t.unsqueeze(1) @ z.unsqueeze(2)).view(-1)
                else:
                    here = t >= 0
                    dot = torch.where(here, z.gather(1, t.clamp_min(0)[:, None]).view(-1), 0.0)
                e, lse, top = _combined_shifted_exp_(z, shard)  # z's memory, read by dot already
                # each process adds its vocabulary's <t, z>; the normaliser once, by the row's owner
                own = owner[start:stop] == shard.rank
                part = scale[start:stop] * (torch.where(own, lse, 0.0) - dot)
                losses.index_add_(0, owner[start:stop], part)
                if grad_h is None and grad_head is None:
                    continue
                g = e.mul_((top - lse[:, None]).exp_())  # softmax(z) on this process's rows, in z's memory
                if t.is_floating_point():
                    g.sub_(t)
                else:  # -1 at the label where this process holds it (a mask, not nonzero(): no device sync)
                    g.scatter_add_(1, t.clamp_min(0)[:, None], here.to(g.dtype).neg_()[:, None])
                g = g.mul_(scale[start:stop, None]).to(w.dtype)
                if grad_h is not None:
                    grad_h[start:stop] = g @ w
                if grad_head is not None:
                    if g.dtype == grad_head.dtype:
                        grad_head.addmm_(g.T, h[start:stop])
                    else:
                        grad_head += g.T @ h[start:stop]
            dist.all_reduce(losses, group=shard.group)
            if grad_h is not None:  # each process's vocabulary's part of a position's gradient, summed at its owner
                mine = grad_h.new_empty((longest, *grad_h.shape[1:]))
                dist.reduce_scatter_single(mine, grad_h, group=shard.group)
                grad_h = mine[: hidden.shape[0]]
        ctx.save_for_backward(*(x for x in (grad_h, grad_head) if x is not None))
        ctx.wants = (wants_hidden, wants_head)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return losses[shard.rank]

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        return *_forward_gradients(ctx, grad_output), None, None, None, None


def _combined_shifted_exp_(z: Tensor, shard: VocabShard) -> tuple[Tensor, Tensor, Tensor]:
    """``(e, lse, top)`` for this process's logits ``z`` (its vocabulary rows): ``e = exp(z -
    top)`` in ``z``'s memory, ``top`` the rows' local maxima, and ``lse`` each row's
    ``logsumexp`` over the whole vocabulary, combined from every process's (one all-gather).
    The softmax over the whole vocabulary at this process's rows is ``e * exp(top - lse)``: one
    exponential of the logits, where ``logsumexp`` and then the softmax would take two."""
    if z.shape[1]:
        e, sums, top = _shifted_exp_(z)
        local = (sums.log_() + top).view(-1)
    else:  # no vocabulary rows here
        e, top = z, z.new_full((z.shape[0], 1), -torch.inf)
        local = top.view(-1)
    every = local.new_empty(shard.count * local.shape[0])
    dist.all_gather_single(every, local.contiguous(), group=shard.group)
    return e, torch.logsumexp(every.view(shard.count, -1), 0), top


def _vocab_parallel(hidden: Tensor, shard: VocabShard, row_weights: Tensor, plan, rows: int | None) -> Tensor:
    if hidden.dim() != 2 or shard.weight.dim() != 2 or hidden.shape[1] != shard.weight.shape[1]:
        raise ValueError(
            f"hidden (N x d) and head (V x d) must share d; got {tuple(hidden.shape)} and {tuple(shard.weight.shape)}"
        )
    return _VocabParallelCrossEntropy.apply(hidden, shard.weight, row_weights, shard, plan, rows)


def sliced_cross_entropy(
    hidden: Tensor, head: Tensor, target: Target, row_weights: Tensor, rows: int | None = None
) -> Tensor:
    """The mean cross-entropy, weighted by ``row_weights``, of ``softmax(hidden @ head.T)`` to
    ``target``, never holding more than one slice of the logits.

    Args:
        hidden: ``N x d`` hidden states (one row per position).
        head: ``V x d`` output embedding (no bias).
        target: called as ``target(start, stop, logits)`` with the slice's float32 (or wider)
            logits; returns the rows' targets without gradient: distributions
            (``(stop - start) x V``) or class indices (``stop - start``).
        row_weights: ``N`` weights of the rows (0 drops a row); the loss is divided by their sum.
        rows: positions per slice (default: :data:`SLICE_BYTES` of float32 logits).
    """
    if hidden.dim() != 2 or head.dim() != 2 or hidden.shape[1] != head.shape[1]:
        raise ValueError(
            f"hidden (N x d) and head (V x d) must share d; got {tuple(hidden.shape)} and {tuple(head.shape)}"
        )
    rows = rows or max(1, SLICE_BYTES // (4 * head.shape[0]))
    return _SlicedCrossEntropy.apply(hidden, head, row_weights, target, rows)


def next_token_loss(
    hidden: Tensor, head: Tensor | VocabShard, labels: Tensor, ignore_index: int = -100, rows: int | None = None
) -> Tensor:
    """A causal LM's loss as its HF class computes it (position i predicts ``labels[i + 1]``;
    ``ignore_index`` labels and the last position count for nothing), from ``B x S x d`` hidden
    states and the head (or this process's rows of it: :class:`VocabShard`), a slice of
    positions at a time."""
    hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    labels = labels[:, 1:].reshape(-1).to(hidden.device)
    keep = labels != ignore_index
    index = labels.clamp_min(0)  # an ignored row's index is never read: its weight is 0
    if not isinstance(head, VocabShard):
        return sliced_cross_entropy(hidden, head, lambda start, stop, _: index[start:stop], keep, rows)

    def plan(longest: int, compute: torch.dtype, wide: torch.dtype):
        every = _gather_positions(index, longest, head) - head.start
        local = torch.where((every >= 0) & (every < head.weight.shape[0]), every, -1)  # -1: another's row
        return lambda start, stop, _: local[start:stop]

    return _vocab_parallel(hidden, head, keep, plan, rows)


def mixture_loss(
    hidden: Tensor,
    head: Tensor | VocabShard,
    endpoints: Sequence[tuple[Tensor, Tensor]],
    weights: Sequence[float | Tensor],
    mask: Tensor | None = None,
    rows: int | None = None,
) -> Tensor:
    """The cross-entropy of the point's predictions to ``sum_k w_k softmax(h_k W_k^T)``, the
    endpoints' predictions mixed at ``weights``, at every position (``mask`` weighs them, as an
    attention mask does), a slice of positions at a time.

    ``endpoints``: each endpoint's ``(hidden, head)``, the hidden states ``B x S x d`` as
    ``hidden``'s; they carry no gradient. With ``head`` a :class:`VocabShard` the loss is
    vocabulary-parallel: each process takes its rows of the endpoints' heads (whole, or shards
    of the same split).
    """
    d = hidden.shape[-1]
    row_weights = torch.ones(hidden.shape[:-1], dtype=torch.bool, device=hidden.device) if mask is None else mask
    row_weights = row_weights.reshape(-1).to(hidden.device)
    if isinstance(head, VocabShard):
        return _vocab_parallel(hidden.reshape(-1, d), head, row_weights, _mixture_plan(head, endpoints, weights), rows)
    compute = compute_dtype(hidden, head)
    flat = [(h.detach().reshape(-1, d), w.detach().to(compute)) for h, w in endpoints]
    mix = [float(w) for w in weights]

    def mixture(start: int, stop: int, logits: Tensor) -> Tensor:
        target = None
        for (h, w), share in zip(flat, mix):
            e, sums, _ = _shifted_exp_((h[start:stop].to(compute) @ w.T).to(logits.dtype))
            p = e.div_(sums)  # the softmax in place: one slice-sized buffer per endpoint
            target = p.mul_(share) if target is None else target.add_(p, alpha=share)
        return target

    return sliced_cross_entropy(hidden.reshape(-1, d), head, mixture, row_weights, rows)


def _mixture_plan(shard: VocabShard, endpoints: Sequence[tuple[Tensor, Tensor]], weights: Sequence[float | Tensor]):
    """The vocabulary-parallel loss's targets: ``sum_k w_k softmax(h_k W_k^T)`` on this
    process's vocabulary rows, each endpoint's softmax normalised over the whole vocabulary."""
    mix = [float(w) for w in weights]

    def plan(longest: int, compute: torch.dtype, wide: torch.dtype):
        d = shard.weight.shape[1]
        flat = [
            (
                _gather_positions(h.detach().reshape(-1, d).to(compute), longest, shard),
                shard.rows_of(w).detach().to(compute),
            )
            for h, w in endpoints
        ]

        def mixture(start: int, stop: int, logits: Tensor) -> Tensor:
            target = None
            for (h, w), share in zip(flat, mix):
                z = (h[start:stop] @ w.T).to(logits.dtype)
                e, lse, top = _combined_shifted_exp_(z, shard)
                p = e.mul_((top - lse[:, None]).exp_())
                target = p.mul_(share) if target is None else target.add_(p, alpha=share)
            return target

        return mixture

    return plan


def vocabulary_head_key(model: nn.Module) -> str | None:
    """The state-dict key of ``model``'s output embedding when it is a bias-free linear map of
    the base model's last hidden states (GPT-2, GPT-NeoX, LLaMA); ``None`` otherwise."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.bias is not None:
        return None
    return next(f"{name}.weight" for name, module in model.named_modules() if module is head)
