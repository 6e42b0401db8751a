#include "imgtool/image.h"

#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/align.h"
#include "base/errno_status.h"
#include "base/options.h"
#include "base/status_macros.h"
#include "block/registry.h"
#include "cor_filter/cor_filter.h"
#include "imgtool/command.h"
#include "io/task.h"

namespace imgtool::cli {
namespace {

absl::Status CouldNotOpen(const std::string& filename,
                          const absl::Status& cause) {
  return WithMessage(cause, absl::StrCat("Could not open '", filename, "': ",
                                         cause.message()));
}

// The engine for the image: the `aio` option of the bottom node (QEMU's
// file-posix aio=, which overrides the command's -i/-n there), else the
// command's; `auto` is Linux AIO (native) for a local file opened with
// O_DIRECT and io_uring otherwise (io/engine.h CreateEngine). Why native
// for O_DIRECT: in the engine suite (README, "The engine suite on XFS and
// ext4") it reached 0.95 of the best fio configuration in 31 of 36 cells,
// io_uring in 14. If Linux AIO cannot be set up (fs.aio-max-nr used up),
// auto falls back to io_uring, then threads.
absl::StatusOr<std::unique_ptr<io::Engine>> CreateEngineFor(
    const NodeOptions& options, const ImageSpec& spec, std::ostream& err) {
  const block::BottomProtocolNode bottom =
      block::FindBottomProtocolNode(options, spec.cache);
  io::EngineKind kind = spec.aio;
  if (auto aio = bottom.node->values.find("aio");
      aio != bottom.node->values.end()) {
    // Other values are refused when the node opens (block/registry.h).
    absl::StatusOr<io::EngineKind> asked = io::ParseEngineKind(aio->second);
    if (asked.ok()) kind = *asked;
  }
  if (kind == io::EngineKind::kAuto && bottom.direct && bottom.posix_file) {
    absl::StatusOr<std::unique_ptr<io::Engine>> native =
        io::CreateEngine(io::EngineKind::kNative, spec.queue_depth, &err);
    if (native.ok()) return native;
  }
  return io::CreateEngine(kind, spec.queue_depth, &err);
}

}  // namespace

bool IsRelativeFilename(const std::string& name) {
  if (name.empty() || name[0] == '/') return false;
  const size_t colon = name.find(':');
  const size_t slash = name.find('/');
  return colon == std::string::npos ||
         (slash != std::string::npos && slash < colon);
}

std::string ResolveBackingFilename(const std::string& image,
                                   const std::string& backing) {
  if (!IsRelativeFilename(backing)) return backing;
  const size_t dir_end = image.rfind('/');
  if (dir_end == std::string::npos) return backing;
  return image.substr(0, dir_end + 1) + backing;
}

absl::Status CheckFormat(const std::string& format, bool for_create) {
  if (format == "raw" || format == "file" || format == "qcow2") {
    return absl::OkStatus();
  }
  // Protocol drivers that create through QEMU's bdrv_co_create_opts_simple
  // (open the existing device; imgtool's create handles them).
  if (block::IsDeviceDriver(format)) {
    return absl::OkStatus();
  }
  if (for_create && block::QemuDriverCannotCreate(format)) {
    return absl::UnimplementedError(absl::StrCat(
        "Format driver '", format, "' does not support image creation"));
  }
  // Other drivers of the registry (null-co, ...) open, never create.
  if (!for_create && block::FindDriver(format) != nullptr) {
    return absl::OkStatus();
  }
  if (block::IsUnsupportedQemuDriver(format)) {
    return absl::UnimplementedError(
        absl::StrCat("Format '", format, "' is not supported yet"));
  }
  return absl::InvalidArgumentError(
      for_create ? absl::StrCat("Unknown file format '", format, "'")
                 : absl::StrCat("Unknown driver '", format, "'"));
}

absl::StatusOr<OpenedImage> OpenImage(const ImageSpec& spec, std::ostream& err,
                                      std::shared_ptr<io::Engine> engine) {
  const std::string& filename = spec.filename;
  if (spec.image_opts && !spec.format.empty()) {
    return absl::InvalidArgumentError(
        "--image-opts and --format are mutually exclusive");
  }
  absl::StatusOr<NodeOptions> options =
      block::ImageOptions(filename, spec.format, spec.image_opts);
  if (!options.ok()) return CouldNotOpen(filename, options.status());

  OpenedImage image;
  if (engine == nullptr) {
    absl::StatusOr<std::unique_ptr<io::Engine>> created =
        CreateEngineFor(*options, spec, err);
    if (!created.ok()) return CouldNotOpen(filename, created.status());
    engine = *std::move(created);
  }
  image.engine = std::move(engine);
  block::OpenSettings s;
  s.engine = image.engine.get();
  s.cache = spec.cache;
  s.read_only = spec.read_only;
  s.force_share = spec.force_share;
  s.raw_shares_write = !spec.unshare_write;
  s.no_backing = spec.no_backing;
  s.writable_backing_depth = spec.writable_backing_depth;
  s.qcow2_grow_ahead = spec.qcow2_grow_ahead;
  s.nbd_connections = spec.nbd_connections;
  s.err = &err;
  s.warn = [&err](absl::string_view warnings) { PrintWarnings(warnings, err); };
  absl::StatusOr<block::OpenedGraph> opened = io::RunSync(
      *image.engine, block::OpenGraph(*std::move(options), std::move(s)));
  if (!opened.ok()) return CouldNotOpen(filename, opened.status());
  image.node = std::move(opened->node);
  image.format = opened->format;
  image.probed = opened->probed;
  image.display_name = std::move(opened->display_name);
  image.node_names = std::move(opened->node_names);
  image.file = opened->file;
  image.qcow2 = opened->qcow2;
  image.qcow2_below = opened->qcow2_below;
  if (spec.copy_on_read) {
    cor_filter::CorSettings settings;
    if (image.qcow2_below != nullptr) {
      settings.cluster_size = image.qcow2_below->cluster_size();
    }
    image.node =
        std::make_unique<cor_filter::CorNode>(std::move(image.node), settings);
    image.node_names[image.node.get()] = image.display_name;
  }
  return image;
}

const std::string& NodeName(const OpenedImage& image,
                            const io::BlockNode* node) {
  auto it = image.node_names.find(node);
  return it != image.node_names.end() ? it->second : node->filename();
}

absl::Status CloseImage(OpenedImage& image) {
  if (image.node == nullptr) return absl::OkStatus();
  absl::Status st = io::RunSync(*image.engine, image.node->Close());
  image.file = nullptr;
  image.qcow2 = nullptr;
  image.qcow2_below = nullptr;
  image.node_names.clear();
  image.node.reset();
  return st;
}

uint64_t VirtualSize(const OpenedImage& image) {
  if (image.qcow2 != nullptr) return image.node->size() / 512 * 512;
  return AlignUp(image.node->size(), 512);
}

io::BlockNode* FindBackingImage(io::BlockNode& top, const std::string& name,
                                int* depth) {
  int level = 0;
  for (io::BlockNode* curr = &top; curr->backing() != nullptr;
       curr = curr->backing()) {
    ++level;
    const auto* q = dynamic_cast<const qcow2::Qcow2Node*>(curr);
    if (q == nullptr) continue;
    io::BlockNode* below = curr->backing();
    const std::string& full = q->full_backing_filename();
    bool found = false;
    if (HasProtocol(name) || HasProtocol(q->backing_filename())) {
      found = name == q->backing_filename() || name == full;
    } else {
      const std::optional<std::string> wanted =
          RealPath(ResolveBackingFilename(curr->filename(), name));
      const std::optional<std::string> have = RealPath(full);
      found = wanted.has_value() && have.has_value() && *wanted == *have;
    }
    if (found) {
      if (depth != nullptr) *depth = level;
      return below;
    }
  }
  return nullptr;
}

}  // namespace imgtool::cli
