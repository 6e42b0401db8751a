#include "imgtool/qcow2_create.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <memory>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "base/errno_status.h"
#include "base/options.h"
#include "base/size.h"
#include "base/status_macros.h"
#include "block/registry.h"
#include "imgtool/command.h"
#include "imgtool/image.h"
#include "io/engine.h"
#include "io/task.h"
#include "posix_file/file_node.h"
#include "posix_file/file_options.pb.h"
#include "qcow2/create.h"
#include "qcow2/qcow2_options.pb.h"

namespace imgtool::cli {
namespace {

struct OptionDesc {
  const char* name;
  OptionType type;
  const char* help;
  const char* default_value;  // printed on the "Formatting" line, or null
};

// qemu-img 7.2's create options of qcow2 followed by those of the `file`
// protocol it does not have, in QEMU's list order.
constexpr OptionDesc kOptions[] = {
    {"encryption", OptionType::kBool,
     "Encrypt the image with format 'aes'. (Deprecated in favor of "
     "encrypt.format=aes)",
     nullptr},
    {"encrypt.format", OptionType::kString,
     "Encrypt the image, format choices: 'aes', 'luks'", nullptr},
    {"encrypt.key-secret", OptionType::kString,
     "ID of secret providing qcow AES key or LUKS passphrase", nullptr},
    {"encrypt.cipher-alg", OptionType::kString,
     "Name of encryption cipher algorithm", nullptr},
    {"encrypt.cipher-mode", OptionType::kString,
     "Name of encryption cipher mode", nullptr},
    {"encrypt.ivgen-alg", OptionType::kString, "Name of IV generator algorithm",
     nullptr},
    {"encrypt.ivgen-hash-alg", OptionType::kString,
     "Name of IV generator hash algorithm", nullptr},
    {"encrypt.hash-alg", OptionType::kString,
     "Name of encryption hash algorithm", nullptr},
    {"encrypt.iter-time", OptionType::kNumber,
     "Time to spend in PBKDF in milliseconds", nullptr},
    {"cluster_size", OptionType::kSize, "qcow2 cluster size", "65536"},
    {"extended_l2", OptionType::kBool, "Extended L2 tables", "off"},
    {"preallocation", OptionType::kString,
     "Preallocation mode (allowed values: off, metadata, falloc, full)",
     nullptr},
    {"compression_type", OptionType::kString,
     "Compression method used for image cluster compression", "zlib"},
    {"size", OptionType::kSize, "Virtual disk size", nullptr},
    {"compat", OptionType::kString,
     "Compatibility level (v2 [0.10] or v3 [1.1])", nullptr},
    {"backing_file", OptionType::kString, "File name of a base image", nullptr},
    {"backing_fmt", OptionType::kString, "Image format of the base image",
     nullptr},
    {"data_file", OptionType::kString, "File name of an external data file",
     nullptr},
    {"data_file_raw", OptionType::kBool,
     "The external data file must stay valid as a raw image", nullptr},
    {"lazy_refcounts", OptionType::kBool, "Postpone refcount updates", "off"},
    {"refcount_bits", OptionType::kNumber,
     "Width of a reference count entry in bits", "16"},
    // The file protocol's own.
    {"nocow", OptionType::kBool, "Turn off copy-on-write (valid only on btrfs)",
     nullptr},
    {"extent_size_hint", OptionType::kSize,
     "Extent size hint for the image file, 0 to disable", nullptr},
};
constexpr size_t kNumQcow2Only = 21;  // the entries before nocow

const OptionDesc* FindOption(const std::string& name) {
  for (const OptionDesc& d : kOptions) {
    if (name == d.name) return &d;
  }
  return nullptr;
}

// Writes the qcow2 image onto the empty file `filename`.
absl::Status WriteImage(const std::string& filename,
                        const qcow2::Qcow2CreateOptions& options,
                        std::ostream& err) {
  ASSIGN_OR_RETURN(std::unique_ptr<io::Engine> engine,
                   io::CreateEngine(io::EngineKind::kAuto, 16, &err));
  posix_file::FileOpenOptions open;
  open.set_filename(filename);
  open.set_read_only(false);
  std::ostringstream warnings;
  absl::StatusOr<std::unique_ptr<posix_file::FileNode>> file =
      posix_file::FileNode::Open(*engine, open, &warnings);
  PrintWarnings(warnings.str(), err);
  if (!file.ok()) return file.status();
  absl::Status st = io::RunSync(*engine, qcow2::CreateQcow2(**file, options));
  absl::Status closed = io::RunSync(*engine, (*file)->Close());
  RETURN_IF_ERROR(st);
  return closed;
}

}  // namespace

absl::Status Qcow2CreateValues::Apply(const std::string& text) {
  for (const std::string& item : SplitOptionItems(text)) {
    ASSIGN_OR_RETURN(OptionList list, ParseOptionString(item));
    for (const auto& [key, value] : list) {
      if (key == "help") continue;
      const OptionDesc* d = FindOption(key);
      if (d == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("Invalid parameter '", key, "'"));
      }
      ASSIGN_OR_RETURN(values_[key], ParseTypedOption(key, value, d->type));
    }
  }
  return absl::OkStatus();
}

void Qcow2CreateValues::SetString(const std::string& key,
                                  const std::string& value) {
  values_[key] = OptionValue{value, 0, false};
}

void Qcow2CreateValues::SetNumber(const std::string& key, uint64_t value) {
  values_[key] = OptionValue{absl::StrCat(value), value, false};
}

std::optional<std::string> Qcow2CreateValues::Text(
    const std::string& key) const {
  auto it = values_.find(key);
  if (it == values_.end()) return std::nullopt;
  return it->second.text;
}

uint64_t Qcow2CreateValues::Number(const std::string& key) const {
  auto it = values_.find(key);
  return it == values_.end() ? 0 : it->second.number;
}

bool Qcow2CreateValues::Flag(const std::string& key) const {
  auto it = values_.find(key);
  return it != values_.end() && it->second.flag;
}

std::string Qcow2CreateValues::FormattingLine(
    const std::string& filename) const {
  std::string line = absl::StrCat("Formatting '", filename, "', fmt=qcow2");
  for (const OptionDesc& d : kOptions) {
    auto it = values_.find(d.name);
    if (it == values_.end()) {
      if (d.default_value != nullptr) {
        absl::StrAppend(&line, " ", d.name, "=", d.default_value);
      }
      continue;
    }
    switch (d.type) {
      case OptionType::kSize:
      case OptionType::kNumber:
        absl::StrAppend(&line, " ", d.name, "=",
                        static_cast<int64_t>(it->second.number));
        break;
      case OptionType::kBool:
        absl::StrAppend(&line, " ", d.name, "=", it->second.text);
        break;
      case OptionType::kString:
        absl::StrAppend(&line, " ", d.name, "=",
                        absl::StrReplaceAll(it->second.text, {{",", ",,"}}));
        break;
    }
  }
  return line;
}

std::string Qcow2OptionHelp(bool with_protocol) {
  std::vector<const OptionDesc*> list;
  const size_t n = with_protocol ? std::size(kOptions) : kNumQcow2Only;
  for (size_t i = 0; i < n; ++i) list.push_back(&kOptions[i]);
  std::sort(list.begin(), list.end(),
            [](const OptionDesc* a, const OptionDesc* b) {
              return std::strcmp(a->name, b->name) < 0;
            });
  std::string text;
  for (const OptionDesc* d : list) text += OptionHelpLine(d->name, d->type, d->help);
  return text;
}

namespace {

// CreateImageFile at the path itself (no protocol prefix left).
absl::Status CreateImageFileAt(const std::string& filename,
                               const posix_file::FileCreateOptions& options,
                               std::ostream& err) {
  std::ostringstream warnings;
  absl::Status st = posix_file::CreateFile(filename, options, &warnings);
  PrintWarnings(warnings.str(), err);
  // posix_file: "<file>: Could not create: <strerror>" ("Could not create:
  // <strerror>" for an empty name); qemu-img quotes the name once more.
  const int error_number = StatusErrno(st);
  if (error_number == 0 ||
      st.message() !=
          ErrnoStatus(filename, "Could not create", error_number).message()) {
    return st;
  }
  return absl::Status(st.code(),
                      absl::StrCat("Could not create '", filename,
                                   "': ", std::strerror(error_number)));
}

// Creation on a protocol without its own (QEMU's
// bdrv_co_create_opts_simple): only preallocation "off" (or none), then
// `filename` opened read-write as `format` ("Protocol driver 'DRIVER' does
// not support image creation, and opening the image failed: ..." when it
// cannot be).
absl::StatusOr<OpenedImage> OpenForSimpleCreate(const std::string& driver,
                                                const std::string& filename,
                                                const std::string& format,
                                                const std::string& prealloc,
                                                std::ostream& err) {
  if (!prealloc.empty() && prealloc != "off") {
    if (prealloc != "falloc" && prealloc != "full" && prealloc != "metadata") {
      return absl::InvalidArgumentError(
          absl::StrCat("invalid parameter value: ", prealloc));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("Unsupported preallocation mode '", prealloc, "'"));
  }
  ImageSpec spec;
  spec.filename = filename;
  spec.format = format;
  spec.read_only = false;
  absl::StatusOr<OpenedImage> image = OpenImage(spec, err);
  if (!image.ok()) {
    absl::string_view cause = image.status().message();
    absl::ConsumePrefix(&cause,
                        absl::StrCat("Could not open '", filename, "': "));
    return absl::Status(image.status().code(),
                        absl::StrCat("Protocol driver '", driver,
                                     "' does not support image creation, and "
                                     "opening the image failed: ",
                                     cause));
  }
  return image;
}

// Creates on the NBD export `filename` (IsNbdName): the export is opened
// read-write as raw, `size` checked against it, its first sector zeroed,
// then, with `qcow2`, that image written into it.
absl::Status CreateOnNbd(const std::string& filename, uint64_t size,
                         const std::string& prealloc,
                         const qcow2::Qcow2CreateOptions* qcow2_options,
                         std::ostream& err) {
  absl::StatusOr<OpenedImage> image =
      OpenForSimpleCreate("nbd", filename, "raw", prealloc, err);
  RETURN_IF_ERROR(image.status());
  io::BlockNode& node = *image->node;
  absl::Status st;
  if (size > node.size()) {
    // nbd_co_truncate (not exact): an export cannot grow.
    st = absl::InvalidArgumentError("Cannot grow NBD nodes");
  }
  if (st.ok() && node.size() > 0) {
    st = io::RunSync(*image->engine,
                     node.WriteZeroes(0, std::min<uint64_t>(node.size(), 512),
                                      io::WriteZeroesFlags{.may_unmap = true}));
    if (!st.ok()) {
      const int e = StatusErrno(st);
      st = WithMessage(
          st, absl::StrCat("Failed to clear the new image's first sector: ",
                           e != 0 ? std::strerror(e) : st.message()));
    }
  }
  if (st.ok() && qcow2_options != nullptr) {
    st = io::RunSync(*image->engine, qcow2::CreateQcow2(node, *qcow2_options));
  }
  absl::Status closed = CloseImage(*image);
  RETURN_IF_ERROR(st);
  return closed;
}

}  // namespace

bool IsNbdName(const std::string& filename) {
  if (!block::HasProtocolPrefix(filename)) return false;
  absl::StatusOr<NodeOptions> node =
      block::ProtocolNodeOptions(filename);
  return node.ok() && node->values["driver"] == "nbd";
}

absl::Status CreateImageFile(const std::string& filename,
                             const posix_file::FileCreateOptions& options,
                             std::ostream& err) {
  if (IsNbdName(filename)) {
    return CreateOnNbd(filename, options.size(), options.preallocation(),
                       nullptr, err);
  }
  ASSIGN_OR_RETURN(std::string path, block::CreatePath(filename));
  return CreateImageFileAt(path, options, err);
}

absl::Status CreateFileForFormat(const std::string& format,
                                 const std::string& filename,
                                 const posix_file::FileCreateOptions& options,
                                 std::ostream& err) {
  if (!block::IsDeviceDriver(format)) {
    return CreateImageFile(filename, options, err);
  }
  absl::StatusOr<OpenedImage> image = OpenForSimpleCreate(
      format, filename, format, options.preallocation(), err);
  if (!image.ok()) {
    return absl::Status(image.status().code(),
                        absl::StrCat(filename, ": ", image.status().message()));
  }
  RETURN_IF_ERROR(CloseImage(*image));
  if (format == "host_cdrom" && !block::CdromMediumInserted(filename)) {
    return absl::FailedPreconditionError(
        absl::StrCat(filename, ": No medium inserted"));
  }
  posix_file::FileCreateOptions device_options;
  device_options.set_size(options.size());
  return CreateImageFile(filename, device_options, err);
}

absl::Status CreateQcow2File(const std::string& name,
                             const Qcow2CreateValues& values,
                             std::ostream& err) {
  // "file:x.qcow2" is the file x.qcow2 (QEMU's bdrv_create_file).
  const bool nbd = IsNbdName(name);
  std::string filename = name;
  if (!nbd) {
    ASSIGN_OR_RETURN(filename, block::CreatePath(name));
  }
  // The file protocol's options, checked before the file is touched.
  posix_file::FileCreateOptions file_options;
  file_options.set_size(0);
  if (values.Has("extent_size_hint")) {
    if (values.Number("extent_size_hint") > UINT32_MAX) {
      return absl::InvalidArgumentError("Extent size hint is too large");
    }
    file_options.set_extent_size_hint(values.Number("extent_size_hint"));
  }
  file_options.set_nocow(values.Flag("nocow"));

  // What imgtool's qcow2 driver cannot create (refused before the file is
  // touched).
  for (const char* key :
       {"encryption", "encrypt.format", "encrypt.key-secret",
        "encrypt.cipher-alg", "encrypt.cipher-mode", "encrypt.ivgen-alg",
        "encrypt.ivgen-hash-alg", "encrypt.hash-alg", "encrypt.iter-time",
        "data_file"}) {
    if (values.Has(key)) {
      return absl::UnimplementedError(
          absl::StrCat("The qcow2 option '", key, "' is not supported yet"));
    }
  }

  qcow2::Qcow2CreateOptions options;
  options.set_size(values.Number("size"));
  if (values.Has("cluster_size")) {
    options.set_cluster_size(values.Number("cluster_size"));
  }
  options.set_compat(values.Text("compat").value_or(""));
  options.set_preallocation(values.Text("preallocation").value_or(""));
  options.set_backing_file(values.Text("backing_file").value_or(""));
  options.set_backing_fmt(values.Text("backing_fmt").value_or(""));
  options.set_lazy_refcounts(values.Flag("lazy_refcounts"));
  options.set_extended_l2(values.Flag("extended_l2"));
  // Errors QEMU finds only after it created the file.
  std::optional<absl::Status> late_error;
  const std::optional<std::string> compression =
      values.Text("compression_type");
  if (compression.has_value()) {
    if (*compression == "zlib" || *compression == "zstd") {
      options.set_compression_type(*compression);
    } else {
      late_error = absl::InvalidArgumentError(absl::StrCat(
          "Parameter 'compression-type' does not accept value '", *compression,
          "'"));
    }
  }
  if (values.Flag("data_file_raw")) {
    late_error = absl::InvalidArgumentError("data-file-raw requires data-file");
  }
  if (values.Has("refcount_bits")) {
    if (values.Number("refcount_bits") > 64) {
      late_error = absl::InvalidArgumentError(
          "Refcount width must be a power of two and may not exceed 64 bits");
    } else {
      options.set_refcount_bits(
          static_cast<uint32_t>(values.Number("refcount_bits")));
    }
  }

  // backing-fmt is a QAPI BlockdevDriver, visited before the options
  // above: a name qemu-img 7.2 (Debian's build) has no driver for fails
  // first, whether or not the backing file is opened (-u).
  static constexpr const char* kBlockdevDrivers[] = {
      "blkdebug", "blklogwrites", "blkreplay", "blkverify", "bochs", "cloop",
      "compress", "copy-before-write", "copy-on-read", "dmg", "file",
      "snapshot-access", "ftp", "ftps", "gluster", "host_cdrom",
      "host_device", "http", "https", "iscsi", "luks", "nbd", "nfs",
      "null-aio", "null-co", "nvme", "parallels", "preallocate", "qcow",
      "qcow2", "qed", "quorum", "raw", "rbd", "replication", "ssh",
      "throttle", "vdi", "vhdx", "vmdk", "vpc", "vvfat"};
  if (const std::string& fmt = options.backing_fmt();
      !fmt.empty() &&
      std::none_of(std::begin(kBlockdevDrivers), std::end(kBlockdevDrivers),
                   [&](const char* d) { return fmt == d; })) {
    late_error = absl::InvalidArgumentError(absl::StrCat(
        "Parameter 'backing-fmt' does not accept value '", fmt, "'"));
  }

  if (nbd) {
    // The export is the file: opened, its first sector zeroed (the qcow2
    // driver passes its file size 0 and no preallocation), then written.
    if (!late_error.has_value()) {
      absl::StatusOr<qcow2::CheckedCreateOptions> checked =
          qcow2::CheckCreateOptions(options);
      if (!checked.ok()) late_error = checked.status();
    }
    RETURN_IF_ERROR(CreateOnNbd(
        name, 0, "", late_error.has_value() ? nullptr : &options, err));
    if (late_error.has_value()) return *late_error;
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(CreateImageFileAt(filename, file_options, err));
  if (!late_error.has_value()) {
    absl::StatusOr<qcow2::CheckedCreateOptions> checked =
        qcow2::CheckCreateOptions(options);
    if (!checked.ok()) late_error = checked.status();
  }
  if (!late_error.has_value()) {
    absl::Status written = WriteImage(filename, options, err);
    if (!written.ok()) late_error = written;
  }
  if (late_error.has_value()) {
    unlink(filename.c_str());
    return *late_error;
  }
  return absl::OkStatus();
}

}  // namespace imgtool::cli
