// What every benchmark suite binary shares: the result file contract of
// benchmarks/README.md ("Result files"): benchmark names
// "<suite>/<key>:<value>/...", the context keys (suite, machine, kernel,
// filesystems, imgtool_commit, build, quick, load_avg_start) and the start-up
// that splits Google Benchmark's flags from the suite's own (Abseil) flags.
// Thread model: call from main() only, before RunSpecifiedBenchmarks.
#ifndef IMGTOOL_BENCHMARKS_SUITE_H_
#define IMGTOOL_BENCHMARKS_SUITE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/testing/loop_mount.h"
#include "benchmark/benchmark.h"

namespace imgtool::benchmarks {

// One config label of a benchmark name: key and value, neither containing
// '/' (values: plain numbers in bytes, or words).
using Label = std::pair<std::string, std::string>;

// "<suite>/<k1>:<v1>/<k2>:<v2>..." in the order given.
std::string BenchName(absl::string_view suite, const std::vector<Label>& labels);

// Parses the command line: Google Benchmark's flags first (defaulting
// --benchmark_min_time to 1 us unless given: one iteration per repetition),
// then the suite's Abseil flags (ABSL_FLAG in the suite's .cc, plus the
// shared --quick and --imgtool_commit). Exits with a usage message on
// unknown flags or positional arguments. Returns the program name (argv[0]).
std::string InitSuite(int argc, char** argv, absl::string_view usage);

// True when --quick was given (smoke-run sizes).
bool Quick();

// Adds the contract's context keys; `filesystems` is the comma-separated
// list of the filesystems the suite runs on ("xfs,ext4").
void AddSuiteContext(absl::string_view suite, absl::string_view filesystems);


// A loop-mounted filesystem of a suite and its label value (FsName).
struct SuiteMount {
  std::string fs;
  std::unique_ptr<testing::LoopMount> mount;
};

// "xfs", "ext4", "ext4_noextents": the `fs` label values.
const char* FsName(testing::FsKind kind);

// Makes one loop mount of `size_bytes` per kind, in order. On failure prints
// "<program>: cannot mount <fs>: <status>" and exits 1 (unmounting the ones
// made so far).
std::vector<SuiteMount> MountAll(absl::string_view program,
                                 const std::vector<testing::FsKind>& kinds,
                                 uint64_t size_bytes);

// st_blocks * 512 of `path`. kNotFound etc. from stat(2) via errno.
absl::StatusOr<uint64_t> AllocatedBytes(const std::string& path);

// Runs `argv` as a subprocess, stdout captured (stderr goes to ours unless
// `merge_stderr`). kInternal with the output when it exits non-zero or dies.
absl::StatusOr<std::string> RunCommand(const std::vector<std::string>& argv,
                                       bool merge_stderr = false);

// The imgtool binary a suite runs: `flag_value` if not empty, else
// imgtool/imgtool in the runfiles (RUNFILES_DIR, or "<program>.runfiles").
// If it is not executable, prints "<program>: <path>: not an executable
// (--imgtool)" and exits 1.
std::string ImgtoolBinary(const std::string& program,
                          const std::string& flag_value);

// Runs the registered benchmarks and shuts Google Benchmark down.
void RunSuite();

}  // namespace imgtool::benchmarks

#endif  // IMGTOOL_BENCHMARKS_SUITE_H_
