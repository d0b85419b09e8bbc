/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Feeds a byte stream to the peer frame parser the way a connection does: header, then
 * the payload decoder of its type; DATA slices go through the slice tracker. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "macro.h"
#include "peer/peer-proto.h"
#include "transport/slicer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        SliceTracker tracker = {};
        uint64_t tracked_id = 0;
        bool have_tracker = false;

        while (size >= PEER_FRAME_HEADER_SIZE) {
                PeerFrameHeader h;
                const uint8_t *payload;
                size_t len;

                if (peer_frame_header_decode(data, size, &h) < 0)
                        break;
                data += PEER_FRAME_HEADER_SIZE;
                size -= PEER_FRAME_HEADER_SIZE;
                /* DATA frames carry the slice bytes after the header; the stream may end
                 * early: decode what is there. */
                len = MIN((size_t)h.length, size);
                payload = data;

                switch (h.type) {
                case PEER_MSG_HELLO: {
                        PeerHello x;
                        uint8_t out[512];
                        if (peer_hello_decode(payload, len, &x) == 0) {
                                int n = peer_hello_encode(&x, out, sizeof out);
                                /* Round trip is exact. */
                                if (n != (int)len || memcmp(out, payload, len) != 0)
                                        abort();
                        }
                        break;
                }
                case PEER_MSG_CHALLENGE: {
                        PeerChallenge x;
                        (void)peer_challenge_decode(payload, len, &x);
                        break;
                }
                case PEER_MSG_AUTH: {
                        PeerAuth x;
                        (void)peer_auth_msg_decode(payload, len, &x);
                        break;
                }
                case PEER_MSG_AUTH_OK: {
                        PeerAuthOk x;
                        (void)peer_auth_ok_decode(payload, len, &x);
                        break;
                }
                case PEER_MSG_AUTH_FAIL:
                case PEER_MSG_BYE: {
                        PeerReason x;
                        (void)peer_reason_decode(payload, len, &x);
                        break;
                }
                case PEER_MSG_HEARTBEAT: {
                        PeerHeartbeat x;
                        (void)peer_heartbeat_decode(payload, len, &x);
                        break;
                }
                case PEER_MSG_WRITE_ACK: {
                        PeerWriteAck x;
                        (void)peer_write_ack_decode(payload, len, &x);
                        break;
                }
                case PEER_MSG_WRITE_ACKS: {
                        static PeerAckRun runs[PEER_WRITE_ACKS_RUNS_MAX];
                        static uint8_t out[PEER_WRITE_ACKS_SIZE(PEER_WRITE_ACKS_RUNS_MAX)];
                        size_t n;
                        if (peer_write_acks_decode(payload, len, runs, ELEMENTSOF(runs), &n) == 0) {
                                int k = peer_write_acks_encode(runs, n, out, sizeof out);
                                /* Round trip is exact. */
                                if (k != (int)len || memcmp(out, payload, len) != 0)
                                        abort();
                        }
                        break;
                }
                case PEER_MSG_DATA: {
                        PeerDataHeader d;
                        if (peer_data_header_decode(payload, len, h.length, &d) < 0)
                                break;
                        {
                                uint8_t again[PEER_DATA_HEADER_SIZE];
                                if (peer_data_header_encode(&d, again, sizeof again) != PEER_DATA_HEADER_SIZE ||
                                    memcmp(again, payload, PEER_DATA_HEADER_SIZE) != 0)
                                        abort();
                        }
                        if (!have_tracker || d.write_id != tracked_id) {
                                if (have_tracker)
                                        slice_tracker_done(&tracker);
                                have_tracker = slice_tracker_init(&tracker, d.total_length, d.slice_size) == 0;
                                tracked_id = d.write_id;
                        }
                        if (have_tracker)
                                (void)slice_tracker_mark(&tracker, d.slice_offset / d.slice_size);
                        break;
                }
                default: {
                        /* A handler range: addresses are the other outside string. */
                        char s[80];
                        struct sockaddr_storage sa;
                        unsigned sl;
                        size_t n = MIN(len, sizeof s - 1);
                        memcpy(s, payload, n);
                        s[n] = 0;
                        (void)peer_address_parse(s, &sa, &sl);
                        (void)peer_host_id_is_valid(s);
                        break;
                }
                }
                data += len;
                size -= len;
        }
        if (have_tracker)
                slice_tracker_done(&tracker);
        return 0;
}
