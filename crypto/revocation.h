// Revoking a site: the federation CA's certificate revocation list (CRL,
// RFC 5280 v2) at DIR/crl.pem.
//
// A site that leaves the federation, or whose key may have leaked, is revoked
// by the serial number of its certificate; the server checks every client
// certificate against the CRL it was given (`serve --crl`) and rereads it on
// SIGHUP (server/server.h). RevokeCertificate adds DIR/<name>.pem's serial,
// re-signs the list with DIR/ca.key, increments its CRL number and replaces
// the file atomically (WriteFileAtomically: a reader sees the old list or the
// new one); revoking a
// serial twice changes nothing and says so. RenewCrl re-signs the list as it
// is (creating an empty one) with a fresh validity window: OpenSSL fails
// every handshake once a CRL is past its next update, so ReadCrl refuses such
// a file and the server warns while one is near it.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"

namespace estuary::crypto {

// RFC 5280's reason codes that apply to a site's certificate.
enum class RevocationReason { kUnspecified, kKeyCompromise, kAffiliationChanged, kSuperseded, kCessationOfOperation };
// "unspecified", "keyCompromise", "affiliationChanged", "superseded", "cessationOfOperation".
const char* RevocationReasonName(RevocationReason reason);
Result<RevocationReason> ParseRevocationReason(const std::string& name);

struct CrlOptions {
  // From now to the CRL's next update.
  std::chrono::seconds valid_for = std::chrono::hours(24 * 365);
};

struct RevokedCertificate {
  std::string serial;  // lowercase hex, no leading zeros
  std::chrono::system_clock::time_point revoked_at;
  RevocationReason reason = RevocationReason::kUnspecified;
};

struct CrlInfo {
  uint64_t number = 0;  // the CRL number: one more with every change
  std::chrono::system_clock::time_point last_update, next_update;
  std::vector<RevokedCertificate> revoked;  // ascending serials
  bool Revokes(const std::string& serial) const;
};

// Adds the serial of dir/<name>.pem (which dir/ca.pem must have issued) to
// dir/crl.pem, signed by dir/ca.key. Returns false when that serial was
// already revoked (the file is left as it was).
Result<bool> RevokeCertificate(const std::filesystem::path& dir, const std::string& name,
                               RevocationReason reason = RevocationReason::kUnspecified,
                               const CrlOptions& options = {});

// Re-signs dir/crl.pem (an empty list if there is none) valid from now for
// options.valid_for.
Status RenewCrl(const std::filesystem::path& dir, const CrlOptions& options = {});

// Reads a CRL and checks it against the CA certificate(s) in `ca`: PEM, v2,
// issued and signed by that CA, and not past its next update. Each problem is
// one line naming the file.
Result<CrlInfo> ReadCrl(const std::filesystem::path& crl, const std::filesystem::path& ca);

// What an operator needs to know of each certificate in a CA directory.
struct CertificateStatus {
  std::string name;    // the file's stem: the site's name
  std::string serial;  // as CrlInfo writes serials
  std::chrono::system_clock::time_point not_after;
  enum class State { kValid, kExpired, kRevoked, kForeign } state = State::kValid;  // foreign: not dir/ca.pem's
  std::optional<RevokedCertificate> revocation;  // when revoked
  // What its extendedKeyUsage states (crypto/certs.h CertRole): "site"
  // (clientAuth only), "server" (serverAuth only), "both" (issued before
  // roles: neither end accepts it any more) or "none".
  std::string role;
  std::vector<std::string> hosts;  // its subjectAltName: "localhost", "10.0.0.5", ...
};
const char* CertificateStateName(CertificateStatus::State state);  // "valid", "expired", "revoked", "foreign"

// Every certificate dir/<name>.pem (besides ca.pem and crl.pem) against
// dir/ca.pem and, when there is one, dir/crl.pem (checked as ReadCrl checks
// it), sorted by name. An unreadable file or list fails, naming it.
Result<std::vector<CertificateStatus>> ListCertificates(const std::filesystem::path& dir);

// The serial number of a certificate file's first certificate, as CrlInfo
// writes serials.
Result<std::string> CertificateSerial(const std::filesystem::path& cert);

}  // namespace estuary::crypto
