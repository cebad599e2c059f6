"""On a CUDA device: learned matching trains as on the CPU and merges exactly; weight matching
and the merge export (``device="cuda"``) recover twins.

Skipped where no GPU is present (CI has none; ``tests/test_devices.py`` checks device placement
there). ``accelerator.prepare`` moves the matcher, and with it the frozen endpoints (which are
neither parameters nor buffers), onto the device; the float64 run must then follow a CPU run
step for step, and ``merge`` must stay an exact symmetry of each endpoint, also after training
under bf16 autocast.
"""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from safetensors.torch import load_file

import hf_lmc
from hf_lmc import DualMatcher
from hf_lmc.canonical.exactness import float64_rmsnorm, tiny_configs
from hf_lmc.io import zoo
from hf_lmc.matching.solvers import assign_product
from hf_lmc.merging.pipeline import merge, merge_models
from tests.models import (
    ARCHITECTURES,
    build_model,
    logits,
    merged_error,
    relative_error,
    sample_inputs,
    transform_tensors,
    twin_folders,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def fresh_accelerator_state(cpu_accelerator, monkeypatch):
    """The device, not the suite's CPU default (tests/conftest.py); and since one process holds
    one accelerate state (device, mixed precision), each test starts anew."""
    monkeypatch.delenv("ACCELERATE_USE_CPU")
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _batches(config, dtype: torch.dtype, count: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    if config.model_type == "vit":
        shape = (4, config.num_channels, config.image_size, config.image_size)
        return [
            {
                "pixel_values": torch.randn(shape, generator=g, dtype=torch.float64).to(dtype),
                "labels": torch.randint(0, config.num_labels, (4,), generator=g),
            }
            for _ in range(count)
        ]
    return [{"input_ids": torch.randint(0, config.vocab_size, (4, 12), generator=g)} for _ in range(count)]


def _pair(arch: str, dtype: torch.dtype):
    config = tiny_configs()[arch]
    return config, build_model(config, seed=1, dtype=dtype), build_model(config, seed=2, dtype=dtype)


def _cuda(inputs: dict) -> dict:
    return {k: v.cuda() for k, v in inputs.items()}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_dual_matching_on_cuda_follows_the_cpu_run_and_merges_exactly(arch):
    config, model_a, model_b = _pair(arch, torch.float64)
    batches = _batches(config, torch.float64, count=3)
    with float64_rmsnorm():
        torch.manual_seed(0)  # the same lambda draws in both runs
        on_cpu = DualMatcher(model_a, model_b, dtype=torch.float64)
        optimizer = torch.optim.Adam(on_cpu.parameters(), lr=1e-2)  # what fit runs at a constant rate
        for batch in batches:
            on_cpu(batch).backward()
            optimizer.step()
            optimizer.zero_grad()
        torch.manual_seed(0)
        on_gpu = DualMatcher(model_a, model_b, dtype=torch.float64)
        on_gpu.fit(batches, steps=3, lr=1e-2, target_barrier=None, accelerator=Accelerator(), progress=False)

        assert all(p.device.type == "cuda" for p in on_gpu.parameters())
        stores = on_gpu.interpolant.endpoints
        assert all(
            t.device.type == "cuda" for store in stores for group in store.tensors.values() for t in group.values()
        )
        # The language models' losses are float32 even here: transformers' ForCausalLMLoss casts
        # the logits to float32. So the runs agree to that rounding, not float64's: on an H100 the
        # parameters (entries up to 3e-2 after three Adam steps) differed by at most 1.6e-8.
        for (name, p), (_, q) in zip(on_cpu.named_parameters(), on_gpu.named_parameters()):
            torch.testing.assert_close(q.cpu(), p, rtol=1e-6, atol=1e-7, msg=name)

        # Exact on the device: the merge at each end is its endpoint's function, compared on the
        # GPU (HF computes RoPE tables in float32, which differ by an ulp across devices).
        inputs = _cuda(sample_inputs(config, dtype=torch.float64))
        for alpha, endpoint in ((0.0, model_a), (1.0, model_b)):
            merged = on_gpu.merge(alpha)
            assert next(merged.parameters()).device.type == "cuda"
            assert relative_error(logits(merged, inputs), logits(copy.deepcopy(endpoint).cuda(), inputs)) < 1e-10
        # The same transforms merge to the same float64 weights on either device.
        on_cpu.load_state_dict({k: v.cpu() for k, v in on_gpu.state_dict().items()})
        on_device, on_host = on_gpu.merge(0.5).state_dict(), on_cpu.merge(0.5).state_dict()
        for key, weight in on_host.items():
            torch.testing.assert_close(on_device[key].cpu(), weight, rtol=1e-12, atol=1e-12, msg=key)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_bf16_autocast_trains_on_cuda_and_the_merge_stays_exact(arch):
    """Autocast covers the training loop only: ``merge`` builds float32 weights from the exact
    (hardened) transforms, so the endpoints are reproduced to float32 precision."""
    config, model_a, model_b = _pair(arch, torch.float32)
    batches = _batches(config, torch.float32, count=1)
    torch.manual_seed(0)
    matcher = DualMatcher(model_a, model_b)
    with torch.no_grad():
        before = matcher(batches[0], alpha=0.5).item()
    losses = matcher.fit(batches, steps=20, lr=1e-2, mixed_precision="bf16", locate_every=5, progress=False)
    assert torch.isfinite(torch.tensor(losses)).all()
    assert matcher.worst_alpha.device.type == "cuda" and 0.1 <= float(matcher.worst_alpha) <= 0.9  # located on the GPU
    assert next(matcher.parameters()).device.type == "cuda"
    with torch.no_grad():
        after = matcher(_cuda(batches[0]), alpha=0.5).item()
    assert after < before
    inputs = sample_inputs(config)
    for alpha, endpoint in ((0.0, model_a), (1.0, model_b)):
        merged = matcher.merge(alpha)
        assert next(merged.parameters()).dtype == torch.float32
        assert relative_error(logits(merged, _cuda(inputs)).cpu(), logits(endpoint, inputs)) < 1e-5


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_weight_merge_on_cuda_of_a_twin_is_a(arch, tmp_path):
    """Weight matching and the export on the GPU (`--device cuda`): B a random symmetry of A."""
    model, folders = twin_folders(tmp_path, arch, [8])
    out = merge(*folders, tmp_path / "merged", progress=False, device="cuda").output
    assert merged_error(out, model) < 1e-3


def test_universe_merge_on_cuda_of_twins_is_the_model(tmp_path):
    model, folders = twin_folders(tmp_path, "llama", [8, 9])
    out = merge_models(folders, tmp_path / "merged", progress=False, device="cuda").output
    assert merged_error(out, model) < 1e-3


def test_offloaded_endpoints_on_cuda_step_as_whole_ones():
    """``EndpointSharding(offload=True)`` on one GPU: the layers live in CPU memory (FSDP2) and
    are copied to the GPU when built; the loss and its gradients are the whole endpoints'."""
    import torch.distributed as dist

    from hf_lmc import EndpointSharding

    config = tiny_configs()["llama"]
    model_a, model_b = (
        build_model(config, seed=1, dtype=torch.float64),
        build_model(config, seed=2, dtype=torch.float64),
    )
    batch = {
        "input_ids": torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0)).cuda()
    }
    try:
        whole = DualMatcher(model_a, model_b, dtype=torch.float64, init="identity").cuda()
        offloaded = DualMatcher(
            model_a, model_b, dtype=torch.float64, init="identity", shard_endpoints=EndpointSharding(offload=True)
        ).cuda()
        shards = [
            p
            for store in offloaded.interpolant.endpoints
            for layer in store.layers.values()
            for p in layer.parameters()
        ]
        assert shards and all(p.to_local().device.type == "cpu" for p in shards)
        losses = [m(batch, alpha=0.5) for m in (whole, offloaded)]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-12, atol=1e-12)
        for (name, p), (_, q) in zip(whole.named_parameters(), offloaded.named_parameters()):
            if p.grad is not None:
                torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-12, msg=name)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_weight_matching_on_cuda_matches_the_cpu():
    """Independent models: the GPU's float32 products round differently, so the objective, not
    each assignment, is compared."""
    config = tiny_configs()["llama"]
    a, b = (hf_lmc.canonicalize(build_model(config, seed=s, dtype=torch.float32)) for s in (1, 2))
    cpu, gpu = hf_lmc.WeightMatcher(progress=False, device="cpu"), hf_lmc.WeightMatcher(progress=False, device="cuda")
    on_cpu, on_gpu = cpu.match(a, b), gpu.match(a, b)
    assert all(t.device.type == "cpu" for t in transform_tensors(on_gpu).values())
    assert cpu.objective(a, b, on_gpu) == pytest.approx(cpu.objective(a, b, on_cpu), rel=1e-4)


def test_unit_assignment_on_cuda_recovers_a_planted_permutation():
    """FFN 2048: the similarity, candidates and certificate screens on the GPU, scipy on the CPU."""
    g = torch.Generator().manual_seed(0)
    left = torch.randn(2048, 64, generator=g)
    perm = torch.randperm(2048, generator=g)
    right = left[perm] + 0.05 * torch.randn(2048, 64, generator=g)
    found = assign_product(left.cuda(), right.cuda())
    assert found.device.type == "cpu" and torch.equal(found, perm) and torch.equal(assign_product(left, right), perm)


@pytest.mark.parametrize("name", ["gpt2", "vit"])
def test_a_zoo_member_trained_on_cuda_follows_the_cpu_member(name, tmp_path):
    """``zoo.train(device="cuda")`` (the paper tier's full budget on a GPU): the seed's member,
    cached under the same key, its record naming the device, its weights the CPU run's to within
    the GPU's rounding after a few steps."""
    entry = zoo.ZOO[name].scaled(steps=5, warmup=1)
    on_cpu = zoo.train(entry, 0, cache=tmp_path / "cpu", progress=False)
    on_gpu = zoo.train(entry, 0, cache=tmp_path / "gpu", progress=False, device="cuda")
    assert on_cpu.name == on_gpu.name
    assert (on_cpu / "zoo.json").read_text().count('"device": "cpu"') == 1
    assert (on_gpu / "zoo.json").read_text().count('"device": "cuda"') == 1
    cpu, gpu = load_file(on_cpu / "model.safetensors"), load_file(on_gpu / "model.safetensors")
    assert cpu.keys() == gpu.keys()
    for key in cpu:
        assert relative_error(gpu[key], cpu[key]) < 1e-3, key
