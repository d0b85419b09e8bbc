/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Runs a libFuzzer target without libFuzzer (any compiler): every file named on the
 * command line, or every file in a named directory, is fed to LLVMFuzzerTestOneInput,
 * followed by `--mutations N` deterministic mutations of each (bit flips, byte sets,
 * truncations, extensions), so that the normal test suite exercises the parser beyond
 * the stored inputs. The empty input always runs. */
#include <dirent.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static unsigned long mutations = 0;
static uint64_t rng = 0x9e3779b97f4a7c15ULL;

static uint64_t next_random(void) {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        return rng;
}

static void run_mutations(const uint8_t *data, size_t size) {
        size_t cap = size + 64;
        uint8_t *buf = malloc(cap);
        if (!buf)
                abort();
        for (unsigned long i = 0; i < mutations; i++) {
                size_t n = size;
                memcpy(buf, data, size);
                unsigned k = 1 + (unsigned)(next_random() % 4);
                for (unsigned j = 0; j < k; j++) {
                        uint64_t r = next_random();
                        switch (r % 5) {
                        case 0: /* flip a bit */
                                if (n)
                                        buf[(r >> 8) % n] ^= (uint8_t)(1u << ((r >> 40) % 8));
                                break;
                        case 1: /* set a byte to an interesting value */
                                if (n) {
                                        static const uint8_t v[] = { 0, 1, 0x7f, 0x80, 0xff, 0x40 };
                                        buf[(r >> 8) % n] = v[(r >> 40) % sizeof v];
                                }
                                break;
                        case 2: /* truncate */
                                if (n)
                                        n = (r >> 8) % n;
                                break;
                        case 3: /* extend */
                                if (n < cap)
                                        buf[n++] = (uint8_t)(r >> 8);
                                break;
                        default: /* random byte */
                                if (n)
                                        buf[(r >> 8) % n] = (uint8_t)(r >> 32);
                                break;
                        }
                }
                LLVMFuzzerTestOneInput(buf, n);
        }
        free(buf);
}

static int run_file(const char *path) {
        FILE *f = fopen(path, "re");
        if (!f) {
                fprintf(stderr, "%s: %s\n", path, strerror(errno));
                return -errno;
        }
        uint8_t *data = NULL;
        size_t size = 0, cap = 0;
        for (;;) {
                if (size == cap) {
                        cap = cap ? cap * 2 : 4096;
                        uint8_t *p = realloc(data, cap);
                        if (!p)
                                abort();
                        data = p;
                }
                size_t n = fread(data + size, 1, cap - size, f);
                if (n == 0)
                        break;
                size += n;
        }
        fclose(f);
        LLVMFuzzerTestOneInput(data, size);
        run_mutations(data, size);
        free(data);
        return 1;
}

int main(int argc, char **argv) {
        unsigned n = 0;
        for (int i = 1; i < argc; i++) {
                if (strcmp(argv[i], "--mutations") == 0 && i + 1 < argc) {
                        mutations = strtoul(argv[++i], NULL, 10);
                        continue;
                }
                struct stat st;
                if (stat(argv[i], &st) < 0) {
                        fprintf(stderr, "%s: %s\n", argv[i], strerror(errno));
                        return EXIT_FAILURE;
                }
                if (!S_ISDIR(st.st_mode)) {
                        if (run_file(argv[i]) < 0)
                                return EXIT_FAILURE;
                        n++;
                        continue;
                }
                /* In name order: the same run on every file system. */
                struct dirent **names = NULL;
                int n_names = scandir(argv[i], &names, NULL, alphasort);
                if (n_names < 0)
                        return EXIT_FAILURE;
                int r = 0;
                for (int k = 0; k < n_names; k++) {
                        char p[4096];
                        /* run_file() is 1 for a file run: every one of them runs (with
                         * r == 0 here only the first did, the rest of the seeds never). */
                        if (r >= 0 && names[k]->d_name[0] != '.') {
                                snprintf(p, sizeof p, "%s/%s", argv[i], names[k]->d_name);
                                r = run_file(p);
                                n++;
                        }
                        free(names[k]);
                }
                free(names);
                if (r < 0)
                        return EXIT_FAILURE;
        }
        LLVMFuzzerTestOneInput((const uint8_t *)"", 0);
        printf("%u inputs (+ the empty one), %lu mutations each: ok\n", n, mutations);
        return EXIT_SUCCESS;
}
