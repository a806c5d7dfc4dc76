#include "crypto/provision.h"

#include <optional>
#include <set>
#include <system_error>

#include "base/parallel_for.h"
#include "crypto/revocation.h"

namespace estuary::crypto {

namespace fs = std::filesystem;

Status ProvisionCertificates(const fs::path& dir, const std::vector<std::string>& names, size_t threads,
                             const CertOptions& options) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return IoError("certificates: {}: {}", dir.string(), ec.message());
  if (!fs::exists(dir / "ca.pem")) ESTUARY_RETURN_IF_ERROR(InitCa(dir));
  const std::string wanted = options.role == CertRole::kServer ? "server" : "site";
  std::set<std::string> usable;
  ESTUARY_ASSIGN_OR_RETURN(const std::vector<CertificateStatus> listed, ListCertificates(dir));
  for (const CertificateStatus& cert : listed) {
    if (cert.state == CertificateStatus::State::kValid && cert.role == wanted) usable.insert(cert.name);
  }
  std::vector<std::string> missing;
  for (const std::string& name : names) {
    if (!usable.count(name) || !fs::exists(dir / (name + ".key"))) missing.push_back(name);
  }
  std::vector<Status> issued(missing.size());
  ParallelFor(missing.size(), threads, [&](size_t i) {
    std::error_code ignored;
    fs::remove(dir / (missing[i] + ".pem"), ignored);
    fs::remove(dir / (missing[i] + ".key"), ignored);
    issued[i] = IssueCertificate(dir, missing[i], options);
  });
  for (const Status& s : issued) ESTUARY_RETURN_IF_ERROR(s);
  return Status::Ok();
}

Result<std::vector<std::shared_ptr<const Identity>>> LoadIdentities(const fs::path& dir,
                                                                    const std::vector<std::string>& names,
                                                                    size_t threads) {
  std::vector<std::optional<Result<std::shared_ptr<const Identity>>>> loaded(names.size());
  ParallelFor(names.size(), threads,
              [&](size_t i) { loaded[i] = LoadIdentity(dir / (names[i] + ".pem"), dir / (names[i] + ".key")); });
  std::vector<std::shared_ptr<const Identity>> identities;
  identities.reserve(names.size());
  for (auto& identity : loaded) {
    if (!identity->ok()) return identity->status();
    identities.push_back(**identity);
  }
  return identities;
}

}  // namespace estuary::crypto
