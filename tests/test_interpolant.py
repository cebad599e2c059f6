"""The learned-matching interpolant runs the stock HF class and is differentiable in the transform."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_lmc
from hf_lmc.canonical.exactness import tiny_configs
from hf_lmc.learned.interpolant import Interpolant
from hf_lmc.learned.params import GLParam, OrthogonalParam, PermutationParam
from hf_lmc.symmetry import AttentionMap, BlockMonomial, DenseMlpMap, ResidualMap, Transform
from tests.models import ARCHITECTURES, CONFIGS, build_model, float64_rmsnorm, logits, relative_error, sample_inputs


def _twin(config, seed: int):
    """A float64 model, its canonical form A, and B = A moved by a random symmetry; plus the undo."""
    model = build_model(config, seed=seed, dtype=torch.float64)
    a = hf_lmc.canonicalize(model)
    moved = hf_lmc.random_symmetry(a.spec, seed=seed)
    return config, model, a, moved.apply(a).materialize(), moved.inverse()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_interpolant_of_a_twin_is_a_and_gradients_reach_the_parameters(arch):
    config, model, a, b, undo = _twin(
        tiny_configs()[arch], seed=1
    )  # undo: the exact alignment weight matching would find

    # Trainable residual map and layer-0 OV maps, initialised at the exact alignment.
    residual = OrthogonalParam(
        a.spec.hidden_size,
        init=undo.maps["residual"].matrix,
        method="cayley",
        fix_ones=a.spec.centred,
        dtype=torch.float64,
    )
    attn = undo.maps["attn.0"]
    ov = [
        GLParam(a.spec.head_dim, init=(attn.ov.blocks[h], attn.ov.inverse_blocks[h]), dtype=torch.float64)
        for h in range(a.spec.num_kv_heads)
    ]

    mlp = undo.maps["mlp.0"].map  # and layer-0 MLP units as a straight-through permutation
    units = PermutationParam(a.spec.intermediate_size, init=mlp.perm, method="ste", dtype=torch.float64)
    scale = mlp.blocks[:, 0, 0]

    def transform() -> Transform:
        blocks = [m() for m in ov]
        ov_map = BlockMonomial(
            attn.ov.perm, torch.stack([m for m, _ in blocks]), torch.stack([inv for _, inv in blocks])
        )
        maps = dict(undo.maps) | {
            "residual": ResidualMap.from_matrix(residual()),
            "attn.0": AttentionMap(attn.qk, ov_map, attn.query_perm),
            "mlp.0": DenseMlpMap(units(), scale),
        }
        return Transform(maps)

    interpolant = Interpolant(a, b)
    inputs = sample_inputs(config)
    out = interpolant(transform(), 0.5, **inputs)
    assert relative_error(out.logits, logits(model, inputs)) < 1e-9  # the stock class computes A's function

    out.logits.square().mean().backward()
    assert residual.weight.grad is not None and residual.weight.grad.abs().sum() > 0
    assert all(m.weight.grad is not None and m.weight.grad.abs().sum() > 0 for m in ov)
    assert units.scores.grad is not None and units.scores.grad.abs().sum() > 0
    hardened = transform().maps["mlp.0"].harden()
    assert torch.equal(hardened.map.perm, mlp.perm) and torch.equal(hardened.map.blocks, mlp.blocks)
    assert all(not p.requires_grad for p in interpolant.template.parameters())


@pytest.mark.parametrize(
    "arch", [pytest.param(a, marks=pytest.mark.slow) if a in ("gpt2", "gpt_neox") else a for a in ARCHITECTURES]
)
def test_trainable_transform_starts_exact_and_trains_every_symmetry(arch):
    """Over randomised configs: exact at init, gradients reach every parameter, exact hardened export."""
    from hf_lmc.learned.trainable import TrainableTransform

    @settings(max_examples=4, deadline=None)
    @given(config=CONFIGS[arch](), seed=st.integers(0, 2**16))
    def run(config, seed):
        with float64_rmsnorm():
            _, model, a, b, undo = _twin(config, seed)
            trainable = TrainableTransform(a.spec, undo, dtype=torch.float64)
            inputs = sample_inputs(config, seed=seed)
            expected = logits(model, inputs)
            out = Interpolant(a, b)(trainable(), 0.5, **inputs)
            assert relative_error(out.logits, expected) < 1e-9
            out.logits.square().mean().backward()
            trained = [name for name, p in trainable.named_parameters() if p.requires_grad]
            assert trained and all(p.grad is not None for _, p in trainable.named_parameters() if p.requires_grad), (
                trained
            )

            hardened = trainable.harden()  # exact group element: the export path reproduces A
            merged = hf_lmc.to_hf(hf_lmc.interpolate(a, hardened.apply(b), 0.5))
            assert relative_error(logits(merged, inputs), expected) < 1e-9

    run()


def test_layer_checkpointing_rebuilds_each_layer_in_backward_and_changes_nothing(monkeypatch):
    """Checkpointed layers build their weights twice (forward, then backward) with identical
    results; a fraction checkpoints that share of the layers, the others build once; ``"auto"``
    keeps whole the layers that fit in its budget at the call's batch and checkpoints the rest."""
    from hf_lmc.learned import interpolant as interpolant_module
    from hf_lmc.learned.trainable import TrainableTransform

    config = tiny_configs()["llama"]
    config.num_hidden_layers = 4
    config, _, a, b, undo = _twin(config, seed=2)
    trainable = TrainableTransform(a.spec, undo, dtype=torch.float64)
    inputs = sample_inputs(config)
    results = {}
    # "auto" at a budget that holds two layers whole at this batch: the other two checkpointed
    first = a.group(0)
    layer_bytes = max(sum(t.numel() * t.element_size() for t in a.group(i).values()) for i in range(4))
    hidden_bytes = inputs["input_ids"].numel() * config.hidden_size * next(iter(first.values())).element_size()
    per_layer = interpolant_module.WEIGHT_COPIES * layer_bytes + interpolant_module.HIDDEN_STATES * hidden_bytes
    cases = [(False, []), (True, [0, 1, 2, 3]), (0.5, [0, 2]), (0.25, [0]), ("auto", [])]
    cases.append((("auto", 2 * per_layer + per_layer // 2), [1, 3]))
    for setting, twice in cases:
        trainable.zero_grad()
        if isinstance(setting, tuple):
            monkeypatch.setattr(interpolant_module, "KEEP_WHOLE_BYTES", setting[1])
        interpolant = Interpolant(a, b, checkpoint_layers=setting[0] if isinstance(setting, tuple) else setting)
        built = []
        group = interpolant._group
        interpolant._group = lambda g, point, *rest, built=built, group=group, **kw: (
            built.append(g) or group(g, point, *rest, **kw)
        )
        out = interpolant(trainable(), 0.37, **inputs)
        out.logits.square().mean().backward()
        layers = [g for g in built if isinstance(g, int)]
        assert sorted(layers) == sorted([*range(a.spec.num_layers), *twice]), setting
        results[setting] = (out.logits.detach(), [p.grad.clone() for p in trainable.parameters() if p.grad is not None])
    for setting, _ in cases[1:]:
        torch.testing.assert_close(results[setting][0], results[False][0], rtol=0, atol=0)
        for g_plain, g_checkpointed in zip(results[False][1], results[setting][1]):
            torch.testing.assert_close(g_checkpointed, g_plain)


def test_checkpointed_layers_spread_a_fraction_evenly_and_reject_other_values():
    from hf_lmc.learned.interpolant import checkpointed_layers

    assert checkpointed_layers(12, True) == frozenset(range(12)) and checkpointed_layers(12, False) == frozenset()
    assert checkpointed_layers(12, 0.5) == frozenset(range(0, 12, 2))
    assert checkpointed_layers(24, 0.25) == frozenset(range(0, 24, 4))
    assert len(checkpointed_layers(7, 0.5)) == 4 and checkpointed_layers(7, 0.0) == frozenset()
    for bad in (1.5, -0.1, "half", None):
        with pytest.raises(ValueError, match="checkpoint_layers"):
            checkpointed_layers(12, bad)


def test_auto_checkpointing_keeps_whole_what_fits_its_budget_spread_evenly(monkeypatch):
    from hf_lmc.learned import interpolant as interpolant_module

    monkeypatch.setattr(interpolant_module, "KEEP_WHOLE_BYTES", 1000)
    monkeypatch.setattr(interpolant_module, "WEIGHT_COPIES", 1)
    monkeypatch.setattr(interpolant_module, "HIDDEN_STATES", 1)
    auto = interpolant_module.auto_checkpointed
    assert auto(12, 50, 50) == frozenset({5, 11})  # 10 of the 12 fit whole
    assert auto(4, 100, 100) == frozenset()  # 4 * 200 <= 1000: every layer whole
    assert auto(12, 100, 150) == frozenset(range(1, 12, 3)) | frozenset(range(2, 12, 3))  # 4 whole: 0, 3, 6, 9
    assert auto(12, 600, 500) == frozenset(range(12))  # not even one fits


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(arch=st.sampled_from(ARCHITECTURES), data=st.data())
def test_an_endpoint_alone_is_its_stock_model(arch, data):
    """``endpoint(k)`` (what the ensemble objective mixes) builds endpoint k from its own tensors
    only, and computes exactly the stock model it was canonicalised from."""
    config = data.draw(CONFIGS[arch]())
    models = [build_model(config, seed=s, dtype=torch.float64) for s in (1, 2, 3)]
    interpolant = Interpolant(*(hf_lmc.canonicalize(m) for m in models))
    inputs = sample_inputs(config, dtype=torch.float64)
    reads = []

    def noting_reads(load, store):
        """``load``, noting each call's ``store`` in ``reads``: whose tensors each call loads."""
        return lambda group, rows=None: reads.append(store) or load(group, rows)

    for store in interpolant.endpoints:
        store.load = noting_reads(store.load, store)
    interpolant.models = tuple(store.canonical() for store in interpolant.endpoints)
    with float64_rmsnorm():
        for k, model in enumerate(models):
            reads.clear()
            out = interpolant.endpoint(k, **inputs)
            assert relative_error(out.logits, logits(model, inputs)) < 1e-10
            assert reads and all(store is interpolant.endpoints[k] for store in reads)
    with pytest.raises(ValueError, match="no endpoint 3"):
        interpolant.endpoint(3, **inputs)


@settings(max_examples=6, deadline=None)
@given(arch=st.sampled_from(["gpt2", "gpt_neox", "llama"]), data=st.data())
def test_a_point_moving_only_the_tokens_read_is_the_whole_point(arch, data):
    """A call moves only the token-table rows its batch reads: its logits and the transforms'
    gradients are those of the whole interpolated state run through the stock class, over
    randomised configs, for a batch of a few tokens (the padding token among them) and for one
    of random tokens."""
    from torch.func import functional_call

    from hf_lmc.learned.trainable import TrainableTransform

    config = data.draw(CONFIGS[arch]())
    config.pad_token_id = 1  # read by the few tokens' batch: LLaMA's embedding gives its row no gradient
    a, b = (hf_lmc.canonicalize(build_model(config, seed=s)) for s in (1, 2))
    trainable = TrainableTransform(a.spec, hf_lmc.random_symmetry(a.spec, seed=3), dtype=torch.float64)
    with torch.no_grad():
        for p in trainable.parameters():
            p.add_(0.01 * torch.randn_like(p))
    interpolant = Interpolant(a, b)
    stock = type(build_model(config))(interpolant.config).double().eval()  # untied, as the interpolant is
    inputs = sample_inputs(config)
    few = {**inputs, "input_ids": inputs["input_ids"] % 3}
    for batch in (few, inputs):
        results = []
        for whole in (False, True):
            trainable.zero_grad()
            if whole:
                state = interpolant.state(trainable(), 0.4)
                out = functional_call(stock, state, args=(), kwargs=batch, tie_weights=False, strict=False)
            else:
                out = interpolant(trainable(), 0.4, **batch)
            out.logits.square().mean().backward()
            results.append(
                (out.logits.detach(), [p.grad.clone() for p in trainable.parameters() if p.grad is not None])
            )
        (rows, rows_grads), (whole, whole_grads) = results
        torch.testing.assert_close(rows, whole, rtol=1e-10, atol=1e-12)
        assert len(rows_grads) == len(whole_grads) > 0
        for g, h in zip(rows_grads, whole_grads):
            torch.testing.assert_close(g, h, rtol=1e-9, atol=1e-12)
