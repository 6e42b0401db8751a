// imgtool io [-f FMT] [--image-opts] [-t CACHE] [-n] [-r] [-U] [-d DISCARD]
// [-i AIO] [-c CMD]... [FILE]: the qemu-io look-alike. Opens one image and
// runs each -c command in order (or the lines of standard input if there is
// no -c), printing what qemu-io 7.2 prints: "wrote N/N bytes at offset O"
// plus a timing line, hex dumps, pattern verification failures, allocation
// maps. A failing command prints its error (qemu-io's wording, mostly on
// stdout) and the next command still runs; the exit status is 1 if any
// command failed. aio_* requests stay in flight while later commands run and
// print their completion lines when they finish (at the latest at aio_flush
// or when the image is closed).
//
// Everything goes through the generic io::BlockNode interface and
// io::GetChainStatus, so formats with a backing chain work unchanged.
#include <getopt.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <memory>
#include <optional>
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
#include "base/size.h"
#include "base/status_macros.h"
#include "imgtool/command.h"
#include "imgtool/image.h"
#include "io/block_node.h"
#include "io/chain_status.h"
#include "io/engine.h"
#include "io/task.h"
#include "qcow2/qcow2_node.h"

namespace imgtool::cli {
namespace {

using Clock = std::chrono::steady_clock;

// qemu-io's largest request (INT_MAX rounded down to 512 bytes).
constexpr uint64_t kMaxRequestBytes = 2147483136;
// The byte qemu-io fills write buffers with when no -P is given.
constexpr uint8_t kDefaultPattern = 0xcd;
constexpr uint64_t kSectorSize = 512;

constexpr char kUsage[] =
    "Usage: imgtool io [-f FMT] [--image-opts] [-t CACHE] [-n] [-r] [-U] "
    "[-d DISCARD] [-i AIO] [-c CMD]... [FILE]";

constexpr char kHelp[] =
    "Usage: imgtool io [-f FMT] [--image-opts] [-t CACHE] [-n] [-r] [-U] "
    "[-d DISCARD] [-i AIO] [-c CMD]... [FILE]\n"
    "Runs qemu-io commands on an image (the lines of standard input if no -c "
    "is given).\n"
    "  -c, --cmd CMD          run CMD (may be repeated; run in order)\n"
    "  -f, --format FMT       image format (raw, file, qcow2); probed if "
    "absent\n"
    "  -r, --read-only        open the image read-only\n"
    "  -n, --nocache          short for -t none\n"
    "  -t, --cache MODE       none, writeback, writethrough (default), "
    "directsync, unsafe\n"
    "  -d, --discard MODE     unmap (default) or ignore\n"
    "  -i, --aio MODE         threads, native or io_uring\n"
    "  -U, --force-share      open without taking the image locks (needs -r)\n"
    "\n"
    "Run 'imgtool io -c help' for the list of commands.\n";

// qemu-io 7.2's own help text (`qemu-io -h`), printed under that name.
constexpr char kQemuIoHelp[] =
    "Usage: qemu-io [OPTIONS]... [-c STRING]... [file]\n"
    "QEMU Disk exerciser\n"
    "\n"
    "  --object OBJECTDEF   define an object such as 'secret' for\n"
    "                       passwords and/or encryption keys\n"
    "  --image-opts         treat file as option string\n"
    "  -c, --cmd STRING     execute command with its arguments\n"
    "                       from the given string\n"
    "  -f, --format FMT     specifies the block driver to use\n"
    "  -r, --read-only      export read-only\n"
    "  -s, --snapshot       use snapshot file\n"
    "  -n, --nocache        disable host cache, short for -t none\n"
    "  -C, --copy-on-read   enable copy-on-read\n"
    "  -m, --misalign       misalign allocations for O_DIRECT\n"
    "  -k, --native-aio     use kernel AIO implementation\n"
    "                       (Linux only, prefer use of -i)\n"
    "  -i, --aio=MODE       use AIO mode (threads, native or io_uring)\n"
    "  -t, --cache=MODE     use the given cache mode for the image\n"
    "  -d, --discard=MODE   use the given discard mode for the image\n"
    "  -T, --trace [[enable=]<pattern>][,events=<file>][,file=<file>]\n"
    "                       specify tracing options\n"
    "                       see qemu-img(1) man page for full description\n"
    "  -U, --force-share    force shared permissions\n"
    "  -h, --help           display this help and exit\n"
    "  -V, --version        output version information and exit\n"
    "\n"
    "See 'qemu-io -c help' for information on available commands.\n"
    "\n"
    "See <https://qemu.org/contribute/report-a-bug> for how to report bugs.\n"
    "More information on the QEMU project at <https://qemu.org>.\n";

// Under the name qemu-io, a command-line error is reported as qemu-io
// reports it: glibc's getopt message, then the whole help on stdout (exit
// 1, nothing more on stderr). `status` is ParseOptions' UsageError.
absl::Status QemuIoUsageFailure(const absl::Status& status,
                                std::ostream& out, std::ostream& err) {
  const absl::string_view message = status.message();
  std::string text;
  auto quoted = [&](absl::string_view prefix) -> std::string {
    absl::string_view word = message.substr(prefix.size());
    if (!word.empty() && word.back() == '\'') word.remove_suffix(1);
    return std::string(word);
  };
  if (absl::StartsWith(message, "unrecognized option '")) {
    const std::string word = quoted("unrecognized option '");
    text = absl::StartsWith(word, "--")
               ? absl::StrCat("unrecognized option '", word, "'")
               : absl::StrCat("invalid option -- '", word.substr(1), "'");
  } else if (absl::StartsWith(message, "missing argument for option '")) {
    const std::string word = quoted("missing argument for option '");
    text = absl::StartsWith(word, "--")
               ? absl::StrCat("option '", word, "' requires an argument")
               : absl::StrCat("option requires an argument -- '",
                              word.substr(1), "'");
  }
  if (!text.empty()) err << ProgramName() << ": " << text << "\n";
  out << kQemuIoHelp;
  return absl::InvalidArgumentError("");
}

enum LongOption { kImageOpts = 256, kObject };

const struct option kLongOptions[] = {
    {"help", no_argument, nullptr, 'h'},
    {"cmd", required_argument, nullptr, 'c'},
    {"format", required_argument, nullptr, 'f'},
    {"read-only", no_argument, nullptr, 'r'},
    {"nocache", no_argument, nullptr, 'n'},
    {"cache", required_argument, nullptr, 't'},
    {"discard", required_argument, nullptr, 'd'},
    {"aio", required_argument, nullptr, 'i'},
    {"native-aio", no_argument, nullptr, 'k'},
    {"misalign", no_argument, nullptr, 'm'},
    {"force-share", no_argument, nullptr, 'U'},
    {"snapshot", no_argument, nullptr, 's'},
    {"copy-on-read", no_argument, nullptr, 'C'},
    {"image-opts", no_argument, nullptr, kImageOpts},
    {"object", required_argument, nullptr, kObject},
    {nullptr, 0, nullptr, 0},
};

// ---------------------------------------------------------------------------
// Output formats (qemu-io's).

// A byte count or rate as qemu-io prints it: binary units with three
// decimals, ".000" left out; below 1 KiB plain "%f bytes" with ".000000"
// left out: 1536 -> "1.500 KiB", 4096 -> "4 KiB", 1 -> "1 bytes".
std::string HumanBytes(double value) {
  static constexpr struct {
    double size;
    const char* unit;
  } kUnits[] = {
      {1152921504606846976.0, "EiB"},
      {1125899906842624.0, "PiB"},
      {1099511627776.0, "TiB"},
      {1073741824.0, "GiB"},
      {1048576.0, "MiB"},
      {1024.0, "KiB"},
  };
  for (const auto& u : kUnits) {
    if (value >= u.size) {
      std::string number = absl::StrFormat("%.3f", value / u.size);
      if (absl::EndsWith(number, ".000")) number.resize(number.size() - 4);
      return absl::StrCat(number, " ", u.unit);
    }
  }
  std::string number = absl::StrFormat("%f", value);
  if (absl::EndsWith(number, ".000000")) number.resize(number.size() - 7);
  return absl::StrCat(number, " bytes");
}

// Elapsed time: "00.01 sec" under a second, else "H:MM:SS.cc"; the machine
// format (-C) always uses the second form.
std::string ElapsedText(double seconds, bool machine) {
  const uint64_t centis = static_cast<uint64_t>(seconds * 100);
  const uint64_t secs = centis / 100;
  const unsigned cs = static_cast<unsigned>(centis % 100);
  if (!machine && secs == 0) return absl::StrFormat("00.%02u sec", cs);
  return absl::StrFormat("%u:%02u:%02u.%02u", secs / 3600, (secs / 60) % 60,
                         secs % 60, cs);
}

double Seconds(Clock::duration d) {
  double s = std::chrono::duration<double>(d).count();
  return s > 1e-9 ? s : 1e-9;
}

// The two report lines of a finished request, or the one -C line
// (bytes,ops,time,bytes/sec,ops/sec).
std::string Report(absl::string_view op, double seconds, uint64_t offset,
                   uint64_t count, uint64_t total, int ops, bool machine) {
  if (machine) {
    return absl::StrFormat("%d,%d,%s,%.3f,%.3f\n", total, ops,
                           ElapsedText(seconds, true), total / seconds,
                           ops / seconds);
  }
  return absl::StrFormat(
      "%s %d/%d bytes at offset %d\n%s, %d ops; %s (%s/sec and %.4f "
      "ops/sec)\n",
      op, total, count, offset, HumanBytes(static_cast<double>(total)), ops,
      ElapsedText(seconds, false), HumanBytes(total / seconds), ops / seconds);
}

// 16 bytes a line: "%08x:  " offset, "xx " per byte, a space, and the bytes
// as text (letters and digits only, '.' for the rest).
std::string HexDump(absl::Span<const uint8_t> data, uint64_t offset) {
  std::string text;
  for (size_t i = 0; i < data.size(); i += 16) {
    const size_t n = std::min<size_t>(16, data.size() - i);
    absl::StrAppendFormat(&text, "%08x:  ", offset + i);
    for (size_t j = 0; j < n; ++j) {
      absl::StrAppendFormat(&text, "%02x ", data[i + j]);
    }
    text += ' ';
    for (size_t j = 0; j < n; ++j) {
      const unsigned char c = data[i + j];
      text += (c < 128 && std::isalnum(c)) ? static_cast<char>(c) : '.';
    }
    text += '\n';
  }
  return text;
}

// The errno a failed request reports ("write failed: <strerror>").
int ErrnoOf(const absl::Status& status) {
  if (const int e = StatusErrno(status); e != 0) return e;
  switch (status.code()) {
    case absl::StatusCode::kUnimplemented:
      return ENOTSUP;
    case absl::StatusCode::kInvalidArgument:
      return EINVAL;
    case absl::StatusCode::kFailedPrecondition:
      return EPERM;
    case absl::StatusCode::kPermissionDenied:
      return EACCES;
    case absl::StatusCode::kNotFound:
      return ENOENT;
    case absl::StatusCode::kResourceExhausted:
      return ENOSPC;
    case absl::StatusCode::kUnavailable:
      return EAGAIN;
    default:
      return EIO;
  }
}

std::string ErrorText(const absl::Status& status) {
  return std::strerror(ErrnoOf(status));
}

// A node's message without the file name in front (qemu-io's errors do not
// name the image): "x.raw: Unsupported ..." -> "Unsupported ...".
std::string WithoutFilename(const absl::Status& status,
                            const std::string& filename) {
  absl::string_view message = status.message();
  absl::ConsumePrefix(&message, absl::StrCat(filename, ": "));
  return std::string(message);
}

bool AllBytesAre(absl::Span<const uint8_t> data, uint8_t byte) {
  return std::all_of(data.begin(), data.end(),
                     [byte](uint8_t b) { return b == byte; });
}

// ---------------------------------------------------------------------------
// Requests.

struct Request {
  enum Kind { kRead, kWrite, kWriteZeroes, kDiscard, kWriteCompressed };
  Kind kind = kRead;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  absl::Span<uint8_t> buffer;    // kRead/kWrite: `bytes` long
  bool may_unmap = false;        // kWriteZeroes (-u)
  bool no_fallback = false;      // kWriteZeroes (-n)
  bool fua = false;              // kWrite/kWriteZeroes (-f): flush afterwards
  bool discard_ignored = false;  // kDiscard with -d ignore
};

// Runs one request against `node` the way qemu's BlockBackend checks it:
// a range past `image_length` (the 512-rounded length) fails with EIO.
io::Task<absl::Status> RunRequest(io::BlockNode* node, uint64_t image_length,
                                  Request r) {
  if (r.offset > image_length || image_length - r.offset < r.bytes) {
    co_return ErrnoStatus(node->filename(), "request", EIO);
  }
  absl::Status status;
  switch (r.kind) {
    case Request::kRead:
      co_return co_await node->Read(r.offset, r.buffer);
    case Request::kWrite:
      status = co_await node->Write(r.offset, r.buffer);
      break;
    case Request::kWriteCompressed: {
      // write -c: only qcow2 compresses (qemu-io: ENOTSUP elsewhere).
      auto* qcow2 = dynamic_cast<qcow2::Qcow2Node*>(node);
      if (qcow2 == nullptr) co_return ErrnoStatus("", "write", ENOTSUP);
      status = co_await qcow2->WriteCompressed(r.offset, r.buffer);
      if (absl::IsFailedPrecondition(status)) {
        // A cluster allocated already: QEMU's EIO.
        status = ErrnoStatus(node->filename(), status.message(), EIO);
      }
      break;
    }
    case Request::kWriteZeroes:
      status = co_await node->WriteZeroes(
          r.offset, r.bytes,
          io::WriteZeroesFlags{.may_unmap = r.may_unmap,
                               .no_fallback = r.no_fallback});
      break;
    case Request::kDiscard:
      if (r.discard_ignored) co_return absl::OkStatus();
      status = co_await node->Discard(r.offset, r.bytes);
      // Discard is advisory: a node that cannot discard has done its job.
      if (absl::IsUnimplemented(status)) status = absl::OkStatus();
      co_return status;
  }
  if (status.ok() && r.fua) status = co_await node->Flush();
  co_return status;
}

// An aio_read/aio_write in flight: owns its buffer until it completes.
struct AioRequest {
  Request request;
  std::vector<uint8_t> buffer;
  bool quiet = false;
  bool machine = false;
  bool verbose = false;
  std::optional<uint8_t> pattern;  // aio_read -P
  Clock::time_point start;
};

// The options of the request commands (read, write, readv, writev, aio_read,
// aio_write, discard); each command's optstring says which it takes.
struct IoOptions {
  bool machine = false;      // -C
  bool quiet = false;        // -q
  bool verbose = false;      // -v
  bool vmstate = false;      // -b
  bool compressed = false;   // -c
  bool fua = false;          // -f
  bool invalid = false;      // -i
  bool no_fallback = false;  // -n
  bool unmap = false;        // -u
  bool zero = false;         // -z
  std::optional<uint8_t> pattern;          // -P
  std::optional<uint64_t> pattern_offset;  // read -s
  std::optional<uint64_t> pattern_count;   // read -l
  std::optional<std::string> source_file;  // write -s
};

// ---------------------------------------------------------------------------
// Commands.

class Session;

struct CommandDef {
  const char* name;
  const char* alias;  // or nullptr
  int min_args;
  int max_args;  // -1: no limit
  bool writes;   // refused on a read-only image
  bool needs_image;
  const char* args;     // synopsis after the name
  const char* oneline;  // what it does
  bool (Session::*run)(const CommandDef& def, std::vector<std::string>& words);
};

class Session {
 public:
  explicit Session(Streams streams) : streams_(streams) {}

  absl::Status Open(const ImageSpec& spec, bool discard_ignored) {
    discard_ignored_ = discard_ignored;
    absl::StatusOr<OpenedImage> image = OpenImage(spec, streams_.err);
    if (!image.ok()) {
      // qemu-io words it "can't open device F: <cause>" ("can't open:
      // <cause>" for --image-opts), without the "Could not open 'F': "
      // that qemu-img puts before the cause.
      absl::string_view cause = image.status().message();
      absl::ConsumePrefix(
          &cause, absl::StrCat("Could not open '", spec.filename, "': "));
      return absl::Status(
          image.status().code(),
          spec.image_opts
              ? absl::StrCat("can't open: ", cause)
              : absl::StrCat("can't open device ", spec.filename, ": ",
                             cause));
    }
    image_ = *std::move(image);
    return absl::OkStatus();
  }

  // Runs one command line. Returns false once `quit` ran.
  bool Execute(const std::string& line);

  // Waits for the aio requests, prints their completions and closes the
  // image; returns the close error.
  absl::Status Close() {
    if (image_.node == nullptr) return absl::OkStatus();
    DrainAio();
    streams_.out.flush();
    return CloseImage(image_);
  }

  bool failed() const { return failed_; }

  // --- commands (each returns false if it failed; kCommands lists them).

  bool CmdRead(const CommandDef& def, std::vector<std::string>& words);
  bool CmdWrite(const CommandDef& def, std::vector<std::string>& words);
  bool CmdReadv(const CommandDef& def, std::vector<std::string>& words);
  bool CmdWritev(const CommandDef& def, std::vector<std::string>& words);
  bool CmdAioRead(const CommandDef& def, std::vector<std::string>& words);
  bool CmdAioWrite(const CommandDef& def, std::vector<std::string>& words);
  bool CmdAioFlush(const CommandDef& def, std::vector<std::string>& words);
  bool CmdDiscard(const CommandDef& def, std::vector<std::string>& words);
  bool CmdFlush(const CommandDef& def, std::vector<std::string>& words);
  bool CmdTruncate(const CommandDef& def, std::vector<std::string>& words);
  bool CmdLength(const CommandDef& def, std::vector<std::string>& words);
  bool CmdInfo(const CommandDef& def, std::vector<std::string>& words);
  bool CmdMap(const CommandDef& def, std::vector<std::string>& words);
  bool CmdAlloc(const CommandDef& def, std::vector<std::string>& words);
  bool CmdSleep(const CommandDef& def, std::vector<std::string>& words);
  bool CmdHelp(const CommandDef& def, std::vector<std::string>& words);
  bool CmdQuit(const CommandDef& def, std::vector<std::string>& words);

 private:
  std::ostream& out() { return streams_.out; }
  std::ostream& err() { return streams_.err; }
  io::BlockNode& node() { return *image_.node; }
  io::Engine& engine() { return *image_.engine; }
  uint64_t ImageLength() const { return VirtualSize(image_); }

  // Drives the engine until `task` is done, printing the completions of aio
  // requests as they finish (qemu-io's event loop runs while it waits).
  template <typename T>
  T Wait(io::Task<T> task) {
    std::optional<T> result;
    io::Spawn(std::move(task),
              [&result](T v) { result.emplace(std::move(v)); });
    PrintAioOutput();
    while (!result.has_value()) {
      absl::Status st = engine().Poll(/*wait=*/true);
      PrintAioOutput();
      if (!st.ok() || (engine().in_flight() == 0 && !result.has_value())) {
        std::abort();  // An engine failure or a task waiting on nothing.
      }
    }
    return std::move(*result);
  }

  // The errno text of a failed request ("read failed: <text>"). A qcow2
  // corruption event in it ("qcow2: Marking image as corrupt: ...") goes to
  // stderr first, once per session, as qemu-io shows QEMU's report of it
  // (later events are suppressed there too). Once an image opened
  // read-write was marked corrupt, QEMU has dropped its driver and later
  // requests fail with ENOMEDIUM.
  std::string FailureText(const absl::Status& status) {
    if (absl::IsDataLoss(status) && absl::StartsWith(status.message(), "qcow2: ")) {
      const bool marked = absl::StartsWith(status.message(), "qcow2: Marking image as corrupt");
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

  void PrintAioOutput() {
    if (aio_output_.empty()) return;
    out() << aio_output_;
    aio_output_.clear();
  }

  void DrainAio() {
    PrintAioOutput();
    while (aio_in_flight_ > 0) {
      absl::Status st = engine().Poll(/*wait=*/true);
      PrintAioOutput();
      if (!st.ok() || (engine().in_flight() == 0 && aio_in_flight_ > 0)) {
        std::abort();
      }
    }
  }

  // --- argument helpers (each prints qemu-io's message and returns false).

  bool Usage(const CommandDef& def) {
    out() << def.name << " " << def.args << " -- " << def.oneline << "\n";
    return false;
  }

  // getopt over words[1..] with words[0] as the program name, permuting
  // like glibc; prints glibc's messages and the usage line on errors.
  bool GetOptions(const CommandDef& def, std::vector<std::string>& words,
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
        err() << words[0] << ": invalid option -- '"
              << static_cast<char>(optopt) << "'\n";
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

  // GetOptions for the request commands: `optstring` is a subset of
  // "bcCfilnpP:qs:uvz" (-p is accepted and ignored, as by qemu-io); -s is the
  // pattern verification offset where `optstring` has -l, else the source
  // file. Values are checked as they come, so the first bad one is reported.
  bool GetIoOptions(const CommandDef& def, std::vector<std::string>& words,
                    const char* optstring, IoOptions* opts,
                    std::vector<std::string>* operands) {
    const bool s_is_offset = std::strchr(optstring, 'l') != nullptr;
    return GetOptions(
        def, words, optstring,
        [&](int c, const char* arg) {
          uint64_t v = 0;
          uint8_t p = 0;
          switch (c) {
            case 'b':
              opts->vmstate = true;
              break;
            case 'c':
              opts->compressed = true;
              break;
            case 'C':
              opts->machine = true;
              break;
            case 'f':
              opts->fua = true;
              break;
            case 'i':
              opts->invalid = true;
              break;
            case 'l':
              if (!ParseNumber(arg, &v)) return false;
              opts->pattern_count = v;
              break;
            case 'n':
              opts->no_fallback = true;
              break;
            case 'p':
              break;  // ignored, as by qemu-io
            case 'P':
              if (!ParsePattern(arg, &p)) return false;
              opts->pattern = p;
              break;
            case 'q':
              opts->quiet = true;
              break;
            case 's':
              if (s_is_offset) {
                if (!ParseNumber(arg, &v)) return false;
                opts->pattern_offset = v;
              } else {
                opts->source_file = arg;
              }
              break;
            case 'u':
              opts->unmap = true;
              break;
            case 'v':
              opts->verbose = true;
              break;
            case 'z':
              opts->zero = true;
              break;
          }
          return true;
        },
        operands);
  }

  // Runs `r`, setting *seconds to how long it took; prints "<op> failed:
  // <error>" and returns false if it failed.
  bool RunTimed(const Request& r, absl::string_view op, double* seconds) {
    if (driver_dropped_) {
      out() << op << " failed: " << std::strerror(ENOMEDIUM) << "\n";
      return false;
    }
    const Clock::time_point start = Clock::now();
    absl::Status st = Wait(RunRequest(&node(), ImageLength(), r));
    *seconds = Seconds(Clock::now() - start);
    if (!st.ok()) {
      const std::string why = FailureText(st);
      out() << op << " failed: " << why << "\n";
      return false;
    }
    return true;
  }

  // What read and readv (`op`, named in the failure message) do once their
  // arguments are checked: reads `count` bytes at `offset`; with -P, checks
  // that bytes [check_offset, check_offset + check_count) of them all hold
  // the pattern (false and a message if not); then, unless -q, prints the
  // hex dump (-v) and the report.
  bool ReadAndCheck(const IoOptions& o, absl::string_view op, uint64_t offset,
                    uint64_t count, uint64_t check_offset,
                    uint64_t check_count) {
    std::vector<uint8_t> data(count);
    const Request r{.kind = Request::kRead,
                    .offset = offset,
                    .bytes = count,
                    .buffer = absl::MakeSpan(data)};
    double seconds = 0;
    if (!RunTimed(r, op, &seconds)) return false;
    const absl::Span<const uint8_t> buffer = data;
    bool ok = true;
    if (o.pattern.has_value() &&
        !AllBytesAre(buffer.subspan(check_offset, check_count), *o.pattern)) {
      out() << "Pattern verification failed at offset "
            << offset + check_offset << ", " << check_count << " bytes\n";
      ok = false;
    }
    if (o.quiet) return ok;
    if (o.verbose) out() << HexDump(buffer, offset);
    out() << Report("read", seconds, offset, buffer.size(), buffer.size(), 1,
                    o.machine);
    return ok;
  }

  // A number as qemu-io's cvtnum reads it (base/size.h grammar).
  bool ParseNumber(const std::string& text, uint64_t* value) {
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

  bool ParsePattern(const char* text, uint8_t* pattern) {
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(text, &end, 0);
    if (*text == '\0' || *end != '\0' || errno != 0 || v < 0 || v > 0xff) {
      out() << text << " is not a valid pattern byte\n";
      return false;
    }
    *pattern = static_cast<uint8_t>(v);
    return true;
  }

  // The lengths of a vectored command (readv, writev, aio_*): each at most
  // kMaxRequestBytes, and so is their sum.
  bool ParseLengths(absl::Span<const std::string> texts, uint64_t* total) {
    *total = 0;
    for (const std::string& t : texts) {
      uint64_t len = 0;
      if (!ParseNumber(t, &len)) return false;
      if (len > kMaxRequestBytes) {
        out() << "Argument '" << t << "' exceeds maximum size "
              << kMaxRequestBytes << "\n";
        return false;
      }
      if (*total > kMaxRequestBytes - len) {
        out() << "The total number of bytes exceed the maximum size "
              << kMaxRequestBytes << "\n";
        return false;
      }
      *total += len;
    }
    return true;
  }

  // -b / -c requests work on whole sectors.
  bool CheckSectorAligned(uint64_t offset, uint64_t count) {
    if (offset % kSectorSize != 0) {
      out() << offset << " is not a sector-aligned value for 'offset'\n";
      return false;
    }
    if (count % kSectorSize != 0) {
      out() << count << " is not a sector-aligned value for 'count'\n";
      return false;
    }
    return true;
  }

  // Fills `buffer` by repeating the bytes of the file `path` (write -s).
  bool FillFromFile(const std::string& path, std::vector<uint8_t>& buffer) {
    std::ifstream in(path, std::ios::binary);
    if (!in) {
      err() << path << ": " << std::strerror(errno) << "\n";
      return false;
    }
    std::vector<uint8_t> content;
    content.reserve(buffer.size());
    char chunk[65536];
    while (content.size() < buffer.size() &&
           in.read(chunk, sizeof(chunk)).gcount() > 0) {
      content.insert(content.end(), chunk, chunk + in.gcount());
    }
    if (in.bad()) {
      err() << path << ": " << std::strerror(EISDIR) << "\n";
      return false;
    }
    if (content.empty()) {
      err() << path << ": file is empty\n";
      return false;
    }
    for (size_t i = 0; i < buffer.size(); ++i) {
      buffer[i] = content[i % content.size()];
    }
    return true;
  }

  // The operands of readv, writev, aio_read and aio_write: an offset, then
  // lengths summed into `count`. False after a message if one is bad.
  bool ParseOffsetAndLengths(const std::vector<std::string>& operands,
                             uint64_t* offset, uint64_t* count) {
    return ParseNumber(operands[0], offset) &&
           ParseLengths(absl::MakeConstSpan(operands).subspan(1), count);
  }

  // -n and -u only go with -z (write, aio_write). False after a message.
  bool CheckZeroOnlyOptions(const IoOptions& o) {
    if (o.no_fallback && !o.zero) {
      out() << "-n requires -z to be specified\n";
      return false;
    }
    if (o.unmap && !o.zero) {
      out() << "-u requires -z to be specified\n";
      return false;
    }
    return true;
  }

  // The request of write and aio_write: with -z a write zeroes (-u, -n),
  // else a write of `buffer` filled with `count` bytes of the -P pattern
  // (or of the -s file's bytes). False after a message if -s's file fails.
  bool MakeWriteRequest(const IoOptions& o, uint64_t offset, uint64_t count,
                        std::vector<uint8_t>& buffer, Request* r) {
    *r = Request{.kind = Request::kWrite,
                 .offset = offset,
                 .bytes = count,
                 .fua = o.fua};
    if (o.zero) {
      r->kind = Request::kWriteZeroes;
      r->may_unmap = o.unmap;
      r->no_fallback = o.no_fallback;
      return true;
    }
    buffer.assign(count, o.pattern.value_or(kDefaultPattern));
    if (o.source_file.has_value() && !FillFromFile(*o.source_file, buffer)) {
      return false;
    }
    r->buffer = absl::MakeSpan(buffer);
    return true;
  }

  // Whether [offset, offset + n) of the top node is allocated there (not in
  // a backing file), with n in 1..max_bytes. The bytes between the node's
  // end and the 512-rounded image length count as allocated, as for raw.
  absl::StatusOr<std::pair<bool, uint64_t>> IsAllocated(uint64_t offset,
                                                        uint64_t max_bytes) {
    const uint64_t node_size = node().size();
    if (offset >= node_size) return std::make_pair(true, max_bytes);
    ASSIGN_OR_RETURN(
        io::ChainStatus cs,
        Wait(io::GetChainStatus(node(), offset,
                                std::min(max_bytes, node_size - offset))));
    return std::make_pair(cs.depth == 0 && cs.present,
                          std::max<uint64_t>(cs.status.length, 1));
  }

  void SubmitAio(std::shared_ptr<AioRequest> aio, const char* op);

  Streams streams_;
  OpenedImage image_;
  bool discard_ignored_ = false;
  bool failed_ = false;
  bool quit_ = false;
  bool corruption_reported_ = false;  // a qcow2 corruption event was printed
  // The image was marked corrupt: QEMU has no driver for it any more
  // (ENOMEDIUM for every request, length and info).
  bool driver_dropped_ = false;
  int aio_in_flight_ = 0;
  std::string aio_output_;  // completion lines not printed yet
};

constexpr CommandDef kCommands[] = {
    {"aio_flush", nullptr, 0, 0, false, true, "",
     "completes all outstanding aio requests", &Session::CmdAioFlush},
    {"aio_read", nullptr, 2, -1, false, true,
     "[-Ciqv] [-P pattern] off len [len..]",
     "asynchronously reads a number of bytes", &Session::CmdAioRead},
    {"aio_write", nullptr, 2, -1, true, true,
     "[-Cfiquz] [-P pattern] off len [len..]",
     "asynchronously writes a number of bytes", &Session::CmdAioWrite},
    {"alloc", "a", 1, 2, false, true, "offset [count]",
     "checks if offset is allocated in the file", &Session::CmdAlloc},
    {"discard", "d", 2, -1, true, true, "[-Cq] off len",
     "discards a number of bytes at a specified offset", &Session::CmdDiscard},
    {"flush", "f", 0, 0, false, true, "",
     "flush all in-core file state to disk", &Session::CmdFlush},
    {"help", "?", 0, 1, false, false, "[command]",
     "help for one or all commands", &Session::CmdHelp},
    {"info", "i", 0, 0, false, true, "",
     "prints information about the current file", &Session::CmdInfo},
    {"length", "l", 0, 0, false, true, "",
     "gets the length of the current file", &Session::CmdLength},
    {"map", nullptr, 0, 0, false, true, "",
     "prints the allocated areas of a file", &Session::CmdMap},
    {"quit", "q", 0, 0, false, false, "", "exit the program",
     &Session::CmdQuit},
    {"read", "r", 2, -1, false, true,
     "[-abCqv] [-P pattern [-s off] [-l len]] off len",
     "reads a number of bytes at a specified offset", &Session::CmdRead},
    {"readv", nullptr, 2, -1, false, true,
     "[-Cqv] [-P pattern] off len [len..]",
     "reads a number of bytes at a specified offset", &Session::CmdReadv},
    {"sleep", nullptr, 1, 1, false, false, "",
     "waits for the given value in milliseconds", &Session::CmdSleep},
    {"truncate", "t", 1, 3, true, true, "[-m prealloc_mode] off",
     "truncates the current file at the given offset", &Session::CmdTruncate},
    {"write", "w", 2, -1, true, true,
     "[-bcCfnquz] [-P pattern | -s source_file] off len",
     "writes a number of bytes at a specified offset", &Session::CmdWrite},
    {"writev", nullptr, 2, -1, true, true,
     "[-Cfq] [-P pattern] off len [len..]",
     "writes a number of bytes at a specified offset", &Session::CmdWritev},
};

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
  } else if (def->needs_image && image_.node == nullptr) {
    err() << "no file open, try 'help open'\n";
  } else if (def->writes && image_.node->read_only()) {
    err() << ProgramName() << ": Block node is read-only\n";
  } else {
    ok = (this->*(def->run))(*def, words);
  }
  if (!ok) failed_ = true;
  return !quit_;
}

bool Session::CmdRead(const CommandDef& def, std::vector<std::string>& words) {
  IoOptions o;
  std::vector<std::string> operands;
  if (!GetIoOptions(def, words, "bCl:pP:qs:v", &o, &operands)) return false;
  if (operands.size() != 2) return Usage(def);
  if (!o.pattern.has_value() &&
      (o.pattern_offset.has_value() || o.pattern_count.has_value())) {
    return Usage(def);
  }
  uint64_t offset = 0, count = 0;
  if (!ParseNumber(operands[0], &offset) || !ParseNumber(operands[1], &count)) {
    return false;
  }
  if (count > kMaxRequestBytes) {
    out() << "length cannot exceed " << kMaxRequestBytes << ", given "
          << operands[1] << "\n";
    return false;
  }
  if (o.vmstate && !CheckSectorAligned(offset, count)) return false;
  const uint64_t check_offset = o.pattern_offset.value_or(0);
  uint64_t check_count = 0;
  if (o.pattern.has_value()) {
    if (o.pattern_count.has_value()) {
      check_count = *o.pattern_count;
    } else if (check_offset <= count) {
      check_count = count - check_offset;
    }
    if (check_offset > count || check_count > count - check_offset) {
      out() << "pattern verification range exceeds end of read data\n";
      return false;
    }
  }
  if (o.vmstate) {
    // The VM state area is not part of the io::BlockNode interface.
    out() << "read failed: " << std::strerror(ENOTSUP) << "\n";
    return false;
  }
  return ReadAndCheck(o, "read", offset, count, check_offset, check_count);
}

bool Session::CmdWrite(const CommandDef& def, std::vector<std::string>& words) {
  IoOptions o;
  std::vector<std::string> operands;
  if (!GetIoOptions(def, words, "bcCfnpP:qs:uz", &o, &operands)) return false;
  if (operands.size() != 2) return Usage(def);
  if (o.vmstate && o.zero) {
    out() << "-b and -z cannot be specified at the same time\n";
    return false;
  }
  if (o.fua && (o.vmstate || o.compressed)) {
    out() << "-f and -b or -c cannot be specified at the same time\n";
    return false;
  }
  const int sources = int(o.zero) + int(o.pattern.has_value()) +
                      int(o.source_file.has_value());
  if (sources > 1) {
    out() << "Only one of -z, -P, and -s can be specified at the same time\n";
    return false;
  }
  if (!CheckZeroOnlyOptions(o)) return false;
  uint64_t offset = 0, count = 0;
  if (!ParseNumber(operands[0], &offset) || !ParseNumber(operands[1], &count)) {
    return false;
  }
  if (count > kMaxRequestBytes && !o.no_fallback) {
    out() << "length cannot exceed " << kMaxRequestBytes
          << " without -n, given " << operands[1] << "\n";
    return false;
  }
  if ((o.vmstate || o.compressed) && !CheckSectorAligned(offset, count)) {
    return false;
  }
  if (o.vmstate) {
    // The VM state area is not part of the io::BlockNode interface.
    out() << "write failed: " << std::strerror(ENOTSUP) << "\n";
    return false;
  }
  std::vector<uint8_t> buffer;
  Request r;
  if (!MakeWriteRequest(o, offset, count, buffer, &r)) return false;
  if (o.compressed && !o.zero) r.kind = Request::kWriteCompressed;
  double seconds = 0;
  if (!RunTimed(r, "write", &seconds)) return false;
  if (!o.quiet) {
    out() << Report("wrote", seconds, offset, count, count, 1, o.machine);
  }
  return true;
}

bool Session::CmdReadv(const CommandDef& def, std::vector<std::string>& words) {
  IoOptions o;
  std::vector<std::string> operands;
  if (!GetIoOptions(def, words, "CP:qv", &o, &operands)) return false;
  if (operands.size() < 2) return Usage(def);
  uint64_t offset = 0, count = 0;
  if (!ParseOffsetAndLengths(operands, &offset, &count)) return false;
  return ReadAndCheck(o, "readv", offset, count, 0, count);
}

bool Session::CmdWritev(const CommandDef& def,
                        std::vector<std::string>& words) {
  IoOptions o;
  std::vector<std::string> operands;
  if (!GetIoOptions(def, words, "CfP:q", &o, &operands)) return false;
  if (operands.size() < 2) return Usage(def);
  uint64_t offset = 0, count = 0;
  if (!ParseOffsetAndLengths(operands, &offset, &count)) return false;
  std::vector<uint8_t> buffer(count, o.pattern.value_or(kDefaultPattern));
  Request r{.kind = Request::kWrite,
            .offset = offset,
            .bytes = count,
            .buffer = absl::MakeSpan(buffer),
            .fua = o.fua};
  double seconds = 0;
  if (!RunTimed(r, "writev", &seconds)) return false;
  if (!o.quiet) {
    out() << Report("wrote", seconds, offset, count, count, 1, o.machine);
  }
  return true;
}

void Session::SubmitAio(std::shared_ptr<AioRequest> aio, const char* op) {
  const bool write = aio->request.kind != Request::kRead;
  if (driver_dropped_) {
    absl::StrAppend(&aio_output_, write ? "aio_write" : "readv", " failed: ",
                    std::strerror(ENOMEDIUM), "\n");
    return;
  }
  ++aio_in_flight_;
  aio->start = Clock::now();
  if (!aio->buffer.empty()) aio->request.buffer = absl::MakeSpan(aio->buffer);
  io::Task<absl::Status> task =
      RunRequest(&node(), ImageLength(), aio->request);
  io::Spawn(std::move(task), [this, aio, op, write](absl::Status st) {
    --aio_in_flight_;
    const double seconds = Seconds(Clock::now() - aio->start);
    const Request& r = aio->request;
    if (!st.ok()) {
      // qemu-io names a failed aio_read "readv".
      absl::StrAppend(&aio_output_, write ? "aio_write" : "readv",
                      " failed: ", FailureText(st), "\n");
      return;
    }
    if (aio->pattern.has_value() && !AllBytesAre(aio->buffer, *aio->pattern)) {
      absl::StrAppend(&aio_output_, "Pattern verification failed at offset ",
                      r.offset, ", ", r.bytes, " bytes\n");
    }
    if (aio->quiet) return;
    if (aio->verbose)
      absl::StrAppend(&aio_output_, HexDump(aio->buffer, r.offset));
    absl::StrAppend(&aio_output_, Report(op, seconds, r.offset, r.bytes,
                                         r.bytes, 1, aio->machine));
  });
}

bool Session::CmdAioRead(const CommandDef& def,
                         std::vector<std::string>& words) {
  auto aio = std::make_shared<AioRequest>();
  IoOptions o;
  std::vector<std::string> operands;
  if (!GetIoOptions(def, words, "CiP:qv", &o, &operands)) return false;
  aio->machine = o.machine;
  aio->quiet = o.quiet;
  aio->verbose = o.verbose;
  aio->pattern = o.pattern;
  if (operands.size() < 2) return Usage(def);
  if (o.invalid) {
    // qemu-io's -i only counts a failed request in its statistics.
    out() << "injecting invalid read request\n";
    return true;
  }
  uint64_t offset = 0, count = 0;
  if (!ParseOffsetAndLengths(operands, &offset, &count)) return false;
  aio->buffer.resize(count);
  aio->request =
      Request{.kind = Request::kRead, .offset = offset, .bytes = count};
  SubmitAio(std::move(aio), "read");
  return true;
}

bool Session::CmdAioWrite(const CommandDef& def,
                          std::vector<std::string>& words) {
  auto aio = std::make_shared<AioRequest>();
  IoOptions o;
  std::vector<std::string> operands;
  if (!GetIoOptions(def, words, "CfiP:quz", &o, &operands)) return false;
  aio->machine = o.machine;
  aio->quiet = o.quiet;
  if (operands.size() < 2) return Usage(def);
  if (o.zero && operands.size() > 2) {
    out() << "-z supports only a single length parameter\n";
    return false;
  }
  if (!CheckZeroOnlyOptions(o)) return false;
  if (o.invalid) {
    out() << "injecting invalid write request\n";
    return true;
  }
  uint64_t offset = 0, count = 0;
  if (o.zero) {
    // One length, not limited to a buffer's size.
    if (!ParseNumber(operands[0], &offset) ||
        !ParseNumber(operands[1], &count)) {
      return false;
    }
  } else if (!ParseOffsetAndLengths(operands, &offset, &count)) {
    return false;
  }
  if (!MakeWriteRequest(o, offset, count, aio->buffer, &aio->request)) {
    return false;
  }
  SubmitAio(std::move(aio), "wrote");
  return true;
}

bool Session::CmdAioFlush(const CommandDef&, std::vector<std::string>&) {
  DrainAio();
  return true;
}

bool Session::CmdDiscard(const CommandDef& def,
                         std::vector<std::string>& words) {
  IoOptions o;
  std::vector<std::string> operands;
  if (!GetIoOptions(def, words, "Cq", &o, &operands)) return false;
  if (operands.size() != 2) return Usage(def);
  uint64_t offset = 0, count = 0;
  if (!ParseNumber(operands[0], &offset) || !ParseNumber(operands[1], &count)) {
    return false;
  }
  Request r{.kind = Request::kDiscard,
            .offset = offset,
            .bytes = count,
            .discard_ignored = discard_ignored_};
  double seconds = 0;
  if (!RunTimed(r, "discard", &seconds)) return false;
  if (!o.quiet) {
    out() << Report("discard", seconds, offset, count, count, 1, o.machine);
  }
  return true;
}

bool Session::CmdFlush(const CommandDef&, std::vector<std::string>&) {
  // qemu-io prints nothing, even when the flush fails.
  return Wait(node().Flush()).ok();
}

bool Session::CmdTruncate(const CommandDef& def,
                          std::vector<std::string>& words) {
  io::PreallocMode mode = io::PreallocMode::kOff;
  std::vector<std::string> operands;
  if (!GetOptions(
          def, words, "m:",
          [&](int, const char* arg) {
            absl::StatusOr<io::PreallocMode> m = io::ParsePreallocMode(arg);
            if (!m.ok()) {
              err() << ProgramName() << ": " << m.status().message() << "\n";
              return false;
            }
            mode = *m;
            return true;
          },
          &operands)) {
    return false;
  }
  // qemu-io uses the first operand and ignores the rest.
  if (operands.empty()) return Usage(def);
  uint64_t size = 0;
  if (!ParseNumber(operands[0], &size)) return false;
  if (driver_dropped_) {
    err() << ProgramName() << ": No medium inserted\n";
    return false;
  }
  absl::Status st = Wait(node().Truncate(size, mode));
  if (!st.ok()) {
    err() << ProgramName() << ": " << WithoutFilename(st, node().filename()) << "\n";
    return false;
  }
  return true;
}

bool Session::CmdLength(const CommandDef&, std::vector<std::string>&) {
  if (driver_dropped_) {
    out() << "getlength: " << std::strerror(ENOMEDIUM) << "\n";
    return false;
  }
  out() << HumanBytes(static_cast<double>(ImageLength())) << "\n";
  return true;
}

bool Session::CmdInfo(const CommandDef&, std::vector<std::string>&) {
  if (driver_dropped_) return false;  // qemu-io: bdrv_get_info fails silently
  out() << "format name: " << image_.format << "\n";
  // qemu-io 7.2 prints the name of the `file` driver twice.
  if (image_.format == "file") out() << "format name: file\n";
  const qcow2::Qcow2Node* q = image_.qcow2;
  if (q == nullptr) {
    // Raw and file nodes have no clusters and no VM state area.
    out() << "cluster size: " << HumanBytes(0) << "\n"
          << "vm state offset: " << HumanBytes(0) << "\n";
    return true;
  }
  // The VM state area starts after the guest range the L1 table maps for
  // the virtual size (QEMU's qcow2_vm_state_offset).
  const uint64_t l2_entry_bytes = q->extended_l2() ? 16 : 8;
  const uint64_t l1_coverage =
      q->cluster_size() * (q->cluster_size() / l2_entry_bytes);
  const uint64_t sectors_bytes = q->size() / kSectorSize * kSectorSize;
  const uint64_t vm_state =
      (sectors_bytes + l1_coverage - 1) / l1_coverage * l1_coverage;
  const bool v3 = q->header().version >= 3;
  auto flag = [](bool b) { return b ? "true" : "false"; };
  out() << "cluster size: "
        << HumanBytes(static_cast<double>(q->cluster_size())) << "\n"
        << "vm state offset: " << HumanBytes(static_cast<double>(vm_state))
        << "\n"
        << "Format specific information:\n"
        << "    compat: " << q->compat() << "\n"
        << "    compression type: "
        << (q->header().compression_type == 0 ? "zlib" : "zstd") << "\n";
  if (v3) out() << "    lazy refcounts: " << flag(q->lazy_refcounts()) << "\n";
  out() << "    refcount bits: " << q->refcount_bits() << "\n";
  if (v3) {
    out() << "    corrupt: " << flag(q->corrupt()) << "\n"
          << "    extended l2: " << flag(q->extended_l2()) << "\n";
  }
  return true;
}

bool Session::CmdMap(const CommandDef&, std::vector<std::string>&) {
  if (driver_dropped_) {
    err() << ProgramName() << ": Failed to query image length: " << std::strerror(ENOMEDIUM) << "\n";
    return false;
  }
  const uint64_t length = ImageLength();
  uint64_t offset = 0;
  while (offset < length) {
    absl::StatusOr<std::pair<bool, uint64_t>> first =
        IsAllocated(offset, length - offset);
    if (!first.ok()) {
      const std::string why = FailureText(first.status());
      err() << ProgramName() << ": Failed to get allocation status: " << why << "\n";
      return false;
    }
    const bool allocated = first->first;
    uint64_t run = first->second;
    while (offset + run < length) {
      absl::StatusOr<std::pair<bool, uint64_t>> next =
          IsAllocated(offset + run, length - offset - run);
      if (!next.ok()) {
        // As qemu-io's map_is_allocated: a failure while extending the run
        // ends the run, which is printed; the next query reports it (a
        // corruption event is still printed now, when it happens).
        FailureText(next.status());
        break;
      }
      if (next->first != allocated) break;
      run += next->second;
    }
    out() << absl::StrFormat(
        "%s (0x%x) bytes %s allocated at offset %s (0x%x)\n",
        HumanBytes(static_cast<double>(run)), run, allocated ? "   " : "not",
        HumanBytes(static_cast<double>(offset)), offset);
    offset += run;
  }
  return true;
}

bool Session::CmdAlloc(const CommandDef&, std::vector<std::string>& words) {
  uint64_t offset = 0, count = kSectorSize;
  if (!ParseNumber(words[1], &offset)) return false;
  if (words.size() > 2 && !ParseNumber(words[2], &count)) return false;
  const uint64_t length = ImageLength();
  count = offset < length ? std::min(count, length - offset) : 0;
  uint64_t allocated = 0;
  for (uint64_t done = 0; done < count;) {
    absl::StatusOr<std::pair<bool, uint64_t>> st =
        IsAllocated(offset + done, count - done);
    if (!st.ok()) {
      const std::string why = FailureText(st.status());
      out() << "is_allocated failed: " << why << "\n";
      return false;
    }
    if (st->first) allocated += st->second;
    done += st->second;
  }
  out() << allocated << "/" << count << " bytes allocated at offset "
        << HumanBytes(static_cast<double>(offset)) << "\n";
  return true;
}

bool Session::CmdSleep(const CommandDef&, std::vector<std::string>& words) {
  char* end = nullptr;
  errno = 0;
  const long long ms = std::strtoll(words[1].c_str(), &end, 0);
  if (words[1].empty() || *end != '\0' || errno != 0 || ms < 0) {
    out() << words[1] << " is not a valid number\n";
    return false;
  }
  // The event loop keeps running: aio requests complete meanwhile.
  const Clock::time_point deadline =
      Clock::now() + std::chrono::milliseconds(ms);
  while (Clock::now() < deadline) {
    if (image_.engine != nullptr && engine().in_flight() > 0) {
      if (!engine().Poll(/*wait=*/false).ok()) std::abort();
      PrintAioOutput();
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(
        deadline - Clock::now(), std::chrono::milliseconds(1)));
  }
  if (image_.engine != nullptr) PrintAioOutput();
  return true;
}

bool Session::CmdHelp(const CommandDef&, std::vector<std::string>& words) {
  if (words.size() > 1) {
    const CommandDef* def = FindCommand(words[1]);
    if (def == nullptr) {
      out() << "command " << words[1] << " not found\n";
      return false;
    }
    out() << def->name << " " << def->args << " -- " << def->oneline << "\n";
    return true;
  }
  for (const CommandDef& def : kCommands) {
    out() << def.name << " " << def.args << " -- " << def.oneline << "\n";
  }
  out() << "\nUse 'help commandname' for extended help.\n";
  return true;
}

bool Session::CmdQuit(const CommandDef&, std::vector<std::string>&) {
  quit_ = true;
  return true;
}

}  // namespace

absl::Status RunIo(const std::vector<std::string>& args, Streams streams) {
  ImageSpec spec;
  spec.read_only = false;
  spec.cache = "writethrough";  // qemu-io's default
  std::vector<std::string> commands;
  std::string discard = "unmap";
  std::string aio;
  bool help = false;
  const bool as_qemu_io = ProgramName() == "qemu-io";
  absl::StatusOr<std::vector<std::string>> parsed =
      ParseOptions(
          args, "c:f:rnt:d:i:kmUhsCT:", kLongOptions, kUsage,
          [&](int c, const std::string& arg) -> absl::Status {
            switch (c) {
              case 'c':
                commands.push_back(arg);
                break;
              case 'f':
                spec.format = arg;
                break;
              case 'r':
                spec.read_only = true;
                break;
              case 'n':
                spec.cache = "none";
                break;
              case 't':
                spec.cache = arg;
                break;
              case 'd':
                discard = arg;
                break;
              case 'i':
                aio = arg;
                break;
              case 'k':
                aio = "native";
                break;
              case 'm':
                break;  // buffer misalignment: nothing to do here
              case 'U':
                spec.force_share = true;
                break;
              case 'h':
                help = true;
                break;
              case kImageOpts:
                spec.image_opts = true;
                break;
              case 's':
                return absl::UnimplementedError("-s is not supported yet");
              case 'C':
                return absl::UnimplementedError("-C is not supported yet");
              case 'T':
                return absl::UnimplementedError("-T is not supported yet");
            }
            return absl::OkStatus();
          });
  if (!parsed.ok()) {
    if (as_qemu_io && absl::IsInvalidArgument(parsed.status()) &&
        (absl::StartsWith(parsed.status().message(), "unrecognized option") ||
         absl::StartsWith(parsed.status().message(), "missing argument"))) {
      return QemuIoUsageFailure(parsed.status(), streams.out, streams.err);
    }
    return parsed.status();
  }
  std::vector<std::string> operands = *std::move(parsed);
  if (help) {
    streams.out << (as_qemu_io ? kQemuIoHelp : kHelp);
    return absl::OkStatus();
  }
  if (operands.size() > 1) {
    if (as_qemu_io) return QemuIoUsageFailure(absl::OkStatus(), streams.out, streams.err);
    return UsageError("Expecting at most one image file name", kUsage);
  }
  if (spec.image_opts && !spec.format.empty()) {
    return absl::InvalidArgumentError(
        "--image-opts and -f are mutually exclusive");
  }
  static constexpr const char* kCacheModes[] = {
      "none", "writeback", "writethrough", "directsync", "unsafe"};
  if (std::find_if(std::begin(kCacheModes), std::end(kCacheModes),
                   [&](const char* m) { return spec.cache == m; }) ==
      std::end(kCacheModes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("Invalid cache option: ", spec.cache));
  }
  bool discard_ignored = false;
  if (discard == "ignore" || discard == "off") {
    discard_ignored = true;
  } else if (discard != "unmap" && discard != "on") {
    return absl::InvalidArgumentError(
        absl::StrCat("Invalid discard option: ", discard));
  }
  if (!aio.empty()) {
    ASSIGN_OR_RETURN(spec.aio, io::ParseEngineKind(aio));
  }

  Session session(streams);
  if (operands.size() == 1) {
    spec.filename = operands[0];
    // Worded as Session::Open's errors ("can't open: " for --image-opts).
    const auto cant_open = [&](absl::string_view why) {
      return absl::InvalidArgumentError(
          spec.image_opts
              ? absl::StrCat("can't open: ", why)
              : absl::StrCat("can't open device ", spec.filename, ": ", why));
    };
    if (spec.force_share && !spec.read_only) {
      return cant_open("force-share=on can only be used with read-only images");
    }
    if (aio == "native" && spec.cache != "none" && spec.cache != "directsync") {
      return cant_open(
          "aio=native was specified, but it requires cache.direct=on, which "
          "was not specified.");
    }
    RETURN_IF_ERROR(session.Open(spec, discard_ignored));
  }
  if (commands.empty()) {
    // No -c: read the commands from standard input, with a prompt.
    std::string line;
    for (;;) {
      streams.out << ProgramName() << "> " << std::flush;
      if (!std::getline(std::cin, line)) break;
      if (!session.Execute(line)) break;
    }
  } else {
    for (const std::string& command : commands) {
      if (!session.Execute(command)) break;
    }
  }
  RETURN_IF_ERROR(session.Close());
  streams.out.flush();
  if (session.failed()) {
    // Each failed command has printed its error: exit 1 without a message.
    return absl::Status(absl::StatusCode::kUnknown, "");
  }
  return absl::OkStatus();
}

}  // namespace imgtool::cli
