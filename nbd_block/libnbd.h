// libnbd (Debian libnbd-dev 1.14), loaded when the first nbd node opens.
//
// Linking libnbd into imgtool made every process load it and what it
// needs (GnuTLS, libxml2 and their dependencies) at start: `imgtool
// --version` went from 8 ms to 22 ms (hyperfine, session 20), a cost paid
// by every short command (snapshot, info, check) that never speaks NBD.
// So libnbd.h gives only the declarations, and the functions the driver
// calls are looked up once with dlopen/dlsym.
//
// Thread-safety: LoadLibNbd may be called from any thread; the first call
// loads (C++ static initialisation), later calls return the same table.
#ifndef IMGTOOL_NBD_BLOCK_LIBNBD_H_
#define IMGTOOL_NBD_BLOCK_LIBNBD_H_

#include <libnbd.h>

#include "absl/status/statusor.h"
#include "block/objects.h"

namespace imgtool::nbd_block {

// The libnbd functions nbd_node.cc and imgtool nbd -L use.
#define IMGTOOL_LIBNBD_FUNCTIONS(X)                                            \
  X(nbd_add_meta_context)                                                      \
  X(nbd_aio_block_status)                                                      \
  X(nbd_aio_flush)                                                             \
  X(nbd_aio_get_direction)                                                     \
  X(nbd_aio_get_fd)                                                            \
  X(nbd_aio_in_flight)                                                         \
  X(nbd_aio_is_closed)                                                         \
  X(nbd_aio_is_dead)                                                           \
  X(nbd_aio_is_processing)                                                     \
  X(nbd_aio_is_ready)                                                          \
  X(nbd_aio_notify_read)                                                       \
  X(nbd_aio_notify_write)                                                      \
  X(nbd_aio_pread)                                                             \
  X(nbd_aio_pwrite)                                                            \
  X(nbd_aio_trim)                                                              \
  X(nbd_aio_zero)                                                              \
  X(nbd_can_cache)                                                             \
  X(nbd_can_df)                                                                \
  X(nbd_can_fast_zero)                                                         \
  X(nbd_can_flush)                                                             \
  X(nbd_can_fua)                                                               \
  X(nbd_can_meta_context)                                                      \
  X(nbd_can_multi_conn)                                                        \
  X(nbd_can_trim)                                                              \
  X(nbd_can_zero)                                                              \
  X(nbd_close)                                                                 \
  X(nbd_connect_socket)                                                        \
  X(nbd_connect_tcp)                                                           \
  X(nbd_connect_unix)                                                          \
  X(nbd_create)                                                                \
  X(nbd_get_block_size)                                                        \
  X(nbd_get_errno)                                                             \
  X(nbd_get_error)                                                             \
  X(nbd_get_size)                                                              \
  X(nbd_is_read_only)                                                          \
  X(nbd_is_rotational)                                                         \
  X(nbd_opt_abort)                                                             \
  X(nbd_opt_info)                                                              \
  X(nbd_opt_list)                                                              \
  X(nbd_opt_list_meta_context)                                                 \
  X(nbd_set_debug)                                                             \
  X(nbd_set_debug_callback)                                                    \
  X(nbd_set_export_name)                                                       \
  X(nbd_set_opt_mode)                                                          \
  X(nbd_set_tls)                                                               \
  X(nbd_set_tls_certificates)                                                  \
  X(nbd_set_tls_psk_file)                                                      \
  X(nbd_set_tls_username)                                                      \
  X(nbd_set_tls_verify_peer)                                                   \
  X(nbd_shutdown)

// One pointer per function, typed as libnbd.h declares it.
struct LibNbd {
#define IMGTOOL_LIBNBD_POINTER(name) decltype(&::name) name = nullptr;
  IMGTOOL_LIBNBD_FUNCTIONS(IMGTOOL_LIBNBD_POINTER)
#undef IMGTOOL_LIBNBD_POINTER
};

// The loaded table (owned by the process, never unloaded), or
// kFailedPrecondition "Could not load libnbd.so.0: <dlerror>" when the
// library or one of its functions is missing (package libnbd0).
absl::StatusOr<const LibNbd *> LoadLibNbd();

// Makes handle `h` require TLS with the client credentials `creds` (a
// tls-creds-x509 or tls-creds-psk object, block/objects.h): x509 from
// creds.dir (libnbd's ca-cert.pem, client-cert.pem, client-key.pem) with
// verify-peer, psk from DIR/keys.psk with the username (default "qemu").
// False when libnbd refused a setting (nbd_get_error says why).
bool SetTlsCreds(const LibNbd &nbd, struct nbd_handle *h,
                 const block::ObjectRegistry::TlsCreds &creds);

} // namespace imgtool::nbd_block

#endif // IMGTOOL_NBD_BLOCK_LIBNBD_H_
