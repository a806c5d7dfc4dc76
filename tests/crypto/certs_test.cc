#include "crypto/certs.h"

#include <gtest/gtest.h>
#include <openssl/bn.h>
#include <openssl/pem.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>

#include <memory>

#include "crypto/openssl_util.h"
#include "test_dir.h"

namespace estuary::crypto {
namespace {

using internal::X509Ptr;
using testing::TempDir;
using testing::WriteText;

X509Ptr LoadCert(const std::filesystem::path& path) {
  auto cert = internal::ReadCertificate(path);
  EXPECT_TRUE(cert.ok()) << cert.status().ToString();
  return cert.ok() ? std::move(cert).value() : nullptr;
}

// Verifies `leaf` against `ca` the way a TLS peer would, for `purpose`.
int Verify(X509* leaf, X509* ca, int purpose) {
  std::unique_ptr<X509_STORE, internal::FreeWith<X509_STORE_free>> store(X509_STORE_new());
  X509_STORE_add_cert(store.get(), ca);
  std::unique_ptr<X509_STORE_CTX, internal::FreeWith<X509_STORE_CTX_free>> ctx(X509_STORE_CTX_new());
  X509_STORE_CTX_init(ctx.get(), store.get(), leaf, nullptr);
  X509_STORE_CTX_set_purpose(ctx.get(), purpose);
  if (X509_verify_cert(ctx.get()) == 1) return X509_V_OK;
  return X509_STORE_CTX_get_error(ctx.get());
}

mode_t ModeOf(const std::filesystem::path& path) {
  struct stat st{};
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return st.st_mode & 0777;
}

TEST(Certs, CaAndLeafVerify) {
  TempDir dir;
  ASSERT_TRUE(InitCa(dir.path()).ok());
  ASSERT_TRUE(IssueCertificate(dir.path(), "site-a").ok());
  X509Ptr ca = LoadCert(dir.path() / "ca.pem");
  X509Ptr leaf = LoadCert(dir.path() / "site-a.pem");
  ASSERT_TRUE(ca && leaf);

  // A site's certificate is for client authentication only and names no host.
  EXPECT_EQ(Verify(leaf.get(), ca.get(), X509_PURPOSE_SSL_CLIENT), X509_V_OK);
  EXPECT_EQ(Verify(leaf.get(), ca.get(), X509_PURPOSE_SSL_SERVER), X509_V_ERR_INVALID_PURPOSE);
  EXPECT_EQ(X509_check_ca(ca.get()), 1);
  EXPECT_EQ(X509_check_ca(leaf.get()), 0);
  EXPECT_EQ(X509_get_version(leaf.get()), X509_VERSION_3);
  EXPECT_EQ(X509_get_signature_nid(leaf.get()), NID_ecdsa_with_SHA256);
  EXPECT_EQ(*internal::CommonName(leaf.get()), "site-a");
  EXPECT_EQ(*internal::CommonName(ca.get()), "estuary-ca");
  EXPECT_EQ(X509_get_ext_by_NID(leaf.get(), NID_subject_alt_name, -1), -1);
  for (const char* host : {"site-a", "localhost"}) {
    EXPECT_EQ(X509_check_host(leaf.get(), host, 0, X509_CHECK_FLAG_NEVER_CHECK_SUBJECT, nullptr), 0) << host;
  }
  EXPECT_EQ(X509_check_ip_asc(leaf.get(), "127.0.0.1", 0), 0);

  const uint32_t usage = X509_get_key_usage(leaf.get());
  EXPECT_TRUE(usage & KU_DIGITAL_SIGNATURE);
  EXPECT_FALSE(usage & KU_KEY_CERT_SIGN);
  EXPECT_TRUE(X509_get_key_usage(ca.get()) & KU_KEY_CERT_SIGN);
  EXPECT_TRUE(X509_get_key_usage(ca.get()) & KU_CRL_SIGN);
  EXPECT_EQ(X509_get_extended_key_usage(leaf.get()), uint32_t{XKU_SSL_CLIENT});

  // Key identifiers chain the leaf to the CA.
  const ASN1_OCTET_STRING* ca_ski = X509_get0_subject_key_id(ca.get());
  const ASN1_OCTET_STRING* leaf_aki = X509_get0_authority_key_id(leaf.get());
  ASSERT_NE(ca_ski, nullptr);
  ASSERT_NE(leaf_aki, nullptr);
  EXPECT_EQ(ASN1_OCTET_STRING_cmp(ca_ski, leaf_aki), 0);
  EXPECT_NE(X509_get0_subject_key_id(leaf.get()), nullptr);

  EXPECT_EQ(ModeOf(dir.path() / "ca.key"), 0600u);
  EXPECT_EQ(ModeOf(dir.path() / "site-a.key"), 0600u);
}

// The server's certificate: server authentication only, for the hosts the
// operator names, or the loopback ones.
TEST(Certs, TheServerRoleNamesItsHostsAndOnlyThem) {
  TempDir dir;
  ASSERT_TRUE(InitCa(dir.path()).ok());
  ASSERT_TRUE(IssueCertificate(dir.path(), "server", {.role = CertRole::kServer}).ok());
  ASSERT_TRUE(IssueCertificate(dir.path(), "named",
                               {.role = CertRole::kServer, .dns = {"fl.example.org", "agg-2.example.org"},
                                .ips = {"10.0.0.5", "fd00::5"}})
                  .ok());
  X509Ptr ca = LoadCert(dir.path() / "ca.pem");
  X509Ptr loopback = LoadCert(dir.path() / "server.pem");
  X509Ptr named = LoadCert(dir.path() / "named.pem");
  ASSERT_TRUE(ca && loopback && named);
  for (X509* cert : {loopback.get(), named.get()}) {
    EXPECT_EQ(Verify(cert, ca.get(), X509_PURPOSE_SSL_SERVER), X509_V_OK);
    EXPECT_EQ(Verify(cert, ca.get(), X509_PURPOSE_SSL_CLIENT), X509_V_ERR_INVALID_PURPOSE);
    EXPECT_EQ(X509_get_extended_key_usage(cert), uint32_t{XKU_SSL_SERVER});
  }
  constexpr unsigned kSanOnly = X509_CHECK_FLAG_NEVER_CHECK_SUBJECT;
  EXPECT_EQ(X509_check_host(loopback.get(), "localhost", 0, kSanOnly, nullptr), 1);
  EXPECT_EQ(X509_check_ip_asc(loopback.get(), "127.0.0.1", 0), 1);
  EXPECT_EQ(X509_check_ip_asc(loopback.get(), "::1", 0), 1);
  EXPECT_EQ(X509_check_host(loopback.get(), "server", 0, kSanOnly, nullptr), 0) << "its name is not a host";

  for (const char* host : {"fl.example.org", "agg-2.example.org", "FL.Example.ORG"}) {
    EXPECT_EQ(X509_check_host(named.get(), host, 0, kSanOnly, nullptr), 1) << host;
  }
  EXPECT_EQ(X509_check_ip_asc(named.get(), "10.0.0.5", 0), 1);
  EXPECT_EQ(X509_check_ip_asc(named.get(), "fd00:0::5", 0), 1);
  for (const char* host : {"localhost", "example.org", "x.fl.example.org", "named"}) {
    EXPECT_EQ(X509_check_host(named.get(), host, 0, kSanOnly, nullptr), 0) << host;
  }
  EXPECT_EQ(X509_check_ip_asc(named.get(), "127.0.0.1", 0), 0) << "given hosts replace the loopback ones";
}

TEST(Certs, HostsAreRefusedForASiteAndMustBeHostsForTheServer) {
  TempDir dir;
  ASSERT_TRUE(InitCa(dir.path()).ok());
  Status site_with_host = IssueCertificate(dir.path(), "site-a", {.dns = {"site-a.example.org"}});
  EXPECT_EQ(site_with_host.code(), Code::kInvalidArgument);
  EXPECT_NE(site_with_host.message().find("a site's certificate names no host"), std::string::npos)
      << site_with_host.message();
  EXPECT_EQ(IssueCertificate(dir.path(), "site-a", {.ips = {"10.0.0.1"}}).code(), Code::kInvalidArgument);
  for (const std::string& bad : std::vector<std::string>{"", "*.example.org", "a..b", "-a.org", "a-.org", "under_score.org", "sp ace",
                                                         "trailing.", "a,DNS:evil.org", "10.0.0.5",
                                                         std::string(64, 'x') + ".org"}) {
    Status status = IssueCertificate(dir.path(), "server", {.role = CertRole::kServer, .dns = {bad}});
    EXPECT_EQ(status.code(), Code::kInvalidArgument) << "'" << bad << "': " << status.ToString();
    EXPECT_NE(status.message().find("'" + bad + "'"), std::string::npos) << status.message();
  }
  for (const char* bad : {"", "10.0.0", "10.0.0.256", "localhost", "::g", "10.0.0.1,IP:10.0.0.2"}) {
    Status status = IssueCertificate(dir.path(), "server", {.role = CertRole::kServer, .ips = {bad}});
    EXPECT_EQ(status.code(), Code::kInvalidArgument) << "'" << bad << "': " << status.ToString();
  }
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "server.key")) << "nothing written for a refused request";
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "site-a.key"));
}

TEST(Certs, KeysAreP256) {
  TempDir dir;
  ASSERT_TRUE(InitCa(dir.path()).ok());
  ASSERT_TRUE(IssueCertificate(dir.path(), "site-a").ok());
  auto key = internal::ReadPrivateKey(dir.path() / "site-a.key");
  ASSERT_TRUE(key.ok()) << key.status().ToString();
  char group[64] = {};
  size_t length = 0;
  ASSERT_EQ(EVP_PKEY_get_group_name(key->get(), group, sizeof(group), &length), 1);
  EXPECT_STREQ(group, "prime256v1");
}

// Keys we issue take the EC decoder's fast path; any other PEM key a site
// brings still loads through the general reader, and an encrypted one is
// refused with the file's name instead of a passphrase prompt.
TEST(Certs, PrivateKeysOfOtherTypesStillLoad) {
  TempDir dir;
  std::unique_ptr<EVP_PKEY, internal::FreeWith<EVP_PKEY_free>> ed25519(EVP_PKEY_Q_keygen(nullptr, nullptr, "ED25519"));
  ASSERT_NE(ed25519, nullptr);
  std::unique_ptr<BIO, internal::FreeWith<BIO_free_all>> plain(BIO_new(BIO_s_mem()));
  ASSERT_EQ(PEM_write_bio_PrivateKey(plain.get(), ed25519.get(), nullptr, nullptr, 0, nullptr, nullptr), 1);
  std::unique_ptr<BIO, internal::FreeWith<BIO_free_all>> locked(BIO_new(BIO_s_mem()));
  char passphrase[] = "secret";
  ASSERT_EQ(PEM_write_bio_PKCS8PrivateKey(locked.get(), ed25519.get(), EVP_aes_256_cbc(), passphrase, 6, nullptr,
                                          nullptr), 1);
  auto text = [](BIO* bio) {
    char* data = nullptr;
    const long size = BIO_get_mem_data(bio, &data);
    return std::string(data, size_t(size));
  };
  WriteText(dir.path() / "ed25519.key", text(plain.get()));
  WriteText(dir.path() / "locked.key", text(locked.get()));

  auto key = internal::ReadPrivateKey(dir.path() / "ed25519.key");
  ASSERT_TRUE(key.ok()) << key.status().ToString();
  EXPECT_EQ(EVP_PKEY_get_base_id(key->get()), EVP_PKEY_ED25519);

  auto refused = internal::ReadPrivateKey(dir.path() / "locked.key");
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("locked.key"), std::string::npos) << refused.status().message();
}

TEST(Certs, SerialsAreRandom128Bit) {
  TempDir dir;
  ASSERT_TRUE(InitCa(dir.path()).ok());
  ASSERT_TRUE(IssueCertificate(dir.path(), "a").ok());
  ASSERT_TRUE(IssueCertificate(dir.path(), "b").ok());
  X509Ptr a = LoadCert(dir.path() / "a.pem");
  X509Ptr b = LoadCert(dir.path() / "b.pem");
  ASSERT_TRUE(a && b);
  EXPECT_NE(ASN1_INTEGER_cmp(X509_get0_serialNumber(a.get()), X509_get0_serialNumber(b.get())), 0);
  std::unique_ptr<BIGNUM, internal::FreeWith<BN_free>> serial(
      ASN1_INTEGER_to_BN(X509_get0_serialNumber(a.get()), nullptr));
  EXPECT_LE(BN_num_bits(serial.get()), 128);
  EXPECT_GT(BN_num_bits(serial.get()), 64);  // fails with probability 2^-64
}

TEST(Certs, RefusesToOverwrite) {
  TempDir dir;
  ASSERT_TRUE(InitCa(dir.path()).ok());
  Status again = InitCa(dir.path());
  EXPECT_EQ(again.code(), Code::kFailedPrecondition);
  EXPECT_NE(again.message().find("ca.pem"), std::string::npos) << again.message();

  ASSERT_TRUE(IssueCertificate(dir.path(), "site-a").ok());
  const auto before = internal::ReadSmallFile(dir.path() / "site-a.pem");
  Status reissue = IssueCertificate(dir.path(), "site-a");
  EXPECT_EQ(reissue.code(), Code::kFailedPrecondition);
  EXPECT_NE(reissue.message().find("site-a.pem"), std::string::npos) << reissue.message();
  EXPECT_EQ(*internal::ReadSmallFile(dir.path() / "site-a.pem"), *before);

  // "ca" as a site name would clobber the CA itself.
  EXPECT_EQ(IssueCertificate(dir.path(), "ca").code(), Code::kFailedPrecondition);

  // A stray key alone is enough to refuse, and is left as it was.
  WriteText(dir.path() / "site-b.key", "keep me");
  EXPECT_EQ(IssueCertificate(dir.path(), "site-b").code(), Code::kFailedPrecondition);
  EXPECT_EQ(*internal::ReadSmallFile(dir.path() / "site-b.key"), "keep me");
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "site-b.pem"));
}

TEST(Certs, RejectsBadNames) {
  TempDir dir;
  ASSERT_TRUE(InitCa(dir.path()).ok());
  for (const std::string& bad : std::vector<std::string>{"", "..", ".", "a/b", "../escape", "sp ace", "semi;colon", "ü",
                                std::string(65, 'x'), std::string("nul\0", 4)}) {
    Status status = IssueCertificate(dir.path(), bad);
    EXPECT_EQ(status.code(), Code::kInvalidArgument) << "name '" << bad << "': " << status.ToString();
  }
  EXPECT_TRUE(IssueCertificate(dir.path(), std::string(64, 'x')).ok());
  EXPECT_TRUE(IssueCertificate(dir.path(), "Site_1.example-org").ok());
  EXPECT_EQ(InitCa(dir.path() / "other", "").code(), Code::kInvalidArgument);
}

TEST(Certs, RejectsEmptyValidityWindow) {
  TempDir dir;
  ASSERT_TRUE(InitCa(dir.path()).ok());
  CertOptions backwards{.not_before = std::chrono::hours(1), .not_after = std::chrono::seconds(0)};
  EXPECT_EQ(IssueCertificate(dir.path(), "x", backwards).code(), Code::kInvalidArgument);
}

TEST(Certs, MissingCaIsNamed) {
  TempDir dir;
  Status status = IssueCertificate(dir.path(), "site-a");
  EXPECT_EQ(status.code(), Code::kNotFound);
  EXPECT_NE(status.message().find((dir.path() / "ca.pem").string()), std::string::npos) << status.message();
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "site-a.key"));
}

TEST(Certs, CorruptCaKeyIsNamed) {
  TempDir dir;
  ASSERT_TRUE(InitCa(dir.path()).ok());
  std::filesystem::remove(dir.path() / "ca.key");
  WriteText(dir.path() / "ca.key", "-----BEGIN PRIVATE KEY-----\nnot base64 at all!!\n-----END PRIVATE KEY-----\n");
  Status status = IssueCertificate(dir.path(), "site-a");
  EXPECT_EQ(status.code(), Code::kInvalidArgument);
  const std::string expected_prefix = "crypto: " + (dir.path() / "ca.key").string() + ": cannot read private key: ";
  EXPECT_EQ(status.message().rfind(expected_prefix, 0), 0u) << status.message();
  EXPECT_EQ(status.message().find('\n'), std::string::npos) << status.message();
}

TEST(Certs, MismatchedCaKeyIsNamed) {
  TempDir dir, other;
  ASSERT_TRUE(InitCa(dir.path()).ok());
  ASSERT_TRUE(InitCa(other.path()).ok());
  Status status = IssueCertificateWith(dir.path() / "ca.pem", other.path() / "ca.key", "site-a",
                                       dir.path() / "site-a.pem", dir.path() / "site-a.key");
  EXPECT_EQ(status.code(), Code::kInvalidArgument);
  EXPECT_NE(status.message().find((other.path() / "ca.key").string() + ": private key does not match"),
            std::string::npos)
      << status.message();
}

TEST(Certs, IssueWithForeignCa) {
  TempDir dir, foreign;
  ASSERT_TRUE(InitCa(dir.path()).ok());
  ASSERT_TRUE(InitCa(foreign.path(), "other-ca").ok());
  ASSERT_TRUE(IssueCertificateWith(foreign.path() / "ca.pem", foreign.path() / "ca.key", "site-a",
                                   dir.path() / "intruder.pem", dir.path() / "intruder.key")
                  .ok());
  X509Ptr ours = LoadCert(dir.path() / "ca.pem");
  X509Ptr theirs = LoadCert(foreign.path() / "ca.pem");
  X509Ptr intruder = LoadCert(dir.path() / "intruder.pem");
  EXPECT_EQ(Verify(intruder.get(), theirs.get(), X509_PURPOSE_SSL_CLIENT), X509_V_OK);
  EXPECT_NE(Verify(intruder.get(), ours.get(), X509_PURPOSE_SSL_CLIENT), X509_V_OK);
}

TEST(Certs, ExpiredWindowVerifiesAsExpired) {
  TempDir dir;
  ASSERT_TRUE(InitCa(dir.path()).ok());
  CertOptions expired{.not_before = -std::chrono::hours(48), .not_after = -std::chrono::hours(24)};
  ASSERT_TRUE(IssueCertificate(dir.path(), "old", expired).ok());
  X509Ptr ca = LoadCert(dir.path() / "ca.pem");
  X509Ptr old = LoadCert(dir.path() / "old.pem");
  EXPECT_EQ(Verify(old.get(), ca.get(), X509_PURPOSE_SSL_CLIENT), X509_V_ERR_CERT_HAS_EXPIRED);
}

}  // namespace
}  // namespace estuary::crypto
