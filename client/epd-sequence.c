/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* libepd: KV sequences (org.epd1.Pages, org.epd1.Sequence). */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "epd-internal.h"
#include "macro.h"

#define PAGES_PATH "/org/epd1/pages"
#define SEQ_IFACE "org.epd1.Sequence"
#define PAGES_IFACE "org.epd1.Pages"

static int read_pages(epd_client *c, sd_bus_message *reply, uint32_t **ret, size_t *ret_n) {
        const void *p;
        size_t sz;
        int r = sd_bus_message_read_array(reply, 'u', &p, &sz);
        if (r < 0)
                return epd__error(c, r, NULL);
        if (ret) {
                uint32_t *a = malloc(MAX(sz, sizeof(uint32_t)));
                if (!a)
                        return epd__error(c, -ENOMEM, NULL);
                memcpy(a, p, sz);
                *ret = a;
        }
        if (ret_n)
                *ret_n = sz / sizeof(uint32_t);
        return 0;
}

static int dup_path(epd_client *c, const char *path, char **ret) {
        if (!ret)
                return 0;
        *ret = strdup(path);
        return *ret ? 0 : epd__error(c, -ENOMEM, NULL);
}

/* The rest of an answer that made sequence `path` (its pages, its path copied): on a
 * failure the sequence is given back and nothing half made reaches the caller. */
static int take_sequence(epd_client *c, sd_bus_message *reply, const char *path, char **ret_path,
                         uint32_t **ret_pages, size_t *ret_n_pages) {
        uint32_t *pages = NULL;
        char *p = NULL;
        int r = reply ? read_pages(c, reply, ret_pages ? &pages : NULL, ret_n_pages) : 0;
        if (r >= 0)
                r = dup_path(c, path, ret_path ? &p : NULL);
        if (r < 0) {
                free(pages);
                return epd__undo(c, r, path, SEQ_IFACE, "Release", NULL);
        }
        if (ret_pages)
                *ret_pages = pages;
        if (ret_path)
                *ret_path = p;
        return 0;
}

int epd_sequence_create(epd_client *c, const char *arena, uint32_t n_pages, char **ret_path,
                        uint32_t **ret_pages, size_t *ret_n_pages) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        const char *path;
        if (!c || !arena)
                return epd__error(c, -EINVAL, NULL);
        int r = epd__call(c, PAGES_PATH, PAGES_IFACE, "CreateSequence", &reply, "su", arena, n_pages);
        if (r < 0)
                return r;
        r = sd_bus_message_read(reply, "o", &path);
        if (r < 0)
                return epd__error(c, r, NULL);
        return take_sequence(c, reply, path, ret_path, ret_pages, ret_n_pages);
}

static int append_hashes(sd_bus_message *m, const uint64_t *hashes, size_t n) {
        return sd_bus_message_append_array(m, 't', hashes, n * sizeof(uint64_t));
}

int epd_sequence_create_from_prefix(epd_client *c, const char *arena, const uint64_t *hashes,
                                    size_t n_hashes, char **ret_path, size_t *ret_blocks,
                                    uint32_t **ret_pages, size_t *ret_n_pages) {
        sd_bus_message *m = NULL, *reply = NULL;
        const char *path;
        uint32_t blocks;
        if (!c || !arena || (n_hashes > 0 && !hashes))
                return epd__error(c, -EINVAL, NULL);
        int r = epd__new_call(c, PAGES_PATH, PAGES_IFACE, "CreateFromPrefix", &m);
        if (r < 0)
                return r;
        r = sd_bus_message_append(m, "s", arena);
        if (r >= 0)
                r = append_hashes(m, hashes, n_hashes);
        r = r < 0 ? epd__error(c, r, NULL) : epd__send(c, m, &reply);
        sd_bus_message_unref(m);
        if (r < 0)
                return r;
        r = sd_bus_message_read(reply, "o", &path);
        if (r < 0) {
                sd_bus_message_unref(reply);
                return epd__error(c, r, NULL);
        }
        r = sd_bus_message_read(reply, "u", &blocks);
        if (r < 0) {
                r = epd__undo(c, epd__error(c, r, NULL), path, SEQ_IFACE, "Release", NULL);
                sd_bus_message_unref(reply);
                return r;
        }
        r = take_sequence(c, reply, path, ret_path, ret_pages, ret_n_pages);
        if (r >= 0 && ret_blocks)
                *ret_blocks = blocks;
        sd_bus_message_unref(reply);
        return r;
}

/* Appends the hashes to m (whose first arguments are in; r is how appending them
 * went), sends it and returns the count the reply carries. Takes m. */
static int call_hashes(epd_client *c, sd_bus_message *m, int r, const uint64_t *hashes, size_t n_hashes) {
        sd_bus_message *reply = NULL;
        uint32_t count = 0;
        if (r >= 0)
                r = append_hashes(m, hashes, n_hashes);
        r = r < 0 ? epd__error(c, r, NULL) : epd__send(c, m, &reply);
        sd_bus_message_unref(m);
        if (r < 0)
                return r;
        r = sd_bus_message_read(reply, "u", &count);
        sd_bus_message_unref(reply);
        return r < 0 ? epd__error(c, r, NULL) : (int)MIN(count, (uint32_t)INT32_MAX);
}

int epd_prefix_match(epd_client *c, const char *arena, const uint64_t *hashes, size_t n_hashes) {
        sd_bus_message *m = NULL;
        if (!c || !arena || (n_hashes > 0 && !hashes))
                return epd__error(c, -EINVAL, NULL);
        int r = epd__new_call(c, PAGES_PATH, PAGES_IFACE, "MatchPrefix", &m);
        if (r < 0)
                return r;
        r = sd_bus_message_append(m, "s", arena);
        return call_hashes(c, m, r, hashes, n_hashes);
}

int epd_sequence_append(epd_client *c, const char *path, uint32_t n_pages, uint32_t **ret_pages,
                        size_t *ret_n_pages) {
        sd_bus_message *reply = NULL;
        if (!c || !path)
                return epd__error(c, -EINVAL, NULL);
        int r = epd__call(c, path, SEQ_IFACE, "Append", &reply, "u", n_pages);
        if (r < 0)
                return r;
        r = read_pages(c, reply, ret_pages, ret_n_pages);
        sd_bus_message_unref(reply);
        return r;
}

int epd_sequence_truncate(epd_client *c, const char *path, uint32_t n_pages) {
        if (!c || !path)
                return epd__error(c, -EINVAL, NULL);
        return epd__call(c, path, SEQ_IFACE, "Truncate", NULL, "u", n_pages);
}

int epd_sequence_clone(epd_client *c, const char *path, char **ret_path) {
        sd_bus_message *reply = NULL;
        const char *p;
        if (!c || !path)
                return epd__error(c, -EINVAL, NULL);
        int r = epd__call(c, path, SEQ_IFACE, "Clone", &reply, NULL);
        if (r < 0)
                return r;
        r = sd_bus_message_read(reply, "o", &p);
        r = r < 0 ? epd__error(c, r, NULL) : take_sequence(c, NULL, p, ret_path, NULL, NULL);
        sd_bus_message_unref(reply);
        return r;
}

int epd_sequence_prepare_write(epd_client *c, const char *path, uint32_t first, uint32_t count,
                               uint32_t *ret_pages) {
        sd_bus_message *reply = NULL;
        const void *p;
        size_t sz;
        uint32_t copied;
        if (!c || !path)
                return epd__error(c, -EINVAL, NULL);
        int r = epd__call(c, path, SEQ_IFACE, "PrepareWrite", &reply, "uu", first, count);
        if (r < 0)
                return r;
        r = sd_bus_message_read_array(reply, 'u', &p, &sz);
        if (r >= 0)
                r = sd_bus_message_read(reply, "u", &copied);
        if (r < 0) {
                sd_bus_message_unref(reply);
                return epd__error(c, r, NULL);
        }
        if (sz != (size_t)count * sizeof(uint32_t)) {
                /* Page ids the caller would write to: never partly filled, the rest
                 * whatever the buffer held. */
                sd_bus_message_unref(reply);
                return epd__fail(c, -EBADMSG, "PrepareWrite answered %zu page ids for %" PRIu32 " pages",
                                 sz / sizeof(uint32_t), count);
        }
        if (ret_pages)
                memcpy(ret_pages, p, sz);
        sd_bus_message_unref(reply);
        return (int)MIN(copied, (uint32_t)INT32_MAX);
}

int epd_sequence_publish(epd_client *c, const char *path, uint32_t first, const uint64_t *hashes,
                         size_t n_hashes) {
        sd_bus_message *m = NULL;
        if (!c || !path || (n_hashes > 0 && !hashes))
                return epd__error(c, -EINVAL, NULL);
        int r = epd__new_call(c, path, SEQ_IFACE, "Publish", &m);
        if (r < 0)
                return r;
        r = sd_bus_message_append(m, "u", first);
        return call_hashes(c, m, r, hashes, n_hashes);
}

int epd_sequence_grant(epd_client *c, const char *path, const char *worker_path) {
        if (!c || !path || !worker_path)
                return epd__error(c, -EINVAL, NULL);
        return epd__call(c, path, SEQ_IFACE, "Grant", NULL, "o", worker_path);
}

int epd_sequence_revoke(epd_client *c, const char *path, const char *worker_path) {
        if (!c || !path || !worker_path)
                return epd__error(c, -EINVAL, NULL);
        return epd__call(c, path, SEQ_IFACE, "Revoke", NULL, "o", worker_path);
}

int epd_sequence_release(epd_client *c, const char *path) {
        if (!c || !path)
                return epd__error(c, -EINVAL, NULL);
        return epd__call(c, path, SEQ_IFACE, "Release", NULL, NULL);
}

int epd_sequence_release_nowait(epd_client *c, const char *path) {
        if (!c || !path)
                return epd__error(c, -EINVAL, NULL);
        return epd__call_nowait(c, path, SEQ_IFACE, "Release", NULL);
}

static int get_property(epd_client *c, const char *path, const char *property, const char *type,
                        sd_bus_message **reply) {
        sd_bus_error e = SD_BUS_ERROR_NULL;
        epd__clear_error(c);
        int r = sd_bus_get_property(c->bus, EPD_DESTINATION(c), path, SEQ_IFACE, property, &e, reply, type);
        if (r < 0)
                r = epd__error(c, r, &e);
        sd_bus_error_free(&e);
        return r;
}

int epd_sequence_get_pages(epd_client *c, const char *path, uint32_t **ret_pages, size_t *ret_n_pages) {
        sd_bus_message *reply = NULL;
        if (!c || !path)
                return epd__error(c, -EINVAL, NULL);
        int r = get_property(c, path, "Pages", "au", &reply);
        if (r < 0)
                return r;
        r = read_pages(c, reply, ret_pages, ret_n_pages);
        sd_bus_message_unref(reply);
        return r;
}

int epd_sequence_get_page_size(epd_client *c, const char *path, uint64_t *ret) {
        sd_bus_message *reply = NULL;
        if (!c || !path || !ret)
                return epd__error(c, -EINVAL, NULL);
        int r = get_property(c, path, "PageSize", "t", &reply);
        if (r < 0)
                return r;
        r = sd_bus_message_read(reply, "t", ret);
        sd_bus_message_unref(reply);
        return r < 0 ? epd__error(c, r, NULL) : 0;
}

int epd_sequence_get_arena(epd_client *c, const char *path, char **ret) {
        sd_bus_message *reply = NULL;
        const char *a;
        if (!c || !path || !ret)
                return epd__error(c, -EINVAL, NULL);
        int r = get_property(c, path, "Arena", "s", &reply);
        if (r < 0)
                return r;
        r = sd_bus_message_read(reply, "s", &a);
        if (r >= 0) {
                *ret = strdup(a);
                r = *ret ? 0 : -ENOMEM;
        }
        sd_bus_message_unref(reply);
        return r < 0 ? epd__error(c, r, NULL) : 0;
}

int epd_sequence_attach(epd_client *c, const char *id_or_path, char **ret_path) {
        sd_bus_message *reply = NULL;
        const char *p;
        if (!c || !id_or_path)
                return epd__error(c, -EINVAL, NULL);
        int r = epd__call(c, PAGES_PATH, PAGES_IFACE, "Attach", &reply, "s", id_or_path);
        if (r < 0)
                return r;
        r = sd_bus_message_read(reply, "o", &p);
        r = r < 0 ? epd__error(c, r, NULL) : take_sequence(c, NULL, p, ret_path, NULL, NULL);
        sd_bus_message_unref(reply);
        return r;
}
