// Rough throughput of the qcow2 driver, shaped like `qemu-img bench`:
// COUNT requests of SIZE bytes, DEPTH in flight, at offsets i * SIZE
// (wrapping at the image end). Usage:
//   qcow2_bench IMAGE [write|read] [COUNT] [DEPTH] [SIZE]
// The image must exist (qemu-img create -f qcow2 IMAGE 1G).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "qcow2/test_util.h"

int main(int argc, char** argv) {
  using namespace imgtool;
  if (argc < 2) {
    std::fprintf(stderr, "usage: qcow2_bench IMAGE [write|read] [COUNT] [DEPTH] [SIZE]\n");
    return 2;
  }
  const std::string path = argv[1];
  const bool write = argc < 3 || std::string(argv[2]) == "write";
  const int count = argc > 3 ? std::atoi(argv[3]) : 75000;
  const int depth = argc > 4 ? std::atoi(argv[4]) : 64;
  const uint64_t size = argc > 5 ? std::strtoull(argv[5], nullptr, 0) : 4096;
  qcow2::testing::Env env;
  auto node = env.OpenQcow2(path, !write);
  if (!node.ok()) {
    std::fprintf(stderr, "%s\n", node.status().ToString().c_str());
    return 1;
  }
  std::vector<std::vector<uint8_t>> bufs(depth, std::vector<uint8_t>(size, 0));
  int issued = 0, done = 0, failed = 0;
  const uint64_t disk = (*node)->size();
  auto start = std::chrono::steady_clock::now();
  std::function<void(int)> issue = [&](int slot) {
    if (issued >= count) return;
    const uint64_t offset = (uint64_t(issued) * size) % (disk - size + 1);
    ++issued;
    auto on_done = [&, slot](absl::Status st) {
      if (!st.ok()) ++failed;
      ++done;
      issue(slot);
    };
    if (write) {
      io::Spawn((*node)->Write(offset, io::ConstIoVec(bufs[slot])), on_done);
    } else {
      io::Spawn((*node)->Read(offset, io::IoVec(bufs[slot])), on_done);
    }
  };
  for (int i = 0; i < depth; ++i) issue(i);
  while (done < count) {
    if (!env.engine().Poll(true).ok()) return 1;
  }
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  absl::Status st = env.Run((*node)->Close());
  std::printf("%d %s requests of %llu bytes, depth %d: %.3f s, %.0f IOPS, %d failed, close %s\n",
              count, write ? "write" : "read", (unsigned long long)size, depth, secs,
              count / secs, failed, st.ok() ? "ok" : st.ToString().c_str());
  return failed == 0 && st.ok() ? 0 : 1;
}
