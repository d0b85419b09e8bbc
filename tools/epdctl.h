/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

#include <stdbool.h>
#include <stdio.h>
#include <systemd/sd-bus.h>

#include "epd/epd.h"

typedef struct EpdctlVerb {
        const char *name;
        const char *usage; /* e.g. "trace REQUEST_ID"; NULL: the name */
        const char *help;
        int (*run)(epd_client *c, int argc, char **argv); /* argv: after the verb */
} EpdctlVerb;

extern const EpdctlVerb epdctl_verbs[];
extern bool arg_json;

void json_string(FILE *f, const char *s);
int epdctl_fail(epd_client *c, int r, const char *what);
int epdctl_get_property(epd_client *c, const char *path, const char *interface,
                        const char *property, const char *type, sd_bus_message **reply);

/* Verbs of the subsystems, each in its own file. */
int verb_pages(epd_client *c, int argc, char **argv);     /* epdctl-pages.c */
int verb_sequences(epd_client *c, int argc, char **argv); /* epdctl-pages.c */
/* Verbs defined in their own files. */
int verb_features(epd_client *c, int argc, char **argv); /* epdctl-feature.c */
/* Verbs defined in their subsystems' files. */
int verb_peers(epd_client *c, int argc, char **argv);
int verb_trace(epd_client *c, int argc, char **argv); /* epdctl-telemetry.c */
int verb_paths(epd_client *c, int argc, char **argv); /* epdctl-telemetry.c */
int verb_scheduler(epd_client *c, int argc, char **argv); /* epdctl-scheduler.c */
int verb_journal(epd_client *c, int argc, char **argv);   /* epdctl-scheduler.c */
int verb_gpus(epd_client *c, int argc, char **argv); /* epdctl-gpu.c */
int verb_cluster(epd_client *c, int argc, char **argv);   /* epdctl-cluster.c */
int verb_placement(epd_client *c, int argc, char **argv); /* epdctl-cluster.c */
