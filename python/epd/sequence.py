# SPDX-License-Identifier: LGPL-2.1-or-later
"""KV sequences (org.epd1.Sequence): page tables in a KV arena of epdd.

    import epd, epd.sequence
    with epd.Client() as c:
        c.register("prefill", "Qwen3-VL-8B", "cuda:0", kv=epd.KvLayout(36, 16, 2048, 2048))
        s = epd.sequence.Sequence.create(c, "host0", 4)    # 4 fresh pages
        s.page_buffer(0)[:4] = b"KV.."                    # write into the shared arena
        branch = s.clone()                                 # shares every page, copies nothing
        pages, copied = branch.prepare_write(0, 1)         # copy-on-write of page 0 only
        s.publish(0, block_hashes)                         # cache the blocks for reuse
        t, n = epd.sequence.Sequence.from_prefix(c, "host0", block_hashes)

A sequence belongs to the client that made it and is released when it disconnects;
grant() lets another registered worker read and clone it. See docs/pages.md.
"""

import ctypes
from typing import List, Optional, Sequence as Seq, Tuple

from . import _lib

__all__ = ["Sequence", "prefix_match"]

_P = ctypes.POINTER
_u32p = _P(ctypes.c_uint32)


def _lib_sequences():
    """libepd with the sequence prototypes declared (once)."""
    lib = _lib.lib()
    if getattr(lib, "_epd_sequences_declared", False):
        return lib
    c_int, c_char_p, c_size_t = ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t
    c_uint32, c_uint64, c_void_p = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p
    decls = {
        "epd_sequence_create": (c_int, [c_void_p, c_char_p, c_uint32, _P(c_void_p), _P(_u32p), _P(c_size_t)]),
        "epd_sequence_create_from_prefix": (c_int, [c_void_p, c_char_p, _P(c_uint64), c_size_t, _P(c_void_p),
                                                    _P(c_size_t), _P(_u32p), _P(c_size_t)]),
        "epd_prefix_match": (c_int, [c_void_p, c_char_p, _P(c_uint64), c_size_t]),
        "epd_sequence_append": (c_int, [c_void_p, c_char_p, c_uint32, _P(_u32p), _P(c_size_t)]),
        "epd_sequence_truncate": (c_int, [c_void_p, c_char_p, c_uint32]),
        "epd_sequence_clone": (c_int, [c_void_p, c_char_p, _P(c_void_p)]),
        "epd_sequence_prepare_write": (c_int, [c_void_p, c_char_p, c_uint32, c_uint32, _u32p]),
        "epd_sequence_publish": (c_int, [c_void_p, c_char_p, c_uint32, _P(c_uint64), c_size_t]),
        "epd_sequence_grant": (c_int, [c_void_p, c_char_p, c_char_p]),
        "epd_sequence_revoke": (c_int, [c_void_p, c_char_p, c_char_p]),
        "epd_sequence_release": (c_int, [c_void_p, c_char_p]),
        "epd_sequence_get_pages": (c_int, [c_void_p, c_char_p, _P(_u32p), _P(c_size_t)]),
        "epd_sequence_get_page_size": (c_int, [c_void_p, c_char_p, _P(c_uint64)]),
        "epd_sequence_get_arena": (c_int, [c_void_p, c_char_p, _P(c_void_p)]),
    }
    _lib.declare(lib, decls)
    lib._epd_sequences_declared = True
    return lib


def _take_string(lib, p: ctypes.c_void_p) -> str:
    s = ctypes.cast(p, ctypes.c_char_p).value.decode()
    lib.free(p)
    return s


def _take_pages(lib, p, n: int) -> List[int]:
    pages = [p[i] for i in range(n)]
    lib.free(ctypes.cast(p, ctypes.c_void_p))
    return pages


def _hashes(hashes: Seq[int]):
    """The chain as a uint64_t array: each hash an int in [0, 2**64) (none is masked to
    64 bits: one outside is ValueError)."""
    return _lib.u64_array(hashes, "hashes")


def prefix_match(client, arena: str, hashes: Seq[int]) -> int:
    """How many leading blocks of a chain of block hashes are cached (nothing pinned)."""
    lib = _lib_sequences()
    arr, n = _hashes(hashes)
    return client._check(lib.epd_prefix_match(client._c, arena.encode(), arr, n), "match prefix")


class Sequence:
    """One sequence, by object path. Methods raise epd.EpdError with the D-Bus error name,
    and ValueError for a count or page number outside [0, 2**32) or a hash outside
    [0, 2**64) (checked here: ctypes would pass its low bits)."""

    def __init__(self, client, path: str, arena: Optional[str] = None):
        self._client = client
        self._lib = _lib_sequences()
        self.path = path
        self._arena = arena
        self._page_size = None

    def __repr__(self):
        return f"<epd.sequence.Sequence {self.path}>"

    def _p(self) -> bytes:
        return self.path.encode()

    @classmethod
    def create(cls, client, arena: str, n_pages: int) -> "Sequence":
        lib = _lib_sequences()
        path, pages, n = ctypes.c_void_p(), _u32p(), ctypes.c_size_t()
        n_pages = _lib.u32(n_pages, "n_pages")
        client._check(lib.epd_sequence_create(client._c, arena.encode(), n_pages, ctypes.byref(path),
                                              ctypes.byref(pages), ctypes.byref(n)), "create sequence")
        _take_pages(lib, pages, n.value)
        return cls(client, _take_string(lib, path), arena)

    @classmethod
    def from_prefix(cls, client, arena: str, hashes: Seq[int]) -> Tuple["Sequence", int]:
        """A new sequence of the longest cached prefix of the chain; returns it and its length."""
        lib = _lib_sequences()
        arr, nh = _hashes(hashes)
        path, pages, n, blocks = ctypes.c_void_p(), _u32p(), ctypes.c_size_t(), ctypes.c_size_t()
        client._check(lib.epd_sequence_create_from_prefix(client._c, arena.encode(), arr, nh, ctypes.byref(path),
                                                          ctypes.byref(blocks), ctypes.byref(pages),
                                                          ctypes.byref(n)), "create sequence from prefix")
        _take_pages(lib, pages, n.value)
        return cls(client, _take_string(lib, path), arena), blocks.value

    @property
    def pages(self) -> List[int]:
        pages, n = _u32p(), ctypes.c_size_t()
        self._client._check(self._lib.epd_sequence_get_pages(self._client._c, self._p(), ctypes.byref(pages),
                                                             ctypes.byref(n)), "sequence pages")
        return _take_pages(self._lib, pages, n.value)

    @property
    def arena(self) -> str:
        """The arena the sequence's pages are in (asked once: it never changes)."""
        if self._arena is None:
            p = ctypes.c_void_p()
            self._client._check(self._lib.epd_sequence_get_arena(self._client._c, self._p(), ctypes.byref(p)),
                                "sequence arena")
            self._arena = _take_string(self._lib, p)
        return self._arena

    @property
    def page_size(self) -> int:
        if self._page_size is None:
            v = ctypes.c_uint64()
            self._client._check(self._lib.epd_sequence_get_page_size(self._client._c, self._p(), ctypes.byref(v)),
                                "sequence page size")
            self._page_size = v.value
        return self._page_size

    def append(self, n_pages: int) -> List[int]:
        n_pages = _lib.u32(n_pages, "n_pages")
        pages, n = _u32p(), ctypes.c_size_t()
        self._client._check(self._lib.epd_sequence_append(self._client._c, self._p(), n_pages, ctypes.byref(pages),
                                                          ctypes.byref(n)), "append")
        return _take_pages(self._lib, pages, n.value)

    def truncate(self, n_pages: int):
        """Keeps the first n_pages pages."""
        self._client._check(self._lib.epd_sequence_truncate(self._client._c, self._p(), _lib.u32(n_pages, "n_pages")),
                            "truncate")

    def clone(self) -> "Sequence":
        path = ctypes.c_void_p()
        self._client._check(self._lib.epd_sequence_clone(self._client._c, self._p(), ctypes.byref(path)), "clone")
        return Sequence(self._client, _take_string(self._lib, path), self._arena)

    def prepare_write(self, first: int, count: int) -> Tuple[List[int], int]:
        """The pages of [first, first+count) that may be written, and how many the daemon copied."""
        first, count = _lib.u32(first, "first"), _lib.u32(count, "count")
        out = (ctypes.c_uint32 * max(count, 1))()
        copied = self._client._check(self._lib.epd_sequence_prepare_write(self._client._c, self._p(), first, count,
                                                                          out), "prepare write")
        return list(out[:count]), copied

    def publish(self, first: int, hashes: Seq[int]) -> int:
        arr, n = _hashes(hashes)
        first = _lib.u32(first, "first")
        return self._client._check(self._lib.epd_sequence_publish(self._client._c, self._p(), first, arr, n),
                                   "publish")

    def grant(self, worker_path: str):
        self._client._check(self._lib.epd_sequence_grant(self._client._c, self._p(), worker_path.encode()), "grant")

    def revoke(self, worker_path: str):
        self._client._check(self._lib.epd_sequence_revoke(self._client._c, self._p(), worker_path.encode()),
                            "revoke")

    def release(self):
        self._client._check(self._lib.epd_sequence_release(self._client._c, self._p()), "release")

    def page_buffer(self, index: int, arena: Optional[str] = None) -> memoryview:
        """A writable view of the bytes of page `index` in the mapped arena (no copy).
        Call prepare_write() first if the page may be shared."""
        a = self._client.arena(arena or self.arena)
        page = self.pages[index]
        return a.buffer(a.data_offset + page * self.page_size, self.page_size)
