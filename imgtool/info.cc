// imgtool info [-f FMT] [--output=human|json] [-U] FILE: qemu-img 7.2's
// image information for raw images (human lines or JSON from info.proto).
#include <getopt.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/json_printer.h"
#include "base/size.h"
#include "base/status_macros.h"
#include "imgtool/command.h"
#include "imgtool/image.h"
#include "imgtool/info.pb.h"

namespace imgtool::cli {
namespace {

constexpr char kUsage[] =
    "Usage: imgtool info [-f FMT] [--output=human|json] [-U] FILE";

constexpr char kHelp[] =
    "Usage: imgtool info [-f FMT] [--output=human|json] [-U] FILE\n"
    "Shows the format, virtual size and disk size of an image.\n"
    "  -f FMT                image format (raw, file); probed if absent\n"
    "  --output=human|json   output format (default human)\n"
    "  -U, --force-share     open read-only without taking the image locks\n"
    "  --backing-chain       show the whole chain (raw: just the image)\n";

enum LongOption { kOutput = 256, kBackingChain, kObject, kImageOpts };

const struct option kLongOptions[] = {
    {"help", no_argument, nullptr, 'h'},
    {"format", required_argument, nullptr, 'f'},
    {"output", required_argument, nullptr, kOutput},
    {"backing-chain", no_argument, nullptr, kBackingChain},
    {"object", required_argument, nullptr, kObject},
    {"image-opts", no_argument, nullptr, kImageOpts},
    {"force-share", no_argument, nullptr, 'U'},
    {nullptr, 0, nullptr, 0},
};

std::string HumanInfo(const ImageInfo& info) {
  std::string text = absl::StrCat(
      "image: ", info.filename(), "\n", "file format: ", info.format(), "\n",
      "virtual size: ", FormatHumanSize(info.virtual_size()), " (",
      info.virtual_size(), " bytes)\n", "disk size: ",
      info.has_actual_size() ? FormatHumanSize(info.actual_size())
                             : std::string("unavailable"),
      "\n");
  if (info.has_extent_size_hint()) {
    // The file child section of QEMU >= 8.0.
    absl::StrAppend(
        &text, "Child node '/file':\n", "    filename: ", info.filename(),
        "\n", "    protocol type: file\n", "    file length: ",
        FormatHumanSize(info.virtual_size()), " (", info.virtual_size(),
        " bytes)\n", "    disk size: ",
        info.has_actual_size() ? FormatHumanSize(info.actual_size())
                               : std::string("unavailable"),
        "\n", "    Format specific information:\n",
        "        extent size hint: ", info.extent_size_hint(), "\n");
  }
  return text;
}

}  // namespace

absl::Status RunInfo(const std::vector<std::string>& args, Streams streams) {
  ImageSpec spec;
  std::string output = "human";
  bool help = false;
  ASSIGN_OR_RETURN(
      std::vector<std::string> operands,
      ParseOptions(args, "f:hU", kLongOptions, kUsage,
                   [&](int c, const std::string& arg) -> absl::Status {
                     switch (c) {
                       case 'f': spec.format = arg; break;
                       case 'h': help = true; break;
                       case 'U': spec.force_share = true; break;
                       case kOutput: output = arg; break;
                       case kBackingChain: break;  // raw has no backing file
                       case kObject:
                         return absl::UnimplementedError(
                             "--object is not supported yet");
                       case kImageOpts: spec.image_opts = true; break;
                     }
                     return absl::OkStatus();
                   }));
  if (help) {
    streams.out << kHelp;
    return absl::OkStatus();
  }
  if (operands.size() != 1) {
    return UsageError("Expecting one image file name", kUsage);
  }
  if (spec.image_opts && !spec.format.empty()) {
    return absl::InvalidArgumentError(
        "--image-opts and --format are mutually exclusive");
  }
  ASSIGN_OR_RETURN(const bool json, ParseOutputFormat(output));
  spec.filename = operands[0];
  spec.read_only = true;
  spec.queue_depth = 1;

  ASSIGN_OR_RETURN(OpenedImage image, OpenImage(spec, streams.err));
  ImageInfo info;
  info.set_virtual_size(VirtualSize(image));
  info.set_filename(spec.filename);
  info.set_format(image.format);
  if (absl::StatusOr<uint64_t> allocated = image.node->AllocatedSize();
      allocated.ok()) {
    info.set_actual_size(*allocated);
  }
  info.set_dirty_flag(false);
  if (std::optional<uint64_t> hint = image.file->ExtentSizeHint();
      hint.has_value() && *hint != 0) {
    info.set_extent_size_hint(*hint);
  }
  RETURN_IF_ERROR(CloseImage(image));

  if (json) {
    streams.out << PrintJson(info) << "\n";
  } else {
    streams.out << HumanInfo(info);
  }
  return absl::OkStatus();
}

}  // namespace imgtool::cli
