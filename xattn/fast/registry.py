"""The fast paths' objects by integer handle. Under torch.compile a projection or a fused step is one opaque custom
op (the compiler cannot trace oneDNN's or fbgemm's packed weights); the op carries only an int, and finds its object
here. An entry goes when its object does."""

from __future__ import annotations

import itertools
import weakref

_live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_next = itertools.count()


def register(obj: object) -> int:
    handle = next(_next)
    _live[handle] = obj
    return handle


def lookup(handle: int):
    return _live[handle]


def alive(handle: int) -> bool:
    return handle in _live
