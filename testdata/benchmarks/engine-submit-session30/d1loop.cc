// Depth-1 random 4 KiB O_DIRECT reads straight on io::AioEngine: argv file count
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include "io/aio_engine.h"
#include "io/aligned_buffer.h"
using namespace imgtool::io;
int main(int argc, char** argv) {
  int fd = open(argv[1], O_RDONLY | O_DIRECT);
  long n = atol(argv[2]);
  struct stat st; fstat(fd, &st); const uint64_t blocks = st.st_size / 4096;
  auto engine = AioEngine::Create(1);
  if (!engine.ok()) return 1;
  AlignedBuffer buf(4096);
  struct iovec iov = {buf.data(), 4096};
  uint64_t x = 88172645463325252ull;
  long done = 0;
  Op op;
  auto next = [&] {
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    op = Op{.kind = OpKind::kRead, .fd = fd, .iov = &iov, .iovcnt = 1, .offset = (x % blocks) * 4096};
    op.done = [&](Op& o) { if (o.result != 4096) abort(); ++done; };
    (*engine)->Submit(&op);
  };
  auto t0 = std::chrono::steady_clock::now();
  while (done < n) {
    next();
    while ((*engine)->in_flight() > 0) if (!(*engine)->Poll(true).ok()) return 2;
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  printf("%d\n", (int)(n / s));
}
