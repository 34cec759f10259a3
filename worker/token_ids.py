"""Prompt token ids checked against a vocabulary, in C where they can be.

The router checks a request's ids at the door and the engine checks every prompt it is given:
a 32k-token prompt costs ~0.4 ms so (a Python loop over it took ~3 ms, on the engine's loop
thread). Ids that come as an array (the gRPC door's numpy array) stay one until the engine,
which alone needs a list of Python ints: making that list costs ~1 ms at 32k tokens, and a
list pickles to a Ray actor ~6x slower than the array's bytes.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np


def check_token_ids(ids: Sequence[int] | np.ndarray, vocab: int) -> tuple[list[int] | array, array]:
    """(ids, checked) when every id is an integer in [0, vocab), else a ValueError that names
    the first that is not: `checked` is the ids as a uint32 array (what the hashers read), and
    `ids` a list of them, or `checked` itself when they came as an array."""
    if isinstance(ids, array) and ids.typecode == "I":
        ids = np.frombuffer(ids, dtype=np.uint32)  # checked and copied as a numpy array
    if isinstance(ids, np.ndarray):
        checked = _from_numpy(ids, vocab)
        return checked, checked
    ids = list(ids)
    if not ids:
        raise ValueError("prompt is empty")
    checked = _all_below(ids, vocab)
    if checked is None:  # the fast check failed; the scan names the culprit
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
    return ids, checked


def token_list(ids: Sequence[int] | np.ndarray, vocab: int) -> list[int]:
    """The checked ids as a list of Python ints (see `check_token_ids`), for the engine."""
    ids, checked = check_token_ids(ids, vocab)
    return ids if isinstance(ids, list) else checked.tolist()


def _all_below(ids: list[int], vocab: int) -> array | None:
    """`ids` as a uint32 array if every id is an int in [0, vocab), else None. The conversion
    refuses negatives, ids >= 2**32 and non-ints in one C loop (0.3 ms at 32k tokens); the max
    is taken over the array's buffer (10 us; over the list of ints it costs 0.3-0.9 ms)."""
    try:
        checked = array("I", ids)
    except (OverflowError, TypeError):
        return None
    return checked if np.frombuffer(checked, dtype=np.uint32).max() < vocab else None


def first_outside(ids: np.ndarray, vocab: int) -> int | None:
    """The position of the first id of an integer array outside [0, vocab), or None."""
    bad = np.flatnonzero((ids < 0) | (ids >= vocab))
    return int(bad[0]) if bad.size else None


def _from_numpy(ids: np.ndarray, vocab: int) -> array:
    if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"prompt token ids must be a 1-d array of integers, got {ids.dtype} {ids.shape}")  # fmt: skip
    if ids.size == 0:
        raise ValueError("prompt is empty")
    if (i := first_outside(ids, vocab)) is not None:
        raise ValueError(f"prompt token id {int(ids[i])} is outside the vocabulary [0, {vocab})")
    checked = array("I")
    checked.frombytes(ids.astype(np.uint32).tobytes())
    return checked
