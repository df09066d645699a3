"""Which bytes of a file the OS page cache holds (mincore(2)), so the engine can tell
reads that will wait on the device from reads that are memory copies.

A range is mapped (read-only, nothing is read: mapping faults no page in), asked about
and unmapped again: a whole checkpoint is never mapped, so the address space stays
what the pools need. Where mincore is not available the answer is None.
"""

from __future__ import annotations

import ctypes
import mmap

import numpy as np

_PAGE = mmap.PAGESIZE
_libc = None


def _lib():
    global _libc
    if _libc is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_int, ctypes.c_long]
            libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            _libc = libc
        except (OSError, AttributeError):
            _libc = False
    return _libc


def resident_pages(fd: int, offset: int, length: int) -> np.ndarray | None:
    """One 0/1 entry per page of `fd` from the page holding `offset` through the one
    holding `offset + length - 1`: 1 where the page cache holds it. None if unknown."""
    libc = _lib()
    if not libc or length <= 0:
        return None
    begin = offset // _PAGE * _PAGE
    size = offset + length - begin
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, begin)
    if addr in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        vec = (ctypes.c_ubyte * (-(-size // _PAGE)))()
        if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
            return None
        return np.frombuffer(bytes(vec), dtype=np.uint8) & 1
    finally:
        libc.munmap(ctypes.c_void_p(addr), size)


def uncached_share(ranges) -> float | None:
    """Share of the pages of `(fd, offset, length)` ranges that the page cache does not
    hold: how much of a read would come from the device. None if unknown."""
    missing = total = 0
    for fd, offset, length in ranges:
        pages = resident_pages(fd, offset, length)
        if pages is None:
            return None
        missing += int(pages.size - pages.sum())
        total += pages.size
    return missing / total if total else None


