/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "crc32c.h"
#include "feature/feature-store.h"
#include <stdbool.h>
#include "hashmap.h"
#include "id.h"
#include "macro.h"
#include "siphash24.h"
#include "unaligned.h"

/* 2: the data's CRC32C in the header; 3: and a CRC32C over header, key and descriptor
 * (a damaged shape used to be a hit). Files of another version are misses, removed. */
#define STORE_VERSION 3u
#define HEADER_SIZE 64u
#define HEADER_CRC_AT 56u

/* Fixed (public) keys: names must be stable across restarts. The file holds the full
 * key, so a collision is only a miss, never the wrong bytes. */
static const uint8_t name_key_a[16] = "epd-feature-nm-a";
static const uint8_t name_key_b[16] = "epd-feature-nm-b";

static int openat2_beneath(int dirfd, const char *name, int flags, mode_t mode);

struct FeatureStore {
        int root_fd;
        char *root;
        uint64_t max_bytes;
        /* The spill thread saves while the event loop looks up: the lock covers the
         * counters and every rename/unlink/scan that changes them. */
        pthread_mutex_t lock;
        uint64_t bytes;   /* of f-*.feat files */
        uint64_t trimmed;
        /* The entries in the root (IndexEntry by StoreName, 16-byte keys): a key that is
         * not here has no file, and is answered without touching the disk; one that is,
         * with a bound on its data's size. Kept as files come and go through the store;
         * when it could not be (out of memory), `index_lost` is set and every key counts
         * as maybe stored until the next scan rebuilds it. Under index_lock alone, held
         * for in-memory work only (never across a system call): the event loop asks it,
         * and must not wait behind `lock`'s renames and scans. Order: lock, then
         * index_lock. */
        pthread_mutex_t index_lock;
        Hashmap *index;
        bool index_lost;
};

/* An entry's name, as its two 64-bit hashes ("f-" + both in hex + ".feat"). */
typedef struct StoreName {
        uint64_t h[2];
} StoreName;

static void name_of(const char *key, size_t n, StoreName *ret) {
        ret->h[0] = siphash24(key, n, name_key_a);
        ret->h[1] = siphash24(key, n, name_key_b);
}

/* The hashes of an entry's file name; false for another name. */
static bool name_parse(const char *name, StoreName *ret) {
        if (strlen(name) != 2 + 32 + 5 || strncmp(name, "f-", 2) != 0 || strcmp(name + 34, ".feat") != 0)
                return false;
        for (size_t i = 0; i < 32; i++) {
                char ch = name[2 + i];
                unsigned v = ch >= '0' && ch <= '9' ? (unsigned)(ch - '0')
                             : ch >= 'a' && ch <= 'f' ? (unsigned)(ch - 'a' + 10) : 16u;
                if (v > 15)
                        return false;
                ret->h[i / 16] = (i % 16 ? ret->h[i / 16] << 4 : 0) | v;
        }
        return true;
}

typedef struct IndexEntry {
        StoreName name; /* the key in the index: first */
        uint64_t bytes; /* the data's size, or a bound on it (the file's size less its header) */
} IndexEntry;

/* Under index_lock. */
static void index_add(FeatureStore *s, const StoreName *n, uint64_t bytes) {
        IndexEntry *e = hashmap_get(s->index, n);
        if (e) {
                e->bytes = bytes;
                return;
        }
        e = malloc(sizeof *e);
        if (e)
                *e = (IndexEntry) { .name = *n, .bytes = bytes };
        if (!e || hashmap_put(s->index, &e->name, e) < 0) {
                free(e);
                s->index_lost = true;
        }
}

static void index_del(FeatureStore *s, const StoreName *n) {
        free(hashmap_remove(s->index, n));
}

/* Takes index_lock for one change. */
static void index_add_locked(FeatureStore *s, const StoreName *n, uint64_t bytes) {
        pthread_mutex_lock(&s->index_lock);
        index_add(s, n, bytes);
        pthread_mutex_unlock(&s->index_lock);
}

static void index_del_locked(FeatureStore *s, const StoreName *n) {
        pthread_mutex_lock(&s->index_lock);
        index_del(s, n);
        pthread_mutex_unlock(&s->index_lock);
}

static void index_clear(FeatureStore *s) {
        size_t i = 0;
        void *v;
        while (hashmap_iterate(s->index, &i, &v, NULL))
                free(v);
        hashmap_clear(s->index);
}

static bool is_entry_name(const char *n) {
        size_t l = strlen(n);
        return l > 7 && strncmp(n, "f-", 2) == 0 && strcmp(n + l - 5, ".feat") == 0;
}

/* Size of the entry `name`, 0 if there is none (or it is not a regular file). */
static uint64_t entry_size(FeatureStore *s, const char *name) {
        struct stat st;
        if (fstatat(s->root_fd, name, &st, AT_SYMLINK_NOFOLLOW) < 0 || !S_ISREG(st.st_mode))
                return 0;
        return (uint64_t)st.st_size;
}

/* Under lock: whether the entry `name` is the file ino (0: whatever file), or, with
 * or_none, no file at all. A reader that found its file unusable acts on the name only then: a save may
 * have renamed a good copy into place since it opened the name. */
static bool still_holds(FeatureStore *s, const char *name, ino_t ino, bool or_none) {
        struct stat st;
        if (fstatat(s->root_fd, name, &st, AT_SYMLINK_NOFOLLOW) < 0)
                return or_none;
        return ino == 0 || st.st_ino == ino;
}

/* What a lookup of key found in its file ino: unusable (bytes UINT64_MAX: key leaves
 * the index, also when its name holds no file now) or usable (the index takes the
 * data's exact size); acted on only while the name still holds that file, a save
 * having renamed another there since. */
static void index_settle(FeatureStore *s, const char *key, size_t key_len, const char *name, ino_t ino,
                         uint64_t bytes) {
        StoreName nm;
        name_of(key, key_len, &nm);
        pthread_mutex_lock(&s->lock);
        if (still_holds(s, name, ino, bytes == UINT64_MAX)) {
                if (bytes == UINT64_MAX)
                        index_del_locked(s, &nm);
                else
                        index_add_locked(s, &nm, bytes);
        }
        pthread_mutex_unlock(&s->lock);
}

/* Removes the entry `name` and its index entry, if the name still holds the file ino
 * (0: whatever it holds). */
static void unlink_entry(FeatureStore *s, const char *name, ino_t ino) {
        StoreName n;
        pthread_mutex_lock(&s->lock);
        if (still_holds(s, name, ino, true)) {
                uint64_t size = entry_size(s, name);
                if (unlinkat(s->root_fd, name, 0) >= 0)
                        s->bytes -= MIN(size, s->bytes);
                if (name_parse(name, &n))
                        index_del_locked(s, &n);
        }
        pthread_mutex_unlock(&s->lock);
}

typedef struct TrimEntry {
        struct timespec mtime;
        uint64_t size;
        bool removed;
        char name[FEATURE_STORE_NAME_MAX];
} TrimEntry;

static int trim_cmp(const void *a, const void *b) {
        const TrimEntry *x = a, *y = b;
        if (x->mtime.tv_sec != y->mtime.tv_sec)
                return x->mtime.tv_sec < y->mtime.tv_sec ? -1 : 1;
        if (x->mtime.tv_nsec != y->mtime.tv_nsec)
                return x->mtime.tv_nsec < y->mtime.tv_nsec ? -1 : 1;
        return strcmp(x->name, y->name);
}

/* The store's directory, for reading its entries. */
static int open_root(FeatureStore *s, DIR **ret) {
        int fd = openat2_beneath(s->root_fd, ".", O_RDONLY | O_DIRECTORY, 0);
        if (fd < 0)
                return fd;
        *ret = fdopendir(fd);
        if (!*ret) {
                safe_close(fd);
                return negative_errno();
        }
        return 0;
}

/* Scans the root: recounts the bytes, removes temporary files if asked, removes the
 * least recently used entries until the total is at most target, and rebuilds the
 * index from what is left. Under the lock, or before the store is shared. */
static int scan(FeatureStore *s, bool remove_tmp, uint64_t target) {
        _cleanup_(freep) TrimEntry *v = NULL;
        size_t n = 0, cap = 0;
        uint64_t total = 0;
        struct dirent *de;
        DIR *d;
        int r = open_root(s, &d);
        if (r < 0)
                return r;
        while ((de = readdir(d))) {
                struct stat st;
                if (remove_tmp && strncmp(de->d_name, ".tmp-", 5) == 0) {
                        (void)unlinkat(dirfd(d), de->d_name, 0);
                        continue;
                }
                if (!is_entry_name(de->d_name) || strlen(de->d_name) >= FEATURE_STORE_NAME_MAX)
                        continue;
                if (fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0 || !S_ISREG(st.st_mode))
                        continue;
                if ((uint64_t)st.st_size <= HEADER_SIZE) {
                        /* No feature fits (files are renamed into place whole): damaged,
                         * removed, or the index would give it a size of 0, which a read
                         * back refuses before it could parse and remove it. */
                        (void)unlinkat(dirfd(d), de->d_name, 0);
                        continue;
                }
                if (n == cap) {
                        TrimEntry *nv = reallocarray(v, cap ? cap * 2 : 64, sizeof *nv);
                        if (!nv) {
                                closedir(d);
                                return -ENOMEM;
                        }
                        v = nv;
                        cap = cap ? cap * 2 : 64;
                }
                v[n].mtime = st.st_mtim;
                v[n].size = (uint64_t)st.st_size;
                v[n].removed = false;
                strcpy(v[n].name, de->d_name);
                total += v[n].size;
                n++;
        }
        closedir(d);
        if (total > target) {
                qsort(v, n, sizeof *v, trim_cmp);
                for (size_t i = 0; i < n && total > target; i++)
                        if (unlinkat(s->root_fd, v[i].name, 0) >= 0) {
                                total -= v[i].size;
                                s->trimmed++;
                                v[i].removed = true;
                        }
        }
        s->bytes = total;
        pthread_mutex_lock(&s->index_lock);
        index_clear(s);
        s->index_lost = false;
        for (size_t i = 0; i < n; i++) {
                StoreName nm;
                if (!v[i].removed && name_parse(v[i].name, &nm))
                        index_add(s, &nm, v[i].size - MIN(v[i].size, (uint64_t)HEADER_SIZE));
        }
        pthread_mutex_unlock(&s->index_lock);
        return 0;
}

static int openat2_beneath(int dirfd, const char *name, int flags, mode_t mode) {
        struct open_how how = {
                .flags = (uint64_t)(flags | O_CLOEXEC | O_NOFOLLOW),
                .mode = (flags & O_CREAT) ? mode : 0,
                .resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS,
        };
        long fd = syscall(SYS_openat2, dirfd, name, &how, sizeof how);
        return fd < 0 ? negative_errno() : (int)fd;
}

/* What the store needs of root before it reads it: an absolute path naming a directory
 * that exists (never made here), openat2() in the kernel, and the directory readable
 * through it (the scan's open_root()). The root's O_PATH fd in *ret_fd. */
static int root_open(const char *root, int *ret_fd) {
        _cleanup_(closep) int fd = -EBADF;
        int probe;

        if (!root || root[0] != '/')
                return -EINVAL;
        fd = open(root, O_PATH | O_DIRECTORY | O_CLOEXEC);
        if (fd < 0)
                return negative_errno();
        probe = openat2_beneath(fd, ".", O_RDONLY | O_DIRECTORY, 0);
        if (probe < 0)
                return probe == -ENOSYS ? -EOPNOTSUPP : probe;
        safe_close(probe);
        *ret_fd = TAKE_FD(fd);
        return 0;
}

int feature_store_check(const char *root) {
        int fd = -EBADF;
        int r = root_open(root, &fd);
        safe_close(fd);
        return r;
}

int feature_store_open(const char *root, uint64_t max_bytes, FeatureStore **ret) {
        _cleanup_(closep) int fd = -EBADF;
        FeatureStore *s;
        int probe;

        probe = root_open(root, &fd);
        if (probe < 0)
                return probe;

        s = calloc(1, sizeof *s);
        if (!s)
                return -ENOMEM;
        s->root = strdup(root);
        if (!s->root) {
                free(s);
                return -ENOMEM;
        }
        s->root_fd = TAKE_FD(fd);
        s->max_bytes = max_bytes;
        pthread_mutex_init(&s->lock, NULL);
        pthread_mutex_init(&s->index_lock, NULL);
        s->index = hashmap_new(HASHMAP_KEY_BYTES, sizeof(StoreName));
        if (!s->index) {
                feature_store_free(s);
                return -ENOMEM;
        }
        probe = scan(s, true, max_bytes ? max_bytes : UINT64_MAX);
        if (probe < 0) {
                feature_store_free(s);
                return probe;
        }
        *ret = s;
        return 0;
}

uint64_t feature_store_bytes(FeatureStore *s) {
        pthread_mutex_lock(&s->lock);
        uint64_t v = s->bytes;
        pthread_mutex_unlock(&s->lock);
        return v;
}

uint64_t feature_store_trimmed(FeatureStore *s) {
        pthread_mutex_lock(&s->lock);
        uint64_t v = s->trimmed;
        pthread_mutex_unlock(&s->lock);
        return v;
}

FeatureStore *feature_store_free(FeatureStore *s) {
        if (!s)
                return NULL;
        safe_close(s->root_fd);
        if (s->index) {
                index_clear(s);
                hashmap_free(s->index);
        }
        pthread_mutex_destroy(&s->index_lock);
        pthread_mutex_destroy(&s->lock);
        free(s->root);
        free(s);
        return NULL;
}

int feature_store_name(const char *key, char buf[static FEATURE_STORE_NAME_MAX]) {
        size_t n;

        if (!key)
                return -EINVAL;
        n = strlen(key);
        if (n == 0)
                return -EINVAL;
        StoreName nm;
        name_of(key, n, &nm);
        snprintf(buf, FEATURE_STORE_NAME_MAX, "f-%016llx%016llx.feat", (unsigned long long)nm.h[0],
                 (unsigned long long)nm.h[1]);
        return 0;
}

bool feature_store_has(FeatureStore *s, const char *key, uint64_t *ret_bytes) {
        StoreName nm;
        size_t n = key ? strlen(key) : 0;
        if (n == 0)
                return false;
        name_of(key, n, &nm);
        pthread_mutex_lock(&s->index_lock);
        IndexEntry *e = s->index_lost ? NULL : hashmap_get(s->index, &nm);
        bool has = s->index_lost || e;
        if (ret_bytes)
                *ret_bytes = e ? e->bytes : UINT64_MAX;
        pthread_mutex_unlock(&s->index_lock);
        return has;
}

int feature_store_openat(FeatureStore *s, const char *name, int flags, mode_t mode) {
        return openat2_beneath(s->root_fd, name, flags, mode);
}

static int write_all(int fd, const void *p, size_t n) {
        const uint8_t *b = p;
        while (n > 0) {
                ssize_t k = write(fd, b, n);
                if (k < 0) {
                        if (errno == EINTR)
                                continue;
                        return negative_errno();
                }
                b += k;
                n -= (size_t)k;
        }
        return 0;
}

static int read_all(int fd, void *p, size_t n) {
        uint8_t *b = p;
        while (n > 0) {
                ssize_t k = read(fd, b, n);
                if (k < 0) {
                        if (errno == EINTR)
                                continue;
                        return negative_errno();
                }
                if (k == 0)
                        return -EBADMSG; /* short file */
                b += k;
                n -= (size_t)k;
        }
        return 0;
}

/* CRC32C of the header (its own field as zero), key and descriptor. */
static uint32_t meta_crc(const uint8_t header[static HEADER_SIZE], const void *key, size_t key_len,
                         const void *desc, size_t desc_len) {
        static const uint8_t zero[4] = {};
        uint32_t crc = crc32c(0, header, HEADER_CRC_AT);
        crc = crc32c(crc, zero, sizeof zero);
        crc = crc32c(crc, header + HEADER_CRC_AT + 4, HEADER_SIZE - HEADER_CRC_AT - 4);
        crc = crc32c(crc, key, key_len);
        return crc32c(crc, desc, desc_len);
}

/* Header: magic[8] u32 version u32 key_len u64 data_size u32 desc_len u32 crc32c(data)
 *         id[16] u64 encode_usec u32 crc32c(header, key, descriptor) u32 0. A copy
 *         damaged on disk is refused when it is read back (EBADMSG), never served as a
 *         hit: a damaged header, key or descriptor by the lookup, damaged data by the
 *         read. */
int feature_store_save(FeatureStore *s, const FeatureStoreRecord *rec, const void *data) {
        _cleanup_(freep) void *desc = NULL;
        _cleanup_(closep) int fd = -EBADF;
        char name[FEATURE_STORE_NAME_MAX], tmp[FEATURE_STORE_NAME_MAX + 24];
        uint8_t header[HEADER_SIZE] = {};
        size_t desc_len, key_len;
        EpdId rnd;
        int r;

        if (!rec || !rec->key || !rec->desc || (!data && rec->size > 0))
                return -EINVAL;
        r = feature_store_name(rec->key, name);
        if (r < 0)
                return r;
        r = feature_desc_serialize(rec->desc, &desc, &desc_len);
        if (r < 0)
                return r;
        key_len = strlen(rec->key);

        memcpy(header, FEATURE_STORE_MAGIC, 8);
        unaligned_write_le(header + 8, STORE_VERSION, 4);
        unaligned_write_le(header + 12, key_len, 4);
        unaligned_write_le(header + 16, rec->size, 8);
        unaligned_write_le(header + 24, desc_len, 4);
        unaligned_write_le(header + 28, crc32c(0, data, rec->size), 4);
        memcpy(header + 32, rec->request_id.bytes, 16);
        unaligned_write_le(header + 48, rec->encode_usec, 8);
        unaligned_write_le(header + HEADER_CRC_AT, meta_crc(header, rec->key, key_len, desc, desc_len), 4);

        r = epd_id_random(&rnd);
        if (r < 0)
                return r;
        snprintf(tmp, sizeof tmp, ".tmp-%02x%02x%02x%02x%02x%02x%02x%02x", rnd.bytes[0],
                 rnd.bytes[1], rnd.bytes[2], rnd.bytes[3], rnd.bytes[4], rnd.bytes[5],
                 rnd.bytes[6], rnd.bytes[7]);
        fd = openat2_beneath(s->root_fd, tmp, O_WRONLY | O_CREAT | O_EXCL, 0600);
        if (fd < 0)
                return fd;
        r = write_all(fd, header, sizeof header);
        if (r >= 0)
                r = write_all(fd, rec->key, key_len);
        if (r >= 0)
                r = write_all(fd, desc, desc_len);
        if (r >= 0)
                r = write_all(fd, data, rec->size);
        /* On disk before the name: after a machine crash some file systems leave a file
         * renamed into place but its data unwritten (zeros of the right size), which a
         * load would take for the feature. (The spill thread's time, not the loop's.) */
        if (r >= 0 && fdatasync(fd) < 0)
                r = negative_errno();
        if (r < 0) {
                (void)unlinkat(s->root_fd, tmp, 0);
                return r;
        }
        pthread_mutex_lock(&s->lock);
        uint64_t old = entry_size(s, name);
        /* In the index before the file is in place: whoever sees the file finds the key
         * (a lookup in between finds no file yet: a miss, as before the save). */
        StoreName nm;
        name_of(rec->key, key_len, &nm);
        pthread_mutex_lock(&s->index_lock);
        IndexEntry *was = hashmap_get(s->index, &nm);
        uint64_t was_bytes = was ? was->bytes : 0;
        index_add(s, &nm, rec->size);
        pthread_mutex_unlock(&s->index_lock);
        if (renameat(s->root_fd, tmp, s->root_fd, name) < 0) {
                r = negative_errno();
                pthread_mutex_lock(&s->index_lock);
                if (!was)
                        index_del(s, &nm);
                else if ((was = hashmap_get(s->index, &nm)))
                        was->bytes = was_bytes;
                pthread_mutex_unlock(&s->index_lock);
                pthread_mutex_unlock(&s->lock);
                (void)unlinkat(s->root_fd, tmp, 0);
                return r;
        }
        s->bytes = s->bytes - MIN(old, s->bytes) + HEADER_SIZE + key_len + desc_len + rec->size;
        if (s->max_bytes && s->bytes > s->max_bytes)
                (void)scan(s, false, s->max_bytes / 10 * 9);
        pthread_mutex_unlock(&s->lock);
        return 0;
}

void feature_store_entry_done(FeatureStoreEntry *e) {
        if (!e)
                return;
        e->fd = safe_close(e->fd);
        e->desc = feature_desc_free(e->desc);
}

int feature_store_lookup(FeatureStore *s, const char *key, FeatureStoreEntry *ret) {
        _cleanup_(feature_desc_freep) FeatureDesc *desc = NULL;
        _cleanup_(closep) int fd = -EBADF;
        _cleanup_(freep) uint8_t *buf = NULL;
        char name[FEATURE_STORE_NAME_MAX];
        uint8_t header[HEADER_SIZE];
        uint64_t key_len, desc_len, size;
        struct stat st;
        int r;

        r = feature_store_name(key, name);
        if (r < 0)
                return r;
        /* Non-blocking: a FIFO (or a device) planted under the name would block the
         * open (the load thread's, or the event loop's) until a writer came, for ever;
         * it opens at once instead and the fstat() below refuses it. Nor does a
         * terminal there become the daemon's. */
        fd = openat2_beneath(s->root_fd, name, O_RDONLY | O_NONBLOCK | O_NOCTTY, 0);
        if (fd < 0 && fd != -ENOMEM && fd != -EMFILE && fd != -ENFILE && fd != -EINTR && fd != -EAGAIN) {
                /* Gone behind the store's back, or not a file it can open (a symlink
                 * planted, its mode changed): forgotten, so that the next Acquire is a
                 * miss instead of this again. Unless a save has just put it there. */
                StoreName nm;
                name_of(key, strlen(key), &nm);
                pthread_mutex_lock(&s->lock);
                if (fd != -ENOENT || entry_size(s, name) == 0)
                        index_del_locked(s, &nm);
                pthread_mutex_unlock(&s->lock);
        }
        if (fd < 0)
                return fd;
        if (fstat(fd, &st) < 0)
                return negative_errno();
        if (!S_ISREG(st.st_mode)) {
                /* Not a file the store wrote (a FIFO, a socket, a device): removed, as a
                 * damaged copy is, and the name leaves the index. */
                r = -EBADMSG;
                goto bad;
        }
        /* Blocking again for its reads: a regular file ignores O_NONBLOCK on local file
         * systems, but one that honoured it must not have a good copy taken for a short
         * one (-EAGAIN) and removed. */
        int fl = fcntl(fd, F_GETFL);
        if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) < 0)
                return negative_errno();
        r = read_all(fd, header, sizeof header);
        if (r < 0)
                goto bad;
        key_len = unaligned_read_le(header + 12, 4);
        size = unaligned_read_le(header + 16, 8);
        desc_len = unaligned_read_le(header + 24, 4);
        /* Another version (an older epd's file: a miss, removed), or a header that does
         * not match the file. */
        if (memcmp(header, FEATURE_STORE_MAGIC, 8) != 0 || unaligned_read_le(header + 8, 4) != STORE_VERSION ||
            unaligned_read_le(header + HEADER_CRC_AT + 4, 4) != 0 ||
            key_len != strlen(key) || desc_len > FEATURE_DESC_BINARY_MAX ||
            size > (uint64_t)st.st_size ||
            (uint64_t)st.st_size != HEADER_SIZE + key_len + desc_len + size) {
                r = -EBADMSG;
                goto bad;
        }
        buf = malloc(key_len + desc_len);
        if (!buf)
                return -ENOMEM;
        r = read_all(fd, buf, key_len + desc_len);
        if (r < 0)
                goto bad;
        if (memcmp(buf, key, key_len) != 0) {
                /* Another key's file under this key's name (a collision of the 128-bit
                 * names, or damage): left as it is, but the name leaves the index, or
                 * every lookup of key would open it again. Unless a save has just put
                 * another file there (not the one read). */
                index_settle(s, key, key_len, name, st.st_ino, UINT64_MAX);
                return -ENOENT;
        }
        /* Damaged on disk (a bit of a shape, a dtype, the request id): a descriptor that
         * parses is not enough, it must be the one saved. */
        if (meta_crc(header, buf, key_len, buf + key_len, desc_len) !=
            (uint32_t)unaligned_read_le(header + HEADER_CRC_AT, 4)) {
                r = -EBADMSG;
                goto bad;
        }
        r = feature_desc_parse(buf + key_len, desc_len, size, &desc, NULL);
        if (r < 0) {
                r = -EBADMSG;
                goto bad;
        }

        /* The index learns the data's exact size (an entry found by a scan has a bound
         * on it): the next read-back of key reserves no more than it needs. */
        index_settle(s, key, key_len, name, st.st_ino, size);
        (void)futimens(fd, NULL); /* recently used: trimmed last */
        *ret = (FeatureStoreEntry){
                .fd = TAKE_FD(fd),
                .size = size,
                .desc = TAKE_PTR(desc),
                .encode_usec = unaligned_read_le(header + 48, 8),
                .crc = (uint32_t)unaligned_read_le(header + 28, 4),
                .ino = st.st_ino,
        };
        memcpy(ret->request_id.bytes, header + 32, 16);
        return 0;

bad:
        unlink_entry(s, name, st.st_ino);
        return r == -ENOMEM ? r : -EBADMSG;
}

int feature_store_entry_read(FeatureStoreEntry *e, void *dst) {
        if (!e || e->fd < 0 || (!dst && e->size > 0))
                return -EINVAL;
        int r = read_all(e->fd, dst, e->size);
        if (r >= 0 && crc32c(0, dst, e->size) != e->crc)
                return -EBADMSG; /* damaged on disk: not the bytes that were published */
        return r;
}

int feature_store_remove_file(FeatureStore *s, const char *key, ino_t ino) {
        char name[FEATURE_STORE_NAME_MAX];
        uint64_t size;
        int r = feature_store_name(key, name);
        if (r < 0)
                return r;
        StoreName nm;
        name_of(key, strlen(key), &nm);
        pthread_mutex_lock(&s->lock);
        if (!still_holds(s, name, ino, true))
                r = -ESTALE; /* another file there now: a save's, left with its index entry */
        else {
                size = entry_size(s, name);
                r = unlinkat(s->root_fd, name, 0) < 0 ? negative_errno() : 0;
                if (r >= 0)
                        s->bytes -= MIN(size, s->bytes);
                index_del_locked(s, &nm);
        }
        pthread_mutex_unlock(&s->lock);
        return r;
}

int feature_store_remove(FeatureStore *s, const char *key) {
        return feature_store_remove_file(s, key, 0);
}

void feature_store_forget(FeatureStore *s, const char *key) {
        StoreName nm;
        size_t n = key ? strlen(key) : 0;
        if (n == 0)
                return;
        name_of(key, n, &nm);
        index_del_locked(s, &nm);
}

int feature_store_usage(FeatureStore *s, uint64_t *ret_files, uint64_t *ret_bytes) {
        uint64_t files = 0, bytes = 0;
        struct dirent *de;
        DIR *d;
        int r = open_root(s, &d);
        if (r < 0)
                return r;
        while ((de = readdir(d))) {
                struct stat st;
                if (!is_entry_name(de->d_name))
                        continue;
                if (fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0 || !S_ISREG(st.st_mode))
                        continue;
                files++;
                bytes += (uint64_t)st.st_size;
        }
        closedir(d);
        if (ret_files)
                *ret_files = files;
        if (ret_bytes)
                *ret_bytes = bytes;
        return 0;
}
