"""The interpolant ``(1 - alpha) A + alpha T(B)`` evaluated by the stock HF model, differentiably.

Learned matching trains the parameters of ``T`` through the loss of the interpolated model on
real batches (DESIGN §4). Nothing here re-implements a forward pass: the canonical tensors are
exported with the same code as :func:`hf_lmc.to_hf` (``hf_state_dict_groups``), and the stock
model class runs them through :func:`torch.func.functional_call`. Gradients flow into every
tensor a :class:`~hf_lmc.Transform` is built from (e.g. :mod:`hf_lmc.symmetry.params`).
"""

from __future__ import annotations

import copy

from torch import Tensor, nn
from torch.func import functional_call

from ..canonical import CanonicalModel, export_config, hf_state_dict_groups, interpolate, to_hf
from ..symmetry import Transform


class Interpolant(nn.Module):
    """Evaluate ``(1 - alpha) a + alpha transform(b)`` with the stock model class of ``a``.

    The template model (built once, like :func:`hf_lmc.to_hf`) only supplies the module
    structure and non-trainable buffers; its parameters are replaced on every call.
    """

    def __init__(self, a: CanonicalModel, b: CanonicalModel):
        super().__init__()
        if a.spec != b.spec:
            raise ValueError("the two canonical models differ in architecture or shape")
        # Tied embeddings cannot survive a learned transform of B: the interpolant is untied.
        config = copy.deepcopy(a.config)
        if hasattr(config, "tie_word_embeddings"):
            config.tie_word_embeddings = False
        self.a, self.b = CanonicalModel(a.spec, config, a.load_group), b
        self.config = export_config(self.a)
        template = to_hf(self.a)
        for p in template.parameters():
            p.requires_grad_(False)
        self.template = template

    def state(self, transform: Transform, alpha: float | Tensor, transform_a: Transform | None = None) -> dict[str, Tensor]:
        """The HF state dict of the interpolant (differentiable in the transforms and ``alpha``).

        ``transform_a`` moves A as well (dual matching); by default A stays as it is.
        """
        a = transform_a.apply(self.a) if transform_a is not None else self.a
        merged = interpolate(a, transform.apply(self.b), alpha)
        return {k: v for group in hf_state_dict_groups(merged, self.config) for k, v in group.items()}

    def forward(self, transform: Transform, alpha: float | Tensor, transform_a: Transform | None = None, **batch):
        state = self.state(transform, alpha, transform_a)
        return functional_call(self.template, state, args=(), kwargs=batch, tie_weights=False, strict=False)
