#include "imgtool/image.h"

#include <sys/stat.h>

#include <array>
#include <cstring>
#include <sstream>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/align.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "imgtool/command.h"
#include "io/task.h"

namespace imgtool::cli {
namespace {

// Formats QEMU knows that imgtool does not implement yet.
constexpr std::array<const char*, 14> kUnsupportedFormats = {
    "qcow2", "qcow", "qed", "vmdk", "vdi", "vpc", "vhdx", "luks",
    "dmg", "parallels", "bochs", "cloop", "vvfat", "host_device"};

constexpr char kQcowMagic[] = {'Q', 'F', 'I', '\xfb'};

absl::Status CouldNotOpen(const std::string& filename,
                          const absl::Status& cause) {
  std::string message(cause.message());
  // qemu-img names the file twice when open(2) itself fails (posix_file:
  // "<file>: Could not open: <strerror>").
  const int error_number = StatusErrno(cause);
  if (error_number != 0 &&
      message == absl::StrCat(filename, ": Could not open: ",
                              std::strerror(error_number))) {
    message = absl::StrCat("Could not open '", filename,
                           "': ", std::strerror(error_number));
  }
  return absl::Status(cause.code(), absl::StrCat("Could not open '", filename,
                                                 "': ", message));
}

// Reads the first bytes of the image for format probing. Only the qcow
// magic is recognised (to refuse those images); everything else is raw.
absl::StatusOr<std::string> ProbeFormat(OpenedImage& image) {
  std::array<uint8_t, 512> head{};
  RETURN_IF_ERROR(io::RunSync(
      *image.engine, image.node->Read(0, io::IoVec(head.data(), head.size()))));
  if (std::memcmp(head.data(), kQcowMagic, sizeof(kQcowMagic)) == 0) {
    const bool v1 = head[7] == 1;  // big-endian version: 1 = qcow, 2/3 = qcow2
    return std::string(v1 ? "qcow" : "qcow2");
  }
  return std::string("raw");
}

}  // namespace

absl::Status CheckFormat(const std::string& format, bool for_create) {
  if (format == "raw" || format == "file") return absl::OkStatus();
  for (const char* name : kUnsupportedFormats) {
    if (format == name) {
      return absl::UnimplementedError(
          absl::StrCat("Format '", format, "' is not supported yet"));
    }
  }
  return absl::InvalidArgumentError(
      for_create ? absl::StrCat("Unknown file format '", format, "'")
                 : absl::StrCat("Unknown driver '", format, "'"));
}

absl::StatusOr<OpenedImage> OpenImage(const ImageSpec& spec,
                                      std::ostream& err) {
  const std::string& filename = spec.filename;
  if (spec.image_opts) {
    return absl::UnimplementedError("--image-opts is not supported yet");
  }
  if (!spec.format.empty()) {
    absl::Status st = CheckFormat(spec.format, /*for_create=*/false);
    if (!st.ok()) return CouldNotOpen(filename, st);
  }
  struct stat st;
  if (stat(filename.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    return CouldNotOpen(
        filename, absl::InvalidArgumentError(absl::StrCat(
                      "'file' driver requires '", filename,
                      "' to be a regular file")));
  }

  OpenedImage image;
  ASSIGN_OR_RETURN(image.engine,
                   io::CreateEngine(spec.aio, spec.queue_depth, &err));
  posix_file::FileOpenOptions options;
  options.set_filename(filename);
  options.set_cache(spec.cache);
  options.set_read_only(spec.read_only);
  // The raw format shares every permission (QEMU's default for an image
  // opened by qemu-img), so a read-only open takes only the consistent-read
  // lock: `info` and `map` work on a raw image a VM is writing, as with
  // qemu-img 7.2. Formats with metadata (qcow2) will unshare write.
  options.set_force_share(spec.force_share ||
                          (spec.read_only && !spec.unshare_write));
  std::ostringstream warnings;
  absl::StatusOr<std::unique_ptr<posix_file::FileNode>> file =
      posix_file::FileNode::Open(*image.engine, options, &warnings);
  PrintWarnings(warnings.str(), err);
  if (!file.ok()) return CouldNotOpen(filename, file.status());
  image.file = file->get();
  image.node = *std::move(file);

  if (!spec.format.empty()) {
    image.format = spec.format;
    return image;
  }
  absl::StatusOr<std::string> probed = ProbeFormat(image);
  if (!probed.ok() || *probed != "raw") {
    CloseImage(image).IgnoreError();
    if (!probed.ok()) return CouldNotOpen(filename, probed.status());
    return CouldNotOpen(filename,
                        absl::UnimplementedError(absl::StrCat(
                            "Format '", *probed, "' is not supported yet")));
  }
  image.format = "raw";
  if (!spec.read_only) {
    // qemu-img warns only when a probed raw image is opened for writing.
    err << "WARNING: Image format was not specified for '" << filename
        << "' and probing guessed raw.\n"
           "         Automatically detecting the format is dangerous for raw "
           "images, write operations on block 0 will be restricted.\n"
           "         Specify the 'raw' format explicitly to remove the "
           "restrictions.\n";
  }
  return image;
}

absl::Status CloseImage(OpenedImage& image) {
  if (image.node == nullptr) return absl::OkStatus();
  absl::Status st = io::RunSync(*image.engine, image.node->Close());
  image.file = nullptr;
  image.node.reset();
  return st;
}

uint64_t VirtualSize(const OpenedImage& image) {
  return AlignUp(image.node->size(), 512);
}

}  // namespace imgtool::cli
