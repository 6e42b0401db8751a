#include "block/registry.h"

#include <fcntl.h>
#include <linux/cdrom.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <set>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/errno_status.h"
#include "base/json_printer.h"
#include "base/size.h"
#include "base/status_macros.h"
#include "blkdebug/blkdebug.h"
#include "blkdebug/blkdebug_options.pb.h"
#include "block/objects.h"
#include "compress_filter/compress_filter.h"
#include "cor_filter/cor_filter.h"
#include "cor_filter/cor_options.pb.h"
#include "google/protobuf/message.h"
#include "nbd_block/nbd_node.h"
#include "null_block/null_node.h"
#include "null_block/null_options.pb.h"
#include "posix_file/file_options.pb.h"
#include "prealloc_filter/prealloc_filter.h"
#include "prealloc_filter/prealloc_options.pb.h"
#include "qcow2/check.h"
#include "quorum_block/quorum_node.h"
#include "quorum_block/quorum_options.pb.h"
#include "raw_format/raw_node.h"
#include "raw_format/raw_options.pb.h"
#include "qcow2/qcow2_options.pb.h"

namespace imgtool::block {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

constexpr std::array<const char*, 12> kUnsupportedDrivers = {
    "qcow", "qed",       "vmdk",  "vdi",   "vpc",   "vhdx",
    "luks", "dmg",       "parallels", "bochs", "cloop", "vvfat"};

// QEMU 7.2's format and filter drivers that cannot create images (no
// bdrv_co_create_opts: `qemu-img create -f X -o help` of the installed
// qemu-img 7.2 says "Format driver 'X' does not support image creation").
constexpr std::array<const char*, 17> kNoCreationDrivers = {
    "blkdebug",     "blklogwrites",    "blkverify",   "bochs",
    "cloop",        "compress",        "copy-before-write",
    "copy-on-read", "dmg",             "null-aio",    "null-co",
    "preallocate",  "quorum",          "replication", "snapshot-access",
    "throttle",     "vvfat"};

constexpr char kQcowMagic[] = {'Q', 'F', 'I', '\xfb'};

// Keys every driver takes (QEMU's block layer options).
constexpr std::array<const char*, 5> kGenericKeys = {
    "driver", "node-name", "read-only", "auto-read-only", "force-share"};

// Protocols QEMU 7.2 has and imgtool does not (bdrv_find_protocol's names).
constexpr std::array<const char*, 17> kUnsupportedProtocols = {
    "ssh",  "http",
    "https",        "ftp",          "ftps",     "iscsi", "iser",
    "rbd",          "gluster",      "gluster+tcp", "gluster+unix",
    "gluster+rdma", "nfs",          "fat",      "blkverify", "nvme", "vxhs"};

// QEMU's bdrv_parse_filename_strip_prefix(filename, "<protocol>:"): the
// prefix is stripped, and "./" put before a rest that would read as a
// protocol.
absl::Status StripPrefixFilename(absl::string_view prefix,
                                 absl::string_view filename,
                                 NodeOptions* node) {
  if (absl::ConsumePrefix(&filename, prefix) && HasProtocolPrefix(filename)) {
    node->values["filename"] = absl::StrCat("./", filename);
  } else {
    node->values["filename"] = std::string(filename);
  }
  return absl::OkStatus();
}
absl::Status ParseFileFilename(absl::string_view filename, NodeOptions* node) {
  return StripPrefixFilename("file:", filename, node);
}
absl::Status ParseHostDeviceFilename(absl::string_view filename,
                                     NodeOptions* node) {
  return StripPrefixFilename("host_device:", filename, node);
}
absl::Status ParseHostCdromFilename(absl::string_view filename,
                                    NodeOptions* node) {
  return StripPrefixFilename("host_cdrom:", filename, node);
}

absl::Status ParseNullCo(absl::string_view filename, NodeOptions*) {
  return null_block::ParseNullFilename("null-co", filename);
}
absl::Status ParseNullAio(absl::string_view filename, NodeOptions*) {
  return null_block::ParseNullFilename("null-aio", filename);
}

// nbd: URIs (nbd://, nbd+tcp://, nbd+unix://) and the legacy nbd:...
// syntax fill server.* and export (nbd_block/nbd_node.h).
absl::Status ParseNbd(absl::string_view filename, NodeOptions* node) {
  return nbd_block::ParseNbdFilename(
      filename, [node](const std::string& key, const std::string& value) {
        const size_t dot = key.find('.');
        if (dot == std::string::npos) {
          node->values[key] = value;
        } else {
          node->children[key.substr(0, dot)].values[key.substr(dot + 1)] =
              value;
        }
      });
}

const std::vector<Driver>& Drivers() {
  static const std::vector<Driver>* drivers = [] {
    auto* d = new std::vector<Driver>;
    d->push_back(Driver{
        .name = "file",
        .kind = DriverKind::kProtocol,
        .options = posix_file::FileOpenOptions::descriptor(),
        .keys = {"filename", "locking"},
        // aio picks the command's one engine when set on the first image's
        // file node (imgtool/image.h), nothing per node; the page cache is
        // not dropped behind QEMU's back here.
        .ignored_keys = {"aio", "aio-max-batch", "drop-cache",
                         "x-check-cache-dropped"},
        .unsupported_keys = {"pr-manager"},
        .protocol = "file",
        .parse_filename = ParseFileFilename,
    });
    // QEMU's host_device and host_cdrom: the file driver for block and
    // character devices, with its options.
    for (const char* name : {"host_device", "host_cdrom"}) {
      Driver device = d->back();
      device.name = name;
      device.protocol = name;
      device.parse_filename = std::string(name) == "host_device"
                                  ? ParseHostDeviceFilename
                                  : ParseHostCdromFilename;
      d->push_back(std::move(device));
    }
    for (const char* name : {"null-co", "null-aio"}) {
      d->push_back(Driver{
          .name = name,
          .kind = DriverKind::kProtocol,
          .options = null_block::NullOptions::descriptor(),
          .keys = {"size", "latency-ns", "read-zeroes"},
          .protocol = name,
          .parse_filename = std::string(name) == "null-co" ? ParseNullCo
                                                           : ParseNullAio,
      });
    }
    d->push_back(Driver{
        .name = "nbd",
        .kind = DriverKind::kProtocol,
        .keys = {"server.type", "server.path", "server.host", "server.port",
                 "export", "x-dirty-bitmap", "reconnect-delay",
                 "open-timeout", "tls-creds", "tls-hostname", "multi-conn",
                 "x-tls", "x-tls-certificates"},
        .protocol = "nbd",
        .parse_filename = ParseNbd,
    });
    d->push_back(Driver{
        .name = "raw",
        .kind = DriverKind::kFormat,
        .options = raw_format::RawOptions::descriptor(),
        .keys = {"offset", "size"},
        .has_file_child = true,
    });
    d->push_back(Driver{
        .name = "qcow2",
        .kind = DriverKind::kFormat,
        .options = qcow2::Qcow2OpenOptions::descriptor(),
        .keys = {"l2-cache-size", "refcount-cache-size", "lazy-refcounts",
                 "cache-size", "l2-cache-entry-size", "cache-clean-interval",
                 "overlap-check", "overlap-check.template",
                 "overlap-check.main-header", "overlap-check.active-l1",
                 "overlap-check.active-l2", "overlap-check.refcount-table",
                 "overlap-check.refcount-block",
                 "overlap-check.snapshot-table", "overlap-check.inactive-l1",
                 "overlap-check.inactive-l2",
                 "overlap-check.bitmap-directory"},
        .unsupported_keys = {"pass-discard-request", "pass-discard-snapshot",
                             "pass-discard-other", "data-file", "encrypt"},
        .has_file_child = true,
    });
    d->push_back(Driver{
        .name = "blkdebug",
        .kind = DriverKind::kProtocol,
        .options = blkdebug::BlkdebugOptions::descriptor(),
        .keys = {"config", "align", "max-transfer", "opt-write-zero",
                 "max-write-zero", "opt-discard", "max-discard"},
        .has_file_child = true,
        .file_child_key = "image",
        .protocol = "blkdebug",
        .parse_filename = blkdebug::ParseBlkdebugFilename,
    });
    d->push_back(Driver{
        .name = "copy-on-read",
        .kind = DriverKind::kFilter,
        .options = cor_filter::CorOptions::descriptor(),
        .keys = {"bottom"},
        .has_file_child = true,
    });
    d->push_back(Driver{
        .name = "compress",
        .kind = DriverKind::kFilter,
        .has_file_child = true,
    });
    // A format in QEMU's naming (no protocol name, no `file` child): its
    // children are `children.N`.
    d->push_back(Driver{
        .name = "quorum",
        .kind = DriverKind::kFormat,
        .options = quorum_block::QuorumOptions::descriptor(),
        .keys = {"vote-threshold", "blkverify", "rewrite-corrupted",
                 "read-pattern"},
    });
    d->push_back(Driver{
        .name = "preallocate",
        .kind = DriverKind::kFilter,
        .options = prealloc_filter::PreallocFilterOptions::descriptor(),
        .keys = {"prealloc-align", "prealloc-size"},
        .has_file_child = true,
    });
    return d;
  }();
  return *drivers;
}

bool Contains(const std::vector<std::string>& list, absl::string_view key) {
  return std::find(list.begin(), list.end(), key) != list.end();
}

// True if a key of `keys` is dotted below `name` ("overlap-check.template"
// below "overlap-check"): such a child holds the driver's own options.
bool HasKeysBelow(const std::vector<std::string>& keys,
                  absl::string_view name) {
  return std::any_of(keys.begin(), keys.end(), [&](const std::string& key) {
    return absl::StartsWith(key, absl::StrCat(name, "."));
  });
}

// The value of a driver key in `node`; a dotted key ("overlap-check.
// template") is looked up through the children. Null if not given.
const std::string* FindKeyValue(const NodeOptions& node,
                                absl::string_view key) {
  const NodeOptions* n = &node;
  std::vector<absl::string_view> parts = absl::StrSplit(key, '.');
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    auto child = n->children.find(std::string(parts[i]));
    if (child == n->children.end()) return nullptr;
    n = &child->second;
  }
  auto it = n->values.find(std::string(parts.back()));
  return it == n->values.end() ? nullptr : &it->second;
}

// The cache mode of a node as QEMU's three flags.
struct Cache {
  bool direct = false;
  bool no_flush = false;
  bool writethrough = false;
};

Cache CacheFromMode(const std::string& mode) {
  Cache c;
  c.direct = mode == "none" || mode == "directsync";
  c.writethrough = mode == "writethrough" || mode == "directsync";
  c.no_flush = mode == "unsafe";
  return c;
}

std::string CacheMode(const Cache& c) {
  if (c.direct) return c.writethrough ? "directsync" : "none";
  if (c.no_flush) return "unsafe";
  return c.writethrough ? "writethrough" : "writeback";
}

// A file of a chain, to refuse backing files that loop.
struct FileId {
  dev_t dev = 0;
  ino_t ino = 0;
  bool operator==(const FileId&) const = default;
};

// Where a node sits: the top of a graph, the `file` child of a format or
// filter, or a backing file.
enum class Slot { kTop, kFile, kBacking };

// How far past its data a qcow2 node's file is grown ahead, in bytes.
constexpr uint64_t kQcow2FileGrowthStep = uint64_t{64} << 20;

// A node opened with a `node-name` option, for options that name nodes
// (copy-on-read's `bottom`).
struct NamedNode {
  io::BlockNode* node = nullptr;
  bool is_filter = false;
};

// What one subtree is opened with.
struct Context {
  std::shared_ptr<const OpenSettings> settings;
  std::shared_ptr<std::map<const io::BlockNode*, std::string>> names;
  std::shared_ptr<std::map<std::string, NamedNode>> named_nodes;
  bool read_only = true;
  bool force_share = false;
  Cache cache;
  bool share_all = false;   // the file under a raw format
  bool is_backing = false;  // no probing warning
  int backing_depth = 0;    // links below the top node
  std::vector<FileId> ancestors;
};

struct Opened {
  std::unique_ptr<io::BlockNode> node;
  const Driver* driver = nullptr;
  std::string exact_filename;  // QEMU's exact_filename; "" if none
  std::string json;            // QEMU's full_open_options as JSON
  posix_file::FileNode* file = nullptr;
  qcow2::Qcow2Node* qcow2 = nullptr;
  // The qcow2 node that answers for this node through raw and filters.
  qcow2::Qcow2Node* qcow2_below = nullptr;
  std::vector<FileId> files;  // the files of this subtree (not backing)
  bool probed = false;        // the driver was probed (QEMU's bs->probed)
};

std::string DisplayName(const Opened& o) {
  return o.exact_filename.empty() ? absl::StrCat("json:", o.json)
                                  : o.exact_filename;
}

// QEMU's QDict hash bucket of a key (qobject/qdict.c: tdb_hash modulo 512
// buckets): qobject_to_json walks a QDict bucket by bucket, which is the
// order of the keys in QEMU's json:{...} node names.
unsigned QdictBucket(absl::string_view key) {
  uint32_t value = 0x238F13AFu * static_cast<uint32_t>(key.size());
  for (size_t i = 0; i < key.size(); ++i) {
    value += static_cast<uint32_t>(static_cast<unsigned char>(key[i]))
             << (i * 5 % 24);
  }
  return (1103515243u * value + 12345u) % 512;
}

// A JSON object of `members` (key, JSON text of the value) in QEMU's QDict
// order, as bdrv_refresh_filename prints a node's full_open_options.
std::string QdictJson(std::vector<std::pair<std::string, std::string>> members) {
  std::stable_sort(members.begin(), members.end(),
                   [](const auto& a, const auto& b) {
                     return QdictBucket(a.first) < QdictBucket(b.first);
                   });
  std::string out = "{";
  for (size_t i = 0; i < members.size(); ++i) {
    if (i != 0) out += ", ";
    AppendJsonString(members[i].first, &out);
    absl::StrAppend(&out, ": ", members[i].second);
  }
  out += "}";
  return out;
}

// The JSON text of option `key` of `node` as QEMU keeps it: bare for a
// json: number or boolean, else a string.
std::string JsonValue(const NodeOptions& node, const std::string& key) {
  const std::string& value = node.values.at(key);
  if (node.bare.count(key) != 0) return value;
  std::string quoted;
  AppendJsonString(value, &quoted);
  return quoted;
}

// The description of `driver`'s node over its `file` child (the node
// itself is the caller's to fill in), named as QEMU's bdrv_refresh_filename
// names it: the child's file name if the child is a protocol node and this
// is not a filter, else JSON.
Opened Over(const Driver& driver, const Opened& child) {
  Opened out;
  out.driver = &driver;
  out.file = child.file;
  out.files = child.files;
  if (driver.name == "raw" || driver.kind == DriverKind::kFilter) {
    out.qcow2_below = child.qcow2_below;
  }
  if (child.driver->kind == DriverKind::kProtocol &&
      driver.kind != DriverKind::kFilter) {
    out.exact_filename = child.exact_filename;
  }
  std::string quoted;
  AppendJsonString(driver.name, &quoted);
  out.json = absl::StrCat("{\"driver\": ", quoted, ", \"file\": ",
                          child.json, "}");
  return out;
}

// posix_file says "<file>: Could not open: <strerror>" when open(2) fails;
// QEMU's file driver says "Could not open '<file>': <strerror>".
absl::Status FileError(const std::string& filename, const absl::Status& st) {
  const int error_number = StatusErrno(st);
  if (error_number != 0 &&
      st.message() == absl::StrCat(filename, ": Could not open: ",
                                   std::strerror(error_number))) {
    return absl::Status(st.code(),
                        absl::StrCat("Could not open '", filename,
                                     "': ", std::strerror(error_number)));
  }
  return st;
}

// The first key of a subtree, dotted ("foo.bar"), for unknown-option errors.
std::string FirstKey(const std::string& prefix, const NodeOptions& node) {
  if (!node.values.empty()) {
    return absl::StrCat(prefix, ".", node.values.begin()->first);
  }
  if (!node.children.empty()) {
    const auto& [name, child] = *node.children.begin();
    return FirstKey(absl::StrCat(prefix, ".", name), child);
  }
  return prefix;
}

// `file=<name>` names a node by its node name or device, which imgtool
// commands never have.
absl::Status NodeReferenceError(const std::string& name) {
  return absl::InvalidArgumentError(absl::StrFormat(
      "Cannot find device='%s' nor node-name='%s'", name, name));
}

absl::Status UnknownOption(const Driver& driver, const std::string& key) {
  if (driver.kind == DriverKind::kProtocol) {
    return absl::InvalidArgumentError(
        absl::StrCat("Block protocol '", driver.name,
                     "' doesn't support the option '", key, "'"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("Block format '", driver.name,
                   "' does not support the option '", key, "'"));
}

// The key of `node` (values, then children) that `driver` does not take, if
// any. `consumed` are the children and other keys this node took.
std::optional<std::string> FindUnknownKey(
    const Driver& driver, const NodeOptions& node,
    const std::vector<std::string>& consumed) {
  for (const auto& [key, value] : node.values) {
    const bool generic =
        std::find(kGenericKeys.begin(), kGenericKeys.end(), key) !=
        kGenericKeys.end();
    if (!generic && !Contains(driver.keys, key) &&
        !Contains(driver.ignored_keys, key) && !Contains(consumed, key)) {
      return key;
    }
  }
  for (const auto& [name, child] : node.children) {
    if (name == "cache") {
      for (const auto& [key, value] : child.values) {
        if (key != "direct" && key != "no-flush") {
          return absl::StrCat("cache.", key);
        }
      }
      if (!child.children.empty()) return FirstKey("cache", child);
      continue;
    }
    if (Contains(consumed, name)) continue;
    if (HasKeysBelow(driver.keys, name)) {
      for (const auto& [key, value] : child.values) {
        const std::string dotted = absl::StrCat(name, ".", key);
        if (!Contains(driver.keys, dotted)) return dotted;
      }
      if (!child.children.empty()) return FirstKey(name, child);
      continue;
    }
    return FirstKey(name, child);
  }
  return std::nullopt;
}

// The filename at the bottom of the `file` chain of `node`, if any.
std::optional<std::string> LeafFilename(const NodeOptions& node) {
  const NodeOptions* n = &node;
  while (true) {
    auto filename = n->values.find("filename");
    if (filename != n->values.end()) return filename->second;
    auto file = n->children.find("file");
    if (file == n->children.end()) return std::nullopt;
    n = &file->second;
  }
}

// The options every driver takes: read-only, force-share, auto-read-only
// (accepted, without effect: imgtool never reopens), cache.direct and
// cache.no-flush.
struct GenericOptions {
  // read-only, if given. read-only=off makes a QEMU node writable even
  // where the command opens read-only (qemu-img info), so force-share=on
  // beside it fails there; imgtool keeps such a node read-only but fails
  // the same (CheckAccess).
  std::optional<bool> read_only;
  bool force_share = false;
  std::optional<bool> direct;
  std::optional<bool> no_flush;
};

absl::StatusOr<GenericOptions> ParseGenericOptions(const NodeOptions& node) {
  GenericOptions g;
  for (const char* key : {"read-only", "force-share", "auto-read-only"}) {
    auto it = node.values.find(key);
    if (it == node.values.end()) continue;
    ASSIGN_OR_RETURN(bool on, ParseBoolOption(key, it->second));
    if (std::string(key) == "read-only") g.read_only = on;
    if (std::string(key) == "force-share") g.force_share = on;
  }
  if (auto it = node.children.find("cache"); it != node.children.end()) {
    for (const char* key : {"direct", "no-flush"}) {
      auto v = it->second.values.find(key);
      if (v == it->second.values.end()) continue;
      ASSIGN_OR_RETURN(bool on,
                       ParseBoolOption(absl::StrCat("cache.", key), v->second));
      (std::string(key) == "direct" ? g.direct : g.no_flush) = on;
    }
  }
  return g;
}

}  // namespace

BottomProtocolNode FindBottomProtocolNode(const NodeOptions& options,
                                          const std::string& cache) {
  BottomProtocolNode bottom{&options, CacheFromMode(cache).direct, false};
  for (const NodeOptions* n = &options; n != nullptr;) {
    bottom.node = n;
    absl::StatusOr<GenericOptions> g = ParseGenericOptions(*n);
    if (g.ok() && g->direct.has_value()) bottom.direct = *g->direct;
    auto file = n->children.find("file");
    n = file == n->children.end() ? nullptr : &file->second;
  }
  const NodeOptions& b = *bottom.node;
  if (auto driver = b.values.find("driver"); driver != b.values.end()) {
    bottom.posix_file = IsPosixFileDriver(driver->second);
  } else if (auto name = b.values.find("filename"); name != b.values.end()) {
    bottom.posix_file = !HasProtocolPrefix(name->second);
  }
  return bottom;
}

namespace {

// The read-only and force-share options of a node opened read-only or not
// (`read_only`), as QEMU checks them.
absl::Status CheckAccess(const GenericOptions& g, bool read_only) {
  if (g.read_only.value_or(false) && !read_only) {
    return absl::FailedPreconditionError("Block node is read-only");
  }
  if (g.force_share && (!read_only || !g.read_only.value_or(true))) {
    return absl::InvalidArgumentError(
        "force-share=on can only be used with read-only images");
  }
  return absl::OkStatus();
}

// True if a format driver (qcow2) sits in the `file` chain of `node`:
// probing must then read what that format shows, not the file.
bool ChainHasFormatOtherThanRaw(const NodeOptions& node) {
  for (const NodeOptions* n = &node;;) {
    auto driver = n->values.find("driver");
    if (driver != n->values.end()) {
      const Driver* d = FindDriver(driver->second);
      if (d != nullptr && d->kind == DriverKind::kFormat && d->name != "raw") {
        return true;
      }
    }
    auto file = n->children.find("file");
    if (file == n->children.end()) return false;
    n = &file->second;
  }
}

// True if `node` names a protocol driver other than `file` (blkdebug):
// probing must open it to read the image below.
bool IsOtherProtocol(const NodeOptions& node) {
  auto driver = node.values.find("driver");
  if (driver == node.values.end()) return false;
  const Driver* d = FindDriver(driver->second);
  return d != nullptr && d->kind == DriverKind::kProtocol &&
         !IsPosixFileDriver(d->name);
}

// `"backing": null` in json: or `backing=` (QEMU's deprecated spelling of
// it): the node has no backing file.
bool IsNullBacking(const NodeOptions& node) {
  auto it = node.values.find("backing");
  return it != node.values.end() &&
         (it->second.empty() || it->second == kJsonNullBacking);
}

// kUnimplemented for QEMU options imgtool does not implement; adds the
// generic keys it accepts with their default value (discard=ignore,
// detect-zeroes=off) to `consumed`.
absl::Status CheckUnsupportedKeys(const Driver& driver,
                                  const NodeOptions& node, bool no_backing,
                                  std::vector<std::string>* consumed) {
  if (IsNullBacking(node) ||
      (driver.name == "qcow2" && !no_backing &&
       (node.values.count("backing") != 0 ||
        node.children.count("backing") != 0))) {
    // `backing=NODE` and `backing.*` are taken by OpenQcow2.
    consumed->push_back("backing");
  }
  // qcow2's encryption options name a secret (--object secret,id=...):
  // one that was never defined is QEMU's error; a defined one still cannot
  // be used, as imgtool has no qcow2 encryption.
  if (driver.name == "qcow2") {
    auto encrypt = node.children.find("encrypt");
    if (encrypt != node.children.end()) {
      auto secret = encrypt->second.values.find("key-secret");
      if (secret != encrypt->second.values.end()) {
        absl::StatusOr<std::string> found =
            ObjectRegistry::Default().LookupSecret(secret->second);
        if (!found.ok()) return found.status();
        return absl::UnimplementedError(absl::StrCat(
            "Block format 'qcow2' option 'encrypt.key-secret' is not "
            "supported yet: imgtool cannot use secret '",
            secret->second, "', it has no qcow2 encryption"));
      }
    }
  }
  for (const std::string& key : driver.unsupported_keys) {
    if (node.values.count(key) != 0 || node.children.count(key) != 0) {
      return absl::UnimplementedError(absl::StrCat(
          "Block ",
          driver.kind == DriverKind::kProtocol ? "protocol '" : "format '",
          driver.name, "' option '", key, "' is not supported yet"));
    }
  }
  for (const char* key : {"discard", "detect-zeroes"}) {
    auto it = node.values.find(key);
    if (it == node.values.end()) continue;
    if (it->second != "off" && it->second != "ignore") {
      return absl::UnimplementedError(absl::StrCat(
          "Option '", key, "=", it->second, "' is not supported yet"));
    }
    consumed->push_back(key);
  }
  return absl::OkStatus();
}

io::Task<absl::StatusOr<Opened>> OpenNode(NodeOptions node, Context ctx,
                                          Slot slot);

io::Task<absl::StatusOr<Opened>> OpenFile(const Driver& driver,
                                          NodeOptions node, Context ctx) {
  posix_file::FileOpenOptions options;
  CO_RETURN_IF_ERROR(FillDriverOptions(driver, node, &options));
  const std::string filename = options.filename();
  if (filename.empty()) {
    co_return absl::InvalidArgumentError(absl::StrCat(
        "The '", driver.name, "' block driver requires a file name"));
  }
  for (const char* key : {"aio", "locking"}) {
    auto it = node.values.find(key);
    if (it == node.values.end()) continue;
    const std::string& v = it->second;
    const bool valid = std::string(key) == "locking"
                           ? (v == "auto" || v == "on" || v == "off")
                           : (v == "threads" || v == "native" ||
                              v == "io_uring");
    if (!valid) {
      co_return absl::InvalidArgumentError(
          absl::StrCat("invalid parameter value: ", v));
    }
  }
  struct stat st;
  std::optional<FileId> id;
  if (stat(filename.c_str(), &st) == 0) {
    id = FileId{st.st_dev, st.st_ino};
    if (std::find(ctx.ancestors.begin(), ctx.ancestors.end(), *id) !=
        ctx.ancestors.end()) {
      co_return absl::InvalidArgumentError(absl::StrCat(
          "Backing file '", filename, "' creates an infinite loop."));
    }
  }
  options.set_driver(driver.name);
  options.set_cache(CacheMode(ctx.cache));
  options.set_read_only(ctx.read_only);
  options.set_force_share(ctx.force_share);
  options.set_share_all_with_others(ctx.share_all);
  std::ostringstream warnings;
  absl::StatusOr<std::unique_ptr<posix_file::FileNode>> file =
      posix_file::FileNode::Open(*ctx.settings->engine, options, &warnings);
  if (ctx.settings->warn && !warnings.str().empty()) {
    ctx.settings->warn(warnings.str());
  }
  if (!file.ok()) co_return FileError(filename, file.status());
  if (auto it = node.values.find("aio");
      it != node.values.end() && it->second == "native" && !ctx.cache.direct) {
    absl::Status closed = co_await (*file)->Close();
    closed.IgnoreError();  // the option error is the one to report
    co_return absl::InvalidArgumentError(
        "aio=native was specified, but it requires cache.direct=on, which "
        "was not specified.");
  }
  Opened out;
  out.driver = &driver;
  out.file = file->get();
  out.node = *std::move(file);
  out.exact_filename = filename;
  std::string quoted;
  AppendJsonString(filename, &quoted);
  out.json = absl::StrCat("{\"driver\": \"", driver.name, "\", \"filename\": ",
                          quoted, "}");
  if (id.has_value()) out.files.push_back(*id);
  co_return out;
}

// Adds the values of `from` that `into` lacks (the values `into` has stay).
void AddMissingValues(const NodeOptions& from, NodeOptions* into) {
  for (const auto& [key, value] : from.values) into->values.try_emplace(key, value);
}

// Lays the values and children of `over` over `base` (values of `over`
// win).
void MergeOptions(const NodeOptions& over, NodeOptions* base) {
  for (const auto& [key, value] : over.values) base->values[key] = value;
  for (const std::string& key : over.bare) base->bare.insert(key);
  for (const auto& [key, child] : over.children) {
    MergeOptions(child, &base->children[key]);
  }
}

// What a qcow2 node's options say about its backing file: `backing=NODE`
// (a node reference) and the `backing.*` subtree.
struct BackingOverrides {
  std::optional<std::string> reference;
  std::optional<NodeOptions> options;
};

// Opens a backing file of a qcow2 node: `filename` as the qcow2 node
// resolved it, `format` as stored in the image ("" = probe), with the
// node's backing options as QEMU 7.2's bdrv_open_backing_file takes them:
// a reference names a node ("Cannot find device='x' nor node-name='x'":
// imgtool opens no node outside the graph); `backing.*` options are laid
// over the stored name and format (the driver from the image's backing
// format unless given, the name placed as block::PlaceFilename places it),
// or replace the stored name if they give `file.filename`.
io::Task<absl::StatusOr<std::unique_ptr<io::BlockNode>>> OpenBacking(
    Context ctx, std::string filename, std::string format,
    BackingOverrides overrides) {
  if (overrides.reference.has_value()) {
    co_return NodeReferenceError(*overrides.reference);
  }
  NodeOptions options;
  const NodeOptions* given =
      overrides.options.has_value() ? &*overrides.options : nullptr;
  const bool named_by_options =
      given != nullptr && given->children.count("file") != 0 &&
      given->children.at("file").values.count("filename") != 0;
  if (named_by_options) {
    options = *given;
  } else if (given == nullptr || absl::StartsWith(filename, "json:")) {
    // As a filename on the command line: json:, protocol prefixes.
    CO_ASSIGN_OR_RETURN(options,
                        ImageOptions(filename, format, /*image_opts=*/false));
    if (given != nullptr) MergeOptions(*given, &options);
  } else {
    options = *given;
    if (!format.empty()) options.values.try_emplace("driver", format);
    if (options.values.count("driver") != 0) {
      CO_RETURN_IF_ERROR(PlaceFilename(filename, &options));
    } else {
      CO_ASSIGN_OR_RETURN(NodeOptions protocol, ProtocolNodeOptions(filename));
      AddMissingValues(protocol, &options.children["file"]);
    }
  }
  ++ctx.backing_depth;
  ctx.read_only = ctx.backing_depth != ctx.settings->writable_backing_depth;
  ctx.share_all = false;
  ctx.is_backing = true;
  CO_ASSIGN_OR_RETURN(Opened opened,
                      co_await OpenNode(std::move(options), ctx,
                                        Slot::kBacking));
  (*ctx.names)[opened.node.get()] = DisplayName(opened);
  co_return std::move(opened.node);
}

io::Task<absl::StatusOr<Opened>> OpenQcow2(const Driver& driver,
                                           NodeOptions node, Context ctx,
                                           Opened child) {
  qcow2::Qcow2OpenOptions options;
  CO_RETURN_IF_ERROR(FillDriverOptions(driver, node, &options));
  std::ostream* err = ctx.settings->err;
  qcow2::RefcountRepairer repair = [err](io::BlockNode& f) {
    return qcow2::RebuildRefcounts(f, err);
  };
  qcow2::BackingOpener opener;
  BackingOverrides overrides;
  bool backing_opened = false;  // backing files are opened (opener set)
  if (!ctx.settings->no_backing && !IsNullBacking(node)) {
    if (auto it = node.values.find("backing"); it != node.values.end()) {
      overrides.reference = it->second;
    }
    if (auto it = node.children.find("backing"); it != node.children.end()) {
      overrides.options = it->second;
    }
    Context backing = ctx;
    backing.ancestors.insert(backing.ancestors.end(), child.files.begin(),
                             child.files.end());
    backing_opened = true;
    opener = [backing, overrides](std::string filename, std::string format) {
      return OpenBacking(backing, std::move(filename), std::move(format),
                         overrides);
    };
  }
  Opened out = Over(driver, child);
  // qcow2 allocates clusters at the end of its file: keep the file's
  // length ahead of them so that those writes run in parallel (see
  // FileNode::GrowLengthAhead). Not through a filter: the preallocate
  // filter grows the file itself.
  posix_file::FileNode* grows = nullptr;
  if (child.driver->kind == DriverKind::kProtocol && child.file != nullptr &&
      !ctx.read_only) {
    grows = child.file;
    if (ctx.settings->qcow2_grow_ahead) {
      grows->GrowLengthAhead(kQcow2FileGrowthStep);
    }
  }
  // Named locals, not temporaries in the co_await expression: GCC 12
  // destroys some of those twice.
  std::unique_ptr<io::BlockNode> file = std::move(child.node);
  CO_ASSIGN_OR_RETURN(
      std::unique_ptr<qcow2::Qcow2Node> q,
      co_await qcow2::Qcow2Node::Open(std::move(file), std::move(options),
                                      std::move(opener), std::move(repair)));
  q->set_messages(err);
  if (grows != nullptr && grows->MayHaveTailGrownAhead()) {
    // A writer killed while the file was grown ahead left a hole after the
    // data (and the file marked); past the last refcounted cluster it is
    // cut at close (best effort: refcounts that cannot be read leave the
    // file as it is). Unmarked hole tails stay, as in QEMU.
    absl::StatusOr<uint64_t> used_end = co_await q->RefcountedEnd();
    if (used_end.ok()) grows->AdoptHoleTail(*used_end);
  }
  if (q->backing() == nullptr && backing_opened &&
      (overrides.reference.has_value() || overrides.options.has_value())) {
    // Backing options on an image without a backing file: QEMU opens them
    // as the backing node; imgtool's qcow2 node only takes the backing
    // file its header names.
    absl::Status closed = co_await q->Close();
    closed.IgnoreError();  // the option error is the one to report
    if (overrides.reference.has_value()) {
      co_return absl::InvalidArgumentError(absl::StrCat(
          "Could not open backing file: ",
          NodeReferenceError(*overrides.reference).message()));
    }
    const NodeOptions& given = *overrides.options;
    const bool has_file =
        given.children.count("file") != 0 || given.values.count("file") != 0;
    auto driver_it = given.values.find("driver");
    const Driver* backing_driver =
        driver_it == given.values.end() ? nullptr
                                        : FindDriver(driver_it->second);
    if (driver_it == given.values.end() && !has_file) {
      co_return absl::InvalidArgumentError(
          "Could not open backing file: Must specify either driver or file");
    }
    if (backing_driver != nullptr &&
        backing_driver->kind != DriverKind::kProtocol && !has_file) {
      co_return absl::InvalidArgumentError(
          "Could not open backing file: A block device must be specified "
          "for \"file\"");
    }
    co_return absl::UnimplementedError(
        "Block format 'qcow2' option 'backing' is not supported yet on an "
        "image without a backing file");
  }
  out.qcow2 = q.get();
  out.qcow2_below = q.get();
  out.node = std::move(q);
  co_return out;
}

io::Task<absl::StatusOr<Opened>> OpenPreallocate(const Driver& driver,
                                                 NodeOptions node,
                                                 Opened child) {
  prealloc_filter::PreallocFilterOptions options;
  CO_RETURN_IF_ERROR(FillDriverOptions(driver, node, &options));
  Opened out = Over(driver, child);
  // Options are validated against the file's request alignment there.
  std::unique_ptr<io::BlockNode> file = std::move(child.node);
  CO_ASSIGN_OR_RETURN(
      std::unique_ptr<prealloc_filter::PreallocFilterNode> filter,
      co_await prealloc_filter::OpenPreallocFilter(std::move(file), options));
  out.node = std::move(filter);
  co_return out;
}

// null-co / null-aio: named "null-co://" unless a strong option (size,
// read-zeroes) is given (QEMU's null_refresh_filename), else json:{...}
// with the driver and those options.
io::Task<absl::StatusOr<Opened>> OpenNull(const Driver& driver,
                                          NodeOptions node, Context ctx) {
  null_block::NullOptions options;
  CO_RETURN_IF_ERROR(FillDriverOptions(driver, node, &options));
  CO_ASSIGN_OR_RETURN(std::unique_ptr<null_block::NullNode> null_node,
                      null_block::NullNode::Open(driver.name, options,
                                                 ctx.settings->engine,
                                                 ctx.read_only));
  Opened out;
  out.driver = &driver;
  out.node = std::move(null_node);
  std::string quoted;
  AppendJsonString(driver.name, &quoted);
  std::vector<std::pair<std::string, std::string>> members = {
      {"driver", quoted}};
  for (const char* key : {"size", "read-zeroes"}) {
    if (node.values.count(key) != 0) {
      members.emplace_back(key, JsonValue(node, key));
    }
  }
  if (members.size() == 1) out.exact_filename = absl::StrCat(driver.name, "://");
  out.json = QdictJson(std::move(members));
  co_return out;
}

// nbd: named as QEMU's nbd_refresh_filename (nbd_block::ExactFilename),
// json:{"driver": "nbd", "server": {...}, "export": ...} when it has no
// such name (an IPv6 host).
io::Task<absl::StatusOr<Opened>> OpenNbd(const Driver& driver,
                                         NodeOptions node, Context ctx) {
  CO_ASSIGN_OR_RETURN(
      nbd_block::NbdAddress address,
      nbd_block::AddressFromOptions(
          [&node](const std::string& key) { return FindKeyValue(node, key); }));
  if (address.multi_conn == 0) address.multi_conn = ctx.settings->nbd_connections;
  std::string exact = nbd_block::ExactFilename(address);
  std::vector<std::pair<std::string, std::string>> server;
  auto quote = [](const std::string& v) {
    std::string q;
    AppendJsonString(v, &q);
    return q;
  };
  if (address.is_unix) {
    server = {{"type", quote("unix")}, {"path", quote(address.path)}};
  } else {
    server = {{"type", quote("inet")},
              {"host", quote(address.host)},
              {"port", quote(address.port)}};
  }
  std::vector<std::pair<std::string, std::string>> members = {
      {"driver", quote(driver.name)}, {"server", QdictJson(server)}};
  if (address.export_name.has_value()) {
    members.emplace_back("export", quote(*address.export_name));
  }
  // Strong options of QEMU's nbd driver.
  for (const char* key : {"tls-creds", "tls-hostname"}) {
    if (const std::string* v = FindKeyValue(node, key); v != nullptr) {
      members.emplace_back(key, quote(*v));
    }
  }
  CO_ASSIGN_OR_RETURN(
      std::unique_ptr<nbd_block::NbdNode> nbd,
      nbd_block::NbdNode::Open(exact.empty() ? "nbd" : exact, address,
                               ctx.settings->engine, ctx.read_only));
  Opened out;
  out.driver = &driver;
  out.node = std::move(nbd);
  out.exact_filename = exact;
  out.json = QdictJson(std::move(members));
  co_return out;
}

// The options of `node` as QEMU's flattened keys ("inject-error.0.event"),
// without `skip` children.
void FlattenValues(const NodeOptions& node, const std::string& prefix,
                   std::vector<std::pair<std::string, std::string>>* out) {
  for (const auto& [key, value] : node.values) {
    out->emplace_back(prefix + key, value);
  }
  for (const auto& [key, child] : node.children) {
    FlattenValues(child, absl::StrCat(prefix, key, "."), out);
  }
}

io::Task<absl::StatusOr<Opened>> OpenBlkdebugNode(const Driver& driver,
                                                  NodeOptions node,
                                                  Opened child) {
  blkdebug::BlkdebugOptions options;
  CO_RETURN_IF_ERROR(FillDriverOptions(driver, node, &options));
  std::vector<blkdebug::Rule> rules;
  if (!options.config().empty()) {
    CO_ASSIGN_OR_RETURN(rules, blkdebug::ParseConfigFile(options.config()));
  }
  CO_ASSIGN_OR_RETURN(std::vector<blkdebug::Rule> more,
                      blkdebug::RulesFromOptions(node));
  for (blkdebug::Rule& rule : more) rules.push_back(std::move(rule));
  // Named as QEMU's blkdebug_refresh_filename: "blkdebug:CONFIG:IMAGE" if
  // the node has no options but those, else json with its options in
  // QEMU's qdict order.
  Opened out;
  out.driver = &driver;
  out.file = child.file;
  out.files = child.files;
  out.qcow2_below = child.qcow2_below;
  std::vector<std::pair<std::string, std::string>> entries;
  bool plain = true;
  for (const auto& [key, value] : node.values) {
    if (key == "x-image") continue;
    if (key != "driver" && key != "config") plain = false;
    if (key != "driver") entries.emplace_back(key, value);
  }
  for (const auto& [key, value] : node.children) {
    if (key == "image") continue;
    plain = false;
    FlattenValues(value, key + ".", &entries);
  }
  if (plain && !child.exact_filename.empty()) {
    out.exact_filename = absl::StrCat("blkdebug:", options.config(), ":",
                                      child.exact_filename);
  }
  std::vector<std::pair<std::string, std::string>> members = {
      {"image", child.json}, {"driver", "\"blkdebug\""}};
  for (const auto& [key, value] : entries) {
    std::string quoted;
    AppendJsonString(value, &quoted);
    members.emplace_back(key, quoted);
  }
  out.json = QdictJson(std::move(members));
  std::unique_ptr<io::BlockNode> image = std::move(child.node);
  CO_ASSIGN_OR_RETURN(
      std::unique_ptr<blkdebug::BlkdebugNode> filter,
      co_await blkdebug::OpenBlkdebug(std::move(image), options,
                                      std::move(rules)));
  out.node = std::move(filter);
  co_return out;
}

// copy-on-read (QEMU 7.2's cor_open): `bottom` names a node opened before
// ("Bottom node 'x' not found") that is not a filter; the filter needs to
// write to its child (QEMU's WRITE_UNCHANGED permission), so a read-only
// graph is "Block node is read-only".
io::Task<absl::StatusOr<Opened>> OpenCor(const Driver& driver,
                                         NodeOptions node, Context ctx,
                                         Opened child) {
  cor_filter::CorOptions options;
  CO_RETURN_IF_ERROR(FillDriverOptions(driver, node, &options));
  cor_filter::CorSettings settings;
  if (options.has_bottom()) {
    auto it = ctx.named_nodes->find(options.bottom());
    if (it == ctx.named_nodes->end()) {
      co_return absl::InvalidArgumentError(absl::StrCat(
          "Bottom node '", options.bottom(), "' not found"));
    }
    if (it->second.is_filter) {
      co_return absl::InvalidArgumentError(absl::StrCat(
          "Bottom node '", options.bottom(), "' is a filter"));
    }
    settings.bottom = it->second.node;
  }
  if (ctx.read_only) {
    co_return absl::FailedPreconditionError("Block node is read-only");
  }
  if (child.qcow2_below != nullptr) {
    settings.cluster_size = child.qcow2_below->cluster_size();
  }
  Opened out = Over(driver, child);
  out.node = std::make_unique<cor_filter::CorNode>(std::move(child.node),
                                                   settings);
  co_return out;
}

// compress (QEMU 7.2's compress_open): the child must be a format that
// writes compressed clusters (qcow2), else ENOTSUP "Compression is not
// supported for underlying format: raw"; the filter's request alignment is
// the child's cluster size, and QEMU's permission check refuses writing
// through it when the child's size is not a multiple of that.
io::Task<absl::StatusOr<Opened>> OpenCompress(const Driver& driver,
                                              Context ctx, Opened child) {
  absl::Status refused;
  if (child.driver->name != "qcow2" || child.qcow2 == nullptr) {
    refused = absl::UnimplementedError(
        absl::StrCat("Compression is not supported for underlying format: ",
                     child.driver->name));
  } else if (!ctx.read_only &&
             child.qcow2->size() % child.qcow2->cluster_size() != 0) {
    refused = absl::FailedPreconditionError(
        "Cannot get 'write' permission without 'resize': Image size is not "
        "a multiple of request alignment");
  }
  if (!refused.ok()) {
    absl::Status closed = co_await child.node->Close();
    closed.IgnoreError();  // the open error is the one to report
    co_return refused;
  }
  qcow2::Qcow2Node* qcow2 = child.qcow2;
  compress_filter::CompressSettings settings{
      .cluster_size = qcow2->cluster_size(),
      .write_compressed = [qcow2](uint64_t offset, io::ConstIoVec data) {
        return qcow2->WriteCompressed(offset, data);
      }};
  Opened out = Over(driver, child);
  out.node = std::make_unique<compress_filter::CompressNode>(
      std::move(child.node), std::move(settings));
  co_return out;
}

// quorum (QEMU 7.2's quorum_open): the options are checked before any
// child is opened (quorum_block::CheckQuorumOptions, after "Option
// children is not a valid array" for `children` keys that are not 0..N-1),
// then children.0, children.1, ... are opened as images of their own
// (probed if they name no driver), keeping other writers out.
// rewrite-corrupted needs to write to the children: "Block node is
// read-only" (kFailedPrecondition) on a read-only graph. Named json:{...}
// with the driver, the strong options given and "children": [...].
io::Task<absl::StatusOr<Opened>> OpenQuorum(const Driver& driver,
                                            const NodeOptions& node,
                                            Context ctx) {
  int num_children = 0;
  const NodeOptions* list = nullptr;
  if (auto it = node.children.find("children"); it != node.children.end()) {
    list = &it->second;
    while (list->values.count(absl::StrCat(num_children)) != 0 ||
           list->children.count(absl::StrCat(num_children)) != 0) {
      ++num_children;
    }
    if (list->values.size() + list->children.size() !=
        static_cast<size_t>(num_children)) {
      co_return absl::InvalidArgumentError(
          "Option children is not a valid array");
    }
  }
  quorum_block::QuorumOptions options;
  if (num_children < 1) {
    co_return absl::InvalidArgumentError(
        "Number of provided children must be 1 or more");
  }
  CO_RETURN_IF_ERROR(FillDriverOptions(driver, node, &options));
  CO_ASSIGN_OR_RETURN(quorum_block::QuorumSettings settings,
                      quorum_block::CheckQuorumOptions(options, num_children));
  if (settings.rewrite_corrupted && ctx.read_only) {
    co_return absl::FailedPreconditionError("Block node is read-only");
  }
  Opened out;
  out.driver = &driver;
  std::vector<std::unique_ptr<io::BlockNode>> children;
  std::string children_json = "[";
  Context child_ctx = ctx;
  child_ctx.share_all = false;
  absl::Status failed;
  for (int i = 0; i < num_children && failed.ok(); ++i) {
    const std::string key = absl::StrCat(i);
    if (auto ref = list->values.find(key); ref != list->values.end()) {
      failed = NodeReferenceError(ref->second);
      break;
    }
    absl::StatusOr<Opened> child =
        co_await OpenNode(list->children.at(key), child_ctx, Slot::kTop);
    if (!child.ok()) {
      failed = child.status();
      break;
    }
    (*ctx.names)[child->node.get()] = DisplayName(*child);
    absl::StrAppend(&children_json, i == 0 ? "" : ", ", child->json);
    out.files.insert(out.files.end(), child->files.begin(),
                     child->files.end());
    children.push_back(std::move(child->node));
  }
  std::string name;
  if (failed.ok()) {
    children_json += "]";
    std::string quoted;
    AppendJsonString(driver.name, &quoted);
    std::vector<std::pair<std::string, std::string>> members = {
        {"driver", quoted}, {"children", children_json}};
    for (const std::string& key : driver.keys) {
      if (node.values.count(key) != 0) {
        members.emplace_back(key, JsonValue(node, key));
      }
    }
    out.json = QdictJson(std::move(members));
    name = absl::StrCat("json:", out.json);
    absl::StatusOr<std::unique_ptr<quorum_block::QuorumNode>> quorum =
        quorum_block::QuorumNode::Open(std::move(children), settings, name,
                                       ctx.read_only);
    if (quorum.ok()) {
      out.node = *std::move(quorum);
      co_return out;
    }
    failed = quorum.status();  // the children are still ours to close
  }
  for (auto& child : children) {
    if (child == nullptr) continue;
    absl::Status closed = co_await child->Close();
    closed.IgnoreError();  // the open error is the one to report
  }
  co_return failed;
}

io::Task<absl::StatusOr<Opened>> OpenNode(NodeOptions node, Context ctx,
                                          Slot slot) {
  // 1. The driver: named, implied by a filename (a `file` child is a
  // protocol node), or probed from the first bytes of the file below.
  std::string driver_name;
  bool probed = false;
  std::optional<Opened> file_child;  // opened early when probing needs it
  if (auto it = node.values.find("driver"); it != node.values.end()) {
    driver_name = it->second;
    if (FindDriver(driver_name) == nullptr) {
      if (IsUnsupportedQemuDriver(driver_name)) {
        co_return absl::UnimplementedError(
            absl::StrCat("Format '", driver_name, "' is not supported yet"));
      }
      co_return absl::InvalidArgumentError(
          absl::StrCat("Unknown driver '", driver_name, "'"));
    }
  }
  const auto node_reference = node.values.find("file");
  if (driver_name.empty()) {
    if (node_reference != node.values.end()) {
      co_return NodeReferenceError(node_reference->second);
    }
    if (slot == Slot::kFile) {
      // A protocol node: its driver comes from its filename (only `file`
      // here), never from probing.
      if (node.values.count("filename") == 0) {
        co_return absl::InvalidArgumentError(
            "Must specify either driver or file");
      }
      driver_name = HostDeviceDriverFor(node.values.at("filename"));
      if (driver_name.empty()) driver_name = "file";
    } else if (node.children.count("file") != 0 &&
               (ChainHasFormatOtherThanRaw(node.children.at("file")) ||
                IsOtherProtocol(node.children.at("file")))) {
      // Probe what the format below shows: open it first (keeping writers
      // out, as under any format but raw).
      Context child_ctx = ctx;
      child_ctx.share_all = false;
      CO_ASSIGN_OR_RETURN(Opened opened,
                          co_await OpenNode(node.children.at("file"),
                                            child_ctx, Slot::kFile));
      std::array<uint8_t, 512> head{};
      const size_t got = std::min<uint64_t>(head.size(), opened.node->size());
      if (absl::Status read = co_await opened.node->Read(
              0, io::IoVec(head.data(), head.size()));
          !read.ok()) {
        const int error_number = StatusErrno(read);
        if (error_number == 0) co_return read;
        co_return WithMessage(
            read, absl::StrCat("Could not read image for determining its "
                               "format: ",
                               std::strerror(error_number)));
      }
      driver_name = FormatOfHead(head.data(), got);
      probed = true;
      if (driver_name == "qcow") {
        co_return absl::UnimplementedError(
            "Format 'qcow' is not supported yet");
      }
      (*ctx.names)[opened.node.get()] = DisplayName(opened);
      file_child = std::move(opened);
    } else if (node.children.count("file") != 0) {
      std::optional<std::string> leaf = LeafFilename(node);
      absl::StatusOr<std::string> guess =
          leaf.has_value() ? ProbeFormat(*leaf)
                           : absl::StatusOr<std::string>("raw");
      // Files that cannot be read are opened as raw, which says why.
      driver_name = guess.ok() ? *guess : "raw";
      probed = true;
      if (driver_name == "qcow") {
        co_return absl::UnimplementedError(
            "Format 'qcow' is not supported yet");
      }
    } else {
      co_return absl::InvalidArgumentError(
          "Must specify either driver or file");
    }
  }
  const Driver& driver = *FindDriver(driver_name);
  if (IsNullBacking(node) && node.values.at("backing").empty() &&
      ctx.settings->warn) {
    ctx.settings->warn(
        "Use of \"backing\": \"\" is deprecated; use \"backing\": null "
        "instead");
  }

  // 2. The options every node takes.
  CO_ASSIGN_OR_RETURN(GenericOptions generic, ParseGenericOptions(node));
  CO_RETURN_IF_ERROR(CheckAccess(generic, ctx.read_only));
  if (generic.force_share) ctx.force_share = true;
  if (generic.direct.has_value()) ctx.cache.direct = *generic.direct;
  if (generic.no_flush.has_value()) ctx.cache.no_flush = *generic.no_flush;

  // 3. Children first.
  std::vector<std::string> consumed;  // children and keys taken here
  if (file_child.has_value()) {
    consumed.push_back("file");
  } else if (driver.has_file_child) {
    const std::string& key = driver.file_child_key;
    if (key == "file" && node_reference != node.values.end()) {
      co_return NodeReferenceError(node_reference->second);
    }
    if (auto image = node.values.find("x-image"); image != node.values.end()) {
      // A filename the driver's parse_filename left (blkdebug's IMAGE):
      // the child's file name, or passed down to its own child if the
      // options give the child a driver (QEMU's bdrv_open_child with it).
      auto child = node.children.find(key);
      if (child == node.children.end()) {
        node.children[key].values["filename"] = image->second;
      } else if (child->second.values.count("driver") != 0) {
        CO_RETURN_IF_ERROR(PlaceFilename(image->second, &child->second));
      }
      consumed.push_back("x-image");
    }
    auto it = node.children.find(key);
    if (it == node.children.end()) {
      co_return absl::InvalidArgumentError(absl::StrCat(
          "A block device must be specified for \"", key, "\""));
    }
    consumed.push_back(key);
    Context child_ctx = ctx;
    child_ctx.share_all = driver.name == "raw" && ctx.share_all;
    CO_ASSIGN_OR_RETURN(Opened opened,
                        co_await OpenNode(it->second, child_ctx, Slot::kFile));
    (*ctx.names)[opened.node.get()] = DisplayName(opened);
    file_child = std::move(opened);
  }
  CO_RETURN_IF_ERROR(
      CheckUnsupportedKeys(driver, node, ctx.settings->no_backing, &consumed));

  // 4. The node itself.
  absl::StatusOr<Opened> opened;
  if (IsPosixFileDriver(driver.name)) {
    opened = co_await OpenFile(driver, node, ctx);
  } else if (driver.name == "null-co" || driver.name == "null-aio") {
    opened = co_await OpenNull(driver, node, ctx);
  } else if (driver.name == "nbd") {
    opened = co_await OpenNbd(driver, node, ctx);
  } else if (driver.name == "raw") {
    raw_format::RawOptions options;
    CO_RETURN_IF_ERROR(FillDriverOptions(driver, node, &options));
    Opened out = Over(driver, *file_child);
    const bool window = options.has_offset() || options.has_size();
    // Without offset/size raw is the file node itself, except over blkdebug:
    // there a pass-through RawNode raises QEMU's read_aio and write_aio on
    // it (the names stay the file's).
    const bool over_blkdebug = file_child->node->HandlesDebugEvents();
    if (window) {
      // A window of the file: a node of its own, named with its options
      // (QEMU's strong runtime options of raw).
      std::string quoted;
      AppendJsonString(driver.name, &quoted);
      std::vector<std::pair<std::string, std::string>> members = {
          {"driver", quoted}, {"file", file_child->json}};
      for (const char* key : {"offset", "size"}) {
        if (node.values.count(key) != 0) {
          members.emplace_back(key, JsonValue(node, key));
        }
      }
      out.exact_filename.clear();
      out.json = QdictJson(std::move(members));
    }
    if (window || over_blkdebug) {
      std::unique_ptr<io::BlockNode> file = std::move(file_child->node);
      CO_ASSIGN_OR_RETURN(out.node,
                          raw_format::RawNode::Open(std::move(file), options));
    } else {
      out.node = std::move(file_child->node);
    }
    if (probed && !ctx.read_only && !ctx.is_backing) {
      // qemu-img warns only when a probed raw image is opened for writing.
      *ctx.settings->err
          << "WARNING: Image format was not specified for '"
          << DisplayName(*file_child)
          << "' and probing guessed raw.\n"
             "         Automatically detecting the format is dangerous for "
             "raw images, write operations on block 0 will be restricted.\n"
             "         Specify the 'raw' format explicitly to remove the "
             "restrictions.\n";
    }
    opened = std::move(out);
  } else if (driver.name == "qcow2") {
    opened = co_await OpenQcow2(driver, node, ctx, *std::move(file_child));
  } else if (driver.name == "preallocate") {
    opened = co_await OpenPreallocate(driver, node, *std::move(file_child));
  } else if (driver.name == "copy-on-read") {
    opened = co_await OpenCor(driver, node, ctx, *std::move(file_child));
  } else if (driver.name == "compress") {
    opened = co_await OpenCompress(driver, ctx, *std::move(file_child));
  } else if (driver.name == "quorum") {
    consumed.push_back("children");
    opened = co_await OpenQuorum(driver, node, ctx);
  } else if (driver.name == "blkdebug") {
    consumed.push_back("inject-error");
    consumed.push_back("set-state");
    opened = co_await OpenBlkdebugNode(driver, node, *std::move(file_child));
  } else {
    co_return absl::InternalError(
        absl::StrCat("driver '", driver.name, "' has no open function"));
  }
  if (!opened.ok()) co_return opened.status();
  opened->probed = probed;

  // 5. Keys nobody took.
  if (std::optional<std::string> unknown =
          FindUnknownKey(driver, node, consumed);
      unknown.has_value()) {
    // Raw passes its child through: closing it is closing the child.
    absl::Status closed = co_await opened->node->Close();
    closed.IgnoreError();  // the option error is the one to report
    co_return UnknownOption(driver, *unknown);
  }
  if (auto name = node.values.find("node-name"); name != node.values.end()) {
    // QEMU's filters: preallocate, copy-on-read, and blkdebug (a protocol
    // over a child here).
    const bool is_filter =
        driver.kind == DriverKind::kFilter ||
        (driver.kind == DriverKind::kProtocol && driver.has_file_child);
    (*ctx.named_nodes)[name->second] = NamedNode{opened->node.get(), is_filter};
  }
  co_return opened;
}

}  // namespace

bool IsDeviceDriver(absl::string_view name) {
  return name == "host_device" || name == "host_cdrom";
}

bool IsPosixFileDriver(absl::string_view name) {
  return name == "file" || IsDeviceDriver(name);
}

bool CdromMediumInserted(const std::string& filename) {
  const int fd = open(filename.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return false;
  const bool inserted =
      ioctl(fd, CDROM_DRIVE_STATUS, CDSL_CURRENT) == CDS_DISC_OK;
  close(fd);
  return inserted;
}

std::string HostDeviceDriverFor(const std::string& filename) {
  const int fd = open(filename.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd >= 0) {
    struct stat st;
    const bool cdrom = fstat(fd, &st) == 0 && S_ISBLK(st.st_mode) &&
                       ioctl(fd, CDROM_DRIVE_STATUS, CDSL_CURRENT) >= 0;
    close(fd);
    if (cdrom) return "host_cdrom";
  }
  if (absl::StartsWith(filename, "/dev/cdrom")) return "host_device";
  struct stat st;
  if (stat(filename.c_str(), &st) == 0 &&
      (S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode))) {
    return "host_device";
  }
  return "";
}


const Driver* FindDriver(absl::string_view name) {
  for (const Driver& d : Drivers()) {
    if (d.name == name) return &d;
  }
  return nullptr;
}

std::vector<std::string> DriverNames() {
  std::vector<std::string> names;
  for (const Driver& d : Drivers()) names.push_back(d.name);
  std::sort(names.begin(), names.end());
  return names;
}

bool IsUnsupportedQemuDriver(absl::string_view name) {
  return std::find(kUnsupportedDrivers.begin(), kUnsupportedDrivers.end(),
                   name) != kUnsupportedDrivers.end();
}

bool QemuDriverCannotCreate(absl::string_view name) {
  return std::find(kNoCreationDrivers.begin(), kNoCreationDrivers.end(),
                   name) != kNoCreationDrivers.end();
}

std::string FormatOfHead(const uint8_t* head, size_t got) {
  if (got > 0 && std::memcmp(head, kQcowMagic, sizeof(kQcowMagic)) == 0) {
    const uint32_t version = (uint32_t{head[4]} << 24) |
                             (uint32_t{head[5]} << 16) |
                             (uint32_t{head[6]} << 8) | head[7];
    if (version == 1) return "qcow";
    if (version >= 2) return "qcow2";
  }
  return "raw";
}

absl::StatusOr<std::string> ProbeFormat(const std::string& filename) {
  const int fd = open(filename.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(filename, "Could not open", errno);
  std::array<uint8_t, 512> head{};
  size_t got = 0;
  while (got < head.size()) {
    const ssize_t n = pread(fd, head.data() + got, head.size() - got, got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int error_number = errno;
      close(fd);
      return ErrnoStatus(filename,
                         "Could not read image for determining its format",
                         error_number);
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  close(fd);
  return FormatOfHead(head.data(), got);
}

absl::Status FillDriverOptions(const Driver& driver, const NodeOptions& node,
                               Message* options) {
  if (driver.options == nullptr) return absl::OkStatus();
  const Reflection* reflection = options->GetReflection();
  for (const std::string& key : driver.keys) {
    const std::string* found = FindKeyValue(node, key);
    if (found == nullptr) continue;
    const std::string& value = *found;
    const FieldDescriptor* field = driver.options->FindFieldByName(
        absl::StrReplaceAll(key, {{"-", "_"}, {".", "_"}}));
    if (field == nullptr) {
      return absl::InternalError(absl::StrCat(
          "driver '", driver.name, "': no field for key '", key, "'"));
    }
    switch (field->cpp_type()) {
      case FieldDescriptor::CPPTYPE_UINT64: {
        ASSIGN_OR_RETURN(uint64_t v, ParseSizeOption(key, value));
        reflection->SetUInt64(options, field, v);
        break;
      }
      case FieldDescriptor::CPPTYPE_UINT32: {
        ASSIGN_OR_RETURN(uint64_t v, ParseSizeOption(key, value));
        if (v > UINT32_MAX) {
          return absl::InvalidArgumentError(absl::StrCat(
              "Value '", value, "' is out of range for parameter '", key,
              "'"));
        }
        reflection->SetUInt32(options, field, static_cast<uint32_t>(v));
        break;
      }
      case FieldDescriptor::CPPTYPE_INT64: {
        // QEMU_OPT_NUMBER: qemu_strtou64 in any base, where "-1" wraps.
        const std::string digits =
            absl::StartsWith(value, "-") ? value.substr(1) : value;
        char* end = nullptr;
        errno = 0;
        const unsigned long long v =
            digits.empty() || digits[0] == '-' || digits[0] == '+'
                ? 0
                : std::strtoull(digits.c_str(), &end, 0);
        if (digits.empty() || digits[0] == '-' || digits[0] == '+' ||
            errno != 0 || end == nullptr || *end != '\0') {
          return absl::InvalidArgumentError(
              absl::StrCat("Parameter '", key, "' expects a number"));
        }
        const uint64_t u = absl::StartsWith(value, "-")
                               ? uint64_t{0} - static_cast<uint64_t>(v)
                               : static_cast<uint64_t>(v);
        reflection->SetInt64(options, field, static_cast<int64_t>(u));
        break;
      }
      case FieldDescriptor::CPPTYPE_BOOL: {
        ASSIGN_OR_RETURN(bool v, ParseBoolOption(key, value));
        reflection->SetBool(options, field, v);
        break;
      }
      case FieldDescriptor::CPPTYPE_STRING:
        reflection->SetString(options, field, value);
        break;
      default:
        return absl::InternalError(absl::StrCat(
            "driver '", driver.name, "': key '", key, "' has no parser"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckNodeOptions(const NodeOptions& node, bool read_only,
                              bool no_backing) {
  auto it = node.values.find("driver");
  const Driver* driver =
      it == node.values.end() ? nullptr : FindDriver(it->second);
  if (driver == nullptr) {
    return absl::InvalidArgumentError("CheckNodeOptions: no known driver");
  }
  ASSIGN_OR_RETURN(GenericOptions generic, ParseGenericOptions(node));
  RETURN_IF_ERROR(CheckAccess(generic, read_only));
  std::vector<std::string> consumed;
  if (driver->has_file_child) consumed.push_back(driver->file_child_key);
  if (driver->name == "blkdebug") {
    consumed.insert(consumed.end(), {"inject-error", "set-state", "x-image"});
  }
  RETURN_IF_ERROR(CheckUnsupportedKeys(*driver, node, no_backing, &consumed));
  if (driver->options != nullptr) {
    std::unique_ptr<Message> scratch(
        google::protobuf::MessageFactory::generated_factory()
            ->GetPrototype(driver->options)
            ->New());
    RETURN_IF_ERROR(FillDriverOptions(*driver, node, scratch.get()));
  }
  if (std::optional<std::string> unknown =
          FindUnknownKey(*driver, node, consumed);
      unknown.has_value()) {
    return UnknownOption(*driver, *unknown);
  }
  return absl::OkStatus();
}

absl::Status ProtocolOptions(const std::string& filename, NodeOptions* node) {
  ASSIGN_OR_RETURN(*node, ProtocolNodeOptions(filename));
  return absl::OkStatus();
}

absl::Status PlaceFilename(const std::string& filename, NodeOptions* node) {
  auto driver_it = node->values.find("driver");
  if (driver_it == node->values.end()) return absl::OkStatus();
  const Driver* driver = FindDriver(driver_it->second);
  if (driver == nullptr) return absl::OkStatus();
  if (driver->kind == DriverKind::kProtocol) {
    if (driver->parse_filename == nullptr) {
      node->values.try_emplace("filename", filename);
      return absl::OkStatus();
    }
    NodeOptions parsed;
    RETURN_IF_ERROR(driver->parse_filename(filename, &parsed));
    AddMissingValues(parsed, node);
    return absl::OkStatus();
  }
  if (!driver->has_file_child ||
      node->values.count(driver->file_child_key) != 0) {
    return absl::OkStatus();  // no child, or a node reference
  }
  NodeOptions& child = node->children[driver->file_child_key];
  if (child.values.count("driver") == 0) {
    if (child.values.count("filename") != 0) return absl::OkStatus();
    NodeOptions protocol;
    RETURN_IF_ERROR(ProtocolOptions(filename, &protocol));
    AddMissingValues(protocol, &child);
    return absl::OkStatus();
  }
  return PlaceFilename(filename, &child);
}

absl::StatusOr<NodeOptions> ImageOptions(const std::string& filename,
                                         const std::string& format,
                                         bool image_opts) {
  if (image_opts) {
    ASSIGN_OR_RETURN(OptionList list, ParseOptionString(filename, "file"));
    return BuildNodeOptions(list);
  }
  NodeOptions options;
  if (absl::StartsWith(filename, "json:")) {
    ASSIGN_OR_RETURN(options, ParseJsonFilename(filename));
    if (!format.empty()) options.values["driver"] = format;
    return options;
  }
  const Driver* driver = format.empty() ? nullptr : FindDriver(format);
  if (driver != nullptr && driver->kind == DriverKind::kProtocol) {
    return ProtocolNodeOptions(filename, driver);
  }
  if (!format.empty()) options.values["driver"] = format;
  if (!format.empty() && driver == nullptr) {
    // The open reports the unknown driver first.
    NodeOptions& file = options.children["file"];
    file.values["driver"] = "file";
    file.values["filename"] = filename;
    return options;
  }
  ASSIGN_OR_RETURN(options.children["file"], ProtocolNodeOptions(filename));
  return options;
}

bool HasProtocolPrefix(absl::string_view filename) {
  const size_t stop = filename.find_first_of(":/");
  return stop != absl::string_view::npos && filename[stop] == ':';
}

absl::StatusOr<NodeOptions> ProtocolNodeOptions(absl::string_view filename,
                                                const Driver* driver) {
  if (driver == nullptr) {
    // Devices first, even with a ':' in their names (QEMU's
    // bdrv_find_protocol).
    const std::string device = HostDeviceDriverFor(std::string(filename));
    if (!device.empty()) driver = FindDriver(device);
  }
  if (driver == nullptr && HasProtocolPrefix(filename)) {
    const absl::string_view prefix = filename.substr(0, filename.find(':'));
    for (const Driver& d : Drivers()) {
      if (!d.protocol.empty() && d.protocol == prefix) driver = &d;
      // QEMU's nbd driver has three protocol names; imgtool's adds the NBD
      // URI spec's TLS ones (nbd_block/nbd_node.h).
      if (d.name == "nbd" && (prefix == "nbd+tcp" || prefix == "nbd+unix" ||
                              prefix == "nbds" || prefix == "nbds+unix")) {
        driver = &d;
      }
    }
    if (driver == nullptr) {
      if (std::find(kUnsupportedProtocols.begin(), kUnsupportedProtocols.end(),
                    prefix) != kUnsupportedProtocols.end()) {
        return absl::UnimplementedError(
            absl::StrCat("Protocol '", prefix, "' is not supported yet"));
      }
      return absl::InvalidArgumentError(
          absl::StrCat("Unknown protocol '", prefix, "'"));
    }
  }
  if (driver == nullptr) driver = FindDriver("file");
  NodeOptions node;
  node.values["driver"] = driver->name;
  if (driver->parse_filename != nullptr) {
    RETURN_IF_ERROR(driver->parse_filename(filename, &node));
  } else {
    node.values["filename"] = std::string(filename);
  }
  return node;
}

absl::StatusOr<std::string> CreatePath(absl::string_view filename) {
  if (!HasProtocolPrefix(filename)) return std::string(filename);
  if (absl::ConsumePrefix(&filename, "file:")) return std::string(filename);
  ASSIGN_OR_RETURN(NodeOptions node, ProtocolNodeOptions(filename));
  return absl::UnimplementedError(
      absl::StrCat("Protocol driver '", node.values["driver"],
                   "' does not support image creation"));
}

io::Task<absl::StatusOr<OpenedGraph>> OpenGraph(NodeOptions options,
                                                OpenSettings settings) {
  Context ctx;
  ctx.read_only = settings.read_only;
  ctx.force_share = settings.force_share;
  ctx.cache = CacheFromMode(settings.cache);
  ctx.share_all = settings.raw_shares_write;
  ctx.settings = std::make_shared<const OpenSettings>(std::move(settings));
  ctx.names = std::make_shared<std::map<const io::BlockNode*, std::string>>();
  ctx.named_nodes = std::make_shared<std::map<std::string, NamedNode>>();
  CO_ASSIGN_OR_RETURN(Opened opened,
                      co_await OpenNode(std::move(options), ctx, Slot::kTop));
  OpenedGraph graph;
  graph.display_name = DisplayName(opened);
  graph.format = opened.driver->name;
  graph.probed = opened.probed;
  graph.file = opened.file;
  graph.qcow2 = opened.qcow2;
  graph.qcow2_below = opened.qcow2_below;
  // Raw passes its child through: that node keeps its own name.
  ctx.names->emplace(opened.node.get(), graph.display_name);
  graph.node_names = *ctx.names;
  graph.node = std::move(opened.node);
  co_return graph;
}

}  // namespace imgtool::block
