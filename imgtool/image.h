// Opening images for imgtool commands: the engine and the block graph of
// the image, built by the driver registry (block/registry.h) from the
// options the command line gives: `-f qcow2 IMG` is the short form of
// --image-opts driver=qcow2,file.driver=file,file.filename=IMG, a json:{...}
// filename is QEMU's JSON pseudo-protocol, and --image-opts strings name
// any chain the registry knows (qcow2 over preallocate over file:
// driver=qcow2,file.driver=preallocate,file.file.driver=file,
// file.file.filename=IMG).
// Raw images are the `file` node itself; qcow2 images are a
// qcow2::Qcow2Node over their file, with their backing chain opened
// read-only below them.
//
// Format probing (no driver): a file starting with the qcow2 magic (version
// 2 or 3) is qcow2, one with the qcow (version 1) magic is refused as not
// supported, anything else is raw; qemu-img's three-line raw probing warning
// goes to `err` when a probed raw image is opened for writing (never for
// backing files, which are read-only).
//
// Backing files (qcow2): the name stored in the image is resolved against
// the directory of the image naming it (absolute names and protocol
// prefixes unchanged), opened read-only with the backing format stored in
// the image, or probed without one; chains of any depth. The nodes of one
// command share one engine (OpenImage's `engine` argument), so that images
// opened one after the other (convert, compare) are driven by one
// io::RunSync.
//
// Corrupt qcow2 images (corrupt bit) open read-only; a read-write open fails
// with QEMU's "qcow2: Image is corrupt; cannot be opened read/write". A
// read-write open of a dirty image (lazy refcounts) repairs its refcounts
// first, printing the repair lines on `err` as QEMU does.
// Thread model: everything runs on the calling thread.
#ifndef IMGTOOL_IMGTOOL_IMAGE_H_
#define IMGTOOL_IMGTOOL_IMAGE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <ostream>
#include <string>

#include "absl/status/statusor.h"
#include "io/block_node.h"
#include "io/engine.h"
#include "posix_file/file_node.h"
#include "qcow2/qcow2_node.h"

namespace imgtool::cli {

// The nbd connections convert (source and target) and bench open when the
// server offers multi-conn: nbdcopy's default (--connections=4). An
// imgtool extension: QEMU 7.2's client has no multi-conn.
inline constexpr uint32_t kNbdCopyConnections = 4;

struct ImageSpec {
  std::string filename;     // as the user gave it (relative to cwd)
  std::string format;       // -f; empty = probe
  // `filename` is an --image-opts string (QEMU's option syntax; `format`
  // must then be empty).
  bool image_opts = false;
  std::string cache = "writeback";
  bool read_only = true;
  bool force_share = false;  // -U
  // A read-only open that keeps writers out (QEMU's BDRV_O_NO_SHARE, used
  // for convert's sources unless -U); other read-only opens of raw images
  // share write. qcow2 images always keep writers out unless -U.
  bool unshare_write = false;
  // Do not open the backing file (qemu-img info's BDRV_O_NO_BACKING):
  // clusters the image does not allocate then read as zeroes.
  bool no_backing = false;
  // Open the backing file this many links down the chain read-write
  // (block::OpenSettings::writable_backing_depth); 0: none.
  int writable_backing_depth = 0;
  // block::OpenSettings::qcow2_grow_ahead.
  bool qcow2_grow_ahead = true;
  // The engine (-i/-n; qemu-img's default is threads). imgtool's default
  // (kAuto) is Linux AIO (native) when the image's bottom node is a local
  // file or device opened with O_DIRECT (cache none/directsync or
  // cache.direct=on), else io_uring, falling back to io_uring and then
  // threads when one cannot be set up. An `aio` option on the protocol
  // node at the bottom of the image's `file` chain (--image-opts
  // file.aio=native, json:) overrides it, as in QEMU; only for the
  // command's first image, which creates the engine.
  io::EngineKind aio = io::EngineKind::kAuto;
  int queue_depth = 64;  // requests the command keeps in flight
  // block::OpenSettings::nbd_connections: connections an nbd node opens
  // when its server offers multi-conn (its multi-conn option overrides).
  uint32_t nbd_connections = 1;
  // Copy-on-read (qemu-io -C, open -C; QEMU's BDRV_O_COPY_ON_READ): the
  // image's top node is opened under a copy-on-read filter
  // (cor_filter::CorNode, widening to the cluster size of the qcow2 node
  // below it, if any), so reads of data from its backing chain write that
  // data into the top image. OpenedImage::node is then the filter; format,
  // display_name, qcow2 and the node names stay the image's (QEMU sets a
  // flag on the top node instead of adding one). Needs !read_only: the
  // caller gives QEMU's "Can't use copy-on-read on read-only device".
  bool copy_on_read = false;
};

struct OpenedImage {
  // Shared by all images of a command; declared first so that the node is
  // destroyed before it.
  std::shared_ptr<io::Engine> engine;
  std::unique_ptr<io::BlockNode> node;   // the top node (owns its children)
  // Driver of the top node: "raw", "file", "qcow2" or "preallocate".
  std::string format;
  bool probed = false;  // `format` was probed (block::OpenedGraph::probed)
  // QEMU's name of the image (info's `image:`): the file name, or
  // json:{...} for chains a file name cannot rebuild (block/registry.h).
  std::string display_name;
  // The same for every node of the graph; see NodeName.
  std::map<const io::BlockNode*, std::string> node_names;
  // The protocol node at the bottom of the top node's file chain; not owned.
  posix_file::FileNode* file = nullptr;
  qcow2::Qcow2Node* qcow2 = nullptr;  // `node` if format is "qcow2"
  // The qcow2 node below raw formats and filters whose cluster size info
  // shows (block::OpenedGraph::qcow2_below); not owned.
  qcow2::Qcow2Node* qcow2_below = nullptr;
};

// Opens the image. Errors name the file (the --image-opts string or json:
// filename as given): "Could not open '<file>': <cause>" as qemu-img words
// it (a backing file's error reads "Could not open '<top>': Could not open
// backing file: <cause>"; option errors as block/registry.h lists them).
// kInvalidArgument "--image-opts and --format are mutually exclusive" if
// spec has both. `engine`: the engine of
// images already open for the same command, or null to create one for
// spec.aio (or the image's aio option) and spec.queue_depth (its fallback
// notice goes to `err`; an engine that cannot be set up is "Could not open
// '<file>': Unable to use native AIO: ..." for aio=native).
absl::StatusOr<OpenedImage> OpenImage(
    const ImageSpec& spec, std::ostream& err,
    std::shared_ptr<io::Engine> engine = nullptr);

// The name QEMU gives `node` of the image's graph (map's File column):
// json:{...} for filter nodes such as preallocate, else its file name.
const std::string& NodeName(const OpenedImage& image,
                            const io::BlockNode* node);

// Closes the node (flushing it, then its backing chain) and returns the
// first error. The engine stays (others may share it).
absl::Status CloseImage(OpenedImage& image);

// The size of the image in bytes as qemu-img reports it (`virtual size`,
// the end of `map`, the base of relative resizes), in whole 512-byte
// sectors as QEMU counts them: a raw file's length rounded up (a 1000-byte
// raw file is 1024 bytes, the bytes past its end read as zeroes), a qcow2
// header's size rounded down.
uint64_t VirtualSize(const OpenedImage& image);

// Checks a -f value for a command that creates or opens an image:
// "raw", "file" and "qcow2" are supported; for create, QEMU's drivers
// without image creation (bochs, quorum, null-co, ...; see
// block::QemuDriverCannotCreate) are kUnimplemented "Format driver '<fmt>'
// does not support image creation", as qemu-img words it; other formats
// QEMU knows (qcow, vmdk...) are kUnimplemented "Format '<fmt>' is not
// supported yet";
// anything else is kInvalidArgument "Unknown file format '<fmt>'" (create)
// or "Unknown driver '<fmt>'" (open), as qemu-img words them.
absl::Status CheckFormat(const std::string& format, bool for_create);

// Whether a file name is relative as QEMU sees backing file names: not
// empty, not absolute, and without a protocol prefix ("json:...", "file:x").
bool IsRelativeFilename(const std::string& name);

// QEMU's path_combine() for backing file names: `backing` resolved against
// the directory of `image` ("sub/ov.qcow2" + "base.raw" -> "sub/base.raw");
// absolute names and names with a protocol prefix ("json:...") unchanged.
std::string ResolveBackingFilename(const std::string& image,
                                   const std::string& backing);

// QEMU's bdrv_find_backing_image(top, name): the node of top's backing
// chain (below `top`) that `name` designates, or null. Compared level by
// level as QEMU does: names with a protocol prefix (on either side) as
// strings, with the stored backing name and its resolved form; otherwise
// a relative `name` is resolved against the directory of the image naming
// that level's backing file, and both sides are canonicalized (realpath;
// a level where either does not exist is skipped). If found and `depth` is
// not null, *depth is how many links down it is (1: top's backing file).
io::BlockNode* FindBackingImage(io::BlockNode& top, const std::string& name,
                                int* depth = nullptr);

}  // namespace imgtool::cli

#endif  // IMGTOOL_IMGTOOL_IMAGE_H_
