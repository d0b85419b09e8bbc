# SPDX-License-Identifier: LGPL-2.1-or-later
"""Agent workflows (org.epd1.Workflow): branches over KV sequences, forked copy-on-write.

    import epd, epd.workflow as ew
    with epd.Client() as c:
        c.register("decode", "Qwen3-VL-8B", "cuda:0", kv=epd.KvLayout(36, 16, 2048, 2048))
        wf = ew.Workflow.create(c, seq.path, prompt_tokens)    # branch 0: its own CoW clone
        b, head = wf.fork(0)                                  # a new branch; no byte copied
        step = wf.advance(b, prompt_tokens + tool_output)     # head shares the common prefix
        step.prefix_blocks                                     # pages reused as they are
        ... append pages to step.head, compute the rest of the KV into them ...
        wf.drop(b); wf.release()

A workflow belongs to the client that created it (released when it disconnects) and
needs the daemon's WAL (StateDirectory=): every call is journaled before it returns.
Errors are epd.EpdError with the D-Bus error name (NotFound, PermissionDenied, Stale,
LimitExceeded, InvalidArgument, Failed). See docs/scheduler.md#workflows."""

import ctypes
from typing import List, NamedTuple, Optional, Sequence as Seq, Tuple

from . import _lib
from .sequence import Sequence

__all__ = ["Workflow", "Step", "Segment", "Branch"]

_P = ctypes.POINTER


class _CSegment(ctypes.Structure):
    _fields_ = [("prev_block", ctypes.c_uint32), ("n_blocks", ctypes.c_uint32), ("new_offset", ctypes.c_uint32),
                ("aligned", ctypes.c_bool)]


class _CBranch(ctypes.Structure):
    _fields_ = [("branch", ctypes.c_uint32), ("alive", ctypes.c_bool), ("head", ctypes.c_void_p),
                ("steps", ctypes.c_uint64), ("n_tokens", ctypes.c_uint32)]


class Segment(NamedTuple):
    """Predecessor blocks [prev_block, prev_block+n_blocks) found at token new_offset."""
    prev_block: int
    n_blocks: int
    new_offset: int
    aligned: bool


class Branch(NamedTuple):
    branch: int
    alive: bool
    head: Optional[str]  # object path of the head sequence; None when not alive
    steps: int
    n_tokens: int


class Step(NamedTuple):
    """What Advance answered: the new head (a Sequence of the caller's), how many of its
    leading pages are the predecessor's (shared, not copied), and the moved segments."""
    head: Sequence
    prefix_blocks: int
    segments: List[Segment]


def _lib_workflows():
    lib = _lib.lib()
    if getattr(lib, "_epd_workflows_declared", False):
        return lib
    c_int, c_char_p, c_size_t, c_uint32, c_void_p, c_bool = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t,
                                                             ctypes.c_uint32, ctypes.c_void_p, ctypes.c_bool)
    u32p = _P(c_uint32)
    decls = {
        "epd_workflow_create": (c_int, [c_void_p, c_char_p, u32p, c_size_t, _P(c_void_p), _P(c_void_p)]),
        "epd_workflow_fork": (c_int, [c_void_p, c_char_p, c_uint32, _P(c_uint32), _P(c_void_p)]),
        "epd_workflow_advance": (c_int, [c_void_p, c_char_p, c_uint32, u32p, c_size_t, c_bool, _P(c_void_p),
                                         _P(c_uint32), _P(_P(_CSegment)), _P(c_size_t)]),
        "epd_workflow_merge": (c_int, [c_void_p, c_char_p, c_uint32, c_uint32]),
        "epd_workflow_drop": (c_int, [c_void_p, c_char_p, c_uint32]),
        "epd_workflow_release": (c_int, [c_void_p, c_char_p]),
        "epd_workflow_attach": (c_int, [c_void_p, c_char_p]),
        "epd_workflow_get_branches": (c_int, [c_void_p, c_char_p, _P(_P(_CBranch)), _P(c_size_t)]),
        "epd_workflow_branches_free": (None, [_P(_CBranch), c_size_t]),
    }
    _lib.declare(lib, decls)
    lib._epd_workflows_declared = True
    return lib




def _tokens(tokens: Seq[int]):
    return _lib.u32_array(tokens, "tokens")


class Workflow:
    """One workflow of this client, by id (32 hex digits). A branch number or token
    outside [0, 2**32) is ValueError (checked here: ctypes would pass its low bits)."""

    def __init__(self, client, workflow_id: str, arena: Optional[str] = None):
        self._client, self._lib = client, _lib_workflows()
        self.id = workflow_id
        self._arena = arena

    def __repr__(self):
        return f"<epd.workflow.Workflow {self.id}>"

    def _id(self) -> bytes:
        return self.id.encode()

    @classmethod
    def create(cls, client, sequence: str, tokens: Seq[int], arena: Optional[str] = None) -> "Workflow":
        """A workflow whose branch 0 is a CoW clone of `sequence` (whose KV covers
        `tokens`); the caller keeps its own sequence. Returns the workflow; its branch 0
        head is head(0)."""
        lib = _lib_workflows()
        arr, n = _tokens(tokens)
        wf, head = ctypes.c_void_p(), ctypes.c_void_p()
        client._check(lib.epd_workflow_create(client._c, sequence.encode(), arr, n, ctypes.byref(wf),
                                              ctypes.byref(head)), "create workflow")
        _lib.take_string(lib, head)
        return cls(client, _lib.take_string(lib, wf), arena)

    def fork(self, branch: int = 0) -> Tuple[int, Sequence]:
        """A new branch on a CoW clone of `branch`'s head: (its number, its head)."""
        nb, head = ctypes.c_uint32(), ctypes.c_void_p()
        branch = _lib.u32(branch, "branch")
        self._client._check(self._lib.epd_workflow_fork(self._client._c, self._id(), branch, ctypes.byref(nb),
                                                        ctypes.byref(head)), f"fork branch {branch}")
        return nb.value, Sequence(self._client, _lib.take_string(self._lib, head), self._arena)

    def advance(self, branch: int, tokens: Seq[int], segments: bool = False) -> Step:
        """Moves `branch` to a new step over `tokens`; the new head shares the
        predecessor's longest block-aligned common prefix, the rest is the caller's to
        append and compute. The predecessor head is released by the daemon."""
        branch = _lib.u32(branch, "branch")
        arr, n = _tokens(tokens)
        head, prefix = ctypes.c_void_p(), ctypes.c_uint32()
        segs, nseg = _P(_CSegment)(), ctypes.c_size_t()
        self._client._check(self._lib.epd_workflow_advance(self._client._c, self._id(), branch, arr, n, segments,
                                                           ctypes.byref(head), ctypes.byref(prefix),
                                                           ctypes.byref(segs), ctypes.byref(nseg)),
                            f"advance branch {branch}")
        out = [Segment(segs[i].prev_block, segs[i].n_blocks, segs[i].new_offset, bool(segs[i].aligned))
               for i in range(nseg.value)]
        if segs:
            self._lib.free(ctypes.cast(segs, ctypes.c_void_p))
        return Step(Sequence(self._client, _lib.take_string(self._lib, head), self._arena), prefix.value, out)

    def merge(self, source: int, into: int):
        """`into` adopts `source`'s head; `source` is gone."""
        source, into = _lib.u32(source, "source"), _lib.u32(into, "into")
        self._client._check(self._lib.epd_workflow_merge(self._client._c, self._id(), source, into),
                            f"merge branch {source} into {into}")

    def drop(self, branch: int):
        branch = _lib.u32(branch, "branch")
        self._client._check(self._lib.epd_workflow_drop(self._client._c, self._id(), branch), f"drop branch {branch}")

    def release(self):
        """Releases every branch's sequence and forgets the workflow."""
        self._client._check(self._lib.epd_workflow_release(self._client._c, self._id()), "release workflow")

    def attach(self):
        """After an epdd restart: takes the workflow back (same uid, or root)."""
        self._client._check(self._lib.epd_workflow_attach(self._client._c, self._id()), "attach workflow")

    def branches(self) -> List[Branch]:
        v, n = _P(_CBranch)(), ctypes.c_size_t()
        self._client._check(self._lib.epd_workflow_get_branches(self._client._c, self._id(), ctypes.byref(v),
                                                                ctypes.byref(n)), "workflow branches")
        try:
            return [Branch(v[i].branch, bool(v[i].alive),
                           ctypes.string_at(v[i].head).decode() if v[i].alive else None, v[i].steps, v[i].n_tokens)
                    for i in range(n.value)]
        finally:
            self._lib.epd_workflow_branches_free(v, n.value)

    def head(self, branch: int) -> Sequence:
        for b in self.branches():
            if b.branch == branch and b.alive:
                return Sequence(self._client, b.head, self._arena)
        from . import EpdError
        raise EpdError(2, "org.epd1.Error.NotFound", f"no live branch {branch}", "workflow head")
