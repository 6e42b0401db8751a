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
// -C / open -C open the image under a copy-on-read filter (ImageSpec::
// copy_on_read). Not done: the breakpoint commands (break, wait_break,
// resume, remove_break fail with ENOTSUP as on a graph without blkdebug).
// read -b / write -b reach qcow2's VM state area (Qcow2Node::ReadVmState /
// WriteVmState); other formats fail with ENOTSUP, as in qemu-io.

#include <getopt.h>

#include <algorithm>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "base/status_macros.h"
#include "imgtool/command.h"
#include "imgtool/image.h"
#include "imgtool/io_session.h"
#include "io/engine.h"

namespace imgtool::cli {
namespace {

using qemu_io::OpenRequest;
using qemu_io::Session;

constexpr char kUsage[] =
    "Usage: imgtool io [-f FMT] [--image-opts] [--object OBJECTDEF] "
    "[-t CACHE] [-n] [-r] [-s] [-C] [-U] [-d DISCARD] [-i AIO] [-c CMD]... "
    "[FILE]";

// Every option of `qemu-io --help` (7.2), in its order, with imgtool's
// wording where it says more.
constexpr char kHelp[] =
    "Usage: imgtool io [-f FMT] [--image-opts] [--object OBJECTDEF] "
    "[-t CACHE] [-n] [-r] [-s] [-C] [-U] [-d DISCARD] [-i AIO] [-c CMD]... "
    "[FILE]\n"
    "Runs qemu-io commands on an image (the lines of standard input if no -c "
    "is given).\n"
    "  --object OBJECTDEF     define an object (qemu-io's secret objects; "
    "accepted)\n"
    "  --image-opts           FILE is an option string (driver=...,...) or "
    "json:{...}\n"
    "  -c, --cmd CMD          run CMD (may be repeated; run in order)\n"
    "  -f, --format FMT       image format (raw, qcow2, ...); probed if "
    "absent\n"
    "  -r, --read-only        open the image read-only\n"
    "  -s, --snapshot         writes go to a temporary qcow2 overlay, "
    "dropped at exit\n"
    "  -n, --nocache          short for -t none\n"
    "  -C, --copy-on-read     copy what is read from backing files into the "
    "image\n"
    "  -m, --misalign         misalign buffers for O_DIRECT (accepted, no "
    "effect)\n"
    "  -k, --native-aio       short for -i native\n"
    "  -i, --aio MODE         threads, native or io_uring\n"
    "  -t, --cache MODE       none, writeback, writethrough (default), "
    "directsync, unsafe\n"
    "  -d, --discard MODE     unmap (default) or ignore\n"
    "  -T, --trace OPTIONS    tracing (not supported: an error)\n"
    "  -U, --force-share      open without taking the image locks (needs -r)\n"
    "  -h, --help             display this help and exit\n"
    "  -V, --version          output version information and exit\n"
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
absl::Status QemuIoUsageFailure(const absl::Status& status, std::ostream& out,
                                std::ostream& err) {
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
    {"trace", required_argument, nullptr, 'T'},
    {"version", no_argument, nullptr, 'V'},
    {nullptr, 0, nullptr, 0},
};

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
  bool version = false;
  const bool as_qemu_io = ProgramName() == "qemu-io";
  absl::StatusOr<std::vector<std::string>> parsed = ParseOptions(
      args, "c:f:rnt:d:i:kmUhsCT:V", kLongOptions, kUsage,
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
          case 'V':
            version = true;
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
  if (version) {  // qemu-io exits at -V, before opening anything
    streams.out << VersionText();
    return absl::OkStatus();
  }
  if (operands.size() > 1) {
    if (as_qemu_io)
      return QemuIoUsageFailure(absl::OkStatus(), streams.out, streams.err);
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
  session.Close();
  streams.out.flush();
  if (session.failed()) {
    // Each failed command has printed its error: exit 1 without a message.
    return absl::Status(absl::StatusCode::kUnknown, "");
  }
  return absl::OkStatus();
}

}  // namespace imgtool::cli
