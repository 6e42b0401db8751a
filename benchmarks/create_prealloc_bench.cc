// Suite `create_prealloc`: `imgtool create -f FMT -o preallocation=P` (off,
// falloc, full) of a raw and a qcow2 image on XFS, ext4 and ext4 without
// extents, where fallocate(2) fails with EOPNOTSUPP and falloc falls back to
// writing (glibc's posix_fallocate writes one byte per block).
//
//   create_prealloc/fs:F/fmt:T/prealloc:P  per iteration: a fresh `imgtool
//       create -q` of --image_mib, timed from spawn to exit. Counters:
//       seconds, allocated_bytes (st_blocks * 512 afterwards) and syscalls
//       (the whole process's system calls, from `strace -f -c` of one extra,
//       untimed create per configuration).
//
// Result file contract: benchmarks/README.md ("Result files").
// Run (root): bazel run //benchmarks:create_prealloc_bench -- [--image_mib=1024]
//     [--quick] [--imgtool=PATH]   (default: the imgtool of the runfiles)
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/testing/loop_mount.h"
#include "benchmark/benchmark.h"
#include "benchmarks/suite.h"

ABSL_FLAG(uint64_t, image_mib, 1024,
          "virtual size of each image in MiB (--quick: 32)");
ABSL_FLAG(std::string, imgtool, "",
          "the imgtool binary (default: imgtool/imgtool in the runfiles)");

namespace imgtool::benchmarks {
namespace {

uint64_t g_image_size = 0;
std::string g_imgtool;

std::vector<std::string> CreateCommand(const std::string& path,
                                       const std::string& fmt,
                                       const std::string& prealloc) {
  return {g_imgtool, "create", "-q", "-f", fmt, "-o",
          absl::StrCat("preallocation=", prealloc), path,
          absl::StrCat(g_image_size)};
}

// The "calls" column of the "total" line of `strace -c` output.
absl::StatusOr<uint64_t> StraceTotal(const std::string& text) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    std::vector<absl::string_view> cols =
        absl::StrSplit(line, ' ', absl::SkipWhitespace());
    if (cols.size() >= 5 && cols.back() == "total") {
      uint64_t calls = 0;
      if (absl::SimpleAtoi(cols[3], &calls)) return calls;
    }
  }
  return absl::InternalError(
      absl::StrCat("strace -c output has no total line: ", text));
}

// Syscalls of one create, counted by `strace -f -c` (not timed).
absl::StatusOr<uint64_t> CountSyscalls(const std::string& path,
                                       const std::string& fmt,
                                       const std::string& prealloc) {
  unlink(path.c_str());
  const std::string out = path + ".strace";
  std::vector<std::string> argv = {"strace", "-f", "-c", "-o", out};
  for (std::string& a : CreateCommand(path, fmt, prealloc)) argv.push_back(a);
  absl::StatusOr<std::string> ran = RunCommand(argv, /*merge_stderr=*/true);
  unlink(path.c_str());
  std::ifstream in(out);
  std::stringstream text;
  text << in.rdbuf();
  unlink(out.c_str());
  if (!ran.ok()) return ran.status();
  return StraceTotal(text.str());
}

void BM_Create(benchmark::State& state, std::string path, std::string fmt,
               std::string prealloc) {
  // Google Benchmark calls this more than once per repetition while it
  // finds the iteration count: count syscalls once per configuration.
  static std::map<std::string, uint64_t>* syscalls =
      new std::map<std::string, uint64_t>();
  auto it = syscalls->find(path);
  if (it == syscalls->end()) {
    absl::StatusOr<uint64_t> n = CountSyscalls(path, fmt, prealloc);
    if (!n.ok()) {
      state.SkipWithError(std::string(n.status().ToString()).c_str());
      return;
    }
    it = syscalls->emplace(path, *n).first;
  }
  const std::vector<std::string> command = CreateCommand(path, fmt, prealloc);
  double seconds = 0;
  uint64_t allocated = 0;
  for (auto _ : state) {
    state.PauseTiming();
    unlink(path.c_str());
    sync();  // earlier iterations' writeback must not land in this one
    state.ResumeTiming();
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<std::string> ran = RunCommand(command);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                             start)
                   .count();
    state.PauseTiming();
    absl::StatusOr<uint64_t> bytes =
        ran.ok() ? AllocatedBytes(path) : ran.status();
    unlink(path.c_str());
    if (!bytes.ok()) {
      state.SkipWithError(std::string(bytes.status().ToString()).c_str());
      return;
    }
    allocated = *bytes;
    state.ResumeTiming();
  }
  state.counters["seconds"] = seconds / static_cast<double>(state.iterations());
  state.counters["syscalls"] = static_cast<double>(it->second);
  state.counters["allocated_bytes"] = static_cast<double>(allocated);
}

}  // namespace
}  // namespace imgtool::benchmarks

int main(int argc, char** argv) {
  using namespace imgtool::benchmarks;
  using imgtool::testing::FsKind;
  const std::string program = InitSuite(
      argc, argv,
      "create_prealloc_bench: imgtool create with preallocation off/falloc/"
      "full on XFS, ext4, ext4 without extents (root). Result file contract: "
      "benchmarks/README.md");
  g_image_size = (Quick() ? 32 : absl::GetFlag(FLAGS_image_mib)) << 20;
  g_imgtool = ImgtoolBinary(program, absl::GetFlag(FLAGS_imgtool));
  if (g_image_size < (1u << 20)) {
    std::fprintf(stderr, "create_prealloc_bench: --image_mib must be >= 1\n");
    return 1;
  }
  const std::vector<SuiteMount> mounts = MountAll(
      "create_prealloc_bench",
      {FsKind::kXfs, FsKind::kExt4, FsKind::kExt4NoExtents},
      std::max<uint64_t>(512ull << 20, 2 * g_image_size + (64 << 20)));
  for (const SuiteMount& m : mounts) {
    for (const char* fmt : {"raw", "qcow2"}) {
      for (const char* prealloc : {"off", "falloc", "full"}) {
        const std::string path = absl::StrCat(m.mount->path(), "/img-", fmt,
                                              "-", prealloc, ".", fmt);
        benchmark::RegisterBenchmark(
            BenchName("create_prealloc", {{"fs", m.fs},
                                          {"fmt", fmt},
                                          {"prealloc", prealloc}})
                .c_str(),
            BM_Create, path, std::string(fmt), std::string(prealloc))
            ->Unit(benchmark::kMillisecond);
      }
    }
  }
  AddSuiteContext("create_prealloc", "xfs,ext4,ext4_noextents");
  benchmark::AddCustomContext("image_bytes", absl::StrCat(g_image_size));
  RunSuite();
  return 0;
}
