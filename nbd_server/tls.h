// TLS for the NBD server (NBD_OPT_STARTTLS, doc/proto.md "TLS support"):
// GnuTLS (Debian libgnutls30) sessions over the server's non-blocking
// sockets, with QEMU 7.2's credentials (crypto/tlscredsx509.c,
// tlscredspsk.c) and session rules (crypto/tlssession.c).
//
// Credentials (TlsServerCreds::Load, from an --object tls-creds-x509 /
// tls-creds-psk with endpoint=server, block/objects.h):
//   x509: DIR/ca-cert.pem (trust), server-cert.pem + server-key.pem,
//     optional ca-crl.pem and dh-params.pem; with sanity-check (default on)
//     the server certificate and the CA list are parsed first and the
//     certificate verified against the CA, with QEMU's messages ("Unable to
//     import CA certificate list F", "Unable to import server certificate F:
//     E", "Our own certificate F failed validation against CA: R"); QEMU's
//     key-usage / basic-constraints checks are not made. Priority: the
//     object's `priority` or "NORMAL" (QEMU's CONFIG_TLS_PRIORITY); the
//     client's certificate is requested, and with verify-peer (default on)
//     checked after the handshake as qcrypto_tls_session_check_certificate
//     ("Verify failed: No certificate was found.", "The certificate hasn't
//     got a known issuer", expiry / activation times), then, with an authz
//     id (qemu-nbd's --tls-authz), the distinguished name of the client's
//     certificate (gnutls_x509_crt_get_dn, e.g. "O=imgtool test,CN=client")
//     is checked by block::ObjectRegistry::IsAllowedByAuthz, looked up per
//     client as QEMU does: "TLS x509 authz check for DN is denied", "Cannot
//     find QAuthZ object ID x", "Object 'x' is not a QAuthZ subclass"
//     (qcrypto_tls_session_check_certificate). As QEMU, the authz object
//     is not consulted for psk credentials or with verify-peer=off.
//   psk: DIR/keys.psk (psktool's "user:hexkey" lines), priority
//     "<priority or NORMAL>:+ECDHE-PSK:+DHE-PSK:+PSK".
//   Without dh-params.pem QEMU generates 2048-bit DH parameters at start
//   (about 0.4 s); GnuTLS >= 3.6 negotiates RFC 7919 groups itself, so none
//   are generated here (same handshakes, faster start).
//   Errors: kInvalidArgument with QEMU's message ("Cannot load certificate
//   'C' & key 'K': E", "Cannot set PSK server credentials: E", ...);
//   kFailedPrecondition when libgnutls.so.30 cannot be loaded.
//
// GnuTLS is loaded with dlopen on first use (as libnbd in nbd_block), so
// commands that never serve TLS do not pay for loading it.
//
// Sessions never block: the socket stays non-blocking, and each call returns
// kAgain with the direction to wait for (GnuTLS's GNUTLS_E_AGAIN and
// gnutls_record_get_direction); the caller waits for the fd through its
// event loop (the server's epoll set and kPoll) and calls again.
// Ownership: a TlsServerCreds outlives its sessions; a session does not own
// its fd. Thread model: used from one thread (the engine's); a session may
// have one Recv and one Send in progress at once (GnuTLS keeps separate
// buffers for each direction).
#ifndef IMGTOOL_NBD_SERVER_TLS_H_
#define IMGTOOL_NBD_SERVER_TLS_H_

#include <sys/types.h>
#include <sys/uio.h>

#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "block/objects.h"

namespace imgtool::nbd_server {

class TlsSession;

class TlsServerCreds {
 public:
  // Loads the credentials `creds` names (see above). Blocking file reads:
  // call before serving. `authz`: the id of the authz object that must
  // allow each x509 client (nullopt: none).
  static absl::StatusOr<std::unique_ptr<TlsServerCreds>> Load(
      const block::ObjectRegistry::TlsCreds& creds,
      std::optional<std::string> authz = std::nullopt);
  TlsServerCreds(const TlsServerCreds&) = delete;
  TlsServerCreds& operator=(const TlsServerCreds&) = delete;
  ~TlsServerCreds();

  // A server session on `fd` (not owned), before its handshake.
  // kInternal "Cannot initialize TLS session: E" and the like.
  absl::StatusOr<std::unique_ptr<TlsSession>> NewSession(int fd) const;

 private:
  struct Impl;
  explicit TlsServerCreds(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class TlsSession {
 public:
  // What a call that could not finish waits for.
  enum class Wait { kNone, kRead, kWrite };

  TlsSession(const TlsSession&) = delete;
  TlsSession& operator=(const TlsSession&) = delete;
  ~TlsSession();  // gnutls_deinit; sends nothing (no close_notify, as QEMU)

  // One step of the handshake: kNone when it is complete (the peer is then
  // checked: with x509 and verify-peer, QEMU's certificate checks), kRead /
  // kWrite to wait for the fd and call again. Errors: kUnavailable "TLS
  // handshake failed: E", kPermissionDenied for a refused peer certificate
  // (QEMU's message).
  absl::StatusOr<Wait> Handshake();

  // Reads up to `length` bytes of application data: > 0 bytes read, 0 at
  // the end of the stream (or an unclean close), -1 when nothing is there
  // yet (wait for readability, call again), -2 on any other error.
  ssize_t Recv(void* data, size_t length);
  // Why the last Recv returned 0 or -2, as QEMU's TLS channel words it:
  // "Unexpected end-of-file before all data were read" (close_notify),
  // "Cannot read from TLS channel: Software caused connection abort" (the
  // peer closed without it), "Cannot read from TLS channel: Input/output
  // error".
  std::string ReadError() const;

  // Queues the bytes of `iov` (copied) as one corked write, then sends.
  // Returns 1 when everything was sent, 0 when the socket is full (wait for
  // writability, then call Flush until it returns 1), -1 on error.
  int Send(const struct iovec* iov, int iovcnt);
  int Flush();

 private:
  friend class TlsServerCreds;
  struct Impl;
  explicit TlsSession(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace imgtool::nbd_server

#endif  // IMGTOOL_NBD_SERVER_TLS_H_
