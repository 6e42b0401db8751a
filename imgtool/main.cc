// imgtool: a qemu-img look-alike. main only dispatches
// `imgtool <command> args...` to the command's Run function (command.h) and
// prints its error as "imgtool: <message>".
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "imgtool/command.h"

namespace {

using imgtool::cli::CommandFn;

struct Command {
  const char* name;
  CommandFn run;
};

constexpr Command kCommands[] = {
    {"bench", imgtool::cli::RunBench},
    {"check", imgtool::cli::RunCheck},
    {"compare", imgtool::cli::RunCompare},
    {"convert", imgtool::cli::RunConvert},
    {"create", imgtool::cli::RunCreate},
    {"info", imgtool::cli::RunInfo},
    {"io", imgtool::cli::RunIo},
    {"map", imgtool::cli::RunMap},
    {"resize", imgtool::cli::RunResize},
};

constexpr char kVersion[] = "imgtool version 0.1.0\n";

constexpr char kHelp[] =
    "imgtool version 0.1.0 - disk image utility (a qemu-img look-alike)\n"
    "usage: imgtool [-h | --help | --version] COMMAND [COMMAND OPTIONS]\n"
    "\n"
    "Commands:\n"
    "  bench [-c COUNT] [-d DEPTH] [-f FMT] [--flush-interval=N] [-i AIO] "
    "[-n] [--no-drain]\n"
    "        [-o OFFSET] [--pattern=BYTE] [-q] [-s SIZE] [-S STEP] [-t CACHE] "
    "[-w] [-U] FILE\n"
    "  check [-q] [-f FMT] [--output=human|json] [-r leaks|all] [-T CACHE] "
    "[-U] FILE\n"
    "  compare [-f FMT] [-F FMT] [-T CACHE] [-p] [-q] [-s] [-U] FILE1 FILE2\n"
    "  convert [-f FMT] [-O FMT] [-B BACKING [-F FMT]] [-c] [-o OPTIONS] "
    "[-S SPARSE_SIZE]\n"
    "        [-r RATE_LIMIT] [-m N] [-W] [-n]"
    " [--target-is-zero] [-t CACHE] [-T SRC_CACHE] [-p] [-q] [-U] "
    "SRC... DST\n"
    "  create [-q] [-f FMT] [-b BACKING [-F BACKING_FMT]] [-u] [-o OPTIONS] "
    "FILE [SIZE]\n"
    "  info [-f FMT] [--output=human|json] [--backing-chain] [-U] FILE\n"
    "  io [-f FMT] [-r] [-n] [-t CACHE] [-U] -c CMD [-c CMD]... FILE\n"
    "  map [-f FMT] [--output=human|json] [--start-offset=OFFSET] "
    "[--max-length=LENGTH] [-U] FILE\n"
    "  resize [-q] [-f FMT] [--preallocation=MODE] [--shrink] FILE "
    "[+|-]SIZE\n"
    "\n"
    "FMT is raw (default for new images), file or qcow2; images are probed "
    "when -f\nis left out. SIZE and OFFSET take the suffixes k, M, G, T, P, "
    "E\n"
    "(powers of 1024). 'imgtool COMMAND --help' describes a command's "
    "options.\n";

int UsageFailure(const std::string& message) {
  std::cerr << "imgtool: " << message << "\n"
            << "Try 'imgtool --help' for more information\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  // A write or ftruncate past the file size limit (RLIMIT_FSIZE, `ulimit
  // -f`) raises SIGXFSZ, whose default action kills the process with a core
  // dump. Ignored, the syscall fails with EFBIG instead and the command
  // reports "<file>: ...: File too large" like any other write error, as
  // qemu-img does. A disposition is process-wide, so this covers the
  // engine's threads (thread pool, io_uring workers) started later too.
  signal(SIGXFSZ, SIG_IGN);
  // `bazel run //imgtool -- info x.raw` runs in the runfiles tree; file
  // names are meant relative to the user's directory.
  if (const char* dir = std::getenv("BUILD_WORKING_DIRECTORY");
      dir != nullptr && *dir != '\0') {
    if (chdir(dir) != 0) {
      std::cerr << "imgtool: " << dir << ": chdir: " << std::strerror(errno)
                << "\n";
      return 1;
    }
  }
  if (argc < 2) return UsageFailure("Not enough arguments");
  const std::string command = argv[1];
  if (command == "-h" || command == "--help" || command == "help") {
    std::cout << kHelp;
    return 0;
  }
  if (command == "-V" || command == "--version") {
    std::cout << kVersion;
    return 0;
  }
  for (const Command& c : kCommands) {
    if (command != c.name) continue;
    const std::vector<std::string> args(argv + 2, argv + argc);
    const absl::Status status = c.run(args, {std::cout, std::cerr});
    std::cout.flush();
    if (!status.ok() && !status.message().empty()) {
      std::cerr << imgtool::cli::FormatError(status);
    }
    return imgtool::cli::ExitCodeOf(status);
  }
  return UsageFailure("Command not found: " + command);
}
