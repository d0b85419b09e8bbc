/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The read surface (docs/security.md, "The read surface"): what anyone may read. The
 * table in the document is this test's expectation, and the contracts in dbus/ are the
 * list of properties: every property of every interface must be in exactly one column
 * of its interface's row, and every one is read, on a daemon holding one of everything
 * (workers, a sequence, a local handoff accepted by a decode worker, a feature, a
 * workflow, a scheduler request), by uid nobody and by root, neither of them the owner:
 *   anyone  readable by both;
 *   own     a list: empty for nobody, everything for root;
 *   owner   PermissionDenied for both.
 * The object tree under /org/epd1/sequence and /org/epd1/handoff shows nobody nothing and
 * root everything. Needs root (to read as another uid); exits 77 otherwise. */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <grp.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "epd/epd.h"
#include "epd/epd-feature.h"
#include "epd/handoff.h"
#include "harness.h"
#include "../check-main.h"

#define MAX_ROWS 32
#define MAX_PROPS 32
#define MAX_PATHS 8

typedef enum Column { COL_ANYONE, COL_OWN, COL_OWNER, _COL_MAX } Column;

typedef struct Row {
        char iface[64];
        char object[64];
        char props[_COL_MAX][MAX_PROPS][48];
        size_t n[_COL_MAX];
} Row;

static Harness h;
static char address[512];
static Row rows[MAX_ROWS];
static size_t n_rows;

/* The concrete objects for the table's object patterns (worker, sequence, handoff). */
static char worker_paths[MAX_PATHS][128], sequence_paths[MAX_PATHS][128], handoff_paths[MAX_PATHS][128];
static size_t n_worker_paths, n_sequence_paths, n_handoff_paths;

static char *read_file(const char *path) {
        FILE *f = fopen(path, "re");
        ck_assert_msg(f, "cannot open %s", path);
        char *buf = NULL;
        size_t n = 0;
        ck_assert_int_ge(getdelim(&buf, &n, 0, f), 0);
        fclose(f);
        return buf;
}

/* The backticked words of one table cell. */
static size_t cell_words(const char *cell, size_t len, char out[][48], size_t max) {
        size_t n = 0;
        for (const char *p = cell; p < cell + len; p++) {
                if (*p != '`')
                        continue;
                const char *q = memchr(p + 1, '`', (size_t)(cell + len - p - 1));
                ck_assert_ptr_nonnull(q);
                ck_assert_uint_lt(n, max);
                ck_assert_uint_lt((size_t)(q - p - 1), 48);
                snprintf(out[n++], 48, "%.*s", (int)(q - p - 1), p + 1);
                p = q;
        }
        return n;
}

/* The rows of the table under "## The read surface". */
static void parse_doc(void) {
        if (n_rows > 0)
                return;
        char path[512];
        snprintf(path, sizeof path, "%s/docs/security.md", getenv("SOURCE_ROOT"));
        char *doc = read_file(path);
        char *sec = strstr(doc, "\n## The read surface\n");
        ck_assert_msg(sec, "docs/security.md has no section \"The read surface\"");
        char *end = strstr(sec + 1, "\n## ");
        for (char *line = sec; line && (!end || line < end); line = strchr(line + 1, '\n')) {
                if (strncmp(line, "\n| `org.epd1.", 13) != 0)
                        continue;
                const char *cells[6];
                size_t lens[6], n = 0;
                const char *p = line + 2, *eol = strchr(line + 1, '\n');
                while (n < 6 && p < eol) {
                        const char *bar = memchr(p, '|', (size_t)(eol - p));
                        if (!bar)
                                break;
                        cells[n] = p;
                        lens[n++] = (size_t)(bar - p);
                        p = bar + 1;
                }
                ck_assert_msg(n == 5, "a row of the read surface table has %zu cells, not 5", n);
                ck_assert_uint_lt(n_rows, MAX_ROWS);
                Row *r = &rows[n_rows++];
                char one[2][48];
                ck_assert_uint_eq(cell_words(cells[0], lens[0], one, 2), 1);
                snprintf(r->iface, sizeof r->iface, "%s", one[0]);
                ck_assert_uint_eq(cell_words(cells[1], lens[1], one, 2), 1);
                snprintf(r->object, sizeof r->object, "%s", one[0]);
                for (int c = 0; c < _COL_MAX; c++)
                        r->n[c] = cell_words(cells[2 + c], lens[2 + c], r->props[c], MAX_PROPS);
        }
        free(doc);
        ck_assert_uint_ge(n_rows, 10);
}

static Row *row_of(const char *iface) {
        for (size_t i = 0; i < n_rows; i++)
                if (strcmp(rows[i].iface, iface) == 0)
                        return &rows[i];
        return NULL;
}

static int column_of(const Row *r, const char *prop) {
        int found = -1;
        for (int c = 0; c < _COL_MAX; c++)
                for (size_t i = 0; i < r->n[c]; i++)
                        if (strcmp(r->props[c][i], prop) == 0) {
                                ck_assert_msg(found < 0, "%s.%s is in two columns of docs/security.md", r->iface,
                                              prop);
                                found = c;
                        }
        return found;
}

/* Every interface in dbus/ has a row; every property of it is in one column of the row
 * and nothing else is there. */
START_TEST(test_table_covers_the_contracts) {
        parse_doc();
        char dir[512], path[1024];
        size_t seen = 0;
        snprintf(dir, sizeof dir, "%s/dbus", getenv("SOURCE_ROOT"));
        DIR *d = opendir(dir);
        ck_assert_msg(d, "cannot open %s", dir);
        struct dirent *de;
        while ((de = readdir(d))) {
                const char *name = de->d_name;
                size_t l = strlen(name);
                if (l < 5 || strcmp(name + l - 4, ".xml") != 0)
                        continue;
                snprintf(path, sizeof path, "%s/%s", dir, name);
                char *xml = read_file(path);
                char iface[64] = "";
                const char *p = strstr(xml, "<interface name=\"");
                ck_assert_ptr_nonnull(p);
                ck_assert_int_eq(sscanf(p, "<interface name=\"%63[^\"]\"", iface), 1);
                Row *r = row_of(iface);
                ck_assert_msg(r, "%s (%s) has no row in docs/security.md's read surface table", iface, name);
                size_t n_props = 0;
                for (p = strstr(xml, "<property name=\""); p; p = strstr(p + 1, "<property name=\"")) {
                        char prop[64];
                        ck_assert_int_eq(sscanf(p, "<property name=\"%63[^\"]\"", prop), 1);
                        ck_assert_msg(column_of(r, prop) >= 0, "%s.%s is not in docs/security.md's read surface table",
                                      iface, prop);
                        n_props++;
                }
                ck_assert_msg(n_props == r->n[COL_ANYONE] + r->n[COL_OWN] + r->n[COL_OWNER],
                              "docs/security.md lists %zu properties of %s, dbus/%s has %zu",
                              r->n[COL_ANYONE] + r->n[COL_OWN] + r->n[COL_OWNER], iface, name, n_props);
                free(xml);
                seen++;
        }
        closedir(d);
        ck_assert_uint_eq(seen, n_rows);
}
END_TEST

/* ---- reading ---- */

/* One property read: "ok <count>" (count: the elements of an array, else 1) or the
 * error name. */
static void read_one(sd_bus *bus, const char *path, const char *iface, const char *prop, char *out, size_t n) {
        sd_bus_error e = SD_BUS_ERROR_NULL;
        sd_bus_message *reply = NULL;
        int r = sd_bus_call_method(bus, harness_destination(&h), path, "org.freedesktop.DBus.Properties", "Get", &e,
                                   &reply, "ss", iface, prop);
        if (r < 0) {
                snprintf(out, n, "%s", e.name ? e.name : "?");
                sd_bus_error_free(&e);
                return;
        }
        const char *contents = NULL;
        char type = 0;
        unsigned count = 1;
        if (sd_bus_message_enter_container(reply, 'v', NULL) > 0 &&
            sd_bus_message_peek_type(reply, &type, &contents) > 0 && type == 'a' &&
            sd_bus_message_enter_container(reply, 'a', contents) > 0) {
                count = 0;
                while (sd_bus_message_at_end(reply, false) == 0 && sd_bus_message_skip(reply, contents) >= 0)
                        count++;
        }
        sd_bus_message_unref(reply);
        snprintf(out, n, "ok %u", count);
}

/* The children the object tree shows under path. */
static unsigned children(sd_bus *bus, const char *path) {
        sd_bus_error e = SD_BUS_ERROR_NULL;
        sd_bus_message *reply = NULL;
        const char *xml;
        unsigned n = 0;
        int r = sd_bus_call_method(bus, harness_destination(&h), path, "org.freedesktop.DBus.Introspectable",
                                   "Introspect", &e, &reply, NULL);
        if (r < 0) {
                sd_bus_error_free(&e);
                return 0;
        }
        if (sd_bus_message_read(reply, "s", &xml) >= 0)
                for (const char *p = strstr(xml, "<node name=\""); p; p = strstr(p + 1, "<node name=\""))
                        n++;
        sd_bus_message_unref(reply);
        return n;
}

/* Every property of every row on each of its objects, and the two trees, as one text:
 * lines "IFACE PROP PATH RESULT", then "tree PATH N". */
static void read_everything(FILE *out) {
        sd_bus *bus = NULL;
        int r = harness_raw_bus(&h, &bus);
        if (r < 0) {
                fprintf(out, "noconnection %d\n", r);
                return;
        }
        for (size_t i = 0; i < n_rows; i++) {
                Row *row = &rows[i];
                char (*paths)[128] = NULL;
                size_t n_paths = 1;
                if (strcmp(row->object, "/org/epd1/worker/*") == 0)
                        paths = worker_paths, n_paths = n_worker_paths;
                else if (strcmp(row->object, "/org/epd1/sequence/*") == 0)
                        paths = sequence_paths, n_paths = n_sequence_paths;
                else if (strcmp(row->object, "/org/epd1/handoff/*") == 0)
                        paths = handoff_paths, n_paths = n_handoff_paths;
                for (size_t k = 0; k < n_paths; k++) {
                        const char *path = paths ? paths[k] : row->object;
                        for (int c = 0; c < _COL_MAX; c++)
                                for (size_t j = 0; j < row->n[c]; j++) {
                                        char res[200];
                                        read_one(bus, path, row->iface, row->props[c][j], res, sizeof res);
                                        fprintf(out, "%s %s %s %s\n", row->iface, row->props[c][j], path, res);
                                }
                }
        }
        fprintf(out, "tree /org/epd1/sequence %u\n", children(bus, "/org/epd1/sequence"));
        fprintf(out, "tree /org/epd1/handoff %u\n", children(bus, "/org/epd1/handoff"));
        sd_bus_flush_close_unref(bus);
}

/* read_everything() as uid 65534 in a child; its text. */
static char *read_as_nobody(void) {
        int fds[2];
        ck_assert_int_eq(pipe(fds), 0);
        pid_t pid = harness_fork_as(65534);
        if (pid == 0) {
                close(fds[0]);
                FILE *out = fdopen(fds[1], "w");
                if (!out)
                        _exit(3);
                read_everything(out);
                _exit(fclose(out) == 0 ? 0 : 4);
        }
        close(fds[1]);
        FILE *in = fdopen(fds[0], "r");
        ck_assert_ptr_nonnull(in);
        char *text = NULL;
        size_t n = 0;
        if (getdelim(&text, &n, 0, in) < 0) {
                free(text);
                text = strdup("");
        }
        fclose(in);
        int status;
        ck_assert_int_eq(waitpid(pid, &status, 0), pid);
        ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the uid 65534 reader failed");
        return text;
}

static char *read_as_root(void) {
        char *text = NULL;
        size_t n = 0;
        FILE *out = open_memstream(&text, &n);
        ck_assert_ptr_nonnull(out);
        read_everything(out);
        ck_assert_int_eq(fclose(out), 0);
        return text;
}

/* Each line of `text` for (iface, prop) against its column; who: "nobody" or "root". */
static void check_reads(const char *text, const char *who, bool root) {
        unsigned lines = 0, absent = 0;
        ck_assert_msg(!strstr(text, "noconnection"), "%s could not connect", who);
        for (const char *l = text; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL) {
                char iface[64], prop[64], path[160], res[200] = "";
                unsigned count = 0;
                if (strncmp(l, "tree ", 5) == 0) {
                        ck_assert_int_eq(sscanf(l, "tree %159s %u", path, &count), 2);
                        unsigned want = strcmp(path, "/org/epd1/sequence") == 0 ? n_sequence_paths : n_handoff_paths;
                        ck_assert_msg(root ? count == want : count == 0,
                                      "%s sees %u children of %s in the object tree (%s)", who, count, path,
                                      root ? "all of them expected" : "none expected");
                        continue;
                }
                ck_assert_int_eq(sscanf(l, "%63s %63s %159s %199[^\n]", iface, prop, path, res), 4);
                Row *row = row_of(iface);
                ck_assert_ptr_nonnull(row);
                int c = column_of(row, prop);
                lines++;
                if (strstr(res, "UnknownObject") || strstr(res, "UnknownInterface")) {
                        /* Not served by this daemon's configuration (an optional
                         * subsystem): said, not checked. */
                        ck_assert_msg(c == COL_ANYONE, "%s %s.%s on %s: %s", who, iface, prop, path, res);
                        absent++;
                        continue;
                }
                switch (c) {
                case COL_ANYONE:
                        ck_assert_msg(strncmp(res, "ok ", 3) == 0, "%s may read %s.%s on %s (anyone), got %s", who, iface,
                                      prop, path, res);
                        break;
                case COL_OWN:
                        ck_assert_msg(sscanf(res, "ok %u", &count) == 1, "%s may read %s.%s (own), got %s", who, iface,
                                      prop, res);
                        ck_assert_msg(root ? count >= 1 : count == 0, "%s sees %u entries of %s.%s (%s)", who, count,
                                      iface, prop, root ? "all expected" : "none of the others' expected");
                        break;
                case COL_OWNER:
                        ck_assert_msg(strcmp(res, "org.epd1.Error.PermissionDenied") == 0,
                                      "%s, not the owner, read %s.%s on %s: %s (PermissionDenied expected)", who, iface,
                                      prop, path, res);
                        break;
                default:
                        ck_abort_msg("%s.%s: no column", iface, prop);
                }
        }
        printf("%s: %u reads checked, %u of interfaces this daemon does not serve\n", who, lines, absent);
        ck_assert_uint_ge(lines, 80);
}

/* ---- one of everything ---- */

static const epd_kv_layout kv = { .layers = 4, .tokens_per_block = 16, .k_bytes_per_token = 256,
                                  .v_bytes_per_token = 256, .dtype = "bfloat16" };

static epd_client *worker(const char *role) {
        epd_client *c = NULL;
        ck_assert_int_eq(epd_connect(address, &c), 0);
        ck_assert_int_eq(epd_register(c, role, "model", "cpu", &kv, NULL), 0);
        return c;
}

/* The object paths (the first member of each entry) of a list property, read as root. */
static void list_paths(const char *obj, const char *iface, const char *prop, const char *entry,
                       char (*paths)[128], size_t *n) {
        sd_bus *bus;
        sd_bus_message *reply = NULL;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        char array[64], contents[64];
        snprintf(array, sizeof array, "a%s", entry);
        snprintf(contents, sizeof contents, "%.*s", (int)strlen(entry) - 2, entry + 1); /* without ( ) */
        ck_assert_int_ge(harness_raw_bus(&h, &bus), 0);
        int r = sd_bus_get_property(bus, harness_destination(&h), obj, iface, prop, &e, &reply, array);
        ck_assert_msg(r >= 0, "%s.%s: %s", iface, prop, e.message);
        ck_assert_int_ge(sd_bus_message_enter_container(reply, 'a', entry), 0);
        *n = 0;
        while ((r = sd_bus_message_enter_container(reply, 'r', contents)) > 0) {
                const char *p;
                ck_assert_int_ge(sd_bus_message_read(reply, "o", &p), 0);
                ck_assert_uint_lt(*n, MAX_PATHS);
                snprintf(paths[(*n)++], 128, "%s", p);
                ck_assert_int_ge(sd_bus_message_skip(reply, contents + 1), 0);
                ck_assert_int_ge(sd_bus_message_exit_container(reply), 0);
        }
        ck_assert_int_ge(r, 0);
        sd_bus_message_unref(reply);
        sd_bus_flush_close_unref(bus);
}

START_TEST(test_read_surface) {
        if (geteuid() != 0) {
                printf("SKIP: not root, cannot read as another uid\n");
                return;
        }
        parse_doc();
        epd_client *p = worker("prefill"), *d = worker("decode"), *e = worker("encoder"), *s = worker("scheduler");
        char *seq = NULL, *seq2 = NULL, *path = NULL, *wf = NULL, *head = NULL;
        uint64_t token;

        /* a sequence, a local handoff accepted by the decode worker, a workflow */
        ck_assert_int_eq(epd_sequence_create(p, "kv0", 2, &seq, NULL, NULL), 0);
        static const uint32_t groups[2] = { 2, 2 };
        epd_handoff_options o = { .arena = "kv1" };
        const char *rid = "0123456789abcdef0123456789abcdef";
        ck_assert_int_eq(epd_handoff_prepare(p, rid, NULL, seq, groups, 2, &o, &path, &token), 0);
        epd_handoff_accepted acc;
        ck_assert_int_eq(epd_handoff_accept(d, rid, &acc), 0);
        ck_assert_int_eq(epd_sequence_create(p, "kv0", 4, &seq2, NULL, NULL), 0);
        uint32_t tokens[64];
        for (unsigned i = 0; i < 64; i++)
                tokens[i] = 1000 + i;
        ck_assert_int_eq(epd_workflow_create(p, seq2, tokens, 64, &wf, &head), 0);

        /* a feature, a scheduler request */
        epd_feature_tensor t = { .name = "h", .dtype = "bfloat16", .rank = 2, .shape = { 4, 64 } };
        epd_feature *f = NULL;
        ck_assert_msg(epd_feature_reserve(e, "surface:1", 512, &t, 1, NULL, &f) == 0, "Reserve: %s", epd_last_error_message(e));
        ck_assert_int_eq(epd_feature_publish(e, f, 1), 0);
        epd_admission a;
        ck_assert_int_eq(epd_admit(s, "surface-1", "interactive", 0, 1, false, &a), 0);

        /* the objects, as root lists them */
        list_paths("/org/epd1", "org.epd1.Manager", "Workers", "(osssu)", worker_paths, &n_worker_paths);
        ck_assert_uint_eq(n_worker_paths, 4);
        list_paths("/org/epd1/pages", "org.epd1.Pages", "Sequences", "(oosuut)", sequence_paths, &n_sequence_paths);
        ck_assert_uint_ge(n_sequence_paths, 2);
        list_paths("/org/epd1/handoffs", "org.epd1.Handoffs", "Handoffs", "(ossssuuts)", handoff_paths,
                   &n_handoff_paths);
        ck_assert_uint_eq(n_handoff_paths, 2);

        /* nobody reaches the socket as a group member would (the policy for the system
         * bus is the bus's; here the reads themselves are checked) */
        harness_let_others_in(&h);
        char *nobody = read_as_nobody();
        char *root = read_as_root();
        check_reads(nobody, "uid 65534", false);
        check_reads(root, "root", true);
        free(nobody);
        free(root);

        epd_handoff_accepted_done(&acc);
        free(seq);
        free(seq2);
        free(path);
        free(wf);
        free(head);
        ck_assert_int_eq(epd_feature_release(e, f), 0);
        epd_disconnect(s);
        epd_disconnect(e);
        epd_disconnect(d);
        epd_disconnect(p);
}
END_TEST

static void setup(void) {
        ck_assert_int_eq(harness_init(&h, "[Arena:kv0]\nSize=16M\n"
                                          "[Arena:kv1]\nSize=16M\n"
                                          "[Arena:feat]\nSize=16M\nUsage=feature\n"), 0);
        char store[400];
        snprintf(store, sizeof store, "%s/store", h.dir);
        ck_assert_int_eq(mkdir(store, 0700), 0);
        FILE *f = fopen(h.config, "ae");
        ck_assert_ptr_nonnull(f);
        fprintf(f, "[Features]\nCacheSize=16M\nStoreDirectory=%s\n", store);
        ck_assert_int_eq(fclose(f), 0);
        harness_direct_address(&h, address, sizeof address);
        ck_assert_int_eq(harness_start_epdd(&h, NULL), 0);
}

static void teardown(void) {
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        harness_done(&h);
}

int main(void) {
        Suite *s = suite_create("read-surface");
        TCase *tc = tcase_create("read-surface");
        tcase_set_timeout(tc, 60);
        tcase_add_test(tc, test_table_covers_the_contracts);
        suite_add_tcase(s, tc);
        TCase *td = tcase_create("daemon");
        tcase_add_checked_fixture(td, setup, teardown);
        tcase_set_timeout(td, 60);
        tcase_add_test(td, test_read_surface);
        suite_add_tcase(s, td);
        return check_run(s, CK_NOFORK);
}
