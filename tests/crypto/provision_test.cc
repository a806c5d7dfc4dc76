#include "crypto/provision.h"

#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "crypto/revocation.h"
#include "test_dir.h"

namespace estuary::crypto {
namespace {

using testing::TempDir;

std::vector<std::string> Names(int n) {
  std::vector<std::string> names;
  for (int i = 0; i < n; ++i) names.push_back("site-" + std::to_string(i));
  return names;
}

// name -> (serial, role, state) of what `dir` holds.
std::map<std::string, std::string> Listing(const std::filesystem::path& dir) {
  auto listed = ListCertificates(dir);
  EXPECT_TRUE(listed.ok()) << listed.status().ToString();
  std::map<std::string, std::string> out;
  if (!listed.ok()) return out;
  for (const CertificateStatus& c : *listed) {
    out[c.name] = c.serial + " " + c.role + " " + CertificateStateName(c.state);
  }
  return out;
}

TEST(Provision, IssuesEveryMissingSiteOnThreadsAndKeepsWhatIsThereOnASecondRun) {
  TempDir dir;
  const auto names = Names(9);
  ASSERT_TRUE(ProvisionCertificates(dir.path(), names, 4).ok());
  const auto first = Listing(dir.path());
  ASSERT_EQ(first.size(), names.size());
  for (const auto& name : names) {
    ASSERT_TRUE(first.count(name)) << name;
    EXPECT_NE(first.at(name).find(" site valid"), std::string::npos) << first.at(name);
  }
  ASSERT_TRUE(ProvisionCertificates(dir.path(), names, 4).ok());
  EXPECT_EQ(Listing(dir.path()), first);  // the same serials: nothing reissued
}

TEST(Provision, ACertificateOfTheWrongRoleOrExpiredIsIssuedAnew) {
  TempDir dir;
  ASSERT_TRUE(ProvisionCertificates(dir.path(), {"a", "b", "c"}, 2).ok());
  // "a" becomes a server's certificate, "b" an expired one; "c" stays.
  for (const char* file : {"a.pem", "a.key", "b.pem", "b.key"}) std::filesystem::remove(dir.path() / file);
  Status server = IssueCertificate(dir.path(), "a", {.role = CertRole::kServer});
  ASSERT_TRUE(server.ok()) << server.ToString();
  Status expired =
      IssueCertificate(dir.path(), "b", {.not_before = std::chrono::hours(-48), .not_after = std::chrono::hours(-24)});
  ASSERT_TRUE(expired.ok()) << expired.ToString();
  const auto tampered = Listing(dir.path());
  ASSERT_NE(tampered.at("a").find(" server valid"), std::string::npos) << tampered.at("a");
  ASSERT_NE(tampered.at("b").find(" expired"), std::string::npos) << tampered.at("b");

  ASSERT_TRUE(ProvisionCertificates(dir.path(), {"a", "b", "c"}, 2).ok());
  const auto after = Listing(dir.path());
  EXPECT_NE(after.at("a"), tampered.at("a"));
  EXPECT_NE(after.at("a").find(" site valid"), std::string::npos) << after.at("a");
  EXPECT_NE(after.at("b").find(" site valid"), std::string::npos) << after.at("b");
  EXPECT_EQ(after.at("c"), tampered.at("c"));
}

TEST(Provision, IdentitiesLoadInTheOrderOfTheNamesAndAMissingOneIsNamed) {
  TempDir dir;
  const auto names = Names(6);
  ASSERT_TRUE(ProvisionCertificates(dir.path(), names, 3).ok());
  auto loaded = LoadIdentities(dir.path(), names, 3);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  ASSERT_EQ(loaded->size(), names.size());
  for (const auto& identity : *loaded) EXPECT_NE(identity, nullptr);

  std::filesystem::remove(dir.path() / "site-4.key");
  auto missing = LoadIdentities(dir.path(), names, 3);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("site-4.key"), std::string::npos) << missing.status().ToString();
}

TEST(Provision, AServersCertificateIsNotASitesIdentity) {
  TempDir dir;
  ASSERT_TRUE(ProvisionCertificates(dir.path(), {"server"}, 1, {.role = CertRole::kServer}).ok());
  EXPECT_NE(Listing(dir.path()).at("server").find(" server valid"), std::string::npos);
  auto loaded = LoadIdentities(dir.path(), {"server"}, 1);
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.status().message().find("server.pem"), std::string::npos) << loaded.status().ToString();
}

}  // namespace
}  // namespace estuary::crypto
