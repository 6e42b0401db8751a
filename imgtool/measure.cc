// imgtool measure [--output=human|json] [-O FMT] [-o OPTIONS] [--size SIZE |
// [-f FMT] [-l SNAPSHOT] [-U] FILE]: how large a new raw or qcow2 image of
// the given size, or holding a copy of FILE, gets (qemu-img 7.2's measure):
// "required size" (what a copy needs) and "fully allocated size" (every
// cluster allocated). For qcow2 the arithmetic is qcow2/measure.h; the data
// a copy of FILE needs comes from block status through FILE's backing chain:
// every cluster with data counts whole, zeroes and holes not.
#include <getopt.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/numeric/bits.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/options.h"
#include "base/size.h"
#include "base/status_macros.h"
#include "block/registry.h"
#include "imgtool/command.h"
#include "imgtool/image.h"
#include "imgtool/snapshot_load.h"
#include "imgtool/qcow2_create.h"
#include "io/block_node.h"
#include "io/chain_status.h"
#include "io/engine.h"
#include "io/task.h"
#include "qcow2/measure.h"
#include "qcow2/qcow2_node.h"

namespace imgtool::cli {
namespace {

constexpr char kUsage[] =
    "Usage: imgtool measure [--output=human|json] [-O FMT] [-o OPTIONS] "
    "[--size SIZE | [-f FMT] [-l SNAPSHOT] [-U] FILE]";

constexpr char kHelp[] =
    "Usage: imgtool measure [--output=human|json] [-O FMT] [-o OPTIONS] "
    "[--size SIZE | [-f FMT] [-l SNAPSHOT] [-U] FILE]\n"
    "Prints how large a new image of format FMT gets: the size a copy of FILE "
    "(or an\nempty image of SIZE bytes) requires, and the size when fully "
    "allocated.\n"
    "  -O FMT                output format: raw (default) or qcow2\n"
    "  -o OPTIONS            create options of the output format "
    "(cluster_size=,\n"
    "                        extended_l2=, preallocation=, refcount_bits=, "
    "compat=, ...)\n"
    "  --size SIZE           measure an empty image of SIZE bytes (k, M, G, "
    "T, P, E)\n"
    "  -f FMT                format of FILE (raw, file, qcow2); probed if "
    "absent\n"
    "  --image-opts          FILE is an option string such as\n"
    "                        driver=qcow2,file.filename=x (or use a "
    "json:{...} FILE)\n"
    "  -l SNAPSHOT           measure internal snapshot SNAPSHOT of FILE "
    "(an id or name,\n"
    "                        or snapshot.id=ID,snapshot.name=NAME)\n"
    "  -U, --force-share     open FILE without taking the image locks\n"
    "  --output=human|json   output format (default human)\n";

enum LongOption { kImageOpts = 256, kObject, kOutput, kSize };

const struct option kLongOptions[] = {
    {"help", no_argument, nullptr, 'h'},
    {"image-opts", no_argument, nullptr, kImageOpts},
    {"object", required_argument, nullptr, kObject},
    {"output", required_argument, nullptr, kOutput},
    {"size", required_argument, nullptr, kSize},
    {"force-share", no_argument, nullptr, 'U'},
    {nullptr, 0, nullptr, 0},
};

uint64_t RoundUp(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

// The create options of raw (and of the file protocol, which raw adds):
// size, preallocation, nocow, extent_size_hint. Checked for their types
// only; raw's measure uses none of them but size.
absl::StatusOr<std::optional<uint64_t>> ApplyRawOptions(
    const std::vector<std::string>& texts) {
  std::optional<uint64_t> size;
  for (const std::string& text : texts) {
    for (const std::string& item : SplitOptionItems(text)) {
      ASSIGN_OR_RETURN(OptionList list, ParseOptionString(item));
      for (const auto& [key, value] : list) {
        if (key == "size") {
          ASSIGN_OR_RETURN(size, ParseSizeOption(key, value));
        } else if (key == "extent_size_hint") {
          RETURN_IF_ERROR(ParseSizeOption(key, value).status());
        } else if (key == "nocow") {
          RETURN_IF_ERROR(ParseBoolOption(key, value).status());
        } else if (key != "preallocation") {
          return absl::InvalidArgumentError(
              absl::StrCat("Invalid parameter '", key, "'"));
        }
      }
    }
  }
  return size;
}

// The qcow2 options measure uses, checked as QEMU 7.2's qcow2_measure
// checks them (in its order).
struct Qcow2Params {
  qcow2::MeasureGeometry geometry;
  int version = 3;
  bool preallocates_data = false;  // falloc or full
  bool has_backing_file = false;
  uint64_t size = 0;               // -o size (0 if not given)
};

absl::StatusOr<Qcow2Params> Qcow2ParamsOf(const Qcow2CreateValues& v) {
  Qcow2Params p;
  p.geometry.extended_l2 = v.Flag("extended_l2");
  const uint64_t cs = v.Has("cluster_size") ? v.Number("cluster_size") : 65536;
  if (!absl::has_single_bit(cs) || cs < 512 || cs > (uint64_t{2} << 20)) {
    return absl::InvalidArgumentError(
        "Cluster size must be a power of two between 512 and 2048k");
  }
  if (p.geometry.extended_l2 && cs < 16384) {
    return absl::InvalidArgumentError(
        "Extended L2 entries are only supported with cluster sizes of at "
        "least 16384 bytes");
  }
  p.geometry.cluster_size = cs;
  if (const std::optional<std::string> compat = v.Text("compat");
      compat.has_value()) {
    if (*compat == "0.10") {
      p.version = 2;
    } else if (*compat == "1.1") {
      p.version = 3;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("Invalid compatibility level: '", *compat, "'"));
    }
  }
  const uint64_t refcount_bits =
      v.Has("refcount_bits") ? v.Number("refcount_bits") : 16;
  if (refcount_bits > 64 || !absl::has_single_bit(refcount_bits)) {
    return absl::InvalidArgumentError(
        "Refcount width must be a power of two and may not exceed 64 bits");
  }
  if (p.version < 3 && refcount_bits != 16) {
    return absl::InvalidArgumentError(
        "Different refcount widths than 16 bits require compatibility level "
        "1.1 or above (use compat=1.1 or greater)");
  }
  p.geometry.refcount_order =
      static_cast<uint32_t>(absl::countr_zero(refcount_bits));
  if (const std::optional<std::string> prealloc = v.Text("preallocation");
      prealloc.has_value()) {
    if (*prealloc == "falloc" || *prealloc == "full") {
      p.preallocates_data = true;
    } else if (*prealloc != "off" && *prealloc != "metadata") {
      return absl::InvalidArgumentError(
          absl::StrCat("invalid parameter value: ", *prealloc));
    }
  }
  p.has_backing_file = v.Has("backing_file");
  if (const std::optional<std::string> encrypt = v.Text("encrypt.format");
      encrypt.has_value() && *encrypt == "luks") {
    return absl::UnimplementedError(
        "measuring encrypted qcow2 images is not supported yet");
  }
  p.size = v.Number("size");
  return p;
}

// Bytes of data clusters a copy of `node` (`length` bytes as qemu-img
// counts them) needs with `cluster_size` clusters: each run that block
// status through the backing chain reports as data counts from the start
// of its first cluster to the end of its last one; zeroes and unallocated
// ranges count nothing (QEMU's qcow2_measure loop).
io::Task<absl::StatusOr<uint64_t>> DataClusterBytes(io::BlockNode& node,
                                                    uint64_t length,
                                                    uint64_t cluster_size) {
  uint64_t bytes = 0;
  // Past the node's end (a raw file's last partial sector) reads as zeroes.
  const uint64_t end = std::min(length, node.size());
  for (uint64_t offset = 0; offset < end;) {
    absl::StatusOr<io::ChainStatus> st =
        co_await io::GetChainStatus(node, offset, end - offset);
    if (!st.ok()) {
      co_return absl::Status(st.status().code(),
                             absl::StrCat("Unable to get block status: ",
                                          st.status().message()));
    }
    const uint64_t n = std::max<uint64_t>(st->status.length, 1);
    if (st->status.zero || !st->status.data) {
      offset += n;
      continue;
    }
    const uint64_t next = RoundUp(offset + n, cluster_size);
    bytes += offset % cluster_size + (next - offset);
    offset = next;
  }
  co_return bytes;
}

void Print(const qcow2::Measurement& m, std::optional<uint64_t> bitmaps,
           bool json, std::ostream& out) {
  if (!json) {
    out << "required size: " << m.required << "\n"
        << "fully allocated size: " << m.fully_allocated << "\n";
    if (bitmaps.has_value()) out << "bitmaps size: " << *bitmaps << "\n";
    return;
  }
  out << "{\n";
  if (bitmaps.has_value()) out << "    \"bitmaps\": " << *bitmaps << ",\n";
  out << "    \"required\": " << m.required << ",\n"
      << "    \"fully-allocated\": " << m.fully_allocated << "\n"
      << "}\n";
}

}  // namespace

absl::Status RunMeasure(const std::vector<std::string>& args, Streams streams) {
  ImageSpec spec;
  spec.read_only = true;
  spec.queue_depth = 1;
  bool help = false;
  bool json = false;
  std::string out_fmt = "raw";
  std::vector<std::string> option_texts;
  std::optional<std::string> snapshot;
  std::optional<uint64_t> img_size;
  ASSIGN_OR_RETURN(
      std::vector<std::string> operands,
      ParseOptions(
          args, "hf:O:o:l:U", kLongOptions, kUsage,
          [&](int c, const std::string& arg) -> absl::Status {
            switch (c) {
              case 'h': help = true; break;
              case 'f': spec.format = arg; break;
              case 'O': out_fmt = arg; break;
              case 'o':
                if (!IsValidOptionList(arg)) {
                  return absl::InvalidArgumentError(
                      absl::StrCat("Invalid option list: ", arg));
                }
                option_texts.push_back(arg);
                break;
              case 'l':
                RETURN_IF_ERROR(CheckSnapshotOption(arg, streams.err));
                snapshot = arg;
                break;
              case 'U': spec.force_share = true; break;
              case kImageOpts: spec.image_opts = true; break;
              case kOutput: {
                ASSIGN_OR_RETURN(json, ParseOutputFormat(arg));
                break;
              }
              case kSize: {
                absl::StatusOr<uint64_t> size = ParseSize(arg);
                if (!size.ok()) return PrefixEachLine(size.status());
                img_size = *size;
                break;
              }
            }
            return absl::OkStatus();
          }));
  if (help) {
    streams.out << kHelp;
    return absl::OkStatus();
  }
  if (operands.size() > 1) {
    return absl::InvalidArgumentError(
        "At most one filename argument is allowed.");
  }
  const bool has_file = operands.size() == 1;
  if (!has_file &&
      (spec.image_opts || !spec.format.empty() || snapshot.has_value())) {
    return absl::InvalidArgumentError(
        "--image-opts, -f, and -l require a filename argument.");
  }
  if (has_file && img_size.has_value()) {
    return absl::InvalidArgumentError(
        "--size N cannot be used together with a filename.");
  }
  if (!has_file && !img_size.has_value()) {
    return absl::InvalidArgumentError(
        "Either --size N or one filename must be specified.");
  }

  std::optional<OpenedImage> image;
  auto fail = [&](absl::Status st) {
    if (image.has_value()) CloseImage(*image).IgnoreError();
    return st;
  };
  if (has_file) {
    spec.filename = operands[0];
    ASSIGN_OR_RETURN(image, OpenImage(spec, streams.err));
    if (snapshot.has_value()) {
      absl::Status loaded = LoadSnapshot(*image, *snapshot, streams.err);
      if (!loaded.ok()) return fail(loaded);
    }
  }

  // Formats QEMU knows that cannot be created, or not measured.
  if (block::QemuDriverCannotCreate(out_fmt)) {
    return fail(CheckFormat(out_fmt, /*for_create=*/true));
  }
  for (const char* f : {"qcow", "qed", "vmdk", "vdi", "vpc", "vhdx",
                        "parallels", "host_device"}) {
    if (out_fmt == f) {
      return fail(absl::InvalidArgumentError(absl::StrCat(
          "Block driver '", out_fmt, "' does not support size measurement")));
    }
  }
  if (absl::Status st = CheckFormat(out_fmt, /*for_create=*/true); !st.ok()) {
    return fail(st);
  }
  // qemu-img reports the option's error (with its hint lines) and then
  // "Invalid options for file format ..." as a report of its own.
  auto invalid_options = [&](const absl::Status& st) {
    streams.err << FormatError(st);
    return fail(absl::Status(
        st.code(),
        absl::StrCat("Invalid options for file format '", out_fmt, "'")));
  };

  qcow2::Measurement m;
  std::optional<uint64_t> bitmaps;
  if (out_fmt != "qcow2") {
    absl::StatusOr<std::optional<uint64_t>> size = ApplyRawOptions(option_texts);
    if (!size.ok()) return invalid_options(size.status());
    if (out_fmt == "file") {
      return fail(absl::InvalidArgumentError(
          "Block driver 'file' does not support size measurement"));
    }
    // raw: the image is its data, allocated or not.
    m.required = has_file ? VirtualSize(*image)
                          : RoundUp(img_size.value_or(0), 512);
    m.fully_allocated = m.required;
  } else {
    Qcow2CreateValues values;
    for (const std::string& text : option_texts) {
      for (const std::string& item : SplitOptionItems(text)) {
        // measure has no "-o help": it is an unknown option there.
        absl::StatusOr<OptionList> list = ParseOptionString(item);
        if (list.ok() && !list->empty() && list->front().first == "help") {
          return invalid_options(
              absl::InvalidArgumentError("Invalid parameter 'help'"));
        }
        if (absl::Status st = values.Apply(item); !st.ok()) {
          return invalid_options(st);
        }
      }
    }
    if (img_size.has_value()) values.SetNumber("size", *img_size);
    absl::StatusOr<Qcow2Params> params = Qcow2ParamsOf(values);
    if (!params.ok()) return fail(params.status());
    const qcow2::MeasureGeometry& g = params->geometry;
    uint64_t virtual_size = params->size;
    if (!qcow2::FitsL1Limit(virtual_size, g)) {
      return fail(absl::InvalidArgumentError(
          "The image size is too large (try using a larger cluster size)"));
    }
    uint64_t data = 0;
    if (has_file) {
      const uint64_t ssize = VirtualSize(*image);
      virtual_size = ssize;
      if (params->has_backing_file) {
        // The new image's backing file may share nothing with FILE.
        data = RoundUp(ssize, g.cluster_size);
      } else {
        absl::StatusOr<uint64_t> counted = io::RunSync(
            *image->engine,
            DataClusterBytes(*image->node, ssize, g.cluster_size));
        if (!counted.ok()) return fail(counted.status());
        data = *counted;
      }
      if (params->version >= 3 && image->qcow2 != nullptr &&
          image->qcow2->header().version >= 3) {
        // QEMU 7.2's qcow2_get_persistent_dirty_bitmap_size, in the new
        // image's clusters: every bitmap (inconsistent ones too) wholly
        // allocated, its table, and the directory.
        const uint64_t cs = g.cluster_size;
        uint64_t total = 0;
        uint64_t dir = 0;
        for (const qcow2::Qcow2Node::BitmapInfo& b : image->qcow2->Bitmaps()) {
          const uint64_t bits = ssize / b.granularity +
                                (ssize % b.granularity != 0 ? 1 : 0);
          const uint64_t clusters = ((bits + 7) / 8 + cs - 1) / cs;
          total += clusters * cs + RoundUp(clusters * 8, cs);
          dir += (24 + b.name.size() + 7) / 8 * 8;
        }
        bitmaps = total + RoundUp(dir, cs);
      }
    }
    if (params->preallocates_data) data = RoundUp(virtual_size, g.cluster_size);
    m = qcow2::MeasureQcow2(virtual_size, data, g);
  }
  if (image.has_value()) RETURN_IF_ERROR(CloseImage(*image));
  Print(m, bitmaps, json, streams.out);
  return absl::OkStatus();
}

}  // namespace imgtool::cli
