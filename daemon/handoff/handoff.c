/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "handoff/handoff.h"
#include "macro.h"

#define _fallthrough_ __attribute__((fallthrough))

static bool state_is_live(HandoffState s) {
        return s == HANDOFF_PREPARING || s == HANDOFF_PREPARED || s == HANDOFF_TRANSFERRING ||
               s == HANDOFF_TRANSFERRED;
}

static bool group_is_complete(HandoffGroupState s) {
        return s == HANDOFF_GROUP_SENT || s == HANDOFF_GROUP_RECEIVED;
}

int handoff_new(HandoffRole role, const EpdId *request_id, uint64_t token, uint32_t n_groups,
                const uint64_t *bytes_per_group, usec_t now, usec_t timeout, Handoff **ret) {
        if (role < 0 || role >= _HANDOFF_ROLE_MAX || !request_id || !ret)
                return -EINVAL;
        if (epd_id_is_null(request_id) || token == 0)
                return -EINVAL;
        if (n_groups == 0 || n_groups > HANDOFF_GROUPS_MAX)
                return -EINVAL;

        Handoff *h = calloc(1, sizeof *h);
        if (!h)
                return -ENOMEM;
        h->groups = calloc(n_groups, sizeof *h->groups);
        if (!h->groups) {
                free(h);
                return -ENOMEM;
        }

        uint64_t total = 0;
        for (uint32_t g = 0; g < n_groups; g++) {
                uint64_t b = bytes_per_group ? bytes_per_group[g] : 0;
                if (ADD_OVERFLOW(total, b, &total)) {
                        handoff_free(h);
                        return -EOVERFLOW;
                }
                h->groups[g].bytes_expected = b;
        }

        h->role = role;
        h->state = role == HANDOFF_SOURCE ? HANDOFF_PREPARING : HANDOFF_PREPARED;
        h->request_id = *request_id;
        h->token = token;
        h->n_groups = n_groups;
        h->bytes_total = total;
        h->created_usec = now;
        if (timeout == 0 || timeout == USEC_INFINITY || ADD_OVERFLOW(now, timeout, &h->deadline_usec))
                h->deadline_usec = USEC_INFINITY;

        *ret = h;
        return 0;
}

Handoff *handoff_free(Handoff *h) {
        if (!h)
                return NULL;
        free(h->groups);
        free(h);
        return NULL;
}

bool handoff_is_live(const Handoff *h) {
        return h && state_is_live(h->state);
}

bool handoff_is_ended(const Handoff *h) {
        return h && (h->state == HANDOFF_ROLLED_BACK || h->state == HANDOFF_RELEASED);
}

bool handoff_can_free(const Handoff *h) {
        return handoff_is_ended(h) && h->inflight == 0;
}

bool handoff_matches(const Handoff *h, const EpdId *request_id, uint64_t token) {
        return h && request_id && epd_id_equal(&h->request_id, request_id) && h->token == token;
}

static void update_progress(Handoff *h) {
        while (h->n_done < h->n_groups &&
               group_is_complete(h->groups[h->n_done].state))
                h->n_done++;
        if (h->n_complete == h->n_groups &&
            (h->state == HANDOFF_PREPARED || h->state == HANDOFF_TRANSFERRING))
                h->state = HANDOFF_TRANSFERRED;
}

static void group_complete(Handoff *h, uint32_t g, HandoffGroupState s) {
        h->groups[g].state = s;
        h->n_complete++;
        update_progress(h);
}

static void start_transfer(Handoff *h) {
        if (h->state == HANDOFF_PREPARED)
                h->state = HANDOFF_TRANSFERRING;
}

int handoff_prepared(Handoff *h) {
        if (!h)
                return -EINVAL;
        if (h->role != HANDOFF_SOURCE)
                return -EPERM;
        switch (h->state) {
        case HANDOFF_PREPARING:
                h->state = HANDOFF_PREPARED;
                return 1;
        case HANDOFF_PREPARED:
        case HANDOFF_TRANSFERRING:
        case HANDOFF_TRANSFERRED:
        case HANDOFF_COMMITTED:
                return 0;
        default:
                return -ESTALE;
        }
}

int handoff_group_ready(Handoff *h, uint32_t g) {
        if (!h)
                return -EINVAL;
        if (h->role != HANDOFF_SOURCE)
                return -EPERM;
        if (g >= h->n_groups)
                return -EINVAL;
        if (handoff_is_ended(h))
                return -ESTALE;
        if (g < h->n_ready)
                return 0;
        if (g > h->n_ready)
                return -EINVAL; /* out of order */
        /* g == n_ready < n_groups: cannot be TRANSFERRED or COMMITTED (those need every
         * group ready), so the handoff is PREPARING, PREPARED or TRANSFERRING here. */
        h->groups[g].state = HANDOFF_GROUP_READY;
        h->n_ready++;
        return 1;
}

int handoff_next_to_post(const Handoff *h, uint32_t *ret) {
        if (!h || !ret)
                return -EINVAL;
        if (h->role != HANDOFF_SOURCE)
                return -EPERM;
        if (h->state != HANDOFF_PREPARED && h->state != HANDOFF_TRANSFERRING)
                return -EAGAIN;
        if (h->n_posted >= h->n_ready)
                return -EAGAIN;
        *ret = h->n_posted;
        return 0;
}

uint32_t handoff_ready_unposted(const Handoff *h, uint32_t *ret_first) {
        uint32_t g;
        if (handoff_next_to_post(h, &g) < 0)
                return 0;
        *ret_first = g;
        return h->n_ready - g;
}

int handoff_group_posted(Handoff *h, uint32_t g, uint32_t n_writes) {
        if (!h)
                return -EINVAL;
        if (h->role != HANDOFF_SOURCE)
                return -EPERM;
        if (g >= h->n_groups)
                return -EINVAL;
        if (g < h->n_posted)
                return 0;
        if (handoff_is_ended(h))
                return -ESTALE;
        if (h->state != HANDOFF_PREPARED && h->state != HANDOFF_TRANSFERRING)
                return -EBUSY;
        if (g != h->n_posted || h->groups[g].state != HANDOFF_GROUP_READY)
                return -EINVAL; /* not ready, or out of order */

        h->n_posted++;
        start_transfer(h);
        h->groups[g].state = HANDOFF_GROUP_POSTED;
        h->groups[g].writes_pending = n_writes;
        h->inflight += n_writes;
        if (n_writes == 0)
                group_complete(h, g, HANDOFF_GROUP_SENT);
        return 1;
}

int handoff_writes_done(Handoff *h, uint32_t g, uint32_t n, uint64_t bytes, int error) {
        if (!h)
                return -EINVAL;
        if (h->role != HANDOFF_SOURCE)
                return -EPERM;
        if (g >= h->n_groups || n == 0 || h->groups[g].writes_pending < n)
                return -EINVAL;

        HandoffGroup *gr = &h->groups[g];
        gr->writes_pending -= n;
        h->inflight -= n;

        if (!handoff_is_live(h))
                return 1; /* accounted; nothing else to do */
        if (error != 0) {
                (void)handoff_rollback(h, HANDOFF_CAUSE_TRANSFER_FAILED, false);
                return 1;
        }
        if (ADD_OVERFLOW(gr->bytes_done, bytes, &gr->bytes_done) ||
            gr->bytes_done > gr->bytes_expected) {
                (void)handoff_rollback(h, HANDOFF_CAUSE_TRANSFER_FAILED, false);
                return 1;
        }
        if (gr->writes_pending == 0 && gr->state == HANDOFF_GROUP_POSTED) {
                if (gr->bytes_done != gr->bytes_expected) {
                        (void)handoff_rollback(h, HANDOFF_CAUSE_TRANSFER_FAILED, false);
                        return 1;
                }
                group_complete(h, g, HANDOFF_GROUP_SENT);
        }
        return 1;
}

bool handoff_may_land(const Handoff *h, uint32_t g) {
        return h && h->role == HANDOFF_DESTINATION &&
               (h->state == HANDOFF_PREPARED || h->state == HANDOFF_TRANSFERRING) &&
               g < h->n_groups && h->groups[g].state == HANDOFF_GROUP_PENDING;
}

static void try_receive(Handoff *h, uint32_t g) {
        HandoffGroup *gr = &h->groups[g];
        if (gr->state == HANDOFF_GROUP_PENDING && gr->notice && gr->writes_pending == 0 &&
            gr->bytes_done == gr->bytes_expected)
                group_complete(h, g, HANDOFF_GROUP_RECEIVED);
}

int handoff_writes_landing(Handoff *h, uint32_t g, uint32_t n) {
        if (!h)
                return -EINVAL;
        if (h->role != HANDOFF_DESTINATION)
                return -EPERM;
        if (g >= h->n_groups || n == 0 || h->groups[g].writes_pending > UINT32_MAX - n)
                return -EINVAL;
        if (!handoff_is_live(h))
                return -ESTALE;
        if (!handoff_may_land(h, g))
                return -EINVAL; /* group already complete */
        start_transfer(h);
        h->groups[g].writes_pending += n;
        h->inflight += n;
        return 1;
}

int handoff_writes_landed(Handoff *h, uint32_t g, uint32_t n, uint64_t bytes, int error) {
        if (!h)
                return -EINVAL;
        if (h->role != HANDOFF_DESTINATION)
                return -EPERM;
        if (g >= h->n_groups || n == 0 || h->groups[g].writes_pending < n)
                return -EINVAL;

        HandoffGroup *gr = &h->groups[g];
        gr->writes_pending -= n;
        h->inflight -= n;

        if (!handoff_is_live(h))
                return 1;
        if (error != 0) {
                (void)handoff_rollback(h, HANDOFF_CAUSE_TRANSFER_FAILED, false);
                return 1;
        }
        if (ADD_OVERFLOW(gr->bytes_done, bytes, &gr->bytes_done) ||
            gr->bytes_done > gr->bytes_expected) {
                (void)handoff_rollback(h, HANDOFF_CAUSE_PROTOCOL, false);
                return 1;
        }
        try_receive(h, g);
        return 1;
}

int handoff_group_handed_over(Handoff *h, uint32_t g) {
        if (!h)
                return -EINVAL;
        if (h->role != HANDOFF_DESTINATION)
                return -EPERM;
        if (g >= h->n_groups)
                return -EINVAL;
        if (h->groups[g].state == HANDOFF_GROUP_RECEIVED)
                return 0;
        if (!handoff_is_live(h))
                return -ESTALE;
        if (h->groups[g].writes_pending > 0 || h->groups[g].bytes_done > 0)
                return -EBUSY; /* copied writes into it: not a handover */
        start_transfer(h);
        h->groups[g].bytes_done = h->groups[g].bytes_expected;
        h->groups[g].notice = true;
        try_receive(h, g);
        return 1;
}

int handoff_group_sent_notice(Handoff *h, uint32_t g, uint64_t bytes) {
        if (!h)
                return -EINVAL;
        if (h->role != HANDOFF_DESTINATION)
                return -EPERM;
        if (g >= h->n_groups)
                return -EINVAL;
        HandoffGroup *gr = &h->groups[g];
        if (gr->notice)
                return bytes == gr->bytes_expected ? 0 : -EINVAL;
        if (!handoff_is_live(h))
                return -ESTALE;
        if (bytes != gr->bytes_expected)
                return -EINVAL;
        start_transfer(h);
        gr->notice = true;
        try_receive(h, g);
        return 1;
}

int handoff_take_progress(Handoff *h, uint32_t *from, uint32_t *to) {
        if (!h || !from || !to)
                return -EINVAL;
        *from = *to = h->n_notified;
        if (handoff_is_ended(h) || h->n_done == h->n_notified)
                return 0;
        *to = h->n_done;
        h->n_notified = h->n_done;
        return 1;
}

int handoff_accept(Handoff *h, uint64_t client) {
        if (!h || client == 0)
                return -EINVAL;
        if (h->role != HANDOFF_DESTINATION)
                return -EPERM;
        switch (h->state) {
        case HANDOFF_PREPARED:
        case HANDOFF_TRANSFERRING:
        case HANDOFF_TRANSFERRED:
                if (h->accepted_by == 0) {
                        h->accepted_by = client;
                        return 1;
                }
                _fallthrough_;
        case HANDOFF_COMMITTED:
                return h->accepted_by == client ? 0 : -EPERM;
        default:
                return -ESTALE;
        }
}

int handoff_commit(Handoff *h, uint64_t client) {
        if (!h)
                return -EINVAL;
        if (h->role == HANDOFF_SOURCE ? client != 0 : client == 0)
                return -EPERM;

        if (handoff_is_ended(h))
                return -ESTALE;
        if (h->role == HANDOFF_DESTINATION) {
                if (h->accepted_by == 0)
                        return -EBUSY;
                if (h->accepted_by != client)
                        return -EPERM;
        }
        switch (h->state) {
        case HANDOFF_TRANSFERRED:
                h->state = HANDOFF_COMMITTED;
                return 1;
        case HANDOFF_COMMITTED:
                return 0;
        default:
                return -EBUSY;
        }
}

int handoff_rollback(Handoff *h, HandoffCause cause, bool remote) {
        if (!h || cause <= HANDOFF_CAUSE_NONE || cause >= _HANDOFF_CAUSE_MAX)
                return -EINVAL;
        switch (h->state) {
        case HANDOFF_PREPARING:
        case HANDOFF_PREPARED:
        case HANDOFF_TRANSFERRING:
        case HANDOFF_TRANSFERRED:
                h->state = HANDOFF_ROLLED_BACK;
                h->cause = cause;
                h->remote_rolled_back = remote;
                return 1;
        case HANDOFF_ROLLED_BACK:
                return 0;
        case HANDOFF_COMMITTED:
                return -EALREADY;
        default:
                return -ESTALE;
        }
}

int handoff_release(Handoff *h) {
        if (!h)
                return -EINVAL;
        switch (h->state) {
        case HANDOFF_RELEASED:
                return 0;
        case HANDOFF_COMMITTED:
        case HANDOFF_ROLLED_BACK:
                h->state = HANDOFF_RELEASED;
                return 1;
        default:
                (void)handoff_rollback(h, HANDOFF_CAUSE_REQUESTED, false);
                h->state = HANDOFF_RELEASED;
                return 1;
        }
}

int handoff_check_timeout(Handoff *h, usec_t now) {
        if (!h)
                return -EINVAL;
        if (!handoff_is_live(h) || h->deadline_usec == USEC_INFINITY || now < h->deadline_usec)
                return 0;
        return handoff_rollback(h, HANDOFF_CAUSE_TIMEOUT, false);
}

static const char *const role_table[_HANDOFF_ROLE_MAX] = {
        [HANDOFF_SOURCE] = "source",
        [HANDOFF_DESTINATION] = "destination",
};

static const char *const state_table[_HANDOFF_STATE_MAX] = {
        [HANDOFF_PREPARING] = "preparing",
        [HANDOFF_PREPARED] = "prepared",
        [HANDOFF_TRANSFERRING] = "transferring",
        [HANDOFF_TRANSFERRED] = "transferred",
        [HANDOFF_COMMITTED] = "committed",
        [HANDOFF_RELEASED] = "released",
        [HANDOFF_ROLLED_BACK] = "rolled-back",
};

static const char *const group_state_table[_HANDOFF_GROUP_STATE_MAX] = {
        [HANDOFF_GROUP_PENDING] = "pending",
        [HANDOFF_GROUP_READY] = "ready",
        [HANDOFF_GROUP_POSTED] = "posted",
        [HANDOFF_GROUP_SENT] = "sent",
        [HANDOFF_GROUP_RECEIVED] = "received",
};

static const char *const cause_table[_HANDOFF_CAUSE_MAX] = {
        [HANDOFF_CAUSE_NONE] = "none",
        [HANDOFF_CAUSE_REQUESTED] = "requested",
        [HANDOFF_CAUSE_TIMEOUT] = "timeout",
        [HANDOFF_CAUSE_PEER_DOWN] = "peer-down",
        [HANDOFF_CAUSE_WORKER_GONE] = "worker-gone",
        [HANDOFF_CAUSE_TRANSFER_FAILED] = "transfer-failed",
        [HANDOFF_CAUSE_NO_SPACE] = "no-space",
        [HANDOFF_CAUSE_REFUSED] = "refused",
        [HANDOFF_CAUSE_REMOTE] = "remote",
        [HANDOFF_CAUSE_SHUTDOWN] = "shutdown",
        [HANDOFF_CAUSE_PROTOCOL] = "protocol",
};

static const char *table_lookup(const char *const *t, size_t n, int i) {
        return i >= 0 && (size_t)i < n ? t[i] : NULL;
}

static int table_find(const char *const *t, size_t n, const char *s) {
        if (!s)
                return -EINVAL;
        for (size_t i = 0; i < n; i++)
                if (t[i] && strcmp(t[i], s) == 0)
                        return (int)i;
        return -EINVAL;
}

const char *handoff_role_to_string(HandoffRole r) {
        return table_lookup(role_table, ELEMENTSOF(role_table), r);
}
const char *handoff_state_to_string(HandoffState s) {
        return table_lookup(state_table, ELEMENTSOF(state_table), s);
}
int handoff_state_from_string(const char *s) {
        return table_find(state_table, ELEMENTSOF(state_table), s);
}
const char *handoff_group_state_to_string(HandoffGroupState s) {
        return table_lookup(group_state_table, ELEMENTSOF(group_state_table), s);
}
const char *handoff_cause_to_string(HandoffCause c) {
        return table_lookup(cause_table, ELEMENTSOF(cause_table), c);
}
int handoff_cause_from_string(const char *s) {
        return table_find(cause_table, ELEMENTSOF(cause_table), s);
}

int handoff_group_layout_validate(const HandoffGroupLayout *l, uint64_t page_size) {
        if (!l || page_size == 0)
                return -EINVAL;
        if (l->n_ranges == 0 || l->n_ranges > HANDOFF_RANGES_PER_GROUP_MAX)
                return -EINVAL;
        uint64_t prev_end = 0;
        for (uint32_t i = 0; i < l->n_ranges; i++) {
                uint64_t end;
                if (l->ranges[i].length == 0)
                        return -EINVAL;
                if (ADD_OVERFLOW(l->ranges[i].offset, l->ranges[i].length, &end) || end > page_size)
                        return -EINVAL;
                if (i > 0 && l->ranges[i].offset < prev_end)
                        return -EINVAL; /* unsorted or overlapping */
                prev_end = end;
        }
        return 0;
}

uint64_t handoff_group_layout_bytes(const HandoffGroupLayout *l) {
        uint64_t sum = 0;
        for (uint32_t i = 0; l && i < l->n_ranges && i < HANDOFF_RANGES_PER_GROUP_MAX; i++)
                sum += l->ranges[i].length;
        return sum;
}

static int emit_sliced(const HandoffSlice *w, uint64_t max_slice, handoff_slice_fn emit,
                       void *userdata, int *count) {
        uint64_t done = 0;
        while (done < w->length) {
                uint64_t n = w->length - done;
                if (max_slice > 0 && n > max_slice)
                        n = max_slice;
                HandoffSlice s = {
                        .src_offset = w->src_offset + done,
                        .dst_offset = w->dst_offset + done,
                        .length = n,
                };
                int r = emit(&s, userdata);
                if (r < 0)
                        return r;
                if (*count == INT32_MAX)
                        return -E2BIG;
                (*count)++;
                done += n;
        }
        return 0;
}

int handoff_plan_group(const HandoffGroupLayout *layout, const uint64_t *src_pages,
                       const uint64_t *dst_pages, uint32_t n_pages, uint64_t max_slice,
                       handoff_slice_fn emit, void *userdata) {
        if (!layout || !emit || (n_pages > 0 && (!src_pages || !dst_pages)))
                return -EINVAL;
        if (layout->n_ranges == 0 || layout->n_ranges > HANDOFF_RANGES_PER_GROUP_MAX)
                return -EINVAL;

        HandoffSlice pending = {};
        bool have = false;
        int count = 0, r;

        for (uint32_t i = 0; i < n_pages; i++)
                for (uint32_t k = 0; k < layout->n_ranges; k++) {
                        const HandoffRange *rg = &layout->ranges[k];
                        HandoffSlice c = { .length = rg->length };
                        uint64_t end;
                        if (ADD_OVERFLOW(src_pages[i], rg->offset, &c.src_offset) ||
                            ADD_OVERFLOW(dst_pages[i], rg->offset, &c.dst_offset) ||
                            ADD_OVERFLOW(c.src_offset, c.length, &end) ||
                            ADD_OVERFLOW(c.dst_offset, c.length, &end))
                                return -EOVERFLOW;
                        if (c.length == 0)
                                continue;
                        if (have && pending.src_offset + pending.length == c.src_offset &&
                            pending.dst_offset + pending.length == c.dst_offset &&
                            !ADD_OVERFLOW(pending.length, c.length, &end)) {
                                pending.length = end;
                                continue;
                        }
                        if (have) {
                                r = emit_sliced(&pending, max_slice, emit, userdata, &count);
                                if (r < 0)
                                        return r;
                        }
                        pending = c;
                        have = true;
                }
        if (have) {
                r = emit_sliced(&pending, max_slice, emit, userdata, &count);
                if (r < 0)
                        return r;
        }
        return count;
}

uint64_t handoff_next_token(uint64_t last, usec_t realtime_now) {
        uint64_t t = last + 1;
        if (realtime_now > t)
                t = realtime_now;
        return t == 0 ? 1 : t;
}
