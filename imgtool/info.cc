// imgtool info [-f FMT] [--output=human|json] [--backing-chain] [-U] FILE:
// qemu-img 7.2's image information for raw and qcow2 images (human lines or
// JSON from info.proto). As qemu-img, the image is opened without its
// backing file; --backing-chain opens each file of the chain in turn.
#include <getopt.h>

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/json_printer.h"
#include "base/size.h"
#include "base/status_macros.h"
#include "imgtool/command.h"
#include "imgtool/image.h"
#include "imgtool/info.pb.h"
#include "imgtool/snapshot_list.h"
#include "io/block_node.h"
#include "io/engine.h"
#include "qcow2/qcow2_node.h"

namespace imgtool::cli {
namespace {

constexpr char kUsage[] =
    "Usage: imgtool info [-f FMT] [--output=human|json] [--backing-chain] "
    "[-U] FILE";

constexpr char kHelp[] =
    "Usage: imgtool info [-f FMT] [--output=human|json] [--backing-chain] "
    "[-U] FILE\n"
    "Shows the format, virtual size, disk size and format details of an "
    "image.\n"
    "  -f FMT                image format (raw, file, qcow2); probed if "
    "absent\n"
    "  --image-opts          FILE is an option string such as\n"
    "                        driver=qcow2,file.driver=preallocate,"
    "file.file.filename=x\n"
    "  --output=human|json   output format (default human)\n"
    "  -U, --force-share     open read-only without taking the image locks\n"
    "  --backing-chain       show every image of the backing chain\n";

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
  if (info.has_cluster_size()) {
    absl::StrAppend(&text, "cluster_size: ", info.cluster_size(), "\n");
  }
  if (info.dirty_flag()) absl::StrAppend(&text, "cleanly shut down: no\n");
  if (info.has_backing_filename()) {
    absl::StrAppend(&text, "backing file: ", info.backing_filename());
    if (!info.has_full_backing_filename()) {
      // A relative name on a node without a directory (quorum).
      absl::StrAppend(&text, " (cannot determine actual path)");
    } else if (info.full_backing_filename() != info.backing_filename()) {
      absl::StrAppend(&text, " (actual path: ", info.full_backing_filename(),
                      ")");
    }
    absl::StrAppend(&text, "\n");
  }
  if (info.has_backing_filename_format()) {
    absl::StrAppend(&text, "backing file format: ",
                    info.backing_filename_format(), "\n");
  }
  if (info.snapshots_size() > 0) {
    absl::StrAppend(&text, FormatSnapshotList(info.snapshots()));
  }
  if (info.has_format_specific()) {
    // QEMU dumps the data dictionary with '-' in keys shown as ' '.
    const Qcow2SpecificInfo& q = info.format_specific().data();
    absl::StrAppend(&text, "Format specific information:\n");
    auto flag = [](bool b) { return b ? "true" : "false"; };
    if (q.has_compat()) {
      absl::StrAppend(&text, "    compat: ", q.compat(), "\n");
    }
    if (q.has_compression_type()) {
      absl::StrAppend(&text, "    compression type: ", q.compression_type(),
                      "\n");
    }
    if (q.has_lazy_refcounts()) {
      absl::StrAppend(&text, "    lazy refcounts: ", flag(q.lazy_refcounts()),
                      "\n");
    }
    if (q.bitmaps_size() > 0) {
      absl::StrAppend(&text, "    bitmaps:\n");
      for (int i = 0; i < q.bitmaps_size(); ++i) {
        const Qcow2BitmapInfo& bm = q.bitmaps(i);
        absl::StrAppend(&text, "        [", i, "]:\n", "            flags:\n");
        for (int k = 0; k < bm.flags_always_size(); ++k) {
          absl::StrAppend(&text, "                [", k,
                          "]: ", bm.flags_always(k), "\n");
        }
        absl::StrAppend(&text, "            name: ", bm.name(), "\n",
                        "            granularity: ", bm.granularity(), "\n");
      }
    }
    if (q.has_refcount_bits()) {
      absl::StrAppend(&text, "    refcount bits: ", q.refcount_bits(), "\n");
    }
    if (q.has_corrupt()) {
      absl::StrAppend(&text, "    corrupt: ", flag(q.corrupt()), "\n");
    }
    if (q.has_extended_l2()) {
      absl::StrAppend(&text, "    extended l2: ", flag(q.extended_l2()), "\n");
    }
  }
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

// The information of one opened image (qemu-img's bdrv_query_image_info).
absl::StatusOr<ImageInfo> Describe(const OpenedImage& image,
                                   const std::string& filename) {
  ImageInfo info;
  info.set_virtual_size(VirtualSize(image));
  info.set_filename(filename);
  info.set_format(image.format);
  if (absl::StatusOr<uint64_t> allocated = image.node->AllocatedSize();
      allocated.ok()) {
    info.set_actual_size(*allocated);
  }
  // QEMU's bdrv_get_info answers (dirty-flag false) for qcow2 and for the
  // file driver, through raw and filters; not for null-co.
  if (image.file != nullptr || image.qcow2_below != nullptr) {
    info.set_dirty_flag(false);
  }
  if (const qcow2::Qcow2Node* q = image.qcow2; q != nullptr) {
    info.set_cluster_size(q->cluster_size());
    info.set_dirty_flag(q->dirty());
    if (!q->backing_filename().empty()) {
      info.set_backing_filename(q->backing_filename());
      if (!q->full_backing_filename().empty()) {
        info.set_full_backing_filename(q->full_backing_filename());
      }
    }
    if (!q->backing_format().empty()) {
      info.set_backing_filename_format(q->backing_format());
    }
    ASSIGN_OR_RETURN(std::vector<qcow2::Qcow2Node::SnapshotRecord> snapshots,
                     io::RunSync(*image.engine, image.qcow2->Snapshots()));
    for (const auto& sn : snapshots) {
      *info.add_snapshots() = SnapshotInfoOf(sn);
    }
    FormatSpecificInfo* specific = info.mutable_format_specific();
    specific->set_type("qcow2");
    Qcow2SpecificInfo* data = specific->mutable_data();
    data->set_compat(q->compat());
    data->set_compression_type(q->header().compression_type == 0 ? "zlib"
                                                                  : "zstd");
    if (q->header().version >= 3) data->set_lazy_refcounts(q->lazy_refcounts());
    for (const qcow2::Qcow2Node::BitmapInfo& b : q->Bitmaps()) {
      Qcow2BitmapInfo* bm = data->add_bitmaps();
      if (b.in_use) bm->add_flags_always("in-use");
      if (b.enabled) bm->add_flags_always("auto");
      bm->set_name(b.name);
      bm->set_granularity(b.granularity);
    }
    data->set_refcount_bits(q->refcount_bits());
    if (q->header().version >= 3) {
      data->set_corrupt(q->corrupt());
      data->set_extended_l2(q->extended_l2());
    }
  } else if (image.qcow2_below != nullptr) {
    // A raw format or a filter over a qcow2 node: QEMU's bdrv_get_info
    // answers with the qcow2 node's cluster size.
    info.set_cluster_size(image.qcow2_below->cluster_size());
  } else if (image.format != "qcow2" && image.file != nullptr) {
    if (std::optional<uint64_t> hint = image.file->ExtentSizeHint();
        hint.has_value() && *hint != 0) {
      info.set_extent_size_hint(*hint);
    }
  }
  return info;
}

}  // namespace

absl::Status RunInfo(const std::vector<std::string>& args, Streams streams) {
  ImageSpec spec;
  std::string output = "human";
  bool help = false;
  bool backing_chain = false;
  ASSIGN_OR_RETURN(
      std::vector<std::string> operands,
      ParseOptions(args, "f:hU", kLongOptions, kUsage,
                   [&](int c, const std::string& arg) -> absl::Status {
                     switch (c) {
                       case 'f': spec.format = arg; break;
                       case 'h': help = true; break;
                       case 'U': spec.force_share = true; break;
                       case kOutput: output = arg; break;
                       case kBackingChain: backing_chain = true; break;
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
  spec.read_only = true;
  spec.no_backing = true;
  spec.queue_depth = 1;

  // One image, or the chain: each file opened on its own (without its
  // backing file) by its resolved name, with the backing format it names.
  std::vector<ImageInfo> infos;
  std::set<std::string> seen;
  std::optional<std::string> next = operands[0];
  std::shared_ptr<io::Engine> engine;
  while (next.has_value()) {
    if (!seen.insert(*next).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Backing file '", *next, "' creates an infinite loop."));
    }
    spec.filename = *next;
    ASSIGN_OR_RETURN(OpenedImage image, OpenImage(spec, streams.err, engine));
    engine = image.engine;
    absl::StatusOr<ImageInfo> described = Describe(image, image.display_name);
    absl::Status closed = CloseImage(image);
    RETURN_IF_ERROR(described.status());
    RETURN_IF_ERROR(closed);
    infos.push_back(*std::move(described));
    const ImageInfo& info = infos.back();
    next.reset();
    if (backing_chain && info.has_backing_filename() &&
        !info.has_full_backing_filename()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Could not determine absolute backing filename, but backing "
          "filename '", info.backing_filename(), "' present"));
    }
    if (backing_chain && info.has_full_backing_filename()) {
      next = info.full_backing_filename();
      spec.format = info.backing_filename_format();
      spec.image_opts = false;  // backing files are named by file name
    }
  }

  if (json && backing_chain) {
    streams.out << "[";
    for (size_t i = 0; i < infos.size(); ++i) {
      streams.out << (i == 0 ? "\n    " : ",\n    ") << PrintJson(infos[i], 1);
    }
    streams.out << "\n]\n";
  } else if (json) {
    streams.out << PrintJson(infos[0]) << "\n";
  } else {
    for (size_t i = 0; i < infos.size(); ++i) {
      if (i > 0) streams.out << "\n";
      streams.out << HumanInfo(infos[i]);
    }
  }
  return absl::OkStatus();
}

}  // namespace imgtool::cli
