# SPDX-License-Identifier: LGPL-2.1-or-later
"""ctypes declarations of libepd (client/include/epd/epd.h). No compiled extension."""

import ctypes
import ctypes.util
import math
import numbers
import operator
import os
import time
from typing import Optional

c_char_p = ctypes.c_char_p
c_int = ctypes.c_int
c_size_t = ctypes.c_size_t
c_uint32 = ctypes.c_uint32
c_uint64 = ctypes.c_uint64
c_void_p = ctypes.c_void_p


class EpdArena(ctypes.Structure):
    _fields_ = [
        ("name", c_char_p),
        ("domain", c_char_p),
        ("usage", c_char_p),
        ("size", c_uint64),
        ("data_offset", c_uint64),
        ("gpu", c_int),
        ("fd", c_int),
        ("base", c_void_p),
    ]


class EpdKvLayout(ctypes.Structure):
    _fields_ = [
        ("layers", c_uint32),
        ("tokens_per_block", c_uint32),
        ("k_bytes_per_token", c_uint64),
        ("v_bytes_per_token", c_uint64),
        ("dtype", c_char_p),
    ]


def _installed_library():
    """Where meson put libepd next to this package: _where.py, written by the build,
    says so (a build tree: the library's path; an install: the package's and the
    library's directories under the prefix, so that the prefix is found from where the
    package is, wherever it was installed, with or without DESTDIR)."""
    try:
        from . import _where
    except ImportError:
        return None  # the source tree: no build wrote it
    path = getattr(_where, "BUILD_LIBRARY", None)
    if path:
        return path if os.path.exists(path) else None
    here = os.path.dirname(os.path.abspath(__file__))
    tail = os.path.normpath(_where.PACKAGE_DIR_IN_PREFIX)
    if not here.endswith(os.sep + tail):
        return None  # moved away from its prefix
    prefix = here[: -len(tail) - 1]
    path = os.path.join(prefix, _where.LIBDIR_IN_PREFIX, _where.SONAME)
    return path if os.path.exists(path) else None


def _find_library():
    """EPD_LIBRARY (a path), then the libepd that meson installed or built beside this
    package (_where.py), then the dynamic linker's search (libepd.so.0): no
    LD_LIBRARY_PATH is needed for an installed epd or a build tree's package."""
    path = os.environ.get("EPD_LIBRARY")
    if path:
        return path
    path = _installed_library()
    if path:
        return path
    for name in ("libepd.so.0", ctypes.util.find_library("epd")):
        if name:
            return name
    raise OSError("libepd not found: install epd (meson install), use the package of a build tree "
                  "(PYTHONPATH=BUILD/python), or set EPD_LIBRARY to libepd.so's path")


def _declare(lib):
    """Prototypes, so that ctypes converts arguments and results exactly."""
    P = ctypes.POINTER
    decls = {
        "epd_connect": (c_int, [c_char_p, P(c_void_p)]),
        "epd_disconnect": (c_void_p, [c_void_p]),
        "epd_register": (c_int, [c_void_p, c_char_p, c_char_p, c_char_p, P(EpdKvLayout), P(c_char_p)]),
        "epd_register_named": (c_int, [c_void_p, c_char_p, c_char_p, c_char_p, P(EpdKvLayout), P(c_char_p),
                                       c_char_p, P(c_char_p)]),
        "epd_unregister": (c_int, [c_void_p]),
        "epd_worker_path": (c_char_p, [c_void_p]),
        "epd_arena_count": (c_size_t, [c_void_p]),
        "epd_arena_get": (P(EpdArena), [c_void_p, c_size_t]),
        "epd_arena_find": (c_int, [c_void_p, c_char_p]),
        "epd_arena_map": (c_int, [c_void_p, c_size_t, P(c_void_p)]),
        "epd_get_fd": (c_int, [c_void_p]),
        "epd_process": (c_int, [c_void_p]),
        "epd_wait": (c_int, [c_void_p, c_uint64]),
        "epd_flush": (c_int, [c_void_p, c_uint64]),
        "epd_last_error_name": (c_char_p, [c_void_p]),
        "epd_last_error_message": (c_char_p, [c_void_p]),
    }
    declare(lib, decls)
    # The library frees these; ctypes must not take ownership.
    lib.free.restype = None
    lib.free.argtypes = [c_void_p]
    return lib


def declare(lib, decls):
    """Sets the result and argument types of libepd's functions: {name: (restype, argtypes)}."""
    for name, (restype, argtypes) in decls.items():
        f = getattr(lib, name)
        f.restype = restype
        f.argtypes = argtypes


def unsigned(value, bits: int, what: str) -> int:
    """value as a C unsigned integer of `bits` bits: an int (or an object with __index__,
    numpy's integers) in [0, 2**bits), else ValueError naming `what` and the range.
    Every count, index, page number, layer group, token, branch, hash and size the
    binding passes to libepd goes through here (or u32_array/u64_array): ctypes takes
    any Python int and keeps its low bits, so 2**32 + 3 pages were 3 and -1 was
    2**32 - 1, silently."""
    try:
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an integer in [0, 2**{bits}), not {value!r}") from None
    if not 0 <= v < 1 << bits:
        raise ValueError(f"{what} must be in [0, 2**{bits}), not {v}")
    return v


def u32(value, what: str) -> int:
    """A uint32_t argument (unsigned())."""
    return unsigned(value, 32, what)


def u64(value, what: str) -> int:
    """A uint64_t argument (unsigned())."""
    return unsigned(value, 64, what)


def _array(ctype, bits: int, values, what: str):
    values = values if isinstance(values, (list, tuple)) else list(values)
    try:
        arr = (ctype * max(len(values), 1))(*values)
    except TypeError:
        arr = None
    # min() and max() run in C: the loop that names the culprit only for a bad list.
    if arr is None or (values and (min(values) < 0 or max(values) >= 1 << bits)):
        for i, v in enumerate(values):
            unsigned(v, bits, f"{what}[{i}]")
    return arr, len(values)


def u32_array(values, what: str):
    """(a uint32_t array of values, their count): every element checked as u32() does,
    ValueError naming `what`[i]. At least one element long (ctypes has no empty array)."""
    return _array(c_uint32, 32, values, what)


def u64_array(values, what: str):
    """u32_array() of uint64_t."""
    return _array(c_uint64, 64, values, what)


UINT64_MAX = 2**64 - 1


def timeout(value, what: str, past: bool = False) -> Optional[float]:
    """A timeout in seconds as the binding's calls take it: None or infinity is no end
    (None); NaN, or what is not a number, is ValueError; below 0, ValueError, or 0
    with `past` (the waits: a deadline already passed only looks)."""
    if value is None:
        return None
    try:
        v = float(value) if isinstance(value, numbers.Real) else None
    except OverflowError:  # an int past any float
        v = None
    if v is None:
        raise ValueError(f"{what} must be a number of seconds, not {value!r}")
    if math.isnan(v):
        raise ValueError(f"{what} is NaN: a number of seconds, or None (no end)")
    if v == math.inf:
        return None
    if v < 0:
        if not past:
            raise ValueError(f"{what} must not be negative, not {value!r}")
        return 0.0
    return v


def usec(value, what: str, past: bool = False) -> int:
    """timeout() in microseconds, for libepd: no end is UINT64_MAX (libepd's "forever");
    one past what a uint64_t holds is ValueError."""
    v = timeout(value, what, past)
    return UINT64_MAX if v is None else u64(int(v * 1e6), f"{what} in microseconds")


def take_string(lib, p: ctypes.c_void_p) -> str:
    """A string libepd allocated for the caller, which it then frees."""
    s = ctypes.string_at(p.value).decode()
    lib.free(p)
    return s


# The longest a binding call stays inside libepd when it waits: a wait longer than
# this (or with no timeout) is made of such slices. ctypes keeps the thread in C while
# libepd waits, and Python runs its signal handlers (KeyboardInterrupt, SIGTERM's) only
# between bytecodes: libepd retries an interrupted wait, and a wait that nothing ends (a
# ring on a bus connection, or of a daemon in another PID namespace, has no pidfd to
# tell it the daemon died) would never let them run.
WAIT_SLICE_USEC = 200_000


def wait_slices(timeout_s, what: str = "timeout_s"):
    """The timeouts, in microseconds, of the libepd calls that make one wait of
    timeout_s seconds (None or infinity: no end), each at most WAIT_SLICE_USEC: the
    caller makes one call per value until one is answered, and the handlers of signals
    caught meanwhile run between them. At least one value (0 when timeout_s is 0 or
    past: only look). timeout_s is checked here, before the first value (NaN:
    ValueError naming `what`)."""
    return _slices(timeout(timeout_s, what, past=True))


def _slices(timeout_s):
    if timeout_s is None:
        while True:
            yield WAIT_SLICE_USEC
    deadline = time.monotonic() + timeout_s
    left = timeout_s
    while True:
        yield min(max(0, int(left * 1e6)), WAIT_SLICE_USEC)
        left = deadline - time.monotonic()
        if left <= 0:
            return


_lib = None


def lib():
    global _lib
    if _lib is None:
        _lib = _declare(ctypes.CDLL(_find_library(), use_errno=True))
    return _lib


class Closing:
    """A handle on something of libepd's that close() gives back: usable in a with
    statement, and closed when garbage collected (quietly: the interpreter may be
    going away)."""

    def close(self):
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
