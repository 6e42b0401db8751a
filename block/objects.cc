#include "block/objects.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/status_macros.h"

namespace imgtool::block {
namespace {

// A keyval tree: a string value or a dict of children in the order their
// keys first appeared (a key given again replaces the value in place).
struct KvNode {
  bool is_dict = false;
  std::string value;
  std::vector<std::pair<std::string, std::unique_ptr<KvNode>>> entries;

  KvNode* Find(absl::string_view key) const {
    for (const auto& [k, v] : entries) {
      if (k == key) return v.get();
    }
    return nullptr;
  }
};

constexpr size_t kMaxKeyFragment = 128;  // QEMU's key_in_cur[128]

bool IsAlpha(char c) { return std::isalpha(static_cast<unsigned char>(c)); }
bool IsDigit(char c) { return std::isdigit(static_cast<unsigned char>(c)); }
bool IsAlnum(char c) { return std::isalnum(static_cast<unsigned char>(c)); }

// QEMU's parse_qapi_name(s, false): a letter, then letters, digits, '-' and
// '_'. The length of the name at the start of `s`, 0 if there is none.
size_t QapiNameLength(absl::string_view s) {
  if (s.empty() || !IsAlpha(s[0])) return 0;
  size_t n = 1;
  while (n < s.size() && (IsAlnum(s[n]) || s[n] == '-' || s[n] == '_')) ++n;
  return n;
}

// Puts `value` (a string, or a dict if null) under `key` in `cur`; the
// existing dict if `key` already names one. `shown` is the key as QEMU
// names it in the error.
absl::StatusOr<KvNode*> Put(KvNode* cur, const std::string& key,
                            const std::string* value, absl::string_view shown) {
  if (KvNode* old = cur->Find(key); old != nullptr) {
    if (old->is_dict != (value == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat("Parameters '", shown, ".*' used inconsistently"));
    }
    if (value != nullptr) old->value = *value;
    return old;
  }
  auto node = std::make_unique<KvNode>();
  node->is_dict = value == nullptr;
  if (value != nullptr) node->value = *value;
  KvNode* raw = node.get();
  cur->entries.emplace_back(key, std::move(node));
  return raw;
}

// QEMU's keyval_parse(text, "qom-type", &help) (util/keyval.c): the tree,
// and whether `help` or `?` appeared as a key of its own.
absl::Status ParseKeyval(absl::string_view text, KvNode* root, bool* help) {
  root->is_dict = true;
  bool implied = true;
  size_t pos = 0;
  while (pos < text.size()) {
    const absl::string_view params = text.substr(pos);
    size_t len = params.find_first_of("=,");
    if (len == absl::string_view::npos) len = params.size();
    if (len != 0 && (len == params.size() || params[len] != '=')) {
      const absl::string_view word = params.substr(0, len);
      if (word == "help" || word == "?") {
        *help = true;
        pos += len;
        if (pos < text.size() && text[pos] == ',') ++pos;
        implied = false;
        continue;
      }
      if (implied) {
        const std::string value(word);
        absl::StatusOr<KvNode*> put = Put(root, "qom-type", &value, "qom-type");
        if (!put.ok()) return put.status();
        pos += len;
        if (pos < text.size() && text[pos] == ',') ++pos;
        implied = false;
        continue;
      }
    }
    implied = false;
    const absl::string_view key = params.substr(0, len);
    KvNode* cur = root;
    std::string key_in_cur;
    size_t s = 0;  // offset in `key`
    for (;;) {
      size_t frag = 0;
      if (s != 0 && s < key.size() && IsDigit(key[s])) {
        while (s + frag < key.size() && IsDigit(key[s + frag])) ++frag;
      } else {
        frag = QapiNameLength(key.substr(s));
      }
      if (frag == 0 || (s + frag < key.size() && key[s + frag] != '.')) {
        return absl::InvalidArgumentError(
            absl::StrCat("Invalid parameter '", key, "'"));
      }
      if (frag >= kMaxKeyFragment) {
        return absl::InvalidArgumentError(absl::StrCat(
            "Parameter",
            s != 0 || s + frag != key.size() ? " fragment" : "", " '",
            key.substr(s, frag), "' is too long"));
      }
      if (s != 0) {
        absl::StatusOr<KvNode*> next =
            Put(cur, key_in_cur, nullptr, key.substr(0, s - 1));
        if (!next.ok()) return next.status();
        cur = *next;
      }
      key_in_cur = std::string(key.substr(s, frag));
      s += frag;
      if (s >= key.size() || key[s] != '.') break;
      ++s;
    }
    if (s >= params.size() || params[s] != '=') {
      return absl::InvalidArgumentError(absl::StrCat(
          "Expected '=' after parameter '", key.substr(0, s), "'"));
    }
    size_t p = s + 1;
    std::string value;
    while (p < params.size()) {
      if (params[p] == ',') {
        ++p;
        if (p >= params.size() || params[p] != ',') break;
      }
      value += params[p++];
    }
    absl::StatusOr<KvNode*> put = Put(cur, key_in_cur, &value, key);
    if (!put.ok()) return put.status();
    pos += p;
  }
  return absl::OkStatus();
}

struct TypeInfo {
  const char* name;
  // Property lines of `--object NAME,help`, in qemu-img's order.
  std::vector<const char*> properties;
};

const std::vector<TypeInfo>& Types() {
  static const auto* types = new std::vector<TypeInfo>{
      {"authz-list",
       {"policy=<QAuthZListPolicy>", "rules=<QAuthZListRule>"}},
      {"authz-list-file", {"filename=<string>", "refresh=<bool>"}},
      {"authz-simple", {"identity=<string>"}},
      {"main-loop",
       {"aio-max-batch=<int>", "thread-pool-max=<int>",
        "thread-pool-min=<int>"}},
      {"pr-manager-helper", {"path=<string>"}},
      {"secret",
       {"data=<string>", "file=<string>", "format=<QCryptoSecretFormat>",
        "iv=<string>", "keyid=<string>"}},
      {"secret_keyring",
       {"format=<QCryptoSecretFormat>", "iv=<string>", "keyid=<string>",
        "serial=<int32_t>"}},
      {"thread-context", {"cpu-affinity=<int>", "node-affinity=<int>"}},
      {"throttle-group",
       {"limits=<ThrottleLimits>", "x-bps-read-max-length=<int>",
        "x-bps-read-max=<int>", "x-bps-read=<int>",
        "x-bps-total-max-length=<int>", "x-bps-total-max=<int>",
        "x-bps-total=<int>", "x-bps-write-max-length=<int>",
        "x-bps-write-max=<int>", "x-bps-write=<int>",
        "x-iops-read-max-length=<int>", "x-iops-read-max=<int>",
        "x-iops-read=<int>", "x-iops-size=<int>",
        "x-iops-total-max-length=<int>", "x-iops-total-max=<int>",
        "x-iops-total=<int>", "x-iops-write-max-length=<int>",
        "x-iops-write-max=<int>", "x-iops-write=<int>"}},
      {"tls-cipher-suites",
       {"dir=<string>", "endpoint=<QCryptoTLSCredsEndpoint>",
        "priority=<string>", "verify-peer=<bool>"}},
      {"tls-creds-anon",
       {"dir=<string>", "endpoint=<QCryptoTLSCredsEndpoint>",
        "priority=<string>", "verify-peer=<bool>"}},
      {"tls-creds-psk",
       {"dir=<string>", "endpoint=<QCryptoTLSCredsEndpoint>",
        "priority=<string>", "username=<string>", "verify-peer=<bool>"}},
      {"tls-creds-x509",
       {"dir=<string>", "endpoint=<QCryptoTLSCredsEndpoint>",
        "passwordid=<string>", "priority=<string>", "sanity-check=<bool>",
        "verify-peer=<bool>"}},
  };
  return *types;
}

const TypeInfo* FindType(absl::string_view name) {
  for (const TypeInfo& t : Types()) {
    if (name == t.name) return &t;
  }
  return nullptr;
}

std::string HelpText(const KvNode& root) {
  const KvNode* type = root.Find("qom-type");
  const TypeInfo* info =
      type != nullptr && !type->is_dict ? FindType(type->value) : nullptr;
  std::string text;
  if (info == nullptr) {
    text = "List of user creatable objects:\n";
    for (const TypeInfo& t : Types()) absl::StrAppend(&text, "  ", t.name, "\n");
    return text;
  }
  text = absl::StrCat(info->name, " options:\n");
  for (const char* p : info->properties) absl::StrAppend(&text, "  ", p, "\n");
  return text;
}

// A member the type's QAPI struct visits as a string: absent (nullptr),
// or its value; a dict there is "Parameters 'key.*' are unexpected".
absl::StatusOr<const std::string*> StringMember(const KvNode& root,
                                                absl::string_view key) {
  const KvNode* node = root.Find(key);
  if (node == nullptr) return nullptr;
  if (node->is_dict) {
    return absl::InvalidArgumentError(
        absl::StrCat("Parameters '", key, ".*' are unexpected"));
  }
  return &node->value;
}

// QEMU's id_wellformed(): a letter, then letters, digits, '-', '.', '_'.
bool IsWellFormedId(absl::string_view id) {
  if (id.empty() || !IsAlpha(id[0])) return false;
  for (char c : id) {
    if (!IsAlnum(c) && c != '-' && c != '.' && c != '_') return false;
  }
  return true;
}

// QEMU's qbase64_decode (util/base64.c) over glib's g_base64_decode: the
// characters are checked, then every group of four alphabet characters
// gives three bytes, fewer where '=' stands in the last two places, and a
// short group at the end is dropped.
absl::StatusOr<std::string> DecodeBase64(absl::string_view text) {
  if (text.find('\0') != absl::string_view::npos) {
    return absl::InvalidArgumentError(
        "Base64 data contains embedded NUL characters");
  }
  constexpr absl::string_view kValid =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=\n";
  if (text.find_first_not_of(kValid) != absl::string_view::npos) {
    return absl::InvalidArgumentError(
        "Base64 data contains invalid characters");
  }
  auto rank = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    if (c == '=') return 0;
    return -1;
  };
  std::string out;
  uint32_t v = 0;
  int count = 0;
  char last[2] = {0, 0};  // last[0]: the latest character
  for (char c : text) {
    const int r = rank(c);
    if (r < 0) continue;
    last[1] = last[0];
    last[0] = c;
    v = (v << 6) | static_cast<uint32_t>(r);
    if (++count == 4) {
      out += static_cast<char>((v >> 16) & 0xff);
      if (last[1] != '=') out += static_cast<char>((v >> 8) & 0xff);
      if (last[0] != '=') out += static_cast<char>(v & 0xff);
      count = 0;
    }
  }
  return out;
}

// g_file_get_contents() as QEMU's secret uses it, with glib's messages.
absl::StatusOr<std::string> ReadSecretFile(const std::string& path) {
  auto fail = [&](absl::string_view what, int err) {
    return absl::InvalidArgumentError(
        absl::StrCat("Unable to read ", path, ": ", what, " file “", path,
                     "”: ", std::strerror(err)));
  };
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return fail("Failed to open", errno);
  std::string data;
  char buf[4096];
  struct stat st;
  const bool regular = fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
  for (;;) {
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      close(fd);
      return fail(regular ? "Failed to read from" : "Error reading", err);
    }
    data.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return data;
}

// QEMU's qapi_bool_parse, as the keyval visitor reads a bool member.
absl::StatusOr<bool> BoolMember(const KvNode& root, absl::string_view key,
                                bool fallback) {
  absl::StatusOr<const std::string*> v = StringMember(root, key);
  if (!v.ok()) return v.status();
  if (*v == nullptr) return fallback;
  const std::string& s = **v;
  if (s == "on" || s == "yes" || s == "true" || s == "y") return true;
  if (s == "off" || s == "no" || s == "false" || s == "n") return false;
  return absl::InvalidArgumentError(
      absl::StrCat("Parameter '", key, "' expects 'on' or 'off'"));
}

// qcrypto_tls_creds_get_path: "" for an optional file that does not exist.
absl::StatusOr<std::string> CredsPath(const ObjectRegistry::TlsCreds& c,
                                      const char* name, bool required) {
  if (c.dir.empty()) {
    if (required) {
      return absl::InvalidArgumentError("Missing 'dir' property value");
    }
    return std::string();
  }
  std::string path = absl::StrCat(c.dir, "/", name);
  struct stat st;
  if (stat(path.c_str(), &st) < 0) {
    if (errno == ENOENT && !required) return std::string();
    return absl::InvalidArgumentError(absl::StrCat(
        "Unable to access credentials ", path, ": ", std::strerror(errno)));
  }
  return path;
}

// The members of TlsCredsX509Properties / TlsCredsPskProperties in their
// QAPI visit order, and the file checks of their load functions.
absl::StatusOr<ObjectRegistry::TlsCreds> ParseTlsCreds(const KvNode& root,
                                                       bool psk) {
  ObjectRegistry::TlsCreds c;
  c.psk = psk;
  ASSIGN_OR_RETURN(c.verify_peer, BoolMember(root, "verify-peer", true));
  ASSIGN_OR_RETURN(const std::string* dir, StringMember(root, "dir"));
  if (dir != nullptr) c.dir = *dir;
  ASSIGN_OR_RETURN(const std::string* endpoint, StringMember(root, "endpoint"));
  if (endpoint != nullptr) {
    if (*endpoint != "server" && *endpoint != "client") {
      return absl::InvalidArgumentError(absl::StrCat(
          "Parameter 'endpoint' does not accept value '", *endpoint, "'"));
    }
    c.server = *endpoint == "server";
  }
  ASSIGN_OR_RETURN(const std::string* priority, StringMember(root, "priority"));
  if (priority != nullptr) c.priority = *priority;
  const std::string* username = nullptr;
  if (psk) {
    ASSIGN_OR_RETURN(username, StringMember(root, "username"));
    if (username != nullptr) c.username = *username;
  } else {
    ASSIGN_OR_RETURN(c.sanity_check, BoolMember(root, "sanity-check", true));
    RETURN_IF_ERROR(StringMember(root, "passwordid").status());
  }
  return c;
}

absl::Status CheckTlsCredsFiles(const ObjectRegistry::TlsCreds& c,
                                bool username_given) {
  if (!c.psk) {
    const std::vector<std::pair<const char*, bool>> files =
        c.server ? std::vector<std::pair<const char*, bool>>{
                       {"ca-cert.pem", true},
                       {"ca-crl.pem", false},
                       {"server-cert.pem", true},
                       {"server-key.pem", true},
                       {"dh-params.pem", false}}
                 : std::vector<std::pair<const char*, bool>>{
                       {"ca-cert.pem", true},
                       {"client-cert.pem", false},
                       {"client-key.pem", false}};
    for (const auto& [name, required] : files) {
      RETURN_IF_ERROR(CredsPath(c, name, required).status());
    }
    return absl::OkStatus();
  }
  if (c.server) {
    if (username_given) {
      return absl::InvalidArgumentError(
          "username should not be set when endpoint=server");
    }
    RETURN_IF_ERROR(CredsPath(c, "dh-params.pem", false).status());
    return CredsPath(c, "keys.psk", true).status();
  }
  ASSIGN_OR_RETURN(const std::string path, CredsPath(c, "keys.psk", true));
  // lookup_key: a line "USERNAME:HEXKEY".
  const std::string user = c.username.empty() ? "qemu" : c.username;
  absl::StatusOr<std::string> contents = ReadSecretFile(path);
  if (!contents.ok()) {
    absl::string_view m = contents.status().message();
    absl::ConsumePrefix(&m, absl::StrCat("Unable to read ", path, ": "));
    return absl::InvalidArgumentError(
        absl::StrCat("Cannot read PSK file ", path, ": ", m));
  }
  for (absl::string_view line : absl::StrSplit(*contents, '\n')) {
    if (absl::StartsWith(line, user) && line.size() > user.size() &&
        line[user.size()] == ':') {
      return absl::OkStatus();
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "Username ", user, " not found in PSK file ", path));
}

}  // namespace

ObjectRegistry& ObjectRegistry::Default() {
  static auto* registry = new ObjectRegistry;
  return *registry;
}

const std::vector<std::string>& KnownObjectTypes() {
  static const auto* names = [] {
    auto* v = new std::vector<std::string>;
    for (const TypeInfo& t : Types()) v->push_back(t.name);
    return v;
  }();
  return *names;
}

absl::StatusOr<std::optional<std::string>> ObjectRegistry::AddFromCommandLine(
    absl::string_view text) {
  KvNode root;
  bool help = false;
  if (absl::Status st = ParseKeyval(text, &root, &help); !st.ok()) return st;
  if (help) return std::optional<std::string>(HelpText(root));

  // The QAPI visit of ObjectOptions: qom-type, id, the type's members,
  // then keys no member took.
  const KvNode* type_node = root.Find("qom-type");
  if (type_node == nullptr) {
    return absl::InvalidArgumentError("Parameter 'qom-type' is missing");
  }
  if (type_node->is_dict) {
    return absl::InvalidArgumentError(
        "Parameters 'qom-type.*' are unexpected");
  }
  const TypeInfo* type = FindType(type_node->value);
  if (type == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Parameter 'qom-type' does not accept value '", type_node->value, "'"));
  }
  absl::StatusOr<const std::string*> id = StringMember(root, "id");
  if (!id.ok()) return id.status();
  if (*id == nullptr) {
    return absl::InvalidArgumentError("Parameter 'id' is missing");
  }
  const std::string type_name = type->name;
  std::vector<std::string> members;
  for (const char* p : type->properties) {
    const absl::string_view line(p);
    members.emplace_back(line.substr(0, line.find('=')));
  }
  const std::string* format = nullptr;
  const std::string* keyid = nullptr;
  const std::string* iv = nullptr;
  const std::string* data = nullptr;
  const std::string* file = nullptr;
  bool loaded_given = false;
  if (type_name == "secret") {
    members = {"loaded", "format", "keyid", "iv", "data", "file"};
    if (absl::StatusOr<const std::string*> loaded =
            StringMember(root, "loaded");
        !loaded.ok()) {
      return loaded.status();
    } else if (*loaded != nullptr) {
      const std::string& v = **loaded;
      if (v != "on" && v != "off" && v != "yes" && v != "no" && v != "true" &&
          v != "false" && v != "y" && v != "n") {
        return absl::InvalidArgumentError(
            "Parameter 'loaded' expects 'on' or 'off'");
      }
      loaded_given = true;
    }
    const std::pair<const char*, const std::string**> string_members[] = {
        {"format", &format}, {"keyid", &keyid}, {"iv", &iv},
        {"data", &data},     {"file", &file}};
    for (const auto& [key, out] : string_members) {
      absl::StatusOr<const std::string*> v = StringMember(root, key);
      if (!v.ok()) return v.status();
      *out = *v;
      if (*out != nullptr && std::strcmp(key, "format") == 0 &&
          **out != "raw" && **out != "base64") {
        return absl::InvalidArgumentError(absl::StrCat(
            "Parameter 'format' does not accept value '", **out, "'"));
      }
    }
  }
  const bool tls = type_name == "tls-creds-x509" || type_name == "tls-creds-psk";
  ObjectRegistry::TlsCreds tls_creds;
  if (tls) {
    ASSIGN_OR_RETURN(tls_creds,
                     ParseTlsCreds(root, type_name == "tls-creds-psk"));
  }
  std::string identity;  // authz-simple's
  if (type_name == "authz-simple") {
    ASSIGN_OR_RETURN(const std::string* v, StringMember(root, "identity"));
    if (v == nullptr) {
      return absl::InvalidArgumentError("Parameter 'identity' is missing");
    }
    identity = *v;
  }
  for (const auto& [key, node] : root.entries) {
    if (key == "qom-type" || key == "id") continue;
    bool known = false;
    for (const std::string& m : members) known = known || m == key;
    if (!known) {
      return absl::InvalidArgumentError(
          absl::StrCat("Parameter '", key, "' is unexpected"));
    }
  }
  if (type_name != "secret" && !tls && type_name != "authz-simple") {
    return absl::UnimplementedError(absl::StrCat(
        "Object type '", type_name, "' is not supported by imgtool"));
  }
  if (!IsWellFormedId(**id)) {
    return absl::InvalidArgumentError(
        "Parameter 'id' expects an identifier\n"
        "Identifiers consist of letters, digits, '-', '.', '_', starting with "
        "a letter.");
  }
  if (loaded_given) {
    return absl::InvalidArgumentError(
        "Property 'secret.loaded' is not writable");
  }
  if (Contains(**id)) {
    return absl::AlreadyExistsError(absl::StrCat(
        "attempt to add duplicate property '", **id,
        "' to object (type 'container')"));
  }

  if (type_name == "authz-simple") {
    absl::MutexLock lock(&mu_);
    objects_[**id] = Object{.type = type_name, .identity = std::move(identity)};
    return std::optional<std::string>();
  }
  if (tls) {
    RETURN_IF_ERROR(
        CheckTlsCredsFiles(tls_creds, root.Find("username") != nullptr));
    absl::MutexLock lock(&mu_);
    objects_[**id] = Object{.type = type_name, .tls = std::move(tls_creds)};
    return std::optional<std::string>();
  }

  // qcrypto_secret_complete: load, then decrypt or decode.
  if (data != nullptr && file != nullptr) {
    return absl::InvalidArgumentError("'file' and 'data' are mutually exclusive");
  }
  if (data == nullptr && file == nullptr) {
    return absl::InvalidArgumentError(
        "Either 'file' or 'data' must be provided");
  }
  std::string input;
  if (file != nullptr) {
    absl::StatusOr<std::string> contents = ReadSecretFile(*file);
    if (!contents.ok()) return contents.status();
    input = *std::move(contents);
  } else {
    input = *data;
  }
  const bool base64 = format != nullptr && *format == "base64";
  std::string secret;
  if (keyid != nullptr) {
    if (*keyid == **id) {
      return absl::NotFoundError(
          absl::StrCat("Secret with id '", *keyid, "' has no data"));
    }
    absl::StatusOr<std::string> key = LookupSecret(*keyid);
    if (!key.ok()) return key.status();
    if (key->size() != 32) {
      return absl::InvalidArgumentError("Key should be 32 bytes in length");
    }
    if (iv == nullptr) {
      return absl::InvalidArgumentError("IV is required to decrypt secret");
    }
    absl::StatusOr<std::string> iv_bytes = DecodeBase64(*iv);
    if (!iv_bytes.ok()) return iv_bytes.status();
    if (iv_bytes->size() != 16) {
      return absl::InvalidArgumentError(absl::StrCat(
          "IV should be 16 bytes in length not ", iv_bytes->size()));
    }
    std::string ciphertext = input;
    if (base64) {
      absl::StatusOr<std::string> decoded = DecodeBase64(input);
      if (!decoded.ok()) return decoded.status();
      ciphertext = *std::move(decoded);
    }
    if (ciphertext.size() % 16 != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("Length ", ciphertext.size(),
                       " must be a multiple of block size 16"));
    }
    return absl::UnimplementedError(absl::StrCat(
        "secret '", **id,
        "': decrypting a secret with keyid (AES-256-CBC) is not supported by "
        "imgtool; pass the secret in clear with data= or file="));
  }
  if (base64) {
    absl::StatusOr<std::string> decoded = DecodeBase64(input);
    if (!decoded.ok()) return decoded.status();
    secret = *std::move(decoded);
  } else {
    secret = std::move(input);
  }
  absl::MutexLock lock(&mu_);
  objects_[**id] = Object{.type = type_name, .secret = std::move(secret)};
  return std::optional<std::string>();
}

absl::StatusOr<std::string> ObjectRegistry::LookupSecret(
    absl::string_view id) const {
  absl::MutexLock lock(&mu_);
  auto it = objects_.find(id);
  if (it == objects_.end()) {
    return absl::NotFoundError(absl::StrCat("No secret with id '", id, "'"));
  }
  if (it->second.type != "secret") {
    return absl::InvalidArgumentError(
        absl::StrCat("Object with id '", id, "' is not a secret"));
  }
  return it->second.secret;
}

absl::StatusOr<ObjectRegistry::TlsCreds> ObjectRegistry::LookupTlsCreds(
    absl::string_view id) const {
  absl::MutexLock lock(&mu_);
  auto it = objects_.find(id);
  if (it == objects_.end()) {
    return absl::NotFoundError(
        absl::StrCat("No TLS credentials with id '", id, "'"));
  }
  if (it->second.type != "tls-creds-x509" &&
      it->second.type != "tls-creds-psk") {
    return absl::InvalidArgumentError(
        absl::StrCat("Object with id '", id, "' is not TLS credentials"));
  }
  return it->second.tls;
}

absl::StatusOr<bool> ObjectRegistry::IsAllowedByAuthz(
    absl::string_view authzid, absl::string_view identity) const {
  absl::MutexLock lock(&mu_);
  auto it = objects_.find(authzid);
  if (it == objects_.end()) {
    return absl::NotFoundError(
        absl::StrCat("Cannot find QAuthZ object ID ", authzid));
  }
  if (it->second.type != "authz-simple") {
    return absl::InvalidArgumentError(
        absl::StrCat("Object '", authzid, "' is not a QAuthZ subclass"));
  }
  return identity == it->second.identity;
}

bool ObjectRegistry::Contains(absl::string_view id) const {
  absl::MutexLock lock(&mu_);
  return objects_.find(id) != objects_.end();
}

void ObjectRegistry::Clear() {
  absl::MutexLock lock(&mu_);
  objects_.clear();
}

}  // namespace imgtool::block
