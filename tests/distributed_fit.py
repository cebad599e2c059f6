"""Run by tests/test_learned.py under torchrun (2 processes, gloo) and as 1 process.

Each process trains on its shard of the same global batches; the trained parameters, the
merge's logits and the endpoint elements each process holds are saved by the main process so
the test can compare the 2-process runs (endpoints whole or sharded) with the 1-process run.

    python tests/distributed_fit.py OUT [--shard-endpoints | --shared-build] [--offload] [--gather-float32] [--whole-build]
        [--family=NAME] [--dual] [--objective=NAME] [--resume] [--gather-head] [--tensor-parallel]

``--offload`` keeps the shards in CPU memory (FSDP2's CPU offload: on a CPU machine the same
memory, but the offload code path); ``--gather-float32`` gathers the float64 endpoints in float32;
``--whole-build`` has every process build all of every layer (``EndpointSharding(build=False)``);
``--shared-build`` keeps the endpoints whole and shares only the build (``EndpointSharding(layers=False)``);
``--family=`` picks the tiny model (default ``gpt2``); ``--dual`` trains a :class:`DualMatcher`
(default: :class:`LearnedMatcher`); ``--objective=`` the loss (default: the library's);
``--resume`` kills the run after its second step's checkpoint and resumes it in a fresh matcher;
``--gather-head`` gathers the head instead of running the loss vocabulary-parallel;
``--tensor-parallel`` runs the layers tensor-parallel (their outputs gathered, not their weights).
"""

import gc
import json
import sys

import torch
from accelerate import Accelerator

from hf_lmc import DualMatcher, EndpointSharding, LearnedMatcher, WeightMatcher
from hf_lmc.canonical.exactness import tiny_configs
from tests.models import build_model


def main(out: str, flags: list[str]) -> None:
    shard = ("--shard-endpoints" in flags or "--shared-build" in flags) and EndpointSharding(
        layers="--shard-endpoints" in flags,
        offload="--offload" in flags,
        dtype=torch.float32 if "--gather-float32" in flags else None,
        build="--whole-build" not in flags,
        share_from=0,  # tiny models: every group shared
        vocab_parallel="--gather-head" not in flags,  # the head vocabulary-parallel unless told
        tensor_parallel="--tensor-parallel" in flags,  # the layers' weights gathered unless told
    )
    path_class = DualMatcher if "--dual" in flags else LearnedMatcher
    named = [f.removeprefix("--objective=") for f in flags if f.startswith("--objective=")]
    objective = {"objective": named[-1]} if named else {}
    accelerator = Accelerator(cpu=True)  # first: sharded endpoints need the process group
    family = next((f.removeprefix("--family=") for f in flags if f.startswith("--family=")), "gpt2")
    config = tiny_configs()[family]
    model_a, model_b = (
        build_model(config, seed=1, dtype=torch.float64),
        build_model(config, seed=2, dtype=torch.float64),
    )
    torch.manual_seed(0)  # the same lambda draws in every process
    starts = []  # weight matching runs in the main process alone; the others receive its start
    match = WeightMatcher.match
    WeightMatcher.match = lambda self, a, b: starts.append(1) or match(self, a, b)
    matcher = path_class(model_a, model_b, dtype=torch.float64, shard_endpoints=shard, **objective)
    starts = accelerator.gather(torch.tensor([float(len(starts))])).tolist()
    g = torch.Generator().manual_seed(0)
    if family == "vit":
        size = (4, config.num_channels, config.image_size, config.image_size)
        global_batches = [
            {
                "pixel_values": torch.randn(size, generator=g, dtype=torch.float64),
                "labels": torch.randint(0, config.num_labels, (4,), generator=g),
            }
            for _ in range(3)
        ]
    else:
        global_batches = [{"input_ids": torch.randint(0, config.vocab_size, (4, 10), generator=g)} for _ in range(3)]
    rank, count = accelerator.process_index, accelerator.num_processes
    shards = [{k: v.chunk(count)[rank] for k, v in batch.items()} for batch in global_batches]
    located = []  # the worst point, re-located after every step (on each process's shards, averaged)
    record = lambda step, m: located.append(float(m.worst_alpha))
    options = {
        "steps": 3,
        "lr": 1e-2,
        "target_barrier": None,  # no batches held out: located on the latest shards
        "accelerator": accelerator,
        "locate_every": 1,
        "progress": False,
    }
    if "--resume" in flags:  # killed after step 2's checkpoint, resumed by a fresh matcher
        folder = out + ".state"

        class Killed(Exception):
            pass

        def kill(step, m):
            record(step, m)
            if step == 3:
                raise Killed

        try:
            matcher.fit(shards, checkpoint_dir=folder, checkpoint_every=1, callback=kill, **options)
        except Killed:
            pass
        located.pop()  # step 3 is trained again by the resumed run
        torch.manual_seed(0)
        matcher = path_class(model_a, model_b, dtype=torch.float64, shard_endpoints=shard, **objective)
        options |= {"checkpoint_dir": folder, "resume": True}
    losses = matcher.fit(shards, callback=record, **options)
    merged = matcher.merge(0.5)  # a collective when the endpoints are sharded: every process calls it
    with torch.no_grad():
        logits = merged(**{k: v for k, v in global_batches[0].items() if k != "labels"}).logits
    held = torch.tensor([float(sum(store.local_numel() for store in matcher.interpolant.endpoints))])
    held = accelerator.gather(held).tolist()
    store = matcher.interpolant.endpoints[0]
    layers = sum(
        t.numel() for g in range(store.spec.num_layers) for t in store.load(g).values()
    )  # a collective when sharded
    before = store.load(0)
    matcher.float()  # dtype moves reach sharded layers too
    after = store.load(0)
    moved = all(after[n].dtype == torch.float32 and torch.equal(after[n], before[n].float()) for n in before)
    if accelerator.is_main_process:
        params = {
            k: v.detach().clone()
            for k, v in matcher.state_dict().items()
            if "template" not in k and "interpolant" not in k
        }
        torch.save({"params": params, "logits": logits}, out)
        with open(out + ".json", "w") as f:
            json.dump(
                {
                    "num_processes": accelerator.num_processes,
                    "losses": losses,
                    "located": located,
                    "held": held,
                    "layers_per_model": layers,
                    "moved": moved,
                    "starts": starts,
                },
                f,
            )
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    # An orderly teardown once the run's objects are gone (the collection: modules hold the groups
    # in cycles): destroying a group nothing holds joins gloo's threads before the process ends.
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
