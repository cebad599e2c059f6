"""Progress bars that the user's environment can silence.

hf_lmc's bars follow the variables that silence the bars of its neighbours: ``TQDM_DISABLE``
(tqdm's own) and ``HF_HUB_DISABLE_PROGRESS_BARS`` (huggingface_hub's, which transformers
follows too). Both are read when a bar is made, not when tqdm was imported (tqdm reads its
``TQDM_*`` settings once, at import), so that ``hf-lmc --quiet`` and a caller that sets them
later are obeyed.
"""

from __future__ import annotations

import os

from tqdm.auto import tqdm

#: Environment variables that turn every bar off when set to a true value.
SILENCING = ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")


def silenced() -> bool:
    """Whether the environment asks for no progress bars."""
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on") for name in SILENCING)


def bar(iterable=None, *, show: bool = True, **options) -> tqdm:
    """A tqdm bar over ``iterable`` (or a manual one), hidden when ``show`` is false or the
    environment silences bars (:func:`silenced`)."""
    if not show or silenced():
        options["disable"] = True
    return tqdm(iterable, **options)
