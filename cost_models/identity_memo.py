"""Values derived from a ModelSpec, memoised by the spec's identity: the search prices thousands of configurations of
one model, and hashing a ModelSpec's fields costs more than most of what is derived from it.

    memo = IdentityMemo(limit=256)
    memo.get(model, (tp, ep), lambda: derive(model, tp, ep))

Each entry holds its object, so no other object takes its id while the entry lives; past `limit` entries the memo
starts afresh.
"""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")


class IdentityMemo:
    def __init__(self, limit: int):
        self.limit = limit
        self._entries: dict[tuple, tuple[object, object]] = {}

    def get(self, obj: object, args: tuple, make: Callable[[], T]) -> T:
        key = (id(obj), *args)
        cached = self._entries.get(key)
        if cached is None or cached[0] is not obj:
            if len(self._entries) > self.limit:
                self._entries.clear()
            cached = self._entries[key] = (obj, make())
        return cached[1]


__all__ = ["IdentityMemo"]
