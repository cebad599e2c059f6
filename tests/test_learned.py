"""Learned and dual matching: exact at a twin, lower interpolation loss after training, exact export."""

from __future__ import annotations

import inspect

import pytest
import torch

import hf_lmc
from hf_lmc.canonical.exactness import tiny_configs
from hf_lmc.learned.params import PermutationParam
from hf_lmc.learned.paths import WORST_GRID, DualMatcher, LearnedMatcher
from tests.models import build_model, causal_lm_loss, logits, relative_error, sample_inputs


def _train(matcher, batch, steps: int, lr: float = 1e-2) -> None:
    """Plain Adam on the interpolation loss at sampled weights (no ``fit``: the bare training-loop API)."""
    optimizer = torch.optim.Adam([p for p in matcher.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        loss = matcher(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def test_twin_stays_exact_from_weight_matching_init():
    config = tiny_configs()["gpt_neox"]
    model = build_model(config, seed=0, dtype=torch.float64)
    moved = hf_lmc.to_hf(
        hf_lmc.random_symmetry(hf_lmc.canonicalize(model).spec, seed=3).apply(hf_lmc.canonicalize(model))
    )
    matcher = DualMatcher(model, moved, objective="labels", dtype=torch.float64)
    inputs = sample_inputs(config)
    batch = {"input_ids": inputs["input_ids"]}
    expected = model(**batch, labels=batch["input_ids"]).loss
    assert abs(matcher(batch).item() - expected.item()) < 1e-5  # the twin's path is flat from the start
    assert relative_error(logits(matcher.merge(0.5), inputs), logits(model, inputs)) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("cls", [LearnedMatcher, DualMatcher])
def test_training_lowers_the_interpolation_loss_and_endpoints_stay_exact(cls):
    """Trained (straight-through) permutations; the fixed default has its own test below."""
    config = tiny_configs()["llama"]
    model_a, model_b = build_model(config, seed=1), build_model(config, seed=2)
    matcher = cls(model_a, model_b, permutations="ste", dtype=torch.float64)
    batch = {"input_ids": torch.randint(0, config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))}
    before = matcher(batch, alpha=0.5).item()
    trainable = [p for p in matcher.parameters() if p.requires_grad]
    assert trainable and not any(p.requires_grad for p in matcher.interpolant.template.parameters())
    _train(matcher, batch, steps=15)
    assert matcher(batch, alpha=0.5).item() < before
    inputs = sample_inputs(config)
    assert relative_error(logits(matcher.merge(0.0), inputs), logits(model_a, inputs)) < 1e-6
    assert relative_error(logits(matcher.merge(1.0), inputs), logits(model_b, inputs)) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("cls", [LearnedMatcher, DualMatcher])
@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "gpt2"])
def test_target_frame_starts_where_the_own_frame_does_and_exports_exact_endpoints(arch, cls):
    """``frame="target"`` changes where the trained factors sit, not the start or the group:
    the same merge before training, and exact symmetries of each endpoint after it (GPT-2: the
    residual map keeps fixing the all-ones direction LayerNorm centres on)."""
    config = tiny_configs()[arch]
    model_a, model_b = (
        build_model(config, seed=1, dtype=torch.float64),
        build_model(config, seed=2, dtype=torch.float64),
    )
    own = cls(model_a, model_b, dtype=torch.float64)
    target = cls(model_a, model_b, frame="target", dtype=torch.float64)
    inputs = sample_inputs(config)
    assert relative_error(logits(target.merge(0.5), inputs), logits(own.merge(0.5), inputs)) < 1e-10
    batch = {"input_ids": torch.randint(0, config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))}
    before = target(batch, alpha=0.5).item()
    _train(target, batch, steps=10)
    assert target(batch, alpha=0.5).item() < before
    assert relative_error(logits(target.merge(0.5), inputs), logits(own.merge(0.5), inputs)) > 1e-4  # it moved
    for alpha, endpoint in ((0.0, model_a), (1.0, model_b)):  # (HF LLaMA computes RoPE in float32)
        assert relative_error(logits(target.merge(alpha), inputs), logits(endpoint, inputs)) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "llama", "gpt_neox"])
def test_one_sided_matching_with_a_factor_on_each_side_takes_dual_matchings_steps(arch):
    """Dual matching's merge depends only on ``T_A^-1 T_B = f(A_A)^-1 M_0 f(A_B)`` (docs/design.md §4), and
    ``f(A)^-1 = f(-A)`` while Adam's step is odd in the gradient: one-sided matching with
    ``frame="both"`` (``f(L) M_0 f(A)``) follows dual matching step for step, ``L = -A_A``.
    The same batches and weight draws give the same losses and the same merged function; the
    own frame does not."""
    config = tiny_configs()[arch]
    model_a, model_b = (
        build_model(config, seed=1, dtype=torch.float64),
        build_model(config, seed=2, dtype=torch.float64),
    )
    batch = {"input_ids": torch.randint(0, config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))}

    def trained(matcher):
        torch.manual_seed(0)  # the same weight draws
        optimizer = torch.optim.Adam([p for p in matcher.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for _ in range(20):
            loss = matcher(batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return matcher, torch.tensor(losses)

    dual, dual_losses = trained(DualMatcher(model_a, model_b, dtype=torch.float64))
    both, both_losses = trained(LearnedMatcher(model_a, model_b, frame="both", dtype=torch.float64))
    own, own_losses = trained(LearnedMatcher(model_a, model_b, dtype=torch.float64))
    inputs = sample_inputs(config)
    torch.testing.assert_close(both_losses, dual_losses, rtol=0, atol=1e-5)
    assert (
        relative_error(logits(both.merge(0.5), inputs), logits(dual.merge(0.5), inputs)) < 1e-5
    )  # (LLaMA: float32 RoPE)
    assert (own_losses - dual_losses).abs().max() > 1e-2
    assert relative_error(logits(own.merge(0.5), inputs), logits(dual.merge(0.5), inputs)) > 1e-2
    assert relative_error(logits(both.merge(1.0), inputs), logits(model_b, inputs)) < 1e-6


@pytest.mark.parametrize(
    "arch", [pytest.param(a, marks=pytest.mark.slow) for a in ("gpt2", "llama", "gpt_neox")] + ["vit"]
)
def test_dual_loss_moves_b_alone_with_the_same_loss_and_gradients(arch):
    """Dual matching evaluates ``(1 - a) A + a T_A^-1 T_B(B)``, which is ``(1 - a) T_A(A) + a T_B(B)``
    moved by the symmetry ``T_A^-1``: the same function, so the same loss as a function of both
    transforms and the same gradients, with one model's tensors moved instead of two. Checked in
    float64 against the two-transform path (ensemble objective: its logits stay float64, where
    the causal-LM loss of transformers rounds them to float32), with both transforms away from
    the start. Relaxed permutations are no group elements, and there both models move."""
    from hf_lmc.canonical.exactness import float64_rmsnorm

    config = tiny_configs()[arch]
    model_a, model_b = (
        build_model(config, seed=1, dtype=torch.float64),
        build_model(config, seed=2, dtype=torch.float64),
    )
    g = torch.Generator().manual_seed(0)
    if arch == "vit":
        batch = {
            "pixel_values": torch.randn(
                4, config.num_channels, config.image_size, config.image_size, generator=g, dtype=torch.float64
            )
        }
    else:
        batch = {"input_ids": torch.randint(0, config.vocab_size, (4, 12), generator=g)}
    with float64_rmsnorm():
        matcher = DualMatcher(model_a, model_b, objective="ensemble", dtype=torch.float64)
        with torch.no_grad():
            for p in matcher.parameters():
                if p.requires_grad:
                    p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        transform_a, _transform_b = matcher._path()
        assert transform_a is None  # B alone moves
        loss = matcher(batch, alpha=0.4)
        grads = torch.autograd.grad(loss, [p for p in matcher.parameters() if p.requires_grad])
        both_moved = matcher._point_loss(batch, (matcher.transform_a(), matcher.transform_b()), (0.6, 0.4))
        expected = torch.autograd.grad(both_moved, [p for p in matcher.parameters() if p.requires_grad])
    assert abs(loss.item() - both_moved.item()) < 1e-12 * abs(both_moved.item())
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-12)
    assert any(w.abs().max() > 1e-4 for w in expected[:3])  # the transforms' gradients are not trivially zero
    relaxed = DualMatcher(model_a, model_b, permutations="ste", dtype=torch.float64)
    assert relaxed._path()[0] is not None  # a straight-through permutation has no inverse: both move


def test_endpoints_move_with_the_matcher_and_stay_out_of_its_state(monkeypatch):
    """``.to()`` / ``accelerator.prepare`` move the frozen endpoints with the transforms (they are
    not buffers: DDP would broadcast them every step), and checkpoints hold only the transforms."""
    config = tiny_configs()["gpt2"]
    matcher = LearnedMatcher(build_model(config, seed=1), build_model(config, seed=2))
    batch = {"input_ids": torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))}
    loss32 = matcher(batch, alpha=0.5)
    matcher.double()
    stored = [t for store in matcher.interpolant.endpoints for group in store.tensors.values() for t in group.values()]
    assert stored and all(t.dtype == torch.float64 for t in stored)
    assert matcher.interpolant(matcher.transform_b(), 0.5, **batch).logits.dtype == torch.float64  # (HF's loss upcasts)
    torch.testing.assert_close(matcher(batch, alpha=0.5).float(), loss32, rtol=1e-5, atol=1e-6)
    assert not any("endpoint" in k or "interpolant.models" in k for k in matcher.state_dict())
    matcher.to("meta")
    assert all(
        t.device.type == "meta"
        for store in matcher.interpolant.endpoints
        for g in store.tensors.values()
        for t in g.values()
    )
    monkeypatch.setenv("WORLD_SIZE", "2")  # a multi-process launch without a process group yet
    with pytest.raises(RuntimeError, match="create the Accelerator"):
        LearnedMatcher(build_model(config, seed=1), build_model(config, seed=2), init="identity", shard_endpoints=True)


def test_offloaded_endpoints_in_one_process_train_and_merge_as_whole_ones():
    """``EndpointSharding(offload=True)`` without a launcher: FSDP2 keeps the layers (on a mesh of
    one, over the one-process group it sets up) and the loss, its gradients and the merge are
    the whole endpoints' exactly."""
    import torch.distributed as dist

    from hf_lmc import EndpointSharding

    config = tiny_configs()["llama"]
    model_a, model_b = (
        build_model(config, seed=1, dtype=torch.float64),
        build_model(config, seed=2, dtype=torch.float64),
    )
    batch = {"input_ids": torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))}
    assert not dist.is_initialized()
    try:
        whole = DualMatcher(model_a, model_b, dtype=torch.float64, init="identity")
        offloaded = DualMatcher(
            model_a, model_b, dtype=torch.float64, init="identity", shard_endpoints=EndpointSharding(offload=True)
        )
        assert all(
            len(store.layers) == config.num_hidden_layers and not any(isinstance(g, int) for g in store.tensors)
            for store in offloaded.interpolant.endpoints
        )
        losses = [m(batch, alpha=0.5) for m in (whole, offloaded)]
        for loss in losses:
            loss.backward()
        assert torch.equal(losses[0], losses[1])
        for (name, p), (_, q) in zip(whole.named_parameters(), offloaded.named_parameters()):
            assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), name
        with torch.no_grad():
            torch.testing.assert_close(
                offloaded.merge(0.5)(**batch).logits, whole.merge(0.5)(**batch).logits, rtol=0, atol=0
            )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("cls", [LearnedMatcher, pytest.param(DualMatcher, marks=pytest.mark.slow)])
def test_fixed_permutations_keep_the_starting_assignment_and_train_the_rest(cls):
    """``permutations="fixed"``: no scores to train, the hardened unit and head orders stay
    weight matching's, and the continuous maps still learn (SwiGLU scales included)."""
    config = tiny_configs()["llama"]
    model_a, model_b = build_model(config, seed=1), build_model(config, seed=2)
    batches = [{"input_ids": torch.randint(0, config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))}]
    torch.manual_seed(0)
    matcher = cls(model_a, model_b, permutations="fixed", dtype=torch.float64)
    assert not any(isinstance(m, PermutationParam) for m in matcher.modules())
    start = matcher.transforms()[1]
    before = matcher(batches[0], alpha=0.5).item()
    matcher.fit(batches, steps=15, lr=1e-2, progress=False)
    assert matcher(batches[0], alpha=0.5).item() < before
    learned = matcher.transforms()[1]
    for space in start.maps:
        if space.startswith("mlp."):
            assert torch.equal(learned.maps[space].map.perm, start.maps[space].map.perm)
            assert not torch.equal(learned.maps[space].map.blocks, start.maps[space].map.blocks)  # the scales learn
        elif space.startswith("attn."):
            assert torch.equal(learned.maps[space].qk.perm, start.maps[space].qk.perm)
            assert torch.equal(learned.maps[space].query_perm, start.maps[space].query_perm)
    inputs = sample_inputs(config)
    assert relative_error(logits(matcher.merge(0.0), inputs), logits(model_a, inputs)) < 1e-6
    assert relative_error(logits(matcher.merge(1.0), inputs), logits(model_b, inputs)) < 1e-6


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_fixed_assignments_are_applied_to_the_stored_model_once(arch):
    """With fixed assignments B is stored in its starting unit and head order and the trained maps
    move it without gathers: every layer map a step builds is ``ordered``, and the loss and its
    path are those of the starting transform on B as given (float64)."""
    from hf_lmc.canonical.exactness import float64_rmsnorm
    from hf_lmc.learned.interpolant import Interpolant

    config = tiny_configs()[arch]
    model_a, model_b = build_model(config, seed=1), build_model(config, seed=2)
    batch = {"input_ids": torch.randint(0, config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))}
    with float64_rmsnorm():
        for cls in (LearnedMatcher, DualMatcher):
            matcher = cls(model_a, model_b, objective="labels", dtype=torch.float64)
            start = matcher.transforms()[1]
            assert any(
                not torch.equal(e.map.perm, torch.arange(e.map.perm.numel()))
                for s, e in start.maps.items()
                if s.startswith("mlp.")
            )
            moved = matcher._path()[1]
            assert all(
                e.ordered if s.startswith("attn.") else e.map.ordered for s, e in moved.maps.items() if s != "residual"
            )
            a, b = (hf_lmc.canonicalize(m, dtype=torch.float64) for m in (model_a, model_b))
            want = causal_lm_loss(Interpolant(a, b)(start, 0.3, **batch).logits, batch["input_ids"])
            assert abs(matcher(batch, alpha=0.3).item() - want.item()) < 1e-12 * want.item()


@pytest.mark.slow
@pytest.mark.parametrize("cls", [LearnedMatcher, DualMatcher])
def test_a_given_starting_transform_is_where_training_starts(cls):
    """``init=`` an exact Transform of B (here activation matching's): the untrained matcher
    selects it, fixed permutations keep its assignments through training, and the endpoints stay exact."""
    config = tiny_configs()["gpt_neox"]
    model_a, model_b = build_model(config, seed=1), build_model(config, seed=2)
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, config.vocab_size, (4, 12), generator=g)} for _ in range(3)]
    start = hf_lmc.ActivationMatcher(batches, progress=False).match(
        hf_lmc.canonicalize(model_a), hf_lmc.canonicalize(model_b)
    )
    weight_start = cls(model_a, model_b, dtype=torch.float64).transforms()[1]
    matcher = cls(model_a, model_b, init=start, dtype=torch.float64)
    transform_b = matcher.transforms()[1]
    b = hf_lmc.canonicalize(model_b, dtype=torch.float64)
    for (group, mine), (_, theirs) in zip(transform_b.apply(b).groups(), start.to(torch.float64).apply(b).groups()):
        for name in theirs:
            torch.testing.assert_close(mine[name], theirs[name], rtol=1e-10, atol=1e-12, msg=f"{group}: {name}")
    differs = [
        s
        for s in start.maps
        if s.startswith("mlp.") and not torch.equal(start.maps[s].map.perm, weight_start.maps[s].map.perm)
    ]
    assert differs  # the two starts really assign differently here
    matcher.fit(batches, steps=5, lr=1e-2, progress=False)
    learned = matcher.transforms()[1]
    assert all(
        torch.equal(learned.maps[s].map.perm, start.maps[s].map.perm) for s in start.maps if s.startswith("mlp.")
    )
    inputs = sample_inputs(config)
    assert relative_error(logits(matcher.merge(0.0), inputs), logits(model_a, inputs)) < 1e-10
    assert relative_error(logits(matcher.merge(1.0), inputs), logits(model_b, inputs)) < 1e-10


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt_neox", "vit"])
def test_ensemble_objective_is_the_cross_entropy_to_the_endpoints_mixture(arch):
    """``objective="ensemble"``: the loss at ``alpha`` is the cross-entropy of the interpolated
    model's predictions to ``(1 - alpha) p_A + alpha p_B`` (stock models' probabilities); it
    trains, and the merge stays exact at the endpoints."""
    config = tiny_configs()[arch]
    model_a, model_b = build_model(config, seed=1), build_model(config, seed=2)
    inputs = sample_inputs(config, dtype=torch.float64, batch=4)
    batch = dict(inputs) | ({"labels": torch.tensor([0, 1, 2, 0])} if arch == "vit" else {})  # labels are ignored
    matcher = DualMatcher(model_a, model_b, objective="ensemble", dtype=torch.float64)
    alpha = 0.3
    with torch.no_grad():
        target = (1 - alpha) * logits(model_a, inputs).softmax(-1) + alpha * logits(model_b, inputs).softmax(-1)
        point = matcher.interpolant(matcher.transform_b(), alpha, matcher.transform_a(), **inputs).logits
        expected = -(target * point.log_softmax(-1)).sum(-1).mean()
        assert matcher(batch, alpha=alpha).item() == pytest.approx(expected.item(), rel=1e-10)
        # A twin of A: the mixture is A's own distribution, and the loss is its entropy.
        twin = DualMatcher(model_a, model_a, objective="ensemble", dtype=torch.float64)
        p = logits(model_a, inputs).softmax(-1)
        assert twin(batch, alpha=0.5).item() == pytest.approx(-(p * p.log()).sum(-1).mean().item(), rel=1e-8)
    before = matcher(batch, alpha=0.5).item()
    matcher.fit([batch], steps=15, lr=1e-2, progress=False)
    assert matcher(batch, alpha=0.5).item() < before
    probe = sample_inputs(config, seed=1, dtype=torch.float64)
    assert relative_error(logits(matcher.merge(0.0), probe), logits(model_a, probe)) < 1e-10
    assert relative_error(logits(matcher.merge(1.0), probe), logits(model_b, probe)) < 1e-10


@pytest.mark.parametrize("objective", ["labels", "ensemble"])
def test_input_noise_is_fresh_gaussian_noise_on_the_images_in_training_mode(objective):
    """``input_noise=sigma``: each training-mode call is the noiseless loss at ``pixel_values +
    sigma * z``, ``z ~ N(0, 1)`` drawn afresh (the ensemble's targets see the same noisy images);
    ``eval()`` turns it off, as it does dropout. ``locate_worst`` sees the same noisy images."""
    config = tiny_configs()["vit"]
    model_a, model_b = build_model(config, seed=1), build_model(config, seed=2)
    batch = dict(sample_inputs(config, dtype=torch.float64, batch=4)) | {"labels": torch.tensor([0, 1, 2, 0])}
    noisy = DualMatcher(model_a, model_b, input_noise=0.3, objective=objective, dtype=torch.float64)
    clean = DualMatcher(model_a, model_b, objective=objective, dtype=torch.float64)
    with torch.no_grad():
        torch.manual_seed(5)
        loss = noisy(batch, alpha=0.3).item()
        torch.manual_seed(5)
        moved = {**batch, "pixel_values": batch["pixel_values"] + 0.3 * torch.randn_like(batch["pixel_values"])}
        assert loss == pytest.approx(clean(moved, alpha=0.3).item(), rel=1e-12)
        assert noisy(batch, alpha=0.3).item() != pytest.approx(loss, rel=1e-6)  # fresh noise, another loss
        torch.manual_seed(6)
        located = noisy.locate_worst([batch])
        torch.manual_seed(6)
        moved = {**batch, "pixel_values": batch["pixel_values"] + 0.3 * torch.randn_like(batch["pixel_values"])}
        assert located == clean.locate_worst([moved])
        noisy.eval()
        assert noisy(batch, alpha=0.3).item() == pytest.approx(clean(batch, alpha=0.3).item(), rel=1e-12)


def test_ensemble_objective_mixes_every_endpoint_of_the_simplex():
    config = tiny_configs()["gpt2"]
    models = [build_model(config, seed=s) for s in (1, 2, 3)]
    inputs = sample_inputs(config, dtype=torch.float64, batch=3)
    matcher = hf_lmc.SimplexMatcher(models, init="identity", objective="ensemble", dtype=torch.float64)
    weights = (0.5, 0.3, 0.2)
    with torch.no_grad():
        target = sum(w * logits(m, inputs).softmax(-1) for w, m in zip(weights, models))
        point = logits(matcher.merge(list(weights)), inputs)  # identity transforms: the plain weighted average
        expected = -(target * point.log_softmax(-1)).sum(-1).mean()
        assert matcher(inputs, weights=weights).item() == pytest.approx(expected.item(), rel=1e-10)


@pytest.mark.parametrize("cls", [LearnedMatcher, DualMatcher, hf_lmc.SimplexMatcher])
def test_matchers_built_with_no_settings_train_as_the_command_line_does_with_no_flags(cls):
    """No constructor (nor the training loop, nor the trainable transform) declares an option
    again with a default of its own: they take :class:`LearnOptions` and
    :class:`AccelerateOptions`, the one definition the CLI and recipes read, and fields of them
    by name."""
    from hf_lmc.learned.trainable import TrainableTransform
    from hf_lmc.learned.training import train

    fields = {*hf_lmc.LearnOptions.model_fields, *hf_lmc.AccelerateOptions.model_fields, "warmup_steps"}
    fields.discard("shard_endpoints")  # a path takes an EndpointSharding (offload, gather dtype), more than the flag
    for function in (cls.__init__, train, TrainableTransform.__init__):
        declared = set(inspect.signature(function).parameters) & fields
        assert not declared, f"{function.__qualname__} declares {sorted(declared)} again"
    model = build_model(tiny_configs()["gpt2"], seed=0)
    models = [model, model] if cls is not hf_lmc.SimplexMatcher else [[model] * 3]
    assert cls(*models, init="identity").learn == hf_lmc.LearnOptions()
    assert cls(*models, init="identity", orthogonal="exp").learn == hf_lmc.LearnOptions(orthogonal="exp")


def test_bad_options_are_rejected():
    model = build_model(tiny_configs()["gpt2"], seed=0)
    with pytest.raises(ValueError, match="unknown init"):
        DualMatcher(model, model, init="random")
    with pytest.raises(ValueError, match="lambda_range"):
        DualMatcher(model, model, lambda_range=(0.6, 0.4))
    with pytest.raises(ValueError, match="permutations: .*'fixed'.*got 'frozen'"):
        DualMatcher(model, model, permutations="frozen")
    with pytest.raises(ValueError, match="objective: .*'ensemble'.*got 'kl'"):
        DualMatcher(model, model, objective="kl")
    with pytest.raises(ValueError, match="worst_fraction"):
        DualMatcher(model, model, worst_fraction=1.5)
    with pytest.raises(ValueError, match="input_noise: .*greater than or equal to 0, got -0.1"):
        DualMatcher(model, model, input_noise=-0.1)
    with pytest.raises(ValueError, match="input_noise.*GPT2LMHeadModel"):
        hf_lmc.SimplexMatcher([model, model, model], input_noise=0.1)
    vit = build_model(tiny_configs()["vit"], seed=0)
    with pytest.raises(ValueError, match=r"pixel_values.*\blabels\b"):
        DualMatcher(vit, vit, input_noise=0.1)({"labels": torch.zeros(1, dtype=torch.long)})
    with pytest.raises(ValueError, match="at least one batch"):
        DualMatcher(model, model).locate_worst([])
    with pytest.raises(ValueError, match="locate_every"):
        DualMatcher(model, model).fit([], steps=1, locate_every=0, progress=False)


@pytest.mark.slow
@pytest.mark.parametrize("cls", [LearnedMatcher, DualMatcher])
def test_the_worst_point_is_where_the_exported_path_stands_highest_and_draws_follow_it(cls):
    """``locate_worst`` against the barrier measured the user's way: stock merged models on the
    same batches; then the draws: near that point (``worst_fraction=1``) or in the range (0)."""
    config = tiny_configs()["gpt2"]
    model_a, model_b = (
        build_model(config, seed=1, dtype=torch.float64),
        build_model(config, seed=2, dtype=torch.float64),
    )
    matcher = cls(model_a, model_b, dtype=torch.float64, worst_fraction=1.0)
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, config.vocab_size, (2, 10), generator=g)} for _ in range(2)]
    optimizer = torch.optim.Adam([p for p in matcher.parameters() if p.requires_grad], lr=3e-2)
    for _ in range(5):  # away from weight matching's start, so the path is not the symmetric one
        matcher(batches[0], alpha=0.5).backward()
        optimizer.step()
        optimizer.zero_grad()
    alphas = [i / 10 for i in range(11)]
    with torch.no_grad():
        losses = [
            sum(causal_lm_loss(matcher.merge(alpha)(**b).logits, b["input_ids"]).item() for b in batches) / 2
            for alpha in alphas
        ]
    excess = [loss - ((1 - alpha) * losses[0] + alpha * losses[-1]) for alpha, loss in zip(alphas, losses)]
    expected = alphas[max(range(1, 10), key=excess.__getitem__)]
    matcher.worst_alpha.fill_(0.9 if expected < 0.7 else 0.1)  # so locating has to move it
    assert matcher.locate_worst(batches) == pytest.approx(expected) and float(matcher.worst_alpha) == pytest.approx(
        expected
    )
    torch.testing.assert_close(
        matcher.grid_excess, torch.tensor(excess, dtype=torch.float64), rtol=0, atol=1e-9
    )  # what focus='excess' draws from
    draws = torch.stack([matcher.sample_lambda() for _ in range(200)])
    assert (draws - expected).abs().max() <= 0.05 + 1e-9 and draws.std() > 0.01
    matcher.worst_fraction = 0.0
    draws = torch.stack([matcher.sample_lambda() for _ in range(200)])
    assert draws.min() >= 0.4 and draws.max() <= 0.6


def test_excess_focus_draws_near_every_point_above_the_line_in_proportion_to_its_excess():
    """Two humps above the line: ``"excess"`` draws near both, at rates proportional to their
    excess; points at or below the line get no draws."""
    model = build_model(tiny_configs()["gpt2"], seed=0)
    matcher = DualMatcher(model, model, worst_fraction=1.0, focus="excess")
    assert 0.4 <= float(matcher.sample_lambda()) <= 0.6  # not located yet: the middle of lambda_range
    excess = torch.zeros(len(WORST_GRID), dtype=torch.float64)
    excess[3], excess[7], excess[5] = 0.03, 0.01, -0.02  # humps at alpha 0.3 and 0.7, the middle below the line
    matcher.grid_excess.copy_(excess)
    torch.manual_seed(0)
    draws = torch.stack([matcher.sample_lambda() for _ in range(4000)])
    near = {alpha: ((draws - alpha).abs() <= 0.05 + 1e-9).float().mean().item() for alpha in (0.3, 0.7)}
    assert near[0.3] + near[0.7] == pytest.approx(1.0) and near[0.3] == pytest.approx(0.75, abs=0.03)
    assert "grid_excess" in matcher.state_dict() and "grid_excess" not in DualMatcher(model, model).state_dict()
    with pytest.raises(ValueError, match="focus: .*'excess'.*got 'both'"):
        DualMatcher(model, model, focus="both")


def test_fit_relocates_the_worst_point_on_its_last_two_batches():
    config = tiny_configs()["gpt2"]
    model_a, model_b = (
        build_model(config, seed=1, dtype=torch.float64),
        build_model(config, seed=2, dtype=torch.float64),
    )
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, config.vocab_size, (2, 10), generator=g)} for _ in range(3)]
    seen = {}

    def check(step, matcher):  # after step s the last two batches are s-2 and s-1 (cycled)
        located = float(matcher.worst_alpha)
        seen[step] = located
        if step % 2 == 0:
            assert located == matcher.locate_worst([batches[(step - 2) % 3], batches[(step - 1) % 3]])

    torch.manual_seed(0)
    matcher = DualMatcher(model_a, model_b, dtype=torch.float64)
    # no batches held out: the worst point is located on the latest training batches
    matcher.fit(batches, steps=4, lr=1e-2, locate_every=2, callback=check, holdout=None, progress=False)
    assert sorted(seen) == [1, 2, 3, 4] and seen[1] == 0.5  # the middle of lambda_range until first located


@pytest.mark.slow
def test_fit_reads_a_reiterable_afresh_each_pass_and_keeps_a_one_shot_iterator():
    """A DataLoader that shuffles reshuffles on every pass, and no pass is held in memory (as
    ``itertools.cycle`` would hold a whole dataset); a generator's batches are replayed."""
    config = tiny_configs()["gpt2"]
    model_a, model_b = build_model(config, seed=1), build_model(config, seed=2)
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, config.vocab_size, (2, 10), generator=g)} for _ in range(2)]

    class Passes:  # a re-iterable that says which pass each batch came from
        def __init__(self):
            self.passes = 0

        def __iter__(self):
            self.passes += 1
            return iter(batches)

    data = Passes()
    torch.manual_seed(0)
    # no stopping rule: a list would have its last batch held out, and what is read is the question here
    options = {"steps": 5, "lr": 1e-2, "target_barrier": None, "progress": False}
    straight = LearnedMatcher(model_a, model_b).fit(batches, **options)
    torch.manual_seed(0)
    assert LearnedMatcher(model_a, model_b).fit(data, **options) == straight  # same batches, same order
    assert data.passes == 3  # 2 + 2 + 1 batches: three passes, each a fresh iteration
    torch.manual_seed(0)
    assert LearnedMatcher(model_a, model_b).fit((b for b in batches), **options) == straight

    loader = torch.utils.data.DataLoader(
        torch.arange(8), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    from hf_lmc.learned.training import _passes

    stream = _passes(loader)
    orders = [torch.cat([next(stream)[1], next(stream)[1]]).tolist() for _ in range(3)]
    assert all(sorted(order) == list(range(8)) for order in orders) and len({tuple(order) for order in orders}) > 1
    # a list's batches keep their place from pass to pass (what a kept target is read by); a loader's do not
    listed = _passes(batches)
    assert [next(listed)[0] for _ in range(5)] == [0, 1, 0, 1, 0] and next(stream)[0] is None
    for empty in ([], iter([])):
        with pytest.raises(ValueError, match="yielded no batch"):
            LearnedMatcher(model_a, model_b).fit(empty, steps=1, progress=False)


@pytest.mark.slow
def test_a_seeded_alignment_is_reproducible_and_leaves_the_callers_rng_alone():
    from hf_lmc.config.options import LearnOptions
    from hf_lmc.merging.alignment import align
    from tests.models import transform_tensors

    config = tiny_configs()["gpt2"]
    a, b = (hf_lmc.canonicalize(build_model(config, seed=s)) for s in (1, 2))
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, config.vocab_size, (2, 10), generator=g)} for _ in range(2)]

    def trained(seed):
        learn = LearnOptions(
            steps=3, lr=1e-2, seed=seed, target_barrier=None
        )  # every step trains (random models start below any target)
        _, transform = align("dual", a, b, batches=batches, learn=learn, progress=False)
        return transform_tensors(transform)

    torch.manual_seed(123)
    untouched = torch.rand(4)
    torch.manual_seed(123)
    first = trained(1)
    assert torch.equal(torch.rand(4), untouched)  # the caller's RNG state is restored
    torch.manual_seed(999)  # the seed, not the caller's state, decides the draws
    again, other = trained(1), trained(2)
    assert all(torch.equal(again[k], t) for k, t in first.items())
    assert any(not torch.equal(other[k], t) for k, t in first.items())


def test_draws_read_the_located_point_from_the_device_only_when_it_changes():
    """A read of a GPU buffer waits for every queued kernel: the draws keep a host copy of the
    worst point and the excess, refreshed when the buffers are written (located, loaded)."""
    config = tiny_configs()["gpt2"]
    model_a, model_b = build_model(config, seed=1), build_model(config, seed=2)
    batches = [{"input_ids": torch.randint(0, config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))}]
    matcher = LearnedMatcher(model_a, model_b, worst_fraction=1.0, focus="excess")
    draws = [matcher.sample_lambda() for _ in range(3)]
    read = matcher._focus_read
    draws += [matcher.sample_lambda() for _ in range(5)]
    assert all(0.4 <= float(d) <= 0.6 for d in draws) and matcher._focus_read is read  # later draws reuse the host copy
    matcher.locate_worst(batches)
    matcher.sample_lambda()
    assert matcher._focus_read is not read and matcher._focus_read[1] == float(matcher.worst_alpha)
    state = {k: v.clone() for k, v in matcher.state_dict().items()}
    state["worst_alpha"].fill_(0.2)
    state["grid_excess"].zero_()
    matcher.load_state_dict(state)
    assert all(0.15 - 1e-9 <= float(matcher.sample_lambda()) <= 0.25 + 1e-9 for _ in range(20))  # the loaded point


def test_residual_lr_trains_the_residual_maps_at_their_own_rate():
    config = tiny_configs()["llama"]
    model_a, model_b = build_model(config, seed=1), build_model(config, seed=2)
    batches = [{"input_ids": torch.randint(0, config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))}]
    moved = {}
    for residual_lr in (None, 1e-12):
        torch.manual_seed(0)
        matcher = DualMatcher(model_a, model_b, dtype=torch.float64)
        before = {name: p.detach().clone() for name, p in matcher.named_parameters()}
        matcher.fit(
            batches, steps=1, lr=1e-2, residual_lr=residual_lr, progress=False
        )  # Adam's first step: ~lr per element
        moved[residual_lr] = {name: (p - before[name]).abs().max().item() for name, p in matcher.named_parameters()}
    residual = [name for name in moved[None] if ".residual." in name]
    assert residual and all(moved[None][name] > 1e-4 and moved[1e-12][name] < 1e-9 for name in residual)
    assert all(
        moved[1e-12][name] == pytest.approx(moved[None][name], rel=1e-3)
        for name in moved[None]
        if name not in residual and moved[None][name] > 1e-4
    )
    with pytest.raises(ValueError, match="residual_lr"):
        matcher.fit(batches, steps=1, residual_lr=0.0, progress=False)


@pytest.mark.slow
def test_a_fit_at_info_reports_each_windows_step_time_and_its_shares(caplog):
    """At INFO (``hf-lmc merge -v``) a fit logs, every 10 steps and at the last, the time a step
    took and the shares of building weights, gathers and the rest, which add up to the whole;
    the interpolant's clock runs only while the fit does. At WARNING nothing is timed."""
    import logging
    import re

    config = tiny_configs()["llama"]
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, config.vocab_size, (2, 10), generator=g)} for _ in range(2)]
    path = DualMatcher(build_model(config, seed=1), build_model(config, seed=2))
    with caplog.at_level(logging.WARNING, logger="hf_lmc"):
        path.fit(batches, steps=2, target_barrier=None, progress=False)
    assert not [r for r in caplog.records if "s a step" in r.getMessage()]
    with caplog.at_level(logging.INFO, logger="hf_lmc"):
        path.fit(batches, steps=12, target_barrier=None, progress=False)
    lines = [r.getMessage() for r in caplog.records if "s a step" in r.getMessage()]
    assert [re.search(r"steps (\d+)-(\d+)", line).groups() for line in lines] == [("1", "10"), ("11", "12")]
    for line in lines:
        shares = [float(x) for x in re.findall(r"(-?\d+)%", line)]
        assert len(shares) == 3 and shares[0] > 0 and abs(sum(shares) - 100) <= 2, line
    assert not path.interpolant.clock.running


def test_fit_checkpoints_and_resumes_to_the_same_result(tmp_path):
    config = tiny_configs()["gpt2"]
    model_a, model_b = build_model(config, seed=1), build_model(config, seed=2)
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, config.vocab_size, (2, 10), generator=g)} for _ in range(3)]

    def fresh():
        torch.manual_seed(0)  # lambda draws
        return LearnedMatcher(model_a, model_b, dtype=torch.float64)

    straight = fresh()
    losses = straight.fit(
        batches, steps=6, lr=1e-2, target_barrier=None, gradient_accumulation_steps=2, warmup_steps=1, progress=False
    )
    assert len(losses) == 6

    class Killed(Exception):
        pass

    def kill_at_step_5(step, _):  # after the checkpoint of step 4: the run dies mid-schedule
        if step == 5:
            raise Killed

    first = fresh()
    with pytest.raises(Killed):
        first.fit(
            batches,
            steps=6,
            lr=1e-2,
            target_barrier=None,
            gradient_accumulation_steps=2,
            warmup_steps=1,
            checkpoint_dir=tmp_path / "ckpt",
            checkpoint_every=2,
            callback=kill_at_step_5,
            progress=False,
        )
    resumed = fresh()
    rest = resumed.fit(
        batches,
        steps=6,
        lr=1e-2,
        target_barrier=None,
        gradient_accumulation_steps=2,
        warmup_steps=1,
        checkpoint_dir=tmp_path / "ckpt",
        resume=True,
        progress=False,
    )
    assert len(rest) == 2
    for (name, p), (_, q) in zip(straight.named_parameters(), resumed.named_parameters()):
        torch.testing.assert_close(p, q, msg=name)


def test_resuming_refuses_a_state_saved_from_another_start(tmp_path):
    """A saved state holds factors relative to the start it trained from: resumed with another
    pair (another weight-matching start) it is refused in one line, before anything is loaded;
    a start recomputed with other rounding still resumes."""
    import json

    from hf_lmc.config.options import UsageError
    from hf_lmc.learned import training

    config = tiny_configs()["llama"]
    model_a, model_b, model_c = (build_model(config, seed=s) for s in (1, 2, 3))
    batches = [{"input_ids": torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))}]
    folder = tmp_path / "ckpt"
    saved = DualMatcher(model_a, model_b, dtype=torch.float64)
    saved.fit(batches, steps=1, checkpoint_dir=folder, progress=False)
    recorded = json.loads((folder / "hf_lmc_state.json").read_text())["start"]
    assert {k: v for k, v in recorded.items() if k != "data:"} == json.loads(
        json.dumps(training.start_fingerprint(DualMatcher(model_a, model_b, dtype=torch.float64)))
    )
    with pytest.raises(UsageError, match="resume"):
        DualMatcher(model_a, model_c, dtype=torch.float64).fit(
            batches, steps=2, checkpoint_dir=folder, resume=True, progress=False
        )

    other_rounding = DualMatcher(model_a, model_b, dtype=torch.float64)
    with torch.no_grad():
        for buffer in other_rounding.buffers():
            if buffer.is_floating_point():
                buffer.mul_(1 + 1e-9)
    training._check_same_start(recorded, json.loads(json.dumps(training.start_fingerprint(other_rounding))), folder)
    assert len(other_rounding.fit(batches, steps=2, checkpoint_dir=folder, resume=True, progress=False)) == 1


def test_resuming_refuses_a_state_saved_training_on_other_data(tmp_path):
    """A resumed run replays the saved run's data order: on other data it is another run,
    refused in one line before anything is loaded; the same data resumes."""
    from hf_lmc.config.options import UsageError

    config = tiny_configs()["gpt2"]
    model_a, model_b = build_model(config, seed=1), build_model(config, seed=2)

    def batches(seed):
        g = torch.Generator().manual_seed(seed)
        return [{"input_ids": torch.randint(0, config.vocab_size, (2, 8), generator=g)} for _ in range(2)]

    folder = tmp_path / "ckpt"
    options = {"checkpoint_dir": folder, "target_barrier": None, "progress": False}
    LearnedMatcher(model_a, model_b, dtype=torch.float64).fit(batches(0), steps=1, **options)
    with pytest.raises(UsageError, match="data"):
        LearnedMatcher(model_a, model_b, dtype=torch.float64).fit(batches(1), steps=2, resume=True, **options)
    resumed = LearnedMatcher(model_a, model_b, dtype=torch.float64)
    assert len(resumed.fit(batches(0), steps=2, resume=True, **options)) == 1


@pytest.mark.slow
def test_interrupted_scheduled_fit_resumes_to_the_same_result(tmp_path):
    """A run killed mid-way (here: by its callback) resumes with its optimizer, LR schedule and
    the worst point its draws follow."""
    config = tiny_configs()["gpt2"]
    model_a, model_b = build_model(config, seed=1), build_model(config, seed=2)
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, config.vocab_size, (2, 10), generator=g)} for _ in range(3)]
    options = {
        "steps": 6,
        "lr": 1e-2,
        "schedule": "cosine",
        "warmup_steps": 2,
        "target_barrier": None,  # every step trains: no batch held out, no stop at a target
        "locate_every": 2,
        "progress": False,
    }

    def fresh():
        torch.manual_seed(0)  # lambda draws
        return DualMatcher(model_a, model_b, dtype=torch.float64)

    seen = []
    straight = fresh()
    straight.fit(batches, callback=lambda step, matcher: seen.append(step), **options)
    assert seen == [1, 2, 3, 4, 5, 6]

    def crash(step, matcher):
        if step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fresh().fit(batches, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2, callback=crash, **options)
    resumed = fresh()
    assert len(resumed.fit(batches, checkpoint_dir=tmp_path / "ckpt", resume=True, **options)) == 2
    for (name, p), (_, q) in zip(straight.named_parameters(), resumed.named_parameters()):
        torch.testing.assert_close(p, q, msg=name)
    assert float(resumed.worst_alpha) == float(straight.worst_alpha)  # the buffer the draws follow is saved too
    with pytest.raises(ValueError, match="warmup: 3 warmup steps exceed the 2 training steps"):
        fresh().fit(batches, steps=2, warmup_steps=3, progress=False)


class _DrawingPath(torch.nn.Module):
    """A stand-in path that trains in milliseconds and draws at random every step, as the real
    paths do: the loss pulls ``x`` towards a random target, which a buffer keeps."""

    label, seeks_worst = "drawing", False

    def __init__(self, size: int = 3):
        super().__init__()
        self.x = torch.nn.Parameter(torch.zeros(size, dtype=torch.float64))
        self.register_buffer("drawn", torch.zeros(size, dtype=torch.float64))

    def forward(self, batch):
        self.drawn = torch.rand(self.x.shape, dtype=torch.float64)
        return ((self.x - self.drawn) ** 2).sum()


def _train_drawing(folder=None, size: int = 3, steps: int = 3, **settings) -> _DrawingPath:
    """A scheduled run of :class:`_DrawingPath` from one seed (resumed, it must end where this ends)."""
    from hf_lmc.learned.training import train

    torch.manual_seed(0)
    path = _DrawingPath(size)
    batches = [{"input_ids": torch.zeros(1, 1, dtype=torch.long)}]
    train(
        path,
        batches,
        steps=steps,
        lr=0.1,
        schedule="cosine",
        warmup_steps=1,
        checkpoint_dir=folder,
        checkpoint_every=1,
        progress=False,
        **settings,
    )
    return path


def _saved_state(folder):
    """The tensors file of a checkpoint folder, which holds it, the manifest and the output protocol's marker alone."""
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]  # no staging folder left beside it
    assert sorted(p.name for p in folder.iterdir()) == [".hf-lmc.json", "hf_lmc_state.json", "state.safetensors"]
    return folder / "state.safetensors"


class _Payload:
    """Pickled, it creates ``marker`` when unpickled: what a state file replaced by an attacker's runs."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.mark.parametrize(
    "planted",
    [
        "random_states_0.pkl",
        "custom_checkpoint_0.pkl",
        "custom_checkpoint_1.pkl",
        "optimizer.bin",
        "scheduler.bin",
        "model.safetensors",
        "pytorch_model.bin",
        "scaler.pt",
        "hf_lmc_progress.json",
        "hf_lmc_state.json",
        "tensors",
        ".hf-lmc.json",
    ],
)
def test_a_pickle_planted_in_the_training_state_never_runs(tmp_path, planted):
    """A checkpoint folder's files are read as safetensors and JSON only: a pickle whose
    ``__reduce__`` runs code, planted under any name the folder could hold (accelerate's own
    included) or in place of the tensors file, is refused in one line naming it; it never runs."""
    marker = tmp_path / "ran"
    call, arguments = _Payload(marker).__reduce__()
    call(*arguments).close()  # the payload is live: unpickled, it would leave the marker
    assert marker.exists()
    marker.unlink()
    folder = tmp_path / "ckpt"
    _train_drawing(folder)
    target = _saved_state(folder) if planted == "tensors" else folder / planted
    torch.save(_Payload(marker), target)
    with pytest.raises((ValueError, OSError)) as refused:
        _train_drawing(folder, resume=True)
    message = str(refused.value)
    assert "\n" not in message and target.name in message, message
    assert not marker.exists()


@pytest.mark.parametrize(
    "damage",
    ["torn tensors", "missing tensors", "missing manifest", "edited step", "edited rate", "not json", "other shapes"],
)
def test_a_training_state_that_does_not_validate_is_refused_in_one_line_before_anything_is_loaded(tmp_path, damage):
    """Every file's size and sha256, the manifest's record against its tensors file, and every
    tensor's name, shape and dtype against the live modules are checked before anything is
    copied in: a torn, edited or foreign state is refused in one line naming the file, and the
    path and the random state are as they were."""
    import json

    from hf_lmc.learned.state import TrainingStateError
    from hf_lmc.learned.training import train

    folder = tmp_path / "ckpt"
    _train_drawing(folder)
    tensors, manifest = _saved_state(folder), folder / "hf_lmc_state.json"
    record = json.loads(manifest.read_text())
    named = manifest
    if damage == "torn tensors":
        tensors.write_bytes(tensors.read_bytes()[: tensors.stat().st_size // 2])
        named = tensors
    elif damage == "missing tensors":
        tensors.unlink()
        named = tensors
    elif damage in ("edited step", "edited rate"):
        if damage == "edited step":
            record["step"] = 1
        else:
            record["optimizer_groups"][0]["lr"] = 0.5  # the schedule ends at 0
        manifest.write_text(json.dumps(record))
    elif damage == "missing manifest":
        manifest.unlink()
    elif damage == "not json":
        manifest.write_text("{not json")
    size = 4 if damage == "other shapes" else 3  # saved for a path of 3 elements, resumed with 4
    named = tensors if damage == "other shapes" else named

    torch.manual_seed(0)
    path, random_state = _DrawingPath(size), torch.get_rng_state()
    batches = [{"input_ids": torch.zeros(1, 1, dtype=torch.long)}]
    with pytest.raises(TrainingStateError) as refused:
        train(
            path,
            batches,
            steps=3,
            lr=0.1,
            schedule="cosine",
            warmup_steps=1,
            checkpoint_dir=folder,
            resume=True,
            progress=False,
        )
    message = str(refused.value)
    assert "\n" not in message and named.name in message, message
    assert torch.equal(path.x, torch.zeros(size, dtype=torch.float64)) and torch.equal(
        path.drawn, torch.zeros(size, dtype=torch.float64)
    )
    assert torch.equal(torch.get_rng_state(), random_state)


@pytest.mark.parametrize("exchange", [True, False], ids=["one exchange", "two renames"])
def test_a_run_killed_at_any_point_of_a_save_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch, exchange):
    """A save is atomic: killed at any of its filesystem steps (of the first save or a later one;
    the folders swapped in one exchange or, where the system has none, by two renames), the
    folder holds the previous complete state or the new one, and the resumed run ends exactly
    where an uninterrupted run does, with one state and no staging folder left."""
    import gc
    import os
    import shutil
    import tempfile
    import threading
    from pathlib import Path

    from hf_lmc.io import outputs
    from hf_lmc.learned import state

    class Killed(Exception):
        pass

    steps_taken = []
    run_thread = threading.get_ident()
    filesystem_steps = [
        (state, "save_file"),
        (Path, "write_text"),
        (os, "fsync"),
        (os, "replace"),
        (os, "rename"),
        (shutil, "rmtree"),
        (tempfile, "mkdtemp"),
        (outputs, "_rename2"),
    ]

    def killed_run(folder, kill_at) -> bool:
        steps_taken.clear()
        with monkeypatch.context() as patches:
            for owner, name in filesystem_steps:
                original = getattr(owner, name)

                def step(*args, _original=original, _name=name, **kwargs):
                    if (
                        threading.get_ident() != run_thread
                    ):  # another test's thread still at work: not a step of the run
                        return _original(*args, **kwargs)
                    steps_taken.append(_name)
                    if len(steps_taken) == kill_at:
                        raise Killed(_name)
                    return _original(*args, **kwargs)

                patches.setattr(owner, name, step)
            gc.collect()  # no finaliser of an earlier test's garbage (a temporary folder's rmtree) counts as a step
            gc.disable()
            try:
                _train_drawing(folder, steps=2)
            except Killed:
                return True
            finally:
                gc.enable()
        return False

    monkeypatch.setattr(
        os, "fsync", lambda fd: None
    )  # still a step that can be killed; what it makes durable, no test sees
    if not exchange:
        monkeypatch.setattr(outputs, "_exchange", lambda staging, output: False)
    reference = _train_drawing(steps=2)
    assert not killed_run(tmp_path / "counted" / "ckpt", 0)
    total = len(steps_taken)  # the filesystem steps of two saves, the first and a later one
    assert total >= 2 * 5 and steps_taken.count("save_file") == 2
    for kill_at in range(1, total + 1):
        folder = tmp_path / f"killed at {kill_at}" / "ckpt"
        assert killed_run(folder, kill_at)
        resumed = _train_drawing(folder, steps=2, resume=True)
        assert torch.equal(resumed.x, reference.x) and torch.equal(resumed.drawn, reference.drawn), (
            kill_at,
            steps_taken[-1],
        )
        _saved_state(folder)


def test_the_training_state_keeps_fp16s_loss_scale(tmp_path):
    """Under fp16 accelerate scales the loss by a factor it adapts as it goes: a resumed run goes
    on from the saved factor, and one whose precision differs from the saved run's is refused."""
    from accelerate import Accelerator
    from torch.optim.lr_scheduler import LambdaLR

    from hf_lmc.config.options import UsageError
    from hf_lmc.learned.state import TrainingState
    from hf_lmc.learned.training import _BestPath

    def state(scale):
        accelerator, path = Accelerator(), _DrawingPath()
        accelerator.scaler = (
            torch.amp.GradScaler("cpu", init_scale=scale) if scale else None
        )  # as fp16 on a GPU has one
        optimizer = torch.optim.Adam(path.parameters())
        return TrainingState(path, optimizer, LambdaLR(optimizer, lambda step: 1.0), _BestPath([path.x]), accelerator)

    folder = tmp_path / "ckpt"
    state(1024.0).save(folder, 1, {})
    resumed = state(65536.0)
    assert resumed.load(folder, 1, lambda start: None) == 1
    assert resumed.accelerator.scaler.get_scale() == 1024.0
    with pytest.raises(UsageError, match="fp16"):
        state(None).load(folder, 1, lambda start: None)


def test_a_checkpoint_folder_that_is_not_hf_lmcs_is_refused_and_left_as_it_was(tmp_path):
    """The checkpoint folder is hf_lmc's own: one that holds anything else (a model's folder, a
    user's files, a state of the older pickled format) is refused before the first step, in one
    line naming the parameter, and nothing in it changes; a missing folder resumes as a fresh run."""
    from hf_lmc.config.options import OutputExistsError, ParameterError

    model = tmp_path / "model"
    build_model(tiny_configs()["gpt2"], seed=1).save_pretrained(model)
    older = tmp_path / "older"
    older.mkdir()
    (older / "hf_lmc_progress.json").write_text('{"step": 2}')
    (older / "random_states_0.pkl").write_bytes(b"\x80\x04N.")
    for folder in (model, older):
        before, steps = {p.name: p.read_bytes() for p in folder.iterdir()}, []
        for resume in (False, True):
            with pytest.raises((ParameterError, OutputExistsError)) as refused:
                _train_drawing(folder, resume=resume, callback=lambda step, path, seen=steps: seen.append(step))
            assert refused.value.parameter == "checkpoint_dir" and "{}" in refused.value.template
            message = refused.value.named("--checkpoint-dir")
            assert "\n" not in message and message.startswith("--checkpoint-dir") and str(folder) in message
        assert ("older hf_lmc" in message) == (folder == older)
        assert steps == [] and {p.name: p.read_bytes() for p in folder.iterdir()} == before
    fresh = _train_drawing(tmp_path / "new" / "ckpt", resume=True)
    assert torch.equal(fresh.x, _train_drawing().x)
    _saved_state(tmp_path / "new" / "ckpt")


@pytest.mark.slow
def test_gloo_processes_match_one_process_on_the_same_global_batch(tmp_path):
    """DDP over 1, 2 and 4 CPU processes, with the endpoints whole and sharded by FSDP2 (offloaded,
    gathered in float32) and the build sharded (each process building its rows of every weight,
    the layers run with their weights gathered or tensor-parallel) or not, trains and merges as
    1 process does on the same global batches: learned matching on
    GPT-2, and dual matching toward both objectives on every family; a sharded run killed after
    its second step resumes to the same transforms. Sharded over N, each process holds 1/N of
    the endpoints' layers."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = os.environ | {"ACCELERATE_USE_CPU": "true", "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    script = str(root / "tests" / "distributed_fit.py")
    sharded = ["--shard-endpoints"]
    runs = {  # name: (processes, flags)
        "one": (1, []),
        "two": (2, []),
        "two, sharded": (2, sharded),
        "two, sharded, whole build": (2, [*sharded, "--whole-build"]),
        "two, shared build": (2, ["--shared-build"]),
        "four, sharded, offloaded": (4, [*sharded, "--offload"]),
        "two, sharded, float32 gathers": (2, [*sharded, "--gather-float32"]),
    }
    dual = {}  # dual matching: (family, objective) -> the one-process run's name
    for family in ("gpt2", "gpt_neox", "llama", "vit"):
        for objective in ("ensemble", "labels"):
            flags = ["--dual", f"--family={family}", f"--objective={objective}"]
            dual[family, objective] = name = f"{family}, dual, {objective}"
            runs[f"{name}: one"] = (1, flags)
            runs[f"{name}: two, sharded"] = (2, [*flags, *sharded])
    flags = runs["gpt2, dual, ensemble: one"][1]
    runs["gpt2, dual, ensemble: one, sharded, offloaded"] = (1, [*flags, *sharded, "--offload"])
    runs["gpt2, dual, ensemble: four, sharded"] = (4, [*flags, *sharded])
    runs["gpt2, dual, ensemble: four, shared build"] = (4, [*flags, "--shared-build"])
    runs["gpt2, dual, ensemble: two, sharded, resumed"] = (2, [*flags, *sharded, "--resume"])
    runs["gpt2, dual, ensemble: two, sharded, head gathered"] = (2, [*flags, *sharded, "--gather-head"])
    runs["gpt2, dual, ensemble: four, sharded, tensor-parallel"] = (4, [*flags, *sharded, "--tensor-parallel"])
    for family in ("gpt2", "gpt_neox", "llama"):  # the layers run tensor-parallel: their outputs gathered
        one = dual[family, "labels" if family == "gpt_neox" else "ensemble"]
        runs[f"{one}: two, shared build, tensor-parallel"] = (
            2,
            [*runs[f"{one}: one"][1], "--shared-build", "--tensor-parallel"],
        )
    for name, (processes, flags) in runs.items():
        out = str(tmp_path / name)
        launch = (
            [sys.executable]
            if processes == 1
            else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
        )
        subprocess.run([*launch, script, out, *flags], env=env, check=True, timeout=600, cwd=root)
    info = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in runs}
    assert [info[n]["num_processes"] for n in runs] == [n for n, _ in runs.values()]  # really that many processes
    assert all(info[n]["moved"] for n in runs)  # .float() casts the endpoints, shards included
    assert all(
        info[n]["starts"] == [1] + [0] * (runs[n][0] - 1) for n in runs if "resumed" not in n
    )  # one weight matching, on the main process
    (whole,) = info["one"]["held"]
    assert info["two"]["held"] == info["two, shared build"]["held"] == [whole, whole]
    layers = 2 * info["two, sharded"]["layers_per_model"]  # both endpoints' layer tensors
    assert 0 < layers < whole
    for name in (
        "two, sharded",
        "four, sharded, offloaded",
    ):  # 1/N of the layers each (up to padding), embeddings and heads whole
        processes = runs[name][0]
        held = info[name]["held"]
        assert len(held) == processes and sum(held) == processes * (whole - layers) + layers
        assert max(held) <= whole - layers + layers / processes + 2 * 64, name
    compared = {
        name: ("one", 1e-7, 1e-9)
        for name in (
            "two",
            "two, sharded",
            "two, sharded, whole build",
            "two, shared build",
            "four, sharded, offloaded",
        )
    }
    compared |= {"two, sharded, float32 gathers": ("one", 1e-4, 1e-5)}
    compared |= {f"{one}: two, sharded": (f"{one}: one", 1e-7, 1e-9) for one in dual.values()}
    reference = "gpt2, dual, ensemble: one"
    compared |= {
        f"{reference.removesuffix(': one')}: {name}": (reference, 1e-7, 1e-9)
        for name in (
            "one, sharded, offloaded",
            "four, sharded",
            "four, shared build",
            "two, sharded, resumed",
            "two, sharded, head gathered",
            "four, sharded, tensor-parallel",
        )
    }
    # LLaMA's RMSNorm computes in float32 whatever the model's dtype: the tensor-parallel linears'
    # products, in other shapes, round differently in float64, and a float32 rounding can flip.
    compared |= {
        name: (name.split(": ")[0] + ": one", *((1e-5, 1e-7) if name.startswith("llama") else (1e-7, 1e-9)))
        for name in runs
        if name.endswith("shared build, tensor-parallel")
    }
    assert set(compared) | {"one"} | {f"{one}: one" for one in dual.values()} == set(runs)
    for name, (reference, rtol, atol) in compared.items():
        assert rtol > 1e-7 or info[name]["located"] == info[reference]["located"], (
            name
        )  # one worst point for all (float64)
        single, other = (torch.load(tmp_path / n, weights_only=True) for n in (reference, name))
        assert single["params"].keys() == other["params"].keys() and single["params"]
        for key in single["params"]:  # float64; Adam's normalisation lifts all-reduce rounding to ~1e-10
            torch.testing.assert_close(
                other["params"][key], single["params"][key], rtol=rtol, atol=atol, msg=f"{name}: {key}"
            )
        torch.testing.assert_close(other["logits"], single["logits"], rtol=10 * rtol, atol=10 * atol, msg=name)
    for family, objective in dual:  # the objectives train differently: the comparison can tell runs apart
        if objective == "labels":
            ensemble, labels = (
                torch.load(tmp_path / f"{dual[family, o]}: one", weights_only=True) for o in ("ensemble", "labels")
            )
            assert not torch.allclose(ensemble["logits"], labels["logits"]), family


@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("cls", [LearnedMatcher, DualMatcher])
def test_trained_matcher_is_the_path_built_trained_and_hardened_by_hand(cls, count):
    """The shared contract for learned and dual matching: ``fit(models)`` gives, bit for bit, the
    transforms of the path built from the models (3+: the simplex from universe matching, the
    first model learning as A does in ``cls``), trained with the same seed and settings."""
    from hf_lmc.config.options import LearnOptions
    from hf_lmc.learned import TrainedMatcher
    from hf_lmc.matching import UniverseMatcher
    from tests.models import transform_tensors

    config = tiny_configs()["gpt2"]
    models = [hf_lmc.canonicalize(build_model(config, seed=s)) for s in range(1, count + 1)]
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, config.vocab_size, (2, 10), generator=g)} for _ in range(2)]
    learn = LearnOptions(
        steps=3, lr=1e-2, seed=1, target_barrier=None
    )  # no stopping rule: every batch trains (the rule: below)
    got = TrainedMatcher(cls, batches, learn=learn, progress=False).fit(models)

    if count == 2:
        torch.manual_seed(1)
        path = cls(*models)
    else:
        start = UniverseMatcher(progress=False).fit(models)
        torch.manual_seed(1)
        path = hf_lmc.SimplexMatcher(models, init=start, learns_first=cls is DualMatcher)
    path.fit(batches, steps=3, lr=1e-2, target_barrier=None, seed=1, progress=False)
    expected = list(path.transforms())
    assert len(got) == len(expected) == count
    for mine, theirs in zip(got, expected):
        mine, theirs = transform_tensors(mine), transform_tensors(theirs)
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], t) for k, t in theirs.items())


def _random_pair_and_batches(count: int = 6):
    config = tiny_configs()["gpt2"]
    model_a, model_b = (
        build_model(config, seed=1, dtype=torch.float64),
        build_model(config, seed=2, dtype=torch.float64),
    )
    g = torch.Generator().manual_seed(0)
    return (
        model_a,
        model_b,
        [{"input_ids": torch.randint(0, config.vocab_size, (2, 10), generator=g)} for _ in range(count)],
    )


def test_the_stopping_rule_estimates_the_barrier_on_held_out_batches_and_stops_at_the_target():
    """Before the first step and every ``locate_every`` steps the path's barrier is estimated on
    the held-out batches (the largest excess over the line on the worst-point grid); training
    stops as soon as it is at most the target, and the budget bounds it otherwise."""
    from hf_lmc.evaluation.barriers import loss_barrier

    model_a, model_b, batches = _random_pair_and_batches()
    train, holdout = batches[:4], batches[4:]
    torch.manual_seed(0)
    budgeted = DualMatcher(model_a, model_b, dtype=torch.float64)
    losses = budgeted.fit(train, steps=6, lr=1e-2, locate_every=2, holdout=holdout, target_barrier=0.0, progress=False)
    assert len(losses) == 6 and budgeted.stopping.steps == 6 and budgeted.stopping.holdout_batches == 2
    # the estimate is the labels' barrier of the (training-mode) path on the held-out batches, on the
    # worst-point grid, whatever the training objective (the default, ensemble, here)
    transform_a, transform_b = budgeted._path()
    with torch.no_grad():
        grid = [
            sum(
                causal_lm_loss(budgeted.interpolant(transform_b, alpha, transform_a, **b).logits, b["input_ids"]).item()
                for b in holdout
            )
            / 2
            for alpha in WORST_GRID
        ]
    assert abs(budgeted.stopping.estimate - max(0.0, loss_barrier(list(WORST_GRID), grid))) < 1e-9
    assert ("reached" in budgeted.stopping.describe()) == budgeted.stopping.reached

    torch.manual_seed(0)
    stopped = DualMatcher(model_a, model_b, dtype=torch.float64)
    target = budgeted.stopping.estimate + 1e-6  # reachable: the budgeted run got there by step 6 at the latest
    stopped.fit(train, steps=50, lr=1e-2, locate_every=2, holdout=holdout, target_barrier=target, progress=False)
    assert stopped.stopping.reached and stopped.stopping.steps <= 6 and stopped.stopping.estimate <= target

    torch.manual_seed(0)
    at_start = DualMatcher(model_a, model_b, dtype=torch.float64)
    assert (
        at_start.fit(train, steps=50, lr=1e-2, holdout=holdout, target_barrier=10.0, progress=False) == []
    )  # reached before any step
    assert at_start.stopping.steps == 0 and at_start.stopping.reached


class _WorseningPath(torch.nn.Module):
    """A stand-in path whose training steps raise its barrier: the loss ``-x`` drives ``x`` up, and
    the held-out barrier estimate is ``x`` itself (``grid_excess``), as ``locate_worst`` reports."""

    label, seeks_worst = "worsening", True

    def __init__(self, start: float):
        super().__init__()
        self.x = torch.nn.Parameter(torch.tensor(start, dtype=torch.float64))
        self.grid_excess = torch.zeros(1, dtype=torch.float64)

    def forward(self, batch):
        return -self.x

    def locate_worst(self, batches):
        self.grid_excess = self.x.detach().reshape(1).clone()


def test_training_that_ends_diverged_returns_the_lowest_path_seen(tmp_path):
    """A run whose last held-out estimate is above twice the lowest + 0.1 nats returns the
    parameters of the lowest (here the start's) and says so; one that only wanders up returns its
    last path; a run resumed from a saved state knows the lowest path seen before the save."""
    from hf_lmc.learned.training import train

    batches = [{"input_ids": torch.zeros(1, 1, dtype=torch.long)}] * 2
    settings = {
        "schedule": "constant",
        "locate_every": 10,
        "holdout": batches,
        "target_barrier": 0.01,
        "progress": False,
    }
    diverged = _WorseningPath(0.5)  # estimates at the start (0.5) and after the last step (1.7 > 2 * 0.5 + 0.1)
    train(diverged, batches, steps=6, lr=0.2, **settings)
    assert diverged.x.item() == 0.5  # the start's value, exactly
    assert diverged.stopping.steps == 0 and diverged.stopping.estimate == 0.5
    last_steps, last_estimate = diverged.stopping.last
    assert last_steps == 6 and last_estimate == pytest.approx(1.7)
    assert "kept" in diverged.stopping.describe() and diverged.stopping.backtracks == 0

    wandered = _WorseningPath(0.5)  # up to 0.56: the last path stays
    train(wandered, batches, steps=6, lr=0.01, **settings)
    assert wandered.x.item() == pytest.approx(0.56) and wandered.stopping.last is None and wandered.stopping.steps == 6

    # killed after step 4 (state saved at 2 and 4), resumed: the start is still the lowest path seen
    folder = tmp_path / "state"
    train(_WorseningPath(0.5), batches, steps=4, lr=0.2, checkpoint_dir=folder, checkpoint_every=2, **settings)
    resumed = _WorseningPath(0.5)
    train(resumed, batches, steps=6, lr=0.2, checkpoint_dir=folder, checkpoint_every=2, resume=True, **settings)
    assert resumed.x.item() == 0.5 and resumed.stopping.steps == 0


def test_training_whose_estimate_diverges_goes_back_at_half_the_learning_rate(tmp_path):
    """An estimate above twice the lowest + 0.1 nats means the steps diverge: training goes back
    to the lowest path, clears Adam's moments and halves the learning rate for the rest of the
    schedule; a run resumed from a state saved after that still counts the halving."""
    from hf_lmc.learned.training import train

    batches = [{"input_ids": torch.zeros(1, 1, dtype=torch.long)}] * 2
    path, seen = _WorseningPath(0.5), []
    # Adam moves x by the learning rate each step: 0.75, 1.0, 1.25 (> 1.1: back to 0.5 at lr 0.125), 0.625, 0.75, 0.875
    train(
        path,
        batches,
        steps=6,
        lr=0.25,
        schedule="constant",
        locate_every=3,
        holdout=batches,
        target_barrier=0.01,
        callback=lambda step, p: seen.append(p.x.item()),
        progress=False,
    )
    assert seen == pytest.approx([0.75, 1.0, 0.5, 0.625, 0.75, 0.875], abs=1e-6)
    assert path.stopping.backtracks == 1 and path.stopping.last is None and path.x.item() == pytest.approx(0.875)
    assert "halved 1 time" in path.stopping.describe()

    # killed after step 4 (state saved at 2 and 4), resumed: the halving is remembered, rate and count
    folder, settings = tmp_path / "state", {"checkpoint_dir": tmp_path / "state", "checkpoint_every": 2}
    train(
        _WorseningPath(0.5),
        batches,
        steps=4,
        lr=0.25,
        schedule="constant",
        locate_every=3,
        holdout=batches,
        target_barrier=0.01,
        progress=False,
        **settings,
    )
    resumed, seen = _WorseningPath(0.5), []
    train(
        resumed,
        batches,
        steps=6,
        lr=0.25,
        schedule="constant",
        locate_every=3,
        holdout=batches,
        target_barrier=0.01,
        callback=lambda step, p: seen.append(p.x.item()),
        progress=False,
        resume=True,
        **settings,
    )
    assert folder.is_dir() and seen == pytest.approx([0.75, 0.875], abs=1e-6)
    assert resumed.stopping.backtracks == 1 and "halved 1 time" in resumed.stopping.describe()


def test_trained_matchers_hold_out_the_last_batches_for_the_target_and_report_it():
    from hf_lmc.config.options import LearnOptions
    from hf_lmc.learned.training import TrainedMatcher, holdout_split

    model_a, model_b, batches = _random_pair_and_batches(16)
    assert holdout_split(batches) == (batches[:14], batches[14:]) and holdout_split(iter(batches))[1] is None
    models = [hf_lmc.canonicalize(m) for m in (model_a, model_b)]
    matcher = TrainedMatcher(DualMatcher, batches, learn=LearnOptions(steps=4, target_barrier=0.0), progress=False)
    matcher.fit(models)
    assert matcher.stopping.holdout_batches == 2 and matcher.stopping.steps == 4 and len(matcher.losses) == 4
    untargeted = TrainedMatcher(DualMatcher, batches, learn=LearnOptions(steps=4, target_barrier=None), progress=False)
    untargeted.fit(models)
    assert untargeted.stopping.estimate is None and len(untargeted.losses) == 4


@pytest.mark.slow
def test_merge_under_torchrun_writes_once_what_one_process_writes(tmp_path):
    """``torchrun --nproc_per_node 2 -m hf_lmc merge ...``: both processes train dual matching
    (DDP, each fitting batch split between them; the endpoints whole, or sharded by FSDP2 and
    offloaded), the main process alone writes, and the merge is the one-process merge to float32
    all-reduce rounding. A run killed mid-way resumes from its saved state to the uninterrupted
    run's merge."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    from hf_lmc.canonical.exactness import tiny_configs

    root = Path(__file__).resolve().parent.parent
    config = tiny_configs()["vit"]
    folders = []
    for seed in (1, 2):
        build_model(config, seed=seed, dtype=torch.float32).save_pretrained(tmp_path / f"m{seed}")
        folders.append(str(tmp_path / f"m{seed}"))
    g = torch.Generator().manual_seed(0)
    size = config.image_size
    torch.save(
        {
            "pixel_values": torch.randn(16, config.num_channels, size, size, generator=g),
            "labels": torch.randint(0, config.num_labels, (16,), generator=g),
        },
        tmp_path / "fit.pt",
    )
    env = os.environ | {"PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    settings = [
        "--data",
        str(tmp_path / "fit.pt"),
        "--batch-size",
        "4",
        "--steps",
        "4",
        "--lr",
        "1e-2",
        "--seed",
        "0",
        "--target-barrier",
        "0",
    ]
    one, two = (
        [sys.executable, "-m", "hf_lmc"],
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "hf_lmc"],
    )
    runs = {  # (processes, method): (launch, further flags)
        ("one", "dual"): (one, settings),
        ("one", "weight"): (one, []),
        ("two", "dual"): (two, settings),
        ("two", "weight"): (two, []),
        ("two, sharded", "dual"): (two, [*settings, "--shard-endpoints", "--offload-endpoints"]),
    }
    outputs = {}
    for (name, method), (launch, flags) in runs.items():
        out = tmp_path / f"{name}-{method}"
        done = subprocess.run(
            [*launch, "merge", *folders, "-o", str(out), "--method", method, *flags],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.count("merged model written to") == 1, done.stdout  # one process reports
        outputs[name, method] = load_file(out / "model.safetensors")
        if method == "dual":  # the card records the launch it trained in
            launch = next(
                line for line in (out / "README.md").read_text().splitlines() if line.startswith("| launch |")
            )
            assert ("2 processes" in launch) == (name != "one")
            assert ("FSDP2" in launch) == (name == "two, sharded")
            assert ("1/N" in launch) == (name != "one")  # each process built its share (--shard-build, the default)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no staging debris
    for name, method in runs:
        reference, other = outputs["one", method], outputs[name, method]
        assert reference.keys() == other.keys()
        for key in reference:
            torch.testing.assert_close(other[key], reference[key], rtol=1e-4, atol=1e-5, msg=f"{name}, {method}: {key}")

    # Killed after the state of step 2 was saved, resumed: the uninterrupted two-process merge.
    state, out = ["--checkpoint-dir", str(tmp_path / "state"), "--checkpoint-every", "2"], tmp_path / "resumed"
    killed = [*two[:-2], str(root / "tests" / "killed_merge.py"), "3"]
    dual = ["merge", *folders, "-o", str(out), "--method", "dual", *settings, *state]
    done = subprocess.run(
        [*killed, *dual], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path, check=False
    )
    assert done.returncode != 0 and not out.exists()
    # The same kill again: a resumed run takes only the last two steps, so it never reaches it.
    done = subprocess.run(
        [*killed, *dual, "--resume"], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    resumed, straight = load_file(out / "model.safetensors"), outputs["two", "dual"]
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=1e-6, atol=1e-7, msg=f"resumed: {key}")
    assert any(
        not torch.equal(outputs["one", "dual"][k], outputs["one", "weight"][k]) for k in outputs["one", "dual"]
    )  # dual trained


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_permutation_only_learning_trains_the_permutations_and_nothing_else(arch):
    """``trained="permutations"`` (Theus et al.'s "learned matching (permutation only)"): only
    permutation scores train, and the hardened transform is a pure permutation (residual dims,
    heads and units) with every continuous map at permutation-only weight matching's identity."""
    config = tiny_configs()[arch]
    model_a, model_b = build_model(config, seed=1), build_model(config, seed=2)
    batches = [{"input_ids": torch.randint(0, config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))}]
    torch.manual_seed(0)
    matcher = LearnedMatcher(
        model_a, model_b, trained="permutations", permutations="ste", symmetries="permutation", dtype=torch.float64
    )
    trained = [p for p in matcher.parameters() if p.requires_grad]
    scores = {id(p) for m in matcher.modules() if isinstance(m, PermutationParam) for p in m.parameters()}
    assert trained and {id(p) for p in trained} == scores
    matcher.fit(batches, steps=6, lr=1e-1, progress=False)
    learned = matcher.transforms()[1]
    eye = torch.eye(config.hidden_size if arch == "llama" else config.n_embd, dtype=torch.float64)
    residual = learned.maps["residual"].matrix
    assert torch.equal(residual, eye[:, residual.argmax(dim=0)])  # a permutation matrix
    for space, element in learned.maps.items():
        if space.startswith("mlp."):
            assert torch.equal(element.map.blocks, torch.ones_like(element.map.blocks))
        elif space.startswith("attn."):
            for monomial in (element.qk, element.ov):
                assert torch.equal(monomial.blocks, torch.eye(monomial.block_size).expand_as(monomial.blocks).double())
    inputs = sample_inputs(config)
    assert relative_error(logits(matcher.merge(1.0), inputs), logits(model_b, inputs)) < 1e-6


def test_permutation_only_learning_is_refused_where_it_does_not_apply(capsys):
    from hf_lmc.cli import main
    from hf_lmc.config.options import LearnOptions

    with pytest.raises(ValueError, match="trained"):
        LearnOptions(trained="permutations")  # fixed permutations: nothing would train
    for extra in (["--method", "dual"], ["--method", "learned"]):  # dual; learned from a full-group start
        argv = ["merge", "a", "b", "-o", "out", "--data", "x.txt", "--trained", "permutations", "--permutations", "ste"]
        assert main([*argv, *extra]) == 2
        assert "--trained" in capsys.readouterr().err


def test_a_plateau_stops_training_and_the_run_keeps_its_curve():
    """With ``patience``, training stops once that many estimates in a row do not improve on the
    lowest; every estimate is on the curve with its step and the seconds since training began."""
    from hf_lmc.learned.training import train

    batches = [{"input_ids": torch.zeros(1, 1, dtype=torch.long)}] * 2
    settings = {"schedule": "constant", "locate_every": 5, "holdout": batches, "target_barrier": 0.0, "progress": False}
    flat = _WorseningPath(0.5)  # creeps up: no estimate after the start's improves on it
    train(flat, batches, steps=50, lr=1e-4, patience=2, **settings)
    stopping = flat.stopping
    assert stopping.reason == "plateau" and stopping.steps == 10 and "plateau" in stopping.describe()
    assert [step for step, _, _ in stopping.curve] == [0, 5, 10]
    seconds = [second for _, second, _ in stopping.curve]
    assert seconds == sorted(seconds) and seconds[0] >= 0

    budgeted = _WorseningPath(0.5)
    train(budgeted, batches, steps=50, lr=1e-4, **settings)  # no patience: the whole budget
    assert budgeted.stopping.reason == "budget" and budgeted.stopping.steps == 50
    assert [step for step, _, _ in budgeted.stopping.curve] == list(range(0, 51, 5))


def test_time_to_the_final_barrier_is_the_first_estimate_within_ten_percent():
    from hf_lmc.learned.training import Stopping

    run = Stopping(None, 2, budget=150)
    for step, seconds, estimate in [(0, 0.0, 0.5), (50, 10.0, 0.2), (100, 20.0, 0.105), (150, 30.0, 0.1)]:
        run.record(step, estimate, seconds)
    assert run.time_to_final() == (100, 20.0) and run.reason == "budget"
    targeted = Stopping(0.02, 2, budget=150)
    for step, seconds, estimate in [(0, 0.0, 0.5), (50, 10.0, 0.021), (100, 20.0, 0.019)]:
        if targeted.record(step, estimate, seconds):
            break
    assert targeted.reason == "target" and targeted.time_to_final() == (50, 10.0)  # within 10 % of the target
    assert Stopping(None, 0, budget=5).time_to_final() is None


def test_the_default_seed_gives_one_merge_whatever_ran_before():
    """As ``transformers.Trainer``'s seed: fixed by default (42) and recorded, so a merge does not
    depend on what the process drew before it."""
    from hf_lmc.config.options import DEFAULT_SEED, LearnOptions
    from hf_lmc.learned import TrainedMatcher
    from tests.models import transform_tensors

    config = tiny_configs()["gpt2"]
    models = [hf_lmc.canonicalize(build_model(config, seed=s)) for s in (1, 2)]
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, config.vocab_size, (2, 10), generator=g)} for _ in range(2)]
    learn = LearnOptions(steps=3, target_barrier=None)
    assert learn.seed == DEFAULT_SEED == 42
    runs = []
    for before in (0, 123):
        torch.manual_seed(before)
        torch.rand(7)  # whatever the process drew before
        runs.append(transform_tensors(TrainedMatcher(DualMatcher, batches, learn=learn, progress=False).fit(models)[1]))
    assert runs[0].keys() == runs[1].keys() and all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


def test_several_draws_per_step_give_each_share_of_the_batch_its_own_weight():
    """``draws=k``: the step's loss is the mean over k shares of the batch's rows, each at its
    own drawn weight (the path built once), weighted by the share's rows; one draw is the
    single-weight loss, and a weight given by the caller overrides the draws."""
    config = tiny_configs()["gpt2"]
    model_a, model_b = (
        build_model(config, seed=1, dtype=torch.float64),
        build_model(config, seed=2, dtype=torch.float64),
    )
    batch = sample_inputs(config, batch=5, dtype=torch.float64)
    batch = {"input_ids": batch["input_ids"]}
    matcher = DualMatcher(model_a, model_b, objective="labels", draws=3, worst_fraction=0.0, dtype=torch.float64)
    torch.manual_seed(0)
    alphas = [matcher.sample_lambda() for _ in range(3)]
    shares = batch["input_ids"].tensor_split(3)  # rows 2, 2, 1
    with torch.no_grad():
        expected = sum(matcher({"input_ids": rows}, alpha=alpha) * len(rows) / 5 for rows, alpha in zip(shares, alphas))
        torch.manual_seed(0)
        assert matcher(batch).item() == pytest.approx(expected.item(), rel=1e-12)
        assert len({round(float(alpha), 6) for alpha in alphas}) == 3
        given = matcher(batch, alpha=0.5).item()
        matcher.draws = 1
        assert given == pytest.approx(matcher(batch, alpha=0.5).item(), rel=1e-12)  # the caller's weight, whole batch
        torch.manual_seed(0)
        single = matcher(batch).item()
        torch.manual_seed(0)
        assert single == pytest.approx(matcher(batch, alpha=matcher.sample_lambda()).item(), rel=1e-12)
        assert abs(single - expected.item()) > 1e-9  # three weights are not one


def _counted_endpoints(path) -> dict[str, int]:
    """Count the path's endpoint forwards (features for a causal LM, outputs otherwise)."""
    counts = {"runs": 0}
    interpolant = path.interpolant
    for name in ("endpoint_features", "endpoint"):
        original = getattr(interpolant, name)

        def counted(*args, original=original, **kwargs):
            counts["runs"] += 1
            return original(*args, **kwargs)

        setattr(interpolant, name, counted)
    return counts


@pytest.mark.parametrize("arch", ["gpt2", "vit"])
def test_kept_endpoint_outputs_give_the_same_merge_and_run_the_endpoints_once_per_batch(arch):
    """The endpoints' outputs on each fitting batch (the ensemble targets) and their losses on
    the held-out batches are kept from the first time they are computed: a run passing three
    times over its batches gives the same losses, estimates and transforms, bit for bit, as one
    that recomputes them, with the endpoints run once per batch instead of at every use."""
    config = tiny_configs()[arch]
    models = [build_model(config, seed=s) for s in (1, 2)]
    batches = []
    for seed in range(5):  # 4 training batches, the last held out
        batch = sample_inputs(config, seed=seed, batch=2)
        if arch == "vit":
            batch["labels"] = torch.randint(0, config.num_labels, (2,), generator=torch.Generator().manual_seed(seed))
        batches.append(batch)
    runs = {}
    for budget in (0, "1GiB"):
        torch.manual_seed(0)
        path = DualMatcher(*models, init="identity")
        counts = _counted_endpoints(path)
        losses = path.fit(batches, steps=12, locate_every=4, target_barrier=0.0, target_cache=budget, progress=False)
        estimates = [estimate for _, _, estimate in path.stopping.curve]
        tensors = {k: v.detach().clone() for k, v in path.state_dict().items()}
        runs[budget] = (losses, estimates, tensors, counts["runs"], path.targets)
    (losses, estimates, tensors, plain_runs, _), (kept_losses, kept_estimates, kept_tensors, kept_runs, left) = (
        runs.values()
    )
    assert kept_losses == losses and kept_estimates == estimates
    assert tensors.keys() == kept_tensors.keys() and all(torch.equal(tensors[k], kept_tensors[k]) for k in tensors)
    estimated = len(estimates)  # before the first step and every 4 steps: 0, 4, 8, 12
    assert plain_runs == 2 * 12 + 2 * estimated  # two endpoints a step, two an estimate of the held-out batch
    assert kept_runs == 2 * 4 + 2  # once per training batch, once for the held-out batch
    assert left is None  # freed with the run


def test_a_target_cache_keeps_what_fits_its_budget_and_nothing_under_input_noise():
    """Past the budget, outputs are computed and not kept; with input noise (fresh inputs every
    step) nothing is kept at all; the setting reads as a size, 0 included."""
    from hf_lmc.config.options import LearnOptions
    from hf_lmc.learned.targets import TargetCache

    cache = TargetCache(100)
    cache.batch = 0
    values = [cache.get(cache.step_key(part), lambda: torch.zeros(10), lambda t: t.numel() * 4) for part in (0, 1, 0)]
    assert cache.used == 40 * 2 and (cache.hits, cache.misses) == (1, 2)
    assert values[2] is values[0]
    cache.get(cache.step_key(2), lambda: torch.zeros(10), lambda t: t.numel() * 4)  # 120 > 100: not kept
    assert cache.used == 80 and cache.get(cache.step_key(2), lambda: torch.ones(1), lambda t: 4).item() == 1
    cache.batch = None
    assert cache.step_key(0) is None

    config = tiny_configs()["vit"]
    models = [build_model(config, seed=s) for s in (1, 2)]
    assert DualMatcher(*models, init="identity").reuses_targets
    assert not DualMatcher(*models, init="identity", input_noise=0.1).reuses_targets
    assert LearnOptions(target_cache=0).target_cache_bytes == 0
    assert LearnOptions(target_cache="2MiB").target_cache_bytes == 2 * 2**20
    for bad in ("-1", "5B", "lots"):
        with pytest.raises(ValueError, match="target cache"):
            LearnOptions(target_cache=bad)


def test_a_fit_takes_its_blocks_from_the_heap_and_gives_the_command_lines_threshold_back(monkeypatch):
    """Under the command line's fixed mmap threshold (1 MiB, for streamed merges) every MiB-sized
    temporary of a training step would be fresh pages: a fit serves blocks below 32 MiB from the
    heap while it trains and sets the command line's threshold again after. Under the Python
    API (glibc's own growing threshold) it changes nothing."""
    from hf_lmc.utils import allocator

    calls = []

    class Libc:
        def mallopt(self, parameter, value):
            calls.append((parameter, value))
            return 1

        def malloc_trim(self, pad):
            calls.append(("trim", pad))
            return 1

    monkeypatch.setattr(allocator, "_libc", Libc)
    monkeypatch.setattr(allocator, "_SET", {})
    model_a, model_b, batches = _random_pair_and_batches(3)
    seen = []

    def fit():
        path = DualMatcher(model_a, model_b, init="identity", dtype=torch.float64)
        path.fit(
            batches, steps=2, target_barrier=None, progress=False, callback=lambda *_: seen.append(dict(allocator._SET))
        )

    fit()
    assert calls == [] and seen == [{}, {}]  # the Python API: glibc's own threshold
    allocator.return_freed_memory_promptly()
    calls.clear()
    seen.clear()
    fit()
    inside = {allocator.M_MMAP_THRESHOLD: 32 << 20, allocator.M_TRIM_THRESHOLD: 64 << 20}
    assert seen == [inside, inside]
    assert allocator._SET == {allocator.M_MMAP_THRESHOLD: 1 << 20, allocator.M_TRIM_THRESHOLD: 128 << 10}
    assert calls[-1] == ("trim", 0)
