"""``python -m hf_lmc``: the command line (as under ``accelerate launch -m hf_lmc`` or ``torchrun -m hf_lmc``)."""

import sys

from hf_lmc.cli import main

sys.exit(main())
