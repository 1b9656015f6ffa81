"""Values computed once per object: one search plans the same profile at several C, and each
plan would otherwise hash it and derive its device view again (a second each for GPT-3 175B).

An entry lives as long as its object; objects are told apart by identity, because hashing a
frozen profile's fields costs what the memo saves."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")

_MEMO: dict[int, tuple[weakref.ref, dict[Hashable, Any]]] = {}


def _forget(key: int, memo: dict = _MEMO) -> Callable[[weakref.ref], None]:
    # the dict itself, not the module's name for it: at exit the name may be gone first
    return lambda _: memo.pop(key, None)


def once_per_object(obj: object, key: Hashable, compute: Callable[[], T]) -> T:
    """compute() the first time `key` is asked of `obj` (by identity), the same value after."""
    held = _MEMO.get(id(obj))
    if held is None or held[0]() is not obj:
        held = (weakref.ref(obj, _forget(id(obj))), {})
        _MEMO[id(obj)] = held
    values = held[1]
    if key not in values:
        values[key] = compute()
    return values[key]
