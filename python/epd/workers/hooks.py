# SPDX-License-Identifier: LGPL-2.1-or-later
"""epd behind the hook names of vLLM's V1 KV connector and encoder-cache (EC) connector, so
that an engine adapter is a thin subclass that turns the engine's objects (requests,
forward context, paged blocks) into the plain values used here. Nothing here imports
vLLM; the worker harness (serve.py) drives its model through these hooks.

KV (EpdKvConnector), per engine step:
    scheduler side  request_finished(request_id) -> (delay_free, kv_transfer_params)
                    build_connector_meta(saves=[...], loads=[...], delayed=[...]) -> EpdKvMetadata
    worker side     register_kv_caches({layer_name: cache})   once: the layers' order
                    bind_connector_metadata(meta)             before the forward pass
                    start_load_kv()                           decode: accept the handoffs
                    wait_for_layer_load(layer_name)           decode: that layer has landed
                    save_kv_layer(layer_name, (k, v))         prefill: write it, ship its group
                    wait_for_save()                           prefill: every group reported
                    clear_connector_metadata()                after the forward pass
                    get_finished(finished_req_ids) -> (sent, received)

Encoder cache (EpdEcConnector):
    has_cache_item(mm_hash) -> bool           the feature cache holds it (the encoder may skip)
    save_caches(encoder_cache, mm_hash)       the encoder's output into a feature buffer
    start_load_caches(encoder_cache)          the bound request's features, in place on a GPU arena
    get_finished(finished_req_ids)            features of finished requests let go

Semantics follow vLLM's: saves are layer-wise and asynchronous (a group ships when its
last layer's writes have landed, told by a CUDA event, never by a host sync), loads are
layer-wise (wait_for_layer_load returns when the group holding the layer has landed),
and transfers finish asynchronously, reported by request id from get_finished()
(KVConnectorBase_V1's contract):

- a send (a save) is reported finished only for a request whose request_finished()
  returned delay_free_blocks=True, and only once the engine has passed its id in
  finished_req_ids (this call or an earlier one): vLLM asserts each reported id waited
  and frees its blocks then. A save the engine did not delay is released all the same
  (its handoff and pages go once the decode side is done with them), without a word;
- a receive (a load) is reported finished when its transfer is complete (every layer
  read and the handoff committed), whether or not the engine has finished the request:
  vLLM waits for finished_recving before it goes on with a request whose KV is being
  received, so such a request is finished before its receive only when it is aborted.
  (serve.py asks right after the decode and finds it there.) A load the engine
  finished before it was complete (aborted) is let go and not reported.

request_finished() is a scheduler-side hook in vLLM: it runs in the scheduler's process,
on the scheduler's connector object, while the sinks, handoffs and loads are the worker's
(another process, another object). Here one object plays both sides (the harness's
workers run engine and model in one process), so request_finished() reads the worker's
state: a save whose setup failed is not delayed. An adapter with the two sides apart
decides on the scheduler side (delay a request it scheduled a save for: it built that
metadata) and carries the decision to the worker side in the connector metadata:
build_connector_meta(delayed=[request ids]) on the scheduler, bind_connector_metadata()
on the worker records them as delayed, and get_finished() reports those (a save that
failed on the worker after the scheduler delayed it is reported too, so that vLLM frees
its blocks).

The one difference: vLLM's paged KV cache is the engine's own tensor, which the KV
connector reads and writes by block id. This harness's model keeps a contiguous cache
per layer, so a load's K/V are returned by wait_for_layer_load (and kept by
layer_kv()) rather than written into registered blocks, and save_kv_layer takes the
layer's (k, v) of the request rather than the paged layer plus slot mapping.
"""

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence as Seq, Set, Tuple

from .. import EpdError
from ..feature import prefetch
from ..handoff import Accepted, Ring
from ..sequence import Sequence
from . import connector as C


@dataclass
class KvTransfer:
    """One request's KV transfer in a step: a save (prefill) or a load (decode)."""
    request_id: str
    tokens: int
    destination: str = ""          # save: the decode host ("" = this one)
    target: Optional[str] = None   # save: the decode worker's object path, when known
    keep: bool = False             # load: keep the committed sequence (take_sequence())


@dataclass
class EpdKvMetadata:
    saves: List[KvTransfer] = field(default_factory=list)
    loads: List[KvTransfer] = field(default_factory=list)
    # Requests whose request_finished() returned delay_free_blocks=True on the scheduler
    # side (another process in vLLM): the worker side reports their sends finished.
    delayed: List[str] = field(default_factory=list)


class _Load:
    def __init__(self, t: KvTransfer):
        self.t = t
        self.source: Optional[C.EpdKvSource] = None
        self.layers: Dict[int, tuple] = {}
        self.committed: Optional[Sequence] = None
        self.done = False
        self.reported = False  # get_finished() said it received (once, as vLLM expects)


class EpdKvConnector:
    """The KV side. role "producer" (prefill: saves) or "consumer" (decode: loads)."""

    def __init__(self, client, layout: C.KvPageLayout, role: str, arena: str = "host0", group_size: int = 1,
                 ring: Optional[Ring] = None, device: Optional[str] = None, dtype: str = "bfloat16",
                 timeout_s: float = 30.0, background_setup: bool = False, save: str = "auto"):
        """save (producer): how save_kv_layer writes, EpdKvSink's save: "layer" (each layer
        at once, each group shipped as soon as it is written: the transfer overlaps the
        forward pass), "end" (every layer in one launch at wait_for_save, one notice for
        every group), or "auto": "end" for a save to this host from a GPU arena (the
        decode takes the pages where they are, or copies them GPU to GPU at copy-engine
        speed: nothing worth overlapping, while a launch and a notice per layer are on
        the prefill's critical path), "layer" for a save to another host."""
        if role not in ("producer", "consumer"):
            raise ValueError(f"role {role!r}: producer or consumer")
        if save not in ("auto", "layer", "end"):
            raise ValueError(f"save {save!r}: auto, layer or end")
        if background_setup and ring is None:
            # Without a ring every layer group's report is a bus call on `client` from
            # the caller's thread, while the setup thread makes its own: libepd's client
            # is one thread's at a time.
            raise ValueError("background_setup needs a ring (the groups' reports go on it, not on the bus)")
        self.save = save
        self.client, self.layout, self.role, self.arena = client, layout, role, arena
        self.ring, self.device, self.dtype, self.timeout_s = ring, device, dtype, timeout_s
        # A save's sequence and Prepare made on a thread while the model's forward pass is
        # launched (EpdKvSink's background); the engine must not use `client` meanwhile.
        self.background_setup = background_setup
        self._arena_on_gpu: Optional[bool] = None
        self.group_sizes = C.groups_of(layout.layers, group_size)
        self.layer_index: Dict[str, int] = {}
        self._meta: Optional[EpdKvMetadata] = None
        self._sinks: Dict[str, C.EpdKvSink] = {}      # saves whose handoff is not released
        self._loads: Dict[str, _Load] = {}
        self._finished_reqs: Set[str] = set()          # the engine says these are done
        self._delayed: Set[str] = set()                # request_finished() said delay_free (or the metadata)
        self.stats = {"save_s": 0.0, "save_wait_s": 0.0, "load_s": 0.0, "accept_s": 0.0, "wait_s": 0.0}

    # -- scheduler side -------------------------------------------------------------
    @staticmethod
    def build_connector_meta(saves: Seq[KvTransfer] = (), loads: Seq[KvTransfer] = (),
                             delayed: Seq[str] = ()) -> EpdKvMetadata:
        """delayed: the requests the scheduler side's request_finished() told the engine to
        wait for (delay_free_blocks True) since the last metadata: the worker side reports
        their sends finished from get_finished() (see the module's note)."""
        return EpdKvMetadata(list(saves), list(loads), list(delayed))

    def request_finished(self, request_id: str, block_ids=None) -> Tuple[bool, Optional[dict]]:
        """The engine is done with request_id. A save still being consumed keeps its pages
        (delay_free True) until get_finished() reports it; the params tell the decode
        side what to load. Only a request delayed here (or by the metadata's `delayed`)
        is ever reported as a finished send. In vLLM this is the scheduler's hook, in
        another process than the sinks it reads here: see the module's note."""
        s = self._sinks.get(request_id)
        if s is None or s.setup_error() is not None:  # a failed save holds no pages
            return False, None
        self._delayed.add(request_id)
        return True, {"request_id": request_id, "tokens": s.tokens, "n_groups": len(self.group_sizes)}

    # -- worker side ----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Dict[str, object]) -> None:
        """The model's layers by name, in layer order (the caches themselves are the
        model's; see the module's note)."""
        if len(kv_caches) != self.layout.layers:
            raise ValueError(f"{len(kv_caches)} layers registered, the layout has {self.layout.layers}")
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}

    def _settle_setups(self) -> None:
        """Waits for the saves' background setups (their errors stay with their saves):
        what follows calls on `client`, which the setup thread must not be using."""
        if self.background_setup:
            for s in self._sinks.values():
                s.setup_error()

    def _reopen_ring(self) -> None:
        """The daemon let go of the ring (Ring.let_go: ECONNRESET, while it lives on): until
        now the groups went, and the handoffs were asked, on the bus; another ring is opened
        in its place (Ring.reopen: the same object, wherever it is held) at a step's edge,
        where no save has groups in flight on it and no background setup uses the client.
        One that cannot be opened leaves the bus in use; the next step tries again."""
        if self.ring is None or not self.ring.let_go:
            return
        self._settle_setups()
        try:
            self.ring.reopen()
        except EpdError:
            pass

    def bind_connector_metadata(self, meta: EpdKvMetadata) -> None:
        self._reopen_ring()
        self._meta = meta
        # The scheduler side's request_finished() decisions (delay_free True): reported
        # by get_finished() once their sends are done.
        self._delayed |= set(meta.delayed)
        if self.role == "producer":
            if self._arena_on_gpu is None and self.save == "auto":
                self._settle_setups()  # _save_mode asks the daemon about the arena
            for t in meta.saves:
                if t.request_id not in self._sinks:
                    self._sinks[t.request_id] = C.EpdKvSink(self.client, self.arena, self.layout, t.request_id,
                                                            t.tokens, self.group_sizes, t.destination,
                                                            ring=self.ring, target=t.target,
                                                            background=self.background_setup,
                                                            save=self._save_mode(t))

    def _save_mode(self, t: KvTransfer) -> str:
        if self.save != "auto":
            return self.save
        if self._arena_on_gpu is None:
            try:
                self._arena_on_gpu = self.client.arena(self.arena).domain == "gpu"
            except EpdError:
                return "layer"  # the sink's own setup says what is wrong with the arena
        return "end" if self._arena_on_gpu and not t.destination else "layer"

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def _bound(self) -> EpdKvMetadata:
        if self._meta is None:
            raise RuntimeError("no connector metadata bound (bind_connector_metadata before the forward pass)")
        return self._meta

    def _layer(self, layer_name) -> int:
        if isinstance(layer_name, int):
            return layer_name
        try:
            return self.layer_index[layer_name]
        except KeyError:
            raise KeyError(f"layer {layer_name!r} was not registered (register_kv_caches)") from None

    def start_load_kv(self, forward_context=None, **kwargs) -> None:
        """Decode: takes the bound requests' handoffs. Each is one AcceptWait, which the
        daemon answers once the prefill has prepared it (no polling); the bytes keep
        landing while the model starts."""
        for t in self._bound().loads:
            if t.request_id in self._loads:
                continue
            ld = _Load(t)
            t0 = time.perf_counter()
            ld.source = C.EpdKvSource(self.client, t.request_id, self.layout, t.tokens, ring=self.ring,
                                      device=self.device, dtype=self.dtype, accept_timeout_s=self.timeout_s,
                                      wait=False)
            self.stats["accept_s"] += time.perf_counter() - t0
            self._loads[t.request_id] = ld

    def _group_of(self, layer: int) -> int:
        n = 0
        for g, size in enumerate(self.group_sizes):
            n += size
            if layer < n:
                return g
        raise IndexError(f"layer {layer} of {self.layout.layers}")

    def wait_for_layer_load(self, layer_name) -> Dict[str, tuple]:
        """Decode: blocks until the layer has landed for every bound load, reads it (one
        gather per layer) and returns {request_id: (k, v)}."""
        layer = self._layer(layer_name)
        out = {}
        for t in self._bound().loads:
            ld = self._loads[t.request_id]
            t0 = time.perf_counter()
            ld.source.wait_layer_group(self._group_of(layer) + 1, self.timeout_s)
            t1 = time.perf_counter()
            kv = ld.source.layer(layer)
            self.stats["wait_s"] += t1 - t0
            self.stats["load_s"] += time.perf_counter() - t1
            ld.layers[layer] = kv
            out[t.request_id] = kv
            if len(ld.layers) == self.layout.layers and not ld.done:
                self._finish_load(ld)
        return out

    def layer_kv(self, request_id: str, layer_name) -> tuple:
        return self._loads[request_id].layers[self._layer(layer_name)]

    def _finish_load(self, ld: _Load) -> None:
        # Every layer is in the model's cache: commit (the pages become ours), then let
        # them go, or keep the sequence (an agent's first turn: its workflow's root).
        ld.committed = ld.source.finish(keep=ld.t.keep)
        ld.layers.clear()
        ld.done = True

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata=None, **kwargs) -> None:
        """Prefill: writes the layer's K/V of each bound save (kv_layer: (k, v) with one
        save bound, else {request_id: (k, v)}) on the model's stream; the layer group is
        shipped as soon as its writes have landed."""
        layer = self._layer(layer_name)
        saves = self._bound().saves
        per_req = kv_layer if isinstance(kv_layer, dict) else None
        if per_req is None and len(saves) != 1:
            raise ValueError(f"{len(saves)} saves bound: pass {{request_id: (k, v)}}")
        for t in saves:
            k, v = per_req[t.request_id] if per_req is not None else kv_layer
            sink = self._sinks[t.request_id]
            t0 = time.perf_counter()
            sink.layer(layer, k, v)
            self.stats["save_s"] += time.perf_counter() - t0

    def wait_for_save(self) -> None:
        """Prefill: every bound save's groups are written and reported ready (the transfer
        goes on; get_finished() says when the decode side has it)."""
        for t in self._bound().saves:
            sink = self._sinks[t.request_id]
            w, own = sink.wait_s, sink.seconds
            sink.flush()
            self.stats["save_wait_s"] += sink.wait_s - w
            # A save="end" sink writes and reports here: its own time, not a wait.
            self.stats["save_s"] += sink.seconds - own

    def get_finished(self, finished_req_ids: Set[str] = frozenset()) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        """(sends finished, loads finished), each id once (vLLM's contract, see the
        module's note). Sends: saves of requests the engine has finished (this call or an
        earlier one) whose handoff the decode side is done with; their handoff is released
        and their pages let go; reported only if request_finished() delayed them (others
        go without a word). Loads: every load complete (all its layers read, committed),
        whether or not the engine has finished the request; one the engine finished
        before it was complete is let go, not reported."""
        self._finished_reqs |= set(finished_req_ids)
        self._settle_setups()  # the releases below are bus calls
        self._reopen_ring()
        sent, received = set(), set()
        for rid in list(self._sinks):
            if rid not in self._finished_reqs:
                continue
            s = self._sinks[rid]
            if s.setup_error() is not None:
                # Its sequence or Prepare failed (the error reached save_kv_layer or
                # wait_for_save): nothing was shipped and nothing is held; done with it,
                # so that it does not stand in the way of the others. Reported as sent
                # only if request_finished() told the engine to wait for it (it failed
                # after): vLLM freed the others' blocks already and expects no word.
                del self._sinks[rid]
                if rid in self._delayed:
                    sent.add(rid)
            elif s.handoff.finished(self.ring):
                s.done()
                s.handoff.release(self.ring)
                del self._sinks[rid]
                # vLLM: a finished send is a request whose request_finished() returned
                # delay_free_blocks True; it asserts so and frees the blocks. Another
                # one's blocks were freed at once: released here without a word.
                if rid in self._delayed:
                    sent.add(rid)
        for rid in list(self._loads):
            ld = self._loads[rid]
            if ld.done:
                # Complete: reported now, finished by the engine or not (vLLM waits for
                # finished_recving before it goes on with the request).
                if not ld.reported:  # a kept load stays until take_sequence(): said once
                    received.add(rid)
                    ld.reported = True
                if not ld.t.keep:
                    del self._loads[rid]  # its pages went back at commit: nothing left to take
            elif rid in self._finished_reqs:
                # The engine finished a request whose KV never fully loaded (aborted, or
                # its wait or commit raised): its handoff and page tables go now.
                del self._loads[rid]
                self._abandon(ld)
        # Only the ids of saves and loads still here wait for their turn: the engine
        # passes every finished request, ours or not.
        self._finished_reqs &= set(self._sinks) | set(self._loads)
        self._delayed &= set(self._sinks)  # a save reported is no sink any more
        return (sent or None), (received or None)

    @staticmethod
    def _abandon(ld: _Load) -> None:
        if ld.source is not None:
            try:
                ld.source.abandon()
            except EpdError:
                pass  # gone already (rolled back, its client's objects released)

    def take_sequence(self, request_id: str) -> Optional[Sequence]:
        """A finished load's committed sequence (keep=True), which is the caller's from now;
        None for a load not kept (its pages went back when it finished; get_finished()
        forgets it). NotFound for a load still in progress."""
        ld = self._loads.get(request_id)
        if ld is None:
            return None
        if not ld.done:
            raise EpdError(2, "org.epd1.Error.NotFound", f"no finished load of {request_id}", "take sequence")
        del self._loads[request_id]
        return ld.committed

    def sink_of(self, request_id: str) -> C.EpdKvSink:
        return self._sinks[request_id]

    def source_of(self, request_id: str) -> C.EpdKvSource:
        return self._loads[request_id].source

    def shutdown(self) -> None:
        self._settle_setups()
        for s in self._sinks.values():
            try:
                s.done()
                s.handoff.release()
            except Exception:
                pass
        self._sinks.clear()
        if self.ring is not None:
            C.close_notifiers(self.ring)
        for ld in self._loads.values():
            if ld.committed is not None:
                ld.committed.release()
            elif not ld.done:
                self._abandon(ld)
        self._loads.clear()


@dataclass
class EpdEcMetadata:
    """The step's requests and the features each needs: {request_id: [mm_hash, ...]}."""
    loads: Dict[str, List[str]] = field(default_factory=dict)


class EpdEcConnector:
    """The encoder-cache side. Features are keyed by the media's content hash (mm_hash)."""

    def __init__(self, client, device: Optional[str] = None, timeout_s: float = 60.0):
        self.client, self.device, self.timeout_s = client, device, timeout_s
        self._meta: Optional[EpdEcMetadata] = None
        # The features this worker fetched, by hash: the handle and the requests reading
        # it (a second request with the same image finds it in the engine's cache and
        # fetches nothing, but must keep the pin: the cache holds views of it).
        self._pins: Dict[str, Tuple[C.FeatureTensors, Set[str]]] = {}
        # The engine caches each pinned feature was put in: its entry leaves them with the
        # last pin (left there, a later request would read views whose handle is gone).
        self._placed: Dict[str, List[Dict[str, object]]] = {}
        self._held: Dict[str, List[str]] = {}  # request id -> hashes it reads
        self.last_save: Tuple[str, float] = ("", 0.0)  # (hit|waited|produced, encode seconds)
        self.last_save_detail: Dict[str, float] = {}  # its parts (connector.produce's detail)
        self._layouts: Dict[object, tuple] = {}  # save_caches' shape_key -> its output's layout

    # -- scheduler side -------------------------------------------------------------
    def has_cache_item(self, identifier: str) -> bool:
        """The feature cache holds identifier (ready): the encoder need not run for it."""
        return prefetch(self.client, [identifier]) == 1

    # -- worker side ----------------------------------------------------------------
    def bind_connector_metadata(self, meta: EpdEcMetadata) -> None:
        self._meta = meta

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def save_caches(self, encoder_cache: Dict[str, object], mm_hash: str, request_id: str = "", **kwargs) -> None:
        """Publishes encoder_cache[mm_hash] ({name: tensor}) under mm_hash. It may also be a
        callable that computes it: then it runs only when this worker is the one to produce
        the feature (another encoder's concurrent or earlier output is a hit).
        on_acquired (optional): called with hit|wait|produce once epdd has answered, before
        the encoder runs (connector.produce): readers may start then.
        overlap (optional): work to run while the Acquire is on its way, once the layout
        is known (connector.produce's overlap): what the encoder needs whatever the
        answer, such as uploading its inputs."""
        item = encoder_cache[mm_hash]
        fn = item if callable(item) else (lambda: item)
        # shape_key (optional): what fixes the output's shapes (e.g. the image's grid). The
        # layout of an earlier output with the same key is reserved with the Acquire, in
        # one call; the first output of a key teaches it.
        shape_key = kwargs.get("shape_key")
        if shape_key is not None:
            inner = fn

            def fn():
                out = inner()
                self._layouts.setdefault(shape_key, C._layout(out))  # the first teaches it
                return out
        self.last_save_detail = {}
        self.last_save = C.produce(self.client, mm_hash, request_id or mm_hash[:32], fn, self.timeout_s,
                                   self.last_save_detail,
                                   self._layouts.get(shape_key) if shape_key is not None else None,
                                   kwargs.get("on_acquired"), kwargs.get("overlap"))

    def start_load_caches(self, encoder_cache: Dict[str, object], **kwargs) -> None:
        """Fills encoder_cache[mm_hash] for each feature of the bound requests: views of a
        GPU feature arena (no copy; pinned until get_finished() reports the request), or
        copies from a host arena."""
        meta = self._meta if self._meta is not None else EpdEcMetadata(kwargs.get("loads", {}))
        for rid, hashes in meta.loads.items():
            for h in hashes:
                pin = self._pins.get(h)
                if pin is None:
                    if h in encoder_cache:
                        continue  # the engine's own (not fetched here): nothing to pin
                    ft = C.fetch(self.client, h, device=self.device, timeout_s=self.timeout_s)
                    pin = self._pins[h] = (ft, set())
                    self._place(encoder_cache, h, ft)
                elif h not in encoder_cache:
                    self._place(encoder_cache, h, pin[0])
                if rid not in pin[1]:
                    pin[1].add(rid)
                    self._held.setdefault(rid, []).append(h)

    def _place(self, encoder_cache: Dict[str, object], h: str, ft: "C.FeatureTensors") -> None:
        encoder_cache[h] = ft
        placed = self._placed.setdefault(h, [])
        if not any(c is encoder_cache for c in placed):
            placed.append(encoder_cache)

    def get_finished(self, finished_req_ids: Set[str] = frozenset()) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        """Lets go of the features the finished requests read (each once no request that
        reads it is left); returns (None, those ids)."""
        done = set()
        for rid in finished_req_ids:
            for h in self._held.pop(rid, []):
                ft, readers = self._pins[h]
                readers.discard(rid)
                if not readers:
                    del self._pins[h]
                    for cache in self._placed.pop(h, []):
                        if cache.get(h) is ft:  # still ours (not the engine's since)
                            del cache[h]
                    ft.release()
            done.add(rid)
        return None, (done or None)

    def shutdown(self) -> None:
        self.get_finished(set(self._held))
        self.client.flush(self.timeout_s)  # the last Publish and Release: answered, not refused
