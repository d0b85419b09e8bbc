/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Built instead of peer-auth.c when libcrypto is missing: multi-host is refused, never
 * run unauthenticated. */
#include <errno.h>

#include "peer/peer-auth.h"

int peer_auth_key_load(const char *path, PeerAuthKey **ret, const char **ret_why) {
        if (ret_why)
                *ret_why = "epd was built without libcrypto: no peer authentication";
        return -EOPNOTSUPP;
}
int peer_auth_key_from_bytes(const void *key, size_t n, PeerAuthKey **ret) {
        return -EOPNOTSUPP;
}
PeerAuthKey *peer_auth_key_free(PeerAuthKey *k) {
        return NULL;
}
int peer_auth_random(void *buf, size_t n) {
        return -EOPNOTSUPP;
}
int peer_auth_mac(const PeerAuthKey *k, PeerAuthSide side, const PeerAuthTranscript *t,
                  uint8_t out[static PEER_MAC_SIZE]) {
        return -EOPNOTSUPP;
}
bool peer_auth_verify(const PeerAuthKey *k, PeerAuthSide side, const PeerAuthTranscript *t,
                      const uint8_t mac[static PEER_MAC_SIZE]) {
        return false;
}
bool peer_auth_key_equal(const PeerAuthKey *a, const PeerAuthKey *b) {
        return false;
}
int peer_auth_keyed_mac(const PeerAuthKey *k, const char *context, const void *data, size_t n,
                        uint8_t out[static PEER_MAC_SIZE]) {
        return -EOPNOTSUPP;
}
