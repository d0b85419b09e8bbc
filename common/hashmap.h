/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Open-addressing hash map (linear probing, backward-shift deletion) from a key to a
 * pointer. Keys are not copied: a key points into the stored object (e.g. its id
 * field) and must stay valid while the entry exists. O(1) expected for put, get and
 * remove; grows at 70% load. Hashes are keyed with a random per-process SipHash key,
 * so client-chosen keys cannot degrade it. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum HashmapKeyType {
        HASHMAP_KEY_STRING, /* const char *, NUL-terminated */
        HASHMAP_KEY_U64,    /* const uint64_t * */
        HASHMAP_KEY_BYTES,  /* fixed-size byte keys of key_size bytes */
} HashmapKeyType;

typedef struct Hashmap Hashmap;

Hashmap *hashmap_new(HashmapKeyType type, size_t key_size);
Hashmap *hashmap_free(Hashmap *h); /* frees the table, not the values */
size_t hashmap_size(const Hashmap *h);

/* Returns 0 on insert, -EEXIST if the key is present (nothing changed), -ENOMEM. */
int hashmap_put(Hashmap *h, const void *key, void *value);
/* Inserts or replaces; returns the previous value through *old (may be NULL). */
int hashmap_replace(Hashmap *h, const void *key, void *value, void **old);
void *hashmap_get(const Hashmap *h, const void *key);
bool hashmap_contains(const Hashmap *h, const void *key);
/* Removes the entry and returns its value, or NULL. */
void *hashmap_remove(Hashmap *h, const void *key);
void hashmap_clear(Hashmap *h);

/* Iteration: `size_t i = 0; void *v; while (hashmap_iterate(h, &i, &v, NULL)) ...`.
 * Removing the current entry during iteration is not allowed; collect first. */
bool hashmap_iterate(const Hashmap *h, size_t *state, void **value, const void **key);

/* Also used by other tables: hash with the process key. */
uint64_t hashmap_hash_bytes(const void *p, size_t n);
