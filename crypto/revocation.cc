#include "crypto/revocation.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509v3.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <memory>

#include "base/atomic_file.h"
#include "base/utc.h"
#include "crypto/certs.h"
#include "crypto/openssl_util.h"

namespace estuary::crypto {
namespace {

using internal::CrlPtr;
using internal::FreeWith;
using internal::PkeyPtr;
using internal::TakeOpenSslErrors;
using internal::X509Ptr;
using RevokedPtr = std::unique_ptr<X509_REVOKED, FreeWith<X509_REVOKED_free>>;
using TimePtr = std::unique_ptr<ASN1_TIME, FreeWith<ASN1_TIME_free>>;
using IntegerPtr = std::unique_ptr<ASN1_INTEGER, FreeWith<ASN1_INTEGER_free>>;
using EnumeratedPtr = std::unique_ptr<ASN1_ENUMERATED, FreeWith<ASN1_ENUMERATED_free>>;
using ExtensionPtr = std::unique_ptr<X509_EXTENSION, FreeWith<X509_EXTENSION_free>>;
using Clock = std::chrono::system_clock;

struct ReasonCode {
  RevocationReason reason;
  const char* name;
  int code;  // CRLReason (RFC 5280 5.3.1)
};
constexpr ReasonCode kReasons[] = {
    {RevocationReason::kUnspecified, "unspecified", 0},
    {RevocationReason::kKeyCompromise, "keyCompromise", 1},
    {RevocationReason::kAffiliationChanged, "affiliationChanged", 3},
    {RevocationReason::kSuperseded, "superseded", 4},
    {RevocationReason::kCessationOfOperation, "cessationOfOperation", 5},
};

Result<Clock::time_point> TimeOf(const ASN1_TIME* time, const std::filesystem::path& path, const char* what) {
  std::tm tm{};
  if (time == nullptr || ASN1_TIME_to_tm(time, &tm) != 1) {
    return InvalidArgument("crypto: {}: {} is missing or unreadable", path.string(), what);
  }
  // ASN.1 times run from year 0 to 9999 (RFC 5280 even writes 99991231235959Z
  // for "no expiry"), but the clock's nanoseconds end in 2262: a time outside
  // [1970, ~2116] is taken as the nearer end of that range, so that neither
  // the conversion nor a later `time - now` can overflow.
  constexpr time_t kLast = std::chrono::duration_cast<std::chrono::seconds>(Clock::duration::max()).count() / 2;
  const time_t seconds = std::clamp<time_t>(timegm(&tm), 0, kLast);
  return Clock::time_point(std::chrono::seconds(seconds));
}

// The federation's CA and its key, checked to belong together.
struct Ca {
  X509Ptr cert;
  PkeyPtr key;
};
Result<Ca> LoadCa(const std::filesystem::path& dir) {
  const auto cert_path = dir / "ca.pem", key_path = dir / "ca.key";
  Ca ca;
  ESTUARY_ASSIGN_OR_RETURN(ca.cert, internal::ReadCertificate(cert_path));
  ESTUARY_ASSIGN_OR_RETURN(ca.key, internal::ReadPrivateKey(key_path));
  ESTUARY_RETURN_IF_ERROR(internal::CheckKeyMatches(ca.cert.get(), ca.key.get(), cert_path, key_path));
  return ca;
}

// Whether `ca` issued `cert`: its name as the issuer, and its key's signature.
bool IssuedBy(X509* cert, X509* ca) {
  EVP_PKEY* key = X509_get0_pubkey(ca);
  const bool ok = X509_check_issued(ca, cert) == X509_V_OK && key != nullptr && X509_verify(cert, key) == 1;
  ERR_clear_error();
  return ok;
}

bool SignedBy(X509_CRL* crl, X509* ca) {
  if (X509_NAME_cmp(X509_CRL_get_issuer(crl), X509_get_subject_name(ca)) != 0) return false;
  EVP_PKEY* key = X509_get0_pubkey(ca);
  const bool ok = key != nullptr && X509_CRL_verify(crl, key) == 1;
  ERR_clear_error();
  return ok;
}

Result<CrlInfo> Describe(X509_CRL* crl, const std::filesystem::path& path) {
  CrlInfo info;
  ESTUARY_ASSIGN_OR_RETURN(info.last_update, TimeOf(X509_CRL_get0_lastUpdate(crl), path, "lastUpdate"));
  ESTUARY_ASSIGN_OR_RETURN(info.next_update, TimeOf(X509_CRL_get0_nextUpdate(crl), path, "nextUpdate"));
  IntegerPtr number(static_cast<ASN1_INTEGER*>(X509_CRL_get_ext_d2i(crl, NID_crl_number, nullptr, nullptr)));
  uint64_t value = 0;
  if (!number || ASN1_INTEGER_get_uint64(&value, number.get()) != 1) {
    ERR_clear_error();
    return InvalidArgument("crypto: {}: the CRL has no readable CRL number", path.string());
  }
  info.number = value;
  const STACK_OF(X509_REVOKED)* entries = X509_CRL_get_REVOKED(crl);
  for (int i = 0; i < sk_X509_REVOKED_num(entries); ++i) {
    const X509_REVOKED* entry = sk_X509_REVOKED_value(entries, i);
    RevokedCertificate r;
    r.serial = internal::SerialHex(X509_REVOKED_get0_serialNumber(entry));
    ESTUARY_ASSIGN_OR_RETURN(r.revoked_at, TimeOf(X509_REVOKED_get0_revocationDate(entry), path, "revocationDate"));
    EnumeratedPtr code(
        static_cast<ASN1_ENUMERATED*>(X509_REVOKED_get_ext_d2i(entry, NID_crl_reason, nullptr, nullptr)));
    if (code) {
      const long written = ASN1_ENUMERATED_get(code.get());
      for (const ReasonCode& reason : kReasons) {
        if (reason.code == written) r.reason = reason.reason;
      }
    }
    info.revoked.push_back(std::move(r));
  }
  ERR_clear_error();
  return info;
}

// Signs a CRL of `entries` (copied), numbered `number`, valid from now, and
// writes it to dir/crl.pem.
Status WriteCrl(const std::filesystem::path& dir, const Ca& ca, const STACK_OF(X509_REVOKED) * old_entries,
                X509_REVOKED* added, uint64_t number, const CrlOptions& options) {
  if (options.valid_for <= std::chrono::seconds(0)) {
    return InvalidArgument("crypto: a CRL must be valid for a positive time, not {} s", options.valid_for.count());
  }
  CrlPtr crl(X509_CRL_new());
  const time_t now = std::time(nullptr);
  TimePtr last(ASN1_TIME_set(nullptr, now)), next(ASN1_TIME_set(nullptr, now + options.valid_for.count()));
  IntegerPtr crl_number(ASN1_INTEGER_new());
  bool ok = crl && last && next && crl_number && X509_CRL_set_version(crl.get(), X509_CRL_VERSION_2) == 1 &&
            X509_CRL_set_issuer_name(crl.get(), X509_get_subject_name(ca.cert.get())) == 1 &&
            X509_CRL_set1_lastUpdate(crl.get(), last.get()) == 1 && X509_CRL_set1_nextUpdate(crl.get(), next.get()) == 1 &&
            ASN1_INTEGER_set_uint64(crl_number.get(), number) == 1 &&
            X509_CRL_add1_ext_i2d(crl.get(), NID_crl_number, crl_number.get(), 0, 0) == 1;
  for (int i = 0; ok && i < sk_X509_REVOKED_num(old_entries); ++i) {
    RevokedPtr copy(X509_REVOKED_dup(sk_X509_REVOKED_value(old_entries, i)));
    ok = copy && X509_CRL_add0_revoked(crl.get(), copy.get()) == 1;
    if (ok) copy.release();
  }
  if (ok && added != nullptr) {
    RevokedPtr copy(X509_REVOKED_dup(added));
    ok = copy && X509_CRL_add0_revoked(crl.get(), copy.get()) == 1;
    if (ok) copy.release();
  }
  if (!ok) return Internal("crypto: cannot fill the CRL's fields: {}", TakeOpenSslErrors());
  // RFC 5280 asks for the authority key identifier: which CA key signed it.
  X509V3_CTX ctx;
  X509V3_set_ctx(&ctx, ca.cert.get(), nullptr, nullptr, crl.get(), 0);
  ExtensionPtr aki(X509V3_EXT_conf_nid(nullptr, &ctx, NID_authority_key_identifier, "keyid:always"));
  if (!aki || X509_CRL_add_ext(crl.get(), aki.get(), -1) != 1) {
    return Internal("crypto: cannot add the CRL's authority key identifier: {}", TakeOpenSslErrors());
  }
  if (X509_CRL_sort(crl.get()) != 1 || X509_CRL_sign(crl.get(), ca.key.get(), EVP_sha256()) <= 0) {
    return Internal("crypto: cannot sign the CRL: {}", TakeOpenSslErrors());
  }
  internal::BioPtr bio(BIO_new(BIO_s_mem()));
  if (!bio || PEM_write_bio_X509_CRL(bio.get(), crl.get()) != 1) {
    return Internal("crypto: cannot encode the CRL: {}", TakeOpenSslErrors());
  }
  char* data = nullptr;
  const long size = BIO_get_mem_data(bio.get(), &data);
  return WriteFileAtomically(dir / "crl.pem", std::string_view(data, size_t(size)));
}

// dir/crl.pem as the CA signed it, or none yet. Its next update may be past:
// renewing such a list is the way out.
Result<CrlPtr> ExistingCrl(const std::filesystem::path& dir, const Ca& ca) {
  const auto path = dir / "crl.pem";
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return CrlPtr();
  ESTUARY_ASSIGN_OR_RETURN(CrlPtr crl, internal::ReadCrlFile(path));
  if (!SignedBy(crl.get(), ca.cert.get())) {
    return InvalidArgument("crypto: {}: not signed by {}; refusing to extend another CA's list", path.string(),
                           (dir / "ca.pem").string());
  }
  return crl;
}

Result<uint64_t> NumberOf(X509_CRL* crl, const std::filesystem::path& path) {
  if (!crl) return uint64_t{0};
  ESTUARY_ASSIGN_OR_RETURN(const CrlInfo info, Describe(crl, path));
  return info.number;
}

}  // namespace

const char* RevocationReasonName(RevocationReason reason) {
  for (const ReasonCode& r : kReasons) {
    if (r.reason == reason) return r.name;
  }
  return "unspecified";
}

Result<RevocationReason> ParseRevocationReason(const std::string& name) {
  std::string known;
  for (const ReasonCode& r : kReasons) {
    if (name == r.name) return r.reason;
    known += known.empty() ? r.name : fmt::format(", {}", r.name);
  }
  return InvalidArgument("crypto: revocation reason '{}': expected one of {}", name, known);
}

bool CrlInfo::Revokes(const std::string& serial) const {
  return std::any_of(revoked.begin(), revoked.end(), [&](const RevokedCertificate& r) { return r.serial == serial; });
}

Result<bool> RevokeCertificate(const std::filesystem::path& dir, const std::string& name, RevocationReason reason,
                               const CrlOptions& options) {
  ESTUARY_RETURN_IF_ERROR(ValidateSiteName(name));
  ESTUARY_ASSIGN_OR_RETURN(const Ca ca, LoadCa(dir));
  const auto cert_path = dir / (name + ".pem");
  ESTUARY_ASSIGN_OR_RETURN(X509Ptr cert, internal::ReadCertificate(cert_path));
  if (!IssuedBy(cert.get(), ca.cert.get())) {
    return InvalidArgument("crypto: {}: not issued by {}; only the federation CA's certificates can be revoked",
                           cert_path.string(), (dir / "ca.pem").string());
  }
  ESTUARY_ASSIGN_OR_RETURN(CrlPtr old, ExistingCrl(dir, ca));
  const ASN1_INTEGER* serial = X509_get0_serialNumber(cert.get());
  X509_REVOKED* found = nullptr;
  if (old && X509_CRL_get0_by_serial(old.get(), &found, serial) == 1) return false;
  ERR_clear_error();
  ESTUARY_ASSIGN_OR_RETURN(const uint64_t number, NumberOf(old.get(), dir / "crl.pem"));

  RevokedPtr entry(X509_REVOKED_new());
  TimePtr now(ASN1_TIME_set(nullptr, std::time(nullptr)));
  IntegerPtr serial_copy(ASN1_INTEGER_dup(serial));
  bool ok = entry && now && serial_copy && X509_REVOKED_set_serialNumber(entry.get(), serial_copy.get()) == 1 &&
            X509_REVOKED_set_revocationDate(entry.get(), now.get()) == 1;
  if (ok && reason != RevocationReason::kUnspecified) {
    // RFC 5280: the reason code is left out rather than written as unspecified.
    EnumeratedPtr code(ASN1_ENUMERATED_new());
    int value = 0;
    for (const ReasonCode& r : kReasons) {
      if (r.reason == reason) value = r.code;
    }
    ok = code && ASN1_ENUMERATED_set(code.get(), value) == 1 &&
         X509_REVOKED_add1_ext_i2d(entry.get(), NID_crl_reason, code.get(), 0, 0) == 1;
  }
  if (!ok) return Internal("crypto: cannot build the revocation entry: {}", TakeOpenSslErrors());
  ESTUARY_RETURN_IF_ERROR(
      WriteCrl(dir, ca, old ? X509_CRL_get_REVOKED(old.get()) : nullptr, entry.get(), number + 1, options));
  return true;
}

Status RenewCrl(const std::filesystem::path& dir, const CrlOptions& options) {
  ESTUARY_ASSIGN_OR_RETURN(const Ca ca, LoadCa(dir));
  ESTUARY_ASSIGN_OR_RETURN(CrlPtr old, ExistingCrl(dir, ca));
  ESTUARY_ASSIGN_OR_RETURN(const uint64_t number, NumberOf(old.get(), dir / "crl.pem"));
  return WriteCrl(dir, ca, old ? X509_CRL_get_REVOKED(old.get()) : nullptr, nullptr, number + 1, options);
}

namespace internal {

Result<CrlPtr> ReadCheckedCrl(const std::filesystem::path& crl_path, const std::filesystem::path& ca_path,
                              CrlInfo* info) {
  ESTUARY_ASSIGN_OR_RETURN(auto cas, ReadCertificates(ca_path));
  ESTUARY_ASSIGN_OR_RETURN(CrlPtr crl, ReadCrlFile(crl_path));
  if (X509_CRL_get_version(crl.get()) != X509_CRL_VERSION_2) {
    return InvalidArgument("crypto: {}: a v1 CRL; expected v2 (with a CRL number)", crl_path.string());
  }
  if (std::none_of(cas.begin(), cas.end(), [&](const X509Ptr& ca) { return SignedBy(crl.get(), ca.get()); })) {
    return InvalidArgument("crypto: {}: not issued and signed by the CA in {}", crl_path.string(), ca_path.string());
  }
  ESTUARY_ASSIGN_OR_RETURN(*info, Describe(crl.get(), crl_path));
  if (info->next_update <= Clock::now()) {
    return FailedPrecondition("crypto: {}: past its next update ({}), so every handshake would fail; renew it "
                              "with estuary-server certs crl --dir DIR",
                              crl_path.string(), Utc(info->next_update));
  }
  return crl;
}

}  // namespace internal

Result<CrlInfo> ReadCrl(const std::filesystem::path& crl, const std::filesystem::path& ca) {
  CrlInfo info;
  ESTUARY_RETURN_IF_ERROR(internal::ReadCheckedCrl(crl, ca, &info).status());
  return info;
}

Result<std::string> CertificateSerial(const std::filesystem::path& cert) {
  ESTUARY_ASSIGN_OR_RETURN(X509Ptr x509, internal::ReadCertificate(cert));
  return internal::SerialHex(X509_get0_serialNumber(x509.get()));
}

const char* CertificateStateName(CertificateStatus::State state) {
  switch (state) {
    case CertificateStatus::State::kValid: return "valid";
    case CertificateStatus::State::kExpired: return "expired";
    case CertificateStatus::State::kRevoked: return "revoked";
    case CertificateStatus::State::kForeign: return "foreign";
  }
  return "?";
}

namespace {

// The DNS names and IP addresses of a certificate's subjectAltName, in order.
std::vector<std::string> SubjectAltNames(X509* cert) {
  std::vector<std::string> out;
  auto* names = static_cast<GENERAL_NAMES*>(X509_get_ext_d2i(cert, NID_subject_alt_name, nullptr, nullptr));
  for (int i = 0; names != nullptr && i < sk_GENERAL_NAME_num(names); ++i) {
    const GENERAL_NAME* name = sk_GENERAL_NAME_value(names, i);
    if (name->type == GEN_DNS) {
      out.emplace_back(reinterpret_cast<const char*>(ASN1_STRING_get0_data(name->d.dNSName)),
                       size_t(ASN1_STRING_length(name->d.dNSName)));
    } else if (name->type == GEN_IPADD) {
      char text[INET6_ADDRSTRLEN] = "";
      const int length = name->d.iPAddress->length;
      if ((length == 4 || length == 16) &&
          inet_ntop(length == 4 ? AF_INET : AF_INET6, name->d.iPAddress->data, text, sizeof text) != nullptr) {
        out.emplace_back(text);
      }
    }
  }
  GENERAL_NAMES_free(names);
  return out;
}

}  // namespace

Result<std::vector<CertificateStatus>> ListCertificates(const std::filesystem::path& dir) {
  ESTUARY_ASSIGN_OR_RETURN(X509Ptr ca, internal::ReadCertificate(dir / "ca.pem"));
  CrlInfo crl;
  std::error_code ec;
  if (std::filesystem::exists(dir / "crl.pem", ec)) {
    ESTUARY_ASSIGN_OR_RETURN(crl, ReadCrl(dir / "crl.pem", dir / "ca.pem"));
  }
  std::vector<CertificateStatus> out;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const auto& path = entry.path();
    if (path.extension() != ".pem" || path.filename() == "ca.pem" || path.filename() == "crl.pem") continue;
    ESTUARY_ASSIGN_OR_RETURN(X509Ptr cert, internal::ReadCertificate(path));
    CertificateStatus status;
    status.name = path.stem().string();
    status.serial = internal::SerialHex(X509_get0_serialNumber(cert.get()));
    ESTUARY_ASSIGN_OR_RETURN(status.not_after, TimeOf(X509_get0_notAfter(cert.get()), path, "notAfter"));
    const bool ours = IssuedBy(cert.get(), ca.get());
    for (const RevokedCertificate& r : crl.revoked) {
      if (ours && r.serial == status.serial) status.revocation = r;
    }
    const uint32_t usage = (X509_get_extension_flags(cert.get()) & EXFLAG_XKUSAGE) != 0
                               ? X509_get_extended_key_usage(cert.get()) & (XKU_SSL_SERVER | XKU_SSL_CLIENT)
                               : 0;
    status.role = usage == XKU_SSL_CLIENT   ? "site"
                  : usage == XKU_SSL_SERVER ? "server"
                  : usage != 0              ? "both"
                                            : "none";
    status.hosts = SubjectAltNames(cert.get());
    status.state = !ours                            ? CertificateStatus::State::kForeign
                   : status.revocation              ? CertificateStatus::State::kRevoked
                   : status.not_after <= Clock::now() ? CertificateStatus::State::kExpired
                                                    : CertificateStatus::State::kValid;
    out.push_back(std::move(status));
  }
  if (ec) return IoError("crypto: {}: cannot list: {}", dir.string(), ec.message());
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  return out;
}

}  // namespace estuary::crypto
