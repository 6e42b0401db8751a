// imgtool io [-f FMT] [--image-opts] [-t CACHE] [-n] [-r] [-s] [-U]
// [-d DISCARD] [-i AIO] [-c CMD]... [FILE]: the qemu-io 7.2 look-alike.
// Opens FILE (if given) and runs each -c command in order, or the lines of
// standard input after a "qemu-io> " prompt each if there is no -c,
// printing what qemu-io 7.2 prints: "wrote N/N bytes at offset O" plus a
// timing line, hex dumps, pattern verification failures, allocation maps,
// qemu-io's help texts. A failing command prints its error (qemu-io's
// wording, mostly on stdout) and the next command still runs; the exit
// status is 1 if any command failed. aio_* requests stay in flight while
// later commands run and print their completion lines when they finish (at
// the latest at aio_flush, close or exit).
//
// Images: `open [-rsCnkU] [-t cache] [-d discard] [-o options] [path]`
// opens one (several opens and closes per run; one image at a time),
// `close` closes it, `reopen [-r|-w] [-c cache] [-o options]` closes it and
// opens it again with the changed settings after QEMU's checks (generic
// options change, driver options only if the driver takes them, driver and
// node-name never). -s (snapshot mode, QEMU's snapshot=on) opens the image
// read-only as the backing file of a temporary qcow2 overlay in $TMPDIR or
// /var/tmp, deleted once open, so writes never reach the image. In the
// writethrough and directsync cache modes (qemu-io's default is
// writethrough) each write is followed by a flush of the image, as QEMU's
// BlockBackend does without a write cache.
//
// Everything goes through the generic io::BlockNode interface and
// io::GetChainStatus, so formats with a backing chain work unchanged.
// Not done: -C (copy-on-read: refused with "not supported yet"), the
// breakpoint commands (break, wait_break, resume, remove_break fail with
// ENOTSUP as on a graph without blkdebug).
// read -b / write -b reach qcow2's VM state area (Qcow2Node::ReadVmState /
// WriteVmState); other formats fail with ENOTSUP, as in qemu-io.
#include <getopt.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <csignal>
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
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/types/span.h"
#include "base/errno_status.h"
#include "base/options.h"
#include "base/size.h"
#include "base/status_macros.h"
#include "block/registry.h"
#include "imgtool/command.h"
#include "imgtool/image.h"
#include "imgtool/io_help.h"
#include "imgtool/qcow2_create.h"
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
// Opening images (the command line's image, `open`, `reopen`, -s).

// How to open an image: the command line's settings or an `open` command's.
struct OpenRequest {
  ImageSpec spec;
  // The path as qemu-io names it in "can't open device PATH: ..."; empty
  // for --image-opts and for `open -o ...` without a path ("can't open:").
  std::string name;
  bool snapshot = false;       // -s: writes go to a temporary overlay
  bool copy_on_read = false;   // -C
  bool discard_ignored = false;  // -d ignore
};

// Sets the dotted `key` ("file.align") of `tree` to `value`, replacing a
// child or value of the same name.
void SetOption(NodeOptions& tree, absl::string_view key,
               const std::string& value) {
  std::vector<std::string> parts = absl::StrSplit(key, '.');
  NodeOptions* node = &tree;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    node->values.erase(parts[i]);
    node = &node->children[parts[i]];
  }
  node->children.erase(parts.back());
  node->values[parts.back()] = value;
}

// The option string ("driver=qcow2,file.filename=x") that rebuilds `tree`;
// commas in values are doubled.
void FlattenOptions(const NodeOptions& tree, const std::string& prefix,
                    std::string* out) {
  for (const auto& [key, value] : tree.values) {
    if (!out->empty()) *out += ',';
    absl::StrAppend(out, prefix, key, "=",
                    absl::StrReplaceAll(value, {{",", ",,"}}));
  }
  for (const auto& [key, child] : tree.children) {
    FlattenOptions(child, absl::StrCat(prefix, key, "."), out);
  }
}

std::string FlattenOptions(const NodeOptions& tree) {
  std::string out;
  FlattenOptions(tree, "", &out);
  return out;
}

// The options of `open -o OPTIONS [PATH]`: PATH opened as the command line
// opens it (a format's `file` child, probed if no driver), with OPTIONS
// laid over it; a protocol driver (driver=file) takes PATH as its own
// filename, as QEMU's bdrv_fill_options does.
absl::StatusOr<NodeOptions> OpenCommandOptions(const std::string& path,
                                               const std::string& options) {
  ASSIGN_OR_RETURN(OptionList list, ParseOptionString(options));
  NodeOptions tree;
  if (!path.empty()) {
    ASSIGN_OR_RETURN(tree, block::ImageOptions(path, "", false));
  }
  for (const auto& [key, value] : list) {
    if (key != "driver") continue;
    const block::Driver* driver = block::FindDriver(value);
    if (driver != nullptr && driver->kind == block::DriverKind::kProtocol &&
        !path.empty() && !absl::StartsWith(path, "json:")) {
      tree = NodeOptions();
      tree.values["filename"] = path;
    }
  }
  for (const auto& [key, value] : list) SetOption(tree, key, value);
  return tree;
}

// A temporary file name for -s's overlay, as QEMU's get_tmp_filename picks
// one: $TMPDIR or /var/tmp, "vl.XXXXXX". The file is created empty.
absl::StatusOr<std::string> TemporaryFile() {
  const char* dir = std::getenv("TMPDIR");
  std::string name =
      absl::StrCat(dir != nullptr && *dir != '\0' ? dir : "/var/tmp",
                   "/vl.XXXXXX");
  const int fd = mkstemp(name.data());
  if (fd < 0) return ErrnoStatus(name, "Could not get temporary filename", errno);
  close(fd);
  return name;
}

// ---------------------------------------------------------------------------
// Requests.

struct Request {
  enum Kind {
    kRead,
    kWrite,
    kWriteZeroes,
    kDiscard,
    kWriteCompressed,
    kReadVmState,   // read -b
    kWriteVmState,  // write -b
  };
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
// a range past `image_length` (the 512-rounded length) fails with EIO. With
// `write_through` (the writethrough and directsync cache modes: QEMU's
// BlockBackend without a write cache) every write is followed by a flush of
// the node, as QEMU emulates FUA for drivers such as qcow2: their metadata
// caches reach the file after each write.
io::Task<absl::Status> RunRequest(io::BlockNode* node, uint64_t image_length,
                                  Request r, bool write_through) {
  const bool vmstate =
      r.kind == Request::kReadVmState || r.kind == Request::kWriteVmState;
  if (!vmstate &&
      (r.offset > image_length || image_length - r.offset < r.bytes)) {
    co_return ErrnoStatus(node->filename(), "request", EIO);
  }
  // Only qcow2 has a VM state area (QEMU: ENOTSUP from the other drivers).
  auto* qcow2 = dynamic_cast<qcow2::Qcow2Node*>(node);
  if (vmstate && qcow2 == nullptr) co_return ErrnoStatus("", "vmstate", ENOTSUP);
  absl::Status status;
  switch (r.kind) {
    case Request::kReadVmState:
      co_return co_await qcow2->ReadVmState(r.offset, r.buffer);
    case Request::kWriteVmState:
      status = co_await qcow2->WriteVmState(r.offset, r.buffer);
      break;
    case Request::kRead:
      co_return co_await node->Read(r.offset, r.buffer);
    case Request::kWrite:
      status = co_await node->Write(r.offset, r.buffer);
      break;
    case Request::kWriteCompressed: {
      // write -c: only qcow2 compresses (qemu-io: ENOTSUP elsewhere).
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
  if (status.ok() && (r.fua || write_through)) {
    status = co_await node->Flush();
  }
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

std::string OneLineHelp(absl::string_view name, const CommandDef& def);

class Session {
 public:
  explicit Session(Streams streams) : streams_(streams) {}

  // Opens the image `request` describes; no image may be open. Errors are
  // qemu-io's text after "qemu-io: ": "can't open device PATH: <cause>", or
  // "can't open: <cause>" where qemu-io has no path to name.
  absl::Status Open(const OpenRequest& request);

  // Runs one command line. Returns false once `quit` ran.
  bool Execute(const std::string& line);

  // Waits for the aio requests, prints their completions and closes the
  // image (if one is open); returns the close error.
  absl::Status Close() {
    if (image_.node == nullptr) return absl::OkStatus();
    DrainAio();
    streams_.out.flush();
    absl::Status st = CloseImage(image_);
    image_ = OpenedImage();
    driver_dropped_ = false;
    corruption_reported_ = false;
    return st;
  }

  // --image-opts on the command line: `open PATH` then parses PATH as
  // options, and `open -o` is refused.
  void set_image_opts(bool image_opts) { image_opts_ = image_opts; }

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
  bool CmdOpen(const CommandDef& def, std::vector<std::string>& words);
  bool CmdClose(const CommandDef& def, std::vector<std::string>& words);
  bool CmdReopen(const CommandDef& def, std::vector<std::string>& words);
  bool CmdSigraise(const CommandDef& def, std::vector<std::string>& words);
  bool CmdAbort(const CommandDef& def, std::vector<std::string>& words);
  bool CmdBreak(const CommandDef& def, std::vector<std::string>& words);
  bool CmdWaitBreak(const CommandDef& def, std::vector<std::string>& words);
  bool CmdResume(const CommandDef& def, std::vector<std::string>& words);
  bool CmdRemoveBreak(const CommandDef& def, std::vector<std::string>& words);

 private:
  std::ostream& out() { return streams_.out; }
  std::ostream& err() { return streams_.err; }
  io::BlockNode& node() { return *image_.node; }
  io::Engine& engine() { return *image_.engine; }
  uint64_t ImageLength() const { return VirtualSize(image_); }
  // QEMU's BlockBackend has no write cache in these modes.
  bool WriteThrough() const {
    return current_.spec.cache == "writethrough" ||
           current_.spec.cache == "directsync";
  }

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
    out() << OneLineHelp(def.name, def);
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
    absl::Status st =
        Wait(RunRequest(&node(), ImageLength(), r, WriteThrough()));
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
    const Request r{.kind = o.vmstate ? Request::kReadVmState : Request::kRead,
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

  // -s: opens `spec`'s image read-only as the backing file of a new
  // temporary qcow2 overlay (deleted once open), which takes the writes.
  absl::StatusOr<OpenedImage> OpenSnapshot(const ImageSpec& spec);

  // A qemu-io error line on stderr ("qemu-io: <message>").
  void Error(absl::string_view message) {
    err() << ProgramName() << ": " << message << "\n";
  }

  Streams streams_;
  OpenedImage image_;
  OpenRequest current_;  // how image_ was opened
  bool image_opts_ = false;
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
    {"reopen", nullptr, 0, -1, false, true,
     "[(-r|-w)] [-c cache] [-o options]",
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
  std::vector<uint8_t> buffer;
  Request r;
  if (!MakeWriteRequest(o, offset, count, buffer, &r)) return false;
  if (o.compressed && !o.zero) r.kind = Request::kWriteCompressed;
  if (o.vmstate) r.kind = Request::kWriteVmState;
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
      RunRequest(&node(), ImageLength(), aio->request, WriteThrough());
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
  const uint64_t vm_state = q->vm_state_offset();
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

absl::Status Session::Open(const OpenRequest& request) {
  const ImageSpec& spec = request.spec;
  const auto cant_open = [&](absl::StatusCode code, absl::string_view cause) {
    return absl::Status(
        code, request.name.empty()
                  ? absl::StrCat("can't open: ", cause)
                  : absl::StrCat("can't open device ", request.name, ": ",
                                 cause));
  };
  if (spec.force_share && !spec.read_only) {
    return cant_open(absl::StatusCode::kInvalidArgument,
                     "force-share=on can only be used with read-only images");
  }
  if (spec.aio == io::EngineKind::kNative && spec.cache != "none" &&
      spec.cache != "directsync") {
    return cant_open(
        absl::StatusCode::kInvalidArgument,
        "aio=native was specified, but it requires cache.direct=on, which "
        "was not specified.");
  }
  if (request.copy_on_read) {
    // QEMU checks this before it opens anything.
    if (spec.read_only) {
      return cant_open(absl::StatusCode::kInvalidArgument,
                       "Can't use copy-on-read on read-only device");
    }
    return cant_open(absl::StatusCode::kUnimplemented,
                     "copy-on-read (-C) is not supported yet");
  }
  absl::StatusOr<OpenedImage> image = request.snapshot
                                          ? OpenSnapshot(spec)
                                          : OpenImage(spec, err());
  if (!image.ok()) {
    // Without the "Could not open 'F': " that qemu-img puts before the cause.
    absl::string_view cause = image.status().message();
    absl::ConsumePrefix(&cause,
                        absl::StrCat("Could not open '", spec.filename, "': "));
    return cant_open(image.status().code(), cause);
  }
  image_ = *std::move(image);
  current_ = request;
  discard_ignored_ = request.discard_ignored;
  return absl::OkStatus();
}

absl::StatusOr<OpenedImage> Session::OpenSnapshot(const ImageSpec& spec) {
  ImageSpec base_spec = spec;
  base_spec.read_only = true;
  ASSIGN_OR_RETURN(OpenedImage base, OpenImage(base_spec, err()));
  const uint64_t size = VirtualSize(base);
  std::string backing = base.display_name;
  const std::string format = base.format == "file" ? "raw" : base.format;
  RETURN_IF_ERROR(CloseImage(base));
  if (IsRelativeFilename(backing)) {
    char* cwd = getcwd(nullptr, 0);
    if (cwd == nullptr) return ErrnoStatus(".", "getcwd", errno);
    backing = absl::StrCat(cwd, "/", backing);
    std::free(cwd);
  }
  ASSIGN_OR_RETURN(const std::string overlay, TemporaryFile());
  Qcow2CreateValues values;
  values.SetNumber("size", size);
  values.SetString("backing_file", backing);
  if (!absl::StartsWith(backing, "json:")) {
    values.SetString("backing_fmt", format);
  }
  absl::Status created = CreateQcow2File(overlay, values, err());
  if (!created.ok()) {
    unlink(overlay.c_str());
    return created;
  }
  ImageSpec overlay_spec = spec;
  overlay_spec.filename = overlay;
  overlay_spec.format = "qcow2";
  overlay_spec.image_opts = false;
  overlay_spec.force_share = false;
  absl::StatusOr<OpenedImage> opened =
      OpenImage(overlay_spec, err(), base.engine);
  unlink(overlay.c_str());  // QEMU's BDRV_O_TEMPORARY: gone once closed
  return opened;
}

bool Session::CmdOpen(const CommandDef& def, std::vector<std::string>& words) {
  OpenRequest r;
  r.spec.read_only = false;
  r.spec.cache = "writethrough";  // qemu-io's default
  std::string options;
  std::vector<std::string> operands;
  if (!GetOptions(
          def, words, "snCro:ki:t:d:U",
          [&](int c, const char* arg) {
            switch (c) {
              case 's':
                r.snapshot = true;
                break;
              case 'n':
                r.spec.cache = "none";
                break;
              case 'C':
                r.copy_on_read = true;
                break;
              case 'r':
                r.spec.read_only = true;
                break;
              case 'k':
                r.spec.aio = io::EngineKind::kNative;
                break;
              case 'i': {
                absl::StatusOr<io::EngineKind> aio = io::ParseEngineKind(arg);
                if (!aio.ok()) {
                  Error(aio.status().message());
                  return false;
                }
                r.spec.aio = *aio;
                break;
              }
              case 't': {
                std::optional<std::string> mode = CacheMode(arg);
                if (!mode.has_value()) {
                  Error(absl::StrCat("Invalid cache option: ", arg));
                  return false;
                }
                r.spec.cache = *mode;
                break;
              }
              case 'd':
                if (std::strcmp(arg, "ignore") == 0 ||
                    std::strcmp(arg, "off") == 0) {
                  r.discard_ignored = true;
                } else if (std::strcmp(arg, "unmap") == 0 ||
                           std::strcmp(arg, "on") == 0) {
                  r.discard_ignored = false;
                } else {
                  Error(absl::StrCat("Invalid discard option: ", arg));
                  return false;
                }
                break;
              case 'o':
                if (image_opts_) {
                  out() << "--image-opts and 'open -o' are mutually "
                           "exclusive\n";
                  return false;
                }
                if (absl::Status st = ParseOptionString(arg).status();
                    !st.ok()) {
                  Error(st.message());
                  return false;
                }
                absl::StrAppend(&options, options.empty() ? "" : ",", arg);
                break;
              case 'U':
                r.spec.force_share = true;
                break;
            }
            return true;
          },
          &operands)) {
    return false;
  }
  if (operands.size() > 1) return Usage(def);
  const std::string path = operands.empty() ? "" : operands[0];
  if (image_.node != nullptr) {
    Error("file open already, try 'help close'");
    return false;
  }
  if (!options.empty()) {
    absl::StatusOr<NodeOptions> tree = OpenCommandOptions(path, options);
    if (!tree.ok()) {
      Error(tree.status().message());
      return false;
    }
    r.spec.filename = FlattenOptions(*tree);
    r.spec.image_opts = true;
    r.name = path;
  } else if (path.empty()) {
    Error("can't open: Must specify either driver or file");
    return false;
  } else {
    r.spec.filename = path;
    r.spec.image_opts = image_opts_;
    if (!image_opts_) r.name = path;
  }
  if (absl::Status st = Open(r); !st.ok()) {
    Error(st.message());
    return false;
  }
  return true;
}

bool Session::CmdClose(const CommandDef&, std::vector<std::string>&) {
  if (absl::Status st = Close(); !st.ok()) {
    Error(WithoutFilename(st, current_.spec.filename));
    return false;
  }
  return true;
}

// The driver QEMU would name for the node at `path` (dotted child names,
// "" for the top) of the image: from the options where they name one, else
// what the graph has (a `file` child is the file protocol; a backing file
// qcow2 or raw).
std::string DriverAt(const NodeOptions& tree, absl::string_view path,
                     const OpenedImage& image) {
  const NodeOptions* node = &tree;
  std::string last;
  for (absl::string_view part : absl::StrSplit(path, '.', absl::SkipEmpty())) {
    auto it = node->children.find(std::string(part));
    last = std::string(part);
    if (it == node->children.end()) {
      node = nullptr;
      break;
    }
    node = &it->second;
  }
  if (node != nullptr) {
    auto it = node->values.find("driver");
    if (it != node->values.end()) return it->second;
  }
  if (path.empty()) return image.format;
  if (last == "backing" && image.node->backing() != nullptr) {
    return dynamic_cast<const qcow2::Qcow2Node*>(image.node->backing()) !=
                   nullptr
               ? "qcow2"
               : "raw";
  }
  return "file";
}

// The value of dotted `key` in `tree`, if set.
std::optional<std::string> OptionAt(const NodeOptions& tree,
                                    absl::string_view key) {
  std::vector<std::string> parts = absl::StrSplit(key, '.');
  const NodeOptions* node = &tree;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    auto it = node->children.find(parts[i]);
    if (it == node->children.end()) return std::nullopt;
    node = &it->second;
  }
  auto it = node->values.find(parts.back());
  if (it == node->values.end()) return std::nullopt;
  return it->second;
}

bool Session::CmdReopen(const CommandDef& def,
                        std::vector<std::string>& words) {
  std::optional<bool> read_only;  // -r / -w
  std::optional<std::string> cache;
  std::string options;
  std::vector<std::string> operands;
  if (!GetOptions(
          def, words, "c:o:rw",
          [&](int c, const char* arg) {
            switch (c) {
              case 'c': {
                std::optional<std::string> mode = CacheMode(arg);
                if (!mode.has_value()) {
                  Error(absl::StrCat("Invalid cache option: ", arg));
                  return false;
                }
                cache = *mode;
                break;
              }
              case 'o':
                if (absl::Status st = ParseOptionString(arg).status();
                    !st.ok()) {
                  Error(st.message());
                  return false;
                }
                absl::StrAppend(&options, options.empty() ? "" : ",", arg);
                break;
              case 'r':
              case 'w':
                if (read_only.has_value()) {
                  Error("Only one -r/-w option may be given");
                  return false;
                }
                read_only = c == 'r';
                break;
            }
            return true;
          },
          &operands)) {
    return false;
  }
  if (!operands.empty()) return Usage(def);
  absl::StatusOr<OptionList> list = ParseOptionString(options);
  if (!list.ok()) {
    Error(list.status().message());
    return false;
  }
  bool has_read_only = false, has_cache = false;
  for (const auto& [key, value] : *list) {
    if (key == "read-only") has_read_only = true;
    if (key == "cache.direct" || key == "cache.no-flush") has_cache = true;
  }
  if (has_read_only && read_only.has_value()) {
    Error("Cannot set both -r/-w and 'read-only'");
    return false;
  }
  if (has_cache && cache.has_value()) {
    Error("Cannot set both -c and the cache options");
    return false;
  }
  if (current_.snapshot || current_.copy_on_read) {
    Error("reopen of an image opened with -s or -C is not supported yet");
    return false;
  }
  absl::StatusOr<NodeOptions> tree = block::ImageOptions(
      current_.spec.filename, current_.spec.format, current_.spec.image_opts);
  if (!tree.ok()) {
    Error(tree.status().message());
    return false;
  }
  tree->values.emplace("driver", image_.format);
  OpenRequest r = current_;
  r.name.clear();
  r.spec.read_only = read_only.value_or(current_.spec.read_only);
  if (cache.has_value()) r.spec.cache = *cache;
  // QEMU's bdrv_reopen_prepare: the generic options take new values; the
  // rest must keep theirs unless the driver can change them.
  for (const auto& [key, value] : *list) {
    const size_t dot = key.rfind('.');
    const std::string node =
        dot == std::string::npos ? "" : key.substr(0, dot);
    const std::string name =
        dot == std::string::npos ? key : key.substr(dot + 1);
    if (name == "read-only" || name == "auto-read-only" ||
        name == "force-share" || key == "cache.direct" ||
        key == "cache.no-flush") {
      absl::StatusOr<bool> on = ParseBoolOption(key, value);
      if (!on.ok()) {
        Error(on.status().message());
        return false;
      }
      if (key == "read-only") {
        r.spec.read_only = *on;
      } else if (absl::StartsWith(key, "cache.")) {
        SetOption(*tree, key, value);
      }
      continue;
    }
    const std::string driver = DriverAt(*tree, node, image_);
    const std::optional<std::string> now = OptionAt(*tree, key);
    if ((name == "driver" && value == driver) ||
        (now.has_value() && *now == value)) {
      continue;  // unchanged
    }
    const block::Driver* d = block::FindDriver(driver);
    const bool changeable =
        name != "driver" && name != "node-name" && d != nullptr &&
        std::find(d->keys.begin(), d->keys.end(), name) != d->keys.end();
    if (!changeable) {
      Error(absl::StrCat("Cannot change the option '", name, "'"));
      return false;
    }
    SetOption(*tree, key, value);
  }
  r.spec.filename = FlattenOptions(*tree);
  r.spec.format.clear();
  r.spec.image_opts = true;
  const OpenRequest old = current_;
  if (absl::Status st = Close(); !st.ok()) {
    Error(WithoutFilename(st, old.spec.filename));
    return false;
  }
  absl::Status st = Open(r);
  if (st.ok()) return true;
  absl::string_view cause = st.message();
  absl::ConsumePrefix(&cause, "can't open: ");
  Error(cause);
  if (absl::Status again = Open(old); !again.ok()) Error(again.message());
  return false;
}

bool Session::CmdSigraise(const CommandDef&, std::vector<std::string>& words) {
  uint64_t sig = 0;
  if (!ParseNumber(words[1], &sig)) return false;
  if (sig > NSIG) {
    out() << "signal argument '" << words[1]
          << "' is too large to be a valid signal\n";
    return false;
  }
  // As qemu-io: stdout and stderr are flushed first, since raise() may end
  // the process without flushing them.
  out().flush();
  err().flush();
  std::fflush(stdout);
  std::fflush(stderr);
  std::raise(static_cast<int>(sig));
  return true;
}

bool Session::CmdAbort(const CommandDef&, std::vector<std::string>&) {
  std::abort();  // qemu-io's abort(3), with nothing flushed
}

// Breakpoints need a blkdebug node in the graph; imgtool has none yet, so
// these fail as qemu-io does on a graph without one.
bool Session::CmdBreak(const CommandDef&, std::vector<std::string>&) {
  out() << "Could not set breakpoint: " << std::strerror(ENOTSUP) << "\n";
  return false;
}

bool Session::CmdWaitBreak(const CommandDef&, std::vector<std::string>&) {
  // qemu-io would wait forever for a request no breakpoint can suspend.
  out() << "Could not wait for a breakpoint: " << std::strerror(ENOTSUP)
        << "\n";
  return false;
}

bool Session::CmdResume(const CommandDef&, std::vector<std::string>&) {
  out() << "Could not resume request: " << std::strerror(ENOTSUP) << "\n";
  return false;
}

bool Session::CmdRemoveBreak(const CommandDef&,
                             std::vector<std::string>& words) {
  out() << "Could not remove breakpoint " << words[1] << ": "
        << std::strerror(ENOTSUP) << "\n";
  return false;
}

}  // namespace

absl::Status RunIo(const std::vector<std::string>& args, Streams streams) {
  OpenRequest request;
  ImageSpec& spec = request.spec;
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
                request.snapshot = true;
                break;
              case 'C':
                request.copy_on_read = true;
                break;
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
  if (discard == "ignore" || discard == "off") {
    request.discard_ignored = true;
  } else if (discard != "unmap" && discard != "on") {
    return absl::InvalidArgumentError(
        absl::StrCat("Invalid discard option: ", discard));
  }
  if (!aio.empty()) {
    ASSIGN_OR_RETURN(spec.aio, io::ParseEngineKind(aio));
  }

  Session session(streams);
  session.set_image_opts(spec.image_opts);
  if (operands.size() == 1) {
    spec.filename = operands[0];
    if (!spec.image_opts) request.name = spec.filename;
    RETURN_IF_ERROR(session.Open(request));
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
