// imgtool advise [--size SIZE] [--time SECONDS] [--workload W]
// [--output=human|json] DIR: measures image configurations on DIR's
// filesystem and names the best one per workload (issue 20 part 4; an
// imgtool extension, qemu-img has no such command).
//
// Everything happens in a private directory made with mkdtemp inside DIR
// (".imgtool-advise-XXXXXX"): no existing file is opened, and the directory
// is removed at the end, on error, and on SIGINT/SIGTERM/SIGHUP (the
// handler sets a flag that is checked between runs; after the cleanup the
// signal is raised again with its default action, so the exit status says
// which signal ended the run).
//
// The matrix (one image at a time, created by `imgtool create`'s own code
// with the arguments printed as the advice, and written by `imgtool
// bench`'s loop, bench.h):
// - create: preallocation off/falloc/full (raw) and off/metadata/falloc/full
//   (qcow2, 64 KiB clusters): create time, extents (FIEMAP) and space
//   (st_blocks) of an image of --size bytes;
// - random-4k: 4 KiB random O_DIRECT writes (bench --random=1, seed 1: the
//   same offsets in every cell) at depth 64 into a fresh image (allocating
//   writes): raw with extent_size_hint 0 / 1M / 8M, qcow2 with cluster
//   sizes 64k..2M, extended_l2 off/on, without and with the preallocate
//   filter (--image-opts driver=qcow2,file.driver=preallocate,...);
// - sequential: the same cells, 1 MiB sequential writes at depth 16;
// - overlay: the qcow2 cells as overlays (-b base.raw -F raw) over a raw
//   backing file written in full once per run, 4 KiB random writes at
//   depth 64 (copy-on-write from the backing file).
// Budget (--time; the decisions are advise_plan.h's pure functions): the
// create table runs one round first, the workloads share nine tenths of
// the budget, and the create table gets as many more rounds (up to 5) as
// fit in what is left. Each workload calibrates the smallest cell set
// (raw hints, qcow2 64k) with one short run each, then picks the plan whose
// rounds fit from the measured rates and overheads (uncalibrated cells
// counted at the mean): 5 repetitions, else 4, else 4 with fewer cluster
// sizes (dropping 128k and 512k, then 1M), else 3 (then 256k, then 2M too);
// if even that leaves runs under 0.1 s of the fastest cell, shorter runs,
// down to the calibration count with the calibration runs as the first
// repetition. It calibrates the cells the plan adds and gives all cells one
// request count (the same offsets in each). Rounds are interleaved (round r
// starts at cell r) and stop early (at 3 or more) if the load made them
// slower than planned. No run starts after the budget's end: an unfinished
// round is dropped, and a workload left with fewer than 3 rounds prints
// "no verdict: the budget ran out ..." instead of a winner. Every cut is
// printed, and a run over the budget says so.
// Verdict: configurations ranked by median IOPS; winner against runner-up
// by advise_stats.h Decide (U test with >= 4 repetitions a side, else
// non-overlapping ranges): undecided is printed as a tie.
#include <fcntl.h>
#include <getopt.h>
#include <linux/fs.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/utsname.h>
#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <future>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "base/errno_status.h"
#include "base/size.h"
#include "base/status_macros.h"
#include "imgtool/advise_plan.h"
#include "imgtool/advise_stats.h"
#include "imgtool/bench.h"
#include "imgtool/command.h"
#include "posix_file/file_node.h"

namespace imgtool::cli {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr int kMaxReps = 5;
constexpr int kLastLevel = 4;  // the smallest cell set (ClusterSizes)
constexpr int kBarWidth = 30;  // the progress bar's cells

volatile sig_atomic_t g_signal = 0;
void OnSignal(int sig) { g_signal = sig; }

constexpr char kUsage[] =
    "Usage: imgtool advise [--size SIZE] [--time SECONDS] "
    "[--workload random-4k|sequential|overlay|all] [--output=human|json] "
    "[--imgtool-commit ID] DIR";

constexpr char kHelp[] =
    "Usage: imgtool advise [--size SIZE] [--time SECONDS]\n"
    "        [--workload random-4k|sequential|overlay|all] "
    "[--output=human|json]\n"
    "        [--imgtool-commit ID] DIR\n"
    "Measures image configurations on DIR's filesystem and prints the best "
    "one for\neach workload with the `imgtool create` line that makes it "
    "(an imgtool\nextension; qemu-img has no such command). Works in a "
    "temporary directory inside\nDIR, removed at the end; existing files "
    "are never touched.\n"
    "  --size SIZE          virtual size of the test images (default 1G; a "
    "multiple of\n"
    "                       2 MiB, at least 16M); DIR needs about twice "
    "that free\n"
    "  --time SECONDS       time budget of the whole run, 5 to 86400 "
    "(default 60)\n"
    "  --workload W         random-4k: 4 KiB random O_DIRECT writes, depth "
    "64, into a\n"
    "                       fresh image; sequential: 1 MiB writes, depth "
    "16; overlay:\n"
    "                       4 KiB random writes into a qcow2 overlay "
    "(copy-on-write);\n"
    "                       all (default). The create table (preallocation "
    "modes)\n"
    "                       is always measured\n"
    "  --output=human|json  json: the benchmark suites' result format "
    "(suite advise,\n"
    "                       benchmarks/README.md), for check_results.py, "
    "report and\n"
    "                       dashboard\n"
    "  --imgtool-commit ID  the JSON's imgtool_commit (default unknown; "
    "benchmarks/\n"
    "                       advise_filesystems.sh passes git's short "
    "HEAD)\n";

enum class Workload { kCreate, kRandom4k, kSequential, kOverlay };

const char* WorkloadName(Workload w) {
  switch (w) {
    case Workload::kCreate: return "create";
    case Workload::kRandom4k: return "random-4k";
    case Workload::kSequential: return "sequential";
    case Workload::kOverlay: return "overlay";
  }
  return "?";
}

const char* WorkloadText(Workload w) {
  switch (w) {
    case Workload::kCreate:
      return "image creation: time and space of each preallocation mode "
             "(images of --size, at most 256M)";
    case Workload::kRandom4k:
      return "4 KiB random O_DIRECT writes at depth 64 into a fresh image "
             "(allocating writes)";
    case Workload::kSequential:
      return "1 MiB sequential O_DIRECT writes at depth 16 into a fresh image";
    case Workload::kOverlay:
      return "4 KiB random O_DIRECT writes at depth 64 into a qcow2 overlay "
             "over a written raw backing file (copy-on-write)";
  }
  return "?";
}

struct AdviseArgs {
  uint64_t size = kGiB;
  int seconds = 60;
  std::vector<Workload> workloads = {Workload::kRandom4k,
                                     Workload::kSequential,
                                     Workload::kOverlay};
  bool json = false;
  bool help = false;
  // The JSON's imgtool_commit: what --imgtool-commit says (the runner's
  // `git rev-parse --short HEAD`), else "unknown" (the binary carries no
  // build stamp: stamping would relink it, and rerun every test that runs
  // it, at each commit).
  std::string commit = "unknown";
  std::string dir;
};

// "64k", "1M", "1G" for sizes that divide evenly, else bytes.
std::string SizeText(uint64_t bytes) {
  if (bytes == 0) return "0";
  if (bytes % kGiB == 0) return absl::StrCat(bytes / kGiB, "G");
  if (bytes % kMiB == 0) return absl::StrCat(bytes / kMiB, "M");
  if (bytes % 1024 == 0) return absl::StrCat(bytes / 1024, "k");
  return absl::StrCat(bytes);
}

std::string MiBText(double bytes) {
  return absl::StrFormat("%.1f MiB", bytes / kMiB);
}

// One image configuration of the matrix.
struct Config {
  std::string label;  // a word: the `config:` label of the JSON names
  std::string fmt;    // raw or qcow2
  uint64_t hint = 0;  // raw: extent_size_hint
  uint64_t cluster = 0;
  bool subclusters = false;  // qcow2 extended_l2=on
  bool filter = false;       // opened over the preallocate filter
  std::string prealloc;      // create table: the preallocation mode
};

std::vector<Config> CreateConfigs() {
  std::vector<Config> out;
  for (const char* mode : {"off", "falloc", "full"}) {
    out.push_back({absl::StrCat("raw_", mode), "raw", 0, 0, false, false,
                   mode});
  }
  for (const char* mode : {"off", "metadata", "falloc", "full"}) {
    out.push_back({absl::StrCat("qcow2_", mode), "qcow2", 0, 65536, false,
                   false, mode});
  }
  return out;
}

// The cluster sizes at each cut level (0: all).
std::vector<uint64_t> ClusterSizes(int level) {
  switch (level) {
    case 0: return {64 << 10, 128 << 10, 256 << 10, 512 << 10, kMiB, 2 * kMiB};
    case 1: return {64 << 10, 256 << 10, kMiB, 2 * kMiB};
    case 2: return {64 << 10, 256 << 10, 2 * kMiB};
    case 3: return {64 << 10, 2 * kMiB};
    default: return {64 << 10};
  }
}

std::vector<Config> BenchConfigs(Workload w, int level) {
  std::vector<Config> out;
  if (w != Workload::kOverlay) {
    for (uint64_t hint : {uint64_t{0}, kMiB, 8 * kMiB}) {
      out.push_back({absl::StrCat("raw_hint", SizeText(hint)), "raw", hint});
    }
  }
  for (uint64_t cluster : ClusterSizes(level)) {
    for (bool sub : {false, true}) {
      for (bool filter : {false, true}) {
        out.push_back({absl::StrCat("qcow2_", SizeText(cluster),
                                    sub ? "_subclusters" : "",
                                    filter ? "_prealloc-filter" : ""),
                       "qcow2", 0, cluster, sub, filter});
      }
    }
  }
  return out;
}

// The arguments of `imgtool create` for `config` (after "create"): the
// advice prints them with file names "disk.raw", "disk.qcow2", or
// "overlay.qcow2" over "base.raw"; the run uses them as they are.
std::vector<std::string> CreateArgs(const Config& c, Workload w,
                                    const std::string& file, uint64_t size) {
  std::vector<std::string> args = {"-f", c.fmt, "-o"};
  std::vector<std::string> options;
  if (c.fmt == "raw") {
    if (c.prealloc.empty()) {
      options.push_back(absl::StrCat("extent_size_hint=", SizeText(c.hint)));
    }
  } else {
    options.push_back(absl::StrCat("cluster_size=", SizeText(c.cluster)));
    if (c.subclusters) options.push_back("extended_l2=on");
  }
  if (!c.prealloc.empty()) {
    options.push_back(absl::StrCat("preallocation=", c.prealloc));
  }
  args.push_back(absl::StrJoin(options, ","));
  if (w == Workload::kOverlay) {
    args.insert(args.end(), {"-b", "base.raw", "-F", "raw", file});
  } else {
    args.insert(args.end(), {file, SizeText(size)});
  }
  return args;
}

std::string ImageName(const Config& c, Workload w) {
  if (w == Workload::kOverlay) return "overlay.qcow2";
  return c.fmt == "raw" ? "disk.raw" : "disk.qcow2";
}

// --image-opts string opening `file` as qcow2 over the preallocate filter
// (commas in the name doubled, QEMU's option syntax).
std::string FilterOpts(const std::string& file) {
  return absl::StrCat(
      "driver=qcow2,file.driver=preallocate,file.file.driver=file,"
      "file.file.filename=",
      absl::StrReplaceAll(file, {{",", ",,"}}));
}

std::string AdviceLine(const Config& c, Workload w, uint64_t size) {
  return absl::StrCat("imgtool create ",
                      absl::StrJoin(CreateArgs(c, w, ImageName(c, w), size),
                                    " "));
}

// The measurements of one run of a cell.
struct Sample {
  double seconds = 0;         // the bench run (create: the create)
  double iops = 0;
  double mib_per_s = 0;
  double create_seconds = 0;
  uint64_t extents = 0;
  uint64_t allocated = 0;     // st_blocks * 512
  uint64_t writes = 0;
};

// Extents (FIEMAP, after a sync) and allocated bytes of `path`.
absl::Status FileFacts(const std::string& path, Sample& s) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(path, "open", errno);
  struct stat st;
  absl::StatusOr<uint64_t> extents;
  if (fstat(fd, &st) != 0) {
    extents = ErrnoStatus(path, "stat", errno);
  } else {
    extents = posix_file::FiemapExtentCount(fd, path);
  }
  close(fd);
  RETURN_IF_ERROR(extents.status());
  s.extents = *extents;
  s.allocated = static_cast<uint64_t>(st.st_blocks) * 512;
  return absl::OkStatus();
}

double Now() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string FilesystemName(const std::string& dir) {
  struct statfs fs;
  if (statfs(dir.c_str(), &fs) != 0) return "other";
  switch (static_cast<uint64_t>(fs.f_type)) {
    case 0x58465342: return "xfs";
    case 0x01021994: return "tmpfs";
    case 0x9123683e: return "btrfs";
    case 0xef53: {
      // ext2/3/4 share the magic; a directory of a filesystem with extents
      // carries EXT4_EXTENTS_FL (FS_EXTENT_FL).
      const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      int flags = 0;
      const bool got = fd >= 0 && ioctl(fd, FS_IOC_GETFLAGS, &flags) == 0;
      if (fd >= 0) close(fd);
      return got && (flags & FS_EXTENT_FL) == 0 ? "ext4_noextents" : "ext4";
    }
  }
  return "other";
}

// One cell's repetitions.
struct CellResult {
  Config config;
  std::vector<Sample> samples;
  // Why the cell could not be measured (the filesystem refused its
  // configuration): then it has no samples and is not ranked.
  std::string error;
  std::vector<double> Values(double Sample::*field) const {
    std::vector<double> v;
    for (const Sample& s : samples) v.push_back(s.*field);
    return v;
  }
  double MedianOf(double Sample::*field) const {
    return Median(Values(field));
  }
  double MedianOf(uint64_t Sample::*field) const {
    std::vector<double> v;
    for (const Sample& s : samples) v.push_back(static_cast<double>(s.*field));
    return Median(v);
  }
};

struct WorkloadResult {
  Workload workload;
  uint64_t count = 0;  // requests per run (bench workloads)
  int reps = 0;
  std::vector<CellResult> cells;  // ranked (bench workloads) or as planned
  std::vector<std::string> notes;
  Verdict verdict;
  // Set when the budget ran out before the repetitions a verdict needs
  // (kAdviseMinReps): "no verdict: the budget ran out ...", printed instead
  // of the verdict and the create lines.
  std::string no_verdict;
  bool cut = false;  // the budget made it smaller than the full matrix
};

// 0: measured; 1: not measured (the budget ran out first); 2: failed.
int RankClass(const CellResult& c) {
  if (!c.error.empty()) return 2;
  return c.samples.empty() ? 1 : 0;
}

// The cells that were measured (ranked first).
size_t Ranked(const WorkloadResult& r) {
  size_t n = 0;
  while (n < r.cells.size() && RankClass(r.cells[n]) == 0) ++n;
  return n;
}

class Advisor {
 public:
  Advisor(const AdviseArgs& args, std::string work, std::ostream& err,
          bool progress)
      : args_(args), work_(std::move(work)), err_(err), progress_(progress) {}

  absl::StatusOr<std::vector<WorkloadResult>> Run() {
    absl::StatusOr<std::vector<WorkloadResult>> out = RunAll();
    EndProgress(out.ok());
    return out;
  }

  double elapsed() const { return Now() - start_; }

  // Waits for the deletion in flight, if any (before the private
  // directory is removed).
  void WaitDeletes() {
    if (deleting_.valid()) deleting_.wait();
  }
  ~Advisor() { WaitDeletes(); }

 private:
  // Deletes a file in the background: unlink can take seconds where the
  // filesystem discards freed blocks (ext4 mounted -o discard: 2-3 s for a
  // 32 MiB qcow2 here). Renamed first, so that its name is free at once;
  // at most one deletion runs beside the next measurement (DIR's free
  // space allows for one image more).
  void Delete(const std::string& path) {
    const std::string trash = Path(absl::StrCat("deleting-", ++deleted_));
    if (rename(path.c_str(), trash.c_str()) != 0) {
      unlink(path.c_str());
      return;
    }
    WaitDeletes();
    deleting_ = std::async(std::launch::async,
                           [trash] { unlink(trash.c_str()); });
  }

  absl::StatusOr<std::vector<WorkloadResult>> RunAll() {
    start_ = Now();
    end_ = start_ + args_.seconds;
    // The create table: one round first (every image of it once), the
    // others after the workloads with the time then left.
    WorkloadResult create;
    create.workload = Workload::kCreate;
    for (const Config& c : CreateConfigs()) create.cells.push_back({c, {}, ""});
    const auto create_sample = [this](const Config& c) {
      return CreateSample(c);
    };
    RETURN_IF_ERROR(RunRounds(create, 0, 1, 1, end_, create_sample));
    const double first_round = Now() - start_;
    std::vector<WorkloadResult> out;
    // The workloads share nine tenths of the budget (what the first create
    // round left of it), each what the ones before it left.
    const double workloads_end = start_ + args_.seconds * 0.9;
    for (size_t i = 0; i < args_.workloads.size(); ++i) {
      const double share = std::max(workloads_end - Now(), 0.0) /
                           static_cast<double>(args_.workloads.size() - i);
      ASSIGN_OR_RETURN(WorkloadResult r,
                       RunWorkload(args_.workloads[i], Now() + share));
      out.push_back(std::move(r));
    }
    const double left = end_ - Now();
    const int more = create.reps == 1
                         ? PlanCreateRounds(left, first_round, kMaxReps - 1)
                         : 0;
    if (more > 0) {
      RETURN_IF_ERROR(RunRounds(create, 1, 1 + more, 1, end_, create_sample));
    }
    if (create.reps < kMaxReps) {
      create.cut = true;
      create.notes.push_back(absl::StrFormat(
          "create: %d of %d repetitions (time budget: the first round took "
          "%.1f s, %.1f s were left after the workloads)",
          create.reps, kMaxReps, first_round, std::max(left, 0.0)));
    }
    out.insert(out.begin(), std::move(create));
    return out;
  }

  absl::Status CheckSignal() {
    if (g_signal != 0) {
      return absl::CancelledError(
          absl::StrCat(args_.dir, ": interrupted by signal ", g_signal));
    }
    return absl::OkStatus();
  }

  // The bar: the elapsed share of the budget, at most 99 % while running.
  void Progress(const std::string& what) {
    if (!progress_) return;
    const double f = std::clamp(elapsed() / args_.seconds, 0.0, 0.99);
    const int filled = static_cast<int>(f * kBarWidth);
    err_ << "\r\033[K[" << std::string(filled, '#')
         << std::string(kBarWidth - filled, '.') << "] "
         << absl::StrFormat("%3d%% ", static_cast<int>(f * 100)) << what
         << std::flush;
  }
  // After a complete run the bar stays, full, on its own line (as qemu-img
  // -p leaves its 100 % line); after an error or a signal the line is
  // cleared, so that the message starts a clean line.
  void EndProgress(bool done) {
    if (!progress_) return;
    if (done) {
      err_ << "\r\033[K[" << std::string(kBarWidth, '#') << "] 100% "
           << absl::StrFormat("done in %.1f s", elapsed()) << "\n"
           << std::flush;
    } else {
      err_ << "\r\033[K" << std::flush;
    }
  }

  std::string Path(const std::string& name) const {
    return absl::StrCat(work_, "/", name);
  }

  absl::Status Create(const std::vector<std::string>& args) {
    std::vector<std::string> quiet = {"-q"};
    quiet.insert(quiet.end(), args.begin(), args.end());
    std::ostringstream out, err;
    return RunCreate(quiet, {out, err});
  }

  absl::StatusOr<BenchResult> Bench(std::vector<std::string> args) {
    std::ostringstream err;
    return BenchForResult(args, err);
  }

  // Creates, measures and deletes the create table's image.
  absl::StatusOr<Sample> CreateSample(const Config& c) {
    const std::string file = Path(ImageName(c, Workload::kCreate));
    Sample s;
    const double t0 = Now();
    absl::Status st =
        Create(CreateArgs(c, Workload::kCreate, file, CreateTableSize()));
    s.seconds = s.create_seconds = Now() - t0;
    if (st.ok()) st = FileFacts(file, s);
    Delete(file);
    RETURN_IF_ERROR(st);
    return s;
  }

  // One run of a bench cell: a fresh image, `count` requests, its facts.
  absl::StatusOr<Sample> BenchSample(const Config& c, Workload w,
                                     uint64_t count) {
    const std::string file = Path(ImageName(c, w));
    Sample s;
    const double t0 = Now();
    absl::Status st = Create(CreateArgs(c, w, file, args_.size));
    s.create_seconds = Now() - t0;
    if (st.ok()) {
      std::vector<std::string> bench = {"-w", "-t", "none", "-c",
                                        absl::StrCat(count)};
      if (w == Workload::kSequential) {
        bench.insert(bench.end(), {"-d", "16", "-s", "1M"});
      } else {
        bench.insert(bench.end(), {"-d", "64", "-s", "4096", "--random=1"});
      }
      if (c.filter) {
        bench.insert(bench.end(), {"--image-opts", FilterOpts(file)});
      } else {
        bench.insert(bench.end(), {"-f", c.fmt, file});
      }
      absl::StatusOr<BenchResult> r = Bench(bench);
      if (r.ok()) {
        s.seconds = r->elapsed_seconds();
        s.writes = count;
        s.iops = s.seconds > 0 ? count / s.seconds : 0;
        s.mib_per_s =
            s.seconds > 0 ? count * r->parameters().request_size() /
                                static_cast<double>(kMiB) / s.seconds
                          : 0;
        st = FileFacts(file, s);
      } else {
        st = r.status();
      }
    }
    Delete(file);
    RETURN_IF_ERROR(st);
    return s;
  }

  // The create table's images: --size up to 256 MiB (full preallocation
  // writes every byte: at 1 GiB its three repetitions took 26-41 s of a
  // 60 s budget on loaded loop mounts); time and space grow with the size.
  uint64_t CreateTableSize() const { return std::min(args_.size, 256 * kMiB); }

  // A cell the filesystem refused: dropped from the rounds, named in the
  // notes, an error entry in the JSON.
  static void Failed(WorkloadResult& r, CellResult& cell,
                     const absl::Status& st) {
    cell.error = std::string(st.message());
    cell.samples.clear();
    r.notes.push_back(absl::StrFormat("%s: %s failed: %s",
                                      WorkloadName(r.workload),
                                      cell.config.label, cell.error));
  }

  // Runs rounds first_round..reps-1 over r.cells, interleaved (round k
  // starts at cell k), `sample` measuring one cell once. Stops before a
  // round when `min_reps` rounds are done and the next one (as long as the
  // last) would end past `deadline`; stops between runs once end_ (the
  // budget's end) has passed, dropping the unfinished round's samples (the
  // rounds stay whole, so every cell has r.reps samples).
  absl::Status RunRounds(
      WorkloadResult& r, int first_round, int reps, int min_reps,
      double deadline,
      const std::function<absl::StatusOr<Sample>(const Config&)>& sample) {
    const std::string name = WorkloadName(r.workload);
    double round_seconds = 0;
    for (int round = first_round; round < reps; ++round) {
      if (round >= min_reps && Now() + round_seconds > deadline) {
        r.cut = true;
        r.notes.push_back(absl::StrFormat(
            "%s: %d repetitions instead of %d (time budget)", name, round,
            reps));
        break;
      }
      const double t0 = Now();
      std::vector<size_t> had;
      for (const CellResult& c : r.cells) had.push_back(c.samples.size());
      bool out_of_time = false;
      for (size_t i = 0; i < r.cells.size() && !out_of_time; ++i) {
        CellResult& cell = r.cells[(i + round) % r.cells.size()];
        RETURN_IF_ERROR(CheckSignal());
        if (!cell.error.empty()) continue;
        out_of_time = Now() >= end_;
        if (out_of_time) break;
        Progress(absl::StrFormat("%s: %s, round %d of %d", name,
                                 cell.config.label, round + 1, reps));
        absl::StatusOr<Sample> s = sample(cell.config);
        RETURN_IF_ERROR(CheckSignal());
        if (!s.ok()) {
          Failed(r, cell, s.status());
          continue;
        }
        cell.samples.push_back(*s);
      }
      if (out_of_time) {
        for (size_t i = 0; i < r.cells.size(); ++i) {
          if (r.cells[i].error.empty()) r.cells[i].samples.resize(had[i]);
        }
        r.cut = true;
        r.notes.push_back(absl::StrFormat(
            "%s: %d repetitions instead of %d: the budget ran out in round %d",
            name, round, reps, round + 1));
        break;
      }
      round_seconds = Now() - t0;
      r.reps = round + 1;
    }
    return absl::OkStatus();
  }

  // The raw backing file of the overlay workload: --size bytes written
  // with 1 MiB writes (pattern 0xa5), so every read of the overlay's
  // unallocated clusters reads data.
  absl::Status MakeBacking() {
    const std::string base = Path("base.raw");
    RETURN_IF_ERROR(Create({"-f", "raw", base, SizeText(args_.size)}));
    return Bench({"-w", "-t", "none", "-d", "16", "-s", "1M", "-c",
                  absl::StrCat(args_.size / kMiB), "--pattern=165", "-f",
                  "raw", base})
        .status();
  }

  // What a workload's calibration runs measured.
  struct Calibration {
    uint64_t count = 0;                    // requests per calibration run
    std::map<std::string, CellCost> cost;  // the measured cells
    std::map<std::string, Sample> first;   // their calibration runs
    std::set<std::string> tried, refused;
    std::vector<CellResult> failed;        // the refused cells
    double seconds = 0;        // wall time of all calibration runs
    bool out_of_time = false;  // stopped at the budget's end
  };

  // Runs each cell of cut level `level` not tried yet once with cal.count
  // requests; stops between runs at the budget's end (cal.out_of_time).
  absl::Status Calibrate(WorkloadResult& r, int level, Calibration& cal) {
    const std::string name = WorkloadName(r.workload);
    for (const Config& c : BenchConfigs(r.workload, level)) {
      if (cal.tried.count(c.label) != 0) continue;
      RETURN_IF_ERROR(CheckSignal());
      cal.out_of_time = Now() >= end_;
      if (cal.out_of_time) return absl::OkStatus();
      cal.tried.insert(c.label);
      Progress(absl::StrFormat("%s: calibrating %s", name, c.label));
      const double t0 = Now();
      absl::StatusOr<Sample> s = BenchSample(c, r.workload, cal.count);
      RETURN_IF_ERROR(CheckSignal());
      cal.seconds += Now() - t0;
      if (!s.ok()) {
        cal.refused.insert(c.label);
        cal.failed.push_back({c, {}, ""});
        Failed(r, cal.failed.back(), s.status());
        continue;
      }
      cal.cost[c.label] = {cal.count / std::max(s->seconds, 1e-6),
                           std::max(Now() - t0 - s->seconds, 0.0)};
      cal.first[c.label] = *s;
    }
    return absl::OkStatus();
  }

  // One workload within `deadline` (its share of the budget): calibration
  // of the smallest cell set, the plan, the rounds, the ranking.
  absl::StatusOr<WorkloadResult> RunWorkload(Workload w, double deadline) {
    WorkloadResult r;
    r.workload = w;
    const std::string name = WorkloadName(w);
    if (Now() >= end_) {
      NoVerdict(r, "before it started");
      return r;
    }
    if (w == Workload::kOverlay) {
      Progress("overlay: writing the backing file");
      RETURN_IF_ERROR(MakeBacking());
      RETURN_IF_ERROR(CheckSignal());
    }
    Calibration cal;
    cal.count = w == Workload::kSequential ? 32 : 1024;
    RETURN_IF_ERROR(Calibrate(r, kLastLevel, cal));
    if (cal.cost.empty()) {
      if (!cal.out_of_time) {
        return absl::FailedPreconditionError(absl::StrCat(
            name, ": no configuration could be measured: ", r.notes.back()));
      }
      NoVerdict(r, "before one configuration was measured");
    } else {
      RETURN_IF_ERROR(PlanAndRun(r, deadline, cal));
    }
    if (w == Workload::kOverlay) Delete(Path("base.raw"));
    // Rank by median IOPS (the unmeasured and the failed last); the
    // verdict between the first two.
    r.cells.insert(r.cells.end(), cal.failed.begin(), cal.failed.end());
    std::stable_sort(r.cells.begin(), r.cells.end(),
                     [](const CellResult& a, const CellResult& b) {
                       if (RankClass(a) != RankClass(b)) {
                         return RankClass(a) < RankClass(b);
                       }
                       return a.MedianOf(&Sample::iops) >
                              b.MedianOf(&Sample::iops);
                     });
    if (Ranked(r) == 0 && r.no_verdict.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          name, ": no configuration could be measured: ", r.notes.back()));
    }
    if (Ranked(r) >= 2 && r.no_verdict.empty()) {
      r.verdict = Decide(r.cells[0].Values(&Sample::iops),
                         r.cells[1].Values(&Sample::iops));
    }
    return r;
  }

  // The plan (advise_plan.h PlanWorkload) from the first calibration, the
  // calibration of the cells it adds, the count for their measured costs,
  // and the rounds into r.cells. Where the budget ends first, the
  // calibration runs are the only repetition.
  absl::Status PlanAndRun(WorkloadResult& r, double deadline,
                          Calibration& cal) {
    const Workload w = r.workload;
    Plan plan;
    plan.level = kLastLevel;
    if (!cal.out_of_time) {
      PlanInput in;
      for (int level = 0; level <= kLastLevel; ++level) {
        in.levels.emplace_back();
        for (const Config& c : BenchConfigs(w, level)) {
          in.levels.back().push_back(c.label);
        }
      }
      in.costs = cal.cost;
      in.failed = cal.refused;
      in.calibration_count = cal.count;
      in.calibration_seconds = cal.seconds / cal.tried.size();
      in.seconds = deadline - Now();
      plan = PlanWorkload(in);
      RETURN_IF_ERROR(Calibrate(r, plan.level, cal));
      if (!cal.out_of_time) {
        in.costs = cal.cost;
        in.failed = cal.refused;
        in.seconds = deadline - Now();
        in.fixed_reps = plan.reps;
        in.fixed_level = plan.level;
        plan = PlanWorkload(in);
        NotePlan(r, plan, in.seconds);
      }
    }
    if (cal.out_of_time) {
      plan.count = cal.count;
      plan.reuse_calibration = true;
    }
    for (const Config& c : BenchConfigs(w, plan.level)) {
      if (cal.cost.count(c.label) == 0) continue;
      r.cells.push_back({c, {}, ""});
      if (plan.reuse_calibration) r.cells.back().samples = {cal.first[c.label]};
    }
    r.count = plan.count;
    r.reps = plan.reuse_calibration ? 1 : 0;
    if (!cal.out_of_time) {
      RETURN_IF_ERROR(RunRounds(
          r, r.reps, plan.reps, kAdviseMinReps, deadline,
          [&](const Config& c) { return BenchSample(c, w, plan.count); }));
    }
    if (r.reps == 0) {
      // Not one round in time: the calibration runs stand for it.
      for (CellResult& cell : r.cells) {
        if (cell.error.empty()) cell.samples = {cal.first[cell.config.label]};
      }
      r.count = cal.count;
      r.reps = 1;
    }
    if (r.reps < kAdviseMinReps) {
      NoVerdict(r, absl::StrFormat("after %d of the %d repetitions a verdict "
                                   "needs (%d requests per run)",
                                   r.reps, kAdviseMinReps, r.count));
    }
    return absl::OkStatus();
  }

  // The budget ran out `when`: no verdict for r.
  static void NoVerdict(WorkloadResult& r, const std::string& when) {
    r.cut = true;
    r.no_verdict = absl::StrCat("no verdict: the budget ran out ", when);
    r.notes.push_back(
        absl::StrCat(WorkloadName(r.workload), ": ", r.no_verdict));
  }

  // The notes of a plan smaller than the full matrix.
  static void NotePlan(WorkloadResult& r, const Plan& plan, double seconds) {
    const std::string name = WorkloadName(r.workload);
    if (plan.level > 0 || plan.reps < kMaxReps) {
      r.cut = true;
      std::vector<std::string> kept;
      for (uint64_t cluster : ClusterSizes(plan.level)) {
        kept.push_back(SizeText(cluster));
      }
      r.notes.push_back(absl::StrFormat(
          "%s: %d repetitions%s (time budget)", name, plan.reps,
          plan.level > 0
              ? absl::StrCat(", cluster sizes cut to ", absl::StrJoin(kept, ", "))
              : ""));
    }
    if (plan.short_runs) {
      r.cut = true;
      r.notes.push_back(absl::StrFormat(
          "%s: runs of %d requests, shorter than %.1f s of the fastest cell "
          "(time budget)%s",
          name, plan.count, kAdviseMinRunSeconds,
          plan.reuse_calibration
              ? ": the calibration runs are the first repetition"
              : ""));
    }
    if (!plan.fits) {
      r.notes.push_back(absl::StrFormat(
          "%s: even the smallest plan needs about %.1f s, %.1f s were left: "
          "the runs stop at the end of the budget",
          name, plan.estimated_seconds, std::max(seconds, 0.0)));
    }
  }

  const AdviseArgs& args_;
  const std::string work_;
  std::ostream& err_;
  const bool progress_;
  double start_ = 0;
  double end_ = 0;  // start_ + --time: no run starts after it
  std::future<void> deleting_;
  uint64_t deleted_ = 0;
};

std::string Number(double v) {
  if (!std::isfinite(v)) return "0";
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    return absl::StrFormat("%d", static_cast<int64_t>(v));
  }
  return absl::StrFormat("%.10g", v);
}

// 12345.6 -> "12,346".
std::string Grouped(double v) {
  std::string digits = absl::StrFormat("%.0f", v);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0 && digits[i - 1] != '-') {
      out += ',';
    }
    out += digits[i];
  }
  return out;
}

std::string VerdictText(const WorkloadResult& r) {
  const CellResult& a = r.cells[0];
  const CellResult& b = r.cells[1];
  const double ma = a.MedianOf(&Sample::iops);
  const double mb = b.MedianOf(&Sample::iops);
  const std::string diff =
      absl::StrFormat("%+.1f%%", mb > 0 ? (ma / mb - 1) * 100 : 0.0);
  const std::string rule =
      r.verdict.utest
          ? absl::StrFormat("U test p=%.2g", r.verdict.p)
          : absl::StrFormat("%d repetitions: ranges %s (U test p=%.2g)",
                            r.reps,
                            r.verdict.decided ? "apart" : "overlap",
                            r.verdict.p);
  return absl::StrFormat("%s %s (median %s IOPS): %s, %s: %s",
                         r.verdict.decided ? "better than" : "tie with",
                         b.config.label, Grouped(mb), diff, rule,
                         r.verdict.decided ? "decided" : "not decided");
}

void PrintHuman(const AdviseArgs& a, const std::string& fs,
                const std::vector<WorkloadResult>& results, double elapsed,
                std::ostream& out) {
  out << absl::StrFormat(
      "imgtool advise: %s (%s), images of %s, budget %d s, took %.1f s\n",
      a.dir, fs, SizeText(a.size), a.seconds, elapsed);
  for (const WorkloadResult& r : results) {
    out << "\n== " << WorkloadName(r.workload) << ": "
        << WorkloadText(r.workload) << "\n";
    if (r.workload == Workload::kCreate) {
      if (r.reps == 0) {
        out << "not one round in time (see the notes)\n";
        continue;
      }
      out << absl::StrFormat("images of %s, %d repetitions, medians\n",
                             SizeText(std::min(a.size, 256 * kMiB)), r.reps);
      out << absl::StrFormat("%-16s %12s %9s %12s\n", "configuration",
                             "create ms", "extents", "space MiB");
      for (const CellResult& c : r.cells) {
        if (!c.error.empty()) {
          out << absl::StrFormat("%-16s failed (see the notes)\n",
                                 c.config.label);
          continue;
        }
        out << absl::StrFormat(
            "%-16s %12.2f %9d %12.1f\n", c.config.label,
            c.MedianOf(&Sample::create_seconds) * 1000,
            static_cast<uint64_t>(c.MedianOf(&Sample::extents)),
            c.MedianOf(&Sample::allocated) / kMiB);
      }
      continue;
    }
    if (Ranked(r) == 0) {
      out << "  " << r.no_verdict << "\n";
      continue;
    }
    out << absl::StrFormat(
        "%d requests per run, %d repetitions interleaved, medians; spread = "
        "(max - min) / median of IOPS\n",
        r.count, r.reps);
    out << absl::StrFormat("%4s  %-38s %10s %9s %7s %9s %10s %10s\n", "rank",
                           "configuration", "IOPS", "MiB/s", "spread",
                           "extents", "space MiB", "create ms");
    for (size_t i = 0; i < Ranked(r); ++i) {
      const CellResult& c = r.cells[i];
      const std::vector<double> iops = c.Values(&Sample::iops);
      const double median = Median(iops);
      const double spread =
          median > 0 ? (*std::max_element(iops.begin(), iops.end()) -
                        *std::min_element(iops.begin(), iops.end())) /
                           median * 100
                     : 0;
      out << absl::StrFormat(
          "%4d  %-38s %10s %9.1f %6.1f%% %9d %10.1f %10.2f\n", i + 1,
          c.config.label, Grouped(median), c.MedianOf(&Sample::mib_per_s),
          spread, static_cast<uint64_t>(c.MedianOf(&Sample::extents)),
          c.MedianOf(&Sample::allocated) / kMiB,
          c.MedianOf(&Sample::create_seconds) * 1000);
    }
    if (!r.no_verdict.empty()) {
      out << "  " << r.no_verdict << "\n";
      continue;
    }
    const CellResult& best = r.cells[0];
    const std::vector<double> iops = best.Values(&Sample::iops);
    out << absl::StrFormat(
        "Winner: %s: median %s IOPS (min %s, max %s, %d repetitions)\n",
        best.config.label, Grouped(Median(iops)),
        Grouped(*std::min_element(iops.begin(), iops.end())),
        Grouped(*std::max_element(iops.begin(), iops.end())), iops.size());
    if (Ranked(r) >= 2) {
      out << "  " << (r.verdict.decided ? "" : "TIE: ") << VerdictText(r)
          << "\n";
    }
    const size_t lines = r.verdict.decided ? 1 : 2;
    for (size_t i = 0; i < lines && i < Ranked(r); ++i) {
      const Config& c = r.cells[i].config;
      if (r.workload == Workload::kOverlay) {
        out << "  imgtool create -f raw base.raw " << SizeText(a.size)
            << "   # or your base image\n";
      }
      out << "  " << AdviceLine(c, r.workload, a.size) << "\n";
      if (c.filter) {
        out << "  then open it with --image-opts "
            << FilterOpts(ImageName(c, r.workload)) << "\n";
      }
    }
  }
  bool any = false;
  for (const WorkloadResult& r : results) {
    for (const std::string& n : r.notes) {
      if (!any) out << "\nNotes:\n";
      any = true;
      out << "  " << n << "\n";
    }
  }
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      out += absl::StrFormat("\\u%04x", static_cast<int>(ch));
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

// Google Benchmark's JSON layout (benchmarks/README.md "Result files"):
// an iteration entry per repetition and the mean/median/stddev/cv
// aggregates of each counter.
void PrintJsonResults(const AdviseArgs& a, const std::string& fs,
                      const std::vector<WorkloadResult>& results,
                      double elapsed, double load_start, std::ostream& out) {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  struct utsname uts = {};
  uname(&uts);
  double load[3] = {0, 0, 0};
  getloadavg(load, 3);
  char date[64] = {};
  const std::time_t now = std::time(nullptr);
  struct tm tm_now;
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%S+00:00",
                gmtime_r(&now, &tm_now));
  // quick: the budget made the run smaller than the full matrix (fewer
  // repetitions, cluster sizes or requests per run, no verdict), so its
  // figures do not compare with a full run's (benchmarks/README.md).
  bool quick = false;
  for (const WorkloadResult& r : results) quick = quick || r.cut;
#ifdef NDEBUG
  const bool opt = true;
#else
  const bool opt = false;
#endif
  std::vector<std::pair<std::string, std::string>> ctx = {
      {"date", date},
      {"host_name", host},
      {"executable", "imgtool advise"},
      {"library_build_type", opt ? "release" : "debug"},
      {"suite", "advise"},
      {"machine", host},
      {"kernel", uts.release},
      {"filesystems", fs},
      {"imgtool_commit", a.commit},
      {"imgtool_version", kImgtoolVersion},
      {"build", opt ? "opt" : "fastbuild"},
      {"quick", quick ? "true" : "false"},
      {"load_avg_start", absl::StrFormat("%.2f", load_start)},
      {"load_avg_end", absl::StrFormat("%.2f", load[0])},
      {"dir", a.dir},
      {"size_bytes", absl::StrCat(a.size)},
      {"time_budget_seconds", absl::StrCat(a.seconds)},
      {"elapsed_seconds", absl::StrFormat("%.3f", elapsed)},
  };
  std::vector<std::string> notes;
  for (const WorkloadResult& r : results) {
    notes.insert(notes.end(), r.notes.begin(), r.notes.end());
    if (r.workload == Workload::kCreate) continue;
    const std::string w = WorkloadName(r.workload);
    if (!r.no_verdict.empty()) {
      ctx.push_back({absl::StrCat("winner_", w, "_verdict"), r.no_verdict});
      ctx.push_back({absl::StrCat("winner_", w, "_decided"), "false"});
      continue;
    }
    const Config& best = r.cells[0].config;
    ctx.push_back({absl::StrCat("winner_", w), best.label});
    ctx.push_back({absl::StrCat("winner_", w, "_create"),
                   AdviceLine(best, r.workload, a.size)});
    if (best.filter) {
      ctx.push_back({absl::StrCat("winner_", w, "_image_opts"),
                     FilterOpts(ImageName(best, r.workload))});
    }
    if (Ranked(r) >= 2) {
      ctx.push_back({absl::StrCat("winner_", w, "_verdict"),
                     absl::StrCat(best.label, ": ", VerdictText(r))});
      ctx.push_back({absl::StrCat("winner_", w, "_decided"),
                     r.verdict.decided ? "true" : "false"});
    }
  }
  ctx.push_back({"notes", notes.empty() ? "none" : absl::StrJoin(notes, "; ")});

  out << "{\n  \"context\": {\n";
  out << "    \"num_cpus\": " << sysconf(_SC_NPROCESSORS_ONLN) << ",\n";
  out << absl::StrFormat("    \"load_avg\": [%g, %g, %g],\n", load[0], load[1],
                         load[2]);
  for (size_t i = 0; i < ctx.size(); ++i) {
    out << "    " << JsonString(ctx[i].first) << ": "
        << JsonString(ctx[i].second) << (i + 1 < ctx.size() ? ",\n" : "\n");
  }
  out << "  },\n  \"benchmarks\": [";
  bool first = true;
  int family = 0;
  for (const WorkloadResult& r : results) {
    const bool create = r.workload == Workload::kCreate;
    for (const CellResult& c : r.cells) {
      const std::string run_name =
          absl::StrCat("advise/fs:", fs, "/workload:", WorkloadName(r.workload),
                       "/config:", c.config.label);
      // counter name -> per-repetition values
      std::vector<std::pair<std::string, std::vector<double>>> counters;
      auto add = [&](const char* name, auto field) {
        std::vector<double> v;
        for (const Sample& s : c.samples) {
          v.push_back(static_cast<double>(s.*field));
        }
        counters.push_back({name, v});
      };
      add("seconds", &Sample::seconds);
      if (!create) {
        add("IOPS", &Sample::iops);
        add("MiB_per_s", &Sample::mib_per_s);
        add("create_seconds", &Sample::create_seconds);
        add("writes", &Sample::writes);
      }
      add("extents", &Sample::extents);
      add("allocated_bytes", &Sample::allocated);
      const size_t n = c.samples.size();
      if (c.error.empty() && n == 0) continue;  // not measured in time
      if (!c.error.empty()) {
        // Google Benchmark's form of a run that failed: no counters.
        out << (first ? "\n" : ",\n") << "    {\n";
        first = false;
        out << "      \"name\": " << JsonString(run_name) << ",\n"
            << "      \"family_index\": " << family << ",\n"
            << "      \"per_family_instance_index\": 0,\n"
            << "      \"run_name\": " << JsonString(run_name) << ",\n"
            << "      \"run_type\": \"iteration\",\n"
            << "      \"repetitions\": 1,\n"
            << "      \"repetition_index\": 0,\n"
            << "      \"threads\": 1,\n"
            << "      \"iterations\": 0,\n"
            << "      \"real_time\": 0,\n"
            << "      \"cpu_time\": 0,\n"
            << "      \"time_unit\": \"ms\",\n"
            << "      \"error_occurred\": true,\n"
            << "      \"error_message\": " << JsonString(c.error) << "\n"
            << "    }";
        ++family;
        continue;
      }
      auto entry = [&](const std::string& name, const std::string& type,
                       const std::string& extra, double real_seconds,
                       const std::vector<std::pair<std::string, double>>& v) {
        out << (first ? "\n" : ",\n") << "    {\n";
        first = false;
        out << "      \"name\": " << JsonString(name) << ",\n"
            << "      \"family_index\": " << family << ",\n"
            << "      \"per_family_instance_index\": 0,\n"
            << "      \"run_name\": " << JsonString(run_name) << ",\n"
            << "      \"run_type\": \"" << type << "\",\n"
            << "      \"repetitions\": " << n << ",\n"
            << extra << "      \"threads\": 1,\n"
            << "      \"iterations\": 1,\n"
            << "      \"real_time\": " << Number(real_seconds * 1000) << ",\n"
            << "      \"cpu_time\": " << Number(real_seconds * 1000) << ",\n"
            << "      \"time_unit\": \"ms\"";
        for (const auto& [k, x] : v) {
          out << ",\n      " << JsonString(k) << ": " << Number(x);
        }
        out << "\n    }";
      };
      for (size_t i = 0; i < n; ++i) {
        std::vector<std::pair<std::string, double>> v;
        for (const auto& [k, values] : counters) v.push_back({k, values[i]});
        entry(run_name, "iteration",
              absl::StrFormat("      \"repetition_index\": %d,\n", i),
              c.samples[i].seconds, v);
      }
      if (n > 1) {
        for (const char* agg : {"mean", "median", "stddev", "cv"}) {
          auto stat = [&](const std::vector<double>& x) {
            double mean = 0;
            for (double d : x) mean += d;
            mean /= x.size();
            double var = 0;
            for (double d : x) var += (d - mean) * (d - mean);
            const double sd = std::sqrt(var / (x.size() - 1));
            const std::string name = agg;
            if (name == "mean") return mean;
            if (name == "median") return Median(x);
            if (name == "stddev") return sd;
            return mean != 0 ? sd / mean : 0.0;
          };
          std::vector<std::pair<std::string, double>> v;
          for (const auto& [k, values] : counters) {
            v.push_back({k, stat(values)});
          }
          const std::string unit =
              std::string(agg) == "cv" ? "percentage" : "time";
          entry(absl::StrCat(run_name, "_", agg), "aggregate",
                absl::StrFormat("      \"aggregate_name\": \"%s\",\n"
                                "      \"aggregate_unit\": \"%s\",\n",
                                agg, unit),
                stat(counters[0].second), v);
        }
      }
      ++family;
    }
  }
  out << "\n  ]\n}\n";
}

enum LongOption { kSize = 256, kTime, kWorkload, kOutput, kImgtoolCommit };

const struct option kLongOptions[] = {
    {"help", no_argument, nullptr, 'h'},
    {"size", required_argument, nullptr, kSize},
    {"time", required_argument, nullptr, kTime},
    {"workload", required_argument, nullptr, kWorkload},
    {"output", required_argument, nullptr, kOutput},
    {"imgtool-commit", required_argument, nullptr, kImgtoolCommit},
    {nullptr, 0, nullptr, 0},
};

absl::Status HandleOption(AdviseArgs& a, int option, const std::string& arg) {
  switch (option) {
    case 'h':
      a.help = true;
      return absl::OkStatus();
    case kSize: {
      absl::StatusOr<uint64_t> v = ParseSize(arg);
      if (!v.ok() || *v < 16 * kMiB || *v % (2 * kMiB) != 0 ||
          *v > (uint64_t{1} << 50)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "Invalid --size '", arg,
            "': a multiple of 2 MiB from 16M to 1P is needed"));
      }
      a.size = *v;
      return absl::OkStatus();
    }
    case kTime: {
      int v = 0;
      if (!absl::SimpleAtoi(arg, &v) || v < 5 || v > 86400) {
        return absl::InvalidArgumentError(absl::StrCat(
            "Invalid --time '", arg, "': whole seconds from 5 to 86400"));
      }
      a.seconds = v;
      return absl::OkStatus();
    }
    case kWorkload:
      if (arg == "all") {
        a.workloads = {Workload::kRandom4k, Workload::kSequential,
                       Workload::kOverlay};
      } else if (arg == "random-4k") {
        a.workloads = {Workload::kRandom4k};
      } else if (arg == "sequential") {
        a.workloads = {Workload::kSequential};
      } else if (arg == "overlay") {
        a.workloads = {Workload::kOverlay};
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            "Invalid --workload '", arg,
            "': random-4k, sequential, overlay or all"));
      }
      return absl::OkStatus();
    case kOutput: {
      ASSIGN_OR_RETURN(a.json, ParseOutputFormat(arg));
      return absl::OkStatus();
    }
    case kImgtoolCommit: {
      const bool word =
          !arg.empty() && arg.size() <= 64 &&
          std::all_of(arg.begin(), arg.end(), [](char ch) {
            return absl::ascii_isalnum(static_cast<unsigned char>(ch)) ||
                   ch == '-' || ch == '_' || ch == '.';
          });
      if (!word) {
        return absl::InvalidArgumentError(absl::StrCat(
            "Invalid --imgtool-commit '", arg,
            "': 1 to 64 letters, digits, '-', '_' or '.'"));
      }
      a.commit = arg;
      return absl::OkStatus();
    }
  }
  return absl::InternalError(absl::StrCat("advise: unhandled option ", option));
}

// DIR must be a writable directory with room for the matrix: the largest
// image (a raw image written in full, or a fully preallocated one: --size
// plus qcow2 metadata), the previous one still being deleted, and for the
// overlay workload its backing file.
absl::Status CheckDir(const AdviseArgs& a) {
  struct stat st;
  if (stat(a.dir.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat(a.dir, ": ", std::strerror(errno)));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(a.dir, ": ", std::strerror(ENOTDIR)));
  }
  if (access(a.dir.c_str(), W_OK | X_OK) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat(a.dir, ": not writable: ", std::strerror(errno)));
  }
  struct statvfs vfs;
  if (statvfs(a.dir.c_str(), &vfs) != 0) {
    return ErrnoStatus(a.dir, "statvfs", errno);
  }
  const bool overlay = std::find(a.workloads.begin(), a.workloads.end(),
                                 Workload::kOverlay) != a.workloads.end();
  const uint64_t need =
      (overlay ? 3 : 2) * a.size + a.size / 8 + 32 * kMiB;
  const uint64_t have = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  if (have < need) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "%s: not enough free space for the planned matrix: it needs %s "
        "(images of %s%s), the filesystem has %s free; use a smaller --size",
        a.dir, MiBText(need), SizeText(a.size),
        overlay ? " and the overlay's backing file" : "", MiBText(have)));
  }
  return absl::OkStatus();
}

// Removes the files of the private directory (it holds no subdirectories)
// and the directory itself.
void RemoveWorkDir(const std::string& work) {
  if (DIR* d = opendir(work.c_str()); d != nullptr) {
    std::vector<std::string> names;
    while (struct dirent* e = readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") names.push_back(name);
    }
    closedir(d);
    for (const std::string& name : names) {
      unlink(absl::StrCat(work, "/", name).c_str());
    }
  }
  rmdir(work.c_str());
}

}  // namespace

absl::Status RunAdvise(const std::vector<std::string>& args, Streams streams) {
  AdviseArgs a;
  ASSIGN_OR_RETURN(std::vector<std::string> operands,
                   ParseOptions(args, "h", kLongOptions, kUsage,
                                [&a](int option, const std::string& arg) {
                                  return HandleOption(a, option, arg);
                                }));
  if (a.help) {
    streams.out << kHelp;
    return absl::OkStatus();
  }
  if (operands.size() != 1) {
    return UsageError("Expecting one directory", kUsage);
  }
  a.dir = operands[0];
  RETURN_IF_ERROR(CheckDir(a));
  double load[1] = {0};
  getloadavg(load, 1);

  // Signals: set a flag, checked between runs; the old actions come back
  // before the signal is raised again after the cleanup.
  struct sigaction action = {}, old[3];
  action.sa_handler = OnSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  const int signals[3] = {SIGINT, SIGTERM, SIGHUP};
  g_signal = 0;
  for (int i = 0; i < 3; ++i) sigaction(signals[i], &action, &old[i]);

  std::string work = absl::StrCat(a.dir, "/.imgtool-advise-XXXXXX");
  absl::Status status;
  if (mkdtemp(work.data()) == nullptr) {
    status = absl::PermissionDeniedError(absl::StrCat(
        a.dir, ": not writable: mkdtemp: ", std::strerror(errno)));
  }
  std::string fs;
  absl::StatusOr<std::vector<WorkloadResult>> results;
  double elapsed = 0;
  if (status.ok()) {
    fs = FilesystemName(work);
    Advisor advisor(a, work, streams.err, isatty(STDERR_FILENO) != 0);
    results = advisor.Run();
    elapsed = advisor.elapsed();
    advisor.WaitDeletes();
    RemoveWorkDir(work);
    if (!results.ok()) {
      status = results.status();
      if (!absl::StartsWith(status.message(), a.dir)) {
        status = absl::Status(status.code(),
                              absl::StrCat(a.dir, ": ", status.message()));
      }
    }
  }
  for (int i = 0; i < 3; ++i) sigaction(signals[i], &old[i], nullptr);
  if (g_signal != 0) {
    const int sig = g_signal;
    signal(sig, SIG_DFL);
    raise(sig);
  }
  RETURN_IF_ERROR(status);
  if (elapsed > a.seconds * 1.1) {
    // No run starts after the budget's end, so this is one step (an
    // image's create, write or delete, or the overlay's backing file) that
    // took that long here.
    results->back().cut = true;
    results->back().notes.push_back(absl::StrFormat(
        "the run took %.1f s, over the %d s budget: no run starts after its "
        "end, but one step (writing an image, deleting one) took that long "
        "here; give a larger --time or a smaller --size",
        elapsed, a.seconds));
  }
  if (a.json) {
    PrintJsonResults(a, fs, *results, elapsed, load[0], streams.out);
  } else {
    PrintHuman(a, fs, *results, elapsed, streams.out);
  }
  return absl::OkStatus();
}

}  // namespace imgtool::cli
