// Creating qcow2 images (`imgtool create -f qcow2`), byte for byte what
// `qemu-img create -f qcow2` 7.2 writes with the same options
// (qcow2-format.md §10): header with the feature name table, refcount table
// and block, L1 table, the file ending inside a cluster; the backing file
// name and format extension; version 2 headers with compat=0.10; and for
// preallocation=metadata/falloc/full the L2 tables (and data clusters) QEMU
// preallocates, laid out as QEMU lays them out.
// Thread model: like every node, on the engine's thread.
#ifndef IMGTOOL_QCOW2_CREATE_H_
#define IMGTOOL_QCOW2_CREATE_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "io/block_node.h"
#include "io/task.h"
#include "qcow2/format/layout.h"
#include "qcow2/qcow2_options.pb.h"

namespace imgtool::qcow2 {

// The checked form of the create options: the new-image layout's options
// plus the preallocation mode. kInvalidArgument with qemu-img's message for
// bad values ("Parameter 'version' does not accept value '0.9'",
// "Parameter 'preallocation' does not accept value 'foo'", "Cluster size
// must be a power of two between 512 and 2048k", "Backing file and
// preallocation can only be used at the same time if extended_l2 is on",
// "Extended L2 entries are only supported with cluster sizes of at least
// 16384 bytes", ...).
struct CheckedCreateOptions {
  format::NewImageOptions image;
  io::PreallocMode preallocation = io::PreallocMode::kOff;
};
absl::StatusOr<CheckedCreateOptions> CheckCreateOptions(
    const Qcow2CreateOptions& options);

// Writes a new qcow2 image into `file`, an empty (length 0), writable
// protocol node the caller created and will close. Errors: those of
// CheckCreateOptions (before anything is written) and of the file.
io::Task<absl::Status> CreateQcow2(io::BlockNode& file,
                                   Qcow2CreateOptions options);

}  // namespace imgtool::qcow2

#endif  // IMGTOOL_QCOW2_CREATE_H_
