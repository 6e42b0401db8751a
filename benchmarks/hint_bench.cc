// Suite `hint`: the extent size hint of raw images (0, 1 MiB = the default,
// 8 MiB) on XFS and ext4 loop mounts: how the fragmenting write pattern of
// file-posix.md §2 (4 KiB O_DIRECT writes every 8 KiB, a pass at 0 then one
// at 4096, 64 in flight) runs, how many extents it leaves, and how long a
// `map`-style block status walk over the result takes. ext4 has no extent
// size hint (create ignores it there), so its three rows should match.
//
//   hint/fs:F/hint:H/op:write  a fresh image per iteration, the write phase
//       timed. Counters: seconds, MiB_per_s (image bytes / seconds), extents
//       (FIEMAP afterwards). The last image stays for op:map.
//   hint/fs:F/hint:H/op:map    a block status walk with a fresh node per
//       walk (repeated up to 0.05 s per iteration), over the image op:write
//       left (made anew if missing). Counters: seconds (mean per walk),
//       extents, answers.
//
// Result file contract: benchmarks/README.md ("Result files").
// Run (root): bazel run //benchmarks:hint_bench -- [--image_mib=256] [--quick]
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "base/testing/loop_mount.h"
#include "benchmark/benchmark.h"
#include "benchmarks/suite.h"
#include "benchmarks/workloads.h"

ABSL_FLAG(uint64_t, image_mib, 256,
          "raw image size in MiB (--quick: 32); each mount is 4x that");

namespace imgtool::benchmarks {
namespace {

using Clock = std::chrono::steady_clock;

uint64_t g_image_size = 0;
// op:map repeats its walk until this much walk time (or kMaxWalks walks).
constexpr double kMinWalkSeconds = 0.05;
constexpr int kMaxWalks = 1000;

double Seconds(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Creates `path` with `hint` and runs the write phase; returns its seconds
// and sets *extents.
absl::StatusOr<double> WritePhase(const std::string& path, uint64_t hint,
                                  uint64_t* extents) {
  unlink(path.c_str());
  absl::StatusOr<RawImage> image = CreateAndOpenRaw(path, g_image_size, hint);
  if (!image.ok()) return image.status();
  const Clock::time_point start = Clock::now();
  absl::Status st = WriteInterleaved(*image->engine, *image->node, 64);
  const double seconds = Seconds(start);
  absl::StatusOr<uint64_t> count = image->node->ExtentCount();
  absl::Status closed = CloseRaw(*image);
  if (!st.ok()) return st;
  if (!count.ok()) return count.status();
  if (!closed.ok()) return closed;
  *extents = *count;
  return seconds;
}

void BM_Write(benchmark::State& state, std::string path, uint64_t hint) {
  double seconds = 0;
  uint64_t extents = 0;
  for (auto _ : state) {
    absl::StatusOr<double> s = WritePhase(path, hint, &extents);
    if (!s.ok()) {
      state.SkipWithError(std::string(s.status().ToString()).c_str());
      return;
    }
    seconds += *s;
  }
  const double per = seconds / static_cast<double>(state.iterations());
  state.counters["seconds"] = per;
  state.counters["MiB_per_s"] = g_image_size / per / (1 << 20);
  state.counters["extents"] = static_cast<double>(extents);
}

void BM_Map(benchmark::State& state, std::string path, uint64_t hint) {
  uint64_t extents = 0;
  if (access(path.c_str(), F_OK) != 0) {
    absl::StatusOr<double> s = WritePhase(path, hint, &extents);
    if (!s.ok()) {
      state.SkipWithError(std::string(s.status().ToString()).c_str());
      return;
    }
  }
  double seconds = 0;
  uint64_t walks = 0;
  uint64_t answers = 0;
  for (auto _ : state) {
    // One walk can take microseconds: walk until kMinWalkSeconds passed.
    double walked_seconds = 0;
    for (int n = 0; n < kMaxWalks && walked_seconds < kMinWalkSeconds; ++n) {
      state.PauseTiming();
      // A fresh node per walk, as a new `map` process has: FileNode
      // remembers the last data extent, which a second walk would hit.
      absl::StatusOr<RawImage> image = OpenRaw(path, /*read_only=*/true);
      if (!image.ok()) {
        state.SkipWithError(std::string(image.status().ToString()).c_str());
        return;
      }
      absl::StatusOr<uint64_t> count = image->node->ExtentCount();
      state.ResumeTiming();
      const Clock::time_point start = Clock::now();
      absl::StatusOr<uint64_t> walked =
          WalkBlockStatus(*image->engine, *image->node);
      walked_seconds += Seconds(start);
      state.PauseTiming();
      absl::Status closed = CloseRaw(*image);
      if (!walked.ok() || !closed.ok() || !count.ok()) {
        const absl::Status st = !walked.ok()  ? walked.status()
                                : !count.ok() ? count.status()
                                              : closed;
        state.SkipWithError(std::string(st.ToString()).c_str());
        return;
      }
      answers = *walked;
      extents = *count;
      ++walks;
      state.ResumeTiming();
    }
    seconds += walked_seconds;
  }
  state.counters["seconds"] = seconds / static_cast<double>(walks);
  state.counters["extents"] = static_cast<double>(extents);
  state.counters["answers"] = static_cast<double>(answers);
}

}  // namespace
}  // namespace imgtool::benchmarks

int main(int argc, char** argv) {
  using namespace imgtool::benchmarks;
  using imgtool::testing::FsKind;
  InitSuite(argc, argv,
            "hint_bench: extent size hint 0 / 1 MiB / 8 MiB on XFS and ext4 "
            "(root). Result file contract: benchmarks/README.md");
  g_image_size = (Quick() ? 32 : absl::GetFlag(FLAGS_image_mib)) << 20;
  if (g_image_size < (1u << 20)) {
    std::fprintf(stderr, "hint_bench: --image_mib must be >= 1\n");
    return 1;
  }
  const std::vector<SuiteMount> mounts =
      MountAll("hint_bench", {FsKind::kXfs, FsKind::kExt4},
               std::max<uint64_t>(512ull << 20, 4 * g_image_size));
  for (const SuiteMount& m : mounts) {
    for (uint64_t hint : {0ull, 1ull << 20, 8ull << 20}) {
      const std::string path =
          absl::StrCat(m.mount->path(), "/hint-", hint, ".raw");
      const std::vector<Label> labels = {{"fs", m.fs},
                                         {"hint", absl::StrCat(hint)}};
      std::vector<Label> write = labels, map = labels;
      write.push_back({"op", "write"});
      map.push_back({"op", "map"});
      benchmark::RegisterBenchmark(BenchName("hint", write).c_str(), BM_Write,
                                   path, hint)
          ->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark(BenchName("hint", map).c_str(), BM_Map,
                                   path, hint)
          ->Unit(benchmark::kMillisecond);
    }
  }
  AddSuiteContext("hint", "xfs,ext4");
  benchmark::AddCustomContext("image_bytes", absl::StrCat(g_image_size));
  RunSuite();
  return 0;
}
