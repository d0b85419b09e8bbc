# SPDX-License-Identifier: LGPL-2.1-or-later
"""Prefix-aware placement (org.epd1.Placement): where the longest cached prefix of a
request's chained block hashes lives across the cluster, so that a router can send the
request where its KV already is.

    import epd, epd.placement
    with epd.Client() as c:
        p = epd.placement.locate_prefix(c, block_hashes)
        if p.n_blocks:
            route_to(p.host, p.worker)      # p.candidates: every holder, longest first

The daemon asks the owners of the blocks (rendezvous hashing over the live members) and
caches their answers for DirectoryCacheTime=. See docs/cluster.md.
"""

import ctypes
from typing import List, NamedTuple, Sequence as Seq

from . import _lib

__all__ = ["Candidate", "Placement", "locate_prefix"]


class Candidate(NamedTuple):
    host: str
    arena: str
    worker: str
    n_blocks: int


class Placement(NamedTuple):
    n_blocks: int              # of the best candidate; 0: no host holds the first block
    host: str
    arena: str
    worker: str
    candidates: List[Candidate]
    owners_missing: int        # owners that did not answer in time (their blocks: not cached)


class _Candidate(ctypes.Structure):
    _fields_ = [("host", ctypes.c_char_p), ("arena", ctypes.c_char_p), ("worker", ctypes.c_char_p),
                ("n_blocks", ctypes.c_uint32)]


class _Placement(ctypes.Structure):
    _fields_ = [("n_blocks", ctypes.c_uint32), ("host", ctypes.c_char_p), ("arena", ctypes.c_char_p),
                ("worker", ctypes.c_char_p), ("candidates", ctypes.POINTER(_Candidate)),
                ("n_candidates", ctypes.c_size_t), ("owners_missing", ctypes.c_uint32)]


def _lib_placement():
    lib = _lib.lib()
    if getattr(lib, "_epd_placement_declared", False):
        return lib
    lib.epd_locate_prefix.restype = ctypes.c_int
    lib.epd_locate_prefix.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t,
                                      ctypes.POINTER(_Placement)]
    lib.epd_placement_done.restype = None
    lib.epd_placement_done.argtypes = [ctypes.POINTER(_Placement)]
    lib._epd_placement_declared = True
    return lib


def locate_prefix(client, hashes: Seq[int]) -> Placement:
    """Which host, arena and worker hold the longest cached prefix of hashes. Raises
    epd.EpdError (org.epd1.Error.InvalidArgument for an empty list, LimitExceeded past
    65536 hashes); ValueError for a hash outside [0, 2**64)."""
    lib = _lib_placement()
    arr, n = _lib.u64_array(hashes, "hashes")  # each in [0, 2**64): none is masked (ValueError)
    p = _Placement()
    client._check(lib.epd_locate_prefix(client._c, arr, n, ctypes.byref(p)), "locate prefix")
    try:
        cands = [Candidate(p.candidates[i].host.decode(), p.candidates[i].arena.decode(),
                           p.candidates[i].worker.decode(), p.candidates[i].n_blocks)
                 for i in range(p.n_candidates)]
        return Placement(p.n_blocks, p.host.decode(), p.arena.decode(), p.worker.decode(), cands,
                         p.owners_missing)
    finally:
        lib.epd_placement_done(ctypes.byref(p))
