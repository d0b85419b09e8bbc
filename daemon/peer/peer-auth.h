/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Peer authentication: mutual HMAC-SHA256 challenge-response over a shared cluster key
 * (OpenSSL libcrypto; no home-made crypto). Pure: no sockets.
 *
 *   dialer   -> HELLO     {nonce_d, dialer id, role, session, stream}
 *   acceptor -> CHALLENGE {nonce_a, acceptor id, mac_a = HMAC(K, "acceptor" | T)}
 *   dialer   -> AUTH      {mac_d = HMAC(K, "dialer" | T)}
 *   acceptor -> AUTH_OK / AUTH_FAIL
 *
 * T (the transcript) binds both nonces, both host ids, the role, the session id and the
 * stream index, so that no MAC can be replayed into another connection, reflected to
 * the other side, or moved to another stream. MACs are compared in constant time. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "macro.h"
#include "peer/peer-proto.h"

typedef struct PeerAuthKey PeerAuthKey;

#define PEER_AUTH_KEY_MIN 16
#define PEER_AUTH_KEY_MAX 4096

typedef enum PeerAuthSide {
        PEER_AUTH_DIALER,
        PEER_AUTH_ACCEPTOR,
} PeerAuthSide;

typedef struct PeerAuthTranscript {
        uint8_t nonce_dialer[PEER_NONCE_SIZE];
        uint8_t nonce_acceptor[PEER_NONCE_SIZE];
        const char *dialer_id;
        const char *acceptor_id;
        uint8_t role;
        uint64_t session_id;
        uint16_t stream_index;
} PeerAuthTranscript;

/* The key is the file's content with trailing whitespace removed (e.g. the output of
 * `openssl rand -hex 32`), 16..4096 bytes. A file readable by other users is refused
 * (-EPERM); anything but a regular file (a directory, /dev/zero), or a key of the wrong
 * length, is -EINVAL (-EFBIG: too long). ret_why (may be NULL) receives what is wrong in
 * words for a refusal that is not a plain errno of open() or read(), else NULL. */
int peer_auth_key_load(const char *path, PeerAuthKey **ret, const char **ret_why);
int peer_auth_key_from_bytes(const void *key, size_t n, PeerAuthKey **ret);
/* Wipes the key material. */
PeerAuthKey *peer_auth_key_free(PeerAuthKey *k);
bool peer_auth_key_equal(const PeerAuthKey *a, const PeerAuthKey *b);
DEFINE_TRIVIAL_CLEANUP_FUNC(PeerAuthKey *, peer_auth_key_free);

/* Cryptographically random bytes (nonces, session ids). */
int peer_auth_random(void *buf, size_t n);

int peer_auth_mac(const PeerAuthKey *k, PeerAuthSide side, const PeerAuthTranscript *t,
                  uint8_t out[static PEER_MAC_SIZE]);
/* True if mac is what `side` must have sent for t (constant-time compare). */
bool peer_auth_verify(const PeerAuthKey *k, PeerAuthSide side, const PeerAuthTranscript *t,
                      const uint8_t mac[static PEER_MAC_SIZE]);

/* HMAC-SHA256 with the cluster key over something other than a handshake (a member's
 * record in etcd, say): over a fixed label of its own, the length-prefixed context
 * (1..255 bytes, what the data is: no two uses may share one) and the data, so that no
 * such MAC is ever a handshake's, or another context's. -EINVAL for a bad context. */
int peer_auth_keyed_mac(const PeerAuthKey *k, const char *context, const void *data, size_t n,
                        uint8_t out[static PEER_MAC_SIZE]);
