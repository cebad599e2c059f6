"""The loss of a model on held-out batches (:mod:`hf_lmc.evaluation.batches` loads them).

Mean cross-entropy, token-weighted for language models and with accuracy for classifiers: what
the barrier along a path (:mod:`hf_lmc.evaluation.barriers`) and its explanation (:mod:`hf_lmc.evaluation.explain`)
measure at every point.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from hf_lmc.canonical.adapters import ADAPTERS
from hf_lmc.evaluation.batches import Batch, DataError
from hf_lmc.evaluation.head_loss import next_token_loss, vocabulary_head_key


@dataclass(frozen=True)
class EvalResult:
    loss: float
    accuracy: float | None = None


def _vocabulary_head(model: PreTrainedModel) -> torch.Tensor | None:
    """The output embedding of a supported language model, whose logits are exactly that
    bias-free map of its base model's last hidden states; ``None`` for ViT and other classes."""
    adapter = ADAPTERS.get(getattr(model.config, "model_type", None))
    if adapter is None or adapter.takes_images or vocabulary_head_key(model) is None:
        return None
    return model.get_output_embeddings().weight.detach()


@torch.no_grad()
def evaluate(model: PreTrainedModel, batches: Iterable[Batch]) -> EvalResult:
    """Mean cross-entropy (token-weighted for LMs) and, for classifiers, accuracy.

    A supported language model's loss is taken from its last hidden states and head a slice of
    positions at a time (:func:`hf_lmc.evaluation.head_loss.next_token_loss`), in its own dtype with the
    softmax in float32 or wider, so the tokens x vocabulary logits are never held whole.
    """
    model.eval()
    device = next(model.parameters()).device
    head = _vocabulary_head(model)
    total, count, correct = 0.0, 0, 0
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        if "input_ids" in batch:
            ids = batch["input_ids"]
            targets = ids.numel() - ids.shape[0]  # every position but the last predicts the next token
            if head is not None:
                hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state
                total += next_token_loss(hidden, head, ids).item() * targets
            else:
                logits = model(input_ids=ids).logits[:, :-1]
                total += F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1), reduction="sum"
                ).item()
            count += targets
        else:
            logits = model(pixel_values=batch["pixel_values"].to(model.dtype)).logits
            total += F.cross_entropy(logits.float(), batch["labels"], reduction="sum").item()
            correct += (logits.argmax(-1) == batch["labels"]).sum().item()
            count += batch["labels"].numel()
    if count == 0:
        raise DataError("evaluation data is empty")
    loss = total / count
    if not math.isfinite(loss):
        raise DataError("evaluation loss is not finite")
    return EvalResult(loss, correct / count if "input_ids" not in batch else None)
