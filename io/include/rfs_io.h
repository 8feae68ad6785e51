/*
 * rfs-io: reads and writes of files on an rfs mount through a ring in shared memory, beside
 * the mount (see docs/ring.md). Link with -lrfs_io (librfs_io.so, built by
 * `cargo build --release -p rfs-io`).
 *
 * Every call returns 0 or a count on success and a negated errno on failure, but
 * rfs_ring_open, which returns NULL and sets errno. One ring is used by one thread at a time.
 */
#ifndef RFS_IO_H
#define RFS_IO_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct RfsRing rfs_ring;

/* A finished request: its user data, and the bytes moved (a read is short only at the end of
 * the file) or a negated errno. */
struct rfs_completion {
    uint64_t user_data;
    int64_t result;
};

enum rfs_op { RFS_READ = 1, RFS_WRITE = 2, RFS_FSYNC = 3 };

/* A ring of the mount at `mount`, with a shared buffer of `buffer_len` bytes and room for
 * `entries` requests in flight (a power of two, at most 32768). NULL and errno: ENOENT (not an
 * rfs mount, or its ring is off), EACCES (another user's mount without allow_other), EMFILE. */
rfs_ring *rfs_ring_open(const char *mount, size_t buffer_len, uint32_t entries);
/* Ends the ring; requests in flight complete into memory the mount still holds. */
void rfs_ring_close(rfs_ring *ring);

/* The shared buffer: reads land there, writes are taken from there. A byte under a request
 * in flight may change until that request completes. */
uint8_t *rfs_ring_buffer(rfs_ring *ring);
size_t rfs_ring_buffer_len(rfs_ring *ring);

/* Registers the file open on `fd` (opened through the mount; for writing too if `fd` was
 * opened for writing): its number (>= 0). The mount opens it again as this process. */
int64_t rfs_ring_register(rfs_ring *ring, int fd);
/* Gives a registration back, committing its writes as a close does. */
int rfs_ring_unregister(rfs_ring *ring, uint32_t file);

/* Queues a request: RFS_READ of `len` bytes at `offset` of `file` into the buffer at
 * `buf_off`, RFS_WRITE from the buffer, or RFS_FSYNC (offset, len and buf_off unused).
 * -EAGAIN: the ring is full; wait for completions first. */
int rfs_ring_prep(rfs_ring *ring, uint8_t op, uint32_t file, uint64_t offset, uint32_t len,
                  uint64_t buf_off, uint64_t user_data);
/* Submits what is queued, waits for at least `min` completions, and fills up to `max` of
 * `out`: how many. */
int64_t rfs_ring_wait(rfs_ring *ring, size_t min, struct rfs_completion *out, size_t max);
/* Requests queued or submitted whose completions were not handed out yet. */
uint32_t rfs_ring_in_flight(rfs_ring *ring);

#ifdef __cplusplus
}
#endif

#endif
