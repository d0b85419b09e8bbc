/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The scheduler subsystem of epdd: owns the pure Scheduler (scheduler.h) in
 * Manager.scheduler, feeds it the registered workers (a colocated worker serves both
 * prefill and decode), drops requests whose workers never reported, and serves
 * org.epd1.Scheduler (bus-scheduler.c). */

#include "manager.h"
#include "scheduler.h"

extern const Subsystem scheduler_subsystem;

/* The stages a worker role serves (bit per SchedStage). */
unsigned scheduler_stages_of_role(int role);
int bus_scheduler_add(Manager *m, sd_bus *bus);
/* Sets each decode worker's free pages from the KV page pools of the arenas it maps
 * (free + evictable idle pages); called before each admission. */
void scheduler_refresh_pages(Manager *m);
