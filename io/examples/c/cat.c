/*
 * Prints a file of an rfs mount through its ring: the C ABI in a page.
 *
 *   cc -I io/include io/examples/c/cat.c -L target/release -lrfs_io -o rfs-ring-cat
 *   LD_LIBRARY_PATH=target/release ./rfs-ring-cat MOUNT FILE > copy
 *
 * Reads 1 MiB pieces, eight in flight, and writes them out in order.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "rfs_io.h"

#define PIECE (1u << 20)
#define DEPTH 8

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s MOUNT FILE\n", argv[0]);
        return 2;
    }
    rfs_ring *ring = rfs_ring_open(argv[1], (size_t)PIECE * DEPTH, DEPTH);
    if (!ring) {
        fprintf(stderr, "%s: %s\n", argv[1], strerror(errno));
        return 1;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", argv[1], argv[2]);
    int fd = open(path, O_RDONLY);
    if (fd < 0) {
        fprintf(stderr, "%s: %s\n", path, strerror(errno));
        return 1;
    }
    off_t size = lseek(fd, 0, SEEK_END);
    int64_t file = rfs_ring_register(ring, fd);
    close(fd); /* the registration holds the file */
    if (file < 0) {
        fprintf(stderr, "register: %s\n", strerror((int)-file));
        return 1;
    }
    uint64_t pieces = ((uint64_t)size + PIECE - 1) / PIECE, next = 0, out = 0;
    int64_t done_len[DEPTH];
    int done[DEPTH] = {0};
    uint8_t *buffer = rfs_ring_buffer(ring);
    while (out < pieces) {
        while (next < pieces && next < out + DEPTH) {
            int e = rfs_ring_prep(ring, RFS_READ, (uint32_t)file, next * PIECE, PIECE,
                                  (next % DEPTH) * PIECE, next);
            if (e < 0) {
                fprintf(stderr, "prep: %s\n", strerror(-e));
                return 1;
            }
            next++;
        }
        struct rfs_completion c[DEPTH];
        int64_t n = rfs_ring_wait(ring, 1, c, DEPTH);
        if (n < 0) {
            fprintf(stderr, "wait: %s\n", strerror((int)-n));
            return 1;
        }
        for (int64_t k = 0; k < n; k++) {
            if (c[k].result < 0) {
                fprintf(stderr, "piece %llu: %s\n", (unsigned long long)c[k].user_data,
                        strerror((int)-c[k].result));
                return 1;
            }
            done[c[k].user_data % DEPTH] = 1;
            done_len[c[k].user_data % DEPTH] = c[k].result;
        }
        /* In order: a piece's slot is reused only once it is written out. */
        while (out < next && done[out % DEPTH]) {
            uint8_t *piece = buffer + (out % DEPTH) * PIECE;
            if (fwrite(piece, 1, (size_t)done_len[out % DEPTH], stdout) !=
                (size_t)done_len[out % DEPTH])
                return 1;
            done[out % DEPTH] = 0;
            out++;
        }
    }
    rfs_ring_unregister(ring, (uint32_t)file);
    rfs_ring_close(ring);
    return 0;
}
