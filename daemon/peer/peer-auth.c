/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/config.h"
#include "peer/peer-auth.h"

struct PeerAuthKey {
        size_t size;
        uint8_t bytes[];
};

bool peer_auth_key_equal(const PeerAuthKey *a, const PeerAuthKey *b) {
        return a && b && a->size == b->size && CRYPTO_memcmp(a->bytes, b->bytes, a->size) == 0;
}

int peer_auth_key_from_bytes(const void *key, size_t n, PeerAuthKey **ret) {
        PeerAuthKey *k;

        if (!key || n < PEER_AUTH_KEY_MIN || n > PEER_AUTH_KEY_MAX)
                return -EINVAL;
        k = malloc(sizeof *k + n);
        if (!k)
                return -ENOMEM;
        k->size = n;
        memcpy(k->bytes, key, n);
        *ret = k;
        return 0;
}

PeerAuthKey *peer_auth_key_free(PeerAuthKey *k) {
        if (!k)
                return NULL;
        OPENSSL_cleanse(k->bytes, k->size);
        free(k);
        return NULL;
}

int peer_auth_key_load(const char *path, PeerAuthKey **ret, const char **ret_why) {
        uint8_t buf[PEER_AUTH_KEY_MAX + 2];
        const char *why_dummy;
        size_t n = 0;
        int r;

        if (!ret_why)
                ret_why = &why_dummy;
        _cleanup_(closep) int fd = config_secret_file_open(path, ret_why);
        if (fd < 0)
                return fd;
        for (;;) {
                ssize_t l = read(fd, buf + n, sizeof buf - n);
                if (l < 0) {
                        if (errno == EINTR)
                                continue;
                        r = -errno;
                        OPENSSL_cleanse(buf, sizeof buf);
                        return r;
                }
                if (l == 0)
                        break;
                n += (size_t)l;
                if (n == sizeof buf) {
                        OPENSSL_cleanse(buf, sizeof buf);
                        *ret_why = "it is longer than 4096 bytes; a key is 16 to 4096 bytes";
                        return -EFBIG;
                }
        }
        while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r' || buf[n - 1] == ' ' ||
                         buf[n - 1] == '\t'))
                n--;
        if (n == 0)
                *ret_why = "it is empty; a key is 16 to 4096 bytes (openssl rand -hex 32 > FILE)";
        else if (n < PEER_AUTH_KEY_MIN)
                *ret_why = "it holds fewer than 16 bytes (trailing whitespace aside); a key is 16 to 4096 "
                           "bytes (openssl rand -hex 32 > FILE)";
        else if (n > PEER_AUTH_KEY_MAX)
                *ret_why = "it is longer than 4096 bytes; a key is 16 to 4096 bytes";
        r = peer_auth_key_from_bytes(buf, n, ret);
        OPENSSL_cleanse(buf, sizeof buf);
        return r;
}

int peer_auth_random(void *buf, size_t n) {
        if (n > INT32_MAX)
                return -EINVAL;
        if (RAND_bytes(buf, (int)n) != 1)
                return -EIO;
        return 0;
}

/* Serialises the transcript unambiguously: fixed-size fields, length-prefixed ids. */
static size_t transcript_serialize(PeerAuthSide side, const PeerAuthTranscript *t, uint8_t *out) {
        static const char label_d[16] = "epd-peer-dialer", label_a[16] = "epd-peer-accept";
        uint8_t *p = out;
        size_t nd = strnlen(t->dialer_id, PEER_HOST_ID_MAX), na = strnlen(t->acceptor_id, PEER_HOST_ID_MAX);

        memcpy(p, side == PEER_AUTH_DIALER ? label_d : label_a, 16);
        p += 16;
        *p++ = PEER_PROTOCOL_VERSION;
        memcpy(p, t->nonce_dialer, PEER_NONCE_SIZE);
        p += PEER_NONCE_SIZE;
        memcpy(p, t->nonce_acceptor, PEER_NONCE_SIZE);
        p += PEER_NONCE_SIZE;
        *p++ = (uint8_t)nd;
        memcpy(p, t->dialer_id, nd);
        p += nd;
        *p++ = (uint8_t)na;
        memcpy(p, t->acceptor_id, na);
        p += na;
        *p++ = t->role;
        for (int i = 7; i >= 0; i--)
                *p++ = (uint8_t)(t->session_id >> (8 * i));
        *p++ = (uint8_t)(t->stream_index >> 8);
        *p++ = (uint8_t)t->stream_index;
        return (size_t)(p - out);
}

int peer_auth_mac(const PeerAuthKey *k, PeerAuthSide side, const PeerAuthTranscript *t,
                  uint8_t out[static PEER_MAC_SIZE]) {
        uint8_t buf[16 + 1 + 2 * PEER_NONCE_SIZE + 2 * (1 + PEER_HOST_ID_MAX) + 1 + 8 + 2];
        unsigned len = 0;
        size_t n;

        if (!k || !t || !peer_host_id_is_valid(t->dialer_id) || !peer_host_id_is_valid(t->acceptor_id))
                return -EINVAL;
        n = transcript_serialize(side, t, buf);
        if (!HMAC(EVP_sha256(), k->bytes, (int)k->size, buf, n, out, &len) || len != PEER_MAC_SIZE)
                return -EIO;
        return 0;
}

bool peer_auth_verify(const PeerAuthKey *k, PeerAuthSide side, const PeerAuthTranscript *t,
                      const uint8_t mac[static PEER_MAC_SIZE]) {
        uint8_t expected[PEER_MAC_SIZE];
        bool ok;

        if (peer_auth_mac(k, side, t, expected) < 0)
                return false;
        ok = CRYPTO_memcmp(expected, mac, PEER_MAC_SIZE) == 0;
        OPENSSL_cleanse(expected, sizeof expected);
        return ok;
}

int peer_auth_keyed_mac(const PeerAuthKey *k, const char *context, const void *data, size_t n,
                        uint8_t out[static PEER_MAC_SIZE]) {
        /* 16 bytes, as the handshake's labels, and none of them: a transcript never
         * serialises to the same bytes. */
        static const char label[16] = "epd-keyed-mac";
        size_t nc = context ? strnlen(context, 256) : 0, len;
        unsigned mac_len = 0;
        uint8_t *buf;
        int r = 0;

        if (!k || nc == 0 || nc > 255 || (!data && n > 0) || n > INT32_MAX - 16 - 256)
                return -EINVAL;
        len = 16 + 1 + nc + n;
        buf = malloc(len);
        if (!buf)
                return -ENOMEM;
        memcpy(buf, label, 16);
        buf[16] = (uint8_t)nc;
        memcpy(buf + 17, context, nc);
        if (n > 0)
                memcpy(buf + 17 + nc, data, n);
        if (!HMAC(EVP_sha256(), k->bytes, (int)k->size, buf, len, out, &mac_len) || mac_len != PEER_MAC_SIZE)
                r = -EIO;
        OPENSSL_cleanse(buf, len);
        free(buf);
        return r;
}
