"""Models of two widths: the narrower embeds exactly into the wider shape, and merges reproduce
each endpoint there (``hf_lmc.canonical.widths``).

Configs are the randomised ones of :mod:`tests.models`; the wider model of each pair adds
heads (so residual width, with the head size fixed), MLP units, or both (LLaMA: KV heads and
query heads per KV head too).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import transformers as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hf_lmc
from hf_lmc.canonical.exactness import tiny_configs
from hf_lmc.canonical.widths import (
    WidthError,
    common_spec,
    embed,
    residual_embedding,
    resized_config,
    spec_of,
    to_common_shape,
)
from hf_lmc.cli import main
from tests.models import (
    ARCHITECTURES,
    CONFIGS,
    MODEL_CLASSES,
    build_model,
    float64_rmsnorm,
    logits,
    relative_error,
    sample_inputs,
)

PROPERTY = settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
F64 = torch.float64


@st.composite
def wider(draw, config):
    """``config`` with more heads (same head size) and / or more MLP units."""
    spec = spec_of(config)
    units = draw(st.sampled_from([0, 4]))
    if spec.model_type == "llama":  # GQA: more KV heads and / or query heads per KV head; d on its own
        kv, group = spec.num_kv_heads + draw(st.integers(0, 1)), spec.group_size + draw(st.integers(0, 1))
        heads = kv * group
        hidden = heads * -(-(spec.hidden_size + draw(st.integers(0, 4))) // heads)  # HF: a multiple of the heads
    else:  # d = heads x head_dim
        heads = kv = spec.num_heads + draw(st.integers(0, 2))
        hidden = heads * spec.head_dim
    wide = dataclasses.replace(
        spec, hidden_size=hidden, num_heads=heads, num_kv_heads=kv, intermediate_size=spec.intermediate_size + units
    )
    if wide == spec:
        wide = dataclasses.replace(wide, intermediate_size=spec.intermediate_size + 4)
    return resized_config(config, wide)


def _endpoints_check(narrow_config, wide_config, seed: int, swap: bool) -> None:
    """Embedding B exports at A's shape with B's logits; weight-matched merges give A at alpha=0, B at 1."""
    narrow, wide = build_model(narrow_config, seed=seed), build_model(wide_config, seed=seed + 1)
    inputs = sample_inputs(narrow_config, seed=seed, dtype=F64)
    model_a, model_b = (narrow, wide) if swap else (wide, narrow)
    a, b = to_common_shape(hf_lmc.canonicalize(model_a), hf_lmc.canonicalize(model_b))
    assert a.spec == b.spec == spec_of(wide_config)
    for name, model in (("A", a), ("B", b)):
        exported = hf_lmc.to_hf(model)
        assert type(exported) is type(wide) and spec_of(exported.config) == spec_of(wide_config)
        source = model_a if name == "A" else model_b
        err = relative_error(logits(exported, inputs), logits(source, inputs))
        assert err < 1e-10, f"embedded {name}: relative error {err:.1e}"
    transform = hf_lmc.WeightMatcher(progress=False).match(a, b)
    moved = transform.apply(b)
    for alpha, expected in ((0.0, model_a), (1.0, model_b)):
        merged = hf_lmc.to_hf(hf_lmc.interpolate(a, moved, alpha))
        err = relative_error(logits(merged, inputs), logits(expected, inputs))
        assert err < 1e-9, f"merge at alpha={alpha}: relative error {err:.1e}"
    assert all(torch.isfinite(t).all() for t in moved.state_dict().values())


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_narrower_model_embeds_exactly_and_merges_reproduce_both_endpoints(arch):
    @PROPERTY
    @given(data=st.data(), seed=st.integers(0, 2**16), swap=st.booleans())
    def run(data, seed, swap):
        config = data.draw(CONFIGS[arch]())
        with float64_rmsnorm():
            _endpoints_check(config, data.draw(wider(config)), seed, swap)

    run()


def test_a_head_wider_than_the_narrow_stream_stays_exact():
    """Found by the property above: a 2-wide LLaMA with 6-dim heads embedded at width 5. Its OV
    data fills two of the head's six directions, and the least-squares GL map had condition
    number 5e10 (merge error 2e-7); the solver now caps it at 1e6."""
    shape = {
        "vocab_size": 5,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "head_dim": 6,
    }
    with float64_rmsnorm():
        _endpoints_check(
            tf.LlamaConfig(hidden_size=2, **shape), tf.LlamaConfig(hidden_size=5, **shape), seed=1, swap=False
        )


@pytest.mark.parametrize("centred", [True, False], ids=["layernorm", "rmsnorm"])
def test_residual_embedding_has_orthonormal_columns_and_keeps_one_perp(centred):
    e = residual_embedding(5, 9, centred=centred)
    torch.testing.assert_close(e.T @ e, torch.eye(5, dtype=F64))
    if centred:  # 1-perp into 1-perp, u_B to u_A: the exported LayerNorms and the u head trick stay exact
        torch.testing.assert_close(
            e @ torch.full((5,), 1 / math.sqrt(5), dtype=F64), torch.full((9,), 1 / math.sqrt(9), dtype=F64)
        )
        x = torch.randn(5, 3, dtype=F64)
        torch.testing.assert_close((e @ (x - x.mean(0))).sum(0), torch.zeros(3, dtype=F64))


def test_weight_matching_recovers_a_moved_copy_of_an_embedded_model():
    """Padded heads and units (all zero) neither break the solvers nor leave a residue."""
    narrow = hf_lmc.canonicalize(build_model(tiny_configs()["llama"], seed=3))
    spec = dataclasses.replace(narrow.spec, hidden_size=12, intermediate_size=16, num_heads=6, num_kv_heads=3)
    a = embed(narrow, spec).materialize()
    b = hf_lmc.random_symmetry(spec, seed=4).apply(a).materialize()
    matcher = hf_lmc.WeightMatcher(progress=False)
    assert matcher.objective(a, b, matcher.match(a, b)) < 1e-12


def test_unsupported_shape_differences_are_rejected_in_one_line():
    gpt2 = spec_of(tiny_configs()["gpt2"])
    for change, message in (
        ({"num_layers": 3}, "differ in num_layers 2 vs 3"),
        ({"head_dim": 8, "hidden_size": 16}, "differ in head_dim 4 vs 8"),
        ({"output_size": 20}, "differ in output_size 17 vs 20"),
    ):
        with pytest.raises(WidthError, match=message) as caught:
            common_spec(gpt2, dataclasses.replace(gpt2, **change))
        assert "\n" not in str(caught.value) and "at most in width" in str(caught.value)
    # LLaMA: 4 heads / 2 KV heads and 5 / 5 nest in 10 / 5, but HF wants d = 12 divisible by 10 heads.
    llama = spec_of(tiny_configs()["llama"])
    other = dataclasses.replace(llama, hidden_size=10, num_heads=5, num_kv_heads=5)
    with pytest.raises(WidthError, match="not a valid llama config: .*not a multiple"):
        resized_config(tiny_configs()["llama"], common_spec(dataclasses.replace(llama, hidden_size=12), other))
    with pytest.raises(WidthError, match="narrower shape"):
        embed(
            hf_lmc.canonicalize(build_model(tiny_configs()["gpt2"])),
            dataclasses.replace(gpt2, hidden_size=4, num_heads=1, num_kv_heads=1),
        )


@pytest.mark.slow
def test_cli_merges_two_widths_into_the_wider_stock_checkpoint(tmp_path, capsys):
    narrow_config = tiny_configs()["gpt2"]
    wide_config = resized_config(
        narrow_config,
        dataclasses.replace(spec_of(narrow_config), hidden_size=12, num_heads=3, num_kv_heads=3, intermediate_size=40),
    )
    narrow, wide = (
        build_model(narrow_config, seed=1, dtype=torch.float32),
        build_model(wide_config, seed=2, dtype=torch.float32),
    )
    narrow.save_pretrained(tmp_path / "narrow")
    wide.save_pretrained(tmp_path / "wide")
    inputs = sample_inputs(narrow_config)
    # alpha is the weight of B whichever model is wider; the output has the wider shape.
    for a, b, alpha, expected, method in (
        ("narrow", "wide", 0.0, narrow, "weight"),
        ("wide", "narrow", 1.0, narrow, "average"),
    ):
        out = tmp_path / f"{a}-{alpha}"
        assert (
            main(
                [
                    "merge",
                    str(tmp_path / a),
                    str(tmp_path / b),
                    "-o",
                    str(out),
                    "--alpha",
                    str(alpha),
                    "--method",
                    method,
                ]
            )
            == 0
        )
        merged = MODEL_CLASSES["gpt2"].from_pretrained(out).eval()
        assert (merged.config.n_embd, merged.config.n_head, merged.config.n_inner) == (12, 3, 40)
        assert relative_error(logits(merged, inputs), logits(expected, inputs)) < 1e-5
        assert "hidden_size 8 → 12" in (out / "README.md").read_text()
    # The barrier path: both methods start at A and end at B (average: the embedded models, unaligned).
    batches = [sample_inputs(narrow_config, seed=s, batch=4, length=8) for s in range(2)]
    result = hf_lmc.barrier(
        tmp_path / "wide", tmp_path / "narrow", batches, methods=("average", "weight"), alphas=3, progress=False
    )
    for end in (0, -1):
        assert result.losses["average"][end] == pytest.approx(result.losses["weight"][end], rel=1e-5)
    # The embedded model streams token rows like any other (export writes embed / head in row blocks).
    a, b = to_common_shape(hf_lmc.canonicalize(tmp_path / "wide"), hf_lmc.canonicalize(tmp_path / "narrow"))
    for group in ("embed", "head"):
        window, whole = b.group(group, slice(2, 9)), b.group(group)
        for name, t in whole.items():
            expected = t[2:9] if name in b.spec.token_row_names() else t
            torch.testing.assert_close(
                window[name], expected, rtol=1e-6, atol=1e-7
            )  # BLAS may sum a short block in another order
    # Several models of different widths: one line saying they merge two at a time.
    capsys.readouterr()
    three = [str(tmp_path / m) for m in ("wide", "narrow", "narrow")]
    assert main(["merge", *three, "-o", str(tmp_path / "three")]) != 0
    err = capsys.readouterr().err
    assert "merge two at a time" in err and err.count("\n") == 1 and not (tmp_path / "three").exists(), err
    deeper = build_model(
        type(narrow_config).from_dict({**narrow_config.to_dict(), "n_layer": 3}), seed=3, dtype=torch.float32
    )
    deeper.save_pretrained(tmp_path / "deeper")
    capsys.readouterr()
    assert main(["merge", str(tmp_path / "narrow"), str(tmp_path / "deeper"), "-o", str(tmp_path / "out")]) != 0
    err = capsys.readouterr().err
    assert err.startswith("hf-lmc: error:") and "num_layers 2 vs 3" in err and err.count("\n") == 1, err
