// Block graphs from options, as QEMU builds them from --image-opts strings
// and json:{...} filenames: a node is described by a NodeOptions tree
// ("driver=qcow2,file.driver=file,file.filename=x.qcow2") and opened by the
// driver its `driver` key names, children first (`file`, then qcow2's
// backing file). The registry maps driver names to drivers: their kind, the
// option keys they accept and the options proto those keys fill by field
// name (`l2-cache-size` -> l2_cache_size), so no driver parses strings.
//
// Drivers: `file` (protocol, posix_file), `raw` (format; without offset or
// size it adds nothing, so the node is its `file` child itself; with them a
// raw_format::RawNode, named json:{...}), `qcow2`
// (format, with its backing chain) and `preallocate` (filter,
// prealloc_filter; its file child keeps other writers out, so the filter is
// active), `copy-on-read` (filter, cor_filter: `bottom` names a node opened
// with `node-name` below it, "Bottom node 'x' not found" / "Bottom node 'x'
// is a filter" (blkdebug counts as one, as in QEMU); over a read-only
// graph "Block node is read-only", kFailedPrecondition), `compress`
// (filter, compress_filter: its child must be a qcow2 node, else
// kUnimplemented "Compression is not supported for underlying format: raw";
// read-write over a child whose size is not a multiple of its cluster size
// kFailedPrecondition "Cannot get 'write' permission without 'resize':
// Image size is not a multiple of request alignment"), `null-co` and
// `null-aio` (protocols, null_block: named
// "null-co://" unless size or read-zeroes is given), `quorum` (a format in
// QEMU's naming, quorum_block: its children `children.N` are checked after
// its options and opened as images of their own; "Option children is not a
// valid array", "Number of provided children must be 1 or more" and
// quorum_block::CheckQuorumOptions' errors; named json:{...} with
// "children": [...]). json:{...} names list a
// node's keys in QEMU's QDict order (its hash buckets), values as given
// (numbers and booleans of json: filenames bare, everything else strings);
// `blkdebug` (blkdebug/: a protocol in QEMU's naming and errors, over its
// child `image`; plain filenames "blkdebug:CONFIG:IMAGE" name it, and a
// format over it is probed through it). The `file` child of a format or filter given only a filename is
// a `file` node (`file.filename=X`); a graph without a top driver is probed
// from the first bytes of the file at the bottom of its `file` chain.
// Error texts are qemu-img 7.2's (../shared/reference/qemu-img-cli.md,
// "--image-opts"), all kInvalidArgument unless said otherwise:
//   Unknown driver 'xyz'
//   Block format 'qcow2' does not support the option 'foo'
//   Block protocol 'file' doesn't support the option 'foo'
//   The 'file' block driver requires a file name
//   A block device must be specified for "file"
//   Must specify either driver or file
//   Cannot find device='x' nor node-name='x'          (file=x: a node name)
//   Parameter 'l2-cache-size' expects a non-negative number below 2^64 ...
//   Parameter 'lazy-refcounts' expects 'on' or 'off'
//   prealloc-align parameter of preallocate filter is not aligned to 512
//   invalid parameter value: maybe                    (file's locking, aio)
//   Block node is read-only                 (read-only=on, image opened rw)
//   force-share=on can only be used with read-only images
// Formats QEMU has and imgtool not (vmdk, ...) are kUnimplemented "Format
// 'vmdk' is not supported yet"; QEMU options imgtool does not implement
// (qcow2's cache-size, ...) are kUnimplemented "Block format
// 'qcow2' option 'cache-size' is not supported yet".
// qcow2's `encrypt.key-secret=ID` is kNotFound "No secret with id 'ID'" if
// no --object defined ID (block/objects.h), else kUnimplemented (imgtool
// has no qcow2 encryption).
// `backing=` (QEMU's deprecated form of "backing": null, with its warning)
// opens a qcow2 node without its backing file. `backing.*` options (e.g.
// backing.driver=qcow2, backing.node-name=base, backing.file.filename=b)
// are laid over the backing file the image names, as QEMU 7.2's
// bdrv_open_backing_file does (a `file.filename` among them replaces the
// stored name); `backing=NODE` is "Could not open backing file: Cannot
// find device='NODE' nor node-name='NODE'". On an image without a backing
// file, backing options without a file child fail as QEMU's ("A block
// device must be specified for "file""), others are kUnimplemented. When
// backing files are not opened (OpenSettings::no_backing) they are
// unknown options.
// As in QEMU, a child's errors come before its parent's, value errors before
// the driver's open errors, and unknown keys are reported after the node
// opened (then it is closed again).
//
// Thread model: OpenGraph runs on the engine's thread (io::RunSync).
#ifndef IMGTOOL_BLOCK_REGISTRY_H_
#define IMGTOOL_BLOCK_REGISTRY_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/options.h"
#include "google/protobuf/message.h"
#include "io/block_node.h"
#include "io/engine.h"
#include "io/task.h"
#include "posix_file/file_node.h"
#include "qcow2/qcow2_node.h"

namespace imgtool::block {

// QEMU's three kinds of block driver; the kind picks the wording of the
// unknown-option error and how QEMU names the node (info's `image:`).
enum class DriverKind { kProtocol, kFormat, kFilter };

struct Driver {
  std::string name;  // QEMU's driver name: "file", "raw", "qcow2", ...
  DriverKind kind;
  // The options message the keys fill (null: none), and which of its fields
  // users may set: key = field name with '-' for '_' ("prealloc-size").
  // Other fields are set from the command's settings (cache, read_only...).
  const google::protobuf::Descriptor* options = nullptr;
  std::vector<std::string> keys;
  // QEMU keys accepted and without effect on the node (e.g. file's aio,
  // which picks the command's one engine: imgtool/image.h), and QEMU keys
  // not implemented yet (kUnimplemented).
  std::vector<std::string> ignored_keys;
  std::vector<std::string> unsupported_keys;
  bool has_file_child = false;  // formats and filters: the `file` child
  // The key of that child: "file", or "image" for blkdebug.
  std::string file_child_key = "file";
  // Protocols: QEMU's protocol_name, the prefix that names the driver in a
  // filename ("file" for "file:x.qcow2", "null-co" for "null-co://").
  std::string protocol;
  // Protocols: QEMU's bdrv_parse_filename, filling the node's options from
  // a filename that names this driver (or is given with -f DRIVER);
  // kInvalidArgument if the driver refuses it. Null: the filename becomes
  // the `filename` option.
  absl::Status (*parse_filename)(absl::string_view filename,
                                 NodeOptions* node) = nullptr;
};

// QEMU's path_has_protocol: a ':' comes before any '/' ("file:x",
// "a:b.qcow2", not "./a:b.qcow2").
bool HasProtocolPrefix(absl::string_view filename);

// The options of the protocol node a filename names when protocol prefixes
// are allowed (a filename on the command line, or a backing file name;
// never `filename` options, which are taken literally), as QEMU's
// bdrv_fill_options and bdrv_find_protocol: with `driver` (a protocol, -f
// file) that driver parses the whole name; else a name with a prefix
// (HasProtocolPrefix) goes to the registered driver whose `protocol` it is
// ("file:foo:bar.qcow2" is the file "./foo:bar.qcow2", "null-co://" a
// null-co node); a name without one is a `file` node. Errors: the driver's
// parse_filename's; kUnimplemented "Protocol 'ssh' is not supported yet"
// for protocols QEMU has and imgtool not; kInvalidArgument "Unknown
// protocol 'foo'" for any other prefix (formats too: "qcow2:x").
absl::StatusOr<NodeOptions> ProtocolNodeOptions(absl::string_view filename,
                                                const Driver* driver = nullptr);

// The path of the file to create for an image named `filename` (qemu-img
// create, convert's and dd's targets), as QEMU's bdrv_create_file: a
// "file:" prefix is stripped (once: "file:file:x" is the file "file:x");
// a name without a prefix is the path itself. Errors: kUnimplemented
// "Protocol driver 'null-co' does not support image creation" for other
// registered protocols; ProtocolNodeOptions' errors for other prefixes.
absl::StatusOr<std::string> CreatePath(absl::string_view filename);

// The driver registered under `name`, or null.
const Driver* FindDriver(absl::string_view name);

// Names of every registered driver, sorted.
std::vector<std::string> DriverNames();

// True for drivers QEMU has and imgtool does not implement yet ("qcow",
// "vmdk", "vdi", "vpc", "vhdx", "luks", ...).
bool IsUnsupportedQemuDriver(absl::string_view name);

// True for QEMU 7.2's drivers that cannot create an image (bochs, cloop,
// dmg, vvfat and the filters: blkdebug, quorum, preallocate, null-co...),
// for which qemu-img's create, convert, dd and measure say "Format driver
// 'X' does not support image creation". Source: the installed qemu-img
// 7.2's `create -f X -o help` for every format of `qemu-img --help`.
bool QemuDriverCannotCreate(absl::string_view name);

// QEMU's find_hdev_driver: the device driver a filename names before any
// protocol prefix is looked at (QEMU's bdrv_probe_device scores, the
// highest wins): "host_cdrom" (100) for a block device that answers the
// CDROM_DRIVE_STATUS ioctl, else "host_device" for a character or block
// device (100) or a name starting with "/dev/cdrom" (50); "" for anything
// else (a regular file, a missing file, "file:/dev/sda"). Looks at the
// file system (open(2) O_NONBLOCK, stat); never fails.
std::string HostDeviceDriverFor(const std::string& filename);

// Whether `name` is one of QEMU's device drivers, host_device or
// host_cdrom (what HostDeviceDriverFor returns), which create through
// bdrv_co_create_opts_simple.
bool IsDeviceDriver(absl::string_view name);

// Whether `name` is a posix_file driver: `file` or one of its device twins
// (IsDeviceDriver).
bool IsPosixFileDriver(absl::string_view name);

// The protocol node at the bottom of the `file` chain of `options` (the
// node QEMU's file-posix aio= and O_DIRECT apply to) as the open sees it:
// `direct` if it is opened with O_DIRECT, i.e. `cache` (the command's
// cache mode) is none or directsync, or a cache.direct option on a node of
// the chain says so (the lowest one given wins, as the open passes cache
// flags down to children; a node whose read-only, force-share or cache.*
// values the open would refuse adds nothing here);
// `posix_file` if it is a local file or host device: a posix_file driver
// (IsPosixFileDriver), or no driver and a filename without a protocol
// prefix. `node` points into `options`, which must outlive it.
struct BottomProtocolNode {
  const NodeOptions* node;
  bool direct;
  bool posix_file;
};
BottomProtocolNode FindBottomProtocolNode(const NodeOptions& options,
                                          const std::string& cache);

// QEMU's cdrom_is_inserted for host_cdrom: whether the CDROM_DRIVE_STATUS
// ioctl on `filename` (opened O_RDONLY | O_NONBLOCK) says CDS_DISC_OK. False
// for anything that is not a CD-ROM drive with a disc (a loop device, a
// missing file).
bool CdromMediumInserted(const std::string& filename);

// The format of an image from its first `got` bytes (`head` holds at least
// 8 bytes, zeroes after the first `got`): "qcow2", "qcow" or "raw". QEMU
// probes a 2 KiB buffer whose bytes past the end of the file read as
// zeroes, so any non-empty file that starts with the qcow2 magic is qcow
// (big-endian version 1) or qcow2 (version >= 2) however short it is; its
// open then says why it is damaged instead of the file being used as raw.
std::string FormatOfHead(const uint8_t* head, size_t got);

// The format of the file `filename` from its first bytes, as qemu-img
// probes it: "qcow2" (qcow2 magic, version >= 2), "qcow" (version 1) or
// "raw". Errors of open(2)/pread(2) name the file.
absl::StatusOr<std::string> ProbeFormat(const std::string& filename);

// Fills `options` (of driver.options' type) from the values of one node:
// each key of driver.keys present in node.values is parsed by its field's
// type: integers as sizes ("64k"; base/size.h ParseSizeOption's errors),
// bools from on/off (true/false from json:), strings as given. Keys that are
// not driver keys are left alone (the caller reports unknown ones).
absl::Status FillDriverOptions(const Driver& driver, const NodeOptions& node,
                               google::protobuf::Message* options);

// Checks the options of one node whose `driver` is registered, without
// opening anything or looking at its children: value errors, QEMU options
// not supported, and keys the driver does not take (its `file` child is
// taken; qcow2's `backing` unless `no_backing`), and read-only=on or
// force-share=on when the node is to be opened read-write (!read_only),
// with OpenGraph's errors. For `check`, which works on the file below a
// qcow2 node.
absl::Status CheckNodeOptions(const NodeOptions& node, bool read_only,
                              bool no_backing);

// The options of an image named on the command line, as QEMU builds them:
// an --image-opts string (`image_opts`: ParseOptionString with "file" as
// the implied key, then BuildNodeOptions); a json:{...} filename
// (ParseJsonFilename; a -f `format` then replaces its driver); or a plain
// filename: {driver: format, file: ProtocolNodeOptions(filename)}, just
// ProtocolNodeOptions(filename, format) when -f names a protocol (-f file,
// -f null-co), no driver (probe) without -f. Errors: those of the parsers
// and of ProtocolNodeOptions.
//
// ProtocolOptions: the same as ProtocolNodeOptions(filename), into `node`.
absl::Status ProtocolOptions(const std::string& filename, NodeOptions* node);

absl::StatusOr<NodeOptions> ImageOptions(const std::string& filename,
                                         const std::string& format,
                                         bool image_opts);

// Puts `filename` where QEMU 7.2 puts a filename given beside the options
// of a node whose driver is set (qemu-io's `open -o driver=...,... FILE`;
// blkdebug's x-image beside `image.*` options): bdrv_fill_options, then
// each format's or filter's bdrv_open_child of its child with that
// filename. A protocol driver takes it as its own (through its
// parse_filename if it has one: blkdebug's x-image, which the registry then
// places into its `image` child the same way), a format or filter passes it
// on to its `file` child (a protocol node named by it if the child names no
// driver, as ProtocolOptions). Keys already set stay; a node without a
// driver, or with an unknown one, is left alone. Errors: parse_filename's.
absl::Status PlaceFilename(const std::string& filename, NodeOptions* node);

// What every node of one graph is opened with (the command's settings).
// Options of a node can tighten them for its subtree: read-only=on,
// force-share=on, cache.direct / cache.no-flush.
struct OpenSettings {
  io::Engine* engine = nullptr;  // not owned; must outlive the nodes
  // none, writeback, writethrough, directsync or unsafe (qemu-img -t/-T).
  std::string cache = "writeback";
  bool read_only = true;
  bool force_share = false;  // -U
  // The file under a raw format shares every permission (QEMU's default
  // for qemu-img); as a backing file or convert's source it keeps writers
  // out (false). Files under qcow2 and preallocate always keep writers out.
  bool raw_shares_write = true;
  // qcow2 nodes open without their backing file (qemu-img info): their
  // unallocated clusters read as zeroes, and backing options are unknown.
  bool no_backing = false;
  // The backing file this many links down the top node's chain (1: its
  // backing file) is opened read-write, like the top (commit's base);
  // 0: every backing file read-only.
  int writable_backing_depth = 0;
  // The files under read-write qcow2 nodes grow their length ahead of the
  // clusters allocated at the end (posix_file::FileNode::GrowLengthAhead,
  // 64 MiB). False for commands that allocate a few metadata clusters only
  // (snapshot): the growth would cost a truncate and an xattr each way.
  bool qcow2_grow_ahead = true;
  // Connections an nbd node opens when the server offers multi-conn and
  // the node has no multi-conn option (nbd_block/nbd_node.h): 1 as QEMU's
  // client; convert and bench ask for 4, as nbdcopy.
  uint32_t nbd_connections = 1;
  // Where the probing warning (a probed raw image opened for writing) and
  // qcow2's dirty-image repair lines go; not null.
  std::ostream* err = nullptr;
  // Receives posix_file's open warnings, one line each; may be empty.
  std::function<void(absl::string_view)> warn;
};

// An opened graph: the top node owns its children.
struct OpenedGraph {
  std::unique_ptr<io::BlockNode> node;
  // Driver of the top node ("raw", "file", "qcow2", "preallocate"), after
  // probing.
  std::string format;
  // Whether that driver was probed (no driver named: QEMU's bs->probed; a
  // probed raw node has a request alignment of 512 in QEMU).
  bool probed = false;
  // The name QEMU gives the top node (its refreshed filename, info's
  // `image:`): the file's name when opening that file with this format
  // alone rebuilds the same graph ("x.qcow2" for qcow2 over file), else
  // json:{...} with the graph's drivers and filenames in QEMU's key order
  // and spacing, e.g. json:{"driver": "qcow2", "file": {"driver":
  // "preallocate", "file": {"driver": "file", "filename": "x.qcow2"}}}.
  std::string display_name;
  // The same name of every node of the graph, backing files included (map's
  // File column names the node holding the data).
  std::map<const io::BlockNode*, std::string> node_names;
  // The protocol node at the bottom of the top node's `file` chain; not
  // owned.
  posix_file::FileNode* file = nullptr;
  // `node` if it is a qcow2 node.
  qcow2::Qcow2Node* qcow2 = nullptr;
  // The qcow2 node reached from the top through raw formats and filters
  // (`qcow2` itself for a qcow2 top node): QEMU's bdrv_get_info answers for
  // those with its cluster size. Null if there is none; not owned.
  qcow2::Qcow2Node* qcow2_below = nullptr;
};

// Opens the graph described by `options` (see the file comment for the
// rules and errors). Errors do not name the image; callers add "Could not
// open '<image>': ". Backing files of qcow2 nodes are opened read-only
// through the registry too, their names resolved against the image's
// directory ("json:" names parsed), with their stored format or probed;
// a file that is already in the chain is "Backing file '<name>' creates an
// infinite loop.".
io::Task<absl::StatusOr<OpenedGraph>> OpenGraph(NodeOptions options,
                                                OpenSettings settings);

}  // namespace imgtool::block

#endif  // IMGTOOL_BLOCK_REGISTRY_H_
