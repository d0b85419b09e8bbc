/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <netlink/netlink.h>
#include <netlink/route/link.h>
#include <netlink/route/route.h>
#include <netlink/route/rtnl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "hashmap.h"
#include "log.h"
#include "macro.h"
#include "peer/peer-manager.h"
#include "peer/topology.h"
#include "transport/rdma-select.h"
#include "transport/rdma.h"

#define REFRESH_DELAY_USEC (20 * USEC_PER_MSEC)
#define REFRESH_DELAY_MAX_USEC (200 * USEC_PER_MSEC)
#define MAX_GPUS 64
#define MAX_NICS 64

struct Topology {
        sd_event *event;
        PeerManager *pm;
        struct nl_sock *query;      /* synchronous RTM_GETROUTE / RTM_GETLINK */
        struct nl_sock *monitor;    /* multicast: link, address, route changes */
        sd_event_source *monitor_source;
        sd_event_source *refresh_timer;
        /* One path per peer, in the PeerManager's order (peers are only ever appended),
         * and by host id: keys point into paths[i].host_id, so the map is rebuilt
         * whenever the array moves. */
        TopologyPath *paths;
        size_t n_paths, n_paths_allocated;
        Hashmap *by_host_id;
        size_t resolved; /* paths the last refresh asked the kernel about */
        usec_t refresh_first; /* when the armed refresh_timer was first armed */
        TopologyGpu *gpus;
        size_t n_gpus;
        uint64_t events;
        /* RDMA ports and the netdevs they carry (transport/rdma.c), and the policy. */
        RdmaLink rdma[RDMA_MAX_LINKS];
        size_t n_rdma;
        bool rdma_logged_none;
        TransportPolicy policy;
};

/* libnl reports -NLE_* codes; normalise to errno at the boundary. */
static int nl_errno(int nle) {
        switch (-nle) {
        case 0: return 0;
        case NLE_NOMEM: return -ENOMEM;
        case NLE_OBJ_NOTFOUND: return -ENOENT;
        case NLE_NOADDR: return -EADDRNOTAVAIL;
        case NLE_PERM: return -EPERM;
        case NLE_AGAIN: return -EAGAIN;
        case NLE_INVAL: return -EINVAL;
        default: return -EIO;
        }
}

/* Copies with truncation (names and paths from sysfs are bounded by their buffers). */
static void copy_str(char *dst, size_t n, const char *src) {
        size_t l = strnlen(src, n - 1);
        memcpy(dst, src, l);
        dst[l] = 0;
}

static int read_int_file(const char *path, int def) {
        FILE *f = fopen(path, "re");
        int v;

        if (!f)
                return def;
        if (fscanf(f, "%d", &v) != 1)
                v = def;
        fclose(f);
        return v;
}

static void read_str_file(const char *path, char *buf, size_t n) {
        FILE *f = fopen(path, "re");

        buf[0] = 0;
        if (!f)
                return;
        if (!fgets(buf, (int)n, f))
                buf[0] = 0;
        buf[strcspn(buf, "\n")] = 0;
        fclose(f);
}

/* Fills a NIC description from /sys/class/net/IF. */
static void nic_from_sysfs(const char *ifname, TopoDevice *d) {
        char p[PATH_MAX], real[PATH_MAX];
        DIR *dir;
        struct dirent *de;

        *d = (TopoDevice){ .numa_node = -1 };
        copy_str(d->name, sizeof d->name, ifname);
        snprintf(p, sizeof p, "/sys/class/net/%s/device", ifname);
        if (!realpath(p, real))
                return; /* virtual: veth, bridge, lo */
        copy_str(d->path, sizeof d->path, real);
        snprintf(p, sizeof p, "/sys/class/net/%s/device/numa_node", ifname);
        d->numa_node = read_int_file(p, -1);
        snprintf(p, sizeof p, "/sys/class/net/%s/device/infiniband", ifname);
        dir = opendir(p);
        if (dir) {
                while ((de = readdir(dir)))
                        if (de->d_name[0] != '.') {
                                d->rdma = true;
                                copy_str(d->rdma_name, sizeof d->rdma_name, de->d_name);
                                break;
                        }
                closedir(dir);
        }
}

static void discover_gpus(Topology *t) {
        TopoDevice nics[MAX_NICS];
        size_t n_nics = 0;
        DIR *dir;
        struct dirent *de;

        free(t->gpus);
        t->gpus = NULL;
        t->n_gpus = 0;

        dir = opendir("/sys/class/net");
        if (dir) {
                while ((de = readdir(dir)) && n_nics < MAX_NICS) {
                        if (de->d_name[0] == '.')
                                continue;
                        nic_from_sysfs(de->d_name, nics + n_nics);
                        if (nics[n_nics].path[0])
                                n_nics++;
                }
                closedir(dir);
        }

        dir = opendir("/sys/bus/pci/devices");
        if (!dir)
                return;
        t->gpus = calloc(MAX_GPUS, sizeof *t->gpus);
        if (!t->gpus) {
                closedir(dir);
                return;
        }
        while ((de = readdir(dir)) && t->n_gpus < MAX_GPUS) {
                char p[PATH_MAX], real[PATH_MAX], cls[32], vendor[32];
                TopoDevice gpu = { .numa_node = -1 };
                TopologyGpu *g;
                int k;

                if (de->d_name[0] == '.')
                        continue;
                snprintf(p, sizeof p, "/sys/bus/pci/devices/%s/class", de->d_name);
                read_str_file(p, cls, sizeof cls);
                snprintf(p, sizeof p, "/sys/bus/pci/devices/%s/vendor", de->d_name);
                read_str_file(p, vendor, sizeof vendor);
                /* 3D controllers, and VGA controllers of GPU compute vendors. */
                if (strncmp(cls, "0x0302", 6) != 0 &&
                    !(strncmp(cls, "0x0300", 6) == 0 && (strcmp(vendor, "0x10de") == 0 || strcmp(vendor, "0x1002") == 0)))
                        continue;
                snprintf(p, sizeof p, "/sys/bus/pci/devices/%s", de->d_name);
                if (!realpath(p, real))
                        continue;
                copy_str(gpu.name, sizeof gpu.name, de->d_name);
                copy_str(gpu.path, sizeof gpu.path, real);
                snprintf(p, sizeof p, "/sys/bus/pci/devices/%s/numa_node", de->d_name);
                gpu.numa_node = read_int_file(p, -1);

                g = t->gpus + t->n_gpus++;
                copy_str(g->pci, sizeof g->pci, de->d_name);
                g->numa_node = gpu.numa_node;
                k = topology_pick_nic(&gpu, nics, n_nics, g->reason, sizeof g->reason);
                if (k >= 0)
                        copy_str(g->nic, sizeof g->nic, nics[k].name);
                else
                        snprintf(g->reason, sizeof g->reason, "no physical NIC found");
        }
        closedir(dir);
}

static void format_addr(struct nl_addr *a, char *buf, size_t n) {
        buf[0] = 0;
        if (!a || nl_addr_iszero(a))
                return;
        nl_addr2str(a, buf, n);
        /* Host routes print as "10.0.0.2/32"; keep the address. */
        buf[strcspn(buf, "/")] = 0;
}

/* Re-reads the RDMA ports (a port goes down with its netdev; rxe devices come and go). */
static void discover_rdma(Topology *t) {
        RdmaLink links[RDMA_MAX_LINKS];
        int n = rdma_discover(links, ELEMENTSOF(links), &t->rdma_logged_none);

        if (n < 0)
                n = 0;
        if ((size_t)n == t->n_rdma && memcmp(links, t->rdma, (size_t)n * sizeof *links) == 0)
                return;
        for (int i = 0; i < n; i++)
                log_info("rdma: device %s port %u carries %s (GID index %d, %s)", links[i].device, links[i].port,
                         links[i].netdev, links[i].gid_index, links[i].state);
        memcpy(t->rdma, links, (size_t)n * sizeof *links);
        t->n_rdma = (size_t)n;
}

static void resolve_path(Topology *t, Peer *p, TopologyPath *path) {
        char host[INET6_ADDRSTRLEN + 1] = "";
        const char *addr = peer_address(p), *colon;
        struct nl_addr *dst = NULL;
        struct rtnl_route *route = NULL;
        struct rtnl_link *link = NULL;
        TopologyPath old = *path;
        TopoDevice nic;
        int r;

        *path = (TopologyPath){ .numa_node = -1, .transport = TRANSPORT_TCP, .changes = old.changes };
        copy_str(path->host_id, sizeof path->host_id, peer_host_id(p));

        if (addr[0] == '[') {
                colon = strchr(addr, ']');
                if (colon)
                        snprintf(host, sizeof host, "%.*s", (int)(colon - addr - 1), addr + 1);
        } else {
                colon = strrchr(addr, ':');
                if (colon)
                        snprintf(host, sizeof host, "%.*s", (int)(colon - addr), addr);
        }
        r = nl_addr_parse(host, AF_UNSPEC, &dst);
        if (r < 0) {
                snprintf(path->reason, sizeof path->reason, "cannot parse peer address '%s'", addr);
                goto finish;
        }
        r = rtnl_route_lookup(t->query, dst, &route);
        if (r < 0 || !route) {
                /* The kernel's ENETUNREACH reaches libnl as a generic failure. */
                snprintf(path->reason, sizeof path->reason, "no route to %s%s%s", host,
                         r < 0 && r != -NLE_FAILURE ? ": " : "", r < 0 && r != -NLE_FAILURE ? nl_geterror(r) : "");
                goto finish;
        }
        if (rtnl_route_get_nnexthops(route) > 0) {
                struct rtnl_nexthop *nh = rtnl_route_nexthop_n(route, 0);
                path->ifindex = rtnl_route_nh_get_ifindex(nh);
                format_addr(rtnl_route_nh_get_gateway(nh), path->gateway, sizeof path->gateway);
        }
        format_addr(rtnl_route_get_pref_src(route), path->src, sizeof path->src);
        if (path->ifindex > 0 && rtnl_link_get_kernel(t->query, path->ifindex, NULL, &link) >= 0) {
                unsigned flags = rtnl_link_get_flags(link);
                copy_str(path->ifname, sizeof path->ifname, rtnl_link_get_name(link));
                path->link_up = (flags & IFF_UP) && (flags & IFF_RUNNING);
        }
        if (!path->ifname[0]) {
                snprintf(path->reason, sizeof path->reason, "route to %s has no interface", host);
                goto finish;
        }
        if (path->ifindex == 1 || strcmp(path->ifname, "lo") == 0) {
                snprintf(path->reason, sizeof path->reason, "%s is this host (loopback): tcp over lo", host);
                goto finish;
        }
        nic_from_sysfs(path->ifname, &nic);
        path->numa_node = nic.numa_node;
        topology_pci_address(nic.path, path->pci, sizeof path->pci);
        copy_str(path->rdma, sizeof path->rdma, nic.rdma_name);
        {
                const RdmaLink *rl = rdma_link_for_netdev(t->rdma, t->n_rdma, path->ifname);
                char via[96] = "", numa[24] = "", choice[256];
                bool warn = false;
                RdmaPeerInfo ri;

                if (rl)
                        copy_str(path->rdma, sizeof path->rdma, rl->device);
                /* The peer's side and the session's failures come from the transport;
                 * rdma is chosen once the queue pairs are connected. */
                rdma_transport_peer_info(peer_manager_rdma(t->pm), p, &ri);
                path->transport = rdma_select(&(RdmaSelectInput){
                                                      .policy = t->policy,
                                                      .rdma_built = rdma_data_path_built && peer_manager_rdma(t->pm),
                                                      .n_links = t->n_rdma,
                                                      .ifname = path->ifname,
                                                      .local = rl,
                                                      .peer_announced = ri.announced,
                                                      .peer_rdma = ri.ready,
                                                      .peer_device = ri.device,
                                                      .failure = ri.failure[0] ? ri.failure : NULL,
                                              },
                                              choice, sizeof choice, &warn);
                if (warn && !strstr(old.reason, choice))
                        log_warning("topology: peer %s: %s", path->host_id, choice);
                if (path->gateway[0])
                        snprintf(via, sizeof via, " via %s", path->gateway);
                if (nic.numa_node >= 0)
                        snprintf(numa, sizeof numa, ", NUMA node %d", nic.numa_node);
                /* Long names truncate the reason; it stays a terminated string. */
                if (snprintf(path->reason, sizeof path->reason,
                         "route to %s%s dev %s (src %s, link %s, %s%s%s); %s", host, via, path->ifname,
                         path->src[0] ? path->src : "?", path->link_up ? "up" : "DOWN",
                         nic.path[0] ? "PCI " : "virtual device", path->pci, numa, choice) >= (int)sizeof path->reason)
                        log_debug("topology: reason for %s truncated", path->host_id);
        }
finish:
        if (strcmp(old.ifname, path->ifname) != 0 || old.link_up != path->link_up) {
                if (old.reason[0]) /* resolved before (or said left): not the first time */
                        log_info("topology: path to %s changed: %s", path->host_id, path->reason);
                path->changes++;
        }
        if (link)
                rtnl_link_put(link);
        if (route)
                rtnl_route_put(route);
        if (dst)
                nl_addr_put(dst);
}

/* A member that left the membership: nothing is asked of the kernel (a daemon may have
 * known tens of thousands of them), its path says why; it is resolved again at the first
 * refresh after it comes back (the cluster asks for one when a member joins). */
static void path_left(TopologyPath *path) {
        TopologyPath old = *path;

        if (old.retired)
                return; /* said already */
        *path = (TopologyPath){ .numa_node = -1, .transport = TRANSPORT_TCP, .changes = old.changes, .retired = true };
        memcpy(path->host_id, old.host_id, sizeof path->host_id);
        snprintf(path->reason, sizeof path->reason, "left the cluster membership: no path resolved");
        if (old.ifname[0] || old.link_up)
                path->changes++;
}

/* One path per peer: new peers get theirs (unresolved yet) and their entry by host id. */
static int paths_update(Topology *t) {
        size_t n = peer_manager_n_peers(t->pm);
        bool moved = false;
        int r;

        if (n < t->n_paths) {
                /* Peers are never removed; were they, the indices would no longer match. */
                hashmap_clear(t->by_host_id);
                t->n_paths = 0;
        }
        if (n > t->n_paths_allocated) {
                size_t a = MAX(MAX(n, t->n_paths_allocated * 2), (size_t)16);
                TopologyPath *np = reallocarray(t->paths, a, sizeof *np);

                if (!np)
                        return -ENOMEM;
                moved = np != t->paths;
                t->paths = np;
                t->n_paths_allocated = a;
        }
        if (moved) {
                hashmap_clear(t->by_host_id);
                for (size_t i = 0; i < t->n_paths; i++) {
                        r = hashmap_put(t->by_host_id, t->paths[i].host_id, t->paths + i);
                        if (r < 0)
                                goto fail;
                }
        }
        for (size_t i = t->n_paths; i < n; i++) {
                TopologyPath *path = t->paths + i;

                *path = (TopologyPath){ .numa_node = -1, .transport = TRANSPORT_TCP };
                copy_str(path->host_id, sizeof path->host_id, peer_host_id(peer_manager_peer(t->pm, i)));
                r = hashmap_put(t->by_host_id, path->host_id, path);
                if (r < 0)
                        return r; /* the first i are in the map: resolved; the rest at a retry */
                t->n_paths = i + 1;
        }
        return 0;
fail:
        /* The map and the array disagree: start over at the next refresh. */
        hashmap_clear(t->by_host_id);
        t->n_paths = 0;
        return r;
}

static void schedule_refresh(Topology *t);

int topology_refresh(Topology *t) {
        int r;

        r = paths_update(t);
        if (r < 0) {
                /* No memory for a new peer's path: those known are resolved still, and
                 * the new ones at a retry (nothing else may ask for one soon). */
                log_warning_errno(r, "topology: cannot track every peer's path, retrying: %m");
                if (t->refresh_timer)
                        schedule_refresh(t);
        }
        discover_rdma(t);
        t->resolved = 0;
        for (size_t i = 0; i < t->n_paths; i++) {
                Peer *p = peer_manager_peer(t->pm, i);

                if (peer_is_retired(p)) {
                        path_left(t->paths + i);
                        continue;
                }
                resolve_path(t, p, t->paths + i);
                t->resolved++;
        }
        /* A port or route that went away ends RDMA sessions over it (the next refresh
         * shows it); one that came back offers RDMA again. */
        rdma_transport_links_changed(peer_manager_rdma(t->pm));
        return 0;
}

/* Once a burst of changes is over (each call moves the timer on), but no later than
 * REFRESH_DELAY_MAX_USEC after the burst's first: changes that keep coming (members
 * joining and leaving every few ms) do not hold the refresh off for as long as they do. */
static void schedule_refresh(Topology *t) {
        usec_t now = now_usec(CLOCK_MONOTONIC);
        if (sd_event_source_get_enabled(t->refresh_timer, NULL) <= 0)
                t->refresh_first = now;
        else if (now - t->refresh_first >= REFRESH_DELAY_MAX_USEC)
                return; /* armed, and due soon enough */
        (void)sd_event_source_set_time_relative(t->refresh_timer, REFRESH_DELAY_USEC);
        (void)sd_event_source_set_enabled(t->refresh_timer, SD_EVENT_ONESHOT);
}

void topology_refresh_soon(Topology *t) {
        if (t)
                schedule_refresh(t);
}

static void rdma_changed(void *userdata) {
        schedule_refresh(userdata);
}

/* The RDMA port towards p by the last resolved path, if the policy allows RDMA. */
static int rdma_lookup(Peer *p, RdmaLink *ret, char *src, size_t src_size, void *userdata) {
        Topology *t = userdata;
        const TopologyPath *path = topology_path(t, peer_host_id(p));
        const RdmaLink *rl;

        if (t->policy == TRANSPORT_POLICY_TCP)
                return -EPERM;
        if (!path || !path->ifname[0] || path->ifindex == 1 || strcmp(path->ifname, "lo") == 0)
                return -ENETUNREACH;
        rl = rdma_link_for_netdev(t->rdma, t->n_rdma, path->ifname);
        if (!rl)
                return -ENODEV;
        if (!rl->active)
                return -ENETDOWN;
        *ret = *rl;
        copy_str(src, src_size, path->src);
        return 0;
}

void topology_set_transport_policy(Topology *t, int policy) {
        if (!t || policy < 0 || policy >= _TRANSPORT_POLICY_MAX || (TransportPolicy)policy == t->policy)
                return;
        t->policy = (TransportPolicy)policy;
        if (t->pm)
                (void)topology_refresh(t);
}

static int refresh_cb(sd_event_source *s, uint64_t usec, void *userdata) {
        (void)topology_refresh(userdata);
        return 0;
}

static int monitor_valid(struct nl_msg *msg, void *arg) {
        Topology *t = arg;

        t->events++;
        return NL_OK;
}

static int monitor_io(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        Topology *t = userdata;
        uint64_t before = t->events;
        int r;

        r = nl_recvmsgs_default(t->monitor);
        if (r < 0 && r != -NLE_AGAIN)
                log_debug("topology: rtnetlink receive: %s", nl_geterror(r));
        /* Coalesce a burst of changes into one refresh. */
        if (t->events != before || r < 0)
                schedule_refresh(t);
        return 0;
}

Topology *topology_free(Topology *t) {
        if (!t)
                return NULL;
        if (t->pm)
                rdma_transport_set_topology(peer_manager_rdma(t->pm), NULL, NULL, NULL);
        sd_event_source_disable_unref(t->monitor_source);
        sd_event_source_disable_unref(t->refresh_timer);
        if (t->monitor)
                nl_socket_free(t->monitor);
        if (t->query)
                nl_socket_free(t->query);
        hashmap_free(t->by_host_id);
        free(t->paths);
        free(t->gpus);
        sd_event_unref(t->event);
        free(t);
        return NULL;
}

DEFINE_TRIVIAL_CLEANUP_FUNC(Topology *, topology_free);

int topology_new(Topology **ret, sd_event *e, PeerManager *pm) {
        _cleanup_(topology_freep) Topology *t = NULL;
        int r;

        t = calloc(1, sizeof *t);
        if (!t)
                return -ENOMEM;
        t->event = sd_event_ref(e);
        t->pm = pm;
        t->by_host_id = hashmap_new(HASHMAP_KEY_STRING, 0);
        if (!t->by_host_id)
                return -ENOMEM;
        t->query = nl_socket_alloc();
        t->monitor = nl_socket_alloc();
        if (!t->query || !t->monitor)
                return -ENOMEM;
        r = nl_connect(t->query, NETLINK_ROUTE);
        if (r < 0)
                return nl_errno(r);
        nl_socket_disable_seq_check(t->monitor);
        nl_socket_modify_cb(t->monitor, NL_CB_VALID, NL_CB_CUSTOM, monitor_valid, t);
        r = nl_connect(t->monitor, NETLINK_ROUTE);
        if (r < 0)
                return nl_errno(r);
        r = nl_socket_add_memberships(t->monitor, RTNLGRP_LINK, RTNLGRP_IPV4_IFADDR, RTNLGRP_IPV6_IFADDR,
                                      RTNLGRP_IPV4_ROUTE, RTNLGRP_IPV6_ROUTE, 0);
        if (r < 0)
                return nl_errno(r);
        r = nl_socket_set_nonblocking(t->monitor);
        if (r < 0)
                return nl_errno(r);
        r = sd_event_add_io(e, &t->monitor_source, nl_socket_get_fd(t->monitor), EPOLLIN, monitor_io, t);
        if (r < 0)
                return r;
        r = sd_event_add_time_relative(e, &t->refresh_timer, CLOCK_MONOTONIC, REFRESH_DELAY_USEC, 0,
                                       refresh_cb, t);
        if (r < 0)
                return r;
        (void)sd_event_source_set_enabled(t->refresh_timer, SD_EVENT_OFF);

        discover_gpus(t);
        if (!pm)
                discover_rdma(t);
        if (pm) {
                rdma_transport_set_topology(peer_manager_rdma(pm), rdma_lookup, rdma_changed, t);
                r = topology_refresh(t);
                if (r < 0)
                        return r;
        }
        *ret = TAKE_PTR(t);
        return 0;
}

const TopologyPath *topology_path(Topology *t, const char *host_id) {
        if (!t || !host_id)
                return NULL;
        return hashmap_get(t->by_host_id, host_id);
}

size_t topology_paths_resolved(Topology *t) {
        return t ? t->resolved : 0;
}

size_t topology_n_gpus(Topology *t) {
        return t ? t->n_gpus : 0;
}

const TopologyGpu *topology_gpu(Topology *t, size_t i) {
        return t && i < t->n_gpus ? t->gpus + i : NULL;
}
