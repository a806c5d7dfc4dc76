#include "crypto/certs.h"

#include <fcntl.h>
#include <openssl/bn.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string_view>
#include <system_error>

#include "crypto/openssl_util.h"

namespace estuary::crypto {
namespace {

using internal::PkeyPtr;
using internal::TakeOpenSslErrors;
using internal::X509Ptr;

constexpr size_t kMaxNameLength = 64;  // ub-common-name in RFC 5280

bool IsNameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == '-';
}

bool IsIpAddress(const std::string& text) {
  ASN1_OCTET_STRING* ip = a2i_IPADDRESS(text.c_str());
  if (ip == nullptr) return false;
  ASN1_OCTET_STRING_free(ip);
  return true;
}

Status ValidateCaName(const std::string& common_name) {
  if (common_name.empty() || common_name.size() > kMaxNameLength) {
    return InvalidArgument("crypto: CA common name '{}' must be 1..{} characters", common_name, kMaxNameLength);
  }
  for (unsigned char c : common_name) {
    if (c < 0x20 || c == 0x7f) return InvalidArgument("crypto: CA common name has a control character");
  }
  return Status::Ok();
}

Status ValidateWindow(const CertOptions& options) {
  if (options.not_after <= options.not_before) {
    return InvalidArgument("crypto: certificate validity window is empty (not_after {}s <= not_before {}s)",
                           options.not_after.count(), options.not_before.count());
  }
  return Status::Ok();
}

Status RefuseExisting(const std::filesystem::path& path) {
  std::error_code ec;
  if (std::filesystem::exists(std::filesystem::symlink_status(path, ec))) {
    return FailedPrecondition("crypto: {}: already exists; refusing to overwrite", path.string());
  }
  return Status::Ok();
}

Result<PkeyPtr> NewP256Key() {
  PkeyPtr key(EVP_PKEY_Q_keygen(nullptr, nullptr, "EC", "P-256"));
  if (!key) return Internal("crypto: cannot generate P-256 key: {}", TakeOpenSslErrors());
  return key;
}

// 128 random bits; a zero serial is not allowed, so redraw in that
// (astronomically unlikely) case.
Status SetRandomSerial(X509* cert) {
  unsigned char bytes[16];
  std::unique_ptr<BIGNUM, internal::FreeWith<BN_free>> serial;
  do {
    if (RAND_bytes(bytes, sizeof(bytes)) != 1) {
      return Internal("crypto: RAND_bytes failed: {}", TakeOpenSslErrors());
    }
    serial.reset(BN_bin2bn(bytes, sizeof(bytes), nullptr));
    if (!serial) return Internal("crypto: BN_bin2bn failed: {}", TakeOpenSslErrors());
  } while (BN_is_zero(serial.get()));
  if (BN_to_ASN1_INTEGER(serial.get(), X509_get_serialNumber(cert)) == nullptr) {
    return Internal("crypto: cannot set serial: {}", TakeOpenSslErrors());
  }
  return Status::Ok();
}

Status AddExtension(X509* cert, X509V3_CTX* ctx, int nid, const char* value) {
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, ctx, nid, value);
  if (ext == nullptr) {
    return Internal("crypto: cannot build extension {}={}: {}", OBJ_nid2sn(nid), value, TakeOpenSslErrors());
  }
  const int added = X509_add_ext(cert, ext, -1);
  X509_EXTENSION_free(ext);
  if (added != 1) return Internal("crypto: cannot add extension {}: {}", OBJ_nid2sn(nid), TakeOpenSslErrors());
  return Status::Ok();
}

struct Extension {
  int nid;
  std::string value;
};

// Builds and signs a certificate for `subject_key`. issuer == nullptr means
// self-signed (the CA). Extensions are added in order, so the subject key
// identifier must precede the authority key identifier that may refer to it.
Result<X509Ptr> BuildCertificate(const std::string& common_name, EVP_PKEY* subject_key, X509* issuer,
                                 EVP_PKEY* issuer_key, const CertOptions& options,
                                 const std::vector<Extension>& extensions) {
  X509Ptr cert(X509_new());
  if (!cert) return Internal("crypto: X509_new failed: {}", TakeOpenSslErrors());
  bool ok = X509_set_version(cert.get(), X509_VERSION_3) == 1;
  ESTUARY_RETURN_IF_ERROR(SetRandomSerial(cert.get()));
  ok = ok && X509_gmtime_adj(X509_getm_notBefore(cert.get()), options.not_before.count()) != nullptr;
  ok = ok && X509_gmtime_adj(X509_getm_notAfter(cert.get()), options.not_after.count()) != nullptr;
  X509_NAME* subject = X509_get_subject_name(cert.get());
  ok = ok && X509_NAME_add_entry_by_txt(subject, "CN", MBSTRING_UTF8,
                                        reinterpret_cast<const unsigned char*>(common_name.c_str()), -1, -1,
                                        0) == 1;
  X509* issuer_cert = issuer != nullptr ? issuer : cert.get();
  ok = ok && X509_set_issuer_name(cert.get(), X509_get_subject_name(issuer_cert)) == 1;
  ok = ok && X509_set_pubkey(cert.get(), subject_key) == 1;
  if (!ok) return Internal("crypto: cannot fill certificate fields: {}", TakeOpenSslErrors());

  X509V3_CTX ctx;
  X509V3_set_ctx(&ctx, issuer_cert, cert.get(), nullptr, nullptr, 0);
  for (const Extension& ext : extensions) {
    ESTUARY_RETURN_IF_ERROR(AddExtension(cert.get(), &ctx, ext.nid, ext.value.c_str()));
  }
  if (X509_sign(cert.get(), issuer_key, EVP_sha256()) <= 0) {
    return Internal("crypto: cannot sign certificate: {}", TakeOpenSslErrors());
  }
  return cert;
}

// Creates `path` exclusively (O_EXCL: never replaces a file, even one that
// appeared after our existence check) with `mode`, and writes `contents`.
Status WriteNewFile(const std::filesystem::path& path, std::string_view contents, mode_t mode) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
  if (fd < 0) {
    if (errno == EEXIST) return FailedPrecondition("crypto: {}: already exists; refusing to overwrite", path.string());
    return IoError("crypto: {}: cannot create: {}", path.string(), std::strerror(errno));
  }
  // The umask may only have narrowed the mode; fchmod pins it exactly, which
  // matters for keys (0600) whatever the caller's umask.
  Status status;
  if (::fchmod(fd, mode) != 0) status = IoError("crypto: {}: chmod: {}", path.string(), std::strerror(errno));
  size_t written = 0;
  while (status.ok() && written < contents.size()) {
    const ssize_t n = ::write(fd, contents.data() + written, contents.size() - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      status = IoError("crypto: {}: write failed: {}", path.string(), std::strerror(errno));
      break;
    }
    written += static_cast<size_t>(n);
  }
  if (status.ok() && ::fsync(fd) != 0) status = IoError("crypto: {}: fsync: {}", path.string(), std::strerror(errno));
  if (::close(fd) != 0 && status.ok()) status = IoError("crypto: {}: close: {}", path.string(), std::strerror(errno));
  if (!status.ok()) ::unlink(path.c_str());
  return status;
}

Result<std::string> KeyToPem(EVP_PKEY* key) {
  internal::BioPtr bio(BIO_new(BIO_s_mem()));
  if (!bio || PEM_write_bio_PrivateKey(bio.get(), key, nullptr, nullptr, 0, nullptr, nullptr) != 1) {
    return Internal("crypto: cannot encode private key: {}", TakeOpenSslErrors());
  }
  char* data = nullptr;
  const long size = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(size));
}

Result<std::string> CertToPem(X509* cert) {
  internal::BioPtr bio(BIO_new(BIO_s_mem()));
  if (!bio || PEM_write_bio_X509(bio.get(), cert) != 1) {
    return Internal("crypto: cannot encode certificate: {}", TakeOpenSslErrors());
  }
  char* data = nullptr;
  const long size = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(size));
}

// Writes the key first (private, 0600) and then the certificate (0644); if the
// certificate cannot be written the key is removed, so a failed issuance
// leaves nothing behind that would block a retry.
Status WritePair(X509* cert, EVP_PKEY* key, const std::filesystem::path& cert_path,
                 const std::filesystem::path& key_path) {
  ESTUARY_ASSIGN_OR_RETURN(std::string key_pem, KeyToPem(key));
  ESTUARY_ASSIGN_OR_RETURN(std::string cert_pem, CertToPem(cert));
  ESTUARY_RETURN_IF_ERROR(WriteNewFile(key_path, key_pem, 0600));
  Status cert_status = WriteNewFile(cert_path, cert_pem, 0644);
  if (!cert_status.ok()) ::unlink(key_path.c_str());
  OPENSSL_cleanse(key_pem.data(), key_pem.size());
  return cert_status;
}

// A host name as sites will type it: dot-separated labels of letters, digits
// and inner hyphens (RFC 1123). No wildcard: a federation has one server.
Status ValidateDnsName(const std::string& name) {
  if (name.empty() || name.size() > 253) {
    return InvalidArgument("crypto: DNS name '{}' must be 1..253 characters", name);
  }
  if (IsIpAddress(name)) {
    return InvalidArgument("crypto: DNS name '{}' is an IP address; name it as an address instead", name);
  }
  size_t start = 0;
  while (start <= name.size()) {
    const size_t end = std::min(name.find('.', start), name.size());
    const std::string_view label = std::string_view(name).substr(start, end - start);
    const bool alnum_ends = !label.empty() && label.front() != '-' && label.back() != '-';
    if (label.size() > 63 || !alnum_ends ||
        !std::all_of(label.begin(), label.end(), [](char c) { return IsNameChar(c) && c != '_' && c != '.'; })) {
      return InvalidArgument("crypto: DNS name '{}' is not a host name (labels of letters, digits and inner hyphens)",
                             name);
    }
    start = end + 1;
  }
  return Status::Ok();
}

// The extensions that make a certificate a site's or the server's.
Result<std::vector<Extension>> RoleExtensions(const CertOptions& options) {
  if (options.role == CertRole::kSite) {
    if (!options.dns.empty() || !options.ips.empty()) {
      return InvalidArgument("crypto: a site's certificate names no host; DNS names and IP addresses are for the "
                             "server's");
    }
    return std::vector<Extension>{{NID_ext_key_usage, "clientAuth"}};
  }
  std::vector<std::string> names;
  for (const std::string& dns : options.dns) {
    ESTUARY_RETURN_IF_ERROR(ValidateDnsName(dns));
    names.push_back("DNS:" + dns);
  }
  for (const std::string& ip : options.ips) {
    if (!IsIpAddress(ip)) return InvalidArgument("crypto: '{}' is not an IPv4 or IPv6 address", ip);
    names.push_back("IP:" + ip);
  }
  if (names.empty()) names = {"DNS:localhost", "IP:127.0.0.1", "IP:::1"};
  std::string san;
  for (const std::string& entry : names) san += (san.empty() ? "" : ",") + entry;
  return std::vector<Extension>{{NID_ext_key_usage, "serverAuth"}, {NID_subject_alt_name, san}};
}

Status EnsureDirectory(const std::filesystem::path& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return IoError("crypto: {}: cannot create directory: {}", dir.string(), ec.message());
  return Status::Ok();
}

}  // namespace

// Site names become file names, so the alphabet is kept to what is safe
// there; "." and ".." would also escape the directory.
Status ValidateSiteName(const std::string& name) {
  if (name.empty() || name.size() > kMaxNameLength) {
    return InvalidArgument("crypto: certificate name '{}' must be 1..{} characters", name, kMaxNameLength);
  }
  for (char c : name) {
    if (!IsNameChar(c)) {
      return InvalidArgument("crypto: certificate name '{}' has a character outside [A-Za-z0-9._-]", name);
    }
  }
  if (name == "." || name == "..") {
    return InvalidArgument("crypto: certificate name '{}' is not a usable file name", name);
  }
  return Status::Ok();
}

Status InitCa(const std::filesystem::path& dir, const std::string& common_name, const CertOptions& options) {
  ESTUARY_RETURN_IF_ERROR(ValidateCaName(common_name));
  ESTUARY_RETURN_IF_ERROR(ValidateWindow(options));
  const auto cert_path = dir / "ca.pem";
  const auto key_path = dir / "ca.key";
  ESTUARY_RETURN_IF_ERROR(RefuseExisting(cert_path));
  ESTUARY_RETURN_IF_ERROR(RefuseExisting(key_path));
  ESTUARY_RETURN_IF_ERROR(EnsureDirectory(dir));

  ESTUARY_ASSIGN_OR_RETURN(PkeyPtr key, NewP256Key());
  ESTUARY_ASSIGN_OR_RETURN(
      X509Ptr cert, BuildCertificate(common_name, key.get(), nullptr, key.get(), options,
                                     {{NID_basic_constraints, "critical,CA:TRUE"},
                                      {NID_key_usage, "critical,keyCertSign,cRLSign"},
                                      {NID_subject_key_identifier, "hash"},
                                      {NID_authority_key_identifier, "keyid:always"}}));
  return WritePair(cert.get(), key.get(), cert_path, key_path);
}

Status IssueCertificateWith(const std::filesystem::path& ca_cert_path, const std::filesystem::path& ca_key_path,
                            const std::string& name, const std::filesystem::path& out_cert,
                            const std::filesystem::path& out_key, const CertOptions& options) {
  ESTUARY_RETURN_IF_ERROR(ValidateSiteName(name));
  ESTUARY_RETURN_IF_ERROR(ValidateWindow(options));
  ESTUARY_ASSIGN_OR_RETURN(const std::vector<Extension> role, RoleExtensions(options));
  ESTUARY_RETURN_IF_ERROR(RefuseExisting(out_cert));
  ESTUARY_RETURN_IF_ERROR(RefuseExisting(out_key));

  ESTUARY_ASSIGN_OR_RETURN(X509Ptr ca_cert, internal::ReadCertificate(ca_cert_path));
  ESTUARY_ASSIGN_OR_RETURN(PkeyPtr ca_key, internal::ReadPrivateKey(ca_key_path));
  ESTUARY_RETURN_IF_ERROR(internal::CheckKeyMatches(ca_cert.get(), ca_key.get(), ca_cert_path, ca_key_path));
  if (X509_check_ca(ca_cert.get()) != 1) {
    return InvalidArgument("crypto: {}: is not a CA certificate (basicConstraints CA:TRUE missing)",
                           ca_cert_path.string());
  }

  ESTUARY_ASSIGN_OR_RETURN(PkeyPtr key, NewP256Key());
  std::vector<Extension> extensions = {{NID_basic_constraints, "critical,CA:FALSE"},
                                       {NID_key_usage, "critical,digitalSignature"}};
  extensions.insert(extensions.end(), role.begin(), role.end());
  extensions.push_back({NID_subject_key_identifier, "hash"});
  extensions.push_back({NID_authority_key_identifier, "keyid:always"});
  ESTUARY_ASSIGN_OR_RETURN(X509Ptr cert,
                           BuildCertificate(name, key.get(), ca_cert.get(), ca_key.get(), options, extensions));
  return WritePair(cert.get(), key.get(), out_cert, out_key);
}

Status IssueCertificate(const std::filesystem::path& dir, const std::string& name, const CertOptions& options) {
  ESTUARY_RETURN_IF_ERROR(ValidateSiteName(name));
  return IssueCertificateWith(dir / "ca.pem", dir / "ca.key", name, dir / (name + ".pem"), dir / (name + ".key"),
                              options);
}

}  // namespace estuary::crypto
