#include "block/objects.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace imgtool::block {
namespace {

// The message of a failed AddFromCommandLine.
std::string AddError(ObjectRegistry& r, const std::string& text) {
  absl::StatusOr<std::optional<std::string>> added = r.AddFromCommandLine(text);
  if (added.ok()) return "(ok)";
  return std::string(added.status().message());
}

std::string TempFile(const std::string& name, const std::string& contents) {
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(dir != nullptr ? dir : "/tmp") + "/" + name;
  std::ofstream(path, std::ios::binary) << contents;
  return path;
}

TEST(ObjectRegistryTest, AddsSecretFromDataAndFile) {
  ObjectRegistry r;
  ASSERT_TRUE(r.AddFromCommandLine("secret,id=sec0,data=hunter2").ok());
  const std::string path = TempFile("key", "pass,word\n");
  ASSERT_TRUE(r.AddFromCommandLine("secret,id=sec1,file=" + path).ok());
  EXPECT_EQ(*r.LookupSecret("sec0"), "hunter2");
  EXPECT_EQ(*r.LookupSecret("sec1"), "pass,word\n");  // raw: bytes as read
  EXPECT_TRUE(r.Contains("sec1"));
}

TEST(ObjectRegistryTest, KeyvalSyntax) {
  ObjectRegistry r;
  // ",," is a comma in a value; the implied key is qom-type; the last of a
  // repeated key wins; a trailing comma ends the list.
  ASSERT_TRUE(r.AddFromCommandLine("secret,id=a,data=x,,y,data=p,,q,").ok());
  EXPECT_EQ(*r.LookupSecret("a"), "p,q");
  ASSERT_TRUE(r.AddFromCommandLine("qom-type=secret,id=b,id=c,data=").ok());
  EXPECT_EQ(*r.LookupSecret("c"), "");
  EXPECT_FALSE(r.Contains("b"));
  EXPECT_EQ(AddError(r, "secret,,id=s,data=x"), "Invalid parameter ''");
  EXPECT_EQ(AddError(r, "secret,id=s,data"),
            "Expected '=' after parameter 'data'");
  EXPECT_EQ(AddError(r, "secret,id=s,data=x,1a=1"), "Invalid parameter '1a'");
  EXPECT_EQ(AddError(r, "secret,id=s,data=x,a..b=1"),
            "Invalid parameter 'a..b'");
  EXPECT_EQ(AddError(r, "secret,id=s,data=x,data.x=1"),
            "Parameters 'data.*' used inconsistently");
  EXPECT_EQ(AddError(r, "secret,id=s,data.x=1"),
            "Parameters 'data.*' are unexpected");
  EXPECT_EQ(AddError(r, "secret,id=s,data=x,a.b=1"),
            "Parameter 'a' is unexpected");
}

TEST(ObjectRegistryTest, HelpListsTypesOrProperties) {
  ObjectRegistry r;
  absl::StatusOr<std::optional<std::string>> help = r.AddFromCommandLine("help");
  ASSERT_TRUE(help.ok() && help->has_value());
  EXPECT_EQ(help->value().substr(0, 45),
            "List of user creatable objects:\n  authz-list\n");
  help = r.AddFromCommandLine("secret,id=s0,help");
  ASSERT_TRUE(help.ok() && help->has_value());
  EXPECT_EQ(**help,
            "secret options:\n  data=<string>\n  file=<string>\n"
            "  format=<QCryptoSecretFormat>\n  iv=<string>\n"
            "  keyid=<string>\n");
  help = r.AddFromCommandLine("foo,?");  // unknown type: the list
  ASSERT_TRUE(help.ok() && help->has_value());
  EXPECT_EQ(help->value().rfind("List of", 0), 0u);
  EXPECT_FALSE(r.Contains("s0"));
}

TEST(ObjectRegistryTest, ObjectErrorsInQemuOrder) {
  ObjectRegistry r;
  EXPECT_EQ(AddError(r, ""), "Parameter 'qom-type' is missing");
  EXPECT_EQ(AddError(r, "id=s0"), "Parameter 'qom-type' is missing");
  EXPECT_EQ(AddError(r, "foo,id=x"),
            "Parameter 'qom-type' does not accept value 'foo'");
  EXPECT_EQ(AddError(r, "secret,bogus=1"), "Parameter 'id' is missing");
  EXPECT_EQ(AddError(r, "secret,id=0bad,bogus=1"),
            "Parameter 'bogus' is unexpected");
  EXPECT_EQ(AddError(r, "secret,id=s0,bogus=1,format=hex"),
            "Parameter 'format' does not accept value 'hex'");
  EXPECT_EQ(AddError(r, "secret,id=s0,loaded=maybe"),
            "Parameter 'loaded' expects 'on' or 'off'");
  EXPECT_EQ(AddError(r, "secret,id=0bad,loaded=on"),
            "Parameter 'id' expects an identifier\nIdentifiers consist of "
            "letters, digits, '-', '.', '_', starting with a letter.");
  EXPECT_EQ(AddError(r, "secret,id=s0,data=x,loaded=on"),
            "Property 'secret.loaded' is not writable");
  EXPECT_EQ(AddError(r, "secret,id=s0"),
            "Either 'file' or 'data' must be provided");
  EXPECT_EQ(AddError(r, "secret,id=s0,data=x,file=/nonexistent"),
            "'file' and 'data' are mutually exclusive");
  EXPECT_EQ(AddError(r, "secret,id=s0,file=/nonexistent"),
            "Unable to read /nonexistent: Failed to open file "
            "“/nonexistent”: No such file or directory");
  EXPECT_EQ(AddError(r, "secret,id=s0,file=/"),
            "Unable to read /: Error reading file “/”: Is a directory");
  ASSERT_TRUE(r.AddFromCommandLine("secret,id=s0,data=x").ok());
  absl::StatusOr<std::optional<std::string>> dup =
      r.AddFromCommandLine("secret,id=s0,data=y");
  EXPECT_TRUE(absl::IsAlreadyExists(dup.status()));
  EXPECT_EQ(dup.status().message(),
            "attempt to add duplicate property 's0' to object (type "
            "'container')");
  EXPECT_EQ(*r.LookupSecret("s0"), "x");  // the first one stays
  EXPECT_TRUE(absl::IsUnimplemented(
      r.AddFromCommandLine("throttle-group,id=t0").status()));
}

TEST(ObjectRegistryTest, Base64DecodesAsGlibDoes) {
  ObjectRegistry r;
  ASSERT_TRUE(r.AddFromCommandLine("secret,id=a,data=aGVsbG8=,format=base64").ok());
  EXPECT_EQ(*r.LookupSecret("a"), "hello");
  ASSERT_TRUE(r.AddFromCommandLine("secret,id=b,data=aGVsbG8,format=base64").ok());
  EXPECT_EQ(*r.LookupSecret("b"), "hel");  // a short last group is dropped
  const std::string path = TempFile("b64", "aGVs\nbG8=\n");
  ASSERT_TRUE(
      r.AddFromCommandLine("secret,id=c,format=base64,file=" + path).ok());
  EXPECT_EQ(*r.LookupSecret("c"), "hello");
  EXPECT_EQ(AddError(r, "secret,id=d,data=ab-_,format=base64"),
            "Base64 data contains invalid characters");
  const std::string nul = TempFile("nul", std::string("a\0b", 3));
  EXPECT_EQ(AddError(r, "secret,id=d,format=base64,file=" + nul),
            "Base64 data contains embedded NUL characters");
}

TEST(ObjectRegistryTest, EncryptedSecretsCheckedThenRefused) {
  ObjectRegistry r;
  EXPECT_EQ(AddError(r, "secret,id=s0,data=x,keyid=k"),
            "No secret with id 'k'");
  EXPECT_EQ(AddError(r, "secret,id=s0,data=x,keyid=s0"),
            "Secret with id 's0' has no data");
  ASSERT_TRUE(r.AddFromCommandLine("secret,id=short,data=abc").ok());
  EXPECT_EQ(AddError(r, "secret,id=s0,data=x,keyid=short"),
            "Key should be 32 bytes in length");
  ASSERT_TRUE(r.AddFromCommandLine(
                   "secret,id=k,data=" + std::string(32, '0')).ok());
  EXPECT_EQ(AddError(r, "secret,id=s0,data=x,keyid=k"),
            "IV is required to decrypt secret");
  EXPECT_EQ(AddError(r, "secret,id=s0,data=x,keyid=k,iv=AAAA"),
            "IV should be 16 bytes in length not 3");
  EXPECT_EQ(AddError(r, "secret,id=s0,data=x,keyid=k,"
                        "iv=AAAAAAAAAAAAAAAAAAAAAA=="),
            "Length 1 must be a multiple of block size 16");
  EXPECT_TRUE(absl::IsUnimplemented(
      r.AddFromCommandLine("secret,id=s0,data=xxxxxxxxxxxxxxxx,keyid=k,"
                           "iv=AAAAAAAAAAAAAAAAAAAAAA==")
          .status()));
  EXPECT_FALSE(r.Contains("s0"));
}

TEST(ObjectRegistryTest, LookupErrors) {
  ObjectRegistry r;
  EXPECT_TRUE(absl::IsNotFound(r.LookupSecret("nope").status()));
  EXPECT_EQ(r.LookupSecret("nope").status().message(),
            "No secret with id 'nope'");
  ASSERT_TRUE(r.AddFromCommandLine("secret,id=s0,data=x").ok());
  r.Clear();
  EXPECT_FALSE(r.Contains("s0"));
}

TEST(ObjectRegistryTest, TlsCreds) {
  ObjectRegistry r;
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string d = std::string(dir != nullptr ? dir : "/tmp") + "/tls";
  std::system(("mkdir -p " + d).c_str());
  for (const char* f : {"ca-cert.pem", "server-cert.pem", "server-key.pem"}) {
    std::ofstream(d + "/" + f) << "x";
  }
  std::ofstream(d + "/keys.psk") << "alice:00ff\nqemu:0102\n";
  EXPECT_EQ(AddError(r, "tls-creds-x509,id=t0,endpoint=server"),
            "Missing 'dir' property value");
  EXPECT_EQ(AddError(r, "tls-creds-x509,id=t0,dir=/nonexistent"),
            "Unable to access credentials /nonexistent/ca-cert.pem: No such "
            "file or directory");
  EXPECT_EQ(AddError(r, "tls-creds-x509,id=t0,dir=" + d + ",endpoint=up"),
            "Parameter 'endpoint' does not accept value 'up'");
  EXPECT_EQ(AddError(r, "tls-creds-x509,id=t0,dir=" + d + ",verify-peer=2"),
            "Parameter 'verify-peer' expects 'on' or 'off'");
  EXPECT_EQ(AddError(r, "tls-creds-x509,id=t0,dir=" + d + ",username=a"),
            "Parameter 'username' is unexpected");
  EXPECT_EQ(AddError(r, "tls-creds-psk,id=t0,dir=" + d +
                            ",endpoint=server,username=a"),
            "username should not be set when endpoint=server");
  EXPECT_EQ(AddError(r, "tls-creds-psk,id=t0,dir=" + d + ",username=bob"),
            "Username bob not found in PSK file " + d + "/keys.psk");
  ASSERT_TRUE(r.AddFromCommandLine("tls-creds-x509,id=x0,dir=" + d +
                                   ",endpoint=server,verify-peer=off")
                  .ok());
  ASSERT_TRUE(r.AddFromCommandLine("tls-creds-psk,id=p0,dir=" + d).ok());
  ASSERT_TRUE(
      r.AddFromCommandLine("tls-creds-psk,id=p1,dir=" + d + ",username=alice")
          .ok());
  absl::StatusOr<ObjectRegistry::TlsCreds> x0 = r.LookupTlsCreds("x0");
  ASSERT_TRUE(x0.ok());
  EXPECT_FALSE(x0->psk);
  EXPECT_TRUE(x0->server);
  EXPECT_FALSE(x0->verify_peer);
  EXPECT_EQ(x0->dir, d);
  EXPECT_TRUE(r.LookupTlsCreds("p0")->psk);
  EXPECT_FALSE(r.LookupTlsCreds("p0")->server);  // endpoint=client default
  EXPECT_EQ(r.LookupTlsCreds("p1")->username, "alice");
  EXPECT_EQ(r.LookupTlsCreds("nope").status().message(),
            "No TLS credentials with id 'nope'");
  ASSERT_TRUE(r.AddFromCommandLine("secret,id=s0,data=x").ok());
  EXPECT_EQ(r.LookupTlsCreds("s0").status().message(),
            "Object with id 's0' is not TLS credentials");
}

}  // namespace
}  // namespace imgtool::block
