"""Loss along the path and the barrier: definition, data forms, and the aligned path's gain."""

from __future__ import annotations

import json

import pytest
import torch

from hf_lmc.canonical.exactness import tiny_configs
from hf_lmc.config.options import EvalOptions
from hf_lmc.evaluation.barriers import alpha_grid, barrier, loss_barrier, plot
from hf_lmc.evaluation.batches import DataError, load_batches
from tests.models import build_model, char_tokenizer_folder


def test_barrier_definition():
    alphas = alpha_grid(5)
    assert alphas == [0.0, 0.25, 0.5, 0.75, 1.0]
    # endpoints 1 and 3: the straight line at 0.5 is 2, so a loss of 2.5 there is a barrier of 0.5
    assert loss_barrier(alphas, [1.0, 1.6, 2.5, 2.6, 3.0]) == pytest.approx(0.5)
    assert loss_barrier(alphas, [1.0, 1.5, 2.0, 2.5, 3.0]) == pytest.approx(0.0)


def test_vit_barrier_on_tensors_reports_accuracy_and_twin_alignment_is_flat(tmp_path):
    config = tiny_configs()["vit"]
    a = build_model(config, seed=1, dtype=torch.float32)
    data = {"pixel_values": torch.randn(24, 3, 8, 8), "labels": torch.randint(0, 3, (24,))}
    torch.save(data, tmp_path / "eval.pt")
    # B = A itself: both paths are flat
    result = barrier(a, a, str(tmp_path / "eval.pt"), alphas=3, progress=False, eval_options=EvalOptions(batch_size=10))
    assert set(result.losses) == {"average", "weight"} and len(result.accuracies["weight"]) == 3
    assert all(abs(v) < 1e-5 for v in result.barriers.values())
    assert "| weight |" in result.table()
    assert json.loads(result.to_json())["barriers"]["average"] == pytest.approx(result.barriers["average"])
    assert plot(result, tmp_path / "path.png").stat().st_size > 1000


def test_text_data_from_file_and_folder(tmp_path):
    config = tiny_configs()["gpt2"]
    tokenizer_folder = char_tokenizer_folder(tmp_path / "model", config.vocab_size)
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("abcabcabc " * 20)
    (tmp_path / "texts" / "b.txt").write_text("cab " * 30)
    options = EvalOptions(batch_size=4, seq_len=8)
    from_folder = load_batches(str(tmp_path / "texts"), config, tokenizer_folder, options)
    from_file = load_batches(str(tmp_path / "texts" / "a.txt"), config, tokenizer_folder, options)
    assert from_folder[0]["input_ids"].shape == (4, 8) and len(from_folder) > len(from_file)
    with pytest.raises(DataError, match="exceeds the model's context"):
        load_batches(str(tmp_path / "texts"), config, tokenizer_folder, EvalOptions(seq_len=1000))
    with pytest.raises(DataError, match="needs a tokenizer"):
        load_batches(["abc"], config, None, options)


@pytest.mark.slow
def test_weight_matching_flattens_the_path_to_a_moved_twin_with_noise():
    config = tiny_configs()["llama"]
    a = build_model(config, seed=1, dtype=torch.float32)
    import hf_lmc

    ca = hf_lmc.canonicalize(a)
    moved = hf_lmc.random_symmetry(ca.spec, seed=9, dtype=torch.float32).apply(ca)
    noisy = moved.map_tensors(lambda _, t: t + 0.05 * t.std() * torch.randn_like(t)).materialize()
    b = hf_lmc.to_hf(noisy)
    batches = [
        {"input_ids": torch.randint(0, config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(i))}
        for i in range(3)
    ]
    result = barrier(a, b, batches, alphas=5, progress=False)
    # Untrained models give no meaningful vanilla barrier; the aligned path must stay on the
    # line between the endpoints while the vanilla midpoint is a different function.
    assert abs(result.barriers["weight"]) < 5e-3
    assert abs(result.losses["average"][2] - result.losses["weight"][2]) > 1e-2
