#include "nbd_block/libnbd.h"

#include <dlfcn.h>

#include <string>

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

bool SetTlsCreds(const LibNbd &nbd, struct nbd_handle *h,
                 const block::ObjectRegistry::TlsCreds &t) {
  if (nbd.nbd_set_tls(h, LIBNBD_TLS_REQUIRE) != 0)
    return false;
  if (t.psk) {
    const std::string file = absl::StrCat(t.dir, "/keys.psk");
    const std::string user = t.username.empty() ? "qemu" : t.username;
    return nbd.nbd_set_tls_psk_file(h, file.c_str()) == 0 &&
           nbd.nbd_set_tls_username(h, user.c_str()) == 0;
  }
  return nbd.nbd_set_tls_certificates(h, t.dir.c_str()) == 0 &&
         nbd.nbd_set_tls_verify_peer(h, t.verify_peer) == 0;
}

} // namespace imgtool::nbd_block
