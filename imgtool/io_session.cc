// imgtool io: the command table, dispatch, help and the session's shared
// helpers (io_session.h).
#include "imgtool/io_session.h"

#include <getopt.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/types/span.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "imgtool/command.h"
#include "imgtool/image.h"
#include "base/size.h"
#include "imgtool/io_help.h"
#include "imgtool/io_output.h"
#include "imgtool/io_session.h"

namespace imgtool::cli::qemu_io {

// qemu-io 7.2's commands that need no running VM, sorted by name as its
// `help` lists them. `args` is null where qemu-io has none (its one-line
// help then has no second space: "close -- ..."; map's is "", hence
// "map  -- ..."). Commands without `needs_image` run with no image open.
constexpr CommandDef kCommands[] = {
    {"abort", nullptr, 0, 0, false, false, nullptr,
     "simulate a program crash using abort(3)", &Session::CmdAbort},
    {"aio_flush", nullptr, 0, 0, false, true, nullptr,
     "completes all outstanding aio requests", &Session::CmdAioFlush},
    {"aio_read", nullptr, 2, -1, false, true,
     "[-Ciqv] [-P pattern] off len [len..]",
     "asynchronously reads a number of bytes", &Session::CmdAioRead},
    {"aio_write", nullptr, 2, -1, true, true,
     "[-Cfiquz] [-P pattern] off len [len..]",
     "asynchronously writes a number of bytes", &Session::CmdAioWrite},
    {"alloc", "a", 1, 2, false, true, "offset [count]",
     "checks if offset is allocated in the file", &Session::CmdAlloc},
    {"break", nullptr, 2, 2, false, true, "event tag",
     "sets a breakpoint on event and tags the stopped request as tag",
     &Session::CmdBreak},
    {"close", "c", 0, 0, false, true, nullptr, "close the current open file",
     &Session::CmdClose},
    {"discard", "d", 2, -1, true, true, "[-Cq] off len",
     "discards a number of bytes at a specified offset", &Session::CmdDiscard},
    {"flush", "f", 0, 0, false, true, nullptr,
     "flush all in-core file state to disk", &Session::CmdFlush},
    {"help", "?", 0, 1, false, false, "[command]",
     "help for one or all commands", &Session::CmdHelp},
    {"info", "i", 0, 0, false, true, nullptr,
     "prints information about the current file", &Session::CmdInfo},
    {"length", "l", 0, 0, false, true, nullptr,
     "gets the length of the current file", &Session::CmdLength},
    {"map", nullptr, 0, 0, false, true, "",
     "prints the allocated areas of a file", &Session::CmdMap},
    {"open", "o", 1, -1, false, false,
     "[-rsCnkU] [-t cache] [-d discard] [-o options] [path]",
     "open the file specified by path", &Session::CmdOpen},
    {"quit", "q", 0, 0, false, false, nullptr, "exit the program",
     &Session::CmdQuit},
    {"read", "r", 2, -1, false, true,
     "[-abCqv] [-P pattern [-s off] [-l len]] off len",
     "reads a number of bytes at a specified offset", &Session::CmdRead},
    {"readv", nullptr, 2, -1, false, true,
     "[-Cqv] [-P pattern] off len [len..]",
     "reads a number of bytes at a specified offset", &Session::CmdReadv},
    {"remove_break", nullptr, 1, 1, false, true, "tag",
     "remove a breakpoint by tag", &Session::CmdRemoveBreak},
    {"reopen", nullptr, 0, -1, false, true, "[(-r|-w)] [-c cache] [-o options]",
     "reopens an image with new options", &Session::CmdReopen},
    {"resume", nullptr, 1, 1, false, true, "tag",
     "resumes the request tagged as tag", &Session::CmdResume},
    {"sigraise", nullptr, 1, 1, false, false, "signal", "raises a signal",
     &Session::CmdSigraise},
    {"sleep", nullptr, 1, 1, false, false, nullptr,
     "waits for the given value in milliseconds", &Session::CmdSleep},
    {"truncate", "t", 1, 3, true, true, "[-m prealloc_mode] off",
     "truncates the current file at the given offset", &Session::CmdTruncate},
    {"wait_break", nullptr, 1, 1, false, true, "tag",
     "waits for the suspension of a request", &Session::CmdWaitBreak},
    {"write", "w", 2, -1, true, true,
     "[-bcCfnquz] [-P pattern | -s source_file] off len",
     "writes a number of bytes at a specified offset", &Session::CmdWrite},
    {"writev", nullptr, 2, -1, true, true,
     "[-Cfq] [-P pattern] off len [len..]",
     "writes a number of bytes at a specified offset", &Session::CmdWritev},
};

// qemu-io's one-line help of `def`, under the name it was called by.
std::string OneLineHelp(absl::string_view name, const CommandDef& def) {
  return def.args == nullptr
             ? absl::StrCat(name, " -- ", def.oneline, "\n")
             : absl::StrCat(name, " ", def.args, " -- ", def.oneline, "\n");
}

const CommandDef* FindCommand(absl::string_view name) {
  for (const CommandDef& def : kCommands) {
    if (name == def.name || (def.alias != nullptr && name == def.alias)) {
      return &def;
    }
  }
  return nullptr;
}

bool Session::Execute(const std::string& line) {
  std::vector<std::string> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
  if (words.empty()) return true;
  const CommandDef* def = FindCommand(words[0]);
  bool ok = false;
  const int argc = static_cast<int>(words.size()) - 1;
  if (def == nullptr) {
    err() << "command \"" << words[0] << "\" not found\n";
  } else if (def->needs_image && image_.node == nullptr) {
    err() << "no file open, try 'help open'\n";
  } else if (argc < def->min_args ||
             (def->max_args >= 0 && argc > def->max_args)) {
    err() << "bad argument count " << argc << " to " << words[0]
          << ", expected ";
    if (def->max_args < 0) {
      err() << "at least " << def->min_args << " arguments\n";
    } else if (def->min_args == def->max_args) {
      err() << def->min_args << " arguments\n";
    } else {
      err() << "between " << def->min_args << " and " << def->max_args
            << " arguments\n";
    }
  } else if (def->writes && image_.node->read_only()) {
    err() << ProgramName() << ": Block node is read-only\n";
  } else {
    ok = (this->*(def->run))(*def, words);
  }
  if (!ok) failed_ = true;
  return !quit_;
}

void Session::Close() {
  if (image_.node == nullptr) return;
  DrainAio();
  // stdout is not flushed here: qemu-io's stays buffered until exit (or a
  // full buffer), so close's error lines on stderr come before a failed
  // command's "write failed" when both go to one file (iotest 026).
  const std::string filename = current_.spec.filename;
  absl::Status st = CloseImage(image_);
  image_ = OpenedImage();
  driver_dropped_ = false;
  corruption_reported_ = false;
  if (!st.ok()) {
    for (absl::string_view line :
         absl::StrSplit(WithoutFilename(st, filename), '\n')) {
      Error(line);
    }
    // QEMU's stderr is unbuffered: these lines go out before any output a
    // pipe still holds.
    err().flush();
  }
}

std::string Session::FailureText(const absl::Status& status) {
  if (absl::IsDataLoss(status) &&
      absl::StartsWith(status.message(), "qcow2: ")) {
    const bool marked =
        absl::StartsWith(status.message(), "qcow2: Marking image as corrupt");
    if (marked) driver_dropped_ = true;
    if (!corruption_reported_) {
      corruption_reported_ = true;
      out().flush();
      err() << status.message() << "\n";
    } else if (marked) {
      return std::strerror(ENOMEDIUM);
    }
  }
  return ErrorText(status);
}

void Session::DrainAio() {
  PrintAioOutput();
  while (aio_in_flight_ > 0) {
    absl::Status st = engine().Poll(/*wait=*/true);
    PrintAioOutput();
    if (!st.ok() || (engine().in_flight() == 0 && aio_in_flight_ > 0)) {
      std::abort();
    }
  }
}

bool Session::GetOptions(const CommandDef& def, std::vector<std::string>& words,
                         const char* optstring,
                         const std::function<bool(int, const char*)>& on_option,
                         std::vector<std::string>* operands) {
  std::vector<char*> argv;
  for (std::string& w : words) argv.push_back(w.data());
  argv.push_back(nullptr);
  const int argc = static_cast<int>(words.size());
  const std::string opts = absl::StrCat(":", optstring);
  optind = 0;
  opterr = 0;
  bool ok = true;
  for (;;) {
    const int c = getopt(argc, argv.data(), opts.c_str());
    if (c == -1) break;
    if (c == '?') {
      err() << words[0] << ": invalid option -- '" << static_cast<char>(optopt)
            << "'\n";
      ok = Usage(def);
      break;
    }
    if (c == ':') {
      err() << words[0] << ": option requires an argument -- '"
            << static_cast<char>(optopt) << "'\n";
      ok = Usage(def);
      break;
    }
    if (!on_option(c, optarg)) {
      ok = false;
      break;
    }
  }
  if (ok) {
    operands->clear();
    for (int i = optind; i < argc; ++i) operands->push_back(argv[i]);
  }
  optind = 0;
  return ok;
}

bool Session::ParseNumber(const std::string& text, uint64_t* value) {
  absl::StatusOr<uint64_t> v = ParseSize(text);
  if (!v.ok()) {
    const bool too_large =
        absl::StrContains(v.status().message(), "Must be between");
    out() << "Parsing error: "
          << (too_large ? "argument too large"
                        : "non-numeric argument, or extraneous/"
                          "unrecognized suffix")
          << " -- " << text << "\n";
    return false;
  }
  absl::string_view t = text;
  while (!t.empty() &&
         (std::isspace(static_cast<unsigned char>(t[0])) || t[0] == '+')) {
    t.remove_prefix(1);
  }
  if ((absl::StartsWith(t, "0x") || absl::StartsWith(t, "0X")) &&
      std::strchr("kKmMgGtTpP", t.back()) != nullptr) {
    PrintWarnings(absl::StrCat("Using a multiplier suffix on hex numbers is "
                               "deprecated: ",
                               text),
                  err());
  }
  *value = *v;
  return true;
}

bool Session::CmdHelp(const CommandDef&, std::vector<std::string>& words) {
  if (words.size() > 1) {
    const CommandDef* def = FindCommand(words[1]);
    if (def == nullptr) {
      out() << "command " << words[1] << " not found\n";
      return false;
    }
    out() << OneLineHelp(words[1], *def) << QemuIoCommandHelp(def->name);
    return true;
  }
  for (const CommandDef& def : kCommands) out() << OneLineHelp(def.name, def);
  out() << "\nUse 'help commandname' for extended help.\n";
  return true;
}

bool Session::CmdQuit(const CommandDef&, std::vector<std::string>&) {
  quit_ = true;
  return true;
}

}  // namespace imgtool::cli::qemu_io
