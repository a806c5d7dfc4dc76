// The federation's revocation list: what RevokeCertificate and RenewCrl
// write, read back by OpenSSL itself (a verification with CRL checking
// refuses exactly the revoked certificate), and the refusals of bad input,
// each one line naming the file.
#include "crypto/revocation.h"

#include <gtest/gtest.h>
#include <openssl/pem.h>
#include <openssl/x509v3.h>

#include <ctime>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>

#include "crypto/certs.h"
#include "crypto/openssl_util.h"
#include "test_dir.h"

namespace estuary::crypto {
namespace {

using internal::X509Ptr;
using testing::TempDir;
using testing::WriteText;

// A CRL's validity window in days.
double DaysValid(const CrlInfo& info) {
  return std::chrono::duration<double>(info.next_update - info.last_update).count() / 86400.0;
}

std::string ReadText(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

// OpenSSL's verdict on `leaf` against the CA with the CRL checked.
int VerifyWithCrl(const std::filesystem::path& dir, const std::string& leaf) {
  auto ca = internal::ReadCertificate(dir / "ca.pem");
  auto cert = internal::ReadCertificate(dir / (leaf + ".pem"));
  auto crl = internal::ReadCrlFile(dir / "crl.pem");
  EXPECT_TRUE(ca.ok() && cert.ok() && crl.ok());
  if (!ca.ok() || !cert.ok() || !crl.ok()) return -1;
  std::unique_ptr<X509_STORE, internal::FreeWith<X509_STORE_free>> store(X509_STORE_new());
  X509_STORE_add_cert(store.get(), ca->get());
  X509_STORE_add_crl(store.get(), crl->get());
  X509_STORE_set_flags(store.get(), X509_V_FLAG_CRL_CHECK);
  std::unique_ptr<X509_STORE_CTX, internal::FreeWith<X509_STORE_CTX_free>> ctx(X509_STORE_CTX_new());
  X509_STORE_CTX_init(ctx.get(), store.get(), cert->get(), nullptr);
  if (X509_verify_cert(ctx.get()) == 1) return X509_V_OK;
  return X509_STORE_CTX_get_error(ctx.get());
}

void ExpectOneLine(const Status& status, const std::string& needle) {
  ASSERT_FALSE(status.ok()) << "expected a refusal mentioning '" << needle << "'";
  EXPECT_NE(status.message().find(needle), std::string::npos) << status.message();
  EXPECT_EQ(status.message().find('\n'), std::string::npos) << status.message();
}

class Revocation : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(InitCa(dir()).ok());
    for (const char* name : {"site-a", "site-b", "site-c"}) ASSERT_TRUE(IssueCertificate(dir(), name).ok());
  }
  const std::filesystem::path& dir() const { return dir_.path(); }
  std::string Serial(const std::string& name) {
    auto serial = CertificateSerial(dir() / (name + ".pem"));
    EXPECT_TRUE(serial.ok()) << serial.status().ToString();
    return serial.ok() ? *serial : "";
  }
  CrlInfo Read() {
    auto info = ReadCrl(dir() / "crl.pem", dir() / "ca.pem");
    EXPECT_TRUE(info.ok()) << info.status().ToString();
    return info.ok() ? *info : CrlInfo{};
  }
  TempDir dir_;
};

TEST_F(Revocation, ARevokedCertificateFailsVerificationAndTheOthersDoNot) {
  auto revoked = RevokeCertificate(dir(), "site-b", RevocationReason::kKeyCompromise);
  ASSERT_TRUE(revoked.ok()) << revoked.status().ToString();
  EXPECT_TRUE(*revoked);
  const CrlInfo info = Read();
  EXPECT_EQ(info.number, 1u);
  ASSERT_EQ(info.revoked.size(), 1u);
  EXPECT_EQ(info.revoked[0].serial, Serial("site-b"));
  EXPECT_EQ(info.revoked[0].reason, RevocationReason::kKeyCompromise);
  EXPECT_LE(std::chrono::abs(info.revoked[0].revoked_at - std::chrono::system_clock::now()), std::chrono::minutes(1));
  EXPECT_TRUE(info.Revokes(Serial("site-b")));
  EXPECT_FALSE(info.Revokes(Serial("site-a")));
  // 365 days by default.
  EXPECT_NEAR(DaysValid(info), 365, 1e-3);
  // OpenSSL, reading the file we wrote, agrees.
  EXPECT_EQ(VerifyWithCrl(dir(), "site-b"), X509_V_ERR_CERT_REVOKED);
  EXPECT_EQ(VerifyWithCrl(dir(), "site-a"), X509_V_OK);
  EXPECT_EQ(VerifyWithCrl(dir(), "site-c"), X509_V_OK);
}

TEST_F(Revocation, RevokingAgainChangesNothingAndEachChangeIsNumbered) {
  ASSERT_TRUE(RevokeCertificate(dir(), "site-b").ok());
  const std::string first = ReadText(dir() / "crl.pem");
  auto again = RevokeCertificate(dir(), "site-b", RevocationReason::kSuperseded);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_FALSE(*again);
  EXPECT_EQ(ReadText(dir() / "crl.pem"), first) << "the file is left as it was";

  auto second = RevokeCertificate(dir(), "site-c", RevocationReason::kCessationOfOperation);
  ASSERT_TRUE(second.ok() && *second);
  CrlInfo info = Read();
  EXPECT_EQ(info.number, 2u);
  ASSERT_EQ(info.revoked.size(), 2u);
  EXPECT_TRUE(info.Revokes(Serial("site-b")) && info.Revokes(Serial("site-c")));
  EXPECT_EQ(VerifyWithCrl(dir(), "site-b"), X509_V_ERR_CERT_REVOKED);
  EXPECT_EQ(VerifyWithCrl(dir(), "site-c"), X509_V_ERR_CERT_REVOKED);
  EXPECT_EQ(VerifyWithCrl(dir(), "site-a"), X509_V_OK);

  // Renewing keeps the entries, moves the window, and counts on.
  ASSERT_TRUE(RenewCrl(dir(), {.valid_for = std::chrono::hours(24 * 30)}).ok());
  info = Read();
  EXPECT_EQ(info.number, 3u);
  EXPECT_EQ(info.revoked.size(), 2u);
  EXPECT_NEAR(DaysValid(info), 30, 1e-3);
  for (const auto& entry : std::filesystem::directory_iterator(dir())) {
    EXPECT_EQ(entry.path().filename().string().rfind(".crl.pem", 0), std::string::npos) << "a temporary left behind";
  }
}

TEST_F(Revocation, RenewingWithoutAListWritesAnEmptyOne) {
  ASSERT_TRUE(RenewCrl(dir()).ok());
  const CrlInfo info = Read();
  EXPECT_EQ(info.number, 1u);
  EXPECT_TRUE(info.revoked.empty());
  EXPECT_EQ(VerifyWithCrl(dir(), "site-a"), X509_V_OK);
}

TEST_F(Revocation, AListValidPastTheClocksRangeIsReadAsValid) {
  // Found by fuzzing (fuzz/corpus/crl/regress_time_past_2262): a nextUpdate
  // past 2262 overflowed system_clock's nanoseconds in from_time_t (undefined;
  // in practice a date before 1970, so the list was refused as expired).
  ASSERT_TRUE(RenewCrl(dir(), {.valid_for = std::chrono::hours(24 * 365 * 400)}).ok());
  const CrlInfo info = Read();
  EXPECT_GT(info.next_update, std::chrono::system_clock::now() + std::chrono::hours(24 * 365 * 80));
  EXPECT_GT(DaysValid(info), 365 * 80);
}

TEST_F(Revocation, BadRequestsAreRefusedInOneLine) {
  ExpectOneLine(RevokeCertificate(dir(), "site-z").status(), (dir() / "site-z.pem").string() + ": no such file");
  ExpectOneLine(RevokeCertificate(dir(), "../site-a").status(), "'../site-a'");
  ExpectOneLine(ParseRevocationReason("bored").status(), "'bored'");
  // A certificate of another CA copied into the directory.
  TempDir foreign;
  ASSERT_TRUE(InitCa(foreign.path(), "foreign-ca").ok());
  ASSERT_TRUE(IssueCertificate(foreign.path(), "site-x").ok());
  std::filesystem::copy_file(foreign.path() / "site-x.pem", dir() / "site-x.pem");
  ExpectOneLine(RevokeCertificate(dir(), "site-x").status(), "not issued by");
  EXPECT_FALSE(std::filesystem::exists(dir() / "crl.pem")) << "nothing was written";
  // Another CA's list in our directory is not extended.
  ASSERT_TRUE(RevokeCertificate(foreign.path(), "site-x").ok());
  std::filesystem::copy_file(foreign.path() / "crl.pem", dir() / "crl.pem");
  ExpectOneLine(RevokeCertificate(dir(), "site-a").status(), "not signed by");
  ExpectOneLine(ReadCrl(dir() / "crl.pem", dir() / "ca.pem").status(), "not issued and signed by the CA");
  ExpectOneLine(RenewCrl(dir(), {.valid_for = std::chrono::seconds(0)}), "not signed by");
  std::filesystem::remove(dir() / "crl.pem");
  ExpectOneLine(RenewCrl(dir(), {.valid_for = std::chrono::seconds(0)}), "positive");
}

// The operator's list: every certificate's state against the CA and its list.
TEST_F(Revocation, ListCertificatesSaysWhichAreValidExpiredRevokedOrForeign) {
  ASSERT_TRUE(IssueCertificate(dir(), "server", {.role = CertRole::kServer}).ok());
  ASSERT_TRUE(IssueCertificate(dir(), "site-old", {.not_before = -std::chrono::hours(48),
                                                   .not_after = -std::chrono::hours(24)})
                  .ok());
  TempDir foreign;
  ASSERT_TRUE(InitCa(foreign.path(), "foreign-ca").ok());
  ASSERT_TRUE(IssueCertificate(foreign.path(), "site-x").ok());
  std::filesystem::copy_file(foreign.path() / "site-x.pem", dir() / "site-x.pem");
  auto before = ListCertificates(dir());  // no list yet: nothing revoked
  ASSERT_TRUE(before.ok()) << before.status().ToString();
  ASSERT_TRUE(RevokeCertificate(dir(), "site-b", RevocationReason::kAffiliationChanged).ok());
  auto listed = ListCertificates(dir());
  ASSERT_TRUE(listed.ok()) << listed.status().ToString();
  std::map<std::string, CertificateStatus> by_name;
  for (const auto& c : *listed) by_name[c.name] = c;
  ASSERT_EQ(by_name.size(), 6u);
  EXPECT_EQ(by_name["site-a"].state, CertificateStatus::State::kValid);
  EXPECT_EQ(by_name["site-b"].state, CertificateStatus::State::kRevoked);
  ASSERT_TRUE(by_name["site-b"].revocation.has_value());
  EXPECT_EQ(by_name["site-b"].revocation->reason, RevocationReason::kAffiliationChanged);
  EXPECT_EQ(by_name["site-b"].serial, Serial("site-b"));
  EXPECT_EQ(by_name["site-c"].state, CertificateStatus::State::kValid);
  EXPECT_EQ(by_name["site-old"].state, CertificateStatus::State::kExpired);
  EXPECT_EQ(by_name["site-x"].state, CertificateStatus::State::kForeign);
  for (const auto& [name, c] : by_name) {
    EXPECT_EQ(c.role, name == "server" ? "server" : "site") << name;
    const std::vector<std::string> hosts =
        name == "server" ? std::vector<std::string>{"localhost", "127.0.0.1", "::1"} : std::vector<std::string>{};
    EXPECT_EQ(c.hosts, hosts) << name;
  }
  for (const auto& c : *before) EXPECT_NE(c.state, CertificateStatus::State::kRevoked) << c.name;
  EXPECT_EQ(listed->front().name, "server") << "sorted by name";
  // A file that is not a certificate is named.
  WriteText(dir() / "notes.pem", "not a certificate\n");
  ExpectOneLine(ListCertificates(dir()).status(), (dir() / "notes.pem").string());
}

TEST_F(Revocation, ReadCrlRefusesTamperedGarbledAndExpiredLists) {
  ASSERT_TRUE(RevokeCertificate(dir(), "site-b").ok());
  const auto path = dir() / "crl.pem";
  // Tampered: the revoked serial edited in the signed body (as if to free
  // site-b), the CA's signature left as it was.
  {
    auto crl = internal::ReadCrlFile(path);
    ASSERT_TRUE(crl.ok());
    unsigned char* der = nullptr;
    const int length = i2d_X509_CRL(crl->get(), &der);
    ASSERT_GT(length, 0);
    std::string bytes(reinterpret_cast<char*>(der), size_t(length));
    OPENSSL_free(der);
    const ASN1_INTEGER* serial = X509_REVOKED_get0_serialNumber(sk_X509_REVOKED_value(X509_CRL_get_REVOKED(crl->get()), 0));
    const std::string serial_bytes(reinterpret_cast<const char*>(ASN1_STRING_get0_data(serial)),
                                   size_t(ASN1_STRING_length(serial)));
    const size_t at = bytes.find(serial_bytes);
    ASSERT_NE(at, std::string::npos);
    bytes[at + serial_bytes.size() - 1] ^= 0x01;
    const unsigned char* in = reinterpret_cast<const unsigned char*>(bytes.data());
    internal::CrlPtr edited(d2i_X509_CRL(nullptr, &in, long(bytes.size())));
    ASSERT_TRUE(edited);
    internal::BioPtr bio(BIO_new(BIO_s_mem()));
    ASSERT_EQ(PEM_write_bio_X509_CRL(bio.get(), edited.get()), 1);
    char* data = nullptr;
    const long size = BIO_get_mem_data(bio.get(), &data);
    WriteText(dir() / "tampered.pem", std::string(data, size_t(size)));
  }
  ExpectOneLine(ReadCrl(dir() / "tampered.pem", dir() / "ca.pem").status(), "not issued and signed by the CA");
  WriteText(dir() / "garbled.pem", "-----BEGIN X509 CRL-----\nAAAA\n-----END X509 CRL-----\n");
  ExpectOneLine(ReadCrl(dir() / "garbled.pem", dir() / "ca.pem").status(),
                (dir() / "garbled.pem").string() + ": cannot read a certificate revocation list");
  ExpectOneLine(ReadCrl(dir() / "ca.pem", dir() / "ca.pem").status(), "cannot read a certificate revocation list");
  ExpectOneLine(ReadCrl(dir() / "none.pem", dir() / "ca.pem").status(), "no such file");
  // Expired: a list the CA signed whose next update has passed.
  {
    auto crl = internal::ReadCrlFile(path);
    auto key = internal::ReadPrivateKey(dir() / "ca.key");
    ASSERT_TRUE(crl.ok() && key.ok());
    std::unique_ptr<ASN1_TIME, internal::FreeWith<ASN1_TIME_free>> past(ASN1_TIME_set(nullptr, std::time(nullptr) - 3600));
    ASSERT_EQ(X509_CRL_set1_nextUpdate(crl->get(), past.get()), 1);
    ASSERT_GT(X509_CRL_sign(crl->get(), key->get(), EVP_sha256()), 0);
    internal::BioPtr bio(BIO_new(BIO_s_mem()));
    ASSERT_EQ(PEM_write_bio_X509_CRL(bio.get(), crl->get()), 1);
    char* data = nullptr;
    const long size = BIO_get_mem_data(bio.get(), &data);
    WriteText(path, std::string(data, size_t(size)));
  }
  ExpectOneLine(ReadCrl(path, dir() / "ca.pem").status(), "past its next update");
  // Renewing is the way out, and keeps the entry.
  ASSERT_TRUE(RenewCrl(dir()).ok());
  const CrlInfo info = Read();
  EXPECT_TRUE(info.Revokes(Serial("site-b")));
  EXPECT_EQ(info.number, 2u);
}

}  // namespace
}  // namespace estuary::crypto
