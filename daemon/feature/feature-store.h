/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Optional file-backed spill/load of READY features, under one configured root
 * directory ([Features] StoreDirectory=).
 *
 * Confinement: a key is never used as a path. The file name of a key is derived from
 * it ("f-" + 32 hex digits of a 128-bit hash + ".feat"), the full key is stored inside
 * the file and compared on load, and every open is an openat2() relative to the root
 * fd with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS, so neither a
 * crafted key ("..", "/", ...) nor a symlink planted in the root can reach outside it.
 * Files are written to a temporary name and renamed into place, so a reader never sees
 * half a file.
 *
 * Thread-safe: the spill thread (feature-spill.c) saves while the load thread
 * (feature-load.c) looks up and reads.
 *
 * The store keeps an index of the names of its entries in memory (scanned at open,
 * kept as files are saved, removed and trimmed): feature_store_has() answers whether a
 * key may be stored without touching the disk. Files added to the directory by anything
 * else are seen at the next open.
 *
 * File: header (FEATURE_STORE_MAGIC, version, sizes, request id, encoder time, the
 * data's CRC32C and a CRC32C over header, key and descriptor), key, binary descriptor
 * (feature-desc.h), data. Everything read back is validated: a file damaged on disk, or
 * of another format version (an older epd's), is -EBADMSG and removed, never a hit. */

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "id.h"
#include "proto/feature-desc.h"
#include "time-util.h"

typedef struct FeatureStore FeatureStore;

#define FEATURE_STORE_MAGIC "EPDFEAT1"
#define FEATURE_STORE_NAME_MAX 48 /* "f-" + 32 + ".feat" + NUL, rounded */

typedef struct FeatureStoreRecord {
        const char *key;
        uint64_t size;           /* data bytes */
        const FeatureDesc *desc;
        EpdId request_id;
        usec_t encode_usec;
} FeatureStoreRecord;

/* Opens the root (which must exist and be a directory), removes temporary files a crash
 * left behind, and counts what is there. The store keeps its files within max_bytes
 * (0: no limit): when a save goes over, the least recently used files (by mtime; a
 * load touches it) are removed until it is 10% under. -EOPNOTSUPP if the kernel lacks
 * openat2 (Linux < 5.6). */
int feature_store_open(const char *root, uint64_t max_bytes, FeatureStore **ret);
/* What feature_store_open() refuses of root, with the same errors (-EINVAL, -ENOENT,
 * -ENOTDIR, -EACCES, -EOPNOTSUPP, ...), and no side effect: nothing is made, scanned or
 * removed. For `epdd --check-config` and a reload. */
int feature_store_check(const char *root);
FeatureStore *feature_store_free(FeatureStore *s);

/* The file name of a key (never a path). */
int feature_store_name(const char *key, char buf[static FEATURE_STORE_NAME_MAX]);

/* Opens name (relative to the root) confined beneath it. A name that resolves
 * outside, through "..", an absolute path or any symlink, fails (-EXDEV, -ELOOP).
 * Exposed for the confinement tests. */
int feature_store_openat(FeatureStore *s, const char *name, int flags, mode_t mode);

int feature_store_save(FeatureStore *s, const FeatureStoreRecord *rec, const void *data);

/* Whether key may have an entry: false only when the index says it has none (no
 * system call). A true answer is confirmed by feature_store_lookup(), which forgets a
 * name whose file turns out gone. *ret_bytes (may be NULL): the data's size as saved,
 * or for an entry found at open a bound on it (its file's size less the header), or
 * UINT64_MAX when the index could not be kept (out of memory) and nothing is known. */
bool feature_store_has(FeatureStore *s, const char *key, uint64_t *ret_bytes);

/* Looks key up: -ENOENT if absent, or if its name holds another key's file (left as
 * it is). On success the entry describes the data (the index learns its exact size),
 * and its fd is positioned at the first byte. A file that does not parse, of another
 * format version, or whose header or descriptor fails its checksum is -EBADMSG and is
 * removed (a damaged key reads as another key's: -ENOENT, left). Either way a name the lookup found unusable leaves the index, unless
 * a save has put another file there meanwhile. */
typedef struct FeatureStoreEntry {
        int fd;
        uint64_t size;
        FeatureDesc *desc;
        EpdId request_id;
        usec_t encode_usec;
        uint32_t crc;       /* CRC32C of the data, checked by feature_store_entry_read() */
        ino_t ino;          /* the file read */
} FeatureStoreEntry;

int feature_store_lookup(FeatureStore *s, const char *key, FeatureStoreEntry *ret);
/* Reads the data into dst (entry->size bytes): -EBADMSG when they are not the bytes
 * saved (their CRC32C differs). */
int feature_store_entry_read(FeatureStoreEntry *e, void *dst);
void feature_store_entry_done(FeatureStoreEntry *e);

int feature_store_remove(FeatureStore *s, const char *key);
/* The same, only if key's name still holds the file ino (a reader's that found it
 * damaged): -ESTALE, nothing changed, when a save has put another file there since. */
int feature_store_remove_file(FeatureStore *s, const char *key, ino_t ino);
/* Drops key's name from the index, its file (if any) left as it is: a lookup that found
 * no usable copy, for whatever reason, is not tried again until the next save or scan. */
void feature_store_forget(FeatureStore *s, const char *key);

/* Number of entries and bytes in the root (a directory scan; for stats and tests). */
int feature_store_usage(FeatureStore *s, uint64_t *ret_files, uint64_t *ret_bytes);
/* Bytes of entries as the store counts them (kept up to date without a scan). */
uint64_t feature_store_bytes(FeatureStore *s);
/* Files removed to stay within max_bytes, since open. */
uint64_t feature_store_trimmed(FeatureStore *s);

static inline void feature_store_freep(FeatureStore **s) {
        feature_store_free(*s);
}
