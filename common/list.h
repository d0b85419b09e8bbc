/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Intrusive doubly linked lists, in the style of systemd's list.h: an object embeds
 * `LIST_FIELDS(Type, name)` and is linked without any allocation. */

#define LIST_HEAD(t, name) t *name
#define LIST_FIELDS(t, name) t *name##_next, *name##_prev

#define LIST_HEAD_INIT(head) ((head) = NULL)

#define LIST_PREPEND(name, head, item)                                                   \
        do {                                                                             \
                __typeof__(*(head)) **_head = &(head), *_item = (item);                  \
                if ((_item->name##_next = *_head))                                       \
                        _item->name##_next->name##_prev = _item;                         \
                _item->name##_prev = NULL;                                               \
                *_head = _item;                                                          \
        } while (0)

#define LIST_REMOVE(name, head, item)                                                    \
        do {                                                                             \
                __typeof__(*(head)) **_head = &(head), *_item = (item);                  \
                if (_item->name##_next)                                                  \
                        _item->name##_next->name##_prev = _item->name##_prev;            \
                if (_item->name##_prev)                                                  \
                        _item->name##_prev->name##_next = _item->name##_next;            \
                else                                                                     \
                        *_head = _item->name##_next;                                     \
                _item->name##_next = _item->name##_prev = NULL;                          \
        } while (0)

#define LIST_FOREACH(name, i, head) for (__typeof__(*(head)) *i = (head); i; i = i->name##_next)

/* Safe against removal of the current item. */
#define LIST_FOREACH_SAFE(name, i, n, head)                                              \
        for (__typeof__(*(head)) *i = (head), *n = i ? i->name##_next : NULL; i;          \
             i = n, n = i ? i->name##_next : NULL)

/* Doubly linked queue with head and tail (used for LRU lists and FIFOs). */
#define QUEUE_HEAD(t, name)                                                              \
        struct {                                                                         \
                t *first, *last;                                                         \
        } name

#define QUEUE_PUSH_BACK(name, q, item)                                                   \
        do {                                                                             \
                __typeof__((q).first) _it = (item);                                      \
                _it->name##_next = NULL;                                                 \
                _it->name##_prev = (q).last;                                             \
                if ((q).last)                                                            \
                        (q).last->name##_next = _it;                                     \
                else                                                                     \
                        (q).first = _it;                                                 \
                (q).last = _it;                                                          \
        } while (0)

/* Inserts item after `after` (NULL: at the front). */
#define QUEUE_INSERT_AFTER(name, q, after, item)                                         \
        do {                                                                             \
                __typeof__((q).first) _it = (item), _af = (after);                       \
                _it->name##_prev = _af;                                                  \
                _it->name##_next = _af ? _af->name##_next : (q).first;                   \
                if (_it->name##_next)                                                    \
                        _it->name##_next->name##_prev = _it;                             \
                else                                                                     \
                        (q).last = _it;                                                  \
                if (_af)                                                                 \
                        _af->name##_next = _it;                                          \
                else                                                                     \
                        (q).first = _it;                                                 \
        } while (0)

#define QUEUE_REMOVE(name, q, item)                                                      \
        do {                                                                             \
                __typeof__((q).first) _it = (item);                                      \
                if (_it->name##_prev)                                                    \
                        _it->name##_prev->name##_next = _it->name##_next;                \
                else                                                                     \
                        (q).first = _it->name##_next;                                    \
                if (_it->name##_next)                                                    \
                        _it->name##_next->name##_prev = _it->name##_prev;                \
                else                                                                     \
                        (q).last = _it->name##_prev;                                     \
                _it->name##_next = _it->name##_prev = NULL;                              \
        } while (0)
