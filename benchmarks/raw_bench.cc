// Raw images on a real XFS loop mount, extent size hint 0 vs 1 MiB (the
// default): the seed experiment of file-posix.md §2 as a Google Benchmark.
//
//   BM_InterleavedWrites/hint:H  time of the write phase: 4 KiB O_DIRECT
//       writes every 8 KiB through FileNode, first pass at 0, second at
//       4096, 64 in flight, on a freshly created image. Counter `extents`
//       is FileNode::ExtentCount() (FIEMAP) afterwards.
//   BM_Map/hint:H/passes:P  time of a block status walk (what `map` does)
//       over a file after P = 1 (first pass only: data and holes alternate)
//       or 2 (both passes: all data) write passes; counters `extents` and
//       `answers` (block status calls).
//
// Run (root; the mount needs it):
//   bazel run -c opt //benchmarks:raw_bench -- --benchmark_format=json
// --image_mib=N sets the image size (default 256 MiB); the mount is 4x that.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/testing/loop_mount.h"
#include "benchmark/benchmark.h"
#include "benchmarks/workloads.h"

namespace imgtool::benchmarks {
namespace {

uint64_t g_image_size = 256ull << 20;
std::string g_dir;  // the XFS mount point

void Fail(benchmark::State& state, const absl::Status& st) {
  state.SkipWithError(std::string(st.ToString()).c_str());
}

std::optional<uint64_t> HintArg(const benchmark::State& state) {
  const uint64_t hint = static_cast<uint64_t>(state.range(0));
  return hint;  // explicit 0 or 1 MiB
}

void BM_InterleavedWrites(benchmark::State& state) {
  const std::string path = g_dir + "/interleaved.raw";
  uint64_t extents = 0;
  for (auto _ : state) {
    state.PauseTiming();
    absl::StatusOr<RawImage> image =
        CreateAndOpenRaw(path, g_image_size, HintArg(state));
    if (!image.ok()) {
      Fail(state, image.status());
      break;
    }
    state.ResumeTiming();
    absl::Status st = WriteInterleaved(*image->engine, *image->node, 64);
    state.PauseTiming();
    if (!st.ok()) {
      Fail(state, st);
      break;
    }
    absl::StatusOr<uint64_t> count = image->node->ExtentCount();
    if (!count.ok()) {
      Fail(state, count.status());
      break;
    }
    extents = *count;
    st = CloseRaw(*image);
    if (!st.ok()) {
      Fail(state, st);
      break;
    }
    unlink(path.c_str());
    state.ResumeTiming();
  }
  state.counters["extents"] = static_cast<double>(extents);
  state.SetBytesProcessed(state.iterations() * g_image_size);
  state.SetItemsProcessed(state.iterations() * (g_image_size / 4096));
}

void BM_Map(benchmark::State& state) {
  const std::string path = g_dir + "/map.raw";
  uint64_t extents = 0;
  {
    absl::StatusOr<RawImage> image =
        CreateAndOpenRaw(path, g_image_size, HintArg(state));
    if (!image.ok()) {
      Fail(state, image.status());
      return;
    }
    absl::Status st =
        state.range(1) == 1
            ? WriteStrided(*image->engine, *image->node, 0, g_image_size,
                           8192, 4096, 64)
            : WriteInterleaved(*image->engine, *image->node, 64);
    if (st.ok()) {
      absl::StatusOr<uint64_t> count = image->node->ExtentCount();
      st = count.status();
      if (count.ok()) extents = *count;
    }
    absl::Status closed = CloseRaw(*image);
    if (st.ok()) st = closed;
    if (!st.ok()) {
      Fail(state, st);
      return;
    }
  }
  // A fresh node per walk, as a new `map` process would have: FileNode
  // remembers the last data extent, which a second walk would hit.
  uint64_t answers = 0;
  for (auto _ : state) {
    state.PauseTiming();
    absl::StatusOr<RawImage> image = OpenRaw(path, /*read_only=*/true);
    if (!image.ok()) {
      Fail(state, image.status());
      break;
    }
    state.ResumeTiming();
    absl::StatusOr<uint64_t> walked =
        WalkBlockStatus(*image->engine, *image->node);
    state.PauseTiming();
    absl::Status closed = CloseRaw(*image);
    if (!walked.ok() || !closed.ok()) {
      Fail(state, walked.ok() ? closed : walked.status());
      break;
    }
    answers = *walked;
    state.ResumeTiming();
  }
  state.counters["extents"] = static_cast<double>(extents);
  state.counters["answers"] = static_cast<double>(answers);
  unlink(path.c_str());
}

BENCHMARK(BM_InterleavedWrites)
    ->ArgName("hint")
    ->Arg(0)
    ->Arg(1 << 20)
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_Map)
    ->ArgNames({"hint", "passes"})
    ->ArgsProduct({{0, 1 << 20}, {1, 2}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace imgtool::benchmarks

int main(int argc, char** argv) {
  // Our own flag first, then Google Benchmark's.
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--image_mib=", 12) == 0) {
      imgtool::benchmarks::g_image_size =
          std::strtoull(argv[i] + 12, nullptr, 10) << 20;
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;

  absl::StatusOr<std::unique_ptr<imgtool::testing::LoopMount>> mount =
      imgtool::testing::LoopMount::Create(
          imgtool::testing::FsKind::kXfs,
          std::max<uint64_t>(512ull << 20, 4 * imgtool::benchmarks::g_image_size));
  if (!mount.ok()) {
    std::fprintf(stderr, "raw_bench: cannot mount XFS: %s\n",
                 std::string(mount.status().ToString()).c_str());
    return 1;
  }
  imgtool::benchmarks::g_dir = (*mount)->path();
  benchmark::AddCustomContext("image_bytes",
                              std::to_string(imgtool::benchmarks::g_image_size));
  benchmark::AddCustomContext("filesystem", "xfs (loop)");
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
