// imgtool resize [-f FMT] [--preallocation=MODE] [--shrink] [-q] FILE
// [+|-]SIZE: changes the virtual size of a raw or qcow2 image like qemu-img
// 7.2 (qcow2: whole sectors, metadata preallocation, shrinking discards the
// clusters past the new end).
#include <getopt.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "base/errno_status.h"
#include "base/size.h"
#include "base/status_macros.h"
#include "imgtool/command.h"
#include "imgtool/image.h"
#include "io/block_node.h"

namespace imgtool::cli {
namespace {

constexpr char kUsage[] =
    "Usage: imgtool resize [-q] [-f FMT] [--preallocation=MODE] [--shrink] "
    "FILE [+|-]SIZE";

constexpr char kHelp[] =
    "Usage: imgtool resize [-q] [-f FMT] [--preallocation=MODE] [--shrink] "
    "FILE [+|-]SIZE\n"
    "Sets the size of an image, or grows (+) or shrinks (-) it by SIZE.\n"
    "  -f FMT                image format (raw, file, qcow2); probed if "
    "absent\n"
    "  --image-opts          FILE is an option string such as\n"
    "                        driver=qcow2,file.driver=preallocate,"
    "file.file.filename=x\n"
    "  --preallocation=MODE  off (default), metadata (qcow2), falloc or full "
    "for\n"
    "                        the new range\n"
    "  --shrink              allow making the image smaller (data is lost)\n"
    "  -q                    quiet: no \"Image resized.\" line\n";

enum LongOption { kObject = 256, kImageOpts, kPreallocation, kShrink };

const struct option kLongOptions[] = {
    {"help", no_argument, nullptr, 'h'},
    {"object", required_argument, nullptr, kObject},
    {"image-opts", no_argument, nullptr, kImageOpts},
    {"preallocation", required_argument, nullptr, kPreallocation},
    {"shrink", no_argument, nullptr, kShrink},
    {nullptr, 0, nullptr, 0},
};

// qemu-img resize prints the driver's truncate errors without the file
// name ("Cannot resize device files"); posix_file names it.
absl::Status WithoutFileName(const std::string& filename,
                             const absl::Status& st) {
  absl::string_view message = st.message();
  if (!absl::ConsumePrefix(&message, absl::StrCat(filename, ": "))) return st;
  return WithMessage(st, message);
}

}  // namespace

absl::Status RunResize(const std::vector<std::string>& args, Streams streams) {
  // Like qemu-img, the size is taken off the end before option parsing, so
  // that "-512K" is not read as an option.
  if (args.size() == 1 && (args[0] == "-h" || args[0] == "--help")) {
    streams.out << kHelp;
    return absl::OkStatus();
  }
  if (args.size() < 2) return UsageError("Not enough arguments", kUsage);
  std::string size_text = args.back();
  const std::vector<std::string> option_args(args.begin(), args.end() - 1);

  ImageSpec spec;
  spec.read_only = false;
  bool quiet = false;
  bool shrink = false;
  bool help = false;
  io::PreallocMode prealloc = io::PreallocMode::kOff;
  ASSIGN_OR_RETURN(
      std::vector<std::string> operands,
      ParseOptions(option_args, "f:hq", kLongOptions, kUsage,
                   [&](int c, const std::string& arg) -> absl::Status {
                     switch (c) {
                       case 'f': spec.format = arg; break;
                       case 'h': help = true; break;
                       case 'q': quiet = true; break;
                       case kImageOpts: spec.image_opts = true; break;
                       case kPreallocation: {
                         ASSIGN_OR_RETURN(prealloc, io::ParsePreallocMode(arg));
                         break;
                       }
                       case kShrink: shrink = true; break;
                     }
                     return absl::OkStatus();
                   }));
  if (help) {
    streams.out << kHelp;
    return absl::OkStatus();
  }
  if (operands.size() != 1) {
    return UsageError("Expecting image file name and size", kUsage);
  }
  if (spec.image_opts && !spec.format.empty()) {
    return absl::InvalidArgumentError(
        "--image-opts and --format are mutually exclusive");
  }
  spec.filename = operands[0];

  int relative = 0;
  absl::string_view number = size_text;
  if (!number.empty() && (number[0] == '+' || number[0] == '-')) {
    relative = number[0] == '+' ? 1 : -1;
    number.remove_prefix(1);
  }
  ASSIGN_OR_RETURN(const uint64_t n, ParseSizeOption("size", number));

  ASSIGN_OR_RETURN(OpenedImage image, OpenImage(spec, streams.err));
  auto fail = [&](absl::Status st) {
    CloseImage(image).IgnoreError();
    return st;
  };
  // qemu-img works in signed 64-bit sizes: a value beyond INT64_MAX, or a
  // relative size that ends below 1, is "not positive".
  const int64_t current = static_cast<int64_t>(VirtualSize(image));
  const __int128 total =
      relative == 0
          ? static_cast<__int128>(static_cast<int64_t>(n))
          : static_cast<__int128>(current) +
                static_cast<__int128>(static_cast<int64_t>(n)) * relative;
  if (total <= 0 || total > INT64_MAX) {
    return fail(
        absl::InvalidArgumentError("New image size must be positive"));
  }
  const uint64_t new_size = static_cast<uint64_t>(total);
  if (total <= current && prealloc != io::PreallocMode::kOff) {
    return fail(absl::InvalidArgumentError(
        "Preallocation can only be used for growing images"));
  }
  if (total < current && !shrink) {
    return fail(PrefixEachLine(absl::FailedPreconditionError(
        "Use the --shrink option to perform a shrink operation.\n"
        "warning: Shrinking an image will delete all data beyond the "
        "shrunken image's end. Before performing such an operation, make "
        "sure there is no important data there.")));
  }
  if (prealloc == io::PreallocMode::kMetadata && image.qcow2 == nullptr) {
    // Raw images have no metadata; file-posix refuses the mode.
    return fail(absl::InvalidArgumentError(
        "Unsupported preallocation mode: metadata"));
  }
  absl::Status st =
      io::RunSync(*image.engine, image.node->Truncate(new_size, prealloc));
  st = WithoutFileName(spec.filename, st);
  // As qemu-img: the truncate's error or "Image resized.", then blk_unref's
  // close, whose failures (the qcow2 caches not written back) are reported
  // one line per cache and change neither the outcome nor the exit status.
  if (!st.ok()) {
    streams.err << FormatError(st);
  } else if (!quiet) {
    streams.out << "Image resized.\n";
  }
  absl::Status closed = CloseImage(image);
  if (!closed.ok()) {
    for (absl::string_view line : absl::StrSplit(closed.message(), '\n')) {
      streams.err << ProgramName() << ": " << line << "\n";
    }
  }
  // Already reported: an empty message, which main does not print.
  if (!st.ok()) return absl::Status(st.code(), "");
  return absl::OkStatus();
}

}  // namespace imgtool::cli
