// What every benchmark suite binary shares: the result file contract of
// benchmarks/README.md ("Result files"): benchmark names
// "<suite>/<key>:<value>/...", the context keys (suite, machine, kernel,
// filesystems, imgtool_commit, build, quick, load_avg_start) and the start-up
// that splits Google Benchmark's flags from the suite's own (Abseil) flags.
// Thread model: call from main() only, before RunSpecifiedBenchmarks.
#ifndef IMGTOOL_BENCHMARKS_SUITE_H_
#define IMGTOOL_BENCHMARKS_SUITE_H_

#include <sys/resource.h>
#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
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

// Starts `argv` (PATH searched) as a child process in `dir` (empty: this
// process's directory), stdin from /dev/null, stdout to `out_path` and
// stderr to `err_path` (each truncated or created; empty: /dev/null), with
// BUILD_WORKING_DIRECTORY unset (under `bazel run` imgtool would chdir to
// the user's directory, imgtool/main.cc, and the suites' names are relative
// to `dir`). Returns its pid; the caller waits for it. kInternal (errno)
// when fork fails; a child that cannot open its files or chdir exits 126,
// one that cannot exec 127.
absl::StatusOr<pid_t> SpawnCommand(const std::vector<std::string>& argv,
                                   const std::string& dir,
                                   const std::string& out_path,
                                   const std::string& err_path);

// A finished run of RunTimedCommand: wall seconds from the spawn to the
// child's exit, and the child's rusage (wait4).
struct CommandRun {
  double seconds = 0;
  struct rusage usage = {};
};

// SpawnCommand, then waits for the child. kInternal "`ARGV` failed (exit
// N|signal N): FIRST LINE OF err_path" when it does not exit 0.
absl::StatusOr<CommandRun> RunTimedCommand(const std::vector<std::string>& argv,
                                           const std::string& dir,
                                           const std::string& out_path,
                                           const std::string& err_path);

// The first line of the file at `path` ("" if it cannot be read).
std::string FirstLine(const std::string& path);

// The seconds of "Run completed in X seconds." (qemu-img bench and imgtool
// bench print it) in the output file at `out_path`. kInternal if there is
// no such line with X > 0.
absl::StatusOr<double> BenchSeconds(const std::string& out_path);

// The imgtool binary a suite runs: `flag_value` if not empty, else
// imgtool/imgtool in the runfiles (RUNFILES_DIR, or "<program>.runfiles").
// If it is not executable, prints "<program>: <path>: not an executable
// (--imgtool)" and exits 1.
std::string ImgtoolBinary(const std::string& program,
                          const std::string& flag_value);

// Runs the registered benchmarks and shuts Google Benchmark down.
void RunSuite();

// ---- Whole-command suites (chain, snapshot): every (case, tool) run is
// measured before Google Benchmark starts, alternating the tools, and the
// benchmarks then replay them (repetition k reports run k).

// --benchmark_repetitions=N from argv, 1 if absent or not a positive
// number. Call before InitSuite, which hands that flag to Google Benchmark.
int RepetitionsArg(int argc, char** argv);

// Writes `text` to `path` (e.g. "3\n" to /proc/sys/vm/drop_caches).
// kInternal "<path>: cannot write" when opening or writing fails.
absl::Status WriteFile(const std::string& path, const std::string& text);

// Adds the context key load_avg_end: the 1, 5 and 15 minute load averages
// now (after the measured runs); nothing if getloadavg fails.
void AddLoadAvgEnd();

// The counters of measured run `k` of "<case>/<tool>" (counter name to
// value), or an error: that case and tool failed (its message), or it has
// no run k.
using ReplayFn = std::function<absl::StatusOr<std::map<std::string, double>>(
    const std::string& key, size_t k)>;

// Registers "<suite>/fs:<fs>/case:<c>/tool:<t>" for every case and tool, in
// that order, unit milliseconds: repetition k takes one iteration and
// reports replay(key, k)'s counters, or skips with its error's message.
void RegisterReplays(absl::string_view suite, absl::string_view fs,
                     const std::vector<std::string>& cases,
                     const std::vector<std::string>& tools, ReplayFn replay);

}  // namespace imgtool::benchmarks

#endif  // IMGTOOL_BENCHMARKS_SUITE_H_
