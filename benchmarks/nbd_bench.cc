// Suite `nbd`: issue 19's NBD benchmarks, imgtool against qemu-nbd 7.2 and
// nbdcopy / qemu-img on the same files, in one run:
//
//   nbd/fs:xfs/part:server/case:C/tool:T  T: qemu-nbd, imgtool (the
//       server: `qemu-nbd` or `imgtool nbd`, both `-f qcow2 --cache=none
//       --aio=native -t`, on a unix socket (-k) or TCP 127.0.0.1 (-b -p)).
//       C: {randread,randwrite}_d{1,16,64}_{unix,tcp}: fio's `nbd` engine,
//       4 KiB random reads or writes at iodepth 1, 16, 64 (one connection),
//       --seconds each; seqread_{unix,tcp}: 1 MiB sequential reads, iodepth
//       16. Counters: seconds (fio's job_runtime), IOPS, MiB_per_s.
//   nbd/fs:xfs/part:local/case:{randread,randwrite}_d64/tool:imgtool:
//       `imgtool bench -f qcow2 -t none -i native -d 64 -s 4k -S 4182016
//       -c N [-w]` on the same image, no server: the local IOPS that the
//       depth-64 server cells are held against (issue 19: >= 0.8). The
//       step (1021 x 4 KiB) wraps around the image without repeating, as
//       in the snapshot and subcluster suites: scattered, not fio's random.
//   nbd/fs:xfs/part:copy/case:copy_from_{qemu-nbd,imgtool}/tool:T  T:
//       nbdcopy, qemu-img (`convert -f raw -O raw`), imgtool (`convert -f
//       raw -O raw`): copying copy.qcow2 (--copy_gib virtual, --copy_data_mib
//       of data: 1 MiB written every 4 MiB, the rest unallocated) out of
//       the server (`-r -e 4`: multi-conn is offered to whoever uses it)
//       into a raw file on the same filesystem. Counters: seconds (spawn to
//       exit), MiB_per_s (of the data). The first run of each case and tool
//       is checked with `qemu-img compare` against copy.qcow2.
//
// Images (made with qemu-img; 64 KiB clusters, extended_l2=on,
// extent_size_hint=1M): fio.qcow2 (--image_mib, every byte written, so
// writes are overwrites for both servers), copy.qcow2 as above.
//
// Alternation: the timings move with the machine's load, so every (case,
// tool) is measured before Google Benchmark starts: one unmeasured run per
// part, then --benchmark_repetitions rounds, each running every tool of a
// case once, starting one further along each round; the registered
// benchmarks replay those runs in order. A server is started for each run
// and stopped (SIGTERM) after it. Google Benchmark's real_time is not the
// runs' time: read `seconds`.
//
// Targets (issue 19; printed by report and check_results.py, never
// asserted): imgtool's server >= 1.0x qemu-nbd's IOPS in every server
// cell; the depth-64 server cells >= 0.8 of imgtool's local IOPS;
// imgtool convert's copy time <= nbdcopy's.
//
// Result file contract: benchmarks/README.md ("Result files").
// Run (root): bazel run //benchmarks:nbd_bench -- [--image_mib=1024]
//     [--seconds=5] [--copy_gib=4] [--copy_data_mib=1024]
//     [--local_count=200000] [--parts=server,local,copy] [--quick]
//     [--imgtool=PATH]
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
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
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
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
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

ABSL_FLAG(uint64_t, image_mib, 1024,
          "virtual size of fio.qcow2 in MiB, all written (--quick: 128)");
ABSL_FLAG(double, seconds, 5, "fio runtime per server run (--quick: 1)");
ABSL_FLAG(uint64_t, copy_gib, 4, "virtual size of copy.qcow2 in GiB "
          "(--quick: 512 MiB)");
ABSL_FLAG(uint64_t, copy_data_mib, 1024,
          "data in copy.qcow2 in MiB (--quick: 128)");
ABSL_FLAG(uint64_t, local_count, 200000,
          "requests per local imgtool bench run (--quick: 20000)");
ABSL_FLAG(std::string, parts, "server,local,copy",
          "which parts, comma-separated");
ABSL_FLAG(std::string, imgtool, "",
          "the imgtool binary (default: imgtool/imgtool in the runfiles)");

namespace imgtool::benchmarks {
namespace {

constexpr uint64_t kStep = 4096 * 1021;
constexpr int kDepths[] = {1, 16, 64};
constexpr const char* kServers[] = {"qemu-nbd", "imgtool"};
constexpr const char* kClients[] = {"nbdcopy", "qemu-img", "imgtool"};

struct Sample {
  double seconds = 0;
  double iops = 0;
  double mib_per_s = 0;
};

struct Runs {
  std::vector<Sample> samples;
  std::string error;
  bool checked = false;
};

// One (part, case) and the tools it compares.
struct Case {
  std::string part;
  std::string name;
  std::vector<std::string> tools;
};

std::string g_dir;
std::string g_imgtool;
uint64_t g_image = 0, g_copy = 0, g_copy_data = 0, g_local_count = 0;
double g_seconds = 0;
std::map<std::string, Runs> g_runs;  // "case/tool" -> runs
pid_t g_server = -1;                 // the running server, if any
int g_port = 10809 + 37;             // TCP port of the next server

void KillServer() {
  if (g_server > 0) {
    kill(g_server, SIGTERM);
    int wstatus;
    while (waitpid(g_server, &wstatus, 0) < 0 && errno == EINTR) {
    }
    g_server = -1;
  }
}

// Whether a connection to the server's address succeeds now.
bool CanConnect(bool unix_socket, const std::string& sock, int port) {
  int fd;
  int rc;
  if (unix_socket) {
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un a = {};
    a.sun_family = AF_UNIX;
    std::snprintf(a.sun_path, sizeof(a.sun_path), "%s", sock.c_str());
    rc = connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  } else {
    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    rc = connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  }
  close(fd);
  return rc == 0;
}

// Starts `server` (qemu-nbd or imgtool) on `image`; returns the NBD URI
// clients use. kInternal if it exits or does not listen within 20 s.
absl::StatusOr<std::string> StartServer(const std::string& server,
                                        const std::string& image,
                                        bool unix_socket, bool copy) {
  KillServer();
  const std::string sock = g_dir + "/nbd.sock";
  unlink(sock.c_str());
  const int port = g_port;
  g_port = g_port >= 10809 + 137 ? 10809 + 37 : g_port + 1;  // no TIME_WAIT
  std::vector<std::string> argv;
  if (server == "imgtool") {
    argv = {g_imgtool, "nbd"};
  } else {
    argv = {"qemu-nbd"};
  }
  for (const char* a : {"-f", "qcow2", "--cache=none", "--aio=native", "-t"}) {
    argv.push_back(a);
  }
  if (copy) {
    argv.insert(argv.end(), {"-r", "-e", "4"});
  }
  if (unix_socket) {
    argv.insert(argv.end(), {"-k", sock});
  } else {
    argv.insert(argv.end(), {"-b", "127.0.0.1", "-p", absl::StrCat(port)});
  }
  argv.push_back(image);
  const std::string err_path = g_dir + "/server.err";
  ASSIGN_OR_RETURN(const pid_t pid,
                   SpawnCommand(argv, /*dir=*/"", /*out_path=*/"", err_path));
  g_server = pid;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < deadline) {
    int wstatus;
    if (waitpid(pid, &wstatus, WNOHANG) == pid) {
      g_server = -1;
      return absl::InternalError(absl::StrCat(
          "`", absl::StrJoin(argv, " "), "` exited: ", FirstLine(err_path)));
    }
    if (CanConnect(unix_socket, sock, port)) {
      if (unix_socket) return "nbd+unix:///?socket=" + sock;
      return absl::StrCat("nbd://127.0.0.1:", port, "/");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  KillServer();
  return absl::InternalError(
      absl::StrCat("`", absl::StrJoin(argv, " "), "` did not listen in 20 s"));
}

const google::protobuf::Value* Field(const google::protobuf::Value& v,
                                     const std::string& key) {
  if (!v.has_struct_value()) return nullptr;
  auto it = v.struct_value().fields().find(key);
  return it == v.struct_value().fields().end() ? nullptr : &it->second;
}

// fio's nbd engine on `uri`: `rw` (randread, randwrite, read), `bs`,
// `depth`, g_seconds.
absl::StatusOr<Sample> RunFio(const std::string& uri, const std::string& rw,
                              uint64_t bs, int depth) {
  const std::string ms = absl::StrCat(static_cast<int64_t>(g_seconds * 1000));
  ASSIGN_OR_RETURN(
      std::string out,
      RunCommand({"fio", "--name=nbd", "--ioengine=nbd", "--uri=" + uri,
                  "--rw=" + rw, absl::StrCat("--bs=", bs),
                  absl::StrCat("--iodepth=", depth), "--time_based",
                  "--runtime=" + ms + "ms", "--randrepeat=0", "--norandommap",
                  "--output-format=json"},
                 /*merge_stderr=*/false));
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
  const google::protobuf::Value* side =
      Field(job, rw == "randwrite" ? "write" : "read");
  const google::protobuf::Value* ios = side ? Field(*side, "total_ios") : nullptr;
  const google::protobuf::Value* runtime = Field(job, "job_runtime");
  const google::protobuf::Value* error = Field(job, "error");
  if (ios == nullptr || runtime == nullptr || runtime->number_value() <= 0 ||
      (error != nullptr && error->number_value() != 0)) {
    return absl::InternalError("fio: job failed or total_ios/job_runtime missing");
  }
  Sample s;
  s.seconds = runtime->number_value() / 1000;
  s.iops = ios->number_value() / s.seconds;
  s.mib_per_s = s.iops * static_cast<double>(bs) / (1 << 20);
  return s;
}

// Runs argv; returns its wall time. kInternal with stderr's first line.
absl::StatusOr<double> Timed(const std::vector<std::string>& argv,
                             const std::string& out_path) {
  ASSIGN_OR_RETURN(const CommandRun run,
                   RunTimedCommand(argv, g_dir, out_path, g_dir + "/client.err"));
  return run.seconds;
}

absl::StatusOr<Sample> RunServerCase(const std::string& name,
                                     const std::string& tool) {
  const std::vector<std::string> parts = absl::StrSplit(name, '_');
  const bool unix_socket = parts.back() == "unix";
  ASSIGN_OR_RETURN(const std::string uri,
                   StartServer(tool, g_dir + "/fio.qcow2", unix_socket, false));
  absl::StatusOr<Sample> s;
  if (parts[0] == "seqread") {
    s = RunFio(uri, "read", 1 << 20, 16);
  } else {
    int depth = 0;
    if (!absl::SimpleAtoi(absl::StripPrefix(parts[1], "d"), &depth)) {
      s = absl::InternalError("bad case " + name);
    } else {
      s = RunFio(uri, parts[0], 4096, depth);
    }
  }
  KillServer();
  return s;
}

absl::StatusOr<Sample> RunLocalCase(const std::string& name) {
  std::vector<std::string> argv = {g_imgtool, "bench", "-f", "qcow2", "-t",
                                   "none", "-i", "native", "-d", "64", "-s",
                                   "4k", "-S", absl::StrCat(kStep), "-c",
                                   absl::StrCat(g_local_count)};
  if (absl::StartsWith(name, "randwrite")) argv.push_back("-w");
  argv.push_back("fio.qcow2");
  const std::string out_path = g_dir + "/bench.out";
  RETURN_IF_ERROR(Timed(argv, out_path).status());
  ASSIGN_OR_RETURN(const double t, BenchSeconds(out_path));
  Sample s;
  s.seconds = t;
  s.iops = static_cast<double>(g_local_count) / t;
  s.mib_per_s = s.iops * 4096 / (1 << 20);
  return s;
}

absl::StatusOr<Sample> RunCopyCase(const std::string& name,
                                   const std::string& tool, bool check) {
  const std::string server = std::string(absl::StripPrefix(name, "copy_from_"));
  const std::string out = g_dir + "/out.raw";
  unlink(out.c_str());
  sync();
  ASSIGN_OR_RETURN(const std::string uri,
                   StartServer(server, g_dir + "/copy.qcow2", true, true));
  std::vector<std::string> argv;
  if (tool == "nbdcopy") {
    argv = {"nbdcopy", uri, out};
  } else {
    argv = {tool == "imgtool" ? g_imgtool : tool, "convert", "-f", "raw",
            "-O", "raw", uri, out};
  }
  if (tool == "nbdcopy") {
    // nbdcopy writes into an existing file (a sparse one of the size).
    const int fd = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(g_copy)) != 0) {
      if (fd >= 0) close(fd);
      KillServer();
      return ErrnoStatus(out, "create", errno);
    }
    close(fd);
  }
  absl::StatusOr<double> t = Timed(argv, g_dir + "/client.out");
  KillServer();
  if (!t.ok()) return t.status();
  Sample s;
  s.seconds = *t;
  s.mib_per_s = static_cast<double>(g_copy_data >> 20) / *t;
  if (check) {
    absl::StatusOr<std::string> cmp =
        RunCommand({"qemu-img", "compare", "-f", "raw", "-F", "qcow2", out,
                    g_dir + "/copy.qcow2"},
                   true);
    if (!cmp.ok()) {
      return absl::InternalError(absl::StrCat(
          "qemu-img compare after ", tool, " ", name, ": ",
          absl::StrReplaceAll(cmp.status().message(), {{"\n", " "}})));
    }
  }
  return s;
}

absl::StatusOr<Sample> RunCase(const Case& c, const std::string& tool,
                               bool check) {
  if (c.part == "server") return RunServerCase(c.name, tool);
  if (c.part == "local") return RunLocalCase(c.name);
  return RunCopyCase(c.name, tool, check);
}

std::vector<Case> AllCases(const std::vector<std::string>& parts) {
  auto want = [&](const char* p) {
    return std::find(parts.begin(), parts.end(), p) != parts.end();
  };
  std::vector<Case> cases;
  const std::vector<std::string> servers(std::begin(kServers), std::end(kServers));
  if (want("server")) {
    for (const char* transport : {"unix", "tcp"}) {
      for (const char* op : {"randread", "randwrite"}) {
        for (int d : kDepths) {
          cases.push_back(
              {"server", absl::StrCat(op, "_d", d, "_", transport), servers});
        }
      }
      cases.push_back({"server", absl::StrCat("seqread_", transport), servers});
    }
  }
  if (want("local")) {
    cases.push_back({"local", "randread_d64", {"imgtool"}});
    cases.push_back({"local", "randwrite_d64", {"imgtool"}});
  }
  if (want("copy")) {
    for (const char* server : kServers) {
      cases.push_back({"copy", absl::StrCat("copy_from_", server),
                       {std::begin(kClients), std::end(kClients)}});
    }
  }
  return cases;
}

// fio.qcow2 and copy.qcow2 in g_dir.
absl::Status MakeFiles(bool server_or_local, bool copy) {
  auto create = [&](const std::string& name, uint64_t size) {
    return RunCommand({"qemu-img", "create", "-q", "-f", "qcow2", "-o",
                       "cluster_size=64k,extended_l2=on,extent_size_hint=1M",
                       g_dir + "/" + name, absl::StrCat(size)})
        .status();
  };
  if (server_or_local) {
    RETURN_IF_ERROR(create("fio.qcow2", g_image));
    RETURN_IF_ERROR(RunCommand({"qemu-img", "bench", "-q", "-f", "qcow2", "-w",
                                "-t", "none", "-d", "16", "-s", "1M", "-S",
                                "1M", "--pattern=170", "-c",
                                absl::StrCat(g_image >> 20),
                                g_dir + "/fio.qcow2"})
                        .status());
  }
  if (copy) {
    RETURN_IF_ERROR(create("copy.qcow2", g_copy));
    RETURN_IF_ERROR(RunCommand({"qemu-img", "bench", "-q", "-f", "qcow2", "-w",
                                "-t", "none", "-d", "16", "-s", "1M", "-S",
                                absl::StrCat(g_copy / (g_copy_data >> 20)),
                                "--pattern=170", "-c",
                                absl::StrCat(g_copy_data >> 20),
                                g_dir + "/copy.qcow2"})
                        .status());
  }
  sync();
  return absl::OkStatus();
}

void MeasureAll(const std::vector<Case>& cases, int reps) {
  std::string last_part;
  for (const Case& c : cases) {
    if (c.part != last_part) {
      // The first run after making the files is the slowest.
      (void)RunCase(c, c.tools[0], false);
      last_part = c.part;
    }
    for (int i = 0; i < reps; ++i) {
      for (size_t t = 0; t < c.tools.size(); ++t) {
        const std::string& tool = c.tools[(t + i) % c.tools.size()];
        Runs& runs = g_runs[c.name + "/" + tool];
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
    for (const std::string& tool : c.tools) {
      const Runs& r = g_runs[c.name + "/" + tool];
      std::fprintf(
          stderr, "nbd_bench: %s %s: %s\n", c.name.c_str(), tool.c_str(),
          r.error.empty()
              ? absl::StrJoin(r.samples, " ",
                              [&](std::string* out, const Sample& s) {
                                if (c.part == "copy") {
                                  absl::StrAppendFormat(out, "%.3fs", s.seconds);
                                } else {
                                  absl::StrAppendFormat(out, "%.0fIOPS", s.iops);
                                }
                              })
                    .c_str()
              : r.error.c_str());
    }
  }
}

void RegisterAll(const std::vector<Case>& cases) {
  for (const Case& c : cases) {
    for (const std::string& tool : c.tools) {
      const std::string key = c.name + "/" + tool;
      const bool copy = c.part == "copy";
      auto next = std::make_shared<size_t>(0);
      benchmark::RegisterBenchmark(
          BenchName("nbd", {{"fs", "xfs"}, {"part", c.part}, {"case", c.name},
                            {"tool", tool}})
              .c_str(),
          [key, next, copy](benchmark::State& state) {
            const Runs& runs = g_runs[key];
            const size_t k = (*next)++;
            if (!runs.error.empty()) {
              state.SkipWithError(runs.error.c_str());
              return;
            }
            if (k >= runs.samples.size()) {
              state.SkipWithError("more repetitions than measured runs");
              return;
            }
            for (auto _ : state) {
              std::this_thread::sleep_for(std::chrono::milliseconds(1));
            }
            const Sample& s = runs.samples[k];
            state.counters["seconds"] = s.seconds;
            state.counters["MiB_per_s"] = s.mib_per_s;
            if (!copy) state.counters["IOPS"] = s.iops;
          })
          ->Unit(benchmark::kMillisecond);
    }
  }
}

}  // namespace
}  // namespace imgtool::benchmarks

int main(int argc, char** argv) {
  using namespace imgtool::benchmarks;
  using imgtool::testing::FsKind;
  const int reps = RepetitionsArg(argc, argv);
  const std::string program = InitSuite(
      argc, argv,
      "nbd_bench: imgtool nbd against qemu-nbd (fio's nbd engine), imgtool's "
      "local IOPS, and copies out of either server with nbdcopy, qemu-img "
      "and imgtool convert (root). Result file contract: "
      "benchmarks/README.md");
  g_image = (Quick() ? 128ull : absl::GetFlag(FLAGS_image_mib)) << 20;
  g_seconds = Quick() ? 1.0 : absl::GetFlag(FLAGS_seconds);
  g_copy = Quick() ? 512ull << 20 : absl::GetFlag(FLAGS_copy_gib) << 30;
  g_copy_data = (Quick() ? 128ull : absl::GetFlag(FLAGS_copy_data_mib)) << 20;
  g_local_count = Quick() ? 20000 : absl::GetFlag(FLAGS_local_count);
  if (g_image == 0 || g_seconds <= 0 || g_copy_data < (1 << 20) ||
      g_copy < g_copy_data || g_local_count == 0) {
    std::fprintf(stderr, "nbd_bench: need --image_mib, --seconds, "
                         "--copy_data_mib, --local_count > 0 and --copy_gib "
                         ">= --copy_data_mib\n");
    return 1;
  }
  const std::vector<std::string> parts =
      absl::StrSplit(absl::GetFlag(FLAGS_parts), ',', absl::SkipEmpty());
  for (const std::string& p : parts) {
    if (p != "server" && p != "local" && p != "copy") {
      std::fprintf(stderr, "nbd_bench: unknown part '%s' (parts: server, "
                           "local, copy)\n", p.c_str());
      return 1;
    }
  }
  g_imgtool = ImgtoolBinary(program, absl::GetFlag(FLAGS_imgtool));
  const std::vector<SuiteMount> mounts = MountAll(
      "nbd_bench", {FsKind::kXfs}, g_image + 2 * g_copy_data + (1ull << 30));
  g_dir = mounts[0].mount->path();
  const bool copy = std::find(parts.begin(), parts.end(), "copy") != parts.end();
  std::fprintf(stderr, "nbd_bench: making the images\n");
  if (absl::Status made = MakeFiles(!copy || parts.size() > 1, copy);
      !made.ok()) {
    std::fprintf(stderr, "nbd_bench: making the files: %s\n",
                 made.ToString().c_str());
    return 1;
  }
  AddSuiteContext("nbd", "xfs");
  const std::vector<Case> cases = AllCases(parts);
  MeasureAll(cases, reps);
  KillServer();
  AddLoadAvgEnd();
  benchmark::AddCustomContext("image_bytes", absl::StrCat(g_image));
  benchmark::AddCustomContext("copy_image_bytes", absl::StrCat(g_copy));
  benchmark::AddCustomContext("copy_data_bytes", absl::StrCat(g_copy_data));
  benchmark::AddCustomContext("fio_seconds", absl::StrCat(g_seconds));
  benchmark::AddCustomContext("local_count", absl::StrCat(g_local_count));
  RegisterAll(cases);
  RunSuite();
  return 0;
}
