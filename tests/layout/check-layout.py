#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
"""Checks that daemon/ keeps the shape docs/architecture.md draws:

  * no include loop between files of different folders (a folder may loop inside
    itself: a manager and its own bus file);
  * the folders' glue is layered: among include edges that reach a glue file (one
    that includes core/manager.h, sd-bus or sd-event, directly or through other
    headers), the folders form no cycle. Pure headers (no Manager, no bus, no event
    loop) are leaves that any folder may include;
  * no .c file over MAX_FILE_LINES lines, no function over MAX_FUNCTION_LINES.

Usage: check-layout.py SOURCE_ROOT [--graph]. Exits 1 and says what is wrong."""
import collections
import os
import re
import sys

MAX_FILE_LINES = 1200
MAX_FUNCTION_LINES = 150
GLUE_SYSTEM_HEADERS = ('systemd/sd-bus.h', 'systemd/sd-event.h')

root = sys.argv[1] if len(sys.argv) > 1 else '.'
D = os.path.join(root, 'daemon')
INC = re.compile(r'^\s*#\s*include\s+([<"])([^">]+)[">]', re.M)

sources = {}
for dp, _, fs in os.walk(D):
    for f in fs:
        if f.endswith(('.c', '.h')):
            p = os.path.relpath(os.path.join(dp, f), D)
            sources[p] = open(os.path.join(dp, f), encoding='utf-8').read()

# Modules: x.c and x.h are one node.
edges = collections.defaultdict(set)
system_glue = set()
for p, text in sources.items():
    mod = p[:-2]
    for kind, inc in INC.findall(text):
        if kind == '<' and inc in GLUE_SYSTEM_HEADERS:
            system_glue.add(mod)
        elif kind == '"' and inc in sources and inc[:-2] != mod:
            edges[mod].add(inc[:-2])
mods = {p[:-2] for p in sources}

def reaches(start, targets):
    seen, stack = set(), [start]
    while stack:
        v = stack.pop()
        if v in targets:
            return True
        for w in edges.get(v, ()):
            if w not in seen:
                seen.add(w)
                stack.append(w)
    return False

glue = {m for m in mods if m in system_glue or reaches(m, system_glue | {'core/manager'})}

def folder(m):
    return m.split('/')[0] if '/' in m else '.'

def sccs(graph, nodes):
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]
    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            c = []
            while True:
                w = stack.pop()
                on.discard(w)
                c.append(w)
                if w == v:
                    break
            if len(c) > 1:
                out.append(sorted(c))
    sys.setrecursionlimit(100000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out

problems = []
for c in sccs(edges, mods):
    if len({folder(m) for m in c}) > 1:
        problems.append('include loop across folders: ' + ' -> '.join(c))

fedges = collections.defaultdict(set)
why = collections.defaultdict(list)
for a, bs in edges.items():
    for b in bs:
        if b in glue and folder(a) != folder(b):
            fedges[folder(a)].add(folder(b))
            why[(folder(a), folder(b))].append('%s -> %s' % (a, b))
for c in sccs(fedges, set(fedges) | {x for v in fedges.values() for x in v}):
    lines = ['folders whose glue includes each other: ' + ', '.join(c)]
    for a in c:
        for b in c:
            if (a, b) in why:
                lines.append('    %s -> %s: %s' % (a, b, '; '.join(why[(a, b)][:4])))
    problems.append('\n'.join(lines))

SIG = re.compile(r'^[A-Za-z_][^;]*\(')
for p, text in sorted(sources.items()):
    if not p.endswith('.c'):
        continue
    lines = text.split('\n')
    if len(lines) > MAX_FILE_LINES:
        problems.append('daemon/%s: %d lines (more than %d)' % (p, len(lines), MAX_FILE_LINES))
    i = 0
    while i < len(lines):
        if SIG.match(lines[i]) and not lines[i].startswith(('typedef', '#')):
            j = i
            while j < len(lines) and not lines[j].rstrip().endswith(('{', ';')):
                j += 1
            if j < len(lines) and lines[j].rstrip().endswith('{'):
                k = j + 1
                while k < len(lines) and lines[k] != '}':
                    k += 1
                if k - i + 1 > MAX_FUNCTION_LINES:
                    problems.append('daemon/%s:%d: a function of %d lines (more than %d): %s' %
                                    (p, i + 1, k - i + 1, MAX_FUNCTION_LINES, lines[i].strip()))
                i = k
        i += 1

if '--graph' in sys.argv:
    for a in sorted(fedges):
        print('%s -> %s' % (a, ', '.join(sorted(fedges[a]))))
for p in problems:
    print(p)
print('layout: %d files, %d glue modules, %s' % (len(sources), len(glue),
      'OK' if not problems else '%d problems' % len(problems)))
sys.exit(1 if problems else 0)
