// d1 libaio random 4k O_DIRECT reads: argv: file count [efd] [pget]
#define _GNU_SOURCE
#include <libaio.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
int main(int argc, char** argv) {
  int fd = open(argv[1], O_RDONLY | O_DIRECT); long n = atol(argv[2]);
  int use_efd = argc > 3 && atoi(argv[3]); int pget = argc > 4 && atoi(argv[4]);
  struct stat st; fstat(fd, &st); long blocks = st.st_size / 4096;
  io_context_t ctx = 0; io_setup(16, &ctx); void* buf; posix_memalign(&buf, 4096, 4096);
  int efd = eventfd(0, EFD_NONBLOCK);
  struct iocb cb, *cbs[1] = {&cb}; struct io_event ev;
  unsigned long long x = 88172645463325252ull;
  struct timespec a, b; clock_gettime(CLOCK_MONOTONIC, &a);
  for (long i = 0; i < n; i++) {
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    io_prep_pread(&cb, fd, buf, 4096, (long long)(x % blocks) * 4096);
    if (use_efd) io_set_eventfd(&cb, efd);
    if (io_submit(ctx, 1, cbs) != 1) { perror("submit"); return 1; }
    int r = pget ? io_pgetevents(ctx, 1, 1, &ev, NULL, NULL) : io_getevents(ctx, 1, 1, &ev, NULL);
    if (r != 1 || ev.res != 4096) { fprintf(stderr, "bad %d %ld\n", r, (long)ev.res); return 1; }
  }
  clock_gettime(CLOCK_MONOTONIC, &b);
  printf("%d\n", (int)(n / ((b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9)));
}
