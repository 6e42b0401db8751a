// Suite `prealloc_filter`: qcow2 with and without the preallocate filter
// between it and its file (`qcow2 -> preallocate -> file` vs `qcow2 ->
// file`), the measurement of the filter's series (preallocate-filter.md §9):
// sequential writes into a fresh 16 GiB qcow2 image (64 KiB clusters),
// cache=none, 64 in flight, on XFS and ext4 loop mounts.
//
//   prealloc_filter/fs:F/filter:{off,on}/write:aligned16k
//       16 KiB writes at 0, 16 KiB, 32 KiB, ...
//   prealloc_filter/fs:F/filter:{off,on}/write:unaligned64k
//       64 KiB writes at 1 KiB, 65 KiB, ... (each straddles two clusters and
//       is not aligned to the file's O_DIRECT request alignment)
//   Per iteration: a fresh image and chain (not timed), --write_mib of
//   writes (timed), Close (not timed; the filter truncates its tail).
//   Counters: seconds, MiB_per_s, IOPS, extents (FIEMAP extents of the image
//   file after close).
//
// Result file contract: benchmarks/README.md ("Result files").
// Run (root): bazel run //benchmarks:prealloc_filter_bench -- [--write_mib=512]
//     [--quick]
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/testing/loop_mount.h"
#include "benchmark/benchmark.h"
#include "benchmarks/qcow2_workloads.h"
#include "benchmarks/suite.h"
#include "benchmarks/workloads.h"
#include "io/block_node.h"
#include "io/engine.h"
#include "io/task.h"
#include "posix_file/file_node.h"
#include "prealloc_filter/prealloc_filter.h"
#include "prealloc_filter/prealloc_options.pb.h"
#include "qcow2/qcow2_node.h"
#include "qcow2/qcow2_options.pb.h"

ABSL_FLAG(uint64_t, write_mib, 512,
          "MiB written per iteration (--quick: 32)");

namespace imgtool::benchmarks {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kVirtualSize = uint64_t{16} << 30;
constexpr uint64_t kClusterSize = 64 << 10;
constexpr int kDepth = 64;

uint64_t g_write_bytes = 0;

struct Run {
  double seconds = 0;
  uint64_t extents = 0;
};

absl::StatusOr<Run> RunOnce(const std::string& path, bool filter,
                            uint64_t first_offset, uint64_t request) {
  RETURN_IF_ERROR(CreateQcow2Image(path, kVirtualSize, kClusterSize,
                                   /*extended_l2=*/false, ""));
  ASSIGN_OR_RETURN(std::unique_ptr<io::Engine> engine,
                   io::CreateEngine(io::EngineKind::kAuto, kDepth, nullptr));
  ASSIGN_OR_RETURN(std::unique_ptr<posix_file::FileNode> file,
                   OpenFileNode(*engine, path, /*read_only=*/false));
  std::unique_ptr<io::BlockNode> below = std::move(file);
  if (filter) {
    absl::StatusOr<std::unique_ptr<prealloc_filter::PreallocFilterNode>> node =
        io::RunSync(*engine, prealloc_filter::OpenPreallocFilter(
                                 std::move(below),
                                 prealloc_filter::PreallocFilterOptions()));
    RETURN_IF_ERROR(node.status());
    below = std::move(*node);
  }
  ASSIGN_OR_RETURN(std::unique_ptr<qcow2::Qcow2Node> qcow2,
                   io::RunSync(*engine, qcow2::Qcow2Node::Open(
                                            std::move(below),
                                            qcow2::Qcow2OpenOptions(),
                                            /*open_backing=*/nullptr)));
  const uint64_t count = std::max<uint64_t>(1, g_write_bytes / request);
  const Clock::time_point start = Clock::now();
  absl::Status st = WriteStrided(*engine, *qcow2, first_offset,
                                 first_offset + count * request, request,
                                 request, kDepth, 0x5a);
  Run run;
  run.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  absl::Status closed = io::RunSync(*engine, qcow2->Close());
  qcow2.reset();
  engine.reset();
  RETURN_IF_ERROR(st);
  RETURN_IF_ERROR(closed);
  ASSIGN_OR_RETURN(RawImage raw, OpenRaw(path, /*read_only=*/true));
  absl::StatusOr<uint64_t> extents = raw.node->ExtentCount();
  RETURN_IF_ERROR(CloseRaw(raw));
  RETURN_IF_ERROR(extents.status());
  run.extents = *extents;
  return run;
}

void BM_Writes(benchmark::State& state, std::string path, bool filter,
               uint64_t first_offset, uint64_t request) {
  double seconds = 0;
  uint64_t extents = 0;
  for (auto _ : state) {
    absl::StatusOr<Run> run = RunOnce(path, filter, first_offset, request);
    unlink(path.c_str());
    if (!run.ok()) {
      state.SkipWithError(std::string(run.status().ToString()).c_str());
      return;
    }
    seconds += run->seconds;
    extents = run->extents;
  }
  if (seconds <= 0) return;
  const double iterations = static_cast<double>(state.iterations());
  const uint64_t count = std::max<uint64_t>(1, g_write_bytes / request);
  state.counters["seconds"] = seconds / iterations;
  state.counters["IOPS"] = iterations * count / seconds;
  state.counters["MiB_per_s"] =
      iterations * count * request / seconds / (1 << 20);
  state.counters["extents"] = static_cast<double>(extents);
}

}  // namespace
}  // namespace imgtool::benchmarks

int main(int argc, char** argv) {
  using namespace imgtool::benchmarks;
  using imgtool::testing::FsKind;
  InitSuite(argc, argv,
            "prealloc_filter_bench: qcow2 with and without the preallocate "
            "filter, aligned 16 KiB and unaligned 64 KiB sequential writes "
            "(root). Result file contract: benchmarks/README.md");
  g_write_bytes = (Quick() ? 32 : absl::GetFlag(FLAGS_write_mib)) << 20;
  if (g_write_bytes < (1u << 20)) {
    std::fprintf(stderr, "prealloc_filter_bench: --write_mib must be >= 1\n");
    return 1;
  }
  // Room for the data, the metadata and the filter's 128 MiB ahead.
  const std::vector<SuiteMount> mounts =
      MountAll("prealloc_filter_bench", {FsKind::kXfs, FsKind::kExt4},
               g_write_bytes * 5 / 4 + (768ull << 20));
  for (const SuiteMount& m : mounts) {
    const std::string path = m.mount->path() + "/image.qcow2";
    for (bool filter : {false, true}) {
      struct Write {
        const char* label;
        uint64_t first_offset;
        uint64_t request;
      };
      for (const Write& w : {Write{"aligned16k", 0, 16 << 10},
                             Write{"unaligned64k", 1 << 10, 64 << 10}}) {
        benchmark::RegisterBenchmark(
            BenchName("prealloc_filter", {{"fs", m.fs},
                                          {"filter", filter ? "on" : "off"},
                                          {"write", w.label}})
                .c_str(),
            BM_Writes, path, filter, w.first_offset, w.request)
            ->Unit(benchmark::kMillisecond);
      }
    }
  }
  AddSuiteContext("prealloc_filter", "xfs,ext4");
  benchmark::AddCustomContext("write_bytes", absl::StrCat(g_write_bytes));
  benchmark::AddCustomContext("virtual_bytes", absl::StrCat(kVirtualSize));
  benchmark::AddCustomContext("cluster_bytes", absl::StrCat(kClusterSize));
  benchmark::AddCustomContext("depth", absl::StrCat(kDepth));
  RunSuite();
  return 0;
}
