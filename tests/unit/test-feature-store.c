/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "feature/feature-spill.h"
#include "feature/feature-store.h"
#include "feature/feature.h"
#include "macro.h"
#include "../check-main.h"

static char top[] = "/tmp/test-feature-store-XXXXXX";
static char root[128], outside[128];

static void setup(void) {
        ck_assert_ptr_nonnull(mkdtemp(top));
        snprintf(root, sizeof root, "%s/root", top);
        snprintf(outside, sizeof outside, "%s/outside", top);
        ck_assert_int_eq(mkdir(root, 0700), 0);
        ck_assert_int_eq(mkdir(outside, 0700), 0);
        /* a file outside the root that no key may reach */
        char p[192];
        snprintf(p, sizeof p, "%s/secret", outside);
        FILE *f = fopen(p, "we");
        ck_assert_ptr_nonnull(f);
        fputs("secret", f);
        fclose(f);
}

static void teardown(void) {
        char cmd[256];
        snprintf(cmd, sizeof cmd, "rm -rf -- '%s'", top);
        ck_assert_int_eq(system(cmd), 0);
        strcpy(top, "/tmp/test-feature-store-XXXXXX");
}

static FeatureStore *store_open(void) {
        FeatureStore *s;
        int r = feature_store_open(root, 0, &s);
        if (r == -EOPNOTSUPP) {
                fprintf(stderr, "openat2 is not available (Linux < 5.6); skipping\n");
                exit(77);
        }
        ck_assert_int_eq(r, 0);
        return s;
}

static FeatureDesc *desc_bytes(uint64_t n) {
        FeatureDesc *d;
        ck_assert_int_eq(feature_desc_new(1, &d), 0);
        strcpy(d->tensors[0].name, "x");
        d->tensors[0].dtype = FEATURE_DTYPE_U8;
        d->tensors[0].rank = 1;
        d->tensors[0].shape[0] = n;
        d->tensors[0].strides[0] = 1;
        return d;
}

static int count_entries(const char *dir) {
        char cmd[256];
        snprintf(cmd, sizeof cmd, "test $(ls -A '%s' | wc -l) -eq 0", dir);
        return system(cmd) == 0 ? 0 : 1;
}

static const char *const evil_keys[] = {
        "..", "../secret", "../../../../../../etc/passwd", "/etc/passwd", "a/b/c",
        "./.", "../outside/secret", "\xff\xfe binary", "f-0123456789abcdef0123456789abcdef.feat",
};

START_TEST(test_names_are_confined) {
        char name[FEATURE_STORE_NAME_MAX], other[FEATURE_STORE_NAME_MAX];

        for (size_t i = 0; i < ELEMENTSOF(evil_keys); i++) {
                ck_assert_int_eq(feature_store_name(evil_keys[i], name), 0);
                ck_assert_ptr_null(strchr(name, '/'));
                ck_assert_uint_eq(strlen(name), 39);
                ck_assert_int_eq(strncmp(name, "f-", 2), 0);
        }
        ck_assert_int_eq(feature_store_name("", name), -EINVAL);
        ck_assert_int_eq(feature_store_name("a", name), 0);
        ck_assert_int_eq(feature_store_name("b", other), 0);
        ck_assert_str_ne(name, other);
}
END_TEST

START_TEST(test_evil_keys_round_trip_inside) {
        _cleanup_(feature_store_freep) FeatureStore *s = store_open();
        _cleanup_(feature_desc_freep) FeatureDesc *d = desc_bytes(5);
        uint64_t files, bytes;

        for (size_t i = 0; i < ELEMENTSOF(evil_keys); i++) {
                FeatureStoreEntry e = { .fd = -EBADF };
                char buf[5];
                ck_assert_int_eq(feature_store_save(s, &(FeatureStoreRecord){ .key = evil_keys[i], .size = 5, .desc = d, .encode_usec = i }, "hello"), 0);
                ck_assert_int_eq(feature_store_lookup(s, evil_keys[i], &e), 0);
                ck_assert_uint_eq(e.size, 5);
                ck_assert_uint_eq(e.encode_usec, i);
                ck_assert_int_eq(feature_store_entry_read(&e, buf), 0);
                ck_assert_mem_eq(buf, "hello", 5);
                feature_store_entry_done(&e);
        }
        ck_assert_int_eq(feature_store_usage(s, &files, &bytes), 0);
        ck_assert_uint_eq(files, ELEMENTSOF(evil_keys));
        /* nothing appeared outside the root: the outside dir still holds only "secret",
         * the parent only root/ and outside/ */
        char cmd[256];
        snprintf(cmd, sizeof cmd, "test \"$(ls -A '%s')\" = secret && test \"$(ls -A '%s' | tr '\\n' ' ')\" = 'outside root '", outside, top);
        ck_assert_int_eq(system(cmd), 0);
        for (size_t i = 0; i < ELEMENTSOF(evil_keys); i++)
                ck_assert_int_eq(feature_store_remove(s, evil_keys[i]), 0);
        ck_assert_int_eq(count_entries(root), 0);
}
END_TEST

START_TEST(test_openat_beneath) {
        _cleanup_(feature_store_freep) FeatureStore *s = store_open();
        char p[256];
        int fd;

        ck_assert_int_eq(feature_store_openat(s, "../outside/secret", O_RDONLY, 0), -EXDEV);
        ck_assert_int_eq(feature_store_openat(s, "/etc/passwd", O_RDONLY, 0), -EXDEV);
        ck_assert_int_eq(feature_store_openat(s, "..", O_RDONLY | O_DIRECTORY, 0), -EXDEV);
        ck_assert_int_eq(feature_store_openat(s, "../outside/new", O_WRONLY | O_CREAT, 0600), -EXDEV);

        /* a symlinked directory inside the root, pointing out */
        snprintf(p, sizeof p, "%s/link", root);
        ck_assert_int_eq(symlink(outside, p), 0);
        fd = feature_store_openat(s, "link/secret", O_RDONLY, 0);
        ck_assert(fd == -ELOOP || fd == -EXDEV);
        fd = feature_store_openat(s, "link/new", O_WRONLY | O_CREAT, 0600);
        ck_assert(fd == -ELOOP || fd == -EXDEV);
        /* a relative symlink that climbs out */
        snprintf(p, sizeof p, "%s/up", root);
        ck_assert_int_eq(symlink("../outside/secret", p), 0);
        fd = feature_store_openat(s, "up", O_RDONLY, 0);
        ck_assert(fd == -ELOOP || fd == -EXDEV);
        /* a symlink that stays inside is refused as well (no symlinks at all) */
        snprintf(p, sizeof p, "%s/self", root);
        ck_assert_int_eq(symlink(".", p), 0);
        fd = feature_store_openat(s, "self/x", O_RDONLY, 0);
        ck_assert(fd == -ELOOP || fd == -EXDEV);
        /* and a plain name inside works */
        fd = feature_store_openat(s, "plain", O_WRONLY | O_CREAT, 0600);
        ck_assert_int_ge(fd, 0);
        close(fd);
        ck_assert_int_eq(count_entries(outside) == 0, 0); /* "secret" still alone there */
}
END_TEST

/* A symlink planted under the exact file name of a key: lookup refuses it, and save
 * replaces the link instead of writing through it. */
START_TEST(test_planted_symlink) {
        _cleanup_(feature_store_freep) FeatureStore *s = store_open();
        _cleanup_(feature_desc_freep) FeatureDesc *d = desc_bytes(3);
        char name[FEATURE_STORE_NAME_MAX], p[256], target[192], buf[16] = {};
        FeatureStoreEntry e = { .fd = -EBADF };
        struct stat st;

        ck_assert_int_eq(feature_store_name("victim", name), 0);
        snprintf(p, sizeof p, "%s/%s", root, name);
        snprintf(target, sizeof target, "%s/secret", outside);
        ck_assert_int_eq(symlink(target, p), 0);
        ck_assert_int_eq(feature_store_lookup(s, "victim", &e), -ELOOP);
        ck_assert_int_eq(feature_store_save(s, &(FeatureStoreRecord){ .key = "victim", .size = 3, .desc = d }, "new"), 0);
        ck_assert_int_eq(lstat(p, &st), 0);
        ck_assert(S_ISREG(st.st_mode));
        FILE *f = fopen(target, "re");
        ck_assert_ptr_nonnull(f);
        ck_assert_ptr_nonnull(fgets(buf, sizeof buf, f));
        fclose(f);
        ck_assert_str_eq(buf, "secret");
        ck_assert_int_eq(feature_store_lookup(s, "victim", &e), 0);
        feature_store_entry_done(&e);
}
END_TEST

static void on_alarm(int sig) {
        (void)sig;
}

/* A FIFO planted under the file name of a stored key: the lookup does not wait for a
 * writer (before, its open blocked the load thread for ever, and with it every later
 * read back and the daemon's shutdown), refuses it as a file that is not one, and the
 * name leaves the index, as for a planted symlink. */
START_TEST(test_planted_fifo) {
        _cleanup_(feature_store_freep) FeatureStore *s = store_open();
        _cleanup_(feature_desc_freep) FeatureDesc *d = desc_bytes(3);
        char name[FEATURE_STORE_NAME_MAX], p[256];
        FeatureStoreEntry e = { .fd = -EBADF };
        struct stat st;

        ck_assert_int_eq(feature_store_save(s, &(FeatureStoreRecord){ .key = "piped", .size = 3, .desc = d }, "abc"), 0);
        ck_assert(feature_store_has(s, "piped", NULL));
        ck_assert_int_eq(feature_store_name("piped", name), 0);
        snprintf(p, sizeof p, "%s/%s", root, name);
        ck_assert_int_eq(unlink(p), 0);
        ck_assert_int_eq(mkfifo(p, 0600), 0);
        /* A blocked open is interrupted (-EINTR, no SA_RESTART): the test fails
         * instead of hanging. */
        ck_assert_int_eq(sigaction(SIGALRM, &(struct sigaction){ .sa_handler = on_alarm }, NULL), 0);
        alarm(2);
        int r = feature_store_lookup(s, "piped", &e);
        alarm(0);
        ck_assert_int_eq(r, -EBADMSG);
        ck_assert_int_lt(e.fd, 0);
        ck_assert(!feature_store_has(s, "piped", NULL));
        /* not a file the store wrote: gone, and a save puts a real one there */
        ck_assert_int_eq(lstat(p, &st), -1);
        ck_assert_int_eq(feature_store_save(s, &(FeatureStoreRecord){ .key = "piped", .size = 3, .desc = d }, "new"), 0);
        ck_assert_int_eq(feature_store_lookup(s, "piped", &e), 0);
        feature_store_entry_done(&e);
}
END_TEST

START_TEST(test_bad_files) {
        _cleanup_(feature_store_freep) FeatureStore *s = store_open();
        _cleanup_(feature_desc_freep) FeatureDesc *d = desc_bytes(4);
        char a[FEATURE_STORE_NAME_MAX], b[FEATURE_STORE_NAME_MAX], pa[256], pb[256];
        FeatureStoreEntry e = { .fd = -EBADF };

        ck_assert_int_eq(feature_store_lookup(s, "missing", &e), -ENOENT);
        /* a file holding another key (as after a name collision) is a miss, and stays;
         * its name leaves the index (not opened again for keyB) */
        ck_assert_int_eq(feature_store_save(s, &(FeatureStoreRecord){ .key = "keyA", .size = 4, .desc = d }, "AAAA"), 0);
        feature_store_name("keyA", a);
        feature_store_name("keyB", b);
        snprintf(pa, sizeof pa, "%s/%s", root, a);
        snprintf(pb, sizeof pb, "%s/%s", root, b);
        ck_assert_int_eq(rename(pa, pb), 0);
        ck_assert(feature_store_has(s, "keyA", NULL));
        ck_assert_int_eq(feature_store_lookup(s, "keyB", &e), -ENOENT);
        ck_assert_int_eq(access(pb, F_OK), 0);
        ck_assert(!feature_store_has(s, "keyB", NULL));
        /* a truncated file is refused and removed */
        ck_assert_int_eq(feature_store_save(s, &(FeatureStoreRecord){ .key = "keyC", .size = 4, .desc = d }, "CCCC"), 0);
        feature_store_name("keyC", a);
        snprintf(pa, sizeof pa, "%s/%s", root, a);
        ck_assert_int_eq(truncate(pa, 70), 0);
        ck_assert_int_eq(feature_store_lookup(s, "keyC", &e), -EBADMSG);
        ck_assert_int_eq(access(pa, F_OK), -1);
        /* a bad descriptor inside is refused */
        ck_assert_int_eq(feature_store_save(s, &(FeatureStoreRecord){ .key = "keyD", .size = 4, .desc = d }, "DDDD"), 0);
        feature_store_name("keyD", a);
        snprintf(pa, sizeof pa, "%s/%s", root, a);
        int fd = open(pa, O_WRONLY | O_CLOEXEC);
        ck_assert_int_ge(fd, 0);
        ck_assert_int_eq(pwrite(fd, "\x63", 1, 64 + 4 + 16 + 2), 1); /* dtype byte of tensor 0 */
        close(fd);
        ck_assert_int_eq(feature_store_lookup(s, "keyD", &e), -EBADMSG);
        /* a directory under the name is not a file */
        feature_store_name("keyE", a);
        snprintf(pa, sizeof pa, "%s/%s", root, a);
        ck_assert_int_eq(mkdir(pa, 0700), 0);
        ck_assert_int_eq(feature_store_lookup(s, "keyE", &e), -EBADMSG);

        FeatureStore *x;
        ck_assert_int_eq(feature_store_open("relative/dir", 0, &x), -EINVAL);
        ck_assert_int_eq(feature_store_open("/nonexistent-epd-dir", 0, &x), -ENOENT);
        /* feature_store_check() (epdd --check-config, a reload) refuses what open would,
         * with its errors, and makes or removes nothing */
        ck_assert_int_eq(feature_store_check("relative/dir"), -EINVAL);
        ck_assert_int_eq(feature_store_check("/nonexistent-epd-dir"), -ENOENT);
        ck_assert_int_eq(access("/nonexistent-epd-dir", F_OK), -1);
        snprintf(pa, sizeof pa, "%s/secret", outside);
        ck_assert_int_eq(feature_store_check(pa), -ENOTDIR);
        snprintf(pa, sizeof pa, "%s/.tmp-left", root);
        fd = open(pa, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
        ck_assert_int_ge(fd, 0);
        close(fd);
        ck_assert_int_eq(feature_store_check(root), 0);
        ck_assert_int_eq(access(pa, F_OK), 0); /* (open removes it) */
}
END_TEST

/* The store stays within its size: the least recently used files go first, a load
 * counts as a use, and temporary files left by a crash are removed at open. */
START_TEST(test_bounded) {
        _cleanup_(feature_desc_freep) FeatureDesc *d = desc_bytes(1000);
        FeatureStore *s;
        FeatureStoreEntry e = { .fd = -EBADF };
        char key[32], p[256], buf[1000] = {};
        uint64_t files, bytes, one;
        int fd;

        snprintf(p, sizeof p, "%s/.tmp-0123456789abcdef", root);
        fd = open(p, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
        ck_assert_int_ge(fd, 0);
        close(fd);
        /* one entry is 64 + key + descriptor + 1000 bytes; allow about ten */
        ck_assert_int_eq(feature_store_open(root, 0, &s), 0);
        ck_assert_int_eq(access(p, F_OK), -1);
        ck_assert_int_eq(feature_store_save(s, &(FeatureStoreRecord){ .key = "k00", .size = 1000, .desc = d }, buf), 0);
        one = feature_store_bytes(s);
        feature_store_free(s);
        ck_assert_int_eq(feature_store_open(root, 10 * one + one / 2, &s), 0);
        ck_assert_uint_eq(feature_store_bytes(s), one); /* counted at open */
        for (int i = 1; i < 40; i++) {
                snprintf(key, sizeof key, "k%02d", i);
                ck_assert_int_eq(feature_store_save(s, &(FeatureStoreRecord){ .key = key, .size = 1000, .desc = d }, buf), 0);
                ck_assert_uint_le(feature_store_bytes(s), 10 * one + one / 2);
                if (i == 5) {
                        /* use k01: it must outlive its neighbours */
                        usleep(20000);
                        ck_assert_int_eq(feature_store_lookup(s, "k01", &e), 0);
                        feature_store_entry_done(&e);
                }
                if (i == 12) {
                        ck_assert_int_eq(feature_store_lookup(s, "k02", &e), -ENOENT);
                        ck_assert_int_eq(feature_store_lookup(s, "k01", &e), 0);
                        feature_store_entry_done(&e);
                }
                usleep(2000); /* distinct mtimes */
        }
        ck_assert_int_eq(feature_store_usage(s, &files, &bytes), 0);
        ck_assert_uint_eq(bytes, feature_store_bytes(s));
        ck_assert_uint_le(files, 10);
        ck_assert_uint_gt(feature_store_trimmed(s), 0);
        ck_assert_int_eq(feature_store_lookup(s, "k39", &e), 0); /* newest stays */
        feature_store_entry_done(&e);
        ck_assert_int_eq(feature_store_lookup(s, "k02", &e), -ENOENT); /* oldest went */
        ck_assert_int_eq(feature_store_remove(s, "k39"), 0);
        ck_assert_uint_eq(feature_store_bytes(s), bytes - one);
        feature_store_free(s);
}
END_TEST

static bool has_entry(FeatureStore *s, const char *key) {
        FeatureStoreEntry e = { .fd = -EBADF };
        int r = feature_store_lookup(s, key, &e);
        feature_store_entry_done(&e);
        return r == 0;
}

/* The index of stored names: a key without a file is answered without the disk, and
 * the index follows saves, removals, trims, damaged files, files removed behind the
 * store's back, and what a new open finds. */
/* A file under a key's name no longer than the header holds no feature: the scan at
 * open removes it. It entered the index with a size bound of 0, which a Prefetch's
 * read-back refused (-EINVAL) before the file was ever parsed and removed: the key
 * answered "failed" at every Prefetch, for ever (review). */
START_TEST(test_header_only_file_removed) {
        char name[FEATURE_STORE_NAME_MAX], p[256];
        FeatureStore *s = store_open();
        feature_store_free(s);
        feature_store_name("keyZ", name);
        snprintf(p, sizeof p, "%s/%s", root, name);
        int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        ck_assert_int_ge(fd, 0);
        ck_assert_int_eq(write(fd, "partial", 7), 7);
        close(fd);
        s = store_open();
        ck_assert(!feature_store_has(s, "keyZ", NULL));
        ck_assert_int_eq(access(p, F_OK), -1);
        feature_store_free(s);
}
END_TEST

START_TEST(test_index) {
        _cleanup_(feature_desc_freep) FeatureDesc *d = desc_bytes(1000);
        char buf[1000] = {}, key[32], name[FEATURE_STORE_NAME_MAX], p[256];
        FeatureStore *s = store_open();
        uint64_t one;

        ck_assert(!feature_store_has(s, "a", NULL));
        ck_assert(!feature_store_has(s, "", NULL));
        ck_assert_int_eq(feature_store_save(s, &(FeatureStoreRecord){ .key = "a", .size = 1000, .desc = d }, buf), 0);
        uint64_t size = 0;
        ck_assert(feature_store_has(s, "a", &size));
        ck_assert_uint_eq(size, 1000); /* as saved */
        ck_assert(!feature_store_has(s, "b", NULL));
        ck_assert_int_eq(feature_store_remove(s, "a"), 0);
        ck_assert(!feature_store_has(s, "a", NULL));
        /* a second save of a key, and its removal: gone from the index */
        for (int i = 0; i < 2; i++)
                ck_assert_int_eq(feature_store_save(s, &(FeatureStoreRecord){ .key = "a", .size = 1000, .desc = d }, buf),
                                 0);
        ck_assert_int_eq(feature_store_remove(s, "a"), 0);
        ck_assert(!feature_store_has(s, "a", NULL));
        ck_assert_int_eq(feature_store_save(s, &(FeatureStoreRecord){ .key = "b", .size = 1000, .desc = d }, buf), 0);
        ck_assert_int_eq(feature_store_save(s, &(FeatureStoreRecord){ .key = "c", .size = 1000, .desc = d }, buf), 0);
        one = feature_store_bytes(s) / 2;
        feature_store_free(s);

        /* What an open finds, and nothing else: other files in the root are no entries */
        snprintf(p, sizeof p, "%s/notes.txt", root);
        FILE *f = fopen(p, "we");
        ck_assert_ptr_nonnull(f);
        fclose(f);
        snprintf(p, sizeof p, "%s/f-zz000000000000000000000000000000.feat", root);
        f = fopen(p, "we");
        ck_assert_ptr_nonnull(f);
        fclose(f);
        s = store_open();
        ck_assert(feature_store_has(s, "b", &size));
        ck_assert_uint_ge(size, 1000); /* found at open: a bound, the file less its header */
        ck_assert_uint_lt(size, 1000 + 200);
        ck_assert(feature_store_has(s, "c", NULL));
        ck_assert(!feature_store_has(s, "a", NULL));
        ck_assert(!feature_store_has(s, "notes", NULL));

        /* removed behind the store's back: still indexed until a lookup finds it gone */
        ck_assert_int_eq(feature_store_name("b", name), 0);
        snprintf(p, sizeof p, "%s/%s", root, name);
        ck_assert_int_eq(unlink(p), 0);
        ck_assert(feature_store_has(s, "b", NULL));
        ck_assert(!has_entry(s, "b"));
        ck_assert(!feature_store_has(s, "b", NULL));
        /* a damaged file: removed by the lookup, and from the index */
        ck_assert_int_eq(feature_store_name("c", name), 0);
        snprintf(p, sizeof p, "%s/%s", root, name);
        ck_assert_int_eq(truncate(p, 100), 0);
        ck_assert(!has_entry(s, "c"));
        ck_assert(!feature_store_has(s, "c", NULL));
        feature_store_free(s);

        /* trimmed entries leave the index; every key's answer agrees with a lookup */
        ck_assert_int_eq(feature_store_open(root, 4 * one + one / 2, &s), 0);
        for (int i = 0; i < 12; i++) {
                snprintf(key, sizeof key, "t%02d", i);
                ck_assert_int_eq(feature_store_save(s, &(FeatureStoreRecord){ .key = key, .size = 1000, .desc = d }, buf),
                                 0);
                usleep(2000); /* distinct mtimes */
        }
        ck_assert_uint_gt(feature_store_trimmed(s), 0);
        ck_assert(!feature_store_has(s, "t00", NULL));
        ck_assert(feature_store_has(s, "t11", NULL));
        int indexed = 0;
        for (int i = 0; i < 12; i++) {
                snprintf(key, sizeof key, "t%02d", i);
                bool has = feature_store_has(s, key, NULL);
                indexed += has;
                ck_assert_msg(has == has_entry(s, key), "%s: indexed %d", key, has);
        }
        ck_assert_int_gt(indexed, 0);
        ck_assert_int_lt(indexed, 12);
        feature_store_free(s);
}
END_TEST

/* The cache spills on eviction and reads back on a miss. */
START_TEST(test_cache_spill_load) {
        _cleanup_(feature_store_freep) FeatureStore *s = store_open();
        FeatureCacheConfig cfg = { .budget_bytes = 1 << 20 };
        _cleanup_(feature_cache_freep) FeatureCache *c = NULL;
        uint8_t *mem = calloc(1, 1 << 20);
        FeatureDesc *d = desc_bytes(10000);
        FeatureAcquireResult res;
        FeatureRef *r;
        EpdId req = { { 9, 9, 9 } };

        ck_assert_int_eq(feature_cache_new(&cfg, &c), 0);
        ck_assert_int_eq(feature_cache_add_arena(c, 0, mem, 0, 1 << 20, 4096), 0);
        feature_cache_set_store(c, s);
        ck_assert_int_eq(feature_reserve(c, "../../img", 10000, &d, &req, &r, NULL), 0);
        for (int i = 0; i < 10000; i++)
                ((uint8_t *)feature_data(r->feature))[i] = (uint8_t)(i * 7);
        ck_assert_int_eq(feature_publish(r, 1234), 0);
        feature_ref_release(r);
        ck_assert_uint_eq(feature_cache_flush(c), 1);
        ck_assert_uint_eq(feature_cache_stats(c)->spilled, 1);
        memset(mem, 0, 1 << 20);

        ck_assert_int_eq(feature_acquire(c, "../../img", false, 0, &r, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_HIT);
        ck_assert_uint_eq(feature_cache_stats(c)->loaded, 1);
        ck_assert_uint_eq(feature_cache_stats(c)->encoder_usec_saved, 1234);
        ck_assert(epd_id_equal(&r->feature->request_id, &req));
        for (int i = 0; i < 10000; i++)
                ck_assert_uint_eq(((uint8_t *)feature_data(r->feature))[i], (uint8_t)(i * 7));
        feature_ref_release(r);
        /* evicting a loaded feature does not write it again */
        ck_assert_uint_eq(feature_cache_flush(c), 1);
        ck_assert_uint_eq(feature_cache_stats(c)->spilled, 1);
        FeaturePrefetchResult pr;
        ck_assert_int_eq(feature_prefetch(c, "../../img", 0, &pr), 0);
        ck_assert_int_eq(pr, FEATURE_PREFETCH_LOADED);
        feature_cache_free(TAKE_PTR(c));
        free(mem);
}
END_TEST

/* Evictions handed to the spill thread: the region is reused at once, the file appears
 * when the thread has written it, the queue is bounded, and a later miss loads it. */
START_TEST(test_spill_thread) {
        _cleanup_(feature_store_freep) FeatureStore *s = store_open();
        FeatureCacheConfig cfg = { .budget_bytes = 8 * 4096 };
        _cleanup_(feature_cache_freep) FeatureCache *c = NULL;
        uint8_t *mem = calloc(1, 16 * 4096);
        FeatureSpiller *sp;
        FeatureSpillerStats st;
        FeatureAcquireResult res;
        FeatureRef *r;
        char key[16];

        ck_assert_int_eq(feature_cache_new(&cfg, &c), 0);
        ck_assert_int_eq(feature_cache_add_arena(c, 0, mem, 0, 16 * 4096, 4096), 0);
        ck_assert_int_eq(feature_spiller_new(s, 3 * 4096, &sp), 0);
        feature_cache_set_store(c, s);
        feature_cache_set_spill(c, feature_spiller_queue, sp);
        for (int i = 0; i < 40; i++) {
                FeatureDesc *d = desc_bytes(4096);
                snprintf(key, sizeof key, "t%d", i);
                ck_assert_int_eq(feature_reserve(c, key, 4096, &d, NULL, &r, NULL), 0);
                memset(feature_data(r->feature), i, 4096);
                ck_assert_int_eq(feature_publish(r, 1), 0);
                feature_ref_release(r);
        }
        feature_spiller_flush(sp);
        feature_spiller_stats(sp, &st);
        ck_assert_uint_eq(st.pending_bytes, 0);
        ck_assert_uint_eq(st.queued, st.written + st.failed);
        ck_assert_uint_eq(st.failed, 0);
        ck_assert_uint_eq(st.queued + st.dropped, feature_cache_stats(c)->evictions);
        ck_assert_uint_eq(st.queued, feature_cache_stats(c)->spilled);
        ck_assert_uint_gt(st.written, 0);
        /* t0 was evicted first and written: it comes back with its bytes */
        ck_assert_int_eq(feature_acquire(c, "t0", false, 0, &r, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_HIT);
        for (int i = 0; i < 4096; i++)
                ck_assert_uint_eq(((uint8_t *)feature_data(r->feature))[i], 0);
        feature_ref_release(r);
        feature_cache_free(TAKE_PTR(c));
        feature_spiller_free(sp);
        free(mem);
}
END_TEST

/* A reader that found its file damaged removes it only while the name still holds
 * that file: a copy that a save has renamed into place since is kept, with its index
 * entry. A damaged header found by a lookup acts likewise on the file it read. */
START_TEST(test_remove_the_file_read) {
        _cleanup_(feature_desc_freep) FeatureDesc *d = desc_bytes(1000);
        char buf[1000] = {};
        FeatureStore *s = store_open();
        FeatureStoreEntry e = { .fd = -EBADF };

        ck_assert_int_eq(feature_store_save(s, &(FeatureStoreRecord){ .key = "a", .size = 1000, .desc = d }, buf), 0);
        ck_assert_int_eq(feature_store_lookup(s, "a", &e), 0);
        ino_t read = e.ino;
        feature_store_entry_done(&e);
        ck_assert_uint_ne(read, 0);
        /* a new copy saved meanwhile (a new file renamed over the name) */
        ck_assert_int_eq(feature_store_save(s, &(FeatureStoreRecord){ .key = "a", .size = 1000, .desc = d }, buf), 0);
        ck_assert_int_eq(feature_store_remove_file(s, "a", read), -ESTALE);
        ck_assert(feature_store_has(s, "a", NULL));
        ck_assert_int_eq(feature_store_lookup(s, "a", &e), 0);
        ck_assert_uint_ne(e.ino, read);
        read = e.ino;
        feature_store_entry_done(&e);
        ck_assert_int_eq(feature_store_remove_file(s, "a", read), 0);
        ck_assert(!feature_store_has(s, "a", NULL));
        ck_assert_int_eq(count_entries(root), 0);
        feature_store_free(s);
}
END_TEST

/* Flips bit `bit` of the byte at off in path. */
static void flip_bit(const char *path, off_t off, unsigned bit) {
        uint8_t b;
        int fd = open(path, O_RDWR | O_CLOEXEC);
        ck_assert_int_ge(fd, 0);
        ck_assert_int_eq(pread(fd, &b, 1, off), 1);
        b ^= (uint8_t)(1u << bit);
        ck_assert_int_eq(pwrite(fd, &b, 1, off), 1);
        close(fd);
}

/* A bit flipped on disk in a stored descriptor (a shape that still parses, but is not
 * the one published) or header (the request id, the encoder time) is refused and the
 * file removed: never handed out as a hit with a wrong tensor layout. The header's
 * checksum covers header, key and descriptor (the data's CRC32C, the data). */
START_TEST(test_damaged_descriptor) {
        _cleanup_(feature_store_freep) FeatureStore *s = store_open();
        _cleanup_(feature_desc_freep) FeatureDesc *d = desc_bytes(1000);
        uint8_t data[1000] = {};
        char name[FEATURE_STORE_NAME_MAX], path[256];
        FeatureStoreEntry e = { .fd = -EBADF };
        /* The descriptor after header and key: "EPDFDESC" u32 version u32 n_tensors, then
         * tensor 0: u8 name_len, "x", u8 dtype, u8 rank, u16 0, u64 offset, u64 shape[0]. */
        const off_t shape = 64 + (off_t)strlen("shape") + 16 + 1 + 1 + 1 + 1 + 2 + 8;
        const struct { const char *key; off_t off; unsigned bit; } cases[] = {
                { "shape", shape, 3 },             /* shape 1000 -> 992: parses, within the bytes */
                { "shape", shape + 1, 0 },         /* 1000 -> 744 */
                { "shape", 64 + 5 + 16 + 2, 0 },   /* dtype u8 -> i8: same size, parses */
                { "shape", 32, 0 },                /* the request id */
                { "shape", 48, 5 },                /* the encoder time */
                { "shape", 64 + 5 + 16 + 1, 1 },   /* the tensor's name: "x" -> "z" */
        };

        for (size_t i = 0; i < ELEMENTSOF(cases); i++) {
                ck_assert_int_eq(feature_store_save(s, &(FeatureStoreRecord){ .key = cases[i].key, .size = sizeof data,
                                                                              .desc = d, .encode_usec = 77 },
                                                    data), 0);
                ck_assert_int_eq(feature_store_name(cases[i].key, name), 0);
                snprintf(path, sizeof path, "%s/%s", root, name);
                flip_bit(path, cases[i].off, cases[i].bit);
                int r = feature_store_lookup(s, cases[i].key, &e);
                if (r >= 0) {
                        ck_abort_msg("case %zu: a damaged copy was a hit (shape %llu, dtype %d, encoder %llu)", i,
                                     (unsigned long long)e.desc->tensors[0].shape[0], (int)e.desc->tensors[0].dtype,
                                     (unsigned long long)e.encode_usec);
                }
                ck_assert_int_eq(r, -EBADMSG);
                ck_assert_msg(access(path, F_OK) < 0 && errno == ENOENT, "case %zu: the damaged file stays", i);
                ck_assert(!feature_store_has(s, cases[i].key, NULL));
        }
        /* Undamaged, it is read back whole, its data checked. */
        ck_assert_int_eq(feature_store_save(s, &(FeatureStoreRecord){ .key = "shape", .size = sizeof data, .desc = d },
                                            data), 0);
        ck_assert_int_eq(feature_store_lookup(s, "shape", &e), 0);
        ck_assert_uint_eq(e.desc->tensors[0].shape[0], 1000);
        uint8_t back[1000];
        ck_assert_int_eq(feature_store_entry_read(&e, back), 0);
        feature_store_entry_done(&e);
}
END_TEST

/* A file of the older store format (2: a checksum over the data alone, the header's
 * last 8 bytes zero) is a miss, and removed: the store is a cache. Through the cache,
 * an Acquire that may produce is told to produce. */
START_TEST(test_older_format_is_a_miss) {
        _cleanup_(feature_store_freep) FeatureStore *s = store_open();
        FeatureCacheConfig cfg = { .budget_bytes = 1 << 20 };
        _cleanup_(feature_cache_freep) FeatureCache *c = NULL;
        _cleanup_(feature_desc_freep) FeatureDesc *d = desc_bytes(1000);
        uint8_t data[1000] = {}, zero[8] = {}, v2[4] = { 2, 0, 0, 0 };
        char name[FEATURE_STORE_NAME_MAX], path[256];
        FeatureStoreEntry e = { .fd = -EBADF };
        FeatureAcquireResult res;
        FeatureRef *r;

        for (int i = 0; i < 2; i++) {
                const char *key = i == 0 ? "old" : "old-cached";
                ck_assert_int_eq(feature_store_save(s, &(FeatureStoreRecord){ .key = key, .size = sizeof data, .desc = d },
                                                    data), 0);
                ck_assert_int_eq(feature_store_name(key, name), 0);
                snprintf(path, sizeof path, "%s/%s", root, name);
                int fd = open(path, O_WRONLY | O_CLOEXEC);
                ck_assert_int_ge(fd, 0);
                ck_assert_int_eq(pwrite(fd, v2, sizeof v2, 8), (ssize_t)sizeof v2); /* version 2 */
                ck_assert_int_eq(pwrite(fd, zero, sizeof zero, 56), (ssize_t)sizeof zero); /* its padding */
                close(fd);
        }
        ck_assert_int_eq(feature_store_lookup(s, "old", &e), -EBADMSG);
        ck_assert_int_eq(feature_store_name("old", name), 0);
        snprintf(path, sizeof path, "%s/%s", root, name);
        ck_assert_int_eq(access(path, F_OK), -1);

        uint8_t *mem = calloc(1, 1 << 20);
        ck_assert_int_eq(feature_cache_new(&cfg, &c), 0);
        ck_assert_int_eq(feature_cache_add_arena(c, 0, mem, 0, 1 << 20, 4096), 0);
        feature_cache_set_store(c, s);
        ck_assert(feature_store_has(s, "old-cached", NULL));
        ck_assert_int_eq(feature_acquire(c, "old-cached", true, 0, &r, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_PRODUCE);
        ck_assert(!feature_store_has(s, "old-cached", NULL));
        ck_assert_int_eq(count_entries(root), 0);
        feature_ref_release(r);
        feature_cache_free(TAKE_PTR(c));
        free(mem);
}
END_TEST

/* The spill queue's bound can change while it runs (a reload of CacheSize=): a feature
 * past the new bound is dropped, one within it queued; what is queued stays. */
START_TEST(test_spill_bound_changes) {
        _cleanup_(feature_store_freep) FeatureStore *s = store_open();
        FeatureCacheConfig cfg = { .budget_bytes = 4 * 4096 };
        _cleanup_(feature_cache_freep) FeatureCache *c = NULL;
        uint8_t *mem = calloc(1, 16 * 4096);
        FeatureSpiller *sp;
        FeatureSpillerStats st;
        FeatureRef *r;
        char key[16];

        ck_assert_int_eq(feature_cache_new(&cfg, &c), 0);
        ck_assert_int_eq(feature_cache_add_arena(c, 0, mem, 0, 16 * 4096, 4096), 0);
        ck_assert_int_eq(feature_spiller_new(s, 0, &sp), 0); /* nothing fits */
        feature_cache_set_store(c, s);
        feature_cache_set_spill(c, feature_spiller_queue, sp);
        for (int i = 0; i < 12; i++) {
                if (i == 6)
                        feature_spiller_set_max_pending(sp, 64 * 4096);
                FeatureDesc *d = desc_bytes(4096);
                snprintf(key, sizeof key, "b%d", i);
                ck_assert_int_eq(feature_reserve(c, key, 4096, &d, NULL, &r, NULL), 0);
                ck_assert_int_eq(feature_publish(r, 1), 0);
                feature_ref_release(r);
        }
        feature_spiller_flush(sp);
        feature_spiller_stats(sp, &st);
        /* b0..b7 evicted: b0, b1 with a bound of 0 (dropped), b2..b7 with room for 64 */
        ck_assert_uint_eq(feature_cache_stats(c)->evictions, 8);
        ck_assert_uint_eq(st.dropped, 2);
        ck_assert_uint_eq(st.queued, 6);
        ck_assert_uint_eq(st.written, 6);
        ck_assert(!feature_store_has(s, "b1", NULL));
        ck_assert(feature_store_has(s, "b2", NULL));
        feature_cache_free(TAKE_PTR(c));
        feature_spiller_free(sp);
        free(mem);
}
END_TEST

int main(void) {
        Suite *s = suite_create("feature-store");
        TCase *tc = tcase_create("feature-store");
        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_add_test(tc, test_names_are_confined);
        tcase_add_test(tc, test_evil_keys_round_trip_inside);
        tcase_add_test(tc, test_openat_beneath);
        tcase_add_test(tc, test_planted_symlink);
        tcase_add_test(tc, test_planted_fifo);
        tcase_add_test(tc, test_bad_files);
        tcase_add_test(tc, test_bounded);
        tcase_add_test(tc, test_index);
        tcase_add_test(tc, test_header_only_file_removed);
        tcase_add_test(tc, test_remove_the_file_read);
        tcase_add_test(tc, test_cache_spill_load);
        tcase_add_test(tc, test_spill_thread);
        tcase_add_test(tc, test_damaged_descriptor);
        tcase_add_test(tc, test_older_format_is_a_miss);
        tcase_add_test(tc, test_spill_bound_changes);
        suite_add_tcase(s, tc);
        return check_run(s, CK_NOFORK);
}
