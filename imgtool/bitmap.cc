// imgtool bitmap (--merge SOURCE | --add | --remove | --clear | --enable |
// --disable)... [-b SOURCE_FILE [-F SOURCE_FMT]] [-g GRANULARITY] [-f FMT]
// [--image-opts] [--object ...] FILE BITMAP: qemu-img 7.2's img_bitmap.
// The operations run in command-line order on the qcow2 image opened
// read-write without its backing file; the first that fails stops the
// command ("Operation OP on bitmap NAME failed: <QEMU's reason>", exit 1),
// and what the earlier ones did is kept (stored when the image closes).
// --add makes a bitmap disabled if --disable is anywhere on the line.
// --merge SOURCE ORs bitmap SOURCE (of the -b image, opened read-only
// without backing, or of FILE) into BITMAP. The bitmap logic is
// qcow2::Qcow2Node's (qcow2/qcow2_bitmap.cc).
#include <getopt.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/errno_status.h"
#include "base/size.h"
#include "base/status_macros.h"
#include "imgtool/command.h"
#include "imgtool/image.h"
#include "io/block_node.h"

namespace imgtool::cli {
namespace {

constexpr char kUsage[] =
    "Usage: imgtool bitmap (--merge SOURCE | --add | --remove | --clear | "
    "--enable | --disable)... [-b SOURCE_FILE [-F SOURCE_FMT]] "
    "[-g GRANULARITY] [-f FMT] [--image-opts] FILE BITMAP";

constexpr char kHelp[] =
    "Usage: imgtool bitmap (--merge SOURCE | --add | --remove | --clear |\n"
    "        --enable | --disable)... [-b SOURCE_FILE [-F SOURCE_FMT]]\n"
    "        [-g GRANULARITY] [-f FMT] [--image-opts] [--object ...] FILE "
    "BITMAP\n"
    "Changes the persistent dirty bitmap BITMAP of the qcow2 image FILE.\n"
    "  --add             add it (enabled unless --disable is given too)\n"
    "  --remove          remove it\n"
    "  --clear           clear its bits\n"
    "  --enable/--disable  start/stop tracking writes in it\n"
    "  --merge SOURCE    set the bits of bitmap SOURCE in it\n"
    "  -b SOURCE_FILE    the image SOURCE lives in (-F: its format)\n"
    "  -g GRANULARITY    bytes per bit for --add (default: the cluster size\n"
    "                    within 4k..64k)\n";

enum LongOption {
  kObject = 256,
  kImageOpts,
  kAdd,
  kRemove,
  kClear,
  kEnable,
  kDisable,
  kMerge,
};

const struct option kLongOptions[] = {
    {"help", no_argument, nullptr, 'h'},
    {"object", required_argument, nullptr, kObject},
    {"image-opts", no_argument, nullptr, kImageOpts},
    {"add", no_argument, nullptr, kAdd},
    {"remove", no_argument, nullptr, kRemove},
    {"clear", no_argument, nullptr, kClear},
    {"enable", no_argument, nullptr, kEnable},
    {"disable", no_argument, nullptr, kDisable},
    {"merge", required_argument, nullptr, kMerge},
    {"granularity", required_argument, nullptr, 'g'},
    {"source-file", required_argument, nullptr, 'b'},
    {"source-format", required_argument, nullptr, 'F'},
    {nullptr, 0, nullptr, 0},
};

struct Action {
  int op;
  std::string src;  // --merge
};

const char* OpName(int op) {
  switch (op) {
    case kAdd: return "add";
    case kRemove: return "remove";
    case kClear: return "clear";
    case kEnable: return "enable";
    case kDisable: return "disable";
    default: return "merge";
  }
}

// qemu-img's cvtnum("granularity", ...): a size with suffixes up to
// INT64_MAX, its two-line error otherwise.
absl::StatusOr<uint64_t> ParseGranularity(const std::string& text) {
  absl::StatusOr<uint64_t> v = ParseSize(text);
  if (v.ok()) return *v;
  if (absl::StrContains(v.status().message(), "Must be between")) {
    return absl::InvalidArgumentError(
        "Invalid granularity specified. Must be between 0 and "
        "9223372036854775807.");
  }
  return PrefixEachLine(absl::InvalidArgumentError(
      "Invalid granularity specified. You may use k, M, G, T, P or E "
      "suffixes for\nkilobytes, megabytes, gigabytes, terabytes, petabytes "
      "and exabytes."));
}

}  // namespace

absl::Status RunBitmap(const std::vector<std::string>& args, Streams streams) {
  ImageSpec spec;
  spec.read_only = false;
  spec.no_backing = true;
  std::string src_filename;
  std::string src_format;
  bool have_src_format = false;
  uint64_t granularity = 0;
  bool add = false;
  bool add_disabled = false;
  bool merge = false;
  bool help = false;
  std::vector<Action> actions;
  ASSIGN_OR_RETURN(
      std::vector<std::string> operands,
      ParseOptions(args, "b:f:F:g:h", kLongOptions, kUsage,
                   [&](int c, const std::string& arg) -> absl::Status {
                     switch (c) {
                       case 'h': help = true; break;
                       case 'b': src_filename = arg; break;
                       case 'f': spec.format = arg; break;
                       case 'F':
                         src_format = arg;
                         have_src_format = true;
                         break;
                       case 'g': {
                         ASSIGN_OR_RETURN(granularity, ParseGranularity(arg));
                         break;
                       }
                       case kImageOpts: spec.image_opts = true; break;
                       case kAdd:
                         actions.push_back({kAdd, ""});
                         add = true;
                         break;
                       case kDisable:
                         actions.push_back({kDisable, ""});
                         add_disabled = true;
                         break;
                       case kRemove:
                       case kClear:
                       case kEnable:
                         actions.push_back({c, ""});
                         break;
                       case kMerge:
                         actions.push_back({kMerge, arg});
                         merge = true;
                         break;
                     }
                     return absl::OkStatus();
                   }));
  if (help) {
    streams.out << kHelp;
    return absl::OkStatus();
  }
  if (actions.empty()) {
    return absl::InvalidArgumentError(
        "Need at least one of --add, --remove, --clear, --enable, --disable, "
        "or --merge");
  }
  if (granularity != 0 && !add) {
    return absl::InvalidArgumentError("granularity only supported with --add");
  }
  if (have_src_format && src_filename.empty()) {
    return absl::InvalidArgumentError("-F only supported with -b");
  }
  if (!src_filename.empty() && !merge) {
    return absl::InvalidArgumentError(
        "Merge bitmap source file only supported with --merge");
  }
  if (operands.size() != 2) {
    return absl::InvalidArgumentError("Expecting filename and bitmap name");
  }
  if (spec.image_opts && !spec.format.empty()) {
    return absl::InvalidArgumentError(
        "--image-opts and --format are mutually exclusive");
  }
  spec.filename = operands[0];
  const std::string bitmap = operands[1];

  ASSIGN_OR_RETURN(OpenedImage image, OpenImage(spec, streams.err));
  OpenedImage src;
  if (!src_filename.empty()) {
    ImageSpec src_spec;
    src_spec.filename = src_filename;
    src_spec.format = src_format;
    src_spec.no_backing = true;
    absl::StatusOr<OpenedImage> opened =
        OpenImage(src_spec, streams.err, image.engine);
    if (!opened.ok()) {
      CloseImage(image).IgnoreError();
      return opened.status();
    }
    src = *std::move(opened);
  }
  qcow2::Qcow2Node* q = image.qcow2;
  const qcow2::Qcow2Node* src_q =
      src_filename.empty() ? q : src.qcow2;
  absl::Status result;
  if (q != nullptr) {
    // QEMU's read-write open marks the bitmaps in use; its close stores
    // them again whatever the operations did.
    result = io::RunSync(*image.engine, q->PrepareBitmapChanges());
  }
  for (const Action& act : actions) {
    if (!result.ok()) break;
    absl::Status st;
    if (q == nullptr) {
      // Only qcow2 stores bitmaps; QEMU's generic answers for other formats.
      st = act.op == kAdd
               ? absl::UnimplementedError(absl::StrCat(
                     "Can't store persistent bitmaps to ", spec.filename,
                     ": Operation not supported"))
               : absl::NotFoundError(
                     absl::StrCat("Dirty bitmap '", bitmap, "' not found"));
    } else {
      switch (act.op) {
        case kAdd:
          st = io::RunSync(*image.engine,
                           q->AddBitmap(bitmap, static_cast<uint32_t>(
                                                    std::min<uint64_t>(
                                                        granularity,
                                                        UINT32_MAX)),
                                        add_disabled));
          if (granularity > UINT32_MAX) {
            st = absl::InvalidArgumentError(
                "Granularity must be power of 2 and at least 512");
          }
          break;
        case kRemove:
          st = io::RunSync(*image.engine, q->RemoveBitmap(bitmap));
          break;
        case kClear:
          st = io::RunSync(*image.engine, q->ClearBitmap(bitmap));
          break;
        case kEnable:
          st = io::RunSync(*image.engine, q->EnableBitmap(bitmap, true));
          break;
        case kDisable:
          st = io::RunSync(*image.engine, q->EnableBitmap(bitmap, false));
          break;
        case kMerge:
          if (src_q == nullptr) {
            st = absl::NotFoundError(
                absl::StrCat("Dirty bitmap '", act.src, "' not found"));
          } else {
            st = io::RunSync(*image.engine,
                             q->MergeBitmap(bitmap, *src_q, act.src));
          }
          break;
      }
    }
    if (!st.ok()) {
      result = WithMessage(st, absl::StrCat("Operation ", OpName(act.op),
                                            " on bitmap ", bitmap,
                                            " failed: ", st.message()));
      break;
    }
  }
  if (src.node != nullptr) CloseImage(src).IgnoreError();
  absl::Status closed = CloseImage(image);
  RETURN_IF_ERROR(result);
  return closed;
}

}  // namespace imgtool::cli
