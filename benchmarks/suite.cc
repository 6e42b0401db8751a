#include "benchmarks/suite.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "base/errno_status.h"
#include "base/status_macros.h"

ABSL_FLAG(bool, quick, false, "smoke-run sizes (about 10 s per suite)");
ABSL_FLAG(std::string, imgtool_commit, "unknown",
          "commit the binaries were built from (context key imgtool_commit)");

extern char** environ;

namespace imgtool::benchmarks {

std::string BenchName(absl::string_view suite,
                      const std::vector<Label>& labels) {
  std::string name(suite);
  for (const Label& l : labels) absl::StrAppend(&name, "/", l.first, ":", l.second);
  return name;
}

std::string ImgtoolBinary(const std::string& program,
                          const std::string& flag_value) {
  std::string path = flag_value;
  if (path.empty()) {
    const char* runfiles = std::getenv("RUNFILES_DIR");
    path = absl::StrCat(runfiles != nullptr ? std::string(runfiles)
                                            : program + ".runfiles",
                        "/imgtool/imgtool/imgtool");
  }
  if (access(path.c_str(), X_OK) != 0) {
    std::fprintf(stderr, "%s: %s: not an executable (--imgtool)\n",
                 program.c_str(), path.c_str());
    std::exit(1);
  }
  return path;
}

std::string InitSuite(int argc, char** argv, absl::string_view usage) {
  // Default --benchmark_min_time before the user's flags, so theirs win: so
  // small that the first iteration always suffices, so each repetition is
  // one iteration (the suites time long phases, and Google Benchmark would
  // otherwise judge subprocess and I/O time by the thread's CPU time).
  std::vector<char*> args;
  args.push_back(argv[0]);
  static char min_time[] = "--benchmark_min_time=0.000001";
  args.push_back(min_time);
  for (int i = 1; i < argc; ++i) args.push_back(argv[i]);
  int n = static_cast<int>(args.size());
  args.push_back(nullptr);
  benchmark::Initialize(&n, args.data());
  absl::SetProgramUsageMessage(usage);
  std::vector<char*> rest = absl::ParseCommandLine(n, args.data());
  if (rest.size() > 1) {
    std::fprintf(stderr, "%s: unexpected argument '%s'\n", argv[0], rest[1]);
    std::exit(1);
  }
  return argv[0];
}

bool Quick() { return absl::GetFlag(FLAGS_quick); }

void AddSuiteContext(absl::string_view suite, absl::string_view filesystems) {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  struct utsname uts = {};
  uname(&uts);
  double load[1] = {0};
  getloadavg(load, 1);
  benchmark::AddCustomContext("suite", std::string(suite));
  benchmark::AddCustomContext("machine", host);
  benchmark::AddCustomContext("kernel", uts.release);
  benchmark::AddCustomContext("filesystems", std::string(filesystems));
  benchmark::AddCustomContext("imgtool_commit",
                              absl::GetFlag(FLAGS_imgtool_commit));
#ifdef NDEBUG
  benchmark::AddCustomContext("build", "opt");
#else
  benchmark::AddCustomContext("build", "fastbuild");
#endif
  benchmark::AddCustomContext("quick", Quick() ? "true" : "false");
  benchmark::AddCustomContext("load_avg_start", absl::StrFormat("%.2f", load[0]));
}

const char* FsName(testing::FsKind kind) {
  switch (kind) {
    case testing::FsKind::kXfs:
      return "xfs";
    case testing::FsKind::kExt4:
      return "ext4";
    case testing::FsKind::kExt4NoExtents:
      return "ext4_noextents";
  }
  return "unknown";
}

std::vector<SuiteMount> MountAll(absl::string_view program,
                                 const std::vector<testing::FsKind>& kinds,
                                 uint64_t size_bytes) {
  std::vector<SuiteMount> mounts;
  for (testing::FsKind kind : kinds) {
    absl::StatusOr<std::unique_ptr<testing::LoopMount>> mount =
        testing::LoopMount::Create(kind, size_bytes);
    if (!mount.ok()) {
      std::fprintf(stderr, "%s: cannot mount %s: %s\n",
                   std::string(program).c_str(), FsName(kind),
                   std::string(mount.status().ToString()).c_str());
      mounts.clear();
      std::exit(1);
    }
    mounts.push_back(SuiteMount{FsName(kind), std::move(*mount)});
  }
  return mounts;
}

absl::StatusOr<uint64_t> AllocatedBytes(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return ErrnoStatus(path, "stat", errno);
  return static_cast<uint64_t>(st.st_blocks) * 512;
}

absl::StatusOr<pid_t> SpawnCommand(const std::vector<std::string>& argv,
                                   const std::string& dir,
                                   const std::string& out_path,
                                   const std::string& err_path) {
  const pid_t pid = fork();
  if (pid < 0) return ErrnoStatus(argv[0], "fork", errno);
  if (pid > 0) return pid;
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const auto open_out = [](const std::string& path) {
    return path.empty() ? open("/dev/null", O_WRONLY)
                        : open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  };
  const int in_fd = open("/dev/null", O_RDONLY);
  const int out_fd = open_out(out_path);
  const int err_fd = open_out(err_path);
  if (in_fd < 0 || out_fd < 0 || err_fd < 0 ||
      (!dir.empty() && chdir(dir.c_str()) != 0)) {
    _exit(126);
  }
  dup2(in_fd, STDIN_FILENO);
  dup2(out_fd, STDOUT_FILENO);
  dup2(err_fd, STDERR_FILENO);
  unsetenv("BUILD_WORKING_DIRECTORY");
  execvp(args[0], args.data());
  _exit(127);
}

absl::StatusOr<CommandRun> RunTimedCommand(const std::vector<std::string>& argv,
                                           const std::string& dir,
                                           const std::string& out_path,
                                           const std::string& err_path) {
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(const pid_t pid,
                   SpawnCommand(argv, dir, out_path, err_path));
  int wstatus = 0;
  CommandRun run;
  while (wait4(pid, &wstatus, 0, &run.usage) < 0 && errno == EINTR) {
  }
  run.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  if (!WIFEXITED(wstatus) || WEXITSTATUS(wstatus) != 0) {
    return absl::InternalError(absl::StrCat(
        "`", absl::StrJoin(argv, " "), "` failed (",
        WIFEXITED(wstatus) ? absl::StrCat("exit ", WEXITSTATUS(wstatus))
                           : absl::StrCat("signal ", WTERMSIG(wstatus)),
        "): ", err_path.empty() ? std::string() : FirstLine(err_path)));
  }
  return run;
}

std::string FirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

absl::StatusOr<double> BenchSeconds(const std::string& out_path) {
  std::ifstream in(out_path);
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view rest = line;
    if (absl::ConsumePrefix(&rest, "Run completed in ") &&
        absl::ConsumeSuffix(&rest, " seconds.")) {
      double t = 0;
      if (absl::SimpleAtod(rest, &t) && t > 0) return t;
    }
  }
  return absl::InternalError(
      absl::StrCat(out_path, ": no 'Run completed in X seconds.' line"));
}

absl::StatusOr<std::string> RunCommand(const std::vector<std::string>& argv,
                                       bool merge_stderr) {
  char out_name[] = "/tmp/imgtool-bench-out-XXXXXX";
  const int out_fd = mkstemp(out_name);
  if (out_fd < 0) return ErrnoStatus(out_name, "mkstemp", errno);
  unlink(out_name);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out_fd, STDOUT_FILENO);
  if (merge_stderr) {
    posix_spawn_file_actions_adddup2(&actions, out_fd, STDERR_FILENO);
  }
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null",
                                   O_RDONLY, 0);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid;
  const int error =
      posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (error != 0) {
    close(out_fd);
    return ErrnoStatus(argv[0], "posix_spawn", error);
  }
  int wstatus = 0;
  while (waitpid(pid, &wstatus, 0) < 0 && errno == EINTR) {
  }
  std::string out;
  char buf[8192];
  ssize_t got;
  while ((got = pread(out_fd, buf, sizeof(buf), out.size())) > 0) {
    out.append(buf, got);
  }
  close(out_fd);
  if (WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) return out;
  return absl::InternalError(absl::StrCat(
      "`", absl::StrJoin(argv, " "), "` failed (",
      WIFEXITED(wstatus) ? absl::StrCat("exit ", WEXITSTATUS(wstatus))
                         : absl::StrCat("signal ", WTERMSIG(wstatus)),
      "): ", absl::StripAsciiWhitespace(out)));
}

void RunSuite() {
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
}

int RepetitionsArg(int argc, char** argv) {
  int reps = 1;
  for (int i = 1; i < argc; ++i) {
    absl::string_view a = argv[i];
    if (absl::ConsumePrefix(&a, "--benchmark_repetitions=")) {
      if (!absl::SimpleAtoi(a, &reps) || reps < 1) reps = 1;
    }
  }
  return reps;
}

absl::Status WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  out.close();
  if (!out) return absl::InternalError(absl::StrCat(path, ": cannot write"));
  return absl::OkStatus();
}

void AddLoadAvgEnd() {
  double load[3] = {0, 0, 0};
  if (getloadavg(load, 3) == 3) {
    benchmark::AddCustomContext(
        "load_avg_end",
        absl::StrFormat("%.2f %.2f %.2f", load[0], load[1], load[2]));
  }
}

void RegisterReplays(absl::string_view suite, absl::string_view fs,
                     const std::vector<std::string>& cases,
                     const std::vector<std::string>& tools, ReplayFn replay) {
  for (const std::string& c : cases) {
    for (const std::string& tool : tools) {
      const std::string key = c + "/" + tool;
      auto next = std::make_shared<size_t>(0);  // the next run to report
      benchmark::RegisterBenchmark(
          BenchName(suite, {{"fs", std::string(fs)}, {"case", c},
                            {"tool", tool}})
              .c_str(),
          [replay, key, next](benchmark::State& state) {
            absl::StatusOr<std::map<std::string, double>> counters =
                replay(key, (*next)++);
            if (!counters.ok()) {
              state.SkipWithError(
                  std::string(counters.status().message()).c_str());
              return;
            }
            for (auto _ : state) {
              // Longer than the suites' --benchmark_min_time (1 us), so
              // that Google Benchmark takes this one iteration and calls
              // once per repetition.
              std::this_thread::sleep_for(std::chrono::milliseconds(1));
            }
            for (const auto& [name, value] : *counters) {
              state.counters[name] = value;
            }
          })
          ->Unit(benchmark::kMillisecond);
    }
  }
}

}  // namespace imgtool::benchmarks
