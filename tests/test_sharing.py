"""The sharded build's arithmetic, in one process: a process's rows of a move are those rows of
the whole move, in value and in gradient (the collective part runs under gloo in test_learned)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_lmc
from hf_lmc.learned.sharing import RowSharing, owner_of, share_of
from hf_lmc.learned.trainable import TrainableTransform
from tests.models import ARCHITECTURES, CONFIGS, build_model, transform_tensors


def test_shares_are_torch_chunks():
    """A process's rows are ``torch.chunk``'s (FSDP2's shard of the same tensor); shares past
    the end are empty, together they cover every row once, and ``owner_of`` names the share
    that holds a row."""
    for size in range(12):
        for count in range(1, 6):
            rows = torch.arange(size)
            chunks = list(rows.chunk(count)) if size else []
            shares = [rows[share_of(size, r, count)] for r in range(count)]
            assert torch.equal(torch.cat(shares), rows)
            assert all(torch.equal(s, c) for s, c in zip(shares, chunks))
            assert all(s.numel() == 0 for s in shares[len(chunks) :])
            assert [owner_of(row, size, count) for row in range(size)] == [
                r for r in range(count) for _ in shares[r]
            ]  # the owner of a row is the process whose share holds it


def _transforms(spec, start):
    """The element kinds a build moves: a random exact symmetry, and trainable transforms with
    fixed, straight-through and Sinkhorn permutations, and with the permutations alone."""
    yield "exact", start, None
    for options in (
        {"permutations": "fixed"},
        {"permutations": "ste"},
        {"permutations": "sinkhorn"},
        {"permutations": "ste", "trained": "permutations"},
    ):
        init = start if options.get("trained") != "permutations" else None
        trainable = TrainableTransform(spec, init=init, dtype=torch.float64, **options)
        with torch.no_grad():  # away from the start: every parameter moves the tensors
            for p in trainable.parameters():
                p.add_(0.01 * torch.randn_like(p))
        yield str(options), trainable(), trainable


@pytest.mark.parametrize("arch", ARCHITECTURES)
@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_rows_of_a_move_are_the_rows_of_the_whole_move_in_value_and_gradient(arch, data):
    """Over randomised configs and every element kind: ``apply_rows`` over any split of the rows
    (shares empty included) concatenates to ``apply_tensor``, and the transforms' gradients
    summed over the shares are the whole move's; ``apply_columns`` the same over a matrix's
    columns."""
    config = data.draw(CONFIGS[arch]())
    a = hf_lmc.canonicalize(build_model(config, seed=1))
    torch.manual_seed(0)
    start = hf_lmc.random_symmetry(a.spec, seed=2)
    tensors = a.state_dict()
    upstream = {name: torch.randn(t.shape, dtype=torch.float64) for name, t in tensors.items()}
    for label, transform, trainable in _transforms(a.spec, start):
        whole = {name: transform.apply_tensor(name, t) for name, t in tensors.items()}
        expected = None
        moved = [name for name, t in whole.items() if t.requires_grad]  # the tensors the transform moves
        if trainable is not None:
            torch.autograd.backward([whole[n] for n in moved], [upstream[n] for n in moved], retain_graph=True)
            expected = [p.grad.clone() for p in trainable.parameters() if p.grad is not None]
            trainable.zero_grad()
        for count in (2, 3, 7):
            got = {}
            for name, t in tensors.items():
                shares = [share_of(t.shape[0], r, count) for r in range(count)]
                parts = [transform.apply_rows(name, t, rows) for rows in shares]
                got[name] = torch.cat(parts)
                torch.testing.assert_close(got[name], whole[name], rtol=1e-12, atol=1e-12, msg=f"{label}: {name}")
                if t.dim() >= 2:  # a matrix's columns too: the tensor-parallel output projections' shares
                    shares = [share_of(t.shape[1], r, count) for r in range(count)]
                    columns = torch.cat([transform.apply_columns(name, t, c) for c in shares], 1)
                    torch.testing.assert_close(columns, whole[name], rtol=1e-12, atol=1e-12, msg=f"{label}: {name}")
                    if trainable is not None and name in moved:
                        columns.backward(upstream[name], retain_graph=True)
                        by_columns = [p.grad.clone() for p in trainable.parameters() if p.grad is not None]
                        trainable.zero_grad()
                        whole[name].backward(upstream[name], retain_graph=True)
                        by_whole = [p.grad.clone() for p in trainable.parameters() if p.grad is not None]
                        trainable.zero_grad()
                        assert len(by_columns) == len(by_whole) > 0, name
                        for mine, theirs in zip(by_columns, by_whole):
                            torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12, msg=f"{label}: {name}")
            if trainable is not None:
                torch.autograd.backward([got[n] for n in moved], [upstream[n] for n in moved], retain_graph=True)
                grads = [p.grad.clone() for p in trainable.parameters() if p.grad is not None]
                trainable.zero_grad()
                assert len(grads) == len(expected) > 0
                for mine, theirs in zip(grads, expected):
                    torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12, msg=label)


def test_a_column_share_of_a_moved_and_a_staying_endpoint_is_the_columns_of_their_whole_mix():
    """A paired output projection's columns mix a staying endpoint's slice (laid out by rows)
    with a moved one's ``apply_columns`` (transposed, brought to rows before the sum): the
    columns of the whole mix, for every matrix."""
    from hf_lmc.learned.interpolant import Interpolant

    config = CONFIGS["gpt_neox"]().example()
    a = hf_lmc.canonicalize(build_model(config, seed=1)).state_dict()
    b = hf_lmc.canonicalize(build_model(config, seed=2))
    transform = hf_lmc.random_symmetry(b.spec, seed=3)
    b = b.state_dict()
    weights = (0.7, 0.3)
    for name, t in a.items():
        if t.dim() != 2:
            continue
        columns = share_of(t.shape[1], 1, 2)
        got = Interpolant._mixed(name, [(a, None), (b, transform)], weights, columns=columns)
        want = 0.7 * t + 0.3 * transform.apply_tensor(name, b[name])
        torch.testing.assert_close(got, want[:, columns], msg=name)


# The options whose parameterisation a shared build splits (Cayley's columns in every frame, the
# head maps' exponentials), and those it leaves whole on every process (exp, relaxed permutations).
_SHARED_OPTIONS = (
    {"permutations": "fixed"},
    {"permutations": "fixed", "frame": "target"},
    {"permutations": "fixed", "frame": "both"},
    {"permutations": "fixed", "orthogonal": "exp"},
    {"permutations": "ste"},
)


def _parameterisations(rank: int, world: int, store: str, configs) -> None:
    """One of ``world`` gloo processes: every transform of every config computed with the
    parameterisation shared and whole, compared in value and in the gradient of the processes'
    summed losses (the shared backward's reduce-scatters against an all-reduce of whole ones)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        sharing = RowSharing(init_device_mesh("cpu", (world,)))
        for config in configs:
            spec = hf_lmc.canonicalize(build_model(config, seed=1)).spec
            for options in _SHARED_OPTIONS:
                torch.manual_seed(0)  # one pair of transforms on every process
                start = hf_lmc.random_symmetry(spec, seed=2)
                a, b = (TrainableTransform(spec, init=s, dtype=torch.float64, **options) for s in (None, start))
                with torch.no_grad():
                    for p in (*a.parameters(), *b.parameters()):
                        p.add_(0.01 * torch.randn_like(p))
                params = [p for p in (*a.parameters(), *b.parameters()) if p.requires_grad]
                generator = torch.Generator().manual_seed(rank)  # each process its own loss
                results = []
                for shared in (None, sharing):
                    moved = [b(shared)]
                    if a.fixed_assignments and b.fixed_assignments:
                        moved.append(a.relative(b, shared))
                    tensors = {f"{k}.{n}": t for k, m in enumerate(moved) for n, t in transform_tensors(m).items()}
                    generator.manual_seed(rank)
                    loss = sum(
                        (t * torch.randn(t.shape, dtype=t.dtype, generator=generator)).sum()
                        for t in tensors.values()
                        if t.requires_grad
                    )
                    grads = torch.autograd.grad(loss, params, allow_unused=True)
                    grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
                    for g in grads:
                        dist.all_reduce(g)
                    results.append(({n: t.detach() for n, t in tensors.items()}, grads))
                (whole, whole_grads), (mine, mine_grads) = results
                assert whole.keys() == mine.keys()
                for name in whole:
                    torch.testing.assert_close(mine[name], whole[name], rtol=1e-10, atol=1e-12, msg=f"{options} {name}")
                for g, h in zip(mine_grads, whole_grads):
                    torch.testing.assert_close(g, h, rtol=1e-9, atol=1e-11, msg=str(options))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@settings(max_examples=1, deadline=None)
@given(data=st.data())
def test_a_shared_parameterisation_is_the_whole_one_in_value_and_gradient(tmp_path_factory, data):
    """Under gloo at 2 and 3 processes, over a randomised config of every family and every
    parameterisation: the transforms built with the solves and exponentials shared are those
    built whole on each process, and the summed gradient of the processes' losses is the same."""
    configs = [data.draw(CONFIGS[arch]()) for arch in ARCHITECTURES]
    for world in (2, 3):
        store = tmp_path_factory.mktemp("store") / "rendezvous"
        torch.multiprocessing.spawn(_parameterisations, args=(world, str(store), configs), nprocs=world)
