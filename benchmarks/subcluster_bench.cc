// qcow2 subclusters (extended L2 entries) through the driver alone: the
// public subcluster measurement (shared/reference/subclusters.md §9,
// "backing" rows) as a Google Benchmark on a real XFS loop mount.
//
//   BM_OverlayRandomWrites/cluster:C/extended_l2:E
//       A fresh qcow2 overlay (cluster size C, extended L2 off/on) over a
//       fully written raw backing file, opened with cache=none like
//       `qemu-img bench -t none`, gets --count 4 KiB writes, 64 in flight,
//       at offsets i * 4 KiB * 1021 modulo the virtual size (so they spread
//       over the whole disk and almost all land in different clusters).
//       Counters: `IOPS` (writes per second of the write phase) and
//       `backing_read_bytes` (bytes the driver read from the backing file,
//       i.e. copy-on-write traffic, per iteration). Overlay creation and
//       close are not timed.
//
// Run (root; the mount needs it):
//   bazel run -c opt //benchmarks:subcluster_bench -- [--base_mib=256]
//       [--count=2000] [--benchmark_format=json]
// --base_mib sets the backing file and virtual disk size (default 256 MiB);
// the mount is 3x that plus 512 MiB.
#include <unistd.h>

#include <algorithm>
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
#include "base/status_macros.h"
#include "base/testing/loop_mount.h"
#include "benchmark/benchmark.h"
#include "benchmarks/workloads.h"
#include "io/aligned_buffer.h"
#include "io/block_node.h"
#include "io/engine.h"
#include "io/task.h"
#include "posix_file/file_node.h"
#include "posix_file/file_options.pb.h"
#include "qcow2/create.h"
#include "qcow2/qcow2_node.h"
#include "qcow2/qcow2_options.pb.h"

namespace imgtool::benchmarks {
namespace {

constexpr uint64_t kRequest = 4096;
constexpr uint64_t kStep = kRequest * 1021;  // odd multiple: no repeats
constexpr int kDepth = 64;

uint64_t g_base_size = 256ull << 20;
int g_count = 2000;
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

absl::StatusOr<std::unique_ptr<posix_file::FileNode>> OpenFile(
    io::Engine& engine, const std::string& path, bool read_only) {
  posix_file::FileOpenOptions open;
  open.set_filename(path);
  open.set_cache("none");
  open.set_read_only(read_only);
  return posix_file::FileNode::Open(engine, open, nullptr);
}

// Writes a fresh overlay at `path` (what `qemu-img create -f qcow2 -b base
// -F raw -o cluster_size=C,extended_l2=E` writes).
absl::Status CreateOverlay(const std::string& path, uint64_t cluster_size,
                           bool extended_l2) {
  unlink(path.c_str());
  posix_file::FileCreateOptions create;
  create.set_size(0);
  RETURN_IF_ERROR(posix_file::CreateFile(path, create, nullptr));
  ASSIGN_OR_RETURN(std::unique_ptr<io::Engine> engine,
                   io::CreateEngine(io::EngineKind::kAuto, kDepth, nullptr));
  ASSIGN_OR_RETURN(std::unique_ptr<posix_file::FileNode> file,
                   OpenFile(*engine, path, /*read_only=*/false));
  qcow2::Qcow2CreateOptions options;
  options.set_size(g_base_size);
  options.set_cluster_size(cluster_size);
  options.set_backing_file(g_base);
  options.set_backing_fmt("raw");
  options.set_extended_l2(extended_l2);
  absl::Status st = io::RunSync(*engine, qcow2::CreateQcow2(*file, options));
  absl::Status closed = io::RunSync(*engine, file->Close());
  RETURN_IF_ERROR(st);
  return closed;
}

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
                   OpenFile(*engine, path, /*read_only=*/false));
  qcow2::BackingOpener opener =
      [engine, backing_read_bytes](std::string filename, std::string format)
      -> io::Task<absl::StatusOr<std::unique_ptr<io::BlockNode>>> {
    (void)format;  // always raw here
    absl::StatusOr<std::unique_ptr<posix_file::FileNode>> base =
        OpenFile(*engine, filename, /*read_only=*/true);
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

void BM_OverlayRandomWrites(benchmark::State& state) {
  const uint64_t cluster_size = static_cast<uint64_t>(state.range(0));
  const bool extended_l2 = state.range(1) != 0;
  const std::string path = g_dir + "/overlay.qcow2";
  uint64_t backing_read_bytes = 0;
  double seconds = 0;
  for (auto _ : state) {
    state.PauseTiming();
    absl::Status st = CreateOverlay(path, cluster_size, extended_l2);
    absl::StatusOr<Overlay> overlay =
        st.ok() ? OpenOverlay(path, &backing_read_bytes)
                : absl::StatusOr<Overlay>(st);
    if (!overlay.ok()) {
      state.SkipWithError(std::string(overlay.status().ToString()).c_str());
      break;
    }
    const auto start = std::chrono::steady_clock::now();
    state.ResumeTiming();
    st = RandomWrites(*overlay->engine, *overlay->node, g_count);
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
  state.counters["IOPS"] =
      seconds > 0 ? iterations * g_count / seconds : 0.0;
  state.counters["backing_read_bytes"] =
      iterations > 0 ? backing_read_bytes / iterations : 0.0;
  state.SetItemsProcessed(state.iterations() * g_count);
}

void Args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"cluster", "extended_l2"});
  for (int64_t c = 4096; c <= (2 << 20); c *= 2) {
    if (c == 8192) continue;  // the public table's sizes: 4k, 16k..2M
    b->Args({c, 0});
    if (c >= 16384) b->Args({c, 1});
  }
}

BENCHMARK(BM_OverlayRandomWrites)
    ->Apply(Args)
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

absl::Status MakeBase(const std::string& path) {
  ASSIGN_OR_RETURN(RawImage image, CreateAndOpenRaw(path, g_base_size, 0));
  absl::Status st = WriteStrided(*image.engine, *image.node, 0, g_base_size,
                                 1 << 20, 1 << 20, 8, 0xaa);
  absl::Status closed = CloseRaw(image);
  RETURN_IF_ERROR(st);
  return closed;
}

}  // namespace
}  // namespace imgtool::benchmarks

int main(int argc, char** argv) {
  using imgtool::benchmarks::g_base_size;
  using imgtool::benchmarks::g_count;
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--base_mib=", 11) == 0) {
      g_base_size = std::strtoull(argv[i] + 11, nullptr, 10) << 20;
    } else if (std::strncmp(argv[i], "--count=", 8) == 0) {
      g_count = std::atoi(argv[i] + 8);
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
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
  imgtool::benchmarks::g_dir = (*mount)->path();
  imgtool::benchmarks::g_base = imgtool::benchmarks::g_dir + "/base.raw";
  absl::Status st = imgtool::benchmarks::MakeBase(imgtool::benchmarks::g_base);
  if (!st.ok()) {
    std::fprintf(stderr, "subcluster_bench: backing file: %s\n",
                 std::string(st.ToString()).c_str());
    return 1;
  }
  benchmark::AddCustomContext("base_bytes", std::to_string(g_base_size));
  benchmark::AddCustomContext("writes_per_iteration", std::to_string(g_count));
  benchmark::AddCustomContext("filesystem", "xfs (loop)");
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
