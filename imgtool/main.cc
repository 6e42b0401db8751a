// imgtool: a qemu-img look-alike. main only dispatches
// `imgtool <command> args...` to the command's Run function (command.h) and
// prints its error as "imgtool: <message>".
//
// Drop-in names: run under the name qemu-img (a link or copy called
// qemu-img, `bazel run //imgtool:install`), the binary is qemu-img: the same
// commands, "qemu-img: <message>" errors, and a --version whose first line
// is "qemu-img version 7.2.0 (imgtool 0.2.0)", which the callers that parse
// it accept (Cinder's `qemu-img version ([0-9.]*)`). Under the name qemu-io
// it is `imgtool io` with qemu-io's name in messages and prompt, under the
// name qemu-nbd `imgtool nbd` (the NBD server) with qemu-nbd's name.
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_replace.h"
#include "imgtool/command.h"

namespace {

using imgtool::cli::CommandFn;

struct Command {
  const char* name;
  CommandFn run;
};

constexpr Command kCommands[] = {
    {"advise", imgtool::cli::RunAdvise},
    {"amend", imgtool::cli::RunAmend},
    {"bench", imgtool::cli::RunBench},
    {"check", imgtool::cli::RunCheck},
    {"commit", imgtool::cli::RunCommit},
    {"bitmap", imgtool::cli::RunBitmap},
    {"compare", imgtool::cli::RunCompare},
    {"convert", imgtool::cli::RunConvert},
    {"create", imgtool::cli::RunCreate},
    {"dd", imgtool::cli::RunDd},
    {"info", imgtool::cli::RunInfo},
    {"io", imgtool::cli::RunIo},
    {"map", imgtool::cli::RunMap},
    {"measure", imgtool::cli::RunMeasure},
    {"nbd", imgtool::cli::RunNbd},
    {"rebase", imgtool::cli::RunRebase},
    {"resize", imgtool::cli::RunResize},
    {"snapshot", imgtool::cli::RunSnapshot},
};

using imgtool::cli::kImgtoolVersion;
using imgtool::cli::kQemuVersion;

// After the version line; "imgtool" becomes the program's name.
constexpr char kHelp[] =
    "usage: imgtool [-h | --help | --version] COMMAND [COMMAND OPTIONS]\n"
    "\n"
    "Commands:\n"
    "  advise [--size SIZE] [--time SECONDS] [--workload random-4k|sequential|"
    "overlay|all]\n"
    "        [--output=human|json] [--imgtool-commit ID] DIR\n"
    "  amend [-f FMT] [-t CACHE] [-p] [-q] [--force] [--image-opts] -o OPTIONS "
    "FILE\n"
    "  bench [-c COUNT] [-d DEPTH] [-f FMT] [--flush-interval=N] [-i AIO] "
    "[-n] [--no-drain]\n"
    "        [-o OFFSET] [--pattern=BYTE] [-q] [-s SIZE] [-S STEP] [-t CACHE] "
    "[-w] [-U] FILE\n"
    "  bitmap (--merge SOURCE | --add | --remove | --clear | --enable | "
    "--disable)...\n"
    "        [-b SOURCE_FILE [-F SOURCE_FMT]] [-g GRANULARITY] [-f FMT] "
    "FILE BITMAP\n"
    "  check [-q] [-f FMT] [--output=human|json] [-r leaks|all] [-T CACHE] "
    "[-U] FILE\n"
    "  commit [--image-opts] [-q] [-f FMT] [-t CACHE] [-b BASE] "
    "[-r RATE_LIMIT] [-d] [-p] FILE\n"
    "  compare [-f FMT] [-F FMT] [-T CACHE] [-p] [-q] [-s] [-U] FILE1 FILE2\n"
    "  convert [-f FMT] [-O FMT] [-B BACKING [-F FMT]] [-c] [-o OPTIONS] "
    "[-S SPARSE_SIZE]\n"
    "        [-r RATE_LIMIT] [-m N] [-W] [-n]"
    " [--target-is-zero] [-t CACHE] [-T SRC_CACHE] [-p] [-q] [-U] "
    "SRC... DST\n"
    "  create [-q] [-f FMT] [-b BACKING [-F BACKING_FMT]] [-u] [-o OPTIONS] "
    "FILE [SIZE]\n"
    "  dd [--image-opts] [-U] [-f FMT] [-O OUTPUT_FMT] [bs=BLOCK_SIZE] "
    "[count=BLOCKS]\n"
    "        [skip=BLOCKS] if=INPUT of=OUTPUT\n"
    "  info [-f FMT] [--output=human|json] [--backing-chain] [-U] FILE\n"
    "  io [-f FMT] [-r] [-n] [-t CACHE] [-U] -c CMD [-c CMD]... FILE\n"
    "  map [-f FMT] [--output=human|json] [--start-offset=OFFSET] "
    "[--max-length=LENGTH] [-U] FILE\n"
    "  measure [--output=human|json] [-O FMT] [-o OPTIONS] [--size SIZE |\n"
    "        [--image-opts] [-f FMT] [-l SNAPSHOT] [-U] FILE]\n"
    "  nbd [-k PATH | -p PORT [-b ADDR]] [-x NAME] [-D TEXT] [-e N] [-t] "
    "[-r] [-f FMT]\n"
    "        [--image-opts] [--cache=MODE] [--aio=MODE] [--discard=MODE] "
    "[--fork]\n"
    "        [--pid-file=PATH] FILE\n"
    "  rebase [-q] [-f FMT] [-t CACHE] [-T SRC_CACHE] [-p] [-u] [-U] "
    "-b BACKING\n"
    "        [-F BACKING_FMT] FILE\n"
    "  resize [-q] [-f FMT] [--preallocation=MODE] [--shrink] FILE "
    "[+|-]SIZE\n"
    "  snapshot [--image-opts] [-U] [-q] [-l | -a SNAPSHOT | -c SNAPSHOT | "
    "-d SNAPSHOT]\n"
    "        FILE\n"
    "\n"
    "FMT is raw (default for new images), file or qcow2; images are probed "
    "when -f\nis left out. SIZE and OFFSET take the suffixes k, M, G, T, P, "
    "E\n"
    "(powers of 1024). 'imgtool COMMAND --help' describes a command's "
    "options.\n";

int UsageFailure(const std::string& message) {
  const std::string& name = imgtool::cli::ProgramName();
  std::cerr << name << ": " << message << "\n"
            << "Try '" << name << " --help' for more information\n";
  return 1;
}

// The --version text (imgtool::cli::VersionText).
void PrintVersion() { std::cout << imgtool::cli::VersionText(); }

// The --help text: the version line, then kHelp under the program's name
// (so `qemu-img --help` lists the commands as "qemu-img convert ...").
void PrintHelp() {
  const std::string& name = imgtool::cli::ProgramName();
  if (name == "imgtool") {
    std::cout << "imgtool version " << kImgtoolVersion
              << " - disk image utility (a qemu-img look-alike)\n"
              << kHelp;
    return;
  }
  std::cout << name << " version " << kQemuVersion << " (imgtool "
            << kImgtoolVersion << ") - disk image utility\n"
            << absl::StrReplaceAll(kHelp, {{"imgtool", name}});
}

// Runs a command and prints its error; the exit code.
int RunCommand(imgtool::cli::CommandFn run,
               const std::vector<std::string>& args) {
  const absl::Status status = run(args, {std::cout, std::cerr});
  if (const std::optional<std::string> text = imgtool::cli::OutputOf(status);
      text.has_value()) {
    std::cout << *text;
  }
  // Untied (KeepStdioBuffering), stdout's buffer is written at exit.
  if (std::cerr.tie() != nullptr) std::cout.flush();
  if (!status.ok() && !status.message().empty() &&
      !imgtool::cli::OutputOf(status).has_value()) {
    std::cerr << imgtool::cli::FormatError(status);
  }
  return imgtool::cli::ExitCodeOf(status);
}

// qemu-img's streams are C stdio's: stdout on a pipe or file is fully
// buffered (written when its buffer fills and at exit), stderr unbuffered,
// so `qemu-img compare A B 2>&1` shows the read error before the "Warning:
// Image size mismatch!" printed earlier (iotest 074). std::cout writes
// through to C's stdout; only the tie, which flushes it before every write
// to std::cerr, is in the way. On a terminal stdout is line-buffered and the
// tie gives the same order. The same for qemu-io (imgtool io): close's
// "Failed to flush ..." lines come before a failed write's line held in
// stdout (iotest 026).
void KeepStdioBuffering() {
  if (isatty(STDOUT_FILENO) == 0) std::cerr.tie(nullptr);
}

// The name the binary was run under, without its directory.
std::string_view BaseName(const char* argv0) {
  std::string_view name = argv0 == nullptr ? "" : argv0;
  const size_t slash = name.rfind('/');
  return slash == std::string_view::npos ? name : name.substr(slash + 1);
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
  const std::string_view invoked_as = BaseName(argv[0]);
  if (invoked_as == "qemu-img" || invoked_as == "qemu-io" ||
      invoked_as == "qemu-nbd") {
    imgtool::cli::SetProgramName(std::string(invoked_as));
  }
  KeepStdioBuffering();
  if (invoked_as == "qemu-io") {
    return RunCommand(imgtool::cli::RunIo,
                      std::vector<std::string>(argv + 1, argv + argc));
  }
  if (invoked_as == "qemu-nbd") {
    return RunCommand(imgtool::cli::RunNbd,
                      std::vector<std::string>(argv + 1, argv + argc));
  }
  if (argc < 2) return UsageFailure("Not enough arguments");
  const std::string command = argv[1];
  if (command == "-h" || command == "--help" || command == "help") {
    PrintHelp();
    return 0;
  }
  if (command == "-V" || command == "--version") {
    PrintVersion();
    return 0;
  }
  for (const Command& c : kCommands) {
    if (command != c.name) continue;
    return RunCommand(c.run, std::vector<std::string>(argv + 2, argv + argc));
  }
  // qemu-img takes no options before the command but -h, -V and -T (trace).
  if (command.size() > 1 && command[0] == '-') {
    return UsageFailure("unrecognized option '" + command + "'");
  }
  return UsageFailure("Command not found: " + command);
}
