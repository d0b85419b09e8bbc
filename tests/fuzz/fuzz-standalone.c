/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Runs a libFuzzer target over files and directories of inputs without libFuzzer, so
 * that the committed regression inputs run in the normal test suite (gcc included). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int run_file(const char *path) {
        FILE *f = fopen(path, "rbe");
        uint8_t *buf;
        long n;

        if (!f) {
                fprintf(stderr, "%s: %s\n", path, strerror(errno));
                return -1;
        }
        if (fseek(f, 0, SEEK_END) < 0 || (n = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) < 0) {
                fclose(f);
                return -1;
        }
        /* An exact-size copy, so that the sanitizers see reads past the input. */
        buf = malloc(n > 0 ? (size_t)n : 1);
        if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) {
                free(buf);
                fclose(f);
                return -1;
        }
        fclose(f);
        LLVMFuzzerTestOneInput(buf, (size_t)n);
        free(buf);
        return 0;
}

static int run_path(const char *path, unsigned *count) {
        struct stat st;
        if (stat(path, &st) < 0) {
                fprintf(stderr, "%s: %s\n", path, strerror(errno));
                return -1;
        }
        if (!S_ISDIR(st.st_mode)) {
                (*count)++;
                return run_file(path);
        }
        DIR *d = opendir(path);
        if (!d)
                return -1;
        int r = 0;
        for (struct dirent *de; (de = readdir(d));) {
                char p[4096];
                if (de->d_name[0] == '.')
                        continue;
                snprintf(p, sizeof p, "%s/%s", path, de->d_name);
                if (run_path(p, count) < 0)
                        r = -1;
        }
        closedir(d);
        return r;
}

int main(int argc, char **argv) {
        unsigned count = 0;
        int r = 0;

        for (int i = 1; i < argc; i++)
                if (run_path(argv[i], &count) < 0)
                        r = -1;
        /* The empty input, always. */
        LLVMFuzzerTestOneInput((const uint8_t *)"", 0);
        printf("%u inputs\n", count);
        return r < 0 || count == 0 ? EXIT_FAILURE : EXIT_SUCCESS;
}
