// User-creatable objects, as QEMU's tools take them with --object
// (`--object secret,id=sec0,file=/run/key`): the command line's text is
// parsed with QEMU's keyval syntax (implied first key `qom-type`, `,,` for
// a comma inside a value, dotted keys for nested options, `help` or `?`
// anywhere asks for help), checked as qemu-img 7.2 checks it, and the object
// is kept under its id so that the block layer can look it up later (a
// LUKS driver's `key-secret`, qcow2's `encrypt.key-secret`).
//
// Types: every type qemu-img 7.2 lists for `--object help` is known (its
// help text is qemu-img's); `secret`, `tls-creds-x509`, `tls-creds-psk`
// and `authz-simple` can be created. A secret's
// properties are data, file (read when the object is added), format=raw|
// base64 (base64 data is decoded as glib decodes it), and keyid/iv for a
// secret encrypted with another secret (AES-256-CBC): the key lookup, key
// length and IV are checked as QEMU checks them, then decrypting is
// refused (kUnimplemented), as imgtool has no AES yet. Creating any other
// type is kUnimplemented "Object type 'X' is not supported by imgtool".
//
// TLS credentials (QEMU's crypto/tlscreds.c, tlscredsx509.c,
// tlscredspsk.c): properties dir, endpoint=server|client (default client),
// verify-peer (default on), priority, and sanity-check / passwordid (x509)
// or username (psk). When the object is added, the files QEMU's load needs
// are checked as its qcrypto_tls_creds_get_path does (exist: stat): x509
// server DIR/ca-cert.pem, server-cert.pem, server-key.pem (optional
// ca-crl.pem, dh-params.pem); x509 client DIR/ca-cert.pem (optional
// client-cert.pem, client-key.pem); psk DIR/keys.psk, whose line for the
// client's username (default "qemu") must exist. The files are parsed by
// their user (nbd_server/tls.h for a server, libnbd for a client):
//   Missing 'dir' property value
//   Unable to access credentials /d/ca-cert.pem: No such file or directory
//   username should not be set when endpoint=server
//   Username bob not found in PSK file /d/keys.psk
//   Cannot read PSK file /d/keys.psk: Failed to open file “...”: ...
//   Parameter 'endpoint' does not accept value 'x'
//   Parameter 'verify-peer' expects 'on' or 'off'
//
// authz-simple (QEMU's authz/simple.c): identity (mandatory: "Parameter
// 'identity' is missing"); an identity is allowed when it equals it
// (IsAllowedByAuthz). authz-list and authz-list-file are not supported.
//
// Error texts are qemu-img 7.2's, all kInvalidArgument unless said
// otherwise, in QEMU's order (syntax, type, id, properties, id syntax,
// duplicate id, then the type's own checks):
//   Invalid parameter ''  /  Expected '=' after parameter 'data'
//   Parameter 'qom-type' is missing
//   Parameter 'qom-type' does not accept value 'foo'
//   Parameter 'id' is missing
//   Parameter 'format' does not accept value 'hex'
//   Parameter 'bogus' is unexpected  /  Parameters 'data.*' are unexpected
//   Property 'secret.loaded' is not writable
//   Parameter 'id' expects an identifier
//     (+ "\nIdentifiers consist of letters, digits, '-', '.', '_', starting
//     with a letter.", a hint printed without the program's prefix)
//   attempt to add duplicate property 's0' to object (type 'container')
//     (kAlreadyExists)
//   'file' and 'data' are mutually exclusive
//   Either 'file' or 'data' must be provided
//   Unable to read /x: Failed to open file “/x”: No such file or directory
//   Base64 data contains invalid characters
//   No secret with id 'k'  /  Secret with id 'k' has no data (kNotFound)
//   Key should be 32 bytes in length  /  IV is required to decrypt secret
//   IV should be 16 bytes in length not 12
// Where a string has several unknown keys, QEMU names the first in its
// hash table's order; imgtool names the first on the command line.
//
// Thread-safety: an ObjectRegistry is safe to use from several threads.
#ifndef IMGTOOL_BLOCK_OBJECTS_H_
#define IMGTOOL_BLOCK_OBJECTS_H_

#include <map>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace imgtool::block {

class ObjectRegistry {
 public:
  ObjectRegistry() = default;
  ObjectRegistry(const ObjectRegistry&) = delete;
  ObjectRegistry& operator=(const ObjectRegistry&) = delete;

  // The registry of the process: the one --object adds to and the block
  // layer looks secrets up in. Never destroyed.
  static ObjectRegistry& Default();

  // Parses one --object argument and adds the object it describes. When
  // the argument asks for help (`help`, `secret,help`, `?`), nothing is
  // added and the help text qemu-img prints is returned (lines ending in
  // "\n"); otherwise nullopt. Errors as listed above; nothing is added on
  // error. A secret's file is read here (blocking; call it while parsing the
  // command line, not from the engine's thread).
  absl::StatusOr<std::optional<std::string>> AddFromCommandLine(
      absl::string_view text);

  // The bytes of secret `id` (decoded from base64 if it was given so).
  // kNotFound "No secret with id 'x'"; kInvalidArgument "Object with id 'x'
  // is not a secret" for an object of another type.
  absl::StatusOr<std::string> LookupSecret(absl::string_view id) const;

  // TLS credentials (tls-creds-x509 / tls-creds-psk) as added.
  struct TlsCreds {
    bool psk = false;             // tls-creds-psk, else tls-creds-x509
    std::string dir;              // "" when not given
    bool server = false;          // endpoint=server
    bool verify_peer = true;      // verify-peer
    std::string priority;         // "" for QEMU's default ("NORMAL")
    std::string username;         // psk client: "" means "qemu"
    bool sanity_check = true;     // x509: sanity-check
  };
  // kNotFound "No TLS credentials with id 'x'"; kInvalidArgument "Object
  // with id 'x' is not TLS credentials" (qemu-nbd's nbd_get_tls_creds).
  absl::StatusOr<TlsCreds> LookupTlsCreds(absl::string_view id) const;

  // Whether authz object `authzid` allows `identity`
  // (qauthz_is_allowed_by_id in QEMU's authz/base.c; authz-simple: the
  // identity equals its `identity`). Errors, QEMU's texts: kNotFound
  // "Cannot find QAuthZ object ID x"; kInvalidArgument "Object 'x' is not a
  // QAuthZ subclass".
  absl::StatusOr<bool> IsAllowedByAuthz(absl::string_view authzid,
                                        absl::string_view identity) const;

  // Whether an object with this id exists.
  bool Contains(absl::string_view id) const;

  // Forgets every object (tests).
  void Clear();

 private:
  struct Object {
    std::string type;
    std::string secret;  // the bytes, for type "secret"
    TlsCreds tls;        // for tls-creds-*
    std::string identity;  // for authz-simple
  };
  mutable absl::Mutex mu_;
  std::map<std::string, Object, std::less<>> objects_ ABSL_GUARDED_BY(mu_);
};

// The names of the object types qemu-img 7.2 knows, sorted.
const std::vector<std::string>& KnownObjectTypes();

}  // namespace imgtool::block

#endif  // IMGTOOL_BLOCK_OBJECTS_H_
