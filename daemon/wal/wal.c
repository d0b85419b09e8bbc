/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "crc32c.h"
#include "log.h"
#include "macro.h"
#include "time-util.h"
#include "unaligned.h"
#include "wal/wal.h"

#define WAL_LOG_NAME "wal.log"
#define WAL_SNAPSHOT_NAME "wal.snapshot"
#define WAL_LOG_TMP "wal.log.tmp"
#define WAL_SNAPSHOT_TMP "wal.snapshot.tmp"
#define WAL_FILE_MAX ((uint64_t)1 << 36) /* refuse to slurp anything larger */

struct Wal {
        char *dir;
        int dir_fd;
        int fd;              /* wal.log, written at `end` */
        WalSyncPolicy policy;
        bool replayed;
        bool broken;         /* a compaction lost the log fd, or records that failed could
                              * not be cut off: refuse appends */
        uint64_t cut_at;     /* records that failed lie past this offset, uncut (0: none) */
        uint64_t base_lsn;   /* of the current log file */
        uint64_t last_lsn;   /* last appended */
        uint64_t synced_lsn;
        uint64_t synced_end;  /* the log's size up to synced_lsn */
        uint64_t end;        /* bytes of records (and the header) in wal.log */
        uint64_t alloc;      /* the file's size: [end, alloc) is zeros written ahead */
        void *buf;           /* encode buffer */
        size_t buf_size;
        WalStats stats;
        void *userdata;
};

struct WalSnapshot {
        int fd;              /* -EBADF: into memory (mem) instead */
        uint64_t lsn;        /* records in the snapshot are numbered 1.. */
        uint64_t offset;
        void *buf;
        size_t buf_size;
        uint8_t *mem;        /* the whole file image when building in memory */
        size_t mem_size, mem_cap;
};

/* ---- records ---- */

size_t wal_record_size(size_t payload_len) {
        return WAL_RECORD_HEADER_SIZE + ALIGN_TO(payload_len, 8);
}

static uint32_t record_crc(const uint8_t *rec, size_t len) {
        /* Everything but the CRC field itself: length, then lsn..payload. */
        uint32_t c = crc32c(0, rec, 4);
        return crc32c(c, rec + 8, WAL_RECORD_HEADER_SIZE - 8 + len);
}

void wal_record_encode(void *buf, uint64_t lsn, uint16_t type, const void *payload, size_t len) {
        uint8_t *p = buf;
        size_t padded = ALIGN_TO(len, 8);

        unaligned_write_le32(p, (uint32_t)len);
        unaligned_write_le64(p + 8, lsn);
        unaligned_write_le16(p + 16, type);
        unaligned_write_le16(p + 18, 0);
        unaligned_write_le32(p + 20, 0);
        if (len > 0)
                memcpy(p + WAL_RECORD_HEADER_SIZE, payload, len);
        memset(p + WAL_RECORD_HEADER_SIZE + len, 0, padded - len);
        unaligned_write_le32(p + 4, record_crc(p, len));
}

int wal_record_parse(const void *buf, size_t n, WalRecord *ret, size_t *ret_size) {
        const uint8_t *p = buf;
        uint32_t len;
        size_t size;

        if (n < WAL_RECORD_HEADER_SIZE)
                return -EAGAIN;
        len = unaligned_read_le32(p);
        if (len > WAL_RECORD_PAYLOAD_MAX)
                return -EBADMSG;
        size = wal_record_size(len);
        if (n < size)
                return -EAGAIN;
        if (record_crc(p, len) != unaligned_read_le32(p + 4))
                return -EBADMSG;
        /* Covered by the CRC, but a writer never sets them: refuse what we did not write. */
        if (unaligned_read_le16(p + 18) != 0 || unaligned_read_le32(p + 20) != 0)
                return -EBADMSG;
        for (size_t i = len; i < ALIGN_TO(len, 8); i++)
                if (p[WAL_RECORD_HEADER_SIZE + i] != 0)
                        return -EBADMSG;

        *ret = (WalRecord){
                .lsn = unaligned_read_le64(p + 8),
                .type = unaligned_read_le16(p + 16),
                .flags = unaligned_read_le16(p + 18),
                .length = len,
                .payload = p + WAL_RECORD_HEADER_SIZE,
        };
        *ret_size = size;
        return 0;
}

void wal_file_header_encode(void *buf, const WalFileHeader *h) {
        uint8_t *p = buf;

        memcpy(p, WAL_FILE_MAGIC, 8);
        unaligned_write_le32(p + 8, WAL_FILE_VERSION);
        unaligned_write_le32(p + 12, (uint32_t)h->kind);
        unaligned_write_le64(p + 16, h->base_lsn);
        unaligned_write_le64(p + 24, h->created_usec);
        unaligned_write_le32(p + 32, 0);
        unaligned_write_le32(p + 36, crc32c(0, p, 36));
}

int wal_file_header_parse(const void *buf, size_t n, WalFileHeader *ret) {
        const uint8_t *p = buf;
        uint32_t kind;

        if (n < WAL_FILE_HEADER_SIZE)
                return -EBADMSG;
        if (memcmp(p, WAL_FILE_MAGIC, 8) != 0 || crc32c(0, p, 36) != unaligned_read_le32(p + 36))
                return -EBADMSG;
        if (unaligned_read_le32(p + 8) != WAL_FILE_VERSION)
                return -EPROTONOSUPPORT;
        kind = unaligned_read_le32(p + 12);
        if ((kind != WAL_FILE_LOG && kind != WAL_FILE_SNAPSHOT) || unaligned_read_le32(p + 32) != 0)
                return -EBADMSG;
        *ret = (WalFileHeader){
                .kind = (WalFileKind)kind,
                .base_lsn = unaligned_read_le64(p + 16),
                .created_usec = unaligned_read_le64(p + 24),
        };
        return 0;
}

int wal_parse_buffer(const void *buf, size_t n, uint64_t skip_through, WalApplyFn apply,
                     void *userdata, bool from_snapshot, WalParseResult *result) {
        const uint8_t *p = buf;
        size_t off;
        int r;

        *result = (WalParseResult){};
        r = wal_file_header_parse(buf, n, &result->header);
        if (r < 0)
                return r;
        off = WAL_FILE_HEADER_SIZE;
        /* Log records continue the LSNs after base_lsn; a snapshot numbers its own from 1. */
        result->last_lsn = from_snapshot ? 0 : result->header.base_lsn;
        result->good_bytes = off;

        while (off < n) {
                WalRecord rec;
                size_t size;

                r = wal_record_parse(p + off, n - off, &rec, &size);
                if (r < 0) {
                        result->tail = r;
                        break;
                }
                if (rec.lsn != result->last_lsn + 1 || result->ended) {
                        /* (nothing follows a snapshot's end) */
                        result->tail = -EBADMSG;
                        break;
                }
                if (rec.type == WAL_RECORD_SNAPSHOT_END &&
                    (!from_snapshot || rec.length != 8 || unaligned_read_le64(rec.payload) != result->records)) {
                        result->tail = -EBADMSG;
                        break;
                }
                if (apply && rec.lsn > skip_through && rec.type != WAL_RECORD_SNAPSHOT_END) {
                        r = apply(userdata, &rec, from_snapshot);
                        if (r < 0)
                                /* The caller's own failure, never a damaged file (which
                                 * these two codes mean to wal_replay()). */
                                return r == -EBADMSG || r == -EPROTONOSUPPORT ? -EIO : r;
                }
                result->ended = rec.type == WAL_RECORD_SNAPSHOT_END;
                result->records++;
                result->last_lsn = rec.lsn;
                off += size;
                result->good_bytes = off;
        }
        return 0;
}

static const char *const sync_policy_table[_WAL_SYNC_POLICY_MAX] = {
        [WAL_SYNC_ALWAYS] = "always",
        [WAL_SYNC_BATCH] = "batch",
        [WAL_SYNC_NONE] = "none",
};

const char *wal_sync_policy_to_string(WalSyncPolicy p) {
        return p >= 0 && p < _WAL_SYNC_POLICY_MAX ? sync_policy_table[p] : NULL;
}

int wal_sync_policy_from_string(const char *s) {
        for (int i = 0; s && i < _WAL_SYNC_POLICY_MAX; i++)
                if (strcmp(s, sync_policy_table[i]) == 0)
                        return i;
        return -EINVAL;
}

const char *wal_record_type_to_string(uint16_t type) {
        switch (type >> 8) {
        case 0x00:
                return type == WAL_RECORD_SNAPSHOT_END ? "snapshot-end" : "unknown";
        case WAL_RECORD_WORKFLOW >> 8:
                return "workflow";
        case WAL_RECORD_DIRECTORY >> 8:
                return "directory";
        case WAL_RECORD_HANDOFF >> 8:
                return "handoff";
        case WAL_RECORD_SEQUENCE >> 8:
                return "sequence";
        case WAL_RECORD_FEATURE >> 8:
                return "feature";
        case WAL_RECORD_TEST >> 8:
                return "test";
        default:
                return "unknown";
        }
}

/* ---- files ---- */

/* All n bytes, at `off` (pwrite), or at the file position when off < 0 (write). */
static int write_at(int fd, const void *buf, size_t n, int64_t off) {
        const uint8_t *p = buf;

        while (n > 0) {
                ssize_t k = off < 0 ? write(fd, p, n) : pwrite(fd, p, n, (off_t)off);
                if (k < 0) {
                        if (errno == EINTR)
                                continue;
                        return -errno;
                }
                if (k == 0)
                        return -EIO;
                p += k;
                n -= (size_t)k;
                if (off >= 0)
                        off += k;
        }
        return 0;
}

static int write_all(int fd, const void *buf, size_t n) {
        return write_at(fd, buf, n, -1);
}

static int pwrite_all(int fd, const void *buf, size_t n, uint64_t off) {
        return write_at(fd, buf, n, (int64_t)off);
}

static bool all_zero(const uint8_t *p, size_t n) {
        for (size_t i = 0; i < n; i++)
                if (p[i] != 0)
                        return false;
        return true;
}

/* Records are written over zeros written ahead, WAL_PREALLOC bytes at a time: a
 * record's fdatasync then flushes its data only, with no change of the file's size or
 * blocks to journal (the file system's journal commit would double its cost). Replay
 * reads the zeros after the last record as the end of the log, not as damage. */
#define WAL_PREALLOC ((uint64_t)1 << 20)

static int log_reserve(Wal *w, size_t n) {
        static const uint8_t zeros[65536];
        if (w->end + n <= w->alloc)
                return 0;
        uint64_t want = ALIGN_TO(w->end + n, WAL_PREALLOC);
        for (uint64_t off = MAX(w->alloc, w->end); off < want;) {
                size_t k = (size_t)MIN(want - off, (uint64_t)sizeof zeros);
                int r = pwrite_all(w->fd, zeros, k, off);
                if (r < 0)
                        return r;
                off += k;
                w->alloc = off;
        }
        return 0;
}

/* Records from offset `at` on, which their callers hear failed, could not be cut off
 * the file: no record is taken after them (a later sync would make them durable, and a
 * restart replay them), the first one's header is zeroed where the disk allows (a
 * replay stops there), and a close tries the cut again instead of syncing them. */
static void cut_failed(Wal *w, uint64_t at) {
        static const uint8_t zeros[WAL_RECORD_HEADER_SIZE] = {};

        w->broken = true;
        w->cut_at = at;
        if (pwrite_all(w->fd, zeros, sizeof zeros, at) >= 0)
                (void)fdatasync(w->fd);
        log_error("WAL: records that failed could not be cut off at offset %" PRIu64
                  "; no more records are taken until a restart.", at);
}

/* n bytes of records at the end of the log. A failure leaves no part of them behind a
 * later good record: the file is cut back to the records before them. */
static int log_write(Wal *w, const void *p, size_t n) {
        /* Zeros that cannot be written ahead (a full disk) are no reason to refuse a
         * record that fits: it is written at the end all the same, as an append. */
        if (log_reserve(w, n) < 0)
                log_debug("WAL: cannot write zeros ahead of the log; writing the record without.");
        int r = pwrite_all(w->fd, p, n, w->end);
        if (r < 0) {
                if (ftruncate(w->fd, (off_t)w->end) < 0) {
                        log_error_errno(errno, "Failed to cut a failed WAL write: %m");
                        cut_failed(w, w->end); /* whole records of it may have landed */
                } else
                        w->alloc = w->end;
                return log_error_errno(r, "Failed to append to the WAL: %m");
        }
        w->end += n;
        w->alloc = MAX(w->alloc, w->end); /* written past the zeros: they end here now */
        return 0;
}

static int read_file_at(int dir_fd, const char *name, void **ret, size_t *ret_size) {
        _cleanup_(closep) int fd = -EBADF;
        _cleanup_(freep) uint8_t *buf = NULL;
        struct stat st;
        size_t got = 0;

        fd = openat(dir_fd, name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
        if (fd < 0)
                return -errno;
        if (fstat(fd, &st) < 0)
                return -errno;
        if (!S_ISREG(st.st_mode))
                return -EBADFD;
        if ((uint64_t)st.st_size > WAL_FILE_MAX)
                return -EFBIG;
        buf = malloc(st.st_size > 0 ? (size_t)st.st_size : 1);
        if (!buf)
                return -ENOMEM;
        while (got < (size_t)st.st_size) {
                ssize_t k = read(fd, buf + got, (size_t)st.st_size - got);
                if (k < 0) {
                        if (errno == EINTR)
                                continue;
                        return -errno;
                }
                if (k == 0)
                        break;
                got += (size_t)k;
        }
        *ret = TAKE_PTR(buf);
        *ret_size = got;
        return 0;
}

static int ensure_buf(void **buf, size_t *size, size_t need) {
        void *p;

        if (*size >= need)
                return 0;
        need = MAX(need, (size_t)4096);
        p = realloc(*buf, need);
        if (!p)
                return -ENOMEM;
        *buf = p;
        *size = need;
        return 0;
}

/* Writes a fresh file with only a header, durably, and renames it into place. */
static int create_file_atomic(int dir_fd, const char *tmp, const char *name, WalFileKind kind,
                              uint64_t base_lsn) {
        _cleanup_(closep) int fd = -EBADF;
        uint8_t hdr[WAL_FILE_HEADER_SIZE];
        int r;

        fd = openat(dir_fd, tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
        if (fd < 0)
                return -errno;
        wal_file_header_encode(hdr, &(WalFileHeader){ .kind = kind, .base_lsn = base_lsn,
                                                      .created_usec = now_usec(CLOCK_REALTIME) });
        r = write_all(fd, hdr, sizeof hdr);
        if (r < 0)
                return r;
        if (fsync(fd) < 0)
                return -errno;
        if (renameat(dir_fd, tmp, dir_fd, name) < 0)
                return -errno;
        if (fsync(dir_fd) < 0)
                return -errno;
        return 0;
}

/* Makes the entry of `path` in its parent durable (fsync of the parent directory). */
static int fsync_parent(const char *path) {
        _cleanup_(freep) char *copy = strdup(path);
        if (!copy)
                return -ENOMEM;
        _cleanup_(closep) int fd = open(dirname(copy), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (fd < 0 || fsync(fd) < 0)
                return -errno;
        return 0;
}

int wal_open(const char *dir, WalSyncPolicy policy, Wal **ret) {
        _cleanup_(wal_freep) Wal *w = NULL;
        int r;

        if (!dir || policy < 0 || policy >= _WAL_SYNC_POLICY_MAX)
                return -EINVAL;
        if (mkdir(dir, 0700) < 0 && errno != EEXIST)
                return log_error_errno(errno, "Failed to create WAL directory %s: %m", dir);
        /* The log's own directory is synced with its files; its entry, and the state
         * directory's (made by epdd or by systemd's StateDirectory=, neither syncing it),
         * are synced here, at every start (two directory syncs), or a power loss after
         * the first acknowledged record could take the whole directory with it. */
        _cleanup_(freep) char *parent = strdup(dir);
        if (!parent)
                return -ENOMEM;
        r = fsync_parent(dir);
        if (r >= 0)
                r = fsync_parent(dirname(parent));
        if (r == -EACCES || r == -EPERM)
                /* A parent epdd may not open (0711, another owner's): the start goes on. */
                log_warning_errno(r, "Cannot sync the directories above %s (%m): a power loss right after the "
                                     "first start may lose the WAL directory's entry.", dir);
        else if (r < 0 && r != -EINVAL && r != -EROFS)
                return log_error_errno(r, "Failed to sync the directories above %s: %m", dir);

        w = calloc(1, sizeof *w);
        if (!w)
                return -ENOMEM;
        w->fd = w->dir_fd = -EBADF;
        w->policy = policy;
        w->dir = strdup(dir);
        if (!w->dir)
                return -ENOMEM;
        w->dir_fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (w->dir_fd < 0)
                return log_error_errno(errno, "Failed to open WAL directory %s: %m", dir);
        /* Leftovers of a compaction that crashed before its rename are garbage. */
        (void)unlinkat(w->dir_fd, WAL_LOG_TMP, 0);
        (void)unlinkat(w->dir_fd, WAL_SNAPSHOT_TMP, 0);
        *ret = TAKE_PTR(w);
        return 0;
}

Wal *wal_free(Wal *w) {
        if (!w)
                return NULL;
        if (w->fd >= 0 && w->cut_at > 0) {
                /* Never synced: their callers heard they failed. Synced only once cut
                 * off: a sync of a file still holding them would make them durable. */
                if (ftruncate(w->fd, (off_t)w->cut_at) >= 0) {
                        w->end = w->alloc = w->cut_at;
                        (void)fdatasync(w->fd);
                }
        } else if (w->fd >= 0 && w->policy != WAL_SYNC_NONE && w->synced_lsn < w->last_lsn)
                (void)fdatasync(w->fd);
        /* A clean close leaves the records alone in the file, without the zeros written
         * ahead (replay would take them for the end of the log all the same). */
        if (w->fd >= 0 && w->alloc > w->end)
                (void)!ftruncate(w->fd, (off_t)w->end);
        safe_close(w->fd);
        safe_close(w->dir_fd);
        free(w->buf);
        free(w->dir);
        free(w);
        return NULL;
}

/* end: where the records stop (a replayed log may have zeros written ahead after them);
 * UINT64_MAX: at the end of the file. */
static int open_log_for_append(Wal *w, uint64_t end) {
        struct stat st;

        w->fd = safe_close(w->fd);
        w->fd = openat(w->dir_fd, WAL_LOG_NAME, O_WRONLY | O_CLOEXEC | O_NOFOLLOW);
        if (w->fd < 0)
                return -errno;
        if (fstat(w->fd, &st) < 0)
                return -errno;
        w->alloc = (uint64_t)st.st_size;
        w->end = MIN(end, w->alloc);
        w->stats.log_bytes = w->end;
        return 0;
}

/* Well-formed records after a damaged one, in the bytes a replay is about to cut: their
 * number and the last one's LSN. A torn tail has none (the batch being written when the
 * daemon died, whose later records can only be ones no sync covered, and zeros written
 * ahead); damage in the middle of the log does: those records may have been
 * acknowledged. Cheap tests first (the header's zero fields, an LSN past the last good
 * one), so that garbage costs no CRC at every offset. The CRCs are bounded too
 * (DAMAGE_SCAN_BUDGET): bytes crafted to pass the cheap tests every 24 bytes, each
 * claiming a payload of 1 MiB, would otherwise cost ~44000 times their size of CRC
 * (days for a log of a GiB) before the daemon starts. Past the bound *ret_incomplete is
 * set and the scan stops: what follows is not known to hold no records, so the caller
 * keeps the bytes as if it did. */
#define DAMAGE_SCAN_BUDGET(n) (2 * (uint64_t)(n) + 2 * (uint64_t)WAL_RECORD_PAYLOAD_MAX)
static uint64_t records_after_damage(const uint8_t *p, size_t n, uint64_t last_lsn, uint64_t *ret_lsn,
                                     bool *ret_incomplete) {
        uint64_t found = 0, budget = DAMAGE_SCAN_BUDGET(n);
        *ret_incomplete = false;
        /* A zeroed header is where the writer cut records whose callers heard they failed
         * and whose cut the file system refused (cut_failed()): the end, not damage. */
        if (n >= WAL_RECORD_HEADER_SIZE && all_zero(p, WAL_RECORD_HEADER_SIZE))
                return 0;
        for (size_t off = 8; off + WAL_RECORD_HEADER_SIZE <= n;) {
                const uint8_t *q = p + off;
                uint64_t lsn = unaligned_read_le64(q + 8);
                uint32_t len = unaligned_read_le32(q);
                WalRecord rec;
                size_t size;
                if (unaligned_read_le32(q + 20) == 0 && unaligned_read_le16(q + 18) == 0 && lsn > last_lsn &&
                    lsn - last_lsn <= n / WAL_RECORD_HEADER_SIZE + 1 && len <= WAL_RECORD_PAYLOAD_MAX &&
                    wal_record_size(len) <= n - off) {
                        /* wal_record_parse() CRCs the header and the payload. */
                        if (wal_record_size(len) > budget) {
                                *ret_incomplete = true;
                                break;
                        }
                        budget -= wal_record_size(len);
                        if (wal_record_parse(q, n - off, &rec, &size) == 0) {
                                found++;
                                *ret_lsn = rec.lsn;
                                off += size;
                                continue;
                        }
                }
                off += 8;
        }
        return found;
}

/* Keeps the bytes a replay cuts when well-formed records follow the damage, as
 * wal.log.cut-LSN (LSN: the last good record's) in the WAL directory, synced: the
 * changes they hold are not replayed, but they are not destroyed either. */
static int keep_cut_bytes(Wal *w, const void *p, size_t n, uint64_t last_lsn, char *name, size_t name_size) {
        for (unsigned i = 0; i < 100; i++) {
                if (i == 0)
                        snprintf(name, name_size, WAL_LOG_NAME ".cut-%" PRIu64, last_lsn);
                else
                        snprintf(name, name_size, WAL_LOG_NAME ".cut-%" PRIu64 ".%u", last_lsn, i);
                _cleanup_(closep) int fd =
                        openat(w->dir_fd, name, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
                if (fd < 0 && errno == EEXIST)
                        continue;
                if (fd < 0)
                        return -errno;
                int r = write_all(fd, p, n);
                if (r < 0)
                        return r;
                if (fsync(fd) < 0 || fsync(w->dir_fd) < 0)
                        return -errno;
                return 0;
        }
        return -EEXIST;
}

/* The log's tail from pr->good_bytes on is damaged (torn or corrupt): counted, kept
 * aside when records may follow the damage (keep_cut_bytes()), then cut. */
static int cut_damaged_tail(Wal *w, const void *log, size_t log_size, const WalParseResult *pr) {
        _cleanup_(closep) int fd = -EBADF;
        int r;

        if (pr->tail == -EAGAIN)
                w->stats.torn++;
        else
                w->stats.corrupt++;
        w->stats.cut_bytes = log_size - pr->good_bytes;
        uint64_t after_lsn = 0;
        const uint8_t *cut = (const uint8_t *)log + pr->good_bytes;
        bool incomplete;
        w->stats.cut_records = records_after_damage(cut, log_size - pr->good_bytes, pr->last_lsn,
                                                    &after_lsn, &incomplete);
        w->stats.cut_scan_incomplete = incomplete;
        if (w->stats.cut_records > 0 || incomplete) {
                char name[64];
                r = keep_cut_bytes(w, cut, log_size - pr->good_bytes, pr->last_lsn, name, sizeof name);
                if (r < 0)
                        return log_error_errno(r, "WAL %s/%s is damaged after LSN %" PRIu64
                                               ", with %" PRIu64 " well-formed records after the "
                                               "damage, and they cannot be kept aside (%m): "
                                               "refusing to cut them.",
                                               w->dir, WAL_LOG_NAME, pr->last_lsn,
                                               w->stats.cut_records);
                if (incomplete)
                        log_error("WAL %s/%s is damaged after LSN %" PRIu64 ": the %zu bytes "
                                  "after the damage were not all examined (the scan for "
                                  "well-formed records stopped at its bound, %" PRIu64
                                  " found), and nothing after the damage is replayed; changes "
                                  "they hold may have been acknowledged. The cut bytes are kept "
                                  "in %s/%s.",
                                  w->dir, WAL_LOG_NAME, pr->last_lsn, log_size - pr->good_bytes,
                                  w->stats.cut_records, w->dir, name);
                else
                        log_error("WAL %s/%s is damaged after LSN %" PRIu64 ": %" PRIu64
                                  " well-formed records (up to LSN %" PRIu64 ") follow the damage "
                                  "and are not replayed; changes they hold may have been "
                                  "acknowledged. The cut bytes are kept in %s/%s.",
                                  w->dir, WAL_LOG_NAME, pr->last_lsn, w->stats.cut_records,
                                  after_lsn, w->dir, name);
        }
        log_warning("WAL %s/%s: %s record at byte %zu after LSN %" PRIu64
                    "; cutting %zu bytes.",
                    w->dir, WAL_LOG_NAME, pr->tail == -EAGAIN ? "torn" : "corrupt",
                    pr->good_bytes, pr->last_lsn, log_size - pr->good_bytes);
        fd = openat(w->dir_fd, WAL_LOG_NAME, O_WRONLY | O_CLOEXEC | O_NOFOLLOW);
        if (fd < 0 || ftruncate(fd, (off_t)pr->good_bytes) < 0 || fsync(fd) < 0)
                return log_error_errno(errno, "Failed to cut %s/%s: %m", w->dir,
                                       WAL_LOG_NAME);
        return 0;
}

int wal_replay(Wal *w, WalApplyFn apply, void *userdata) {
        _cleanup_(freep) void *snap = NULL, *log = NULL;
        size_t snap_size = 0, log_size = 0;
        uint64_t snap_lsn = 0;
        WalParseResult pr;
        bool have_log;
        int r;

        if (w->replayed)
                return -EBUSY;

        r = read_file_at(w->dir_fd, WAL_SNAPSHOT_NAME, &snap, &snap_size);
        if (r >= 0) {
                r = wal_parse_buffer(snap, snap_size, 0, apply, userdata, true, &pr);
                if (r < 0)
                        return log_error_errno(r, "WAL snapshot %s/%s unusable: %m", w->dir,
                                               WAL_SNAPSHOT_NAME);
                /* A snapshot is written whole and renamed into place: any flaw is real
                 * corruption, and the state it held cannot be recovered by cutting. */
                if (pr.header.kind != WAL_FILE_SNAPSHOT || pr.tail != 0 || !pr.ended)
                        return log_error_errno(EBADMSG,
                                               "WAL snapshot %s/%s is corrupt at byte %zu.",
                                               w->dir, WAL_SNAPSHOT_NAME, pr.good_bytes);
                snap_lsn = pr.header.base_lsn;
                w->stats.snapshot_records = pr.records - 1;
        } else if (r != -ENOENT)
                return log_error_errno(r, "Failed to read WAL snapshot in %s: %m", w->dir);

        r = read_file_at(w->dir_fd, WAL_LOG_NAME, &log, &log_size);
        if (r == -ENOENT)
                have_log = false;
        else if (r < 0)
                return log_error_errno(r, "Failed to read %s/%s: %m", w->dir, WAL_LOG_NAME);
        else
                have_log = true;

        /* A log is created whole (header written and synced, then renamed into place),
         * so a bad header is outside damage, or a log of a newer epdd: refused, as a
         * damaged snapshot is. Starting a new log over it would drop every acknowledged
         * change since the last compaction, silently. The file is left as it is. */
        if (have_log) {
                r = wal_parse_buffer(log, log_size, snap_lsn, apply, userdata, false, &pr);
                if (r == -EPROTONOSUPPORT)
                        return log_error_errno(r,
                                               "WAL log %s/%s was written by a newer epdd (format version above "
                                               "%u): refusing to start; start that version, or move the state "
                                               "directory aside to start without it.",
                                               w->dir, WAL_LOG_NAME, (unsigned)WAL_FILE_VERSION);
                if (r == -EBADMSG)
                        return log_error_errno(r,
                                               "WAL log %s/%s has a damaged header: refusing to start rather than "
                                               "lose the changes it holds; move it aside to start without them.",
                                               w->dir, WAL_LOG_NAME);
                if (r < 0)
                        return r;
                else if (pr.header.kind != WAL_FILE_LOG || pr.header.base_lsn > snap_lsn) {
                        /* Records between the snapshot and this log are missing. */
                        return log_error_errno(EBADMSG,
                                               "WAL log %s/%s starts at LSN %" PRIu64
                                               " but the snapshot ends at %" PRIu64 ".",
                                               w->dir, WAL_LOG_NAME, pr.header.base_lsn + 1,
                                               snap_lsn);
                }
        }

        /* An old log left by a compaction that crashed between its two renames holds
         * only records the snapshot already has: start a fresh one after it. */
        if (have_log && pr.header.base_lsn < snap_lsn && pr.last_lsn <= snap_lsn)
                have_log = false;

        if (!have_log) {
                r = create_file_atomic(w->dir_fd, WAL_LOG_TMP, WAL_LOG_NAME, WAL_FILE_LOG, snap_lsn);
                if (r < 0)
                        return log_error_errno(r, "Failed to create %s/%s: %m", w->dir, WAL_LOG_NAME);
                w->base_lsn = w->last_lsn = snap_lsn;
        } else {
                w->base_lsn = pr.header.base_lsn;
                w->last_lsn = MAX(pr.last_lsn, snap_lsn);
                w->stats.replayed = pr.last_lsn > snap_lsn ? pr.last_lsn - snap_lsn : 0;
                if (pr.good_bytes < log_size && all_zero((const uint8_t *)log + pr.good_bytes, log_size - pr.good_bytes))
                        log_debug("WAL %s/%s: %zu bytes written ahead after LSN %" PRIu64 ".", w->dir,
                                  WAL_LOG_NAME, log_size - pr.good_bytes, pr.last_lsn);
                else if (pr.good_bytes < log_size) {
                        r = cut_damaged_tail(w, log, log_size, &pr);
                        if (r < 0)
                                return r;
                }
        }

        r = open_log_for_append(w, have_log ? pr.good_bytes : UINT64_MAX);
        if (r < 0)
                return log_error_errno(r, "Failed to open %s/%s: %m", w->dir, WAL_LOG_NAME);
        /* A killed epdd may have left records in the page cache that no sync made
         * durable: the state just rebuilt from them is served from now on, so they are
         * synced before anything of it is. */
        if (w->policy != WAL_SYNC_NONE && w->last_lsn > w->base_lsn) {
                if (fdatasync(w->fd) < 0)
                        return log_error_errno(errno, "Failed to sync the replayed %s/%s: %m", w->dir,
                                               WAL_LOG_NAME);
                w->stats.syncs++;
        }
        /* The names in the directory too: a compaction killed between its rename and
         * the directory's sync leaves the new log's name in memory only, and records
         * appended to it now would be lost with that name at a power loss. */
        if (w->policy != WAL_SYNC_NONE && fsync(w->dir_fd) < 0)
                return log_error_errno(errno, "Failed to sync the WAL directory %s: %m", w->dir);
        w->synced_lsn = w->last_lsn;
        w->synced_end = w->end;
        w->replayed = true;
        return 0;
}

int wal_append(Wal *w, uint16_t type, const void *payload, size_t len, uint64_t *ret_lsn) {
        size_t size;
        int r;

        if (!w->replayed)
                return -ENOTCONN;
        if (w->broken)
                return -EIO;
        if (len > WAL_RECORD_PAYLOAD_MAX || (len > 0 && !payload) || type == WAL_RECORD_SNAPSHOT_END)
                return -EINVAL;

        size = wal_record_size(len);
        r = ensure_buf(&w->buf, &w->buf_size, size);
        if (r < 0)
                return r;
        wal_record_encode(w->buf, w->last_lsn + 1, type, payload, len);

        r = log_write(w, w->buf, size);
        if (r < 0)
                return r;
        w->last_lsn++;
        w->stats.appended++;
        w->stats.appended_bytes += size;
        w->stats.log_bytes = w->end;

        if (w->policy == WAL_SYNC_ALWAYS) {
                r = wal_sync(w);
                if (r < 0)
                        return r;
        } else if (w->policy == WAL_SYNC_NONE) {
                w->synced_lsn = w->last_lsn;
                w->synced_end = w->end;
        }

        if (ret_lsn)
                *ret_lsn = w->last_lsn;
        return 0;
}

int wal_write_encoded(Wal *w, const void *records, size_t size, uint64_t last_lsn) {
        int r;

        if (!w->replayed)
                return -ENOTCONN;
        if (w->broken)
                return -EIO;
        if (last_lsn <= w->last_lsn || size == 0)
                return -EINVAL;
        r = log_write(w, records, size);
        if (r < 0)
                return r;
        w->stats.appended += last_lsn - w->last_lsn;
        w->stats.appended_bytes += size;
        w->stats.log_bytes = w->end;
        w->last_lsn = last_lsn;
        if (w->policy == WAL_SYNC_NONE) {
                w->synced_lsn = w->last_lsn;
                w->synced_end = w->end;
        }
        return 0;
}

int wal_sync(Wal *w) {
        if (!w->replayed)
                return -ENOTCONN;
        if (w->synced_lsn >= w->last_lsn)
                return 0;
        if (w->policy != WAL_SYNC_NONE) {
                if (fdatasync(w->fd) < 0) {
                        int e = -errno;
                        /* The records since the last good sync are not known to be on
                         * disk and their callers hear they failed: cut them off, so that
                         * neither a restart's replay nor a clean close keeps them. */
                        if (ftruncate(w->fd, (off_t)w->synced_end) < 0) {
                                log_error_errno(errno, "Failed to cut the WAL back after a failed sync: %m");
                                cut_failed(w, w->synced_end);
                        } else {
                                w->end = w->alloc = w->synced_end;
                                w->last_lsn = w->synced_lsn;
                                w->stats.log_bytes = w->end;
                                if (fdatasync(w->fd) < 0) {
                                        /* The cut may not be durable: the file could come
                                         * back at its old length with the records that
                                         * failed. Zero the first one's header and take
                                         * nothing more until a restart. */
                                        log_error_errno(errno, "Failed to sync the WAL's cut: %m");
                                        cut_failed(w, w->synced_end);
                                }
                        }
                        return log_error_errno(e, "Failed to sync the WAL: %m");
                }
                w->stats.syncs++;
        }
        w->synced_lsn = w->last_lsn;
        w->synced_end = w->end;
        return 0;
}

bool wal_needs_sync(const Wal *w) {
        return w->synced_lsn < w->last_lsn;
}

uint64_t wal_last_lsn(const Wal *w) {
        return w->last_lsn;
}

uint64_t wal_synced_lsn(const Wal *w) {
        return w->synced_lsn;
}

bool wal_is_broken(const Wal *w) {
        return w->broken;
}

void wal_set_policy(Wal *w, WalSyncPolicy p) {
        if (p >= 0 && p < _WAL_SYNC_POLICY_MAX)
                w->policy = p;
}

WalSyncPolicy wal_get_policy(const Wal *w) {
        return w->policy;
}

const WalStats *wal_get_stats(const Wal *w) {
        return &w->stats;
}

void wal_set_userdata(Wal *w, void *userdata) {
        w->userdata = userdata;
}

void *wal_get_userdata(const Wal *w) {
        return w->userdata;
}

/* Appends bytes to the snapshot: its file, or its memory image. */
static int snapshot_put(WalSnapshot *s, const void *p, size_t n) {
        if (s->fd >= 0)
                return write_all(s->fd, p, n);
        if (s->mem_size + n > s->mem_cap) {
                size_t cap = MAX(s->mem_cap * 2, s->mem_size + n);
                uint8_t *m = realloc(s->mem, MAX(cap, (size_t)4096));
                if (!m)
                        return -ENOMEM;
                s->mem = m;
                s->mem_cap = MAX(cap, (size_t)4096);
        }
        memcpy(s->mem + s->mem_size, p, n);
        s->mem_size += n;
        return 0;
}

int wal_snapshot_add(WalSnapshot *s, uint16_t type, const void *payload, size_t len) {
        size_t size;
        int r;

        if (len > WAL_RECORD_PAYLOAD_MAX || (len > 0 && !payload) || type == WAL_RECORD_SNAPSHOT_END)
                return -EINVAL;
        size = wal_record_size(len);
        r = ensure_buf(&s->buf, &s->buf_size, size);
        if (r < 0)
                return r;
        wal_record_encode(s->buf, s->lsn + 1, type, payload, len);
        r = snapshot_put(s, s->buf, size);
        if (r < 0)
                return r;
        s->lsn++;
        s->offset += size;
        return 0;
}

/* Header, the state (fn), SNAPSHOT_END: into s (its fd or its memory). */
static int snapshot_write(WalSnapshot *s, uint64_t lsn, WalSnapshotFn fn, void *userdata) {
        uint8_t hdr[WAL_FILE_HEADER_SIZE], end[8];
        int r;

        wal_file_header_encode(hdr, &(WalFileHeader){ .kind = WAL_FILE_SNAPSHOT, .base_lsn = lsn,
                                                      .created_usec = now_usec(CLOCK_REALTIME) });
        r = snapshot_put(s, hdr, sizeof hdr);
        if (r < 0)
                return r;
        s->offset = sizeof hdr;
        r = fn(userdata, s);
        if (r < 0)
                return r;
        unaligned_write_le64(end, s->lsn);
        r = ensure_buf(&s->buf, &s->buf_size, wal_record_size(8));
        if (r < 0)
                return r;
        wal_record_encode(s->buf, s->lsn + 1, WAL_RECORD_SNAPSHOT_END, end, 8);
        return snapshot_put(s, s->buf, wal_record_size(8));
}

int wal_snapshot_build(WalSnapshotFn fn, void *userdata, uint64_t lsn, void **ret, size_t *ret_size,
                       uint64_t *ret_records) {
        WalSnapshot s = { .fd = -EBADF };
        int r = snapshot_write(&s, lsn, fn, userdata);
        free(s.buf);
        if (r < 0) {
                free(s.mem);
                return r;
        }
        *ret = s.mem;
        *ret_size = s.mem_size;
        if (ret_records)
                *ret_records = s.lsn;
        return 0;
}

/* The snapshot file is in place (renamed, directory synced): a fresh log after it. */
/* After the snapshot's rename: a failure here may have put a fresh wal.log in place of
 * the one this Wal appends to (its rename done, the directory's fsync failed), so the
 * log takes no further record. */
static int compact_finish(Wal *w, uint64_t lsn, uint64_t records) {
        int r = create_file_atomic(w->dir_fd, WAL_LOG_TMP, WAL_LOG_NAME, WAL_FILE_LOG, lsn);
        if (r >= 0)
                r = open_log_for_append(w, UINT64_MAX);
        if (r < 0) {
                w->broken = true;
                return r;
        }
        w->base_lsn = lsn;
        w->synced_end = w->end; /* the new log's header, made durable by its creation */
        w->stats.snapshot_records = records;
        w->stats.compactions++;
        return 0;
}

int wal_compact_buffer(Wal *w, const void *snapshot, size_t size, uint64_t lsn, uint64_t records) {
        _cleanup_(closep) int fd = -EBADF;
        int r;

        if (!w->replayed)
                return -ENOTCONN;
        if (w->broken)
                return -EIO;
        if (lsn != w->last_lsn)
                return -EINVAL; /* records before the snapshot are not all in the log yet */
        r = wal_sync(w);
        if (r < 0) {
                w->broken = true; /* records were cut: the writer's next LSNs no longer follow */
                return r;
        }
        fd = openat(w->dir_fd, WAL_SNAPSHOT_TMP, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
        if (fd < 0)
                return log_error_errno(errno, "WAL compaction in %s failed: %m", w->dir);
        r = write_all(fd, snapshot, size);
        if (r >= 0 && (fsync(fd) < 0 || renameat(w->dir_fd, WAL_SNAPSHOT_TMP, w->dir_fd, WAL_SNAPSHOT_NAME) < 0 ||
                       fsync(w->dir_fd) < 0))
                r = -errno;
        if (r < 0) {
                (void)unlinkat(w->dir_fd, WAL_SNAPSHOT_TMP, 0);
                return log_error_errno(r, "WAL compaction in %s failed: %m", w->dir);
        }
        /* From here the snapshot is the truth: the old log's records are all <= lsn. */
        r = compact_finish(w, lsn, records);
        if (r < 0)
                return log_error_errno(r, "WAL compaction in %s failed: %m", w->dir);
        return 0;
}

int wal_compact(Wal *w, WalSnapshotFn fn, void *userdata) {
        WalSnapshot s = { .fd = -EBADF };
        uint64_t lsn;
        int r;

        if (!w->replayed)
                return -ENOTCONN;
        r = wal_sync(w);
        if (r < 0)
                return r;
        lsn = w->last_lsn;

        s.fd = openat(w->dir_fd, WAL_SNAPSHOT_TMP, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW,
                      0600);
        if (s.fd < 0) {
                r = -errno;
                goto fail;
        }
        r = snapshot_write(&s, lsn, fn, userdata);
        if (r < 0)
                goto fail;
        if (fsync(s.fd) < 0 || renameat(w->dir_fd, WAL_SNAPSHOT_TMP, w->dir_fd, WAL_SNAPSHOT_NAME) < 0 ||
            fsync(w->dir_fd) < 0) {
                r = -errno;
                goto fail;
        }
        /* From here the snapshot is the truth; the old log's records are all <= lsn
         * and replay skips them, so a crash before the next rename loses nothing. */
        r = compact_finish(w, lsn, s.lsn);
        if (r < 0)
                goto fail_after;
        safe_close(s.fd);
        free(s.buf);
        return 0;

fail:
        (void)unlinkat(w->dir_fd, WAL_SNAPSHOT_TMP, 0);
fail_after:
        safe_close(s.fd);
        free(s.buf);
        return log_error_errno(r, "WAL compaction in %s failed: %m", w->dir);
}
