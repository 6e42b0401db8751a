// Suite `snapshot`: issue 18's internal snapshots and persistent dirty
// bitmaps, imgtool and qemu-img 7.2 side by side on the same files:
//
//   snapshot/fs:xfs/case:C/tool:T  T: qemu-img, imgtool. C:
//     create      `snapshot -c s1` on big.qcow2 (no snapshot yet)
//     delete      `snapshot -d s0` on big-snap.qcow2 (its only snapshot)
//     cow         `bench -w -t none -d 64 -s 4k -S STEP -c --count` on
//                 cow.qcow2 (fully written, then a snapshot taken): nearly
//                 every write is the first one into a cluster the snapshot
//                 shares, so it copies that cluster
//     cow_extl2   the same on cow-extl2.qcow2 (extended_l2=on)
//     write       the same bench, -c --bitmap_count, on full.qcow2 (fully
//                 written, no snapshot): overwrites of allocated clusters
//     write_bitmap  the same on full-bitmap.qcow2: full.qcow2 after
//                 `qemu-img bitmap --add full-bitmap.qcow2 b0` (one enabled
//                 persistent bitmap, 64 KiB granularity)
//   Counters per repetition: seconds (spawn to exit), bytes_written (what
//   the process wrote to storage as the kernel counts it: wait4's
//   ru_oublock * 512, i.e. /proc/PID/io write_bytes at exit, the pages it
//   dirtied in the page cache plus its O_DIRECT writes; for create and
//   delete all of it is metadata), cpu_seconds (user + system time of the
//   process and its threads: what the bitmap costs in CPU shows here even
//   when the load hides it in IOPS) and max_rss_bytes; the bench cases add
//   IOPS (requests / the time the tool itself prints, "Run completed in X
//   seconds").
//
// STEP is 4182016 (4 KiB * 1021, an odd number of 4 KiB blocks): offsets
// advance by STEP modulo the virtual size, so no block repeats before the
// whole disk was visited, as in benchmarks/subcluster_side_by_side.sh.
//
// The files (made once with qemu-img; 64 KiB clusters): big.qcow2
// (--size_gib virtual, the first --data_gib written contiguously by
// `qemu-img bench -w -s 1M`, so its L2 tables there are full), big-snap.qcow2
// (big.qcow2 plus `qemu-img snapshot -c s0`), cow.qcow2 and cow-extl2.qcow2
// (--cow_mib virtual, every cluster written, then `qemu-img snapshot -c
// s0`), full.qcow2 and full-bitmap.qcow2 (--cow_mib, every cluster written;
// the second with the bitmap b0). Every run starts from a fresh copy of its
// file, made before the timing: a reflink (FICLONE, instant on XFS) for
// create and delete, a real copy (read/write) for the bench cases, whose
// overwrites would otherwise make XFS copy its own shared extents on every
// write. Before every run: `sync`, `fstrim` and the page cache dropped.
// After the first run of each case and tool, `qemu-img check` of the result
// must be clean (else the case is an error entry).
//
// Alternation: the timings move with the machine's load, so the suite
// measures before it reports: one unmeasured run per case, then
// --benchmark_repetitions rounds, each running every tool once (write and
// write_bitmap share their rounds: four runs each), starting one further
// along each round; the registered benchmarks replay those runs in order. Google Benchmark's
// real_time is not the commands' time: read `seconds`.
//
// Targets (issue 18; printed by report and check_results.py, never
// asserted): create and delete at most 0.8 of qemu-img's time; cow and
// cow_extl2 IOPS at least qemu-img's; imgtool's write_bitmap IOPS less than
// 3 % below its write IOPS.
//
// Result file contract: benchmarks/README.md ("Result files").
// Run (root): bazel run //benchmarks:snapshot_bench -- [--size_gib=10]
//     [--data_gib=4] [--cow_mib=1024] [--count=1000] [--bitmap_count=100000]
//     [--cases=create,delete,...] [--quick] [--imgtool=PATH]
#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "base/testing/loop_mount.h"
#include "benchmark/benchmark.h"
#include "benchmarks/suite.h"

ABSL_FLAG(uint64_t, size_gib, 10,
          "virtual size of big.qcow2 in GiB (--quick: 512 MiB)");
ABSL_FLAG(uint64_t, data_gib, 4,
          "data in big.qcow2 in GiB, from offset 0 (--quick: 256 MiB)");
ABSL_FLAG(uint64_t, cow_mib, 1024,
          "virtual size of the bench cases' images in MiB, all written "
          "(--quick: 64)");
ABSL_FLAG(uint64_t, count, 1000,
          "4 KiB writes per run of cow and cow_extl2 (--quick: 500)");
ABSL_FLAG(uint64_t, bitmap_count, 100000,
          "4 KiB writes per run of write and write_bitmap (--quick: 2000)");
ABSL_FLAG(std::string, cases,
          "create,delete,cow,cow_extl2,write,write_bitmap",
          "which cases, comma-separated");
ABSL_FLAG(std::string, imgtool, "",
          "the imgtool binary (default: imgtool/imgtool in the runfiles)");

namespace imgtool::benchmarks {
namespace {

constexpr const char* kTools[] = {"qemu-img", "imgtool"};
constexpr const char* kCases[] = {"create", "delete",    "cow",
                                  "cow_extl2", "write", "write_bitmap"};
constexpr uint64_t kStep = 4096 * 1021;

// One measured run of a tool.
struct Sample {
  double seconds = 0;
  double iops = 0;  // bench cases only
  double cpu_seconds = 0;
  uint64_t bytes_written = 0;
  uint64_t max_rss_bytes = 0;
};

// The runs of one case and tool, in the order they were made; or why the
// tool failed.
struct Runs {
  std::vector<Sample> samples;
  std::string error;
  bool checked = false;  // qemu-img check ran on a result
};

std::string g_dir;  // mount point holding the files
std::string g_imgtool;
uint64_t g_size = 0, g_data = 0, g_cow = 0, g_count = 0, g_bitmap_count = 0;
std::map<std::string, Runs> g_runs;  // "case/tool" -> runs

bool IsBench(const std::string& c) {
  return c != "create" && c != "delete";
}

// A copy of `from` as `to`: a reflink (FICLONE) or, with !reflink, every
// byte read and written (holes too: the files here have none).
absl::Status Copy(const std::string& from, const std::string& to,
                  bool reflink) {
  const int in = open(from.c_str(), O_RDONLY | O_CLOEXEC);
  if (in < 0) return ErrnoStatus(from, "open", errno);
  const int out = open(to.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC,
                       0644);
  if (out < 0) {
    const int e = errno;
    close(in);
    return ErrnoStatus(to, "open", e);
  }
  absl::Status st;
  if (reflink) {
    if (ioctl(out, FICLONE, in) != 0) st = ErrnoStatus(to, "ioctl(FICLONE)", errno);
  } else {
    std::vector<char> buf(4 << 20);
    for (;;) {
      const ssize_t n = read(in, buf.data(), buf.size());
      if (n < 0) {
        st = ErrnoStatus(from, "read", errno);
        break;
      }
      if (n == 0) break;
      if (write(out, buf.data(), n) != n) {
        st = ErrnoStatus(to, "write", errno);
        break;
      }
    }
  }
  close(in);
  close(out);
  return st;
}

// Runs argv in `dir` (stdout to `out_path`, stderr to `err_path`) and
// measures it. kInternal with the stderr's first line if it fails.
absl::StatusOr<Sample> Measure(const std::vector<std::string>& argv,
                               const std::string& dir,
                               const std::string& out_path,
                               const std::string& err_path) {
  ASSIGN_OR_RETURN(const CommandRun run,
                   RunTimedCommand(argv, dir, out_path, err_path));
  const struct rusage& usage = run.usage;
  Sample s;
  s.seconds = run.seconds;
  // Linux fills ru_oublock from the task's I/O accounting: write_bytes / 512.
  s.bytes_written = static_cast<uint64_t>(usage.ru_oublock) * 512;
  s.max_rss_bytes = static_cast<uint64_t>(usage.ru_maxrss) << 10;
  s.cpu_seconds = usage.ru_utime.tv_sec + usage.ru_stime.tv_sec +
                  (usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) / 1e6;
  return s;
}

// One run of `tool` on `case_name` from a fresh copy of its file; with
// `check`, qemu-img check of the result must be clean.
absl::StatusOr<Sample> RunCase(const std::string& case_name,
                               const std::string& tool, bool check) {
  std::string file;
  std::vector<std::string> args;
  uint64_t count = 0;
  if (case_name == "create") {
    file = "big.qcow2";
    args = {"snapshot", "-c", "s1"};
  } else if (case_name == "delete") {
    file = "big-snap.qcow2";
    args = {"snapshot", "-d", "s0"};
  } else {
    file = case_name == "cow"         ? "cow.qcow2"
           : case_name == "cow_extl2" ? "cow-extl2.qcow2"
           : case_name == "write"     ? "full.qcow2"
                                      : "full-bitmap.qcow2";
    count = case_name == "cow" || case_name == "cow_extl2" ? g_count
                                                           : g_bitmap_count;
    args = {"bench", "-f", "qcow2", "-w", "-t", "none", "-d", "64", "-s", "4k",
            "-S", absl::StrCat(kStep), "-c", absl::StrCat(count)};
  }
  const std::string run = g_dir + "/run.qcow2";
  unlink(run.c_str());
  RETURN_IF_ERROR(Copy(g_dir + "/" + file, run, !IsBench(case_name)));
  sync();
  (void)RunCommand({"fstrim", g_dir});  // not every filesystem trims
  RETURN_IF_ERROR(WriteFile("/proc/sys/vm/drop_caches", "3\n"));
  std::vector<std::string> argv = {tool == "imgtool" ? g_imgtool : tool};
  argv.insert(argv.end(), args.begin(), args.end());
  argv.push_back("run.qcow2");
  const std::string out_path = g_dir + "/stdout.txt";
  ASSIGN_OR_RETURN(Sample s, Measure(argv, g_dir, out_path,
                                     g_dir + "/stderr.txt"));
  if (count > 0) {
    ASSIGN_OR_RETURN(const double t, BenchSeconds(out_path));
    s.iops = static_cast<double>(count) / t;
  }
  if (check) {
    absl::StatusOr<std::string> out =
        RunCommand({"qemu-img", "check", "-f", "qcow2", run}, true);
    if (!out.ok()) {
      return absl::InternalError(absl::StrCat(
          "qemu-img check after ", tool, " ", case_name, ": ",
          absl::StrReplaceAll(out.status().message(), {{"\n", " "}})));
    }
  }
  return s;
}

// big.qcow2, big-snap.qcow2, cow.qcow2, cow-extl2.qcow2, full.qcow2 and
// full-bitmap.qcow2 in g_dir.
absl::Status MakeFiles() {
  auto in_dir = [](const std::string& name) { return g_dir + "/" + name; };
  auto create = [&](const std::string& name, uint64_t size,
                    const std::string& extl2) {
    return RunCommand({"qemu-img", "create", "-q", "-f", "qcow2", "-o",
                       "cluster_size=64k,extended_l2=" + extl2, in_dir(name),
                       absl::StrCat(size)})
        .status();
  };
  // Writes [0, bytes) with 1 MiB requests (pattern 0xaa).
  auto fill = [&](const std::string& name, uint64_t bytes) {
    return RunCommand({"qemu-img", "bench", "-q", "-f", "qcow2", "-w", "-t",
                       "none", "-d", "16", "-s", "1M", "-S", "1M",
                       "--pattern=170", "-c", absl::StrCat(bytes >> 20),
                       in_dir(name)})
        .status();
  };
  auto snapshot = [&](const std::string& name) {
    return RunCommand({"qemu-img", "snapshot", "-c", "s0", in_dir(name)})
        .status();
  };
  RETURN_IF_ERROR(create("big.qcow2", g_size, "off"));
  RETURN_IF_ERROR(fill("big.qcow2", g_data));
  RETURN_IF_ERROR(Copy(in_dir("big.qcow2"), in_dir("big-snap.qcow2"), true));
  RETURN_IF_ERROR(snapshot("big-snap.qcow2"));
  RETURN_IF_ERROR(create("full.qcow2", g_cow, "off"));
  RETURN_IF_ERROR(fill("full.qcow2", g_cow));
  RETURN_IF_ERROR(Copy(in_dir("full.qcow2"), in_dir("full-bitmap.qcow2"), false));
  RETURN_IF_ERROR(RunCommand({"qemu-img", "bitmap", "--add", "-g", "64k",
                              in_dir("full-bitmap.qcow2"), "b0"})
                      .status());
  RETURN_IF_ERROR(Copy(in_dir("full.qcow2"), in_dir("cow.qcow2"), false));
  RETURN_IF_ERROR(snapshot("cow.qcow2"));
  RETURN_IF_ERROR(create("cow-extl2.qcow2", g_cow, "on"));
  RETURN_IF_ERROR(fill("cow-extl2.qcow2", g_cow));
  RETURN_IF_ERROR(snapshot("cow-extl2.qcow2"));
  sync();
  return absl::OkStatus();
}

// The cases measured together, in turns: each alone, except write and
// write_bitmap, whose difference is the bitmap's cost and must not be the
// load's (both under the same load, run for run).
std::vector<std::vector<std::string>> Groups(
    const std::vector<std::string>& cases) {
  std::vector<std::vector<std::string>> groups;
  std::vector<std::string> writes;
  for (const std::string& c : cases) {
    if (c == "write" || c == "write_bitmap") {
      if (writes.empty()) groups.push_back({});  // its place in the order
      writes.push_back(c);
    } else {
      groups.push_back({c});
    }
  }
  for (auto& g : groups) {
    if (g.empty()) g = writes;
  }
  return groups;
}

// Every case's runs: one unmeasured per case, then `reps` rounds; a round
// runs every (case, tool) of the group once, starting one further along
// the list each round, so that no tool or case always goes first.
void MeasureAll(const std::vector<std::string>& cases, int reps) {
  for (const std::vector<std::string>& group : Groups(cases)) {
    std::vector<std::pair<std::string, std::string>> turns;
    for (const std::string& c : group) {
      // The first run after making the files is the slowest.
      (void)RunCase(c, "qemu-img", false);
      for (const char* tool : kTools) turns.emplace_back(c, tool);
    }
    for (int i = 0; i < reps; ++i) {
      for (size_t t = 0; t < turns.size(); ++t) {
        const auto& [c, tool] = turns[(t + i) % turns.size()];
        Runs& runs = g_runs[c + "/" + tool];
        if (!runs.error.empty()) continue;
        absl::StatusOr<Sample> s = RunCase(c, tool, !runs.checked);
        runs.checked = true;
        if (!s.ok()) {
          runs.error = std::string(s.status().message());
        } else {
          runs.samples.push_back(*s);
        }
      }
    }
    for (const auto& [c, tool] : turns) {
      const Runs& r = g_runs[c + "/" + tool];
      std::fprintf(
          stderr, "snapshot_bench: %s %s: %s\n", c.c_str(), tool.c_str(),
          r.error.empty()
              ? absl::StrJoin(r.samples, " ",
                              [](std::string* out, const Sample& s) {
                                absl::StrAppendFormat(
                                    out, "%.3fs/%dKiB", s.seconds,
                                    s.bytes_written >> 10);
                                if (s.iops > 0) {
                                  absl::StrAppendFormat(out, "/%.0fIOPS",
                                                        s.iops);
                                }
                              })
                    .c_str()
              : r.error.c_str());
    }
  }
}

// The counters of run k of "case/tool" (RegisterReplays); IOPS for the
// bench cases only.
absl::StatusOr<std::map<std::string, double>> Replay(const std::string& key,
                                                     size_t k) {
  const Runs& runs = g_runs[key];
  if (!runs.error.empty()) return absl::InternalError(runs.error);
  if (k >= runs.samples.size()) {
    return absl::OutOfRangeError("more repetitions than measured runs");
  }
  const Sample& s = runs.samples[k];
  std::map<std::string, double> counters = {
      {"seconds", s.seconds},
      {"cpu_seconds", s.cpu_seconds},
      {"bytes_written", static_cast<double>(s.bytes_written)},
      {"max_rss_bytes", static_cast<double>(s.max_rss_bytes)}};
  if (IsBench(key.substr(0, key.find('/')))) counters["IOPS"] = s.iops;
  return counters;
}

}  // namespace
}  // namespace imgtool::benchmarks

int main(int argc, char** argv) {
  using namespace imgtool::benchmarks;
  using imgtool::testing::FsKind;
  const int reps = RepetitionsArg(argc, argv);  // the runner always passes it
  const std::string program = InitSuite(
      argc, argv,
      "snapshot_bench: snapshot -c/-d, copy-on-write after a snapshot and "
      "bitmap write cost, imgtool and qemu-img (root). Result file "
      "contract: benchmarks/README.md");
  g_size = Quick() ? 512ull << 20 : absl::GetFlag(FLAGS_size_gib) << 30;
  g_data = Quick() ? 256ull << 20 : absl::GetFlag(FLAGS_data_gib) << 30;
  g_cow = (Quick() ? 64ull : absl::GetFlag(FLAGS_cow_mib)) << 20;
  g_count = Quick() ? 500 : absl::GetFlag(FLAGS_count);
  g_bitmap_count = Quick() ? 2000 : absl::GetFlag(FLAGS_bitmap_count);
  if (g_data == 0 || g_size < g_data || g_cow == 0 || g_count == 0 ||
      g_bitmap_count == 0) {
    std::fprintf(stderr, "snapshot_bench: need --data_gib >= 1, --size_gib "
                         ">= --data_gib, --cow_mib, --count and "
                         "--bitmap_count >= 1\n");
    return 1;
  }
  const std::vector<std::string> cases =
      absl::StrSplit(absl::GetFlag(FLAGS_cases), ',', absl::SkipEmpty());
  for (const std::string& c : cases) {
    if (std::find(std::begin(kCases), std::end(kCases), c) == std::end(kCases)) {
      std::fprintf(stderr, "snapshot_bench: unknown case '%s' (cases: %s)\n",
                   c.c_str(), absl::StrJoin(kCases, ", ").c_str());
      return 1;
    }
  }
  g_imgtool = ImgtoolBinary(program, absl::GetFlag(FLAGS_imgtool));
  // Room for big.qcow2 (its snapshot copy shares its extents), the four
  // small images, a run's copy and metadata.
  const std::vector<SuiteMount> mounts =
      MountAll("snapshot_bench", {FsKind::kXfs},
               g_data + 6 * g_cow + (1ull << 30));
  g_dir = mounts[0].mount->path();
  std::fprintf(stderr, "snapshot_bench: making the images (%llu MiB with "
                       "%llu MiB of data; %llu MiB written)\n",
               static_cast<unsigned long long>(g_size >> 20),
               static_cast<unsigned long long>(g_data >> 20),
               static_cast<unsigned long long>(g_cow >> 20));
  if (absl::Status made = MakeFiles(); !made.ok()) {
    std::fprintf(stderr, "snapshot_bench: making the files: %s\n",
                 made.ToString().c_str());
    return 1;
  }
  // load_avg_start: before the runs; load_avg_end: after them.
  AddSuiteContext("snapshot", "xfs");
  MeasureAll(cases, reps);
  AddLoadAvgEnd();
  benchmark::AddCustomContext("image_bytes", absl::StrCat(g_size));
  benchmark::AddCustomContext("data_bytes", absl::StrCat(g_data));
  benchmark::AddCustomContext("bench_image_bytes", absl::StrCat(g_cow));
  benchmark::AddCustomContext("cow_writes", absl::StrCat(g_count));
  benchmark::AddCustomContext("bitmap_writes", absl::StrCat(g_bitmap_count));
  RegisterReplays("snapshot", "xfs", cases,
                  {std::begin(kTools), std::end(kTools)}, Replay);
  RunSuite();
  return 0;
}
