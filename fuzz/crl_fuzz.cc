// A certificate revocation list through crypto::ReadCrl, against a fixed CA
// (fuzz/crl_ca: a key made for this harness only). The first byte picks how
// the rest is used:
//   even: as the CRL file itself (PEM framing, DER, signature, fields);
//   odd:  as a DER CRL that, when OpenSSL can decode it, the harness signs
//         with the CA's key before writing it as PEM, so the checks past the
//         signature (version, dates, CRL number, entries) see arbitrary fields.
// A CRL accepted must be current and name every revoked serial.
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <chrono>
#include <string>

#include "crypto/revocation.h"
#include "fuzz/fuzz_util.h"

namespace {

const std::filesystem::path kCaDir = ESTUARY_FUZZ_SOURCE_DIR "/crl_ca";

EVP_PKEY* CaKey() {
  static EVP_PKEY* key = [] {
    FILE* file = std::fopen((kCaDir / "ca.key").c_str(), "r");
    FUZZ_CHECK(file != nullptr, "cannot open %s", (kCaDir / "ca.key").c_str());
    EVP_PKEY* read = PEM_read_PrivateKey(file, nullptr, nullptr, nullptr);
    std::fclose(file);
    FUZZ_CHECK(read != nullptr);
    return read;
  }();
  return key;
}

// The DER CRL signed by the CA, as PEM; empty when OpenSSL cannot decode or sign it.
std::string SignedPem(const uint8_t* der, size_t size) {
  const unsigned char* p = der;
  X509_CRL* crl = d2i_X509_CRL(nullptr, &p, long(size));
  std::string pem;
  if (crl != nullptr && X509_CRL_sign(crl, CaKey(), EVP_sha256()) > 0) {
    BIO* bio = BIO_new(BIO_s_mem());
    if (PEM_write_bio_X509_CRL(bio, crl) == 1) {
      char* data = nullptr;
      const long n = BIO_get_mem_data(bio, &data);
      pem.assign(data, size_t(n));
    }
    BIO_free(bio);
  }
  X509_CRL_free(crl);
  ERR_clear_error();
  return pem;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace estuary;
  if (size < 1) return 0;
  std::string file;
  if (data[0] % 2 == 0) {
    file.assign(reinterpret_cast<const char*>(data + 1), size - 1);
  } else {
    file = SignedPem(data + 1, size - 1);
    if (file.empty()) return 0;
  }
  const auto path = fuzz::WriteScratch("crl.pem", file);
  auto info = crypto::ReadCrl(path, kCaDir / "ca.pem");
  if (!info.ok()) {
    fuzz::CheckError(info.status());
    return 0;
  }
  FUZZ_CHECK(info->next_update > std::chrono::system_clock::now());
  for (const crypto::RevokedCertificate& revoked : info->revoked) {
    FUZZ_CHECK(info->Revokes(revoked.serial));
    (void)crypto::RevocationReasonName(revoked.reason);
  }
  return 0;
}
