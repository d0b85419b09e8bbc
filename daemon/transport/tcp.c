/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "hashmap.h"
#include "list.h"
#include "log.h"
#include "macro.h"
#include "time-util.h"
#include "peer/peer-proto.h"
#include "transport/slicer.h"
#include "transport/tcp.h"
#include "transport/transport-peer.h"
#include "transport/transport-util.h"

/* Bytes one stream moves per wakeup before it yields to the rest of the loop. */
#define STREAM_BUDGET (16U * 1024U * 1024U)
/* And slices: 16 MiB of 4 KiB ones, 4096 writes begun or ended, took 31 ms (release). */
#define STREAM_SLICES_BUDGET 2048U
#define MAX_REGIONS 1024
#define MAX_POST 65536
#define SCRATCH_SIZE (256U * 1024U)
#define DATA_FRAME_HEADER (PEER_FRAME_HEADER_SIZE + PEER_DATA_HEADER_SIZE)
/* Slices one stream takes ahead from the round-robin queue, and their bytes: small
 * writes go out several per syscall, while a small write posted behind big ones still
 * waits for at most SEND_BATCH_BYTES per stream. */
#define SEND_BATCH 16
#define SEND_BATCH_BYTES (2U * 1024U * 1024U)
/* Posts made while the loop has more to do leave together when it has nothing else (an
 * idle-priority defer source, run before the WAL's urge): handoffs prepared one bus call
 * after another go out SEND_BATCH slices per sendmsg() rather than one handoff each, and
 * a handoff alone leaves on the loop's next turn. SEND_BATCH_BYTES posted go at once;
 * on a loop that never idles none waits longer than FLUSH_MAX_USEC
 * (tcp_transport_flush_overdue(), after every dispatch of manager_run()'s loop). */
#define FLUSH_MAX_USEC 100U
/* A slice of at most SMALL_SLICE bytes is read into the stream's buffer, up to
 * RBUF_SIZE bytes at once, with whatever follows it (the next slices' headers and
 * payloads), and copied out: one syscall for many small layer groups instead of one
 * each. Bigger slices are read straight into their pages (bytes of one that came with
 * an earlier small slice excepted), so that bulk data is copied once. */
#define SMALL_SLICE (16U * 1024U)
#define RBUF_SIZE (64U * 1024U)

typedef struct TcpTransport TcpTransport;
typedef struct TcpStream TcpStream;
typedef struct OutWrite OutWrite;
typedef struct InWrite InWrite;

struct OutWrite {
        SliceWrite sw;                 /* first: container_of from the slice queue */
        uint64_t write_id;             /* hashmap key */
        uint64_t cookie;
        const TransportRegion *src;
        uint64_t src_offset;
        uint32_t dst_region;
        uint64_t dst_offset;
        uint32_t flags;                /* TRANSPORT_WRITE_* (the same bits as PEER_DATA_F_*) */
        uint64_t imm, target;
        unsigned slices_sending;       /* handed out, not yet fully written */
};

struct InWrite {
        uint64_t write_id;             /* hashmap key */
        PeerDataHeader hdr;            /* as the first slice said: every slice must agree */
        TransportIncoming in;          /* where it lands (resolved), for the validator */
        int error;                     /* refused: bytes are discarded, ack carries it */
        SliceTracker tracker;
        uint64_t map_bytes;            /* the tracker's bitmap: of TcpPeer.in_map_bytes */
};

typedef struct TcpPeer TcpPeer;

typedef struct SendSlice {
        OutWrite *w;
        uint64_t offset, length;
        uint8_t hdr[DATA_FRAME_HEADER];
        size_t hdr_done;
        uint64_t data_done;
} SendSlice;

struct TcpStream {
        TcpTransport *t;
        TcpPeer *tp;
        unsigned index;
        int fd;
        sd_event_source *io;
        uint32_t events;               /* what io watches now */
        bool parked;                   /* the next write's target is not known yet */
        sd_event_source *park_timer;

        /* Send side: the slices taken from the peer's queue, sent in order, several
         * per sendmsg(). */
        SendSlice batch[SEND_BATCH];
        unsigned b_head, b_n;
        uint64_t b_bytes;

        /* Receive side. */
        uint8_t r_hdr[DATA_FRAME_HEADER];
        size_t r_hdr_have;
        InWrite *rw;
        uint8_t *r_dst;                /* NULL: discard */
        uint64_t r_remaining;
        uint64_t r_slice_len;          /* the slice's payload, in all */
        uint8_t *rbuf;                 /* small slices: bytes read ahead (RBUF_SIZE) */
        size_t rpos, rlen;             /* rbuf[rpos, rlen) not consumed yet */
        sd_event_source *again;        /* reads rbuf's rest when no socket wakeup will */
};

struct TcpPeer {
        TcpTransport *t;
        Peer *peer;
        TcpStream *streams[PEER_MAX_STREAMS];
        unsigned n_streams;
        SliceQueue queue;
        Hashmap *out;                  /* OutWrite* by write_id */
        Hashmap *in;                   /* InWrite* by write_id */
        uint64_t in_map_bytes;         /* their slice maps (bound: TCP_IN_MAPS_MAX) */
        sd_event_source *in_watch;     /* while writes come in: the stall watch */
        uint64_t in_moves, in_seen;    /* bumped as slices begin and bytes land; as the watch saw it */
        unsigned in_idle_checks;       /* its checks in a row that saw no write move */
        uint64_t next_write_id;
        uint64_t bytes_in;
        uint64_t *acked;               /* writes landed this wakeup: one WRITE_ACKS */
        size_t n_acked, acked_cap;
        unsigned plugged;              /* tcp_plug() depth: posts wait for tcp_unplug() */
        bool send_due;                 /* posted while plugged */
        bool flush_due;                /* posted, waits for the flush (send_soon()) */
        uint64_t due_bytes;            /* posted since the last send_now() */
        LIST_FIELDS(TcpPeer, peers);
};

struct TcpTransport {
        Transport base;
        sd_event *event;
        TransportPeerOps peers_ops; /* the peer layer: control messages, validation */
        uint32_t slice_size;
        TransportRegion *regions[MAX_REGIONS];
        LIST_HEAD(TcpPeer, peers);
        int efd;
        sd_event_source *flush;        /* idle priority: send_soon()'s posts leave */
        bool flush_armed;
        uint64_t flush_since;          /* CLOCK_MONOTONIC: the oldest post waiting */
        TransportDoneQueue done;
        uint8_t *scratch;
        uint64_t in_stall_usec;        /* TCP_IN_STALL_USEC */
};

static TcpTransport *tcp(Transport *t) {
        return container_of(t, TcpTransport, base);
}

static int stream_io(sd_event_source *s, int fd, uint32_t revents, void *userdata);

static void complete(TcpTransport *t, uint64_t cookie, int error, uint64_t bytes) {
        transport_done_push(&t->base, &t->done, t->efd, cookie, error, bytes);
}

static TcpPeer **tcp_peer_slot(TcpTransport *t, Peer *p) {
        return (TcpPeer **)t->peers_ops.slot(p, TRANSPORT_TCP);
}

static TcpPeer *tcp_peer_get(TcpTransport *t, Peer *p, bool create) {
        TcpPeer *tp = *tcp_peer_slot(t, p);

        if (tp || !create)
                return tp;
        tp = calloc(1, sizeof *tp);
        if (!tp)
                return NULL;
        tp->t = t;
        tp->peer = p;
        tp->next_write_id = 1;
        tp->out = hashmap_new(HASHMAP_KEY_U64, 0);
        tp->in = hashmap_new(HASHMAP_KEY_U64, 0);
        if (!tp->out || !tp->in) {
                hashmap_free(tp->out);
                hashmap_free(tp->in);
                free(tp);
                return NULL;
        }
        LIST_PREPEND(peers, t->peers, tp);
        *tcp_peer_slot(t, p) = tp;
        return tp;
}

static TcpStream *stream_free(TcpStream *s) {
        if (!s)
                return NULL;
        sd_event_source_disable_unref(s->park_timer);
        sd_event_source_disable_unref(s->io);
        sd_event_source_disable_unref(s->again);
        safe_close(s->fd);
        free(s->rbuf);
        free(s);
        return NULL;
}

static void in_write_free(TcpPeer *tp, InWrite *w) {
        tp->in_map_bytes -= MIN(tp->in_map_bytes, w->map_bytes);
        slice_tracker_done(&w->tracker);
        free(w);
}

void tcp_transport_peer_reset(Transport *tt, Peer *p, int error) {
        TcpTransport *t = tcp(tt);
        TcpPeer *tp = *tcp_peer_slot(t, p);
        size_t i = 0;
        void *v;

        if (!tp)
                return;
        /* Close the streams first: from here on no byte of any write lands. */
        for (unsigned k = 0; k < PEER_MAX_STREAMS; k++)
                tp->streams[k] = stream_free(tp->streams[k]);
        tp->n_streams = 0;

        while (hashmap_iterate(tp->out, &i, &v, NULL)) {
                OutWrite *w = v;
                complete(t, w->cookie, error, 0);
                free(w);
        }
        hashmap_clear(tp->out);
        tp->queue = (SliceQueue){};
        /* Nothing is held for the next session: its posts start their own batch. */
        tp->flush_due = tp->send_due = false;
        tp->due_bytes = 0;

        i = 0;
        while (hashmap_iterate(tp->in, &i, &v, NULL)) {
                InWrite *w = v;
                if (w->error == 0)
                        t->peers_ops.incoming_done(t->peers_ops.userdata, p, &w->in, error);
                in_write_free(tp, w);
        }
        hashmap_clear(tp->in);
        tp->in_map_bytes = 0;
        tp->in_watch = sd_event_source_disable_unref(tp->in_watch);
        tp->n_acked = 0;
}

static void stream_update(TcpStream *s) {
        bool want = s->b_n > 0 || !slice_queue_empty(&s->tp->queue);
        uint32_t ev = (s->parked ? 0 : EPOLLIN) | (want ? EPOLLOUT : 0);

        if (ev == s->events)
                return;
        s->events = ev;
        (void)sd_event_source_set_io_events(s->io, ev);
}

int tcp_transport_attach_stream(Transport *tt, Peer *p, int fd, unsigned index) {
        TcpTransport *t = tcp(tt);
        TcpPeer *tp;
        TcpStream *s;
        int r;

        if (index >= PEER_MAX_STREAMS) {
                safe_close(fd);
                return -EINVAL;
        }
        tp = tcp_peer_get(t, p, true);
        if (!tp) {
                safe_close(fd);
                return -ENOMEM;
        }
        if (tp->streams[index]) {
                safe_close(fd);
                return -EEXIST;
        }
        s = calloc(1, sizeof *s);
        if (!s) {
                safe_close(fd);
                return -ENOMEM;
        }
        s->t = t;
        s->tp = tp;
        s->index = index;
        s->fd = fd;
        s->events = EPOLLIN;
        r = sd_event_add_io(t->event, &s->io, fd, EPOLLIN, stream_io, s);
        if (r < 0) {
                stream_free(s);
                return r;
        }
        tp->streams[index] = s;
        tp->n_streams++;
        stream_update(s);
        return 0;
}

unsigned tcp_transport_streams_up(Transport *tt, Peer *p) {
        TcpPeer *tp = *tcp_peer_slot(tcp(tt), p);
        return tp ? tp->n_streams : 0;
}

void tcp_transport_peer_inflight(Transport *tt, Peer *p, uint64_t *out, uint64_t *in) {
        TcpPeer *tp = *tcp_peer_slot(tcp(tt), p);
        if (out)
                *out = tp ? hashmap_size(tp->out) : 0;
        if (in)
                *in = tp ? hashmap_size(tp->in) : 0;
}

/* The receiver says write_id landed (error 0) or failed. Returns false when it never
 * finished sending it: the peer is confused, and the session was reset. */
static bool write_acked(TcpTransport *t, TcpPeer *tp, uint64_t write_id, int error) {
        OutWrite *w = hashmap_get(tp->out, &write_id);
        if (!w || w->sw.next_offset < w->sw.length || w->slices_sending > 0) {
                t->peers_ops.stream_failed(tp->peer, -EBADMSG, "acknowledgement for an unknown write");
                return false;
        }
        hashmap_remove(tp->out, &write_id);
        complete(t, w->cookie, error, error ? 0 : w->sw.length);
        free(w);
        return true;
}

void tcp_transport_write_acked(Transport *tt, Peer *p, uint64_t write_id, int error) {
        TcpTransport *t = tcp(tt);
        TcpPeer *tp = *tcp_peer_slot(t, p);

        if (tp)
                (void)write_acked(t, tp, write_id, error);
}

void tcp_transport_writes_acked(Transport *tt, Peer *p, const PeerAckRun *runs, size_t n) {
        TcpTransport *t = tcp(tt);
        TcpPeer *tp = *tcp_peer_slot(t, p);

        for (size_t i = 0; tp && i < n; i++)
                for (uint64_t id = runs[i].first; id < runs[i].first + runs[i].count; id++)
                        if (!write_acked(t, tp, id, 0))
                                return;
}

/* ---- sending ---- */

static void batch_fill(TcpStream *s) {
        TcpPeer *tp = s->tp;

        while (s->b_n < SEND_BATCH && (s->b_n == 0 || s->b_bytes < SEND_BATCH_BYTES)) {
                SendSlice *b = s->batch + (s->b_head + s->b_n) % SEND_BATCH;
                PeerDataHeader dh;
                Slice sl;

                if (!slice_queue_next(&tp->queue, &sl))
                        break;
                *b = (SendSlice){ .w = (OutWrite *)sl.write, .offset = sl.offset, .length = sl.length };
                b->w->slices_sending++;
                dh = (PeerDataHeader){
                        .target = b->w->target,
                        .imm = b->w->imm,
                        .flags = b->w->flags,
                        .write_id = b->w->write_id,
                        .cookie = b->w->cookie,
                        .dst_offset = b->w->dst_offset,
                        .total_length = b->w->sw.length,
                        .slice_offset = sl.offset,
                        .region = b->w->dst_region,
                        .slice_size = b->w->sw.slice_size,
                };
                peer_frame_header_encode(b->hdr, PEER_MSG_DATA, (uint32_t)(PEER_DATA_HEADER_SIZE + sl.length));
                (void)peer_data_header_encode(&dh, b->hdr + PEER_FRAME_HEADER_SIZE, PEER_DATA_HEADER_SIZE);
                s->b_n++;
                s->b_bytes += sl.length;
        }
}

static int stream_send_budget(TcpStream *s, size_t budget) {
        unsigned slices = 0;
        while (budget > 0 && slices < STREAM_SLICES_BUDGET) {
                struct iovec iov[2 * SEND_BATCH];
                size_t n_iov = 0;
                ssize_t n;

                batch_fill(s);
                if (s->b_n == 0)
                        break;
                for (unsigned k = 0; k < s->b_n; k++) {
                        SendSlice *b = s->batch + (s->b_head + k) % SEND_BATCH;
                        if (b->hdr_done < sizeof b->hdr)
                                iov[n_iov++] = (struct iovec){ b->hdr + b->hdr_done, sizeof b->hdr - b->hdr_done };
                        iov[n_iov++] = (struct iovec){
                                (uint8_t *)b->w->src->host_base + b->w->src_offset + b->offset + b->data_done,
                                b->length - b->data_done,
                        };
                }
                n = sendmsg(s->fd, &(struct msghdr){ .msg_iov = iov, .msg_iovlen = n_iov },
                            MSG_NOSIGNAL | MSG_DONTWAIT);
                if (n < 0) {
                        if (errno == EINTR)
                                continue;
                        if (errno == EAGAIN)
                                return 0;
                        return -errno;
                }
                budget -= MIN(budget, (size_t)n);
                while (n > 0 && s->b_n > 0) {
                        SendSlice *b = s->batch + s->b_head;
                        size_t h = MIN((size_t)n, sizeof b->hdr - b->hdr_done);
                        uint64_t d;

                        b->hdr_done += h;
                        n -= (ssize_t)h;
                        d = MIN((uint64_t)n, b->length - b->data_done);
                        b->data_done += d;
                        n -= (ssize_t)d;
                        if (b->hdr_done < sizeof b->hdr || b->data_done < b->length)
                                break;
                        b->w->slices_sending--;
                        slices++;
                        s->b_bytes -= b->length;
                        s->b_head = (s->b_head + 1) % SEND_BATCH;
                        s->b_n--;
                }
        }
        stream_update(s);
        return 0;
}

static int stream_send(TcpStream *s) {
        return stream_send_budget(s, STREAM_BUDGET);
}

/* New writes go out at once, a batch per stream, from the call that queued them: a small
 * handoff's bytes leave without waiting for the loop's next turn (an EPOLLOUT round: two
 * epoll_ctl and an epoll_wait). What a stream cannot send now, or an error, is left to
 * its EPOLLOUT handler (stream_io), which fails the stream where the caller cannot. */
static void send_now(TcpPeer *tp) {
        for (unsigned k = 0; k < PEER_MAX_STREAMS; k++) {
                TcpStream *s = tp->streams[k];
                if (!s)
                        continue;
                if (!(s->events & EPOLLOUT))
                        (void)stream_send_budget(s, SEND_BATCH_BYTES); /* an error: stream_io's */
                stream_update(s);
        }
}

/* The peer's control frames first (a pipelined write's PREPARE), then its data. */
static void send_flushed(TcpPeer *tp) {
        tp->flush_due = false;
        tp->due_bytes = 0;
        if (tp->t->peers_ops.flush_control)
                tp->t->peers_ops.flush_control(tp->peer);
        send_now(tp);
}

static void flush_all(TcpTransport *t) {
        t->flush_armed = false;
        if (t->flush)
                (void)sd_event_source_set_enabled(t->flush, SD_EVENT_OFF);
        LIST_FOREACH(peers, tp, t->peers)
                if (tp->flush_due)
                        send_flushed(tp);
}

static int on_flush(sd_event_source *s, void *userdata) {
        flush_all(userdata);
        return 0;
}

/* Posted: out now, or with what else the loop posts before it idles (FLUSH_MAX_USEC). */
static void send_soon(TcpPeer *tp) {
        TcpTransport *t = tp->t;

        if (tp->due_bytes < SEND_BATCH_BYTES) {
                if (!t->flush && sd_event_add_defer(t->event, &t->flush, on_flush, t) >= 0)
                        (void)sd_event_source_set_priority(t->flush, SD_EVENT_PRIORITY_IDLE - 1);
                if (t->flush && sd_event_source_set_enabled(t->flush, SD_EVENT_ONESHOT) >= 0) {
                        if (!t->flush_armed)
                                t->flush_since = now_usec(CLOCK_MONOTONIC);
                        t->flush_armed = true;
                        tp->flush_due = true;
                        return;
                }
        }
        send_flushed(tp); /* a full batch, or no source: at once */
}

void tcp_transport_flush_overdue(Transport *tt) {
        TcpTransport *t = tt ? tcp(tt) : NULL;
        if (t && t->flush_armed && now_usec(CLOCK_MONOTONIC) >= t->flush_since + FLUSH_MAX_USEC)
                flush_all(t);
}

/* ---- receiving ---- */

static int send_ack(TcpPeer *tp, uint64_t write_id, int error) {
        PeerWriteAck a = { .write_id = write_id, .error = error };
        uint8_t buf[PEER_WRITE_ACK_SIZE];

        (void)peer_write_ack_encode(&a, buf, sizeof buf);
        return tp->t->peers_ops.send(tp->peer, PEER_MSG_WRITE_ACK, buf, sizeof buf);
}

_Static_assert(TRANSPORT_WRITE_IMM == PEER_DATA_F_IMM && TRANSPORT_WRITE_TARGET == PEER_DATA_F_TARGET,
               "write flags travel as they are");

/* Where a new write's bytes go (w->in), or why they are discarded (w->error): the
 * peer layer's validator decides, after the region checks a write into a named region
 * needs. -EAGAIN: its target is not known here yet; ask again later. */
static int in_write_admit(TcpTransport *t, TcpPeer *tp, InWrite *w) {
        const PeerDataHeader *dh = &w->hdr;
        TransportRegion *reg;
        uint64_t end;
        int r;

        w->in = (TransportIncoming){
                .region = dh->region,
                .offset = dh->dst_offset,
                .length = dh->total_length,
                .cookie = dh->cookie,
                .flags = dh->flags,
                .imm = dh->imm,
                .target = dh->target,
        };
        if (!(dh->flags & PEER_DATA_F_TARGET)) {
                reg = dh->region < MAX_REGIONS ? t->regions[dh->region] : NULL;
                if (!reg || reg->domain != MEMORY_HOST || !reg->host_base || reg->source_only)
                        return -ENXIO;
                if (ADD_OVERFLOW(dh->dst_offset, dh->total_length, &end) || end > reg->size)
                        return -ERANGE;
        }
        /* Asked once per write, before its first byte lands. */
        r = t->peers_ops.validate_incoming(t->peers_ops.userdata, tp->peer, &w->in);
        if (r < 0)
                return r;
        /* A write into a target lands where the validator resolved it: check that too. */
        reg = w->in.region < MAX_REGIONS ? t->regions[w->in.region] : NULL;
        if (!reg || reg->domain != MEMORY_HOST || !reg->host_base || ADD_OVERFLOW(w->in.offset, w->in.length, &end) ||
            end > reg->size || w->in.length != dh->total_length) {
                /* Accepted by the validator: it counts the write as landing. */
                t->peers_ops.incoming_done(t->peers_ops.userdata, tp->peer, &w->in, -ERANGE);
                return -ERANGE;
        }
        return 0;
}

/* The stall watch: every half of the bound while writes come in from tp, a check that
 * saw no slice begin nor byte land from it since the check before is idle; two in a row
 * (the bound, and at most half as long again, without a byte) end the session, with
 * every write in flight both ways. A write waits its turn while others move (the sender
 * sends a slice of each queued write in turn: with much queued, its next slice comes
 * long after its last); one the sender left while sending others ends with its
 * handoff's deadline. */
static int on_in_watch(sd_event_source *es, uint64_t usec, void *userdata) {
        TcpPeer *tp = userdata;
        TcpTransport *t = tp->t;
        size_t i = 0;
        InWrite *w = NULL;

        tp->in_idle_checks = tp->in_moves != tp->in_seen ? 0 : tp->in_idle_checks + 1;
        tp->in_seen = tp->in_moves;
        if (hashmap_iterate(tp->in, &i, (void **)&w, NULL) && tp->in_idle_checks >= 2) {
                log_warning("tcp: peer %s: no byte of its incoming writes (write %" PRIu64 " among them) for %" PRIu64
                            " s or more: its sender stopped in the middle; ending the session.",
                            t->peers_ops.name(tp->peer), w->write_id, t->in_stall_usec / USEC_PER_SEC);
                tp->in_watch = sd_event_source_disable_unref(tp->in_watch);
                t->peers_ops.stream_failed(tp->peer, -ETIMEDOUT, "incoming write stalled");
                return 0;
        }
        if (hashmap_size(tp->in) == 0) {
                tp->in_watch = sd_event_source_disable_unref(tp->in_watch);
                return 0;
        }
        if (sd_event_source_set_time_relative(es, t->in_stall_usec / 2) < 0 ||
            sd_event_source_set_enabled(es, SD_EVENT_ONESHOT) < 0)
                tp->in_watch = sd_event_source_disable_unref(tp->in_watch);
        return 0;
}

static void in_watch_arm(TcpPeer *tp) {
        if (tp->in_watch)
                return;
        tp->in_idle_checks = 0;
        if (sd_event_add_time_relative(tp->t->event, &tp->in_watch, CLOCK_MONOTONIC, tp->t->in_stall_usec / 2,
                                       USEC_PER_SEC / 10, on_in_watch, tp) < 0)
                log_debug("tcp: cannot arm the incoming writes' stall watch");
}

void tcp_transport_set_in_stall(Transport *tt, uint64_t usec) {
        tcp(tt)->in_stall_usec = MAX(usec, (uint64_t)2);
}

/* A slice header arrived: find or create its write and decide where its bytes go.
 * -EAGAIN: the write's target is not known yet (the stream waits, nothing taken). */
static int stream_slice_begin(TcpStream *s) {
        TcpTransport *t = s->t;
        TcpPeer *tp = s->tp;
        PeerFrameHeader fh;
        PeerDataHeader dh;
        InWrite *w;
        int r;

        r = peer_frame_header_decode(s->r_hdr, PEER_FRAME_HEADER_SIZE, &fh);
        if (r < 0)
                return r;
        if (fh.type != PEER_MSG_DATA)
                return -EBADMSG;
        r = peer_data_header_decode(s->r_hdr + PEER_FRAME_HEADER_SIZE, PEER_DATA_HEADER_SIZE, fh.length, &dh);
        if (r < 0)
                return r;

        w = hashmap_get(tp->in, &dh.write_id);
        if (w) {
                if (w->hdr.cookie != dh.cookie || w->hdr.dst_offset != dh.dst_offset ||
                    w->hdr.total_length != dh.total_length || w->hdr.region != dh.region ||
                    w->hdr.slice_size != dh.slice_size || w->hdr.flags != dh.flags || w->hdr.imm != dh.imm ||
                    w->hdr.target != dh.target)
                        return -EBADMSG;
        } else {
                if (hashmap_size(tp->in) >= PEER_INCOMING_MAX)
                        return -EBADMSG;
                /* Its slice map, against what the peer's writes in flight hold already:
                 * a peer cannot make this side allocate without bound (tiny frames
                 * naming huge writes), refused or not. */
                uint64_t map = DIV_ROUND_UP(peer_slice_count(dh.total_length, dh.slice_size), 64) * 8;
                if (tp->in_map_bytes + map > TCP_IN_MAPS_MAX) {
                        log_warning("tcp: peer %s: its incoming writes would need %" PRIu64 " bytes of slice maps "
                                    "(at most %llu): protocol error", t->peers_ops.name(tp->peer),
                                    tp->in_map_bytes + map, (unsigned long long)TCP_IN_MAPS_MAX);
                        return -ENOBUFS;
                }
                w = calloc(1, sizeof *w);
                if (!w)
                        return -ENOMEM;
                *w = (InWrite){ .write_id = dh.write_id, .hdr = dh, .map_bytes = map };
                w->hdr.slice_offset = 0;
                w->error = in_write_admit(t, tp, w);
                if (w->error == -EAGAIN) {
                        free(w);
                        return -EAGAIN;
                }
                r = slice_tracker_init(&w->tracker, dh.total_length, dh.slice_size);
                if (r >= 0)
                        r = hashmap_put(tp->in, &w->write_id, w);
                if (r < 0) {
                        if (w->error == 0)
                                t->peers_ops.incoming_done(t->peers_ops.userdata, tp->peer, &w->in, r);
                        w->map_bytes = 0; /* not counted yet */
                        in_write_free(tp, w);
                        return r;
                }
                tp->in_map_bytes += w->map_bytes;
                in_watch_arm(tp);
                if (w->error < 0)
                        log_debug_errno(w->error, "tcp: refused incoming write %llu (region %u, %llu+%llu): %m",
                                        (unsigned long long)dh.write_id, dh.region,
                                        (unsigned long long)dh.dst_offset, (unsigned long long)dh.total_length);
        }
        /* Claimed now, before a byte lands: the same slice again (on this stream or
         * another, where it may still be landing) is a protocol error here, and the
         * write cannot complete, and be freed, while a stream is inside one of its
         * slices. */
        r = slice_tracker_claim(&w->tracker, dh.slice_offset / dh.slice_size);
        if (r < 0)
                return -EBADMSG;
        tp->in_moves++;
        s->rw = w;
        s->r_remaining = s->r_slice_len = fh.length - PEER_DATA_HEADER_SIZE;
        if (w->error == 0)
                s->r_dst = (uint8_t *)t->regions[w->in.region]->host_base + w->in.offset + dh.slice_offset;
        else
                s->r_dst = NULL;
        return 0;
}

static int acks_push(TcpPeer *tp, uint64_t write_id) {
        if (tp->n_acked == tp->acked_cap) {
                size_t cap = MAX(tp->acked_cap * 2, (size_t)64);
                uint64_t *a = reallocarray(tp->acked, cap, sizeof *a);
                if (!a)
                        return -ENOMEM;
                tp->acked = a;
                tp->acked_cap = cap;
        }
        tp->acked[tp->n_acked++] = write_id;
        return 0;
}

/* The writes that landed in this wakeup, acknowledged as runs of consecutive ids in one
 * WRITE_ACKS (more only past PEER_WRITE_ACKS_RUNS_MAX runs). */
static int acks_flush(TcpPeer *tp) {
        static PeerAckRun runs[PEER_WRITE_ACKS_RUNS_MAX];
        static uint8_t buf[PEER_WRITE_ACKS_SIZE(PEER_WRITE_ACKS_RUNS_MAX)];
        uint64_t *ids = tp->acked;
        size_t left = tp->n_acked, used;
        int r = 0;

        while (left > 0 && r >= 0) {
                size_t n = peer_ack_runs_build(ids, left, runs, ELEMENTSOF(runs), &used);
                r = peer_write_acks_encode(runs, n, buf, sizeof buf);
                if (r >= 0)
                        r = tp->t->peers_ops.send(tp->peer, PEER_MSG_WRITE_ACKS, buf, (size_t)r);
                ids += used;
                left -= used;
        }
        tp->n_acked = 0;
        return r < 0 ? r : 0;
}

/* The slice's last byte landed. Returns 1 if the session was reset meanwhile. */
static int stream_slice_end(TcpStream *s) {
        TcpTransport *t = s->t;
        TcpPeer *tp = s->tp;
        InWrite *w = s->rw;
        Peer *p = tp->peer;
        unsigned idx = s->index;
        int r;

        s->rw = NULL;
        slice_tracker_landed(&w->tracker); /* claimed at its header */
        if (!slice_tracker_complete(&w->tracker))
                return 0;
        hashmap_remove(tp->in, &w->write_id);
        if (w->error == 0) {
                t->peers_ops.incoming_done(t->peers_ops.userdata, p, &w->in, 0);
                /* Acknowledged with the others of this wakeup: in this session only. Had
                 * the call reset it, the id would go out in the next one, whose sender
                 * does not know it and resets that one too. */
                r = t->peers_ops.is_up(p) && tp->streams[idx] == s ? acks_push(tp, w->write_id) : 0;
        } else
                r = send_ack(tp, w->write_id, w->error);
        in_write_free(tp, w);
        if (r < 0 || !t->peers_ops.is_up(p) || tp->streams[idx] != s) {
                if (r < 0 && t->peers_ops.is_up(p))
                        t->peers_ops.stream_failed(p, r, "sending acknowledgement");
                return 1;
        }
        return 0;
}

static int on_park_timeout(sd_event_source *es, uint64_t usec, void *userdata) {
        TcpStream *s = userdata;
        s->park_timer = sd_event_source_disable_unref(s->park_timer);
        s->t->peers_ops.stream_failed(s->tp->peer, -ETIMEDOUT, "data for a target that was never announced");
        return 0;
}

/* The next write's target is not known yet: stop reading this stream (TCP holds the
 * bytes back) until tcp_resume_incoming(), for at most TCP_PARK_TIMEOUT_USEC. */
static void stream_park(TcpStream *s) {
        s->parked = true;
        s->r_hdr_have = sizeof s->r_hdr; /* the header is kept, and asked about again */
        if (!s->park_timer && sd_event_add_time_relative(s->t->event, &s->park_timer, CLOCK_MONOTONIC,
                                                         TCP_PARK_TIMEOUT_USEC, 0, on_park_timeout, s) < 0)
                log_debug("tcp: cannot arm a parked stream's timer");
        stream_update(s);
}

static int on_stream_again(sd_event_source *es, void *userdata) {
        TcpStream *s = userdata;
        return stream_io(NULL, s->fd, EPOLLIN, s);
}

/* Bytes wait in rbuf, or a whole header in r_hdr (read with the last payload): read
 * them in the next loop iteration. Bytes in the socket wake the stream as any other
 * (level-triggered): a defer source, whose pending mark is older than theirs, would
 * read on ahead of the streams, control connections and bus calls that waited. */
static void stream_again(TcpStream *s) {
        if (s->parked || (s->rpos >= s->rlen && (s->rw || s->r_hdr_have < sizeof s->r_hdr)))
                return;
        int avail = 0;
        if (ioctl(s->fd, FIONREAD, &avail) == 0 && avail > 0)
                return;
        if (!s->again && sd_event_add_defer(s->t->event, &s->again, on_stream_again, s) < 0) {
                log_debug("tcp: cannot queue a stream's buffered bytes");
                return;
        }
        (void)sd_event_source_set_enabled(s->again, SD_EVENT_ONESHOT);
}

/* Up to `want` bytes from rbuf into dst (NULL: discarded); how many. */
static size_t rbuf_take(TcpStream *s, uint8_t *dst, size_t want) {
        size_t n = MIN(want, s->rlen - s->rpos);
        if (dst && n > 0)
                memcpy(dst, s->rbuf + s->rpos, n);
        s->rpos += n;
        return n;
}

/* Fills the empty rbuf from the socket: 1, 0 when the socket had nothing, or an error.
 * *drained: the read came back short, so the socket is empty now. */
static int rbuf_fill(TcpStream *s, bool *drained) {
        if (!s->rbuf) {
                s->rbuf = malloc(RBUF_SIZE);
                if (!s->rbuf)
                        return -ENOMEM;
        }
        ssize_t n = recv(s->fd, s->rbuf, RBUF_SIZE, MSG_DONTWAIT);
        if (n < 0)
                return errno == EAGAIN || errno == EINTR ? 0 : -errno;
        if (n == 0)
                return -ECONNRESET;
        s->rpos = 0;
        s->rlen = (size_t)n;
        *drained = (size_t)n < RBUF_SIZE;
        return 1;
}

/* The slice's bytes arrived (from rbuf or the socket): `n` of them, at r_dst. */
static void slice_took(TcpStream *s, uint64_t n) {
        s->tp->bytes_in += n;
        s->tp->in_moves++;
        s->r_remaining -= n;
        if (s->r_dst)
                s->r_dst += n;
}

/* Reads until the socket is empty: a recv() or readv() that returns less than it asked
 * for has emptied it, so reading stops there rather than with one more call that only
 * says EAGAIN. The fd is level-triggered (no EPOLLET): bytes that arrive meanwhile wake
 * the loop again; bytes left in rbuf do not, so stream_again() queues them. */
static int stream_recv(TcpStream *s) {
        size_t budget = STREAM_BUDGET;
        unsigned slices = 0;
        bool drained = false;
        int r;

        if (s->parked)
                return 0;

        while (budget > 0 && slices < STREAM_SLICES_BUDGET) {
                ssize_t n;

                if (!s->rw) {
                        if (s->r_hdr_have < sizeof s->r_hdr)
                                s->r_hdr_have += rbuf_take(s, s->r_hdr + s->r_hdr_have,
                                                           sizeof s->r_hdr - s->r_hdr_have);
                        if (s->r_hdr_have < sizeof s->r_hdr) {
                                if (drained)
                                        return 0;
                                n = recv(s->fd, s->r_hdr + s->r_hdr_have, sizeof s->r_hdr - s->r_hdr_have,
                                         MSG_DONTWAIT);
                                if (n < 0)
                                        return errno == EAGAIN || errno == EINTR ? 0 : -errno;
                                if (n == 0)
                                        return -ECONNRESET;
                                s->r_hdr_have += (size_t)n;
                                if (s->r_hdr_have < sizeof s->r_hdr)
                                        return 0; /* short: the socket is empty */
                        }
                        s->r_hdr_have = 0;
                        r = stream_slice_begin(s);
                        if (r == -EAGAIN) {
                                stream_park(s); /* rbuf keeps what follows the header */
                                return 0;
                        }
                        if (r < 0)
                                return r;
                        /* The header taken: its park (if any) is over. */
                        s->park_timer = sd_event_source_disable_unref(s->park_timer);
                }
                if (s->r_remaining == 0) {
                        /* nothing to read: an empty slice */
                } else if (s->rpos < s->rlen) {
                        /* Read ahead with an earlier small slice. */
                        size_t take = rbuf_take(s, s->r_dst, (size_t)MIN(s->r_remaining, (uint64_t)SIZE_MAX));
                        slice_took(s, take);
                } else if (drained) {
                        return 0;
                } else if (s->r_slice_len <= SMALL_SLICE) {
                        r = rbuf_fill(s, &drained);
                        if (r <= 0)
                                return r;
                        budget -= MIN(budget, s->rlen);
                        continue;
                } else {
                        /* The rest of this slice, and the next slice's header with it
                         * (data streams carry nothing but DATA frames): one syscall
                         * per slice. */
                        struct iovec iov[2];
                        size_t n_iov = 1;
                        uint64_t take;

                        if (s->r_dst)
                                iov[0] = (struct iovec){ s->r_dst, s->r_remaining };
                        else
                                iov[0] = (struct iovec){ s->t->scratch, MIN(s->r_remaining, (uint64_t)SCRATCH_SIZE) };
                        if (iov[0].iov_len == s->r_remaining)
                                iov[n_iov++] = (struct iovec){ s->r_hdr, sizeof s->r_hdr };
                        n = readv(s->fd, iov, (int)n_iov);
                        if (n < 0)
                                return errno == EAGAIN || errno == EINTR ? 0 : -errno;
                        if (n == 0)
                                return -ECONNRESET;
                        /* Short (the next header asked for included): the socket is empty. */
                        drained = (size_t)n < iov[0].iov_len + (n_iov > 1 ? iov[1].iov_len : 0);
                        budget -= MIN(budget, (size_t)n);
                        take = MIN((uint64_t)n, s->r_remaining);
                        slice_took(s, take);
                        s->r_hdr_have = (size_t)((uint64_t)n - take);
                }
                if (s->r_remaining == 0) {
                        r = stream_slice_end(s);
                        if (r != 0)
                                return r;
                        slices++;
                }
                if (drained && s->rpos >= s->rlen && (s->rw || s->r_hdr_have < sizeof s->r_hdr))
                        return 0;
        }
        stream_again(s); /* out of budget with bytes read ahead, or a header */
        return 0;
}

static int stream_io(sd_event_source *es, int fd, uint32_t revents, void *userdata) {
        TcpStream *s = userdata;
        Peer *p = s->tp->peer;
        const TransportPeerOps *ops = &s->t->peers_ops;
        int r;

        if (s->parked && (revents & (EPOLLHUP | EPOLLERR))) {
                ops->stream_failed(p, -ECONNRESET, "data stream closed");
                return 0;
        }
        if (revents & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
                /* The acknowledgements of everything this wakeup completes leave in
                 * one write. */
                TcpPeer *tp = s->tp;
                ops->cork(p);
                r = stream_recv(s);
                if (r == 0 && acks_flush(tp) < 0 && ops->is_up(p)) {
                        ops->uncork(p);
                        ops->stream_failed(p, -EIO, "sending acknowledgements");
                        return 0;
                }
                ops->uncork(p);
                if (r == 1)
                        return 0; /* the session was reset; s is gone */
                if (r < 0) {
                        ops->stream_failed(p, r, r == -ECONNRESET ? "data stream closed" : "data stream receive");
                        return 0;
                }
        }
        if (revents & EPOLLOUT) {
                /* Posts held for the idle point leave with this stream's next send: the
                 * peer's control frames (their PREPAREs) go first, as at the idle point,
                 * or the receiver parks the stream for a target it is not told of yet. */
                if (s->tp->flush_due)
                        send_flushed(s->tp);
                r = stream_send(s);
                if (r < 0) {
                        ops->stream_failed(p, r, "data stream send");
                        return 0;
                }
        }
        return 0;
}

/* ---- the vtable ---- */

static int tcp_register_region(Transport *tt, TransportRegion *r) {
        TcpTransport *t = tcp(tt);

        if (!r || r->id >= MAX_REGIONS)
                return -EINVAL;
        if (r->domain != MEMORY_HOST || !r->host_base)
                return -EOPNOTSUPP;
        if (t->regions[r->id] && t->regions[r->id] != r)
                return -EEXIST;
        t->regions[r->id] = r;
        return 0;
}

static void tcp_unregister_region(Transport *tt, TransportRegion *r) {
        TcpTransport *t = tcp(tt);

        if (r && r->id < MAX_REGIONS && t->regions[r->id] == r)
                t->regions[r->id] = NULL;
}

static int tcp_post(Transport *tt, void *peer, const TransportWrite *w, size_t n) {
        TcpTransport *t = tcp(tt);
        Peer *p = peer;
        TcpPeer *tp;
        OutWrite **ws;
        size_t queued = 0;
        int r = 0;

        if (!p || (!w && n > 0) || n > MAX_POST)
                return -EINVAL;
        if (!t->peers_ops.is_up(p))
                return -ENOTCONN;
        for (size_t i = 0; i < n; i++) {
                const TransportRegion *src = w[i].src_region < MAX_REGIONS ? t->regions[w[i].src_region] : NULL;
                uint64_t end;

                if (!src)
                        return -ENXIO;
                if ((w[i].flags & ~(TRANSPORT_WRITE_IMM | TRANSPORT_WRITE_TARGET)) ||
                    (!(w[i].flags & TRANSPORT_WRITE_IMM) && w[i].imm != 0) ||
                    (!(w[i].flags & TRANSPORT_WRITE_TARGET) && w[i].target != 0))
                        return -EINVAL;
                if (w[i].length == 0 || ADD_OVERFLOW(w[i].src_offset, w[i].length, &end) || end > src->size ||
                    ADD_OVERFLOW(w[i].dst_offset, w[i].length, &end) ||
                    peer_slice_count(w[i].length, t->slice_size) > PEER_MAX_SLICES_PER_WRITE)
                        return -EINVAL;
        }
        tp = tcp_peer_get(t, p, true);
        if (!tp)
                return -ENOMEM;
        /* The peer takes at most PEER_INCOMING_MAX writes begun and not finished, and the
         * slicer starts every queued write before it finishes any: past that many
         * unanswered here, this post is refused (its handoff alone fails) rather than
         * the peer resetting the whole session (review). */
        if (hashmap_size(tp->out) + n > PEER_INCOMING_MAX)
                return -ENOBUFS;
        ws = calloc(MAX(n, (size_t)1), sizeof *ws);
        if (!ws)
                return -ENOMEM;
        for (size_t i = 0; i < n; i++) {
                OutWrite *o = calloc(1, sizeof *o);
                if (!o) {
                        r = -ENOMEM;
                        break;
                }
                ws[i] = o;
                (void)slice_write_init(&o->sw, w[i].length, t->slice_size);
                o->write_id = tp->next_write_id++;
                o->cookie = w[i].cookie;
                o->src = t->regions[w[i].src_region];
                o->src_offset = w[i].src_offset;
                o->dst_region = w[i].flags & TRANSPORT_WRITE_TARGET ? 0 : w[i].dst_region;
                o->dst_offset = w[i].dst_offset;
                o->flags = w[i].flags;
                o->imm = w[i].imm;
                o->target = w[i].target;
                r = hashmap_put(tp->out, &o->write_id, o);
                if (r < 0) {
                        free(o);
                        ws[i] = NULL;
                        break;
                }
                queued++;
        }
        if (r < 0) {
                /* All or nothing. */
                for (size_t i = 0; i < queued; i++) {
                        hashmap_remove(tp->out, &ws[i]->write_id);
                        free(ws[i]);
                }
                free(ws);
                return r;
        }
        for (size_t i = 0; i < n; i++)
                slice_queue_push(&tp->queue, &ws[i]->sw);
        free(ws);
        t->base.stats.batches++;
        for (size_t i = 0; i < n; i++)
                tp->due_bytes += w[i].length;
        if (tp->plugged)
                tp->send_due = true;
        else
                send_soon(tp);
        return 0;
}

/* Posts between tcp_plug() and tcp_unplug() leave together: a handoff's groups shipped
 * at once go out in one sendmsg() rather than one each (or with the loop's other posts,
 * send_soon()). */
static void tcp_plug(Transport *tt, void *peer) {
        TcpPeer *tp = tcp_peer_get(tcp(tt), peer, true);
        if (tp)
                tp->plugged++;
}

static void tcp_unplug(Transport *tt, void *peer) {
        TcpPeer *tp = tcp_peer_get(tcp(tt), peer, false);
        if (!tp || tp->plugged == 0 || --tp->plugged > 0 || !tp->send_due)
                return;
        tp->send_due = false;
        send_soon(tp);
}

static int tcp_completion_fd(Transport *tt) {
        return tcp(tt)->efd;
}

static size_t tcp_poll(Transport *tt, TransportCompletion *c, size_t n) {
        TcpTransport *t = tcp(tt);
        return transport_done_take(&t->done, t->efd, c, n);
}

static void tcp_cancel_peer(Transport *tt, void *peer) {
        TcpTransport *t = tcp(tt);
        Peer *p = peer;

        /* Bytes already in the socket buffers would still land: only ending the
         * session guarantees that none does. The peer then reconnects. */
        if (p && *tcp_peer_slot(t, p))
                t->peers_ops.stream_failed(p, -ECANCELED, "transfers cancelled");
}

static void tcp_resume_incoming(Transport *tt, void *peer) {
        TcpPeer *tp = peer ? *tcp_peer_slot(tcp(tt), peer) : NULL;

        /* The streams read again: their held header is asked about first (level-triggered
         * epoll wakes them, the rest of the slice being in the socket or on its way). */
        for (unsigned k = 0; tp && k < PEER_MAX_STREAMS; k++) {
                TcpStream *s = tp->streams[k];
                if (!s || !s->parked)
                        continue;
                /* Its timer stays: the held header's deadline runs from its first park,
                 * not from each resume (a resume comes with every pipelined PREPARE of
                 * the peer and every settled page, and would have pushed it back forever). */
                s->parked = false;
                stream_update(s);
                stream_again(s); /* what followed the held header may be in rbuf */
        }
}

static void tcp_free(Transport *tt) {
        TcpTransport *t;

        if (!tt)
                return;
        t = tcp(tt);
        while (t->peers) {
                TcpPeer *tp = t->peers;
                for (unsigned k = 0; k < PEER_MAX_STREAMS; k++)
                        stream_free(tp->streams[k]);
                size_t i = 0;
                void *v;
                while (hashmap_iterate(tp->out, &i, &v, NULL))
                        free(v);
                i = 0;
                while (hashmap_iterate(tp->in, &i, &v, NULL))
                        in_write_free(tp, v);
                sd_event_source_disable_unref(tp->in_watch);
                hashmap_free(tp->out);
                hashmap_free(tp->in);
                free(tp->acked);
                *tcp_peer_slot(t, tp->peer) = NULL;
                LIST_REMOVE(peers, t->peers, tp);
                free(tp);
        }
        t->flush = sd_event_source_disable_unref(t->flush);
        safe_close(t->efd);
        free(t->done.items);
        free(t->scratch);
        sd_event_unref(t->event);
        free(t);
}

static const TransportOps tcp_ops = {
        .kind = TRANSPORT_TCP,
        .name = "tcp",
        .caps = TRANSPORT_CAP_IMM | TRANSPORT_CAP_TARGET,
        .register_region = tcp_register_region,
        .unregister_region = tcp_unregister_region,
        .post = tcp_post,
        .completion_fd = tcp_completion_fd,
        .poll = tcp_poll,
        .cancel_peer = tcp_cancel_peer,
        .resume_incoming = tcp_resume_incoming,
        .plug = tcp_plug,
        .unplug = tcp_unplug,
        .free = tcp_free,
};

int tcp_transport_new(Transport **ret, sd_event *e, const TransportPeerOps *peers, uint32_t slice_size) {
        TcpTransport *t;

        if (slice_size < PEER_SLICE_MIN || slice_size > PEER_SLICE_MAX)
                return -EINVAL;
        t = calloc(1, sizeof *t);
        if (!t)
                return -ENOMEM;
        t->base.ops = &tcp_ops;
        t->event = sd_event_ref(e);
        t->peers_ops = *peers;
        t->slice_size = slice_size;
        t->in_stall_usec = TCP_IN_STALL_USEC;
        t->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        t->scratch = malloc(SCRATCH_SIZE);
        if (t->efd < 0 || !t->scratch) {
                int r = t->efd < 0 ? -errno : -ENOMEM;
                t->efd = safe_close(t->efd);
                tcp_free(&t->base);
                return r;
        }
        *ret = &t->base;
        return 0;
}
