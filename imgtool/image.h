// Opening images for imgtool commands: the engine, the protocol node and
// (later) the format node stacked on it. Raw images are the `file` node
// itself. Format probing: a file without -f is probed (raw for now) and
// qemu-img's three-line raw probing warning goes to `err`.
#ifndef IMGTOOL_IMGTOOL_IMAGE_H_
#define IMGTOOL_IMGTOOL_IMAGE_H_

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>

#include "absl/status/statusor.h"
#include "io/block_node.h"
#include "io/engine.h"
#include "posix_file/file_node.h"

namespace imgtool::cli {

struct ImageSpec {
  std::string filename;          // as the user gave it (relative to cwd)
  std::string format;            // -f; empty = probe
  bool image_opts = false;       // filename is an --image-opts string
  std::string cache = "writeback";
  bool read_only = true;
  bool force_share = false;      // -U
  // A read-only open that keeps writers out (QEMU's BDRV_O_NO_SHARE, used
  // for convert's sources unless -U); other read-only opens share write.
  bool unshare_write = false;
  io::EngineKind aio = io::EngineKind::kAuto;
  int queue_depth = 64;          // requests the command keeps in flight
};

struct OpenedImage {
  std::unique_ptr<io::Engine> engine;
  std::unique_ptr<io::BlockNode> node;   // the top node (owns its children)
  std::string format;                    // "raw", later "qcow2"
  posix_file::FileNode* file = nullptr;  // the protocol node, not owned
};

// Opens the image. Errors name the file: "Could not open '<file>': <cause>"
// as qemu-img words it.
absl::StatusOr<OpenedImage> OpenImage(const ImageSpec& spec, std::ostream& err);

// Closes the node (flushing it) and returns the first error.
absl::Status CloseImage(OpenedImage& image);

// The size of the image in bytes as qemu-img reports it (`virtual size`,
// the end of `map`, the base of relative resizes): the top node's length
// rounded up to 512 bytes, since QEMU counts whole sectors (a 1000-byte raw
// file is 1024 bytes). The bytes past the end of the file read as zeroes.
uint64_t VirtualSize(const OpenedImage& image);

// Checks a -f value for a command that creates or opens an image:
// "raw" and "file" are supported; other formats QEMU knows (qcow2, vmdk...)
// are kUnimplemented "Format '<fmt>' is not supported yet"; anything else is
// kInvalidArgument "Unknown file format '<fmt>'" (create) or
// "Unknown driver '<fmt>'" (open), as qemu-img words them.
absl::Status CheckFormat(const std::string& format, bool for_create);

}  // namespace imgtool::cli

#endif  // IMGTOOL_IMGTOOL_IMAGE_H_
