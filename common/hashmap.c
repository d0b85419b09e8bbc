/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "hashmap.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/random.h>
#include <unistd.h>

#include "macro.h"
#include "siphash24.h"

typedef struct Bucket {
        const void *key; /* NULL: empty */
        void *value;
        uint64_t hash;
} Bucket;

struct Hashmap {
        HashmapKeyType type;
        size_t key_size;
        size_t n_buckets; /* power of two, or 0 */
        size_t n_entries;
        Bucket *buckets;
};

static uint8_t hash_key[16];
static pthread_once_t hash_key_once = PTHREAD_ONCE_INIT;

static void hash_key_init(void) {
        ssize_t n;
        do
                n = getrandom(hash_key, sizeof hash_key, 0);
        while (n < 0 && errno == EINTR);
        if (n == (ssize_t)sizeof hash_key)
                return;
        /* No getrandom (a seccomp filter, an old kernel): the kernel's pool another way.
         * A key a client could guess would let chosen keys degrade every table. */
        int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
        n = fd >= 0 ? read(fd, hash_key, sizeof hash_key) : -1;
        if (fd >= 0)
                close(fd);
        if (n != (ssize_t)sizeof hash_key)
                abort(); /* no randomness at all: refuse to run with a guessable key */
}

uint64_t hashmap_hash_bytes(const void *p, size_t n) {
        pthread_once(&hash_key_once, hash_key_init);
        return siphash24(p, n, hash_key);
}

static uint64_t key_hash(const Hashmap *h, const void *key) {
        switch (h->type) {
        case HASHMAP_KEY_STRING:
                return hashmap_hash_bytes(key, strlen(key));
        case HASHMAP_KEY_U64:
                return hashmap_hash_bytes(key, sizeof(uint64_t));
        default:
                return hashmap_hash_bytes(key, h->key_size);
        }
}

static bool key_eq(const Hashmap *h, const void *a, const void *b) {
        switch (h->type) {
        case HASHMAP_KEY_STRING:
                return strcmp(a, b) == 0;
        case HASHMAP_KEY_U64:
                return *(const uint64_t *)a == *(const uint64_t *)b;
        default:
                return memcmp(a, b, h->key_size) == 0;
        }
}

Hashmap *hashmap_new(HashmapKeyType type, size_t key_size) {
        Hashmap *h = calloc(1, sizeof *h);
        if (!h)
                return NULL;
        h->type = type;
        h->key_size = type == HASHMAP_KEY_BYTES ? key_size : 0;
        return h;
}

Hashmap *hashmap_free(Hashmap *h) {
        if (!h)
                return NULL;
        free(h->buckets);
        free(h);
        return NULL;
}

size_t hashmap_size(const Hashmap *h) {
        return h ? h->n_entries : 0;
}

static Bucket *find(const Hashmap *h, const void *key, uint64_t hash) {
        if (h->n_buckets == 0)
                return NULL;
        size_t mask = h->n_buckets - 1;
        for (size_t i = hash & mask;; i = (i + 1) & mask) {
                Bucket *b = &h->buckets[i];
                if (!b->key)
                        return NULL;
                if (b->hash == hash && key_eq(h, b->key, key))
                        return b;
        }
}

static void insert_nocheck(Bucket *buckets, size_t n, const void *key, void *value, uint64_t hash) {
        size_t mask = n - 1;
        for (size_t i = hash & mask;; i = (i + 1) & mask)
                if (!buckets[i].key) {
                        buckets[i] = (Bucket){ key, value, hash };
                        return;
                }
}

static int grow(Hashmap *h) {
        if ((h->n_entries + 1) * 10 <= h->n_buckets * 7)
                return 0;
        size_t n = h->n_buckets ? h->n_buckets * 2 : 16;
        Bucket *nb = calloc(n, sizeof *nb);
        if (!nb)
                return -ENOMEM;
        for (size_t i = 0; i < h->n_buckets; i++)
                if (h->buckets[i].key)
                        insert_nocheck(nb, n, h->buckets[i].key, h->buckets[i].value,
                                       h->buckets[i].hash);
        free(h->buckets);
        h->buckets = nb;
        h->n_buckets = n;
        return 0;
}

/* A new key (not in the map): makes room, then inserts. */
static int insert(Hashmap *h, const void *key, void *value, uint64_t hash) {
        int r = grow(h);
        if (r < 0)
                return r;
        insert_nocheck(h->buckets, h->n_buckets, key, value, hash);
        h->n_entries++;
        return 0;
}

int hashmap_put(Hashmap *h, const void *key, void *value) {
        uint64_t hash = key_hash(h, key);
        if (find(h, key, hash))
                return -EEXIST;
        return insert(h, key, value, hash);
}

int hashmap_replace(Hashmap *h, const void *key, void *value, void **old) {
        uint64_t hash = key_hash(h, key);
        Bucket *b = find(h, key, hash);
        if (b) {
                if (old)
                        *old = b->value;
                b->key = key;
                b->value = value;
                return 0;
        }
        if (old)
                *old = NULL;
        return insert(h, key, value, hash);
}

void *hashmap_get(const Hashmap *h, const void *key) {
        if (!h || h->n_entries == 0)
                return NULL;
        Bucket *b = find(h, key, key_hash(h, key));
        return b ? b->value : NULL;
}

bool hashmap_contains(const Hashmap *h, const void *key) {
        if (!h || h->n_entries == 0)
                return false;
        return find(h, key, key_hash(h, key)) != NULL;
}

void *hashmap_remove(Hashmap *h, const void *key) {
        if (!h || h->n_entries == 0)
                return NULL;
        Bucket *b = find(h, key, key_hash(h, key));
        if (!b)
                return NULL;
        void *value = b->value;
        size_t mask = h->n_buckets - 1;
        size_t i = (size_t)(b - h->buckets);
        /* Backward-shift deletion: no tombstones, probe chains stay short. */
        for (size_t j = (i + 1) & mask;; j = (j + 1) & mask) {
                Bucket *e = &h->buckets[j];
                if (!e->key)
                        break;
                size_t home = e->hash & mask;
                /* Move e into the hole at i if its home is not in (i, j]. */
                bool in_range = i <= j ? (home > i && home <= j) : (home > i || home <= j);
                if (!in_range) {
                        h->buckets[i] = *e;
                        i = j;
                }
        }
        h->buckets[i] = (Bucket){ 0 };
        h->n_entries--;
        return value;
}

void hashmap_clear(Hashmap *h) {
        if (!h || !h->buckets)
                return;
        memset(h->buckets, 0, h->n_buckets * sizeof(Bucket));
        h->n_entries = 0;
}

bool hashmap_iterate(const Hashmap *h, size_t *state, void **value, const void **key) {
        if (!h)
                return false;
        for (size_t i = *state; i < h->n_buckets; i++)
                if (h->buckets[i].key) {
                        *state = i + 1;
                        if (value)
                                *value = h->buckets[i].value;
                        if (key)
                                *key = h->buckets[i].key;
                        return true;
                }
        *state = h->n_buckets;
        return false;
}
