#include "imgtool/temp_overlay.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "imgtool/qcow2_create.h"

namespace imgtool::cli {
namespace {

// A temporary file name as QEMU's get_tmp_filename picks one: $TMPDIR or
// /var/tmp, "vl.XXXXXX". The file is created empty.
absl::StatusOr<std::string> TemporaryFile() {
  const char* dir = std::getenv("TMPDIR");
  std::string name = absl::StrCat(
      dir != nullptr && *dir != '\0' ? dir : "/var/tmp", "/vl.XXXXXX");
  const int fd = mkstemp(name.data());
  if (fd < 0)
    return ErrnoStatus(name, "Could not get temporary filename", errno);
  close(fd);
  return name;
}

}  // namespace

absl::StatusOr<TemporaryOverlay> OpenTemporaryOverlay(const ImageSpec& spec,
                                                      std::ostream& err) {
  ImageSpec base_spec = spec;
  base_spec.read_only = true;
  base_spec.copy_on_read = false;  // applies to the overlay
  ASSIGN_OR_RETURN(OpenedImage base, OpenImage(base_spec, err));
  const uint64_t size = VirtualSize(base);
  std::string backing = base.display_name;
  const std::string format = base.format == "file" ? "raw" : base.format;
  RETURN_IF_ERROR(CloseImage(base));
  if (IsRelativeFilename(backing)) {
    char* cwd = getcwd(nullptr, 0);
    if (cwd == nullptr) return ErrnoStatus(".", "getcwd", errno);
    backing = absl::StrCat(cwd, "/", backing);
    std::free(cwd);
  }
  TemporaryOverlay overlay;
  ASSIGN_OR_RETURN(overlay.path, TemporaryFile());
  Qcow2CreateValues values;
  values.SetNumber("size", size);
  values.SetString("backing_file", backing);
  if (!absl::StartsWith(backing, "json:")) {
    values.SetString("backing_fmt", format);
  }
  absl::Status created = CreateQcow2File(overlay.path, values, err);
  if (!created.ok()) {
    unlink(overlay.path.c_str());
    return created;
  }
  ImageSpec overlay_spec = spec;
  overlay_spec.filename = overlay.path;
  overlay_spec.format = "qcow2";
  overlay_spec.image_opts = false;
  overlay_spec.force_share = false;
  absl::StatusOr<OpenedImage> opened =
      OpenImage(overlay_spec, err, base.engine);
  unlink(overlay.path.c_str());  // QEMU's BDRV_O_TEMPORARY
  if (!opened.ok()) return opened.status();
  overlay.image = *std::move(opened);
  return overlay;
}

}  // namespace imgtool::cli
