/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* A Client is one D-Bus peer of the daemon: a unique name on a bus (tracked with
 * sd_bus_track), or one connection on the direct socket (which ends with the
 * connection). Everything a client allocates is a ClientObject linked to it; when the
 * client goes away, each object's release function runs — the same function that the
 * explicit Release method calls — so a dying worker leaves nothing behind. */

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <systemd/sd-bus.h>

#include "list.h"

typedef struct Manager Manager;
typedef struct Client Client;
typedef struct ClientObject ClientObject;
typedef struct Worker Worker;

/* Kinds of per-client objects (counted together against [Limits] MaxObjectsPerClient=). */
typedef enum ClientObjectType {
        CLIENT_OBJECT_WORKER,
        CLIENT_OBJECT_SEQUENCE,
        CLIENT_OBJECT_FEATURE_REF,
        CLIENT_OBJECT_HANDOFF,
        CLIENT_OBJECT_RING,
        CLIENT_OBJECT_WORKFLOW,
        CLIENT_OBJECT_PIN,
        CLIENT_OBJECT_REQUEST,   /* an admitted scheduler request */
        CLIENT_OBJECT_OTHER,
        _CLIENT_OBJECT_TYPE_MAX,
} ClientObjectType;

struct ClientObject {
        Client *owner;
        ClientObjectType type;
        /* Frees the object (and with it, the ClientObject). Called by the explicit
         * release path and by client_free(); must unlink itself with
         * client_object_unlink(). */
        void (*release)(ClientObject *o);
        LIST_FIELDS(ClientObject, objects);
};

struct Client {
        Manager *manager;
        uint64_t serial;      /* unique for the daemon's lifetime */
        sd_bus *bus;          /* the connection the client speaks on */
        char *unique_name;    /* on a bus; NULL on a direct connection */
        char *key;            /* hashmap key: "<serial of connection>/<unique name or ->" */
        sd_bus_track *track;  /* on a bus */
        pid_t pid;            /* from the connection's credentials: always read, a client */
        uid_t uid;            /* whose credentials cannot be read is never created */
        bool dying;
        bool mapper;          /* its process is kept in the fd store (core/mappers.h) */
        /* Gone from its connection while its process still runs, with GPU arenas mapped:
         * what it holds is freed once the process has exited (its GPU work with it) or
         * CLIENT_EXIT_WAIT_USEC later (client_gone()). */
        sd_event_source *exit_watch, *exit_timer;
        int exit_pidfd;
        unsigned n_objects[_CLIENT_OBJECT_TYPE_MAX];
        LIST_HEAD(ClientObject, objects);
        ClientObject *worker; /* its registration, among objects (looked up on most calls) */
};

/* Finds or creates the client that sent the message; -EACCES if its credentials cannot
 * be read (the call is refused), -EUSERS past MaxClients=. */
int manager_client_from_message(Manager *m, sd_bus_message *msg, Client **ret);
/* The same for method handlers: refusals become named errors (PermissionDenied,
 * LimitExceeded) with their reason. */
int manager_client_require(Manager *m, sd_bus_message *msg, Client **ret, sd_bus_error *error);
/* Finds the client, without creating it; NULL if it has no state here. */
Client *manager_client_lookup_message(Manager *m, sd_bus_message *msg);

/* The reader of something filtered by owner (a list of objects, an object tree): *ret_root
 * when its effective uid is 0 (root reads everything listed as root's in
 * docs/security.md), *ret_client its client, NULL when it has no state here (it then owns
 * nothing). -EACCES when its uid cannot be read: the reader is never taken for root. Makes
 * no client. */
int manager_reader(Manager *m, sd_bus_message *msg, bool *ret_root, Client **ret_client);
/* The same with the reader's effective uid (ret_client optional). */
int manager_reader_uid(Manager *m, sd_bus_message *msg, uid_t *ret_uid, Client **ret_client);
/* The same for property getters: the refusal is PermissionDenied naming `what`. */
int manager_reader_require(Manager *m, sd_bus_message *msg, const char *what, bool *ret_root,
                           Client **ret_client, sd_bus_error *error);

/* Links a new object to its owner: -EDQUOT past MaxObjectsPerClient= objects of all
 * kinds, -EALREADY for a second worker registration. */
int client_object_link(Client *c, ClientObject *o, ClientObjectType type,
                       void (*release)(ClientObject *o));
/* Whether c may link one more object (0), or -EDQUOT / -ESHUTDOWN as client_object_link()
 * would answer: asked before a call changes shared state for an object that would then
 * be refused. */
int client_object_room(const Client *c);
void client_object_unlink(ClientObject *o);

/* Releases all objects, then frees the client. */
Client *client_free(Client *c);
/* Called when a direct connection closes or a tracked name vanishes. */
void client_gone(Client *c);

/* The registered worker of this client, or NULL (one worker per client by default). */
Worker *client_get_worker(Client *c);

/* For method handlers: the calling client's worker, or a named NotRegistered error. */
int manager_require_worker(Manager *m, sd_bus_message *msg, Worker **ret, sd_bus_error *error);
