"""Prompt token ids checked against a vocabulary, in C where they can be, once.

A prompt's ids are checked where they enter (the gRPC door, `pagefleet.LLM`, the router for a
text prompt it tokenized) and become `CheckedIds`, a uint32 array that remembers the vocabulary
it was checked against: everything below (the router, a group, the engine) trusts it instead of
checking again. The ids stay an array up to the engine, which alone needs a list of Python
ints; an array also pickles to a Ray actor far faster than a list (benchmarks/RESULTS.md).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np


class CheckedIds(array):
    """Token ids known to be in [0, vocab): a uint32 array (what the hashers read) that is
    trusted wherever it goes, pickled with its `vocab`."""

    vocab: int

    @classmethod
    def trusted(cls, checked: array | np.ndarray, vocab: int) -> CheckedIds:
        """`checked` (an array whose ids were checked against `vocab`) as CheckedIds."""
        out = cls("I")
        if isinstance(checked, np.ndarray):
            out.frombytes(checked.astype(np.uint32).tobytes())
        else:
            out.frombytes(checked.tobytes())
        out.vocab = vocab
        return out


def check_token_ids(ids: Sequence[int] | np.ndarray, vocab: int) -> tuple[list[int] | array, CheckedIds]:
    """(ids, checked) when every id is an integer in [0, vocab), else a ValueError that names
    the first that is not: `checked` is the ids as `CheckedIds`, and `ids` a list of them, or
    `checked` itself when they came as an array. CheckedIds of this vocabulary are not checked
    again."""
    if isinstance(ids, CheckedIds) and ids.vocab == vocab:
        return ids, ids
    if isinstance(ids, array) and ids.typecode == "I":
        ids = np.frombuffer(ids, dtype=np.uint32)  # checked and copied as a numpy array
    if isinstance(ids, np.ndarray):
        checked = CheckedIds.trusted(_from_numpy(ids, vocab), vocab)
        return checked, checked
    ids = list(ids)
    if not ids:
        raise ValueError("prompt is empty")
    checked = _all_below(ids, vocab)
    if checked is None:  # the fast check failed; the scan names the culprit
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
    return ids, CheckedIds.trusted(checked, vocab)


def token_list(ids: Sequence[int] | np.ndarray, vocab: int) -> list[int]:
    """The checked ids as a list of Python ints (see `check_token_ids`), for the engine."""
    ids, checked = check_token_ids(ids, vocab)
    return ids if isinstance(ids, list) else checked.tolist()


def _all_below(ids: list[int], vocab: int) -> array | None:
    """`ids` as a uint32 array if every id is an int in [0, vocab), else None. The conversion
    refuses negatives, ids >= 2**32 and non-ints in one C loop; the max is taken over the
    array's buffer (far cheaper than over the list of ints)."""
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
        raise ValueError(f"prompt token ids must be a 1-d array of integers, got {ids.dtype} {ids.shape}")
    if ids.size == 0:
        raise ValueError("prompt is empty")
    if (i := first_outside(ids, vocab)) is not None:
        raise ValueError(f"prompt token id {int(ids[i])} is outside the vocabulary [0, {vocab})")
    checked = array("I")
    checked.frombytes(ids.astype(np.uint32).tobytes())
    return checked
