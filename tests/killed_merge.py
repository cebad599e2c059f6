"""Run by tests/test_learned.py under torchrun: ``hf-lmc merge`` whose processes die, with no
clean-up, at their Nth optimiser step, as a killed run does.

    python -m torch.distributed.run ... tests/killed_merge.py N merge A B -o OUT ...
"""

import os
import sys

import torch

from hf_lmc.cli import main

if __name__ == "__main__":
    kill_at, argv = int(sys.argv[1]), sys.argv[2:]
    step, taken = torch.optim.Adam.step, []

    def dying(self, *args, **kwargs):
        taken.append(1)
        if len(taken) == kill_at:
            os._exit(137)  # as SIGKILL leaves it: nothing flushed, nothing cleaned up
        return step(self, *args, **kwargs)

    torch.optim.Adam.step = dying
    sys.exit(main(argv))
