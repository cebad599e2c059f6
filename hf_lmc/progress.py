"""Progress bars that the user's environment can silence.

tqdm reads ``TQDM_DISABLE`` (and every ``TQDM_*`` setting) only for arguments its caller leaves
out, so a bar made with ``disable=False`` shows whatever the environment says. :func:`bar` leaves
``disable`` to the environment when progress is wanted and sets it only to hide the bar.
"""

from __future__ import annotations

from tqdm.auto import tqdm


def bar(iterable=None, *, show: bool = True, **options) -> tqdm:
    """A tqdm bar over ``iterable`` (or a manual one), hidden when ``show`` is false; when shown,
    ``TQDM_DISABLE`` and the other ``TQDM_*`` environment settings still apply."""
    if not show:
        options["disable"] = True
    return tqdm(iterable, **options)
