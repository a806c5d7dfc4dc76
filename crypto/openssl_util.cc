#include "crypto/openssl_util.h"

#include <openssl/decoder.h>
#include <openssl/err.h>
#include <openssl/bn.h>
#include <openssl/pem.h>
#include <openssl/x509v3.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <system_error>

namespace estuary::crypto::internal {
namespace {

constexpr std::string_view kPemBegin = "-----BEGIN ";

// A PEM passphrase callback that refuses: with no callback OpenSSL would
// prompt on the terminal, which would hang a daemon.
int RefusePassphrase(char*, int, int, void*) { return -1; }

// Our keys are EC (P-256). Asking OpenSSL 3's decoder for exactly that is
// four times faster than PEM_read_bio_PrivateKey, which tries every key type
// and format in turn: that matters to a simulator that loads a key per site.
// Null for anything else, which the general reader then handles.
PkeyPtr ReadEcPrivateKey(const std::string& pem) {
  EVP_PKEY* key = nullptr;
  OSSL_DECODER_CTX* decoder = OSSL_DECODER_CTX_new_for_pkey(&key, "PEM", nullptr, "EC", OSSL_KEYMGMT_SELECT_KEYPAIR,
                                                            nullptr, nullptr);
  if (decoder == nullptr) return nullptr;
  const auto* data = reinterpret_cast<const unsigned char*>(pem.data());
  size_t length = pem.size();
  const bool decoded = OSSL_DECODER_CTX_set_pem_password_cb(decoder, RefusePassphrase, nullptr) == 1 &&
                       OSSL_DECODER_from_data(decoder, &data, &length) == 1;
  OSSL_DECODER_CTX_free(decoder);
  if (!decoded) {
    EVP_PKEY_free(key);
    return nullptr;
  }
  return PkeyPtr(key);
}

Status CheckLooksLikePem(const std::filesystem::path& path, const std::string& contents) {
  if (contents.empty()) return InvalidArgument("crypto: {}: file is empty", path.string());
  if (contents.find(kPemBegin) == std::string::npos) {
    return InvalidArgument("crypto: {}: not a PEM file (no '-----BEGIN' line)", path.string());
  }
  return Status::Ok();
}

BioPtr MemoryBio(const std::string& contents) {
  return BioPtr(BIO_new_mem_buf(contents.data(), static_cast<int>(contents.size())));
}

}  // namespace

std::string TakeOpenSslErrors(std::string_view fallback) {
  std::string joined;
  char buffer[256];
  while (unsigned long code = ERR_get_error()) {
    ERR_error_string_n(code, buffer, sizeof(buffer));
    if (!joined.empty()) joined += "; ";
    joined += buffer;
  }
  return joined.empty() ? std::string(fallback) : joined;
}

Result<std::string> ReadSmallFile(const std::filesystem::path& path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (!std::filesystem::exists(status)) {
    return NotFound("crypto: {}: no such file", path.string());
  }
  if (std::filesystem::is_directory(status)) {
    return InvalidArgument("crypto: {}: is a directory, expected a PEM file", path.string());
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return IoError("crypto: {}: cannot open: {}", path.string(), std::strerror(errno));
  std::ostringstream contents;
  contents << in.rdbuf();
  if (in.bad()) return IoError("crypto: {}: read failed: {}", path.string(), std::strerror(errno));
  return contents.str();
}

Result<std::vector<X509Ptr>> ReadCertificates(const std::filesystem::path& path) {
  ESTUARY_ASSIGN_OR_RETURN(std::string contents, ReadSmallFile(path));
  ESTUARY_RETURN_IF_ERROR(CheckLooksLikePem(path, contents));
  ERR_clear_error();
  BioPtr bio = MemoryBio(contents);
  std::vector<X509Ptr> certs;
  while (X509* cert = PEM_read_bio_X509(bio.get(), nullptr, RefusePassphrase, nullptr)) {
    certs.emplace_back(cert);
  }
  // Running out of PEM blocks ends the loop with PEM_R_NO_START_LINE; anything
  // else means a block was there but did not decode.
  const unsigned long last = ERR_peek_last_error();
  const bool clean_end = ERR_GET_LIB(last) == ERR_LIB_PEM && ERR_GET_REASON(last) == PEM_R_NO_START_LINE;
  if (certs.empty() || !clean_end) {
    if (clean_end) ERR_clear_error();
    return InvalidArgument("crypto: {}: cannot read certificate: {}", path.string(),
                           TakeOpenSslErrors("no CERTIFICATE block"));
  }
  ERR_clear_error();
  return certs;
}

Result<X509Ptr> ReadCertificate(const std::filesystem::path& path) {
  ESTUARY_ASSIGN_OR_RETURN(auto certs, ReadCertificates(path));
  return std::move(certs.front());
}

// The one PEM object of a small file, read by `read` (a PEM_read_bio_*
// function): one line naming the file, what it should hold and why not.
template <typename Ptr, typename Read>
Result<Ptr> ReadPemObject(const std::filesystem::path& path, Read read, std::string_view what, const char* block,
                          const std::function<Ptr(const std::string&)>& first_try = nullptr) {
  ESTUARY_ASSIGN_OR_RETURN(std::string contents, ReadSmallFile(path));
  ESTUARY_RETURN_IF_ERROR(CheckLooksLikePem(path, contents));
  ERR_clear_error();
  if (first_try) {
    if (Ptr object = first_try(contents)) return object;
    ERR_clear_error();
  }
  BioPtr bio = MemoryBio(contents);
  Ptr object(read(bio.get(), nullptr, RefusePassphrase, nullptr));
  if (!object) {
    return InvalidArgument("crypto: {}: cannot read {}: {}", path.string(), what,
                           TakeOpenSslErrors(fmt::format("no {} block", block)));
  }
  return object;
}

Result<PkeyPtr> ReadPrivateKey(const std::filesystem::path& path) {
  return ReadPemObject<PkeyPtr>(path, PEM_read_bio_PrivateKey, "private key", "PRIVATE KEY", ReadEcPrivateKey);
}

Status CheckKeyMatches(X509* cert, EVP_PKEY* key, const std::filesystem::path& cert_path,
                       const std::filesystem::path& key_path) {
  ERR_clear_error();
  if (X509_check_private_key(cert, key) != 1) {
    TakeOpenSslErrors();
    return InvalidArgument("crypto: {}: private key does not match certificate {}", key_path.string(),
                           cert_path.string());
  }
  return Status::Ok();
}

Result<std::string> CommonName(X509* cert) {
  X509_NAME* subject = X509_get_subject_name(cert);
  const int index = X509_NAME_get_index_by_NID(subject, NID_commonName, -1);
  if (index < 0) return NotFound("crypto: certificate subject has no common name");
  ASN1_STRING* data = X509_NAME_ENTRY_get_data(X509_NAME_get_entry(subject, index));
  unsigned char* utf8 = nullptr;
  const int length = ASN1_STRING_to_UTF8(&utf8, data);
  if (length < 0) return InvalidArgument("crypto: certificate common name is not valid text");
  std::string name(reinterpret_cast<char*>(utf8), static_cast<size_t>(length));
  OPENSSL_free(utf8);
  return name;
}

uint32_t StatedRoles(X509* cert) {
  if ((X509_get_extension_flags(cert) & EXFLAG_XKUSAGE) == 0) return 0;
  return X509_get_extended_key_usage(cert) & (XKU_SSL_SERVER | XKU_SSL_CLIENT);
}

std::string SerialHex(const ASN1_INTEGER* serial) {
  std::unique_ptr<BIGNUM, FreeWith<BN_free>> bn(ASN1_INTEGER_to_BN(serial, nullptr));
  if (!bn) return "";
  char* hex = BN_bn2hex(bn.get());
  if (hex == nullptr) return "";
  std::string out(hex);
  OPENSSL_free(hex);
  for (char& c : out) c = char(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

Result<CrlPtr> ReadCrlFile(const std::filesystem::path& path) {
  return ReadPemObject<CrlPtr>(path, PEM_read_bio_X509_CRL, "a certificate revocation list", "X509 CRL");
}

}  // namespace estuary::crypto::internal
