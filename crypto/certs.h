// Certificate provisioning for a federation: one CA, one certificate per site.
//
// Keys are ECDSA P-256, certificates X.509 v3 signed with SHA-256, written as
// PEM with OpenSSL 3 APIs (no shell-out). Key files are created mode 0600.
// A site's identity is the subject common name of its certificate.
#pragma once

#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "base/status.h"

namespace estuary::crypto {

// What a certificate lets its holder be. Each end of a connection checks the
// other's (crypto/tls.h), so a site's certificate cannot serve a federation
// and the server's cannot join one as a site.
enum class CertRole {
  kSite,    // extendedKeyUsage clientAuth; names no host
  kServer,  // extendedKeyUsage serverAuth; subjectAltName: the hosts below
};

struct CertOptions {
  // Validity window relative to now. Tests make expired certificates with a
  // window entirely in the past.
  std::chrono::seconds not_before = std::chrono::seconds(-300);
  std::chrono::seconds not_after = std::chrono::hours(24 * 825);
  CertRole role = CertRole::kSite;
  // The server role only: the DNS names and IP addresses (v4 or v6) sites
  // reach it by. With neither, the loopback ones: localhost, 127.0.0.1, ::1.
  std::vector<std::string> dns = {};
  std::vector<std::string> ips = {};
};

// Creates dir/ca.pem and dir/ca.key (CN = common_name). Refuses to overwrite
// an existing CA.
Status InitCa(const std::filesystem::path& dir, const std::string& common_name = "estuary-ca",
              const CertOptions& options = {.not_before = std::chrono::seconds(-300),
                                            .not_after = std::chrono::hours(24 * 3650)});

// Issues dir/<name>.pem and dir/<name>.key signed by dir/ca.pem + dir/ca.key.
// CN = name; keyUsage digitalSignature; the rest by options.role (CertRole).
// `name` must be [A-Za-z0-9._-]{1,64}; a DNS name must be letters, digits and
// hyphens in dot-separated labels (no wildcard), an IP address a literal one;
// names and addresses for a site are refused.
Status IssueCertificate(const std::filesystem::path& dir, const std::string& name,
                        const CertOptions& options = {});

// As IssueCertificate, but signed by the CA at ca_cert/ca_key and written to
// out_cert/out_key (used for a foreign CA in tests and for custom layouts).
Status IssueCertificateWith(const std::filesystem::path& ca_cert, const std::filesystem::path& ca_key,
                            const std::string& name, const std::filesystem::path& out_cert,
                            const std::filesystem::path& out_key, const CertOptions& options = {});

// Site names become file names: [A-Za-z0-9._-]{1,64}, and not "." or "..".
// Fails with one line naming the name.
Status ValidateSiteName(const std::string& name);

}  // namespace estuary::crypto
