// qemu-img's qcow2 create options, shared by `imgtool create -f qcow2` and
// `imgtool convert -O qcow2`: the option list (QEMU 7.2's qcow2 options
// followed by the file protocol's nocow and extent_size_hint), parsing of
// `-o` texts, `-o help`, the "Formatting ..." line, and writing the image.
#ifndef IMGTOOL_IMGTOOL_QCOW2_CREATE_H_
#define IMGTOOL_IMGTOOL_QCOW2_CREATE_H_

#include <cstdint>
#include <map>
#include <optional>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "imgtool/command.h"
#include "posix_file/file_options.pb.h"

namespace imgtool::cli {

class Qcow2CreateValues {
 public:
  // Applies one `-o` argument ("key=value,..."; ",," is a comma; "help"
  // items are skipped). kInvalidArgument with qemu-img's text for an unknown
  // key ("Invalid parameter 'foo'") or a bad value ("Parameter
  // 'lazy_refcounts' expects 'on' or 'off'", "Parameter 'refcount_bits'
  // expects a number", the size messages of base/size.h).
  absl::Status Apply(const std::string& text);

  // Sets a value without parsing (a string option, or a size/number given
  // as bytes).
  void SetString(const std::string& key, const std::string& value);
  void SetNumber(const std::string& key, uint64_t value);

  bool Has(const std::string& key) const { return values_.count(key) != 0; }
  std::optional<std::string> Text(const std::string& key) const;
  uint64_t Number(const std::string& key) const;  // 0 if unset
  bool Flag(const std::string& key) const;        // false if unset

  // qemu-img's "Formatting '<file>', fmt=qcow2 ..." line without newline:
  // every option that is set or has a default, in QEMU's list order; sizes
  // and numbers as signed 64-bit numbers, strings with commas doubled.
  std::string FormattingLine(const std::string& filename) const;

 private:
  // Each option as given (the last value of a key wins, as in qemu-img).
  std::map<std::string, OptionValue> values_;
};

// `-o help` for qcow2: "  name=<type>  - help" lines sorted by name; with
// `with_protocol` also the file protocol's options (qemu-img lists both
// when a file name is given).
std::string Qcow2OptionHelp(bool with_protocol);

// Creates the image file (emptying an existing one, as qemu-img does) with
// posix_file::CreateFile, printing its warnings to `err`. When the file
// cannot be opened the error is qemu-img's "Could not create '<file>':
// <strerror>" (the name quoted even when it is empty); other errors are
// posix_file's. Used for raw and qcow2 images by create and convert.
absl::Status CreateImageFile(const std::string& filename,
                             const posix_file::FileCreateOptions& options,
                             std::ostream& err);

// Whether `filename` names an NBD export (nbd://, nbd+unix://, nbd:...).
// Creating on one is QEMU's bdrv_co_create_opts_simple for the nbd driver:
// the export must exist and be writable (else "Protocol driver 'nbd' does
// not support image creation, and opening the image failed: <cause>"),
// preallocation other than off is "Unsupported preallocation mode 'M'", a
// raw image larger than the export is "Cannot grow NBD nodes" (the export
// keeps its size), and the export's first sector (up to 512 bytes) is
// zeroed; a qcow2 image is then written into the export (its file size 0:
// any export is large enough to start). CreateImageFile and
// CreateQcow2File take such names (create, convert and dd targets).
bool IsNbdName(const std::string& filename);

// CreateImageFile for the target of create, convert or dd in `format`
// (raw, file, host_device, host_cdrom; not qcow2). host_device and
// host_cdrom are QEMU's bdrv_co_create_opts_simple: nothing is created; the
// existing device is opened with that driver (failing as "<file>: Protocol
// driver 'host_device' does not support image creation, and opening the
// image failed: <why>", with the error's code), a preallocation other than
// off is "<file>: Unsupported preallocation mode 'falloc'" (checked first),
// host_cdrom needs a disc ("<file>: No medium inserted",
// kFailedPrecondition), then the device keeps its length ("Cannot grow
// device files" for a larger size) and its first sector is zeroed.
absl::Status CreateFileForFormat(const std::string& format,
                                 const std::string& filename,
                                 const posix_file::FileCreateOptions& options,
                                 std::ostream& err);

// Creates the image file (emptying an existing one, as qemu-img does), then
// writes a qcow2 image with `values` (size, which must be set, and the
// rest) onto it. The options are checked after the file is created, as
// QEMU does; on any failure the file is deleted, so nothing that looks like
// an image is left. Errors carry qemu-img's message without the file name
// prefix, except those of creating the file ("Could not create '<file>':
// <strerror>"). kUnimplemented for options imgtool cannot create
// (encryption, external data files).
absl::Status CreateQcow2File(const std::string& filename,
                             const Qcow2CreateValues& values,
                             std::ostream& err);

}  // namespace imgtool::cli

#endif  // IMGTOOL_IMGTOOL_QCOW2_CREATE_H_
