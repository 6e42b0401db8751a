#include "nbd_block/libnbd.h"

#include <dlfcn.h>

#include "absl/strings/str_cat.h"

namespace imgtool::nbd_block {
namespace {

absl::StatusOr<LibNbd> Load() {
  // The soname of Debian's libnbd0 (libnbd.so is only in libnbd-dev).
  void *lib = dlopen("libnbd.so.0", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("Could not load libnbd.so.0: ", dlerror()));
  }
  LibNbd t;
  const char *missing = nullptr;
#define IMGTOOL_LIBNBD_LOOKUP(name)                                            \
  t.name = reinterpret_cast<decltype(t.name)>(dlsym(lib, #name));              \
  if (t.name == nullptr && missing == nullptr)                                 \
    missing = #name;
  IMGTOOL_LIBNBD_FUNCTIONS(IMGTOOL_LIBNBD_LOOKUP)
#undef IMGTOOL_LIBNBD_LOOKUP
  if (missing != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("Could not load libnbd.so.0: no symbol ", missing));
  }
  return t;
}

} // namespace

absl::StatusOr<const LibNbd *> LoadLibNbd() {
  static const absl::StatusOr<LibNbd> *const loaded =
      new absl::StatusOr<LibNbd>(Load());
  if (!loaded->ok())
    return loaded->status();
  return &**loaded;
}

} // namespace imgtool::nbd_block
