// qcow2 subclusters (extended L2 entries) through the driver alone: the
// public subcluster measurement (shared/reference/subclusters.md §9,
// "backing" rows) as a Google Benchmark on a real XFS loop mount.
//
//   subcluster/fs:xfs/cluster:C/extended_l2:E   (suite `subcluster`)
//       A fresh qcow2 overlay (cluster size C, extended L2 off/on) over a
//       fully written raw backing file, opened with cache=none like
//       `qemu-img bench -t none`, gets N 4 KiB writes, 64 in flight, at
//       offsets i * 4 KiB * 1021 modulo the virtual size (so they spread
//       over the whole disk and almost all land in different clusters).
//       N = min(--count, max(256, --cow_mib / C)) bounds the whole-cluster
//       copies of big standard clusters (as subcluster_side_by_side.sh).
//       Counters: `seconds` (the write phase), `IOPS` (N / seconds),
//       `bytes_from_backing` (bytes the driver read from the backing file,
//       i.e. copy-on-write traffic) and `writes` (N). Overlay creation and
//       close are not timed. With --cold_backing (default) the page cache
//       is dropped before each timed run, so copy-on-write reads reach the
//       disk, as the public table's reads of a 40 GB backing image did.
//
// Result file contract: benchmarks/README.md ("Result files").
// Run (root; the mount needs it):
//   bazel run //benchmarks:subcluster_bench -- [--base_mib=1024]
//       [--count=4000] [--cow_mib=512] [--cold_backing=false] [--quick]
//       [--benchmark_format=json]
// --base_mib sets the backing file and virtual disk size; the mount is 3x
// that plus 512 MiB. --quick: 64 MiB, 500 writes, --cow_mib 64.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "base/testing/loop_mount.h"
#include "benchmark/benchmark.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "benchmarks/qcow2_workloads.h"
#include "benchmarks/suite.h"
#include "benchmarks/workloads.h"
#include "io/aligned_buffer.h"
#include "io/block_node.h"
#include "io/engine.h"
#include "io/task.h"
#include "posix_file/file_node.h"
#include "posix_file/file_options.pb.h"
#include "qcow2/qcow2_node.h"
#include "qcow2/qcow2_options.pb.h"

ABSL_FLAG(uint64_t, base_mib, 1024,
          "backing file and virtual disk size in MiB (--quick: 64)");
ABSL_FLAG(bool, cold_backing, true,
          "before each timed run, sync and drop the page cache, so that "
          "copy-on-write reads from the backing file reach the disk as in "
          "the public measurement (its 40 GB backing image was read from the "
          "SSD); false: after the first run the backing file is read from "
          "memory");
ABSL_FLAG(int, count, 4000, "most 4 KiB writes per iteration (--quick: 500)");
ABSL_FLAG(uint64_t, cow_mib, 512,
          "writes per cell are at most this over the cluster size, at least "
          "256 (--quick: 64)");

namespace imgtool::benchmarks {
namespace {

constexpr uint64_t kRequest = 4096;
constexpr uint64_t kStep = kRequest * 1021;  // odd multiple: no repeats
constexpr int kDepth = 64;

uint64_t g_base_size = 0;
int g_count = 0;
uint64_t g_cow_bytes = 0;
bool g_cold_backing = true;
std::string g_dir;  // the XFS mount point
std::string g_base;  // the raw backing file

// Forwards everything to `inner` and counts the bytes read through it.
class CountingNode final : public io::BlockNode {
 public:
  CountingNode(std::unique_ptr<io::BlockNode> inner, uint64_t* read_bytes)
      : io::BlockNode(inner->filename(), inner->read_only()),
        inner_(std::move(inner)),
        read_bytes_(read_bytes) {}

  uint64_t size() const override { return inner_->size(); }
  absl::StatusOr<uint64_t> AllocatedSize() const override {
    return inner_->AllocatedSize();
  }
  io::Task<absl::Status> Close() override { return inner_->Close(); }

 protected:
  io::Task<absl::Status> DoRead(uint64_t offset, io::IoVec buf) override {
    *read_bytes_ += buf.size();
    return inner_->Read(offset, buf);
  }
  io::Task<absl::Status> DoWrite(uint64_t offset,
                                 io::ConstIoVec data) override {
    return inner_->Write(offset, data);
  }
  io::Task<absl::Status> DoWriteZeroes(uint64_t offset, uint64_t length,
                                       io::WriteZeroesFlags flags) override {
    return inner_->WriteZeroes(offset, length, flags);
  }
  io::Task<absl::Status> DoDiscard(uint64_t offset, uint64_t length) override {
    return inner_->Discard(offset, length);
  }
  io::Task<absl::Status> DoFlush() override { return inner_->Flush(); }
  io::Task<absl::StatusOr<io::BlockStatus>> DoGetBlockStatus(
      uint64_t offset, uint64_t max_length) override {
    return inner_->GetBlockStatus(offset, max_length);
  }

 private:
  std::unique_ptr<io::BlockNode> inner_;
  uint64_t* read_bytes_;
};

struct Overlay {
  std::unique_ptr<io::Engine> engine;
  std::unique_ptr<qcow2::Qcow2Node> node;
};

absl::StatusOr<Overlay> OpenOverlay(const std::string& path,
                                    uint64_t* backing_read_bytes) {
  Overlay overlay;
  ASSIGN_OR_RETURN(overlay.engine,
                   io::CreateEngine(io::EngineKind::kAuto, kDepth, nullptr));
  io::Engine* engine = overlay.engine.get();
  ASSIGN_OR_RETURN(std::unique_ptr<posix_file::FileNode> file,
                   OpenFileNode(*engine, path, /*read_only=*/false));
  qcow2::BackingOpener opener =
      [engine, backing_read_bytes](std::string filename, std::string format)
      -> io::Task<absl::StatusOr<std::unique_ptr<io::BlockNode>>> {
    (void)format;  // always raw here
    absl::StatusOr<std::unique_ptr<posix_file::FileNode>> base =
        OpenFileNode(*engine, filename, /*read_only=*/true);
    if (!base.ok()) co_return base.status();
    co_return std::unique_ptr<io::BlockNode>(
        std::make_unique<CountingNode>(std::move(*base), backing_read_bytes));
  };
  ASSIGN_OR_RETURN(overlay.node,
                   io::RunSync(*engine, qcow2::Qcow2Node::Open(
                                            std::move(file),
                                            qcow2::Qcow2OpenOptions(),
                                            std::move(opener))));
  return overlay;
}

// qemu-img bench's generator: `count` writes, offsets advancing by kStep
// modulo the node size, kDepth workers.
struct WriteState {
  io::BlockNode* node = nullptr;
  uint64_t size = 0;
  uint64_t next = 0;
  int left = 0;
  int running = 0;
  absl::Status error;
};

io::Task<void> Writer(WriteState* s, io::ConstIoVec buf) {
  while (s->error.ok() && s->left > 0) {
    --s->left;
    const uint64_t offset = s->next;
    s->next = (s->next + kStep) % s->size;
    absl::Status st = co_await s->node->Write(offset, buf);
    if (!st.ok() && s->error.ok()) s->error = std::move(st);
  }
}

absl::Status RandomWrites(io::Engine& engine, io::BlockNode& node, int count) {
  WriteState s;
  s.node = &node;
  s.size = node.size();
  s.left = count;
  io::AlignedBuffer buffer(kDepth * kRequest);
  std::memset(buffer.data(), 0x55, buffer.size());
  for (int i = 0; i < kDepth; ++i) {
    ++s.running;
    io::Spawn(Writer(&s, buffer.span().subspan(i * kRequest, kRequest)),
              [&s] { --s.running; });
  }
  while (s.running > 0) {
    if (engine.in_flight() == 0) {
      return absl::InternalError("RandomWrites: writers stalled");
    }
    RETURN_IF_ERROR(engine.Poll(/*wait=*/true));
  }
  return s.error;
}

// Writes back dirty pages and drops the clean page cache (root only), so
// the next reads of the backing file come from the disk.
// Errors: the errno of opening or writing /proc/sys/vm/drop_caches.
absl::Status DropPageCache() {
  sync();
  constexpr char kPath[] = "/proc/sys/vm/drop_caches";
  const int fd = open(kPath, O_WRONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(kPath, "open", errno);
  const bool written = write(fd, "3\n", 2) == 2;
  const int error_number = errno;
  close(fd);
  if (!written) return ErrnoStatus(kPath, "write", error_number);
  return absl::OkStatus();
}

void BM_OverlayRandomWrites(benchmark::State& state, uint64_t cluster_size,
                            bool extended_l2) {
  const int count = static_cast<int>(std::min<uint64_t>(
      g_count, std::max<uint64_t>(256, g_cow_bytes / cluster_size)));
  const std::string path = g_dir + "/overlay.qcow2";
  uint64_t backing_read_bytes = 0;
  double seconds = 0;
  for (auto _ : state) {
    state.PauseTiming();
    absl::Status st =
        CreateQcow2Image(path, g_base_size, cluster_size, extended_l2, g_base);
    absl::StatusOr<Overlay> overlay =
        st.ok() ? OpenOverlay(path, &backing_read_bytes)
                : absl::StatusOr<Overlay>(st);
    if (!overlay.ok()) {
      state.SkipWithError(std::string(overlay.status().ToString()).c_str());
      break;
    }
    if (g_cold_backing) {
      absl::Status dropped = DropPageCache();
      if (!dropped.ok()) {
        state.SkipWithError(std::string(dropped.ToString()).c_str());
        break;
      }
    }
    const auto start = std::chrono::steady_clock::now();
    state.ResumeTiming();
    st = RandomWrites(*overlay->engine, *overlay->node, count);
    state.PauseTiming();
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                             start)
                   .count();
    absl::Status closed =
        io::RunSync(*overlay->engine, overlay->node->Close());
    overlay->node.reset();
    overlay->engine.reset();
    if (st.ok()) st = closed;
    if (!st.ok()) {
      state.SkipWithError(std::string(st.ToString()).c_str());
      break;
    }
    state.ResumeTiming();
  }
  unlink(path.c_str());
  const double iterations = static_cast<double>(state.iterations());
  if (iterations == 0 || seconds <= 0) return;
  state.counters["seconds"] = seconds / iterations;
  state.counters["IOPS"] = iterations * count / seconds;
  state.counters["bytes_from_backing"] = backing_read_bytes / iterations;
  state.counters["writes"] = count;
}

}  // namespace
}  // namespace imgtool::benchmarks

int main(int argc, char** argv) {
  using namespace imgtool::benchmarks;
  InitSuite(argc, argv,
            "subcluster_bench: qcow2 cluster size x extended_l2, 4 KiB random "
            "writes onto an overlay (root). Result file contract: "
            "benchmarks/README.md");
  g_base_size = (Quick() ? 64 : absl::GetFlag(FLAGS_base_mib)) << 20;
  g_count = Quick() ? 500 : absl::GetFlag(FLAGS_count);
  g_cold_backing = absl::GetFlag(FLAGS_cold_backing);
  g_cow_bytes = (Quick() ? 64 : absl::GetFlag(FLAGS_cow_mib)) << 20;
  if (g_base_size < (4u << 20) || g_count < 1) {
    std::fprintf(stderr, "subcluster_bench: --base_mib >= 4, --count >= 1\n");
    return 1;
  }

  absl::StatusOr<std::unique_ptr<imgtool::testing::LoopMount>> mount =
      imgtool::testing::LoopMount::Create(imgtool::testing::FsKind::kXfs,
                                          3 * g_base_size + (512ull << 20));
  if (!mount.ok()) {
    std::fprintf(stderr, "subcluster_bench: cannot mount XFS: %s\n",
                 std::string(mount.status().ToString()).c_str());
    return 1;
  }
  g_dir = (*mount)->path();
  g_base = g_dir + "/base.raw";
  absl::Status st = CreateFullRaw(g_base, g_base_size);
  if (!st.ok()) {
    std::fprintf(stderr, "subcluster_bench: backing file: %s\n",
                 std::string(st.ToString()).c_str());
    return 1;
  }
  // The public table's sizes: 4k, 16k..2M; extended L2 needs >= 16k.
  for (uint64_t c = 4096; c <= (2u << 20); c *= 2) {
    if (c == 8192) continue;
    for (bool extended_l2 : {false, true}) {
      if (extended_l2 && c < 16384) continue;
      benchmark::RegisterBenchmark(
          BenchName("subcluster", {{"fs", "xfs"},
                                   {"cluster", absl::StrCat(c)},
                                   {"extended_l2", extended_l2 ? "on" : "off"}})
              .c_str(),
          BM_OverlayRandomWrites, c, extended_l2)
          ->Unit(benchmark::kMillisecond);
    }
  }
  AddSuiteContext("subcluster", "xfs");
  benchmark::AddCustomContext("base_bytes", absl::StrCat(g_base_size));
  benchmark::AddCustomContext("max_writes_per_iteration", absl::StrCat(g_count));
  benchmark::AddCustomContext("cow_bytes", absl::StrCat(g_cow_bytes));
  benchmark::AddCustomContext("cold_backing", g_cold_backing ? "1" : "0");
  RunSuite();
  return 0;
}
