"""Measuring a merge: loss on batches (the sliced head loss of causal LMs), evaluation and fitting
batches, barriers along the path and over the simplex, and where a barrier comes from."""
