"""The command line's front doors, one module per command, named as it is typed (``hf-lmc apply`` is
:mod:`hf_lmc.commands.apply`); :mod:`hf_lmc.cli` builds the parser from them."""
