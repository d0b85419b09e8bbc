/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "sched/pool-select.h"

#include <errno.h>
#include <fnmatch.h>
#include <stdio.h>
#include <string.h>

static const char *const roles[] = { "encoder", "prefill", "decode", "colocated" };

bool pool_select_label_valid(const char *label) {
        size_t n = label ? strnlen(label, POOL_SELECT_LABEL_MAX) : 0;
        if (n == 0 || n >= POOL_SELECT_LABEL_MAX)
                return false;
        for (size_t i = 0; i < n; i++)
                if (label[i] <= ' ' || label[i] >= 0x7f)
                        return false;
        return true;
}

/* The next selector of *p into buf; false at the end. */
static bool next_selector(const char **p, char *buf, size_t n, bool *too_long) {
        const char *s = *p;
        while (*s == ' ' || *s == '\t')
                s++;
        if (!*s)
                return false;
        size_t l = strcspn(s, " \t");
        *too_long = l >= n;
        l = l >= n ? n - 1 : l;
        memcpy(buf, s, l);
        buf[l] = 0;
        *p = s + strcspn(s, " \t");
        return true;
}

static int check_one(const char *sel, const char **why) {
        const char *v;
        if (strcmp(sel, "*") == 0)
                return 0;
        if ((v = strchr(sel, ':')) == NULL || v[1] == 0) {
                *why = "expected *, name:GLOB, role:ROLE, model:GLOB, device:GLOB or label:LABEL";
                return -EINVAL;
        }
        v++;
        size_t k = (size_t)(v - sel - 1);
        if (k == 4 && strncmp(sel, "role", 4) == 0) {
                for (size_t i = 0; i < sizeof roles / sizeof roles[0]; i++)
                        if (strcmp(v, roles[i]) == 0)
                                return 0;
                *why = "role: expects encoder, prefill, decode or colocated";
                return -EINVAL;
        }
        if (k == 5 && strncmp(sel, "label", 5) == 0) {
                if (!pool_select_label_valid(v)) {
                        *why = "label: expects 1 to 63 printable characters";
                        return -EINVAL;
                }
                return 0;
        }
        if ((k == 4 && strncmp(sel, "name", 4) == 0) || (k == 5 && strncmp(sel, "model", 5) == 0) ||
            (k == 6 && strncmp(sel, "device", 6) == 0))
                return 0;
        *why = "unknown selector kind (name, role, model, device or label)";
        return -EINVAL;
}

int pool_select_validate(const char *list, char *bad_buf, size_t bad_len, const char **ret_why) {
        char sel[512];
        bool too_long = false;
        const char *why = NULL;

        if (!list || strlen(list) >= POOL_SELECT_MAX) {
                why = "the list is too long";
                goto bad;
        }
        for (const char *p = list; next_selector(&p, sel, sizeof sel, &too_long);) {
                if (too_long) {
                        why = "a selector is too long";
                        goto bad_sel;
                }
                if (check_one(sel, &why) < 0)
                        goto bad_sel;
        }
        return 0;
bad_sel:
        if (bad_buf && bad_len)
                snprintf(bad_buf, bad_len, "%s", sel);
        if (ret_why)
                *ret_why = why;
        return -EINVAL;
bad:
        if (bad_buf && bad_len)
                bad_buf[0] = 0;
        if (ret_why)
                *ret_why = why;
        return -EINVAL;
}

static bool glob(const char *pattern, const char *s) {
        return s && fnmatch(pattern, s, 0) == 0;
}

static bool match_one(const char *sel, const PoolSelectWorker *w) {
        if (strcmp(sel, "*") == 0)
                return true;
        const char *v = strchr(sel, ':');
        if (!v)
                return false;
        size_t k = (size_t)(v - sel);
        v++;
        if (k == 4 && strncmp(sel, "name", 4) == 0)
                return glob(v, w->name);
        if (k == 4 && strncmp(sel, "role", 4) == 0)
                return w->role && strcmp(v, w->role) == 0;
        if (k == 5 && strncmp(sel, "model", 5) == 0)
                return glob(v, w->model);
        if (k == 6 && strncmp(sel, "device", 6) == 0)
                return glob(v, w->device);
        if (k == 5 && strncmp(sel, "label", 5) == 0) {
                for (size_t i = 0; i < w->n_labels; i++)
                        if (w->labels[i] && strcmp(w->labels[i], v) == 0)
                                return true;
                return false;
        }
        return false;
}

bool pool_select_match(const char *list, const PoolSelectWorker *w) {
        char sel[512];
        bool too_long = false, any = false;

        if (!list)
                return true;
        for (const char *p = list; next_selector(&p, sel, sizeof sel, &too_long);) {
                any = true;
                if (!too_long && match_one(sel, w))
                        return true;
        }
        return !any;
}
