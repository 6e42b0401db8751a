// crash_writer: opens a qcow2 image read-write through Qcow2Node on the
// io_uring engine (its backing file, raw or qcow2, read-only) and runs a
// random write-heavy workload with 64 requests in flight until it is
// killed. Prints nothing while all goes well; a failed request prints its
// status on stderr and exits with 1 (the test then reports it).
//
//   crash_writer <image> <seed> <mode>
//
// Modes (all choices from `seed`):
//   mixed  writes at random offsets and lengths (unaligned too), compressed
//          cluster writes, write zeroes with and without unmap, discards,
//          reads, occasional flushes and, for every other seed, growing
//          truncates; the metadata caches are tiny, small or default by seed.
//   alloc  metadata-heavy: small writes to fresh clusters all over a sparse
//          image, frequent growing truncates (L1 growth) with writes into
//          the new area, tiny L2 and refcount caches (evictions).
// By seed, the image file grows its length ahead of the data as imgtool's
// qcow2 nodes do (64 MiB, posix_file::FileNode::GrowLengthAhead), or 1 MiB
// ahead (writes cross the grown length often), or not at all; a kill then
// leaves a hole after the data.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "io/block_node.h"
#include "io/engine.h"
#include "io/task.h"
#include "qcow2/qcow2_node.h"
#include "qcow2/testing/harness.h"

namespace imgtool::qcow2::testing {
namespace {

constexpr int kInFlight = 64;

[[noreturn]] void Fail(const char* what, const absl::Status& st) {
  std::fprintf(stderr, "crash_writer: %s: %s\n", what, st.ToString().c_str());
  std::fflush(stderr);
  _exit(1);
}

// Bytes that deflate well: runs of a few values.
std::vector<uint8_t> Compressible(uint64_t length, uint64_t seed) {
  std::vector<uint8_t> v(length);
  for (uint64_t i = 0; i < length; ++i) {
    v[i] = static_cast<uint8_t>(
        (i / 64 + seed) % 7 == 0 ? 0 : (i / 512 + seed) & 0xff);
  }
  return v;
}

class Workload {
 public:
  Workload(Qcow2Node& node, uint64_t seed, bool alloc)
      : node_(node),
        rng_(seed),
        alloc_(alloc),
        cluster_(node.cluster_size()),
        data_(Pattern(8 << 20, seed)),
        compressible_(Compressible(4 << 20, seed)) {
    grow_ = alloc_ || (seed & 1) != 0;
    // Growth stops at four times the starting size (disk space).
    max_size_ = node.size() * 4;
    grow_from_ = node.size();
  }

  io::Task<void> Worker() {
    while (true) co_await OneOp();
  }

 private:
  uint64_t Rand(uint64_t n) { return n == 0 ? 0 : rng_() % n; }

  // An offset in [0, size - length], aligned to 1, 512 or a cluster.
  uint64_t Offset(uint64_t length, uint64_t lo = 0) {
    const uint64_t size = node_.size();
    if (length >= size - lo) return lo;
    uint64_t off = lo + Rand(size - lo - length + 1);
    switch (Rand(3)) {
      case 0:
        break;
      case 1:
        off &= ~uint64_t{511};
        break;
      default:
        off &= ~(cluster_ - 1);
        break;
    }
    return std::max(off, lo);
  }

  uint64_t Length() {
    uint64_t max;
    if (alloc_) {
      max = std::min<uint64_t>(cluster_, 4096);
    } else {
      max = std::min<uint64_t>(4 * cluster_ + 1000, 1 << 20);
    }
    uint64_t len = 1 + Rand(max);
    switch (Rand(4)) {
      case 0:
        len = (len + 511) & ~uint64_t{511};
        break;
      case 1:
        len = std::max<uint64_t>(cluster_, len & ~(cluster_ - 1));
        break;
      default:
        break;
    }
    return std::min<uint64_t>(len, 4 << 20);
  }

  io::Task<void> OneOp() {
    const uint64_t r = Rand(1000);
    if (grow_ && !growing_ && r < (alloc_ ? 20 : 5)) {
      co_await Grow();
      co_return;
    }
    if (r < 15 && !alloc_) {
      absl::Status st = co_await node_.Flush();
      if (!st.ok()) Fail("flush", st);
      co_return;
    }
    const uint64_t len = Length();
    // alloc: half of the requests land in the area the last truncate added.
    const uint64_t lo = alloc_ && Rand(2) == 0 ? grow_from_ : 0;
    const uint64_t off = Offset(len, std::min(lo, node_.size() - 1));
    const uint64_t n = std::min(len, node_.size() - off);
    if (!alloc_ && r < 50) {
      // A compressed cluster (refused on allocated clusters).
      const uint64_t coff = Offset(1) & ~(cluster_ - 1);
      const uint64_t clen = std::min(cluster_, node_.size() - coff);
      absl::Status st = co_await node_.WriteCompressed(
          coff, io::ConstIoVec(compressible_.data() + Rand(cluster_), clen));
      if (!st.ok() && !absl::IsFailedPrecondition(st))
        Fail("compressed write", st);
    } else if (r < 650) {
      const uint64_t src = Rand(data_.size() - n);
      absl::Status st =
          co_await node_.Write(off, io::ConstIoVec(data_.data() + src, n));
      if (!st.ok()) Fail("write", st);
    } else if (r < 750) {
      io::WriteZeroesFlags flags;
      flags.may_unmap = Rand(2) == 0;
      absl::Status st = co_await node_.WriteZeroes(off, n, flags);
      if (!st.ok()) Fail("write zeroes", st);
    } else if (r < 850) {
      absl::Status st = co_await node_.Discard(off, n);
      if (!st.ok() && !absl::IsUnimplemented(st)) Fail("discard", st);
    } else {
      std::vector<uint8_t> buf(n);
      absl::Status st = co_await node_.Read(off, io::IoVec(buf));
      if (!st.ok()) Fail("read", st);
    }
  }

  io::Task<void> Grow() {
    const uint64_t old_size = node_.size();
    if (old_size >= max_size_) co_return;
    growing_ = true;
    // A few L2 tables' worth (alloc) or up to 2 MiB, in 512-byte steps.
    const uint64_t l2_span = cluster_ * (cluster_ / 8);
    uint64_t add = alloc_ ? 1 + Rand(std::min<uint64_t>(4 * l2_span, 8 << 20))
                          : 1 + Rand(2 << 20);
    add = (add + 511) & ~uint64_t{511};
    const uint64_t new_size = std::min(max_size_, old_size + add);
    absl::Status st = co_await node_.Truncate(new_size, io::PreallocMode::kOff);
    if (!st.ok()) Fail("truncate", st);
    grow_from_ = old_size;
    growing_ = false;
  }

  Qcow2Node& node_;
  std::mt19937_64 rng_;
  const bool alloc_;
  const uint64_t cluster_;
  const std::vector<uint8_t> data_;
  const std::vector<uint8_t> compressible_;
  bool grow_ = false;
  bool growing_ = false;
  uint64_t max_size_ = 0;
  uint64_t grow_from_ = 0;
};

int Main(int argc, char** argv) {
  uint64_t seed = 0;
  if (argc != 4 || !absl::SimpleAtoi(argv[2], &seed) ||
      (std::string(argv[3]) != "mixed" && std::string(argv[3]) != "alloc")) {
    std::fprintf(stderr, "usage: crash_writer <image> <seed> mixed|alloc\n");
    return 2;
  }
  const bool alloc = std::string(argv[3]) == "alloc";
  Env env(io::EngineKind::kIoUring, kInFlight);
  Qcow2OpenOptions options;
  if (alloc || seed % 3 == 0) {
    // At least two tables stay cached: constant evictions.
    options.set_l2_cache_size(1);
    options.set_refcount_cache_size(1);
  } else if (seed % 3 == 1) {
    options.set_l2_cache_size(64 * 1024);
    options.set_refcount_cache_size(64 * 1024);
  }
  constexpr uint64_t kGrowthSteps[] = {uint64_t{64} << 20, uint64_t{1} << 20, 0};
  absl::StatusOr<std::unique_ptr<Qcow2Node>> node = env.OpenQcow2(
      argv[1], /*read_only=*/false, options, kGrowthSteps[(seed / 3) % 3]);
  if (!node.ok()) Fail("open", node.status());
  Workload workload(**node, seed, alloc);
  for (int i = 0; i < kInFlight; ++i) io::Spawn(workload.Worker());
  while (true) {
    absl::Status st = env.engine().Poll(/*wait=*/true);
    if (!st.ok()) Fail("poll", st);
  }
}

}  // namespace
}  // namespace imgtool::qcow2::testing

int main(int argc, char** argv) {
  return imgtool::qcow2::testing::Main(argc, argv);
}
