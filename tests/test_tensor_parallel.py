"""Tensor-parallel layers (hf_lmc.learned.tensor_parallel): a layer's plan, read off the
adapter's export, rebuilds every linear from the processes' rows; under gloo the path's loss
and gradients are the one-process ones."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_lmc
import hf_lmc.learned.interpolant as interpolant_module
from hf_lmc import DualMatcher, EndpointSharding
from hf_lmc.canonical.exactness import tiny_configs
from hf_lmc.canonical.form import export_config, skeleton
from hf_lmc.learned.sharing import share_of
from hf_lmc.learned.tensor_parallel import plan_layer
from tests.models import ARCHITECTURES, CONFIGS, build_model

LANGUAGE_MODELS = ["gpt2", "gpt_neox", "llama"]


def _layer(model, i: int = 0):
    """A canonical model's layer ``i``: its tensors, their export, the export function, the
    stock layer module and its path."""
    canonical = hf_lmc.canonicalize(model, dtype=torch.float64)
    config = export_config(canonical)
    tensors = canonical.group(i)

    def export(t):
        return canonical.adapter.hf_group(t, config, canonical.spec, i)

    exported = export(tensors)
    key = next(iter(exported))
    path = key[: key.index(f".{i}.") + len(f".{i}")]
    layer = skeleton(canonical.adapter.model_class, config).get_submodule(path)
    return tensors, exported, export, layer, path + "."


def _plans(export, tensors, layer, prefix, count, pairable=False):
    shapes = {name: t.shape for name, t in tensors.items()}
    return [plan_layer(export, shapes, layer, prefix, rank, count, pairable) for rank in range(count)]


def _assembled(plan, tensors, exported, rank, count):
    local = {
        name: tensors[name][share_of(tensors[name].shape[0], rank, count)].reshape(-1, tensors[name][0].numel())
        for name in plan.matrices
    }
    local |= {name: tensors[name][:, share_of(tensors[name].shape[1], rank, count)].T for name in plan.columns}
    return plan.assemble(local, {n: tensors[n] for n in plan.vectors}, {n: exported[n] for n in plan.constants})


def _assert_output_features(built, exported, linear):
    """A process's weight and bias of a linear run at its output features are the exported
    ones at those features; the weight, output features first."""
    weight = built[linear.weight].movedim(linear.out_axis, 0)
    assert torch.equal(weight, exported[linear.weight].movedim(linear.out_axis, 0)[linear.own])
    if linear.bias is not None:
        assert torch.equal(built[linear.bias], exported[linear.bias][linear.own])
    return weight


@pytest.mark.parametrize("arch", LANGUAGE_MODELS)
@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_a_paired_plan_splits_each_output_projection_by_its_input_features(arch, data):
    """Where the attention reads its heads off its projections' widths and the key-value heads
    split evenly, the linears pair: those opening the heads and units run at each process's
    output features, as in an unpaired plan; the output projections at its input features,
    every input feature on one process, the bias on the first alone (the all-reduce adds it
    once); every process builds the projections' columns, the rest's rows."""
    model = build_model(data.draw(CONFIGS[arch]()))
    tensors, exported, export, layer, prefix = _layer(model)
    kv = getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads
    for count in [c for c in range(1, 6) if kv % c == 0]:
        plans = _plans(export, tensors, layer, prefix, count, pairable=True)
        assert all(plan is not None and plan.paired for plan in plans)
        assert set(plans[0].columns) == {n for n in tensors if n.endswith(("attn.o.weight", "mlp.down.weight"))}
        built = [_assembled(plan, tensors, exported, rank, count) for rank, plan in enumerate(plans)]
        for path, linear in plans[0].linears.items():
            seen = []
            for rank, plan in enumerate(plans):
                mine = plan.linears[path]
                weight = built[rank][mine.weight].movedim(mine.out_axis, 0)
                whole = exported[mine.weight].movedim(mine.out_axis, 0)
                if linear.split == "out":
                    _assert_output_features(built[rank], exported, mine)
                    continue
                assert torch.equal(weight, whole[:, mine.inputs])
                seen += mine.inputs.tolist()
                if mine.bias is not None:
                    bias = built[rank][mine.bias]
                    assert torch.equal(bias, exported[mine.bias] if rank == 0 else torch.zeros_like(bias))
            if linear.split == "in":
                assert sorted(seen) == list(range(exported[linear.weight].movedim(linear.out_axis, 0).shape[1]))


@pytest.mark.parametrize("arch", ARCHITECTURES)
@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_a_layer_plan_rebuilds_every_linear_from_the_processes_rows(arch, data):
    """Over randomised configs and 1 to 5 processes (uneven and empty shares included): each
    process's tensors of a planned linear are its output features of the exported weight and
    bias, read from its rows of the canonical matrices alone, and the processes' features,
    padded and put in order by the layout, are the whole exported weight; every other tensor of
    the layer is exported as it is."""
    tensors, exported, export, layer, prefix = _layer(build_model(data.draw(CONFIGS[arch]())))
    for count in range(1, 6):
        plans = _plans(export, tensors, layer, prefix, count)
        assert all(plan is not None for plan in plans)
        assert plans[0].linears and set(plans[0].matrices) == {n for n, t in tensors.items() if t.dim() >= 2}
        built = [_assembled(plan, tensors, exported, rank, count) for rank, plan in enumerate(plans)]
        for path, linear in plans[0].linears.items():
            parts = []
            for rank, plan in enumerate(plans):
                mine = plan.linears[path]
                weight = _assert_output_features(built[rank], exported, mine)
                parts.append(torch.cat([weight, weight.new_zeros(linear.layout.width - len(weight), weight.shape[1])]))
            whole = torch.cat(parts)
            order = linear.layout.order
            assert torch.equal(
                whole if order is None else whole[order], exported[linear.weight].movedim(linear.out_axis, 0)
            )
        for rank in range(count):
            assert built[rank].keys() == exported.keys()
            for name in plans[rank].constants:
                if name not in {lin.bias for lin in plans[rank].linears.values()}:
                    assert torch.equal(built[rank][name], exported[name])


@pytest.mark.parametrize(
    "damage",
    ["scaled row", "mixed rows", "a weight from a vector", "a norm from the tensors"],
)
def test_a_layer_whose_export_is_not_row_for_row_gets_no_plan(damage):
    """The plan is read off the export and checked: an output feature that is a scaled row or
    a mix of rows, a weight made of vectors, or a tensor other than a linear's that depends on
    the canonical tensors, and the layer keeps its weights gathered."""
    tensors, _, export, layer, prefix = _layer(build_model(tiny_configs()["gpt_neox"]))
    qkv = prefix + "attention.query_key_value.weight"
    norm = prefix + "input_layernorm.weight"

    def damaged(t):
        out = export(t)
        if damage == "scaled row":
            out[qkv] = torch.cat([2 * out[qkv][:1], out[qkv][1:]])
        elif damage == "mixed rows":
            out[qkv] = torch.cat([out[qkv][:1] + out[qkv][1:2], out[qkv][1:]])
        elif damage == "a weight from a vector":
            bias = t[next(n for n, v in t.items() if v.dim() == 1 and v.shape[0] == out[qkv].shape[1])]
            out[qkv] = torch.cat([bias[None], out[qkv][1:]])
        else:
            out[norm] = out[norm] + t[next(n for n, v in t.items() if v.dim() == 1 and v.shape == out[norm].shape)]
        return out

    assert all(plan is not None for plan in _plans(export, tensors, layer, prefix, 2))
    assert _plans(damaged, tensors, layer, prefix, 2) == [None, None]


def _paths(family: str, tensor_parallel: bool):
    config = tiny_configs()[family]
    models = [build_model(config, seed=s) for s in (1, 2)]
    torch.manual_seed(0)
    sharding = EndpointSharding(layers=False, share_from=0, tensor_parallel=tensor_parallel)
    return DualMatcher(*models, init="identity", dtype=torch.float64, shard_endpoints=sharding)


def _tensor_parallel_gradients(rank: int, world: int, store: str) -> None:
    """One of ``world`` gloo processes: the dual path's loss on its shard of a global batch and
    the mean over the processes of its parameters' gradients (DDP's), with the layers tensor
    parallel and with their weights gathered, against one process's path on the whole batch,
    for every causal family and both objectives (float64)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    gathers = []  # the linears' output collectives (gathers, or a pair's sums): none unless tensor parallel
    gathered_features, summed_features = interpolant_module.gathered_features, interpolant_module.summed_features
    interpolant_module.gathered_features = lambda *args: gathers.append("gathered") or gathered_features(*args)
    interpolant_module.summed_features = lambda *args: gathers.append("summed") or summed_features(*args)
    weights_gathered = set()  # the layers whose weights a call gathered: none while tensor parallel
    shared_build = interpolant_module.Interpolant._shared_build

    def recording_shared_build(self, group, *args, **kwargs):
        weights_gathered.add(group)
        return shared_build(self, group, *args, **kwargs)

    interpolant_module.Interpolant._shared_build = recording_shared_build
    try:
        for family in LANGUAGE_MODELS:
            vocab = tiny_configs()[family].vocab_size
            ids = torch.randint(0, vocab, (2 * world, 6), generator=torch.Generator().manual_seed(0))
            for objective in ("ensemble", "labels"):
                results = {}
                for name in ("whole", "gathered", "tensor parallel"):
                    if name == "whole":  # the reference: one process's path, no process group used
                        config = tiny_configs()[family]
                        models = [build_model(config, seed=s) for s in (1, 2)]
                        torch.manual_seed(0)
                        path = DualMatcher(*models, init="identity", dtype=torch.float64)
                        batch = {"input_ids": ids}
                    else:
                        path = _paths(family, name == "tensor parallel")
                        batch = {"input_ids": ids.chunk(world)[rank]}
                    path.objective = objective
                    with torch.no_grad():  # away from the identity: every map moves the tensors
                        for p in path.parameters():
                            if p.requires_grad:
                                p.add_(
                                    0.01
                                    * torch.randn(
                                        p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype
                                    )
                                )
                    before = len(gathers)
                    weights_gathered.clear()
                    loss = path(batch, alpha=0.3)
                    loss.backward()
                    assert (len(gathers) > before) == (name == "tensor parallel"), name
                    if (
                        name == "tensor parallel"
                    ):  # paired where the heads split evenly and the attention reads its width
                        config = tiny_configs()[family]
                        kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
                        paired = kv % world == 0
                        assert set(gathers[before:]) == ({"summed"} if paired else {"gathered"}), (family, world)
                    layers = set(range(tiny_configs()[family].num_hidden_layers))
                    if name != "whole":  # every layer tensor parallel, or every layer's weights gathered
                        assert layers & weights_gathered == (set() if name == "tensor parallel" else layers), name
                    grads = {n: p.grad.clone() for n, p in path.named_parameters() if p.grad is not None}
                    if name != "whole":
                        for g in grads.values():
                            dist.all_reduce(g)
                            g /= world
                        dist.all_reduce(total := loss.detach().clone())
                        loss = total / world
                    results[name] = (loss.detach(), grads)
                    assert grads
                expected_loss, expected = results["whole"]
                # LLaMA's RMSNorm computes in float32 whatever the model's dtype: a float64
                # rounding difference (the linears' products in other shapes) can flip a float32 one.
                rtol, atol = (1e-6, 1e-7) if family == "llama" else (1e-9, 1e-12)
                for name in ("gathered", "tensor parallel"):
                    value, grads = results[name]
                    message = f"{family}, {objective}, {name}"
                    torch.testing.assert_close(value, expected_loss, rtol=rtol, atol=atol, msg=message)
                    assert grads.keys() == expected.keys(), message
                    for key in expected:
                        torch.testing.assert_close(
                            grads[key], expected[key], rtol=rtol, atol=atol, msg=f"{message}: {key}"
                        )
        # Left to the byte rule: tensor-parallel while the launch's tokens times the layers'
        # rows (GPT-2's tiny layer: 72) are below their elements (768), 2 tokens a process, not 12.
        path = _paths("gpt2", None)
        for length, parallel in ((2, True), (12, False)):
            ids = torch.randint(
                0, tiny_configs()["gpt2"].vocab_size, (1, length), generator=torch.Generator().manual_seed(1)
            )
            before = len(gathers)
            path({"input_ids": ids}, alpha=0.3).backward()
            assert (len(gathers) > before) == parallel, length
    finally:
        interpolant_module.gathered_features, interpolant_module.summed_features = gathered_features, summed_features
        interpolant_module.Interpolant._shared_build = shared_build
        dist.destroy_process_group()


@pytest.mark.slow
def test_tensor_parallel_layers_give_the_one_process_loss_and_gradients(tmp_path_factory):
    """Under gloo at 2 and 3 processes (uneven shares of GQA's key-value rows at 3), the dual
    path with its layers tensor-parallel gives, on each process's shard of a global batch, the
    loss and the mean gradients of one process on the whole batch, as the gathered build does,
    for every causal family and both objectives; left to the byte rule, the layers run
    tensor-parallel on a short batch and not on a long one."""
    for world in (2, 3):
        store = tmp_path_factory.mktemp("store") / "rendezvous"
        torch.multiprocessing.spawn(_tensor_parallel_gradients, args=(world, str(store)), nprocs=world)
