/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "id.h"

#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <sys/random.h>

/* Ids are drawn from a pool of getrandom() bytes per thread, refilled EPD_ID_POOL_SIZE
 * bytes at a time: one system call per 32 ids instead of one per id (a small handoff
 * made two or three). What is handed out is wiped from the pool at once, so an id's
 * randomness stays only where the id itself is kept. A forked child starts with an empty
 * pool (pthread_atfork(); getpid() would cost the very system call saved), or parent
 * and child would hand out the same ids. */
_Static_assert(EPD_ID_POOL_SIZE % sizeof(EpdId) == 0, "the pool holds whole ids");

static _Thread_local struct {
        uint8_t bytes[EPD_ID_POOL_SIZE];
        size_t left; /* bytes not handed out yet: the last `left` of `bytes` */
} pool;

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;
static bool pool_forksafe; /* pool_reset() is registered for fork's child */

/* In the child of a fork: only the forking thread goes on, and its pool is this one. */
static void pool_reset(void) {
        explicit_bzero(pool.bytes, sizeof pool.bytes);
        pool.left = 0;
}

static void pool_init(void) {
        pool_forksafe = pthread_atfork(NULL, NULL, pool_reset) == 0;
}

static int fill(uint8_t *p, size_t n) {
        size_t done = 0;
        while (done < n) {
                ssize_t k = getrandom(p + done, n - done, 0);
                if (k < 0) {
                        if (errno == EINTR)
                                continue;
                        return -errno;
                }
                done += (size_t)k;
        }
        return 0;
}

int epd_id_random(EpdId *ret) {
        int r;

        (void)pthread_once(&pool_once, pool_init);
        if (!pool_forksafe) /* no pool then: a child could repeat the parent's ids */
                return fill(ret->bytes, sizeof ret->bytes);
        if (pool.left == 0) {
                r = fill(pool.bytes, sizeof pool.bytes);
                if (r < 0) {
                        pool_reset();
                        return r;
                }
                pool.left = sizeof pool.bytes;
        }
        uint8_t *p = pool.bytes + sizeof pool.bytes - pool.left;
        memcpy(ret->bytes, p, sizeof ret->bytes);
        explicit_bzero(p, sizeof ret->bytes);
        pool.left -= sizeof ret->bytes;
        return 0;
}

char *epd_id_to_string(const EpdId *id, char buf[static EPD_ID_STRING_MAX]) {
        static const char hex[] = "0123456789abcdef";
        for (size_t i = 0; i < 16; i++) {
                buf[2 * i] = hex[id->bytes[i] >> 4];
                buf[2 * i + 1] = hex[id->bytes[i] & 15];
        }
        buf[32] = 0;
        return buf;
}

static int unhex(char c) {
        if (c >= '0' && c <= '9')
                return c - '0';
        if (c >= 'a' && c <= 'f')
                return c - 'a' + 10;
        if (c >= 'A' && c <= 'F')
                return c - 'A' + 10;
        return -EINVAL;
}

int epd_id_from_string(const char *s, EpdId *ret) {
        EpdId id;
        if (!s || strlen(s) != 32)
                return -EINVAL;
        for (size_t i = 0; i < 16; i++) {
                int a = unhex(s[2 * i]), b = unhex(s[2 * i + 1]);
                if (a < 0 || b < 0)
                        return -EINVAL; /* *ret untouched */
                id.bytes[i] = (uint8_t)(a << 4 | b);
        }
        *ret = id;
        return 0;
}

bool epd_id_is_null(const EpdId *id) {
        static const EpdId null;
        return memcmp(id, &null, sizeof null) == 0;
}

bool epd_id_equal(const EpdId *a, const EpdId *b) {
        return memcmp(a, b, sizeof *a) == 0;
}
