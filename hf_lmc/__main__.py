"""``python -m hf_lmc``: the command line (as under ``accelerate launch -m hf_lmc`` or ``torchrun -m hf_lmc``)."""

import sys

from .cli import main

sys.exit(main())
