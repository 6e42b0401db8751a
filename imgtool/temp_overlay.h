// A temporary qcow2 overlay over an image, as QEMU 7.2's BDRV_O_SNAPSHOT
// (qemu-io -s, qemu-nbd -s; bdrv_append_temp_snapshot): the image is opened
// read-only below a new qcow2 file of its virtual size, so that writes go to
// the overlay and the image stays unchanged.
#ifndef IMGTOOL_IMGTOOL_TEMP_OVERLAY_H_
#define IMGTOOL_IMGTOOL_TEMP_OVERLAY_H_

#include <ostream>
#include <string>

#include "absl/status/statusor.h"
#include "imgtool/image.h"

namespace imgtool::cli {

struct TemporaryOverlay {
  OpenedImage image;  // the overlay (format qcow2), the image its backing
  std::string path;   // the overlay's file name (already unlinked)
};

// Opens `spec` read-only (its errors as OpenImage's, written to `err` as
// OpenImage writes them), creates the overlay in $TMPDIR or /var/tmp
// ("vl.XXXXXX", QEMU's get_tmp_filename) with the image as its backing file
// (an absolute name; json: names as they are) and opens it with `spec`'s
// cache and aio settings. The overlay file is unlinked once open (QEMU's
// BDRV_O_TEMPORARY): nothing is left behind when the image is closed.
// Errors: kInternal "Could not get temporary filename", create errors.
absl::StatusOr<TemporaryOverlay> OpenTemporaryOverlay(const ImageSpec& spec,
                                                      std::ostream& err);

}  // namespace imgtool::cli

#endif  // IMGTOOL_IMGTOOL_TEMP_OVERLAY_H_
