"""The cross-entropy of a language model's head, taken over slices of positions (docs/design.md §5).

A point of the path predicts ``softmax(h W^T)`` at every position, from its last hidden states
``h`` (T x d, after the final norm) and its output embedding ``W`` (V x d). Computed whole, the
T x V logits are held several times over (the logits, their log-softmax, its gradient, and for
the ensemble objective each endpoint's logits and their mixture): at a vocabulary of 128256 and
4096 tokens a step, most of a step's memory. Here the positions are taken in slices of at most
:data:`SLICE_BYTES` of float32 logits. Each slice's gradient with respect to ``h`` and ``W`` is
computed in the forward, where the slice's softmax is at hand (``dL/dz = (softmax(z) - t) m / n``),
so no T x V tensor is ever alive and no slice is recomputed in backward.

The path's losses (:mod:`hf_lmc.matching.learned`) and the held-out evaluation
(:func:`hf_lmc.evaluation.evaluate`) both take it.

This is the fused linear cross-entropy of Liger Kernel and Apple's Cut Cross-Entropy. Both are
Triton kernels for GPUs with one-hot labels; the path's losses must also run on CPUs, under
autocast, and against a soft target (the endpoints' mixture), hence this version in torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
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
        saved = iter(ctx.saved_tensors)
        grads = [
            (next(saved) * grad_output).to(dtype) if wants else None for wants, dtype in zip(ctx.wants, ctx.dtypes)
        ]
        return grads[0], grads[1], None, None, None


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
    hidden: Tensor, head: Tensor, labels: Tensor, ignore_index: int = -100, rows: int | None = None
) -> Tensor:
    """A causal LM's loss as its HF class computes it (position i predicts ``labels[i + 1]``;
    ``ignore_index`` labels and the last position count for nothing), from ``B x S x d`` hidden
    states and the head, a slice of positions at a time."""
    hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    labels = labels[:, 1:].reshape(-1).to(hidden.device)
    keep = labels != ignore_index
    index = labels.clamp_min(0)  # an ignored row's index is never read: its weight is 0
    return sliced_cross_entropy(hidden, head, lambda start, stop, _: index[start:stop], keep, rows)


def mixture_loss(
    hidden: Tensor,
    head: Tensor,
    endpoints: Sequence[tuple[Tensor, Tensor]],
    weights: Sequence[float | Tensor],
    mask: Tensor | None = None,
    rows: int | None = None,
) -> Tensor:
    """The cross-entropy of the point's predictions to ``sum_k w_k softmax(h_k W_k^T)``, the
    endpoints' predictions mixed at ``weights``, at every position (``mask`` weighs them, as an
    attention mask does), a slice of positions at a time.

    ``endpoints``: each endpoint's ``(hidden, head)``, the hidden states ``B x S x d`` as
    ``hidden``'s; they carry no gradient.
    """
    d = hidden.shape[-1]
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

    row_weights = torch.ones(hidden.shape[:-1], dtype=torch.bool, device=hidden.device) if mask is None else mask
    return sliced_cross_entropy(hidden.reshape(-1, d), head, mixture, row_weights.reshape(-1).to(hidden.device), rows)


def vocabulary_head_key(model: nn.Module) -> str | None:
    """The state-dict key of ``model``'s output embedding when it is a bias-free linear map of
    the base model's last hidden states (GPT-2, GPT-NeoX, LLaMA); ``None`` otherwise."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.bias is not None:
        return None
    return next(f"{name}.weight" for name, module in model.named_modules() if module is head)
