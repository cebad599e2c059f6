"""Run by tests/test_learned.py under torchrun (2 processes, gloo) and as 1 process.

Each process trains on its shard of the same global batches; the trained parameters are saved
by the main process so the test can compare the 2-process run with the 1-process run.
"""

import json
import sys

import torch
from accelerate import Accelerator

from hf_lmc import LearnedMatcher
from hf_lmc.verify import tiny_configs
from tests.models import build_model


def main(out: str) -> None:
    accelerator = Accelerator(cpu=True)
    config = tiny_configs()["gpt2"]
    model_a, model_b = build_model(config, seed=1, dtype=torch.float64), build_model(config, seed=2, dtype=torch.float64)
    torch.manual_seed(0)  # the same lambda draws in every process
    matcher = LearnedMatcher(model_a, model_b, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    global_batches = [torch.randint(0, config.vocab_size, (4, 10), generator=g) for _ in range(3)]
    shards = [{"input_ids": x.chunk(accelerator.num_processes)[accelerator.process_index]} for x in global_batches]
    losses = matcher.fit(shards, steps=3, lr=1e-2, accelerator=accelerator, progress=False)
    if accelerator.is_main_process:
        torch.save({k: v.detach().clone() for k, v in matcher.state_dict().items() if "template" not in k and "interpolant" not in k}, out)
        with open(out + ".json", "w") as f:
            json.dump({"num_processes": accelerator.num_processes, "losses": losses}, f)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1])
