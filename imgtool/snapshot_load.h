// `-l SNAPSHOT` of qemu-img convert and measure: a read-only source image
// reads one of its internal snapshots instead of its current state
// (QEMU 7.2's bdrv_snapshot_load_tmp and
// bdrv_snapshot_load_tmp_by_id_or_name; qcow2 only).
#ifndef IMGTOOL_IMGTOOL_SNAPSHOT_LOAD_H_
#define IMGTOOL_IMGTOOL_SNAPSHOT_LOAD_H_

#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "imgtool/image.h"

namespace imgtool::cli {

// Loads the snapshot `arg` names in `image` (opened read-only): either
// "snapshot.id=ID[,snapshot.name=NAME]" (QEMU's internal_snapshot_opts: the
// entry whose id and name match those given), or a plain NAME (an id, else
// a name). Errors, as qemu-img prints them: kInvalidArgument "Failed in
// parsing snapshot param '<arg>'" after writing "<prog>: Invalid parameter
// '<key>'" to `err`; "Failed to load snapshot: Can't find snapshot";
// "Failed to load snapshot: Block format 'raw' used by device '' does not
// support temporarily loading internal snapshots" for formats without
// snapshots; "Failed to load snapshot: Snapshot L1 table ..." for a broken
// snapshot entry.
absl::Status LoadSnapshot(OpenedImage& image, const std::string& arg,
                          std::ostream& err);

// Whether `arg` is the option form (starts with "snapshot."): parse errors
// of that form come before the images are opened, as in qemu-img.
absl::Status CheckSnapshotOption(const std::string& arg, std::ostream& err);

}  // namespace imgtool::cli

#endif  // IMGTOOL_IMGTOOL_SNAPSHOT_LOAD_H_
