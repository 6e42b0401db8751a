// Suite `chain`: issue 16's backing-chain and sizing commands, imgtool and
// qemu-img side by side on the same files (benchmarks/chain_side_by_side.sh
// as a suite of //benchmarks:run):
//
//   chain/fs:xfs/case:C/tool:T  C: rebase (safe, onto base2.qcow2), flatten
//       (rebase -b ""), commit, measure, dd; T: qemu-img, imgtool. Counters
//       per repetition: seconds (spawn to exit), max_rss_bytes (the
//       process's peak RSS, wait4's ru_maxrss) and bytes_read (what the
//       run read from the loop device: its sectors-read counter times 512,
//       with the page cache dropped before the run).
//
// The files (made once, as chain_side_by_side.sh makes them; 64 KiB
// clusters): base.qcow2 (--size_gib virtual, --data_gib of data in 64 KiB
// pieces spread evenly, each piece its own byte), base2.qcow2 (base.qcow2
// with 1 % of its pieces rewritten), top.qcow2 (an overlay of base.qcow2
// with a 64 KiB piece in 1 % of all clusters, none where base.qcow2 has
// data) and sparse.raw (--extents extents of 4 KiB every 40 KiB, for
// measure). Every run starts from fresh reflink copies (FICLONE; instant on
// XFS), after `sync`, `fstrim` and the page cache dropped.
//
// Alternation: the timings move with the machine's load, so the suite
// measures before it reports. For each case one unmeasured run, then
// --benchmark_repetitions runs per tool, alternating which tool goes first;
// the registered benchmarks then replay those runs in order, one
// repetition each, as their counters. Google Benchmark's own real_time and
// cpu_time are therefore not the commands' times: read `seconds`.
//
// A command the tool does not have (or that fails) is an error entry
// naming its stderr.
//
// Result file contract: benchmarks/README.md ("Result files").
// Run (root): bazel run //benchmarks:chain_bench -- [--size_gib=4]
//     [--data_gib=1] [--extents=100000] [--cases=rebase,flatten,...]
//     [--quick] [--imgtool=PATH]  (default: the imgtool of the runfiles)
#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
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
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "base/testing/loop_mount.h"
#include "benchmark/benchmark.h"
#include "benchmarks/suite.h"

ABSL_FLAG(uint64_t, size_gib, 4, "virtual size of the chain in GiB (--quick: "
          "256 MiB)");
ABSL_FLAG(uint64_t, data_gib, 1, "data in base.qcow2 in GiB, at most half of "
          "--size_gib (--quick: 64 MiB)");
ABSL_FLAG(uint64_t, extents, 100000, "data extents of sparse.raw, measure's "
          "source (--quick: 10000)");
ABSL_FLAG(std::string, cases, "rebase,flatten,commit,measure,dd",
          "which cases, comma-separated");
ABSL_FLAG(std::string, imgtool, "",
          "the imgtool binary (default: imgtool/imgtool in the runfiles)");

namespace imgtool::benchmarks {
namespace {

constexpr uint64_t kCluster = 64 << 10;
constexpr const char* kTools[] = {"qemu-img", "imgtool"};

// One measured run of a tool.
struct Sample {
  double seconds = 0;
  uint64_t max_rss_bytes = 0;
  uint64_t bytes_read = 0;
};

// The runs of one case and tool, in the order they were made; or why the
// tool failed.
struct Runs {
  std::vector<Sample> samples;
  std::string error;
};

std::string g_dir;        // mount point holding the files
std::string g_stat_file;  // /sys/dev/block/M:m/stat of its loop device
std::string g_imgtool;
uint64_t g_size = 0, g_data = 0, g_extents = 0;
std::map<std::string, Runs> g_runs;  // "case/tool" -> runs

// A reflink copy of `from` as `to` (FICLONE).
absl::Status Reflink(const std::string& from, const std::string& to) {
  const int in = open(from.c_str(), O_RDONLY | O_CLOEXEC);
  if (in < 0) return ErrnoStatus(from, "open", errno);
  const int out = open(to.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC,
                       0644);
  if (out < 0) {
    const int e = errno;
    close(in);
    return ErrnoStatus(to, "open", e);
  }
  const int r = ioctl(out, FICLONE, in);
  const int e = errno;
  close(in);
  close(out);
  if (r != 0) return ErrnoStatus(to, "ioctl(FICLONE)", e);
  return absl::OkStatus();
}

// The loop device's sectors read so far (field 3 of its stat file).
absl::StatusOr<uint64_t> SectorsRead() {
  std::ifstream in(g_stat_file);
  uint64_t reads = 0, merges = 0, sectors = 0;
  if (!(in >> reads >> merges >> sectors)) {
    return absl::InternalError(absl::StrCat(g_stat_file, ": cannot read"));
  }
  return sectors;
}

// Runs argv in `dir` (stdout to /dev/null, stderr to `err_path`) and
// measures it. kInternal with the stderr's first line if it fails.
absl::StatusOr<Sample> Measure(const std::vector<std::string>& argv,
                               const std::string& dir,
                               const std::string& err_path) {
  ASSIGN_OR_RETURN(const uint64_t before, SectorsRead());
  ASSIGN_OR_RETURN(const CommandRun run,
                   RunTimedCommand(argv, dir, /*out_path=*/"", err_path));
  ASSIGN_OR_RETURN(const uint64_t after, SectorsRead());
  return Sample{run.seconds, static_cast<uint64_t>(run.usage.ru_maxrss) << 10,
                (after - before) * 512};
}

// One run of `tool` on `case_name` from fresh copies of the files.
absl::StatusOr<Sample> RunCase(const std::string& case_name,
                               const std::string& tool) {
  const std::string run = g_dir + "/run";
  RETURN_IF_ERROR(RunCommand({"rm", "-rf", run}).status());
  if (mkdir(run.c_str(), 0755) != 0) return ErrnoStatus(run, "mkdir", errno);
  std::vector<std::string> files;
  std::vector<std::string> args;
  if (case_name == "rebase") {
    files = {"top.qcow2", "base.qcow2", "base2.qcow2"};
    args = {"rebase", "-f", "qcow2", "-b", "base2.qcow2", "-F", "qcow2",
            "top.qcow2"};
  } else if (case_name == "flatten") {
    files = {"top.qcow2", "base.qcow2"};
    args = {"rebase", "-f", "qcow2", "-b", "", "top.qcow2"};
  } else if (case_name == "commit") {
    files = {"top.qcow2", "base.qcow2"};
    args = {"commit", "-f", "qcow2", "top.qcow2"};
  } else if (case_name == "measure") {
    args = {"measure", "-O", "qcow2", "-f", "raw", "../sparse.raw"};
  } else if (case_name == "dd") {
    files = {"base.qcow2"};
    args = {"dd", "-f", "qcow2", "-O", "raw", "bs=1M",
            absl::StrCat("count=", g_data >> 20), "if=base.qcow2",
            "of=out.raw"};
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown case ", case_name));
  }
  for (const std::string& f : files) {
    RETURN_IF_ERROR(Reflink(g_dir + "/" + f, run + "/" + f));
  }
  sync();
  (void)RunCommand({"fstrim", g_dir});  // not every filesystem trims
  RETURN_IF_ERROR(WriteFile("/proc/sys/vm/drop_caches", "3\n"));
  std::vector<std::string> argv = {tool == "imgtool" ? g_imgtool : tool};
  argv.insert(argv.end(), args.begin(), args.end());
  return Measure(argv, run, g_dir + "/stderr.txt");
}

// base.qcow2, base2.qcow2, top.qcow2 and sparse.raw in g_dir.
absl::Status MakeFiles() {
  const uint64_t clusters = g_size / kCluster;
  const uint64_t stride = g_size / g_data;  // a data piece every `stride`
  const std::string raw = g_dir + "/base.raw";
  {
    const int fd = open(raw.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return ErrnoStatus(raw, "open", errno);
    std::vector<uint8_t> piece(kCluster);
    absl::Status st;
    if (ftruncate(fd, g_size) != 0) st = ErrnoStatus(raw, "ftruncate", errno);
    for (uint64_t i = 0; st.ok() && i < clusters; i += stride) {
      std::fill(piece.begin(), piece.end(), i / stride % 255 + 1);
      if (pwrite(fd, piece.data(), piece.size(), i * kCluster) !=
          static_cast<ssize_t>(piece.size())) {
        st = ErrnoStatus(raw, "pwrite", errno);
      }
    }
    close(fd);
    RETURN_IF_ERROR(st);
  }
  RETURN_IF_ERROR(RunCommand({"qemu-img", "convert", "-f", "raw", "-O",
                              "qcow2", "-o", "cluster_size=64k", raw,
                              g_dir + "/base.qcow2"})
                      .status());
  unlink(raw.c_str());
  RETURN_IF_ERROR(Reflink(g_dir + "/base.qcow2", g_dir + "/base2.qcow2"));
  // 1 % of the data pieces rewritten in base2, 1 % of all clusters in top.
  std::vector<std::string> io = {"qemu-io", "-f", "qcow2"};
  for (uint64_t k = 0; k < clusters / stride; k += 100) {
    io.push_back("-c");
    io.push_back(absl::StrCat("write -q -P 0x55 ", k * stride * kCluster, " 64k"));
  }
  io.push_back(g_dir + "/base2.qcow2");
  RETURN_IF_ERROR(RunCommand(io).status());
  RETURN_IF_ERROR(RunCommand({"qemu-img", "create", "-q", "-f", "qcow2", "-o",
                              "cluster_size=64k", "-b", "base.qcow2", "-F",
                              "qcow2", g_dir + "/top.qcow2"})
                      .status());
  io = {"qemu-io", "-f", "qcow2"};
  for (uint64_t c = 1; c < clusters; c += 100) {
    if (c % stride == 0) continue;
    io.push_back("-c");
    io.push_back(absl::StrCat("write -q -P 0x77 ", c * kCluster, " 64k"));
  }
  io.push_back(g_dir + "/top.qcow2");
  RETURN_IF_ERROR(RunCommand(io).status());
  const std::string sparse = g_dir + "/sparse.raw";
  const int fd = open(sparse.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return ErrnoStatus(sparse, "open", errno);
  std::vector<uint8_t> block(4096, 1);
  absl::Status st;
  if (ftruncate(fd, g_extents * 40960) != 0) {
    st = ErrnoStatus(sparse, "ftruncate", errno);
  }
  for (uint64_t i = 0; st.ok() && i < g_extents; ++i) {
    if (pwrite(fd, block.data(), block.size(), i * 40960) != 4096) {
      st = ErrnoStatus(sparse, "pwrite", errno);
    }
  }
  close(fd);
  RETURN_IF_ERROR(st);
  sync();
  return absl::OkStatus();
}

// Every case's runs: one unmeasured, then `reps` per tool, alternating
// which tool goes first.
void MeasureAll(const std::vector<std::string>& cases, int reps) {
  for (const std::string& c : cases) {
    (void)RunCase(c, "qemu-img");  // the first run after making the files
                                   // was 2-3x slower, whichever tool
    for (int i = 0; i < reps; ++i) {
      for (int t = 0; t < 2; ++t) {
        const std::string tool = kTools[i % 2 == 0 ? 1 - t : t];
        Runs& runs = g_runs[c + "/" + tool];
        if (!runs.error.empty()) continue;
        absl::StatusOr<Sample> s = RunCase(c, tool);
        if (!s.ok()) {
          runs.error = std::string(s.status().message());
        } else {
          runs.samples.push_back(*s);
        }
      }
    }
    for (const char* tool : kTools) {
      const Runs& r = g_runs[c + "/" + tool];
      std::fprintf(stderr, "chain_bench: %s %s: %s\n", c.c_str(), tool,
                   r.error.empty()
                       ? absl::StrJoin(r.samples, " ",
                                       [](std::string* out, const Sample& s) {
                                         absl::StrAppend(out, s.seconds, "s");
                                       })
                             .c_str()
                       : r.error.c_str());
    }
  }
}

// The counters of run k of "case/tool" (RegisterReplays).
absl::StatusOr<std::map<std::string, double>> Replay(const std::string& key,
                                                     size_t k) {
  const Runs& runs = g_runs[key];
  if (!runs.error.empty()) return absl::InternalError(runs.error);
  if (k >= runs.samples.size()) {
    return absl::OutOfRangeError("more repetitions than measured runs");
  }
  const Sample& s = runs.samples[k];
  return std::map<std::string, double>{
      {"seconds", s.seconds},
      {"max_rss_bytes", static_cast<double>(s.max_rss_bytes)},
      {"bytes_read", static_cast<double>(s.bytes_read)}};
}

}  // namespace
}  // namespace imgtool::benchmarks

int main(int argc, char** argv) {
  using namespace imgtool::benchmarks;
  using imgtool::testing::FsKind;
  const int reps = RepetitionsArg(argc, argv);  // the runner always passes it
  const std::string program = InitSuite(
      argc, argv,
      "chain_bench: rebase, commit, measure and dd of imgtool and qemu-img "
      "on a backing chain (root). Result file contract: benchmarks/README.md");
  g_size = Quick() ? 256ull << 20 : absl::GetFlag(FLAGS_size_gib) << 30;
  g_data = Quick() ? 64ull << 20 : absl::GetFlag(FLAGS_data_gib) << 30;
  g_extents = Quick() ? 10000 : absl::GetFlag(FLAGS_extents);
  if (g_data == 0 || g_size < 2 * g_data || g_extents == 0) {
    std::fprintf(stderr, "chain_bench: need --data_gib >= 1, --size_gib >= "
                         "2 * --data_gib and --extents >= 1\n");
    return 1;
  }
  const std::vector<std::string> cases =
      absl::StrSplit(absl::GetFlag(FLAGS_cases), ',', absl::SkipEmpty());
  for (const std::string& c : cases) {
    if (c != "rebase" && c != "flatten" && c != "commit" && c != "measure" &&
        c != "dd") {
      std::fprintf(stderr, "chain_bench: unknown case '%s' (cases: rebase, "
                           "flatten, commit, measure, dd)\n", c.c_str());
      return 1;
    }
  }
  g_imgtool = ImgtoolBinary(program, absl::GetFlag(FLAGS_imgtool));
  // Room for the files (base, base2 and top share their extents), a run's
  // copies and the dd output.
  const std::vector<SuiteMount> mounts =
      MountAll("chain_bench", {FsKind::kXfs},
               g_size + 6 * g_data + g_extents * 40960 + (512ull << 20));
  g_dir = mounts[0].mount->path();
  struct stat st;
  if (stat(g_dir.c_str(), &st) != 0) {
    std::perror(g_dir.c_str());
    return 1;
  }
  g_stat_file = absl::StrCat("/sys/dev/block/", major(st.st_dev), ":",
                             minor(st.st_dev), "/stat");
  std::fprintf(stderr, "chain_bench: making the chain (%llu MiB, %llu MiB of "
                       "data) and sparse.raw (%llu extents)\n",
               static_cast<unsigned long long>(g_size >> 20),
               static_cast<unsigned long long>(g_data >> 20),
               static_cast<unsigned long long>(g_extents));
  if (absl::Status made = MakeFiles(); !made.ok()) {
    std::fprintf(stderr, "chain_bench: making the files: %s\n",
                 made.ToString().c_str());
    return 1;
  }
  // load_avg_start: before the runs; load_avg_end: after them.
  AddSuiteContext("chain", "xfs");
  MeasureAll(cases, reps);
  AddLoadAvgEnd();
  benchmark::AddCustomContext("image_bytes", absl::StrCat(g_size));
  benchmark::AddCustomContext("data_bytes", absl::StrCat(g_data));
  benchmark::AddCustomContext("measure_extents", absl::StrCat(g_extents));
  RegisterReplays("chain", "xfs", cases, {std::begin(kTools), std::end(kTools)},
                  Replay);
  RunSuite();
  return 0;
}
