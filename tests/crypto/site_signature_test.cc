// Site signatures (crypto/site_signature.h): what a site signs, its peers
// verify against the federation's CA; a signature over other bytes, a
// certificate of another CA, the server's certificate and a revoked one are
// each refused with one line saying which.
#include "crypto/site_signature.h"

#include <gtest/gtest.h>

#include "crypto/certs.h"
#include "crypto/revocation.h"
#include "tests/crypto/test_dir.h"

namespace estuary::crypto {
namespace {

class SiteSignature : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(InitCa(dir()).ok());
    for (const char* site : {"site-a", "site-b"}) ASSERT_TRUE(IssueCertificate(dir(), site).ok());
    ASSERT_TRUE(IssueCertificate(dir(), "server", {.role = CertRole::kServer}).ok());
  }
  const std::filesystem::path& dir() const { return tmp_.path(); }
  TlsFiles Files(const std::string& name, bool with_crl = false) const {
    return {.cert = dir() / (name + ".pem"), .key = dir() / (name + ".key"), .ca = dir() / "ca.pem",
            .crl = with_crl ? dir() / "crl.pem" : std::filesystem::path()};
  }
  SiteSigner Signer(const TlsFiles& files) const {
    auto signer = SiteSigner::FromFiles(files);
    EXPECT_TRUE(signer.ok()) << signer.status().ToString();
    return *signer;
  }
  SiteVerifier Verifier(const TlsFiles& files) const {
    auto verifier = SiteVerifier::FromFiles(files);
    EXPECT_TRUE(verifier.ok()) << verifier.status().ToString();
    return *verifier;
  }

 private:
  testing::TempDir tmp_;
};

TEST_F(SiteSignature, APeerVerifiesWhatASiteSignedAndLearnsWhoSignedIt) {
  const SiteSigner a = Signer(Files("site-a"));
  EXPECT_EQ(a.common_name(), "site-a");
  EXPECT_EQ(CertificateCommonName(a.certificate()).value(), "site-a");
  auto signature = a.Sign("round 3: these keys");
  ASSERT_TRUE(signature.ok()) << signature.status().ToString();
  auto signer = Verifier(Files("site-b")).Verify(a.certificate(), "round 3: these keys", *signature);
  ASSERT_TRUE(signer.ok()) << signer.status().ToString();
  EXPECT_EQ(*signer, "site-a");
}

TEST_F(SiteSignature, OtherBytesOrAnotherKeysSignatureDoNotVerify) {
  const SiteSigner a = Signer(Files("site-a"));
  const SiteSigner b = Signer(Files("site-b"));
  const SiteVerifier verifier = Verifier(Files("site-b"));
  const std::string signature = a.Sign("round 3: these keys").value();
  for (const auto& [certificate, message] :
       {std::pair{a.certificate(), std::string("round 3: other keys")}, std::pair{b.certificate(),
                                                                                  std::string("round 3: these keys")}}) {
    auto signer = verifier.Verify(certificate, message, signature);
    ASSERT_FALSE(signer.ok());
    EXPECT_NE(signer.status().message().find("does not verify"), std::string::npos) << signer.status().message();
  }
  EXPECT_FALSE(verifier.Verify(a.certificate(), "round 3: these keys", "").ok());
}

// The verifier remembers a certificate it checked (a SecAgg+ site meets each
// neighbour's twice a round), never a signature: each is checked every time.
TEST_F(SiteSignature, ARememberedCertificateStillHasEverySignatureChecked) {
  const SiteSigner a = Signer(Files("site-a"));
  const SiteSigner b = Signer(Files("site-b"));
  const SiteVerifier verifier = Verifier(Files("site-b"));
  const std::string signature = a.Sign("round 3: these keys").value();
  ASSERT_TRUE(verifier.Verify(a.certificate(), "round 3: these keys", signature).ok());
  for (const SiteVerifier& v : {verifier, SiteVerifier(verifier)}) {  // a copy shares what was checked
    auto other_bytes = v.Verify(a.certificate(), "round 3: other keys", signature);
    ASSERT_FALSE(other_bytes.ok());
    EXPECT_EQ(other_bytes.status().message(), "crypto: the signature of 'site-a' does not verify");
    EXPECT_FALSE(v.Verify(a.certificate(), "round 3: these keys", b.Sign("round 3: these keys").value()).ok());
    EXPECT_FALSE(v.Verify(a.certificate(), "round 3: these keys", "").ok());
    auto again = v.Verify(a.certificate(), "round 3: these keys", signature);
    ASSERT_TRUE(again.ok()) << again.status().ToString();
    EXPECT_EQ(*again, "site-a");
  }
  // What failed is not remembered as checked: the server's certificate is refused each time.
  const SiteSigner server = Signer(Files("server"));
  for (int i = 0; i < 2; ++i) EXPECT_FALSE(verifier.Verify(server.certificate(), "m", server.Sign("m").value()).ok());
}

TEST_F(SiteSignature, ACertificateOfAnotherCaOrOfTheServerIsRefused) {
  testing::TempDir other;
  ASSERT_TRUE(InitCa(other.path(), "another-ca").ok());
  ASSERT_TRUE(IssueCertificate(other.path(), "site-a").ok());
  const SiteSigner foreign = Signer({.cert = other.path() / "site-a.pem", .key = other.path() / "site-a.key",
                                     .ca = other.path() / "ca.pem"});
  const SiteVerifier verifier = Verifier(Files("site-b"));
  auto signer = verifier.Verify(foreign.certificate(), "m", foreign.Sign("m").value());
  ASSERT_FALSE(signer.ok());
  EXPECT_NE(signer.status().message().find("is not a site certificate of this federation"), std::string::npos)
      << signer.status().message();

  // The server holds a certificate of the federation, but not a site's.
  const SiteSigner server = Signer(Files("server"));
  signer = verifier.Verify(server.certificate(), "m", server.Sign("m").value());
  ASSERT_FALSE(signer.ok());
  EXPECT_NE(signer.status().message().find("'server'"), std::string::npos) << signer.status().message();

  EXPECT_FALSE(verifier.Verify("not a certificate", "m", "s").ok());
}

TEST_F(SiteSignature, ARevokedSiteIsRefusedWhereTheVerifierHasTheList) {
  ASSERT_TRUE(RevokeCertificate(dir(), "site-a").ok());
  const SiteSigner a = Signer(Files("site-a"));
  const std::string signature = a.Sign("m").value();
  EXPECT_TRUE(Verifier(Files("site-b")).Verify(a.certificate(), "m", signature).ok()) << "no list: not checked";
  auto signer = Verifier(Files("site-b", true)).Verify(a.certificate(), "m", signature);
  ASSERT_FALSE(signer.ok());
  EXPECT_NE(signer.status().message().find("revoked"), std::string::npos) << signer.status().message();
}

}  // namespace
}  // namespace estuary::crypto
