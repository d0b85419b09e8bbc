/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* libepd: admission (org.epd1.Scheduler; docs/scheduler.md). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "epd-internal.h"
#include "macro.h"

static void copy_path(char *dst, size_t n, const char *src) {
        /* "/" means the stage is not used. */
        if (!src || strcmp(src, "/") == 0)
                dst[0] = 0;
        else {
                strncpy(dst, src, n - 1);
                dst[n - 1] = 0;
        }
}

int epd_admit(epd_client *c, const char *request_id, const char *task_type, uint64_t deadline_usec,
              uint64_t pages_needed, bool multimodal, epd_admission *ret) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *m = NULL, *reply = NULL;
        const char *verdict, *reason, *e, *p, *d;
        uint64_t retry, predicted;
        int32_t prio;
        int r;

        if (!c || !request_id || !task_type || !ret)
                return epd__error(c, -EINVAL, NULL);
        r = epd__new_call(c, "/org/epd1", "org.epd1.Scheduler", "Admit", &m);
        if (r < 0)
                return r;
        r = sd_bus_message_append(m, "sst", request_id, task_type, deadline_usec);
        if (r >= 0)
                r = sd_bus_message_append(m, "a{sv}", 2, "PagesNeeded", "t", pages_needed, "Multimodal", "b",
                                          (int)multimodal);
        if (r < 0)
                return epd__error(c, r, NULL);
        r = epd__send(c, m, &reply);
        if (r < 0)
                return r;
        r = sd_bus_message_read(reply, "sstti" "ooo", &verdict, &reason, &retry, &predicted, &prio, &e, &p, &d);
        if (r < 0)
                return epd__error(c, r, NULL);
        *ret = (epd_admission){ .retry_after_usec = retry, .predicted_usec = predicted, .priority = prio };
        ret->verdict = strcmp(verdict, "admit") == 0 ? EPD_ADMIT : strcmp(verdict, "defer") == 0 ? EPD_DEFER : EPD_REJECT;
        copy_path(ret->reason, sizeof ret->reason, reason);
        copy_path(ret->encoder, sizeof ret->encoder, e);
        copy_path(ret->prefill, sizeof ret->prefill, p);
        copy_path(ret->decode, sizeof ret->decode, d);
        return 0;
}

int epd_complete(epd_client *c, const char *request_id, const char *stage, uint64_t service_usec, bool ok) {
        if (!c || !request_id || !stage)
                return epd__error(c, -EINVAL, NULL);
        return epd__call(c, "/org/epd1", "org.epd1.Scheduler", "Complete", NULL, "sstb", request_id, stage,
                         service_usec, (int)ok);
}

int epd_configure_worker(epd_client *c, uint32_t slots, uint32_t queue_limit, uint64_t free_pages) {
        if (!c || !c->worker_path)
                return epd__error(c, -ENOTCONN, NULL);
        return epd__call(c, "/org/epd1", "org.epd1.Scheduler", "ConfigureWorker", NULL, "oa{sv}",
                         c->worker_path, 3, "Slots", "u", slots, "QueueLimit", "u", queue_limit, "FreePages",
                         "t", free_pages);
}

int epd_configure_worker_host(epd_client *c, const char *host) {
        if (!c || !c->worker_path)
                return epd__error(c, -ENOTCONN, NULL);
        return epd__call(c, "/org/epd1", "org.epd1.Scheduler", "ConfigureWorker", NULL, "oa{sv}",
                         c->worker_path, 1, "Host", "s", host ? host : "");
}
