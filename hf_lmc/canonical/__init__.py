"""The exact canonical form (:mod:`hf_lmc.canonical.form`) and the adapters that rewrite each
model family into it (:mod:`hf_lmc.canonical.adapters`), with the architecture spec, models of two
widths in one shape, and the exactness checks."""
