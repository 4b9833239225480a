/* What one process_vm_readv per descriptor costs: the kernel floor under UCX's CMA transport.
 *
 * UCX (through NIXL) copies a READ between two processes on one host with one
 * process_vm_readv per descriptor (strace: 4,144 calls for 2 READs of 2,048 descriptors).
 * This reads the same bytes from a child process three ways: one 32 KiB piece per call at
 * shuffled addresses (a fragmented READ's descriptors), many pieces per call (what batching
 * descriptors into one syscall would give), and 1 MiB pieces (the big-descriptor ceiling).
 *
 * usage: cma_floor <MiB> <piece bytes> <pieces per call> <threads> <repeats>
 * prints: GB/s (best repeat) and CPU microseconds per piece (user + system, all threads).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_PER_CALL 1024 /* IOV_MAX */

static size_t piece_bytes, num_pieces;
static int per_call;
static char *source, *target;
static size_t *local_order, *remote_order;
static pid_t child;

struct share { size_t first, end; };

static double seconds(clockid_t clock) {
  struct timespec now;
  clock_gettime(clock, &now);
  return now.tv_sec + now.tv_nsec * 1e-9;
}

static double cpu_seconds(void) {
  struct rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_utime.tv_sec + usage.ru_utime.tv_usec * 1e-6 + usage.ru_stime.tv_sec +
         usage.ru_stime.tv_usec * 1e-6;
}

static void *read_share(void *arg) {
  struct share *share = arg;
  struct iovec local[MAX_PER_CALL], remote[MAX_PER_CALL];
  for (size_t i = share->first; i < share->end;) {
    int n = 0;
    for (; n < per_call && i < share->end; n++, i++) {
      local[n].iov_base = target + local_order[i] * piece_bytes;
      local[n].iov_len = piece_bytes;
      remote[n].iov_base = source + remote_order[i] * piece_bytes;
      remote[n].iov_len = piece_bytes;
    }
    ssize_t got = process_vm_readv(child, local, n, remote, n, 0);
    if (got != (ssize_t)(n * piece_bytes)) {
      perror("process_vm_readv");
      exit(1);
    }
  }
  return NULL;
}

static void shuffle(size_t *order, unsigned seed) {
  srand(seed);
  for (size_t i = 0; i < num_pieces; i++) order[i] = i;
  for (size_t i = num_pieces - 1; i > 0; i--) {
    size_t k = (size_t)rand() % (i + 1), t = order[i];
    order[i] = order[k];
    order[k] = t;
  }
}

int main(int argc, char **argv) {
  if (argc != 6) {
    fprintf(stderr, "usage: %s <MiB> <piece bytes> <pieces per call> <threads> <repeats>\n", argv[0]);
    return 2;
  }
  size_t total = (size_t)atol(argv[1]) << 20;
  piece_bytes = (size_t)atol(argv[2]);
  per_call = atoi(argv[3]);
  int threads = atoi(argv[4]), repeats = atoi(argv[5]);
  if (piece_bytes == 0 || total % piece_bytes || per_call < 1 || per_call > MAX_PER_CALL ||
      threads < 1 || threads > 16 || repeats < 1) {
    fprintf(stderr, "bad arguments\n");
    return 2;
  }
  num_pieces = total / piece_bytes;
  source = aligned_alloc(4096, total);
  target = aligned_alloc(4096, total);
  local_order = malloc(num_pieces * sizeof(size_t));
  remote_order = malloc(num_pieces * sizeof(size_t));
  if (!source || !target || !local_order || !remote_order) return 1;
  memset(source, 1, total);
  memset(target, 2, total);
  shuffle(local_order, 1);
  shuffle(remote_order, 2);
  child = fork(); /* its copy of source is what is read */
  if (child == 0) {
    pause();
    _exit(0);
  }
  double best_s = 1e30, cpu_s = 0.0;
  for (int r = 0; r < repeats; r++) {
    pthread_t thread[16];
    struct share share[16];
    double started = seconds(CLOCK_MONOTONIC), cpu_started = cpu_seconds();
    for (int t = 0; t < threads; t++) {
      share[t].first = num_pieces * t / threads;
      share[t].end = num_pieces * (t + 1) / threads;
      pthread_create(&thread[t], NULL, read_share, &share[t]);
    }
    for (int t = 0; t < threads; t++) pthread_join(thread[t], NULL);
    double took = seconds(CLOCK_MONOTONIC) - started;
    cpu_s += cpu_seconds() - cpu_started;
    if (took < best_s) best_s = took;
  }
  printf("%zu KiB pieces, %d per call, %d thread(s): %.2f GB/s, %.2f CPU us per piece\n",
         piece_bytes >> 10, per_call, threads, total / best_s / 1e9,
         cpu_s / repeats / num_pieces * 1e6);
  kill(child, SIGKILL);
  waitpid(child, NULL, 0);
  return 0;
}
