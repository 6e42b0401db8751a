// Suite `engine`: the I/O engines under posix_file::FileNode (io_uring, Linux
// AIO and the thread pool) at queue depths 1..256, 4 KiB O_DIRECT random
// reads and writes on a fully written raw file, on an XFS and on an ext4 loop
// mount (one file each), against fio's io_uring and libaio engines (same
// file, request size and depth). The ceiling of a filesystem, op and depth is
// the best of its fio entries (issue 20 part 1); the report and dashboard
// derive it, the suite writes no entry of its own for it.
//
//   engine/fs:F/op:O/engine:E/depth:D/tool:imgtool   F: xfs, ext4;
//       E: io_uring, native (io::AioEngine, `-i native`), threads
//       per iteration: a fresh engine (kind E, queue depth D) and FileNode
//       (cache=none), then D workers issue 4 KiB requests at random aligned
//       offsets for --seconds; open and close are not timed.
//   engine/fs:F/op:O/engine:E/depth:D/tool:fio   E: io_uring,
//       io_uring_fixedbufs, io_uring_registerfiles, io_uring_sqthread_poll
//       (fio's io_uring options --fixedbufs, --registerfiles,
//       --sqthread_poll=1), libaio
//       per iteration: `fio --ioengine=io_uring|libaio [OPTION] --iodepth=D
//       --direct=1 --bs=4k --rw=randO --time_based --runtime=--seconds` as a
//       subprocess, figures from its --output-format=json.
//   Counters: seconds (the measured run), IOPS, MiB_per_s.
//   Depths 1, 2, 4 .. 256; --quick: 1, 16, 256 (and a 64 MiB file, 0.1 s
//   runs).
//
// Result file contract: benchmarks/README.md ("Result files").
// Run (root): bazel run //benchmarks:engine_bench -- [--file_mib=1024]
//     [--seconds=1] [--quick] [--fio=fio]
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "base/status_macros.h"
#include "base/testing/loop_mount.h"
#include "benchmark/benchmark.h"
#include "benchmarks/suite.h"
#include "benchmarks/workloads.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "io/aligned_buffer.h"
#include "io/block_node.h"
#include "io/engine.h"
#include "io/task.h"
#include "posix_file/file_node.h"
#include "posix_file/file_options.pb.h"

ABSL_FLAG(uint64_t, file_mib, 1024, "size of the raw file in MiB (--quick: 64)");
ABSL_FLAG(double, seconds, 1.0,
          "run time of each measurement in seconds (--quick: 0.1)");
ABSL_FLAG(std::string, fio, "fio", "the fio binary; empty: no fio entries");

namespace imgtool::benchmarks {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kRequest = 4096;

uint64_t g_file_size = 0;
double g_seconds = 0;

struct RunState {
  io::BlockNode* node = nullptr;
  bool write = false;
  uint64_t blocks = 0;  // file size / kRequest
  Clock::time_point deadline;
  uint64_t done = 0;
  int running = 0;
  absl::Status error;
};

io::Task<void> Worker(RunState* s, io::IoVec buf, uint64_t seed) {
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;  // xorshift64 state
  while (s->error.ok() && Clock::now() < s->deadline) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    const uint64_t offset = (x % s->blocks) * kRequest;
    absl::Status st;
    if (s->write) {
      st = co_await s->node->Write(offset, buf);
    } else {
      st = co_await s->node->Read(offset, buf);
    }
    if (!st.ok() && s->error.ok()) s->error = std::move(st);
    ++s->done;
  }
}

// Runs `depth` workers for g_seconds; returns {seconds, requests}.
// `path`: the fully written raw file.
absl::StatusOr<std::pair<double, uint64_t>> RunImgtool(const std::string& path,
                                                       io::EngineKind kind,
                                                       int depth, bool write) {
  ASSIGN_OR_RETURN(std::unique_ptr<io::Engine> engine,
                   io::CreateEngine(kind, depth, nullptr));
  posix_file::FileOpenOptions open;
  open.set_filename(path);
  open.set_cache("none");
  ASSIGN_OR_RETURN(std::unique_ptr<posix_file::FileNode> node,
                   posix_file::FileNode::Open(*engine, open, nullptr));
  io::AlignedBuffer buffer(depth * kRequest);
  std::memset(buffer.data(), 0x5a, buffer.size());
  RunState s;
  s.node = node.get();
  s.write = write;
  s.blocks = g_file_size / kRequest;
  const Clock::time_point start = Clock::now();
  s.deadline = start + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(g_seconds));
  for (int i = 0; i < depth; ++i) {
    ++s.running;
    io::Spawn(Worker(&s, buffer.span().subspan(i * kRequest, kRequest), i + 1),
              [&s] { --s.running; });
  }
  absl::Status st;
  while (s.running > 0 && st.ok()) {
    if (engine->in_flight() == 0) {
      st = absl::InternalError("engine_bench: workers stalled");
      break;
    }
    st = engine->Poll(/*wait=*/true);
  }
  const double seconds =
      std::chrono::duration<double>(Clock::now() - start).count();
  absl::Status closed = io::RunSync(*engine, node->Close());
  RETURN_IF_ERROR(st);
  RETURN_IF_ERROR(s.error);
  RETURN_IF_ERROR(closed);
  return std::make_pair(seconds, s.done);
}

const google::protobuf::Value* Field(const google::protobuf::Value& v,
                                     const std::string& key) {
  if (!v.has_struct_value()) return nullptr;
  auto it = v.struct_value().fields().find(key);
  return it == v.struct_value().fields().end() ? nullptr : &it->second;
}

// fio on `path`; returns {seconds, requests} from its JSON output.
// `fio_engine` is --ioengine's value, `fio_option` one more option or "".
absl::StatusOr<std::pair<double, uint64_t>> RunFio(
    const std::string& path, const std::string& fio_engine,
    const std::string& fio_option, int depth, bool write) {
  const std::string ms = absl::StrCat(static_cast<int64_t>(g_seconds * 1000));
  std::vector<std::string> argv = {
      absl::GetFlag(FLAGS_fio), "--name=engine", "--filename=" + path,
      write ? "--rw=randwrite" : "--rw=randread", "--bs=4k", "--direct=1",
      "--ioengine=" + fio_engine, absl::StrCat("--iodepth=", depth),
      absl::StrCat("--size=", g_file_size), "--time_based",
      "--runtime=" + ms + "ms", "--randrepeat=0", "--norandommap",
      "--output-format=json"};
  if (!fio_option.empty()) argv.push_back(fio_option);
  ASSIGN_OR_RETURN(std::string out,
                   RunCommand(argv, /*merge_stderr=*/false));
  const size_t brace = out.find('{');
  google::protobuf::Value json;
  if (brace == std::string::npos ||
      !google::protobuf::util::JsonStringToMessage(out.substr(brace), &json)
           .ok()) {
    return absl::InternalError(absl::StrCat("fio: output is not JSON: ", out));
  }
  const google::protobuf::Value* jobs = Field(json, "jobs");
  if (jobs == nullptr || !jobs->has_list_value() ||
      jobs->list_value().values_size() != 1) {
    return absl::InternalError("fio: JSON output has no single job");
  }
  const google::protobuf::Value& job = jobs->list_value().values(0);
  const google::protobuf::Value* side = Field(job, write ? "write" : "read");
  const google::protobuf::Value* ios = side ? Field(*side, "total_ios") : nullptr;
  const google::protobuf::Value* runtime = Field(job, "job_runtime");
  const google::protobuf::Value* error = Field(job, "error");
  if (ios == nullptr || runtime == nullptr ||
      (error != nullptr && error->number_value() != 0)) {
    return absl::InternalError("fio: job failed or total_ios/job_runtime missing");
  }
  return std::make_pair(runtime->number_value() / 1000,
                        static_cast<uint64_t>(ios->number_value()));
}

// One series of the suite: imgtool's engine `kind`, or (fio_engine not
// empty) fio with --ioengine=fio_engine and fio_option. `label` is the
// benchmark name's engine label.
struct Engine {
  const char* label;
  io::EngineKind kind;
  const char* fio_engine;
  const char* fio_option;
};

constexpr Engine kEngines[] = {
    {"io_uring", io::EngineKind::kIoUring, "", ""},
    {"native", io::EngineKind::kNative, "", ""},
    {"threads", io::EngineKind::kThreads, "", ""},
    {"io_uring", io::EngineKind::kIoUring, "io_uring", ""},
    {"io_uring_fixedbufs", io::EngineKind::kIoUring, "io_uring",
     "--fixedbufs"},
    {"io_uring_registerfiles", io::EngineKind::kIoUring, "io_uring",
     "--registerfiles"},
    {"io_uring_sqthread_poll", io::EngineKind::kIoUring, "io_uring",
     "--sqthread_poll=1"},
    {"libaio", io::EngineKind::kIoUring, "libaio", ""},
};

void BM_Engine(benchmark::State& state, std::string path, Engine e,
               int depth, bool write) {
  const bool fio = e.fio_engine[0] != '\0';
  double seconds = 0;
  uint64_t requests = 0;
  for (auto _ : state) {
    absl::StatusOr<std::pair<double, uint64_t>> r =
        fio ? RunFio(path, e.fio_engine, e.fio_option, depth, write)
            : RunImgtool(path, e.kind, depth, write);
    if (!r.ok()) {
      state.SkipWithError(std::string(r.status().ToString()).c_str());
      return;
    }
    seconds += r->first;
    requests += r->second;
  }
  if (seconds <= 0) return;
  state.counters["seconds"] = seconds / static_cast<double>(state.iterations());
  state.counters["IOPS"] = requests / seconds;
  state.counters["MiB_per_s"] = requests * kRequest / seconds / (1 << 20);
}

}  // namespace
}  // namespace imgtool::benchmarks

int main(int argc, char** argv) {
  using namespace imgtool::benchmarks;
  using imgtool::testing::FsKind;
  InitSuite(argc, argv,
            "engine_bench: io_uring, native (Linux AIO) and threads, queue "
            "depth 1..256, 4 KiB random O_DIRECT reads/writes on a raw file "
            "on XFS and ext4, and fio's io_uring (plain, fixedbufs, "
            "registerfiles, sqthread_poll) and libaio engines, the ceiling "
            "(root). Result file contract: benchmarks/README.md");
  g_file_size = (Quick() ? 64 : absl::GetFlag(FLAGS_file_mib)) << 20;
  g_seconds = Quick() ? 0.1 : absl::GetFlag(FLAGS_seconds);
  if (g_file_size < (1u << 20) || g_seconds <= 0) {
    std::fprintf(stderr, "engine_bench: --file_mib >= 1, --seconds > 0\n");
    return 1;
  }
  const std::vector<SuiteMount> mounts =
      MountAll("engine_bench", {FsKind::kXfs, FsKind::kExt4},
               g_file_size + (512ull << 20));
  std::vector<std::string> paths;
  for (const SuiteMount& m : mounts) {
    paths.push_back(m.mount->path() + "/engine.raw");
    absl::Status st = CreateFullRaw(paths.back(), g_file_size);
    if (!st.ok()) {
      std::fprintf(stderr, "engine_bench: %s\n",
                   std::string(st.ToString()).c_str());
      return 1;
    }
  }
  const std::vector<int> depths =
      Quick() ? std::vector<int>{1, 16, 256}
              : std::vector<int>{1, 2, 4, 8, 16, 32, 64, 128, 256};
  const bool with_fio = !absl::GetFlag(FLAGS_fio).empty();
  for (size_t m = 0; m < mounts.size(); ++m) {
    for (bool write : {false, true}) {
      const char* op = write ? "randwrite" : "randread";
      for (const Engine& e : kEngines) {
        const bool fio = e.fio_engine[0] != '\0';
        if (fio && !with_fio) continue;
        for (int depth : depths) {
          benchmark::RegisterBenchmark(
              BenchName("engine", {{"fs", mounts[m].fs},
                                   {"op", op},
                                   {"engine", e.label},
                                   {"depth", absl::StrCat(depth)},
                                   {"tool", fio ? "fio" : "imgtool"}})
                  .c_str(),
              BM_Engine, paths[m], e, depth, write)
              ->Unit(benchmark::kMillisecond);
        }
      }
    }
  }
  AddSuiteContext("engine", "xfs,ext4");
  benchmark::AddCustomContext("file_bytes", absl::StrCat(g_file_size));
  benchmark::AddCustomContext("request_bytes", absl::StrCat(kRequest));
  benchmark::AddCustomContext("seconds_per_run", absl::StrCat(g_seconds));
  if (with_fio) {
    absl::StatusOr<std::string> version =
        RunCommand({absl::GetFlag(FLAGS_fio), "--version"});
    if (version.ok()) {
      benchmark::AddCustomContext(
          "fio_version", std::string(absl::StripAsciiWhitespace(*version)));
    }
  }
  RunSuite();
  return 0;
}
