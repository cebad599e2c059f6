"""The path's losses take a causal LM's head a slice of positions at a time: the same loss and
gradients as the whole logits, and no tensor of tokens x vocabulary on the way."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_lmc.canonical.exactness import tiny_configs
from hf_lmc.evaluation import head_loss
from hf_lmc.evaluation.head_loss import VocabShard, mixture_loss, next_token_loss, sliced_cross_entropy
from hf_lmc.evaluation.loss import evaluate
from hf_lmc.learned.paths import DualMatcher, SimplexMatcher
from hf_lmc.learned.sharing import share_of
from tests.models import LargestOutput, build_model, causal_lm_loss, sample_inputs

LANGUAGE_MODELS = ["gpt2", "gpt_neox", "llama"]


def _grads(loss: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, tensors))


@pytest.mark.parametrize("rows", [1, 3, 7, None])
def test_sliced_cross_entropy_is_the_whole_cross_entropy_and_its_gradients(rows):
    """Soft targets, row weights with zeros, any slice size: value and both gradients as the
    whole ``softmax(h W^T)`` computes them (float64)."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(13, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    head = torch.randn(11, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    target = torch.randn(13, 11, dtype=torch.float64, generator=gen).softmax(-1)
    weights = torch.tensor([1, 0, 1, 1, 2, 1, 0, 1, 1, 1, 1, 0, 1], dtype=torch.float64)

    loss = sliced_cross_entropy(hidden, head, lambda start, stop, _: target[start:stop], weights, rows)
    per_row = -(target * (hidden @ head.T).log_softmax(-1)).sum(-1)
    expected = (weights * per_row).sum() / weights.sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-13)
    for got, want in zip(_grads(loss, hidden, head), _grads(expected, hidden, head)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    with torch.no_grad():  # no gradient asked: the same value
        assert sliced_cross_entropy(
            hidden, head, lambda start, stop, _: target[start:stop], weights, rows
        ).item() == pytest.approx(expected.item(), rel=1e-13)


def test_next_token_loss_is_the_causal_lm_loss():
    """Position i predicts label i + 1; ignored labels (-100) and the last position count for nothing."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 6, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    head = torch.randn(9, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    labels = torch.randint(0, 9, (2, 6), generator=gen)
    labels[0, 3] = labels[1, 1] = -100
    loss = next_token_loss(hidden, head, labels, rows=2)
    logits = hidden @ head.T
    expected = causal_lm_loss(logits, labels)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-13)
    for got, want in zip(_grads(loss, hidden, head), _grads(expected, hidden, head)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_mixture_loss_under_autocast_runs_the_products_in_autocast_dtype():
    """Under bfloat16 autocast the head's products run in bfloat16 (as the stock head's would)
    and the softmax in float32; the gradients come back in the inputs' dtypes."""
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 5, 8, generator=gen, requires_grad=True)
    head = torch.randn(16, 8, generator=gen, requires_grad=True)
    ends = [(torch.randn(2, 5, 8, generator=gen), torch.randn(16, 8, generator=gen)) for _ in range(2)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = mixture_loss(hidden, head, ends, (0.4, 0.6), rows=3)
    target = sum(w * (h.bfloat16() @ W.bfloat16().T).float().softmax(-1) for w, (h, W) in zip((0.4, 0.6), ends))
    expected = -(target * (hidden.bfloat16() @ head.bfloat16().T).float().log_softmax(-1)).sum(-1).mean()
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(expected.item(), rel=1e-5)
    grad_hidden, grad_head = _grads(loss, hidden, head)
    assert grad_hidden.dtype == grad_head.dtype == torch.float32
    torch.testing.assert_close(grad_head, _grads(expected, head)[0], rtol=2e-2, atol=1e-3)


def _dense_loss(matcher, batch, transforms, weights) -> torch.Tensor:
    """The path's loss computed from the stock model's whole logits (float64)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = matcher.interpolant.at(transforms, weights, **inputs).logits
    if matcher.objective == "labels":
        labels = batch.get("labels", batch["input_ids"])
        return causal_lm_loss(logits, labels)
    with torch.no_grad():
        target = sum(w * matcher.interpolant.endpoint(k, **inputs).logits.softmax(-1) for k, w in enumerate(weights))
    return -(target * logits.log_softmax(-1)).sum(-1).mean()


@pytest.mark.parametrize("objective", ["labels", "ensemble"])
@pytest.mark.parametrize("arch", LANGUAGE_MODELS)
def test_path_loss_and_gradients_are_those_of_the_whole_logits(arch, objective, monkeypatch):
    """Every causal LM family, both objectives, slices of 3 positions: the matcher's loss and the
    gradients of every trained parameter are those of the stock model's whole logits."""
    config = tiny_configs()[arch]
    monkeypatch.setattr(head_loss, "SLICE_BYTES", 4 * 3 * config.vocab_size)
    matcher = DualMatcher(
        build_model(config, seed=1), build_model(config, seed=2), objective=objective, dtype=torch.float64
    )
    batch = dict(sample_inputs(config, dtype=torch.float64, batch=3))
    weights = (0.6, 0.4)
    parameters = [p for p in matcher.parameters() if p.requires_grad]

    loss = matcher._point_loss(batch, matcher._path(), weights)
    expected = _dense_loss(matcher, batch, matcher._path(), weights)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    got, want = _grads(loss, *parameters), _grads(expected, *parameters)
    assert max((g - w).abs().max() / w.abs().max().clamp_min(1e-30) for g, w in zip(got, want)) < 1e-10
    assert any(w.abs().max() > 0 for w in want)


@pytest.mark.parametrize("objective", ["labels", "ensemble"])
def test_a_step_never_holds_the_tokens_by_vocabulary_logits(objective, monkeypatch):
    """A training step (forward and backward) and the worst-point search of a causal LM with a
    vocabulary far wider than the model: no operator returns a tensor of tokens x vocabulary
    elements (the whole logits are 20 times the next largest tensor here)."""
    config = tiny_configs()["llama"]
    config.vocab_size = 2048
    models = [build_model(config, seed=s, dtype=torch.float32) for s in (1, 2)]
    matcher = DualMatcher(*models, objective=objective, dtype=torch.float32)
    batch = {"input_ids": torch.randint(0, 2048, (4, 16), generator=torch.Generator().manual_seed(0))}
    tokens_by_vocabulary = batch["input_ids"].numel() * config.vocab_size
    monkeypatch.setattr(head_loss, "SLICE_BYTES", 4 * 8 * config.vocab_size)  # 8 positions a slice
    with LargestOutput() as watch:
        matcher(batch, alpha=0.5).backward()
        matcher.locate_worst([batch])
    assert watch.largest < tokens_by_vocabulary / 4
    with LargestOutput() as whole:  # the stock model's forward does hold them: the watch can see them
        models[0](**batch)
    assert whole.largest >= tokens_by_vocabulary


def test_simplex_loss_mixes_every_endpoint_a_slice_at_a_time(monkeypatch):
    config = tiny_configs()["gpt2"]
    monkeypatch.setattr(head_loss, "SLICE_BYTES", 4 * 5 * config.vocab_size)
    models = [build_model(config, seed=s) for s in (1, 2, 3)]
    matcher = SimplexMatcher(models, init="identity", objective="ensemble", dtype=torch.float64)
    inputs = dict(sample_inputs(config, dtype=torch.float64, batch=3))
    weights = (0.5, 0.3, 0.2)
    with torch.no_grad():
        transforms = [t() for t in matcher.learned]
        expected = _dense_loss(matcher, inputs, transforms, weights)
        assert matcher(inputs, weights=weights).item() == pytest.approx(expected.item(), rel=1e-12)


@pytest.mark.parametrize("arch", LANGUAGE_MODELS)
def test_evaluation_loss_is_the_stock_models_loss(arch, monkeypatch):
    """``evaluate`` of a causal LM, its head taken 3 positions at a time: the token-weighted mean
    of the stock model's own next-token loss over batches of two sizes (float64)."""
    config = tiny_configs()[arch]
    monkeypatch.setattr(head_loss, "SLICE_BYTES", 4 * 3 * config.vocab_size)
    model = build_model(config)
    gen = torch.Generator().manual_seed(3)
    batches = [{"input_ids": torch.randint(0, config.vocab_size, (n, 7), generator=gen)} for n in (3, 1)]
    with torch.no_grad():
        sums = [causal_lm_loss(model(**b).logits, b["input_ids"]) * b["input_ids"][:, 1:].numel() for b in batches]
    expected = (sum(sums) / sum(b["input_ids"][:, 1:].numel() for b in batches)).item()
    assert evaluate(model, batches).loss == pytest.approx(expected, rel=1e-12)


def test_evaluation_never_holds_the_tokens_by_vocabulary_logits(monkeypatch):
    config = tiny_configs()["llama"]
    config.vocab_size = 2048
    model = build_model(config, dtype=torch.float32)
    batch = {"input_ids": torch.randint(0, 2048, (4, 16), generator=torch.Generator().manual_seed(0))}
    monkeypatch.setattr(head_loss, "SLICE_BYTES", 4 * 8 * config.vocab_size)
    with LargestOutput() as watch:
        evaluate(model, [batch])
    assert watch.largest < batch["input_ids"].numel() * config.vocab_size / 4


def _vocab_parallel_losses(rank: int, world: int, store: str) -> None:
    """One of ``world`` gloo processes: each with its own positions (a different number each),
    the losses on its rows of the head (:class:`VocabShard`) against the whole head's, in value
    and in the gradients of the processes' summed losses (the head's rows against the rows of
    the summed whole gradient, the hidden states against their own)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        vocab, d = 37, 8  # split unevenly over 2 and 3 processes
        shared = torch.Generator().manual_seed(0)  # the head and the endpoints: one on every process
        head = torch.randn(vocab, d, dtype=torch.float64, generator=shared)
        ends = [torch.randn(vocab, d, dtype=torch.float64, generator=shared) for _ in range(2)]
        own = torch.Generator().manual_seed(1 + rank)  # each process its own positions
        batch, seq = 2, 3 + rank
        hidden = torch.randn(batch, seq, d, dtype=torch.float64, generator=own)
        labels = torch.randint(0, vocab, (batch, seq), generator=own)
        labels[0, 1] = -100  # an ignored position
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[1, -1] = 0
        end_hidden = [torch.randn(batch, seq, d, dtype=torch.float64, generator=own) for _ in range(2)]
        rows = share_of(vocab, rank, world)
        losses = {
            "labels": lambda h, w: next_token_loss(h, w, labels, rows=2),
            "mixture": lambda h, w: mixture_loss(h, w, list(zip(end_hidden, ends)), (0.3, 0.7), mask, rows=2),
        }
        for name, loss in losses.items():
            results = []
            for parallel in (False, True):
                h, w = hidden.clone().requires_grad_(), head.clone().requires_grad_()
                part = w[rows] if parallel else w
                value = loss(
                    h, VocabShard(part, rows.start, vocab, dist.group.WORLD, rank, world) if parallel else part
                )
                value.backward()
                grad_w = w.grad.clone()
                dist.all_reduce(grad_w)  # the summed losses' gradient (only this process's rows when parallel)
                if parallel:
                    grad_w = w.grad[rows]
                else:
                    grad_w = grad_w[rows]
                results.append((value.detach(), h.grad, grad_w))
            (value, grad_h, grad_w), (value_p, grad_h_p, grad_w_p) = results
            torch.testing.assert_close(value_p, value, rtol=1e-12, atol=1e-12, msg=name)
            torch.testing.assert_close(grad_h_p, grad_h, rtol=1e-10, atol=1e-12, msg=name)
            torch.testing.assert_close(grad_w_p, grad_w, rtol=1e-10, atol=1e-12, msg=name)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_vocabulary_parallel_loss_is_the_whole_heads_loss_and_gradients(tmp_path_factory):
    """Under gloo at 2 and 3 processes (an uneven vocabulary, a different number of positions
    on each), both losses on each process's rows of the head equal the whole head's on its own
    positions, and so do the hidden states' gradients and the head rows' share of the summed
    gradient: the head need never be gathered."""
    for world in (2, 3):
        store = tmp_path_factory.mktemp("store") / "rendezvous"
        torch.multiprocessing.spawn(_vocab_parallel_losses, args=(world, str(store)), nprocs=world)
