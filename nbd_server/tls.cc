#include "nbd_server/tls.h"

#include <dlfcn.h>
#include <unistd.h>
#include <gnutls/gnutls.h>
#include <gnutls/x509.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace imgtool::nbd_server {
namespace {

// The GnuTLS functions used here, looked up in libgnutls.so.30.
#define IMGTOOL_GNUTLS_FUNCTIONS(X)        \
  X(gnutls_certificate_allocate_credentials) \
  X(gnutls_certificate_free_credentials)   \
  X(gnutls_certificate_get_peers)          \
  X(gnutls_certificate_server_set_request) \
  X(gnutls_certificate_set_dh_params)      \
  X(gnutls_certificate_set_x509_crl_file)  \
  X(gnutls_certificate_set_x509_key_file2) \
  X(gnutls_certificate_set_x509_trust_file) \
  X(gnutls_certificate_verify_peers2)      \
  X(gnutls_credentials_set)                \
  X(gnutls_deinit)                         \
  X(gnutls_dh_params_deinit)               \
  X(gnutls_dh_params_import_pkcs3)         \
  X(gnutls_dh_params_init)                 \
  X(gnutls_handshake)                      \
  X(gnutls_init)                           \
  X(gnutls_priority_set_direct)            \
  X(gnutls_psk_allocate_server_credentials) \
  X(gnutls_psk_free_server_credentials)    \
  X(gnutls_psk_set_server_credentials_file) \
  X(gnutls_psk_set_server_dh_params)       \
  X(gnutls_record_cork)                    \
  X(gnutls_record_get_direction)           \
  X(gnutls_record_recv)                    \
  X(gnutls_record_send)                    \
  X(gnutls_record_uncork)                  \
  X(gnutls_strerror)                       \
  X(gnutls_transport_set_int2)             \
  X(gnutls_x509_crt_deinit)                \
  X(gnutls_x509_crt_get_activation_time)   \
  X(gnutls_x509_crt_get_dn)                \
  X(gnutls_x509_crt_get_expiration_time)   \
  X(gnutls_x509_crt_import)                \
  X(gnutls_x509_crt_init)                  \
  X(gnutls_x509_crt_list_import)           \
  X(gnutls_x509_crt_list_verify)

struct GnuTls {
#define IMGTOOL_GNUTLS_POINTER(name) decltype(&::name) name = nullptr;
  IMGTOOL_GNUTLS_FUNCTIONS(IMGTOOL_GNUTLS_POINTER)
#undef IMGTOOL_GNUTLS_POINTER
};

absl::StatusOr<GnuTls> Load() {
  void* lib = dlopen("libgnutls.so.30", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("Could not load libgnutls.so.30: ", dlerror()));
  }
  GnuTls t;
  const char* missing = nullptr;
#define IMGTOOL_GNUTLS_LOOKUP(name)                                \
  t.name = reinterpret_cast<decltype(t.name)>(dlsym(lib, #name)); \
  if (t.name == nullptr && missing == nullptr) missing = #name;
  IMGTOOL_GNUTLS_FUNCTIONS(IMGTOOL_GNUTLS_LOOKUP)
#undef IMGTOOL_GNUTLS_LOOKUP
  if (missing != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("Could not load libgnutls.so.30: no symbol ", missing));
  }
  return t;
}

absl::StatusOr<const GnuTls*> LoadGnuTls() {
  static const absl::StatusOr<GnuTls>* const loaded =
      new absl::StatusOr<GnuTls>(Load());
  if (!loaded->ok()) return loaded->status();
  return &**loaded;
}

// QEMU's reason for a verification status (crypto/tlssession.c).
const char* VerifyReason(unsigned int status) {
  const char* reason = "Invalid certificate";
  if (status & GNUTLS_CERT_INVALID) reason = "The certificate is not trusted";
  if (status & GNUTLS_CERT_SIGNER_NOT_FOUND) {
    reason = "The certificate hasn't got a known issuer";
  }
  if (status & GNUTLS_CERT_REVOKED) reason = "The certificate has been revoked";
  if (status & GNUTLS_CERT_INSECURE_ALGORITHM) {
    reason = "The certificate uses an insecure algorithm";
  }
  return reason;
}

bool ReadFile(const std::string& path, std::string* out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  std::ostringstream s;
  s << f.rdbuf();
  *out = s.str();
  return true;
}

// qcrypto_tls_creds_x509_sanity_check, without check_cert's key usage,
// basic constraints and purpose checks.
absl::Status SanityCheck(const GnuTls& g, const std::string& cacert,
                         const std::string& cert) {
  auto invalid = [](std::string m) {
    return absl::InvalidArgumentError(std::move(m));
  };
  gnutls_x509_crt_t crt = nullptr;
  std::string text;
  if (ReadFile(cert, &text)) {
    if (int e = g.gnutls_x509_crt_init(&crt); e < 0) {
      return invalid(absl::StrCat("Unable to initialize certificate: ",
                                  g.gnutls_strerror(e)));
    }
    gnutls_datum_t d = {reinterpret_cast<unsigned char*>(text.data()),
                        static_cast<unsigned int>(strlen(text.c_str()))};
    if (int e = g.gnutls_x509_crt_import(crt, &d, GNUTLS_X509_FMT_PEM);
        e < 0) {
      g.gnutls_x509_crt_deinit(crt);
      return invalid(absl::StrCat("Unable to import server certificate ",
                                  cert, ": ", g.gnutls_strerror(e)));
    }
  }
  constexpr unsigned kMaxCerts = 16;
  gnutls_x509_crt_t cas[kMaxCerts] = {};
  unsigned int ncas = 0;
  absl::Status st;
  if (ReadFile(cacert, &text)) {
    gnutls_datum_t d = {reinterpret_cast<unsigned char*>(text.data()),
                        static_cast<unsigned int>(strlen(text.c_str()))};
    ncas = kMaxCerts;
    if (g.gnutls_x509_crt_list_import(cas, &ncas, &d, GNUTLS_X509_FMT_PEM,
                                      0) < 0) {
      ncas = 0;
      st = invalid(
          absl::StrCat("Unable to import CA certificate list ", cacert));
    }
  }
  if (st.ok() && crt != nullptr && ncas > 0) {
    unsigned int status = 0;
    if (g.gnutls_x509_crt_list_verify(&crt, 1, cas, ncas, nullptr, 0, 0,
                                      &status) < 0) {
      st = invalid(absl::StrCat("Unable to verify server certificate ", cert,
                                " against CA certificate ", cacert));
    } else if (status != 0) {
      st = invalid(absl::StrCat("Our own certificate ", cert,
                                " failed validation against ", cacert, ": ",
                                VerifyReason(status)));
    }
  }
  for (unsigned i = 0; i < ncas; ++i) g.gnutls_x509_crt_deinit(cas[i]);
  if (crt != nullptr) g.gnutls_x509_crt_deinit(crt);
  return st;
}

}  // namespace

struct TlsServerCreds::Impl {
  const GnuTls* g = nullptr;
  bool psk = false;
  bool verify_peer = true;
  std::optional<std::string> authz;
  std::string priority;
  gnutls_certificate_credentials_t x509 = nullptr;
  gnutls_psk_server_credentials_t psk_creds = nullptr;
  gnutls_dh_params_t dh = nullptr;

  ~Impl() {
    if (x509 != nullptr) g->gnutls_certificate_free_credentials(x509);
    if (psk_creds != nullptr) g->gnutls_psk_free_server_credentials(psk_creds);
    if (dh != nullptr) g->gnutls_dh_params_deinit(dh);
  }
};

struct TlsSession::Impl {
  const GnuTls* g = nullptr;
  gnutls_session_t session = nullptr;
  bool verify_peer = false;  // x509 with verify-peer
  std::optional<std::string> authz;  // its --tls-authz id
  bool corked = false;
  ssize_t last_recv = 0;  // GnuTLS's result of the last failed recv

  ~Impl() {
    if (session != nullptr) g->gnutls_deinit(session);
  }
};

TlsServerCreds::TlsServerCreds(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)) {}
TlsServerCreds::~TlsServerCreds() = default;

absl::StatusOr<std::unique_ptr<TlsServerCreds>> TlsServerCreds::Load(
    const block::ObjectRegistry::TlsCreds& c,
    std::optional<std::string> authz) {
  absl::StatusOr<const GnuTls*> loaded = LoadGnuTls();
  if (!loaded.ok()) return loaded.status();
  const GnuTls& g = **loaded;
  auto impl = std::make_unique<Impl>();
  impl->g = &g;
  impl->psk = c.psk;
  impl->verify_peer = c.verify_peer;
  impl->authz = std::move(authz);
  const std::string base = c.priority.empty() ? "NORMAL" : c.priority;
  impl->priority = c.psk ? base + ":+ECDHE-PSK:+DHE-PSK:+PSK" : base;
  auto invalid = [&](absl::string_view what, int e) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, g.gnutls_strerror(e)));
  };
  auto optional = [&](const char* name) {
    const std::string p = absl::StrCat(c.dir, "/", name);
    return access(p.c_str(), F_OK) == 0 ? p : std::string();
  };
  const std::string dhparams = optional("dh-params.pem");
  if (!dhparams.empty()) {
    std::string text;
    if (!ReadFile(dhparams, &text)) {
      return absl::InvalidArgumentError(
          absl::StrCat("Failed to open file “", dhparams,
                       "”: ", std::strerror(errno)));
    }
    if (int e = g.gnutls_dh_params_init(&impl->dh); e < 0) {
      return invalid("Unable to initialize DH parameters: ", e);
    }
    gnutls_datum_t d = {reinterpret_cast<unsigned char*>(text.data()),
                        static_cast<unsigned int>(text.size())};
    if (int e = g.gnutls_dh_params_import_pkcs3(impl->dh, &d,
                                                GNUTLS_X509_FMT_PEM);
        e < 0) {
      return invalid(absl::StrCat("Unable to load DH parameters from ",
                                  dhparams, ": "),
                     e);
    }
  }
  if (c.psk) {
    const std::string file = absl::StrCat(c.dir, "/keys.psk");
    if (int e = g.gnutls_psk_allocate_server_credentials(&impl->psk_creds);
        e < 0) {
      return invalid("Cannot allocate credentials: ", e);
    }
    if (int e = g.gnutls_psk_set_server_credentials_file(impl->psk_creds,
                                                         file.c_str());
        e < 0) {
      return invalid("Cannot set PSK server credentials: ", e);
    }
    if (impl->dh != nullptr) {
      g.gnutls_psk_set_server_dh_params(impl->psk_creds, impl->dh);
    }
  } else {
    const std::string cacert = absl::StrCat(c.dir, "/ca-cert.pem");
    const std::string cacrl = optional("ca-crl.pem");
    const std::string cert = absl::StrCat(c.dir, "/server-cert.pem");
    const std::string key = absl::StrCat(c.dir, "/server-key.pem");
    if (c.sanity_check) {
      if (absl::Status st = SanityCheck(g, cacert, cert); !st.ok()) return st;
    }
    if (int e = g.gnutls_certificate_allocate_credentials(&impl->x509);
        e < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Cannot allocate credentials: '", g.gnutls_strerror(e), "'"));
    }
    if (int e = g.gnutls_certificate_set_x509_trust_file(
            impl->x509, cacert.c_str(), GNUTLS_X509_FMT_PEM);
        e < 0) {
      return invalid(
          absl::StrCat("Cannot load CA certificate '", cacert, "': "), e);
    }
    if (int e = g.gnutls_certificate_set_x509_key_file2(
            impl->x509, cert.c_str(), key.c_str(), GNUTLS_X509_FMT_PEM,
            nullptr, 0);
        e < 0) {
      return invalid(absl::StrCat("Cannot load certificate '", cert,
                                  "' & key '", key, "': "),
                     e);
    }
    if (!cacrl.empty()) {
      if (int e = g.gnutls_certificate_set_x509_crl_file(
              impl->x509, cacrl.c_str(), GNUTLS_X509_FMT_PEM);
          e < 0) {
        return invalid(absl::StrCat("Cannot load CRL '", cacrl, "': "), e);
      }
    }
    if (impl->dh != nullptr) {
      g.gnutls_certificate_set_dh_params(impl->x509, impl->dh);
    }
  }
  return std::unique_ptr<TlsServerCreds>(new TlsServerCreds(std::move(impl)));
}

absl::StatusOr<std::unique_ptr<TlsSession>> TlsServerCreds::NewSession(
    int fd) const {
  const GnuTls& g = *impl_->g;
  auto s = std::make_unique<TlsSession::Impl>();
  s->g = &g;
  // GNUTLS_NO_SIGNAL: its sends use MSG_NOSIGNAL (a peer gone is an error,
  // not SIGPIPE).
  if (int e = g.gnutls_init(&s->session, GNUTLS_SERVER | GNUTLS_NO_SIGNAL);
      e < 0) {
    s->session = nullptr;
    return absl::InternalError(absl::StrCat(
        "Cannot initialize TLS session: ", g.gnutls_strerror(e)));
  }
  if (int e = g.gnutls_priority_set_direct(
          s->session, impl_->priority.c_str(), nullptr);
      e < 0) {
    return absl::InternalError(absl::StrCat(
        impl_->psk ? "Unable to set TLS session priority "
                   : "Cannot set default TLS session priority ",
        impl_->priority, ": ", g.gnutls_strerror(e)));
  }
  int e = impl_->psk
              ? g.gnutls_credentials_set(s->session, GNUTLS_CRD_PSK,
                                         impl_->psk_creds)
              : g.gnutls_credentials_set(s->session, GNUTLS_CRD_CERTIFICATE,
                                         impl_->x509);
  if (e < 0) {
    return absl::InternalError(absl::StrCat(
        "Cannot set session credentials: ", g.gnutls_strerror(e)));
  }
  if (!impl_->psk) {
    // Requested, not required: the check after the handshake enforces it.
    g.gnutls_certificate_server_set_request(s->session, GNUTLS_CERT_REQUEST);
    s->verify_peer = impl_->verify_peer;
    s->authz = impl_->authz;
  }
  g.gnutls_transport_set_int2(s->session, fd, fd);
  return std::unique_ptr<TlsSession>(new TlsSession(std::move(s)));
}

TlsSession::TlsSession(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TlsSession::~TlsSession() = default;

absl::StatusOr<TlsSession::Wait> TlsSession::Handshake() {
  const GnuTls& g = *impl_->g;
  const int r = g.gnutls_handshake(impl_->session);
  if (r == GNUTLS_E_AGAIN || r == GNUTLS_E_INTERRUPTED) {
    return g.gnutls_record_get_direction(impl_->session) != 0 ? Wait::kWrite
                                                              : Wait::kRead;
  }
  if (r < 0) {
    return absl::UnavailableError(
        absl::StrCat("TLS handshake failed: ", g.gnutls_strerror(r)));
  }
  if (!impl_->verify_peer) return Wait::kNone;
  // qcrypto_tls_session_check_certificate on the server's side (no
  // hostname).
  auto refused = [](std::string m) {
    return absl::PermissionDeniedError(std::move(m));
  };
  unsigned int status = 0;
  if (int e = g.gnutls_certificate_verify_peers2(impl_->session, &status);
      e < 0) {
    return refused(absl::StrCat("Verify failed: ", g.gnutls_strerror(e)));
  }
  if (status != 0) return refused(VerifyReason(status));
  unsigned int n = 0;
  const gnutls_datum_t* certs =
      g.gnutls_certificate_get_peers(impl_->session, &n);
  if (certs == nullptr) return refused("No certificate peers");
  const time_t now = time(nullptr);
  for (unsigned int i = 0; i < n; ++i) {
    gnutls_x509_crt_t crt;
    if (int e = g.gnutls_x509_crt_init(&crt); e < 0) {
      return refused(absl::StrCat("Cannot initialize certificate: ",
                                  g.gnutls_strerror(e)));
    }
    std::string error;
    if (int e = g.gnutls_x509_crt_import(crt, &certs[i], GNUTLS_X509_FMT_DER);
        e < 0) {
      error = absl::StrCat("Cannot import certificate: ", g.gnutls_strerror(e));
    } else if (g.gnutls_x509_crt_get_expiration_time(crt) < now) {
      error = "The certificate has expired";
    } else if (g.gnutls_x509_crt_get_activation_time(crt) > now) {
      error = "The certificate is not yet activated";
    } else if (i == 0 && impl_->authz.has_value()) {
      // The peer's own certificate: its distinguished name.
      std::string dn(1024, '\0');
      size_t size = dn.size();
      int e = g.gnutls_x509_crt_get_dn(crt, dn.data(), &size);
      if (e == GNUTLS_E_SHORT_MEMORY_BUFFER) {
        dn.resize(size);
        e = g.gnutls_x509_crt_get_dn(crt, dn.data(), &size);
      }
      if (e < 0) {
        error = absl::StrCat("Cannot get client distinguished name: ",
                             g.gnutls_strerror(e));
      } else {
        dn.resize(strnlen(dn.data(), size));
        absl::StatusOr<bool> allowed =
            block::ObjectRegistry::Default().IsAllowedByAuthz(*impl_->authz,
                                                              dn);
        if (!allowed.ok()) {
          error = std::string(allowed.status().message());
        } else if (!*allowed) {
          error = absl::StrCat("TLS x509 authz check for ", dn, " is denied");
        }
      }
    }
    g.gnutls_x509_crt_deinit(crt);
    if (!error.empty()) return refused(error);
  }
  return Wait::kNone;
}

ssize_t TlsSession::Recv(void* data, size_t length) {
  const ssize_t r =
      impl_->g->gnutls_record_recv(impl_->session, data, length);
  if (r > 0) return r;
  if (r == GNUTLS_E_AGAIN || r == GNUTLS_E_INTERRUPTED) return -1;
  impl_->last_recv = r;
  if (r == 0 || r == GNUTLS_E_PREMATURE_TERMINATION) return 0;
  return -2;
}

std::string TlsSession::ReadError() const {
  if (impl_->last_recv == 0) {
    return "Unexpected end-of-file before all data were read";
  }
  return absl::StrCat("Cannot read from TLS channel: ",
                      impl_->last_recv == GNUTLS_E_PREMATURE_TERMINATION
                          ? std::strerror(ECONNABORTED)
                          : std::strerror(EIO));
}

int TlsSession::Send(const struct iovec* iov, int iovcnt) {
  const GnuTls& g = *impl_->g;
  g.gnutls_record_cork(impl_->session);
  impl_->corked = true;
  for (int i = 0; i < iovcnt; ++i) {
    if (iov[i].iov_len == 0) continue;
    // Corked: the bytes are copied into the session's buffer.
    if (g.gnutls_record_send(impl_->session, iov[i].iov_base,
                             iov[i].iov_len) < 0) {
      return -1;
    }
  }
  return Flush();
}

int TlsSession::Flush() {
  if (!impl_->corked) return 1;
  const ssize_t r = impl_->g->gnutls_record_uncork(impl_->session, 0);
  if (r == GNUTLS_E_AGAIN || r == GNUTLS_E_INTERRUPTED) return 0;
  impl_->corked = false;
  return r < 0 ? -1 : 1;
}

}  // namespace imgtool::nbd_server
