// imgtool convert [-f FMT] [-O FMT] [-o OPTS] [-S SPARSE] [-m N] [-W] [-n]
// [--target-is-zero] [-t CACHE] [-T SRC_CACHE] [-p] [-q] [-U] SRC... DST:
// copies the concatenation of the source images into DST as qemu-img 7.2
// does. The copy works on any io::BlockNode: block status through the
// backing chain says which ranges hold data; ranges that read as zeroes are
// skipped (or written as zeroes when the target may hold old data), and
// zeroes inside data ranges are found by scanning the buffer in 512-byte
// sectors, so the target stays sparse. Up to -m coroutines copy chunks of at
// most 2 MiB each, writing in order unless -W. All images of the command
// share one engine. Targets: raw (posix_file::CreateFile) and qcow2 (the
// create options of `imgtool create -f qcow2`, -B/-F backing files, -c
// compressed clusters through qcow2::Qcow2Node::WriteCompressed).
#include <getopt.h>
#include <sys/stat.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "absl/types/span.h"
#include "base/align.h"
#include "base/errno_status.h"
#include "base/options.h"
#include "base/size.h"
#include "base/status_macros.h"
#include "block/copy.h"
#include "block/progress.h"
#include "block/registry.h"
#include "imgtool/command.h"
#include "imgtool/image.h"
#include "imgtool/snapshot_load.h"
#include "imgtool/qcow2_create.h"
#include "io/block_node.h"
#include "io/engine.h"
#include "io/task.h"
#include "posix_file/file_node.h"
#include "posix_file/file_options.pb.h"
#include "qcow2/qcow2_node.h"

namespace imgtool::cli {
namespace {

constexpr char kUsage[] =
    "Usage: imgtool convert [-f FMT] [-O FMT] [-o OPTIONS] [-S SPARSE_SIZE] "
    "[-r RATE_LIMIT] [-m N] [-W] [-n] [--target-is-zero] [-t CACHE] "
    "[-T SRC_CACHE] [-p] [-q] [-U] SRC... DST";

constexpr char kHelp[] =
    "Usage: imgtool convert [-f FMT] [-O FMT] [-o OPTIONS] [-S SPARSE_SIZE] "
    "[-r RATE_LIMIT]\n"
    "        [-m N] [-W] [-n] [--target-is-zero] [-t CACHE] [-T SRC_CACHE] [-p] [-q] [-U] "
    "SRC... DST\n"
    "Copies the images SRC... (concatenated) into the new image DST.\n"
    "  -f FMT            format of the sources (raw, file, qcow2); probed if "
    "absent\n"
    "  --image-opts      the sources are option strings (driver=qcow2,...)\n"
    "  --target-image-opts  DST is an option string (needs -n)\n"
    "  -O FMT            format of DST: raw (default), file or qcow2\n"
    "  -B BACKING        backing file of a qcow2 DST (needs -F)\n"
    "  -F BACKING_FMT    format of the backing file\n"
    "  -c                write compressed clusters (qcow2 DST)\n"
    "  -o OPTIONS        create options of DST; '-o help' lists them\n"
    "  -S SPARSE_SIZE    zero runs of at least this size (multiple of 512, "
    "default 4k)\n"
    "                    become holes; 0 writes every byte\n"
    "  -r RATE_LIMIT     write at most this many bytes per second (k, M, G "
    "suffixes)\n"
    "  -m N              requests in flight (1..16, default 8)\n"
    "  -W                write out of order (faster; default: in order)\n"
    "  -n                DST exists: do not create it\n"
    "  --target-is-zero  with -n: DST reads as zeroes, skip writing zeroes\n"
    "  -t CACHE          cache mode of DST (default unsafe)\n"
    "  -T SRC_CACHE      cache mode of the sources (default writeback)\n"
    "  -p                show progress\n"
    "  -q                quiet\n"
    "  -U, --force-share open the sources without taking their locks\n";

// The create options of raw over `file`, as `-o help` lists them (the same
// text as `imgtool create`).
constexpr char kSizeHelp[] = "  size=<size>            - Virtual disk size\n";
constexpr char kFileOptionsHelp[] =
    "  extent_size_hint=<size> - Extent size hint for the image file, 0 to "
    "disable\n"
    "  nocow=<bool (on/off)>  - Turn off copy-on-write (valid only on btrfs)\n"
    "  preallocation=<str>    - Preallocation mode (allowed values: off, "
    "falloc, full)\n"
    "  size=<size>            - Virtual disk size\n";
constexpr char kProtocolHint[] =
    "\nThe protocol level may support further options.\n"
    "Specify the target filename to include those options.\n";

using block::kSectorSize;
// The largest -S (qemu-img's MAX_BUF_SECTORS sectors).
constexpr uint64_t kMaxSparseSize = 16 << 20;
constexpr int kMaxCoroutines = 16;

enum LongOption {
  kObject = 256,
  kImageOpts,
  kTargetImageOpts,
  kTargetIsZero,
  kBitmaps,
  kSkipBrokenBitmaps,
  kSalvage,
};

const struct option kLongOptions[] = {
    {"help", no_argument, nullptr, 'h'},
    {"object", required_argument, nullptr, kObject},
    {"image-opts", no_argument, nullptr, kImageOpts},
    {"target-image-opts", no_argument, nullptr, kTargetImageOpts},
    {"target-is-zero", no_argument, nullptr, kTargetIsZero},
    {"bitmaps", no_argument, nullptr, kBitmaps},
    {"skip-broken-bitmaps", no_argument, nullptr, kSkipBrokenBitmaps},
    {"salvage", no_argument, nullptr, kSalvage},
    {"force-share", no_argument, nullptr, 'U'},
    {nullptr, 0, nullptr, 0},
};

// Applies one -o argument to the create options of a raw target. `size` is
// checked but later replaced by the sources' total, as qemu-img does.
absl::Status ApplyCreateOptions(const std::string& text,
                                posix_file::FileCreateOptions* options) {
  ASSIGN_OR_RETURN(OptionList list, ParseOptionString(text));
  for (const auto& [key, value] : list) {
    if (key == "help") continue;
    if (key == "size") {
      RETURN_IF_ERROR(ParseSizeOption(key, value).status());
    } else if (key == "nocow") {
      ASSIGN_OR_RETURN(bool nocow, ParseBoolOption(key, value));
      options->set_nocow(nocow);
    } else if (key == "preallocation") {
      options->set_preallocation(value);
    } else if (key == "extent_size_hint") {
      ASSIGN_OR_RETURN(uint64_t hint, ParseSizeOption(key, value));
      options->set_extent_size_hint(hint);
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("Invalid parameter '", key, "'"));
    }
  }
  return absl::OkStatus();
}

bool HasHelpOption(const std::vector<std::string>& option_texts) {
  for (const std::string& text : option_texts) {
    absl::StatusOr<OptionList> list = ParseOptionString(text);
    if (!list.ok()) continue;
    for (const auto& item : *list) {
      if (item.first == "help") return true;
    }
  }
  return false;
}

// cvtnum() of qemu-img: `what` names the value in the error.
absl::StatusOr<uint64_t> ParseNumber(const std::string& what,
                                     const std::string& text) {
  absl::StatusOr<uint64_t> v = ParseSize(text);
  if (v.ok()) return v;
  return PrefixEachLine(absl::InvalidArgumentError(absl::StrReplaceAll(
      v.status().message(), {{"Invalid image size", "Invalid " + what}})));
}

// Creates the target, as `imgtool create` would, with the sources' total
// size. Errors are qemu-img's "<dst>: error while converting <fmt>: ...".
absl::Status CreateTarget(const std::string& filename,
                          const std::string& format,
                          posix_file::FileCreateOptions options, uint64_t size,
                          std::ostream& err) {
  options.set_size(size);
  absl::Status st = CreateFileForFormat(format, filename, options, err);
  if (st.ok()) return st;
  absl::string_view cause = st.message();
  absl::ConsumePrefix(&cause, absl::StrCat(filename, ": "));
  return absl::Status(
      st.code(),
      absl::StrCat(filename, ": error while converting ", format, ": ", cause));
}

// Whether a freshly created target reads as zeroes everywhere (QEMU's
// has_zero_init): true for regular files, not for block devices. In an NBD
// export (never zero itself) a new qcow2 image is (qcow2_has_zero_init:
// not preallocated).
bool CreatedTargetIsZero(const std::string& filename,
                         const std::string& format) {
  if (IsNbdName(filename)) return format == "qcow2";
  struct stat st;
  return stat(filename.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

struct ConvertArgs {
  std::string source_format;
  std::string target_format;
  std::string cache = "unsafe";
  std::string source_cache = "writeback";
  std::vector<std::string> option_texts;
  std::optional<std::string> backing_file;
  std::optional<std::string> backing_format;
  std::optional<std::string> snapshot;
  uint64_t min_sparse = 4096;
  bool explicit_min_sparse = false;
  int num_coroutines = 8;
  bool in_order = true;
  bool copy_range = false;
  bool compress = false;
  bool progress = false;
  bool quiet = false;
  bool skip_create = false;
  bool target_is_zero = false;
  bool force_share = false;
  bool image_opts = false;
  bool target_image_opts = false;
  bool bitmaps = false;
  bool skip_broken_bitmaps = false;
  bool salvage = false;
  uint64_t rate_limit = 0;
};

absl::Status ParseOption(int c, const std::string& arg, ConvertArgs& a,
                         bool& help, std::ostream& err) {
  switch (c) {
    case 'h':
      help = true;
      break;
    case 'f':
      a.source_format = arg;
      break;
    case 'O':
      a.target_format = arg;
      break;
    case 'B':
      a.backing_file = arg;
      break;
    case 'F':
      a.backing_format = arg;
      break;
    case 'C':
      a.copy_range = true;
      break;
    case 'c':
      a.compress = true;
      break;
    case 'o':
      if (!IsValidOptionList(arg)) {
        return absl::InvalidArgumentError(
            absl::StrCat("Invalid option list: ", arg));
      }
      a.option_texts.push_back(arg);
      break;
    case 'l':
      RETURN_IF_ERROR(CheckSnapshotOption(arg, err));
      a.snapshot = arg;
      break;
    case 'S': {
      ASSIGN_OR_RETURN(uint64_t size,
                       ParseNumber("buffer size for sparse output", arg));
      if (size % kSectorSize != 0 || size > kMaxSparseSize) {
        return absl::InvalidArgumentError(absl::StrCat(
            "Invalid buffer size for sparse output specified. Valid sizes "
            "are multiples of ",
            kSectorSize, " up to ", kMaxSparseSize,
            ". Select 0 to disable sparse detection (fully allocates "
            "output)."));
      }
      a.min_sparse = size;
      a.explicit_min_sparse = true;
      break;
    }
    case 'p':
      a.progress = true;
      break;
    case 't':
      a.cache = arg;
      break;
    case 'T':
      a.source_cache = arg;
      break;
    case 'n':
      a.skip_create = true;
      break;
    case 'm': {
      absl::StatusOr<uint64_t> n = ParseSize(arg);
      if (!n.ok() || *n < 1 || *n > kMaxCoroutines) {
        return absl::InvalidArgumentError(absl::StrCat(
            "Invalid number of coroutines. Allowed number of coroutines is "
            "between 1 and ",
            kMaxCoroutines));
      }
      a.num_coroutines = static_cast<int>(*n);
      break;
    }
    case 'W':
      a.in_order = false;
      break;
    case 'U':
      a.force_share = true;
      break;
    case 'r': {
      ASSIGN_OR_RETURN(a.rate_limit, ParseNumber("rate limit", arg));
      break;
    }
    case 'q':
      a.quiet = true;
      break;
    case kImageOpts:
      a.image_opts = true;
      break;
    case kTargetImageOpts:
      a.target_image_opts = true;
      break;
    case kTargetIsZero:
      a.target_is_zero = true;
      break;
    case kBitmaps:
      a.bitmaps = true;
      break;
    case kSkipBrokenBitmaps:
      a.skip_broken_bitmaps = true;
      break;
    case kSalvage:
      a.salvage = true;
      break;
  }
  return absl::OkStatus();
}

// The checks qemu-img makes on the options alone, in its order.
absl::Status CheckOptions(const ConvertArgs& a) {
  if (a.skip_broken_bitmaps && !a.bitmaps) {
    return absl::InvalidArgumentError(
        "Use of --skip-broken-bitmaps requires --bitmaps");
  }
  if (a.compress && a.copy_range) {
    return absl::InvalidArgumentError(
        "Cannot enable copy offloading when -c is used");
  }
  if (a.explicit_min_sparse && a.copy_range) {
    return absl::InvalidArgumentError(
        "Cannot enable copy offloading when -S is used");
  }
  if (a.copy_range && a.salvage) {
    return absl::InvalidArgumentError(
        "Cannot use copy offloading in salvaging mode");
  }
  if (a.target_image_opts && !a.skip_create) {
    return absl::InvalidArgumentError(
        "--target-image-opts requires use of -n flag");
  }
  if (a.skip_create && !a.option_texts.empty()) {
    return absl::InvalidArgumentError(
        "-o has no effect when skipping image creation");
  }
  if (a.target_is_zero && !a.skip_create) {
    return absl::InvalidArgumentError(
        "--target-is-zero requires use of -n flag");
  }
  return absl::OkStatus();
}

// Closes every image, the last opened (the target) first; the first error
// wins.
absl::Status CloseAll(std::vector<OpenedImage>& images) {
  absl::Status first;
  for (auto it = images.rbegin(); it != images.rend(); ++it) {
    absl::Status st = CloseImage(*it);
    if (first.ok() && !st.ok()) first = st;
  }
  return first;
}

// Fails like qemu-img for what the target cannot do: a backing file for a
// new raw image, compression, bitmaps.
absl::Status CheckTargetFeatures(const ConvertArgs& a, size_t num_sources,
                                 const std::string& target_format,
                                 const Qcow2CreateValues& qcow2_values) {
  if (a.target_is_zero && a.backing_file.has_value()) {
    return absl::InvalidArgumentError(
        "Cannot use --target-is-zero when the destination image has a "
        "backing file");
  }
  if (num_sources > 1 && a.backing_file.has_value()) {
    return absl::InvalidArgumentError(
        "Having a backing file for the target makes no sense when "
        "concatenating multiple input images");
  }
  if (!a.skip_create && target_format == "qcow2" &&
      qcow2_values.Has("backing_file") && !qcow2_values.Has("backing_fmt")) {
    return absl::InvalidArgumentError(
        "Use of backing file requires explicit backing format");
  }
  if (a.compress) {
    // With -n the target's format is known only once it is open
    // (--target-image-opts names it in its options): Copy() checks then,
    // after the open errors, as qemu-img does.
    if (!a.skip_create && target_format != "qcow2") {
      return absl::InvalidArgumentError(
          "Compression not supported for this file format");
    }
    if (qcow2_values.Has("encryption") || qcow2_values.Has("encrypt.format")) {
      return absl::InvalidArgumentError(
          "Compression and encryption not supported at the same time");
    }
    if (qcow2_values.Text("preallocation").value_or("off") != "off") {
      return absl::InvalidArgumentError(
          "Compression and preallocation not supported at the same time");
    }
  }
  return absl::OkStatus();
}

// qemu-img 7.2's convert_check_bitmaps: a qcow2 source, and (unless
// --skip-broken-bitmaps) no inconsistent bitmap, named in QEMU's order
// (its list holds them last-loaded first).
absl::Status CheckSourceBitmaps(const ConvertArgs& a, const OpenedImage& src) {
  if (src.qcow2 == nullptr) {
    return absl::InvalidArgumentError("Source lacks bitmap support");
  }
  if (a.skip_broken_bitmaps) return absl::OkStatus();
  const std::vector<qcow2::Qcow2Node::BitmapInfo> bitmaps =
      src.qcow2->Bitmaps();
  for (auto it = bitmaps.rbegin(); it != bitmaps.rend(); ++it) {
    if (it->inconsistent) {
      return absl::FailedPreconditionError(absl::StrCat(
          "Cannot copy inconsistent bitmap '", it->name,
          "'\nTry --skip-broken-bitmaps, or use 'qemu-img bitmap --remove' "
          "to delete it"));
    }
  }
  return absl::OkStatus();
}

// qemu-img 7.2's convert_copy_bitmaps: each bitmap of the source added to
// the target (same granularity, same enabled state) with the source's bits;
// inconsistent ones skipped with a warning. The target's directory lists
// them in the source's order, as QEMU's does.
absl::Status CopyBitmaps(const ConvertArgs& a, const OpenedImage& src,
                         OpenedImage& target, Streams streams) {
  if (target.qcow2 == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Format driver '", target.format, "' does not support bitmaps"));
  }
  const std::vector<qcow2::Qcow2Node::BitmapInfo> bitmaps =
      src.qcow2->Bitmaps();
  for (auto it = bitmaps.rbegin(); it != bitmaps.rend(); ++it) {
    if (it->inconsistent && a.skip_broken_bitmaps) {
      streams.err << ProgramName() << ": warning: Skipping inconsistent bitmap '"
                  << it->name << "'\n";
    }
  }
  for (const qcow2::Qcow2Node::BitmapInfo& b : bitmaps) {
    if (b.inconsistent) continue;
    absl::Status st = io::RunSync(
        *target.engine, target.qcow2->AddBitmap(b.name, b.granularity,
                                                /*disabled=*/!b.enabled));
    if (!st.ok()) {
      return WithMessage(st, absl::StrCat("Failed to create bitmap ", b.name,
                                          ": ", st.message()));
    }
    st = io::RunSync(*target.engine,
                     target.qcow2->MergeBitmap(b.name, *src.qcow2, b.name));
    if (!st.ok()) {
      io::RunSync(*target.engine, target.qcow2->RemoveBitmap(b.name))
          .IgnoreError();
      return WithMessage(st, absl::StrCat("Failed to populate bitmap ",
                                          b.name, ": ", st.message()));
    }
  }
  return absl::OkStatus();
}

// Copies the opened sources into the opened target.
absl::Status Copy(const ConvertArgs& a, absl::Span<OpenedImage> sources,
                  OpenedImage& target, const std::string& target_name,
                  block::Progress& progress) {
  uint64_t total = 0;
  // The target's backing file (-B) provides what the sources' backing
  // chains did: only their top nodes count.
  const block::SourceView view = a.backing_file.has_value()
                                     ? block::SourceView::kTopOnly
                                     : block::SourceView::kWholeChain;
  std::vector<block::CopySource> copy_sources;
  for (OpenedImage& image : sources) {
    const uint64_t length = VirtualSize(image);
    copy_sources.push_back(
        block::CopySource{image.node.get(), total, length, view, nullptr});
    total += length;
  }
  if (a.compress && target.qcow2 == nullptr) {
    return absl::InvalidArgumentError(
        "Compression not supported for this file format");
  }
  if (a.skip_create && VirtualSize(target) < total) {
    return absl::InvalidArgumentError("output file is smaller than input file");
  }
  block::CopySettings settings;
  settings.min_sparse_sectors = a.min_sparse / kSectorSize;
  // qemu-img aligns runs to the largest power of two <= -S (the request
  // alignment of a format node, 1 byte, is never larger).
  settings.alignment_sectors = 1;
  while (settings.alignment_sectors * 2 <= settings.min_sparse_sectors) {
    settings.alignment_sectors *= 2;
  }
  settings.target_is_zero =
      a.target_is_zero ||
      (!a.skip_create && a.min_sparse != 0 && !a.backing_file.has_value() &&
       CreatedTargetIsZero(target_name, a.target_format));
  // -S 0 writes zero ranges as data.
  settings.zero_ranges_as_data = a.min_sparse == 0;
  settings.in_order = a.in_order;
  settings.copy_whole_chunks = a.copy_range;
  settings.num_workers = a.num_coroutines;
  settings.rate_limit = a.rate_limit;
  if (a.progress && !a.quiet) settings.progress = &progress;
  if (a.compress) {
    settings.compressed_target = target.qcow2;
    settings.compressed_cluster_size = target.qcow2->cluster_size();
  }
  if (a.backing_file.has_value() && !a.skip_create &&
      target.node->backing() != nullptr) {
    settings.target_backing_end =
        AlignUp(target.node->backing()->size(), kSectorSize);
  }

  // Every image was opened on the target's engine.
  return io::RunSync(*target.engine, block::Copy(std::move(copy_sources),
                                                 *target.node, settings));
}

// Everything after the option checks, in qemu-img's order: open the
// sources, create and open the target, copy.
absl::Status Convert(ConvertArgs a,
                     const std::vector<std::string>& source_names,
                     const std::string& target_name, block::Progress& progress,
                     std::vector<OpenedImage>& images, Streams streams) {
  uint64_t total = 0;
  std::shared_ptr<io::Engine> engine;
  for (const std::string& name : source_names) {
    ImageSpec spec;
    spec.filename = name;
    spec.format = a.source_format;
    spec.image_opts = a.image_opts;
    spec.cache = *CacheMode(a.source_cache);
    spec.read_only = true;
    spec.force_share = a.force_share;
    // As qemu-img, keep writers (and convert onto itself) out.
    spec.unshare_write = true;
    spec.queue_depth = a.num_coroutines;
    spec.nbd_connections = kNbdCopyConnections;
    absl::StatusOr<OpenedImage> opened = OpenImage(spec, streams.err, engine);
    if (!opened.ok() && !a.image_opts && !a.skip_create &&
        block::IsUnsupportedQemuDriver(a.source_format) &&
        block::QemuDriverCannotCreate(a.target_format)) {
      // A source in a format QEMU reads and imgtool does not (-f bochs):
      // qemu-img would have opened it and failed next on the target's
      // format, which cannot create images (iotest 113).
      return CheckFormat(a.target_format, /*for_create=*/true);
    }
    if (!opened.ok()) return opened.status();
    OpenedImage image = *std::move(opened);
    engine = image.engine;
    total += VirtualSize(image);
    images.push_back(std::move(image));
  }
  const size_t num_sources = images.size();
  if (a.bitmaps) {
    if (num_sources > 1) {
      return absl::InvalidArgumentError(
          "Copying bitmaps only possible with single source");
    }
    RETURN_IF_ERROR(CheckSourceBitmaps(a, images[0]));
  }
  if (a.snapshot.has_value()) {
    if (num_sources > 1) {
      return absl::InvalidArgumentError(
          "No support for concatenating multiple snapshot");
    }
    absl::Status loaded = LoadSnapshot(images[0], *a.snapshot, streams.err);
    if (!loaded.ok()) {
      CloseAll(images).IgnoreError();
      return loaded;
    }
  }

  const std::string target_format =
      a.target_format.empty() ? "raw" : a.target_format;
  posix_file::FileCreateOptions create_options;
  Qcow2CreateValues qcow2_values;
  if (!a.skip_create && target_format == "qcow2") {
    for (const std::string& text : a.option_texts) {
      RETURN_IF_ERROR(qcow2_values.Apply(text));
    }
    // The size is the sources' total; -B and -F override -o.
    qcow2_values.SetNumber("size", total);
    if (a.backing_file.has_value()) {
      qcow2_values.SetString("backing_file", *a.backing_file);
    }
    if (a.backing_format.has_value()) {
      qcow2_values.SetString("backing_fmt", *a.backing_format);
    }
    a.backing_file = qcow2_values.Text("backing_file");
  } else if (!a.skip_create) {
    RETURN_IF_ERROR(CheckFormat(target_format, /*for_create=*/true));
    for (const std::string& text : a.option_texts) {
      RETURN_IF_ERROR(ApplyCreateOptions(text, &create_options));
    }
    // Neither raw nor file has a backing file.
    if (a.backing_file.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Backing file not supported for file format '", target_format, "'"));
    }
    if (a.backing_format.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("Backing file format not supported for file format '",
                       target_format, "'"));
    }
  }
  RETURN_IF_ERROR(
      CheckTargetFeatures(a, num_sources, target_format, qcow2_values));
  if (!a.skip_create && target_format == "qcow2") {
    absl::Status st = CreateQcow2File(target_name, qcow2_values, streams.err);
    if (!st.ok()) {
      return absl::Status(st.code(),
                          absl::StrCat(target_name,
                                       ": error while converting qcow2: ",
                                       st.message()));
    }
  } else if (!a.skip_create) {
    RETURN_IF_ERROR(CreateTarget(target_name, target_format, create_options,
                                 total, streams.err));
  }

  const std::optional<std::string> cache = CacheMode(a.cache);
  if (!cache.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Invalid cache option: ", a.cache));
  }
  ImageSpec spec;
  spec.filename = target_name;
  // With --target-image-opts only an explicit -O clashes (qemu-img's
  // "--image-opts and --format are mutually exclusive").
  spec.format = a.target_image_opts ? a.target_format : target_format;
  spec.image_opts = a.target_image_opts;
  spec.cache = *cache;
  spec.read_only = false;
  spec.queue_depth = a.num_coroutines;
  spec.nbd_connections = kNbdCopyConnections;
  ASSIGN_OR_RETURN(OpenedImage target, OpenImage(spec, streams.err, engine));
  images.push_back(std::move(target));
  if (a.bitmaps && images.back().qcow2 == nullptr) {
    // qemu-img 7.2 checks once the target is created and open.
    return absl::InvalidArgumentError(absl::StrCat(
        "Format driver '", images.back().format,
        "' does not support bitmaps"));
  }
  RETURN_IF_ERROR(Copy(a, absl::MakeSpan(images).first(num_sources),
                       images.back(), target_name, progress));
  if (a.bitmaps) RETURN_IF_ERROR(CopyBitmaps(a, images[0], images.back(), streams));
  return absl::OkStatus();
}

}  // namespace

absl::Status RunConvert(const std::vector<std::string>& args, Streams streams) {
  ConvertArgs a;
  bool help = false;
  ASSIGN_OR_RETURN(
      std::vector<std::string> operands,
      ParseOptions(args, "hf:O:B:Cco:l:S:pt:T:nm:WUr:qF:", kLongOptions, kUsage,
                   [&](int c, const std::string& arg) {
                     return ParseOption(c, arg, a, help, streams.err);
                   }));
  if (help) {
    streams.out << kHelp;
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(CheckOptions(a));
  const std::string target_format =
      a.target_format.empty() ? "raw" : a.target_format;
  if (HasHelpOption(a.option_texts)) {
    RETURN_IF_ERROR(CheckFormat(target_format, /*for_create=*/true));
    if (target_format == "qcow2") {
      if (operands.size() >= 2) {
        streams.out << "Supported options:\n" << Qcow2OptionHelp(true);
      } else {
        streams.out << "Supported qcow2 options:\n"
                    << Qcow2OptionHelp(false) << kProtocolHint;
      }
    } else if (operands.size() >= 2) {
      streams.out << "Supported options:\n" << kFileOptionsHelp;
    } else if (target_format == "file") {
      streams.out << "Supported file options:\n"
                  << kFileOptionsHelp << kProtocolHint;
    } else {
      streams.out << "Supported raw options:\n" << kSizeHelp << kProtocolHint;
    }
    return absl::OkStatus();
  }
  if (operands.size() < 2) {
    return absl::InvalidArgumentError("Must specify image file name");
  }
  if (a.salvage) {
    return absl::UnimplementedError("--salvage is not supported yet");
  }
  if (!CacheMode(a.source_cache).has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Invalid source cache option: ", a.source_cache));
  }
  const std::vector<std::string> source_names(operands.begin(),
                                              operands.end() - 1);
  const std::string& target_name = operands.back();

  block::Progress progress(a.progress && !a.quiet, 1.0f, streams.out);
  progress.Print(0, 100);
  std::vector<OpenedImage> images;
  absl::Status status =
      Convert(a, source_names, target_name, progress, images, streams);
  absl::Status closed = CloseAll(images);
  if (status.ok()) status = closed;
  if (status.ok()) progress.Print(100, 0);
  progress.End();
  return status;
}

}  // namespace imgtool::cli
