/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* What epdd exports to Prometheus: every subsystem's counters, read on the event loop
 * through their public stats functions, written with metrics.h. docs/telemetry.md
 * lists every family. */

#include "core/manager.h"
#include "metrics/metrics.h"

void metrics_collect(Manager *m, MetricsWriter *w, uint64_t scrapes);
