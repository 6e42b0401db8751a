// Opening images for imgtool commands: the engine, the protocol node and
// (later) the format node stacked on it. Raw images are the `file` node
// itself. Format probing: a file without -f is probed (raw for now) and
// qemu-img's three-line raw probing warning goes to `err`.
#ifndef IMGTOOL_IMGTOOL_IMAGE_H_
#define IMGTOOL_IMGTOOL_IMAGE_H_

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

}  // namespace imgtool::cli

#endif  // IMGTOOL_IMGTOOL_IMAGE_H_
