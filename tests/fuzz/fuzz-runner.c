/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Runs a fuzz target over every file in the directories (or files) given, so that the
 * regression inputs run in the normal test suite, built with gcc, under the sanitizers. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int run_file(const char *path) {
        FILE *f = fopen(path, "re");
        uint8_t *buf;
        long n;

        if (!f)
                return perror(path), -1;
        fseek(f, 0, SEEK_END);
        n = ftell(f);
        rewind(f);
        buf = malloc(n > 0 ? (size_t)n : 1);
        if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) {
                fclose(f);
                free(buf);
                return -1;
        }
        fclose(f);
        LLVMFuzzerTestOneInput(buf, (size_t)n);
        free(buf);
        return 0;
}

int main(int argc, char **argv) {
        int count = 0;

        for (int i = 1; i < argc; i++) {
                struct stat st;
                if (stat(argv[i], &st) < 0)
                        return perror(argv[i]), 1;
                if (S_ISDIR(st.st_mode)) {
                        DIR *d = opendir(argv[i]);
                        struct dirent *de;
                        while (d && (de = readdir(d))) {
                                char p[4096];
                                if (de->d_name[0] == '.')
                                        continue;
                                snprintf(p, sizeof p, "%s/%s", argv[i], de->d_name);
                                if (run_file(p) < 0)
                                        return 1;
                                count++;
                        }
                        if (d)
                                closedir(d);
                } else {
                        if (run_file(argv[i]) < 0)
                                return 1;
                        count++;
                }
        }
        /* The empty input, always. */
        LLVMFuzzerTestOneInput((const uint8_t *)"", 0);
        printf("%d inputs ran\n", count + 1);
        return 0;
}
