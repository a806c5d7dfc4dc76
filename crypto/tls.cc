#include "crypto/tls.h"

#include <openssl/err.h>
#include <openssl/x509v3.h>

#include <algorithm>

#include "crypto/openssl_util.h"
#include "crypto/revocation.h"

namespace estuary::crypto {
namespace internal {

Result<CrlInfo> Trust(X509_STORE* store, const TlsFiles& files) {
  ESTUARY_ASSIGN_OR_RETURN(auto ca_certs, internal::ReadCertificates(files.ca));
  for (const X509Ptr& ca : ca_certs) {
    if (X509_STORE_add_cert(store, ca.get()) != 1) {
      return InvalidArgument("crypto: {}: CA certificate refused: {}", files.ca.string(), TakeOpenSslErrors());
    }
  }
  CrlInfo info;
  if (files.crl.empty()) return info;
  ESTUARY_ASSIGN_OR_RETURN(internal::CrlPtr crl, internal::ReadCheckedCrl(files.crl, files.ca, &info));
  if (X509_STORE_add_crl(store, crl.get()) != 1 || X509_STORE_set_flags(store, X509_V_FLAG_CRL_CHECK) != 1) {
    return InvalidArgument("crypto: {}: CRL refused: {}", files.crl.string(), TakeOpenSslErrors());
  }
  return info;
}

}  // namespace internal

namespace {

namespace ssl = boost::asio::ssl;
using internal::TakeOpenSslErrors;
using internal::StatedRoles;
using internal::Trust;
using internal::X509Ptr;

// Session-ID context is required by OpenSSL whenever the server verifies
// client certificates; without it a resumed session is refused.
constexpr unsigned char kSessionIdContext[] = "estuary";

// The key exchange groups and signature algorithms both ends offer and
// accept: the 128-bit level of our certificates (ECDSA P-256) and nothing
// slower. OpenSSL's defaults add P-384, P-521, X448 and ffdhe2048-8192, and a
// ClientHello that offers only ffdhe8192 costs the server 145 ms of CPU (X25519:
// under half a millisecond), which an unauthenticated peer can ask for at will.
constexpr char kGroups[] = "X25519:P-256";
constexpr char kSignatureAlgorithms[] = "ecdsa_secp256r1_sha256";

// Runs after OpenSSL's own checks of each certificate in the peer's chain
// (purpose included): the peer's own certificate must also state its role
// and only that one.
int RequireStatedRole(int preverified, X509_STORE_CTX* store) {
  if (preverified != 1 || X509_STORE_CTX_get_error_depth(store) != 0) return preverified;
  auto* ssl = static_cast<SSL*>(X509_STORE_CTX_get_ex_data(store, SSL_get_ex_data_X509_STORE_CTX_idx()));
  const uint32_t role = ssl != nullptr && SSL_is_server(ssl) ? XKU_SSL_CLIENT : XKU_SSL_SERVER;
  if (StatedRoles(X509_STORE_CTX_get_current_cert(store)) == role) return 1;
  X509_STORE_CTX_set_error(store, X509_V_ERR_INVALID_PURPOSE);
  return 0;
}

// Fails, naming the file, unless our own certificate states our side's role
// and only it: a peer would refuse it at every handshake, so say so before
// the first.
Status CheckOwnRole(X509* cert, const std::filesystem::path& path, bool server) {
  const uint32_t roles = StatedRoles(cert);
  const char* what = server ? "server" : "site";
  const char* usage = server ? "serverAuth" : "clientAuth";
  if (roles == (XKU_SSL_SERVER | XKU_SSL_CLIENT)) {
    return InvalidArgument(
        "crypto: {}: not a {} certificate: its extendedKeyUsage states both serverAuth and clientAuth (issued before "
        "certificate roles); issue it anew (estuary-server certs issue{})",
        path.string(), what, server ? " --role server --dns/--ip ..." : "");
  }
  if (roles != (server ? XKU_SSL_SERVER : XKU_SSL_CLIENT)) {
    return InvalidArgument("crypto: {}: not a {} certificate: its extendedKeyUsage lacks {}", path.string(), what,
                           usage);
  }
  return Status::Ok();
}

// Loads our chain + key and the CA into `ctx`. Each file is parsed by us first
// so that every failure names the file; the parsed objects are then handed to
// OpenSSL directly rather than re-reading the files.
Status LoadFiles(SSL_CTX* ctx, const TlsFiles& files, bool server) {
  if (files.cert.empty() && files.key.empty()) {  // trust only: identities come per connection
    return Trust(SSL_CTX_get_cert_store(ctx), files).status();
  }
  ESTUARY_ASSIGN_OR_RETURN(auto chain, internal::ReadCertificates(files.cert));
  ESTUARY_ASSIGN_OR_RETURN(auto key, internal::ReadPrivateKey(files.key));
  ESTUARY_RETURN_IF_ERROR(internal::CheckKeyMatches(chain.front().get(), key.get(), files.cert, files.key));

  ERR_clear_error();
  if (SSL_CTX_use_certificate(ctx, chain.front().get()) != 1) {
    return InvalidArgument("crypto: {}: certificate refused: {}", files.cert.string(), TakeOpenSslErrors());
  }
  for (size_t i = 1; i < chain.size(); ++i) {
    if (SSL_CTX_add1_chain_cert(ctx, chain[i].get()) != 1) {
      return InvalidArgument("crypto: {}: chain certificate {} refused: {}", files.cert.string(), i,
                             TakeOpenSslErrors());
    }
  }
  if (SSL_CTX_use_PrivateKey(ctx, key.get()) != 1 || SSL_CTX_check_private_key(ctx) != 1) {
    return InvalidArgument("crypto: {}: private key refused: {}", files.key.string(), TakeOpenSslErrors());
  }
  ESTUARY_RETURN_IF_ERROR(Trust(SSL_CTX_get_cert_store(ctx), files).status());
  return CheckOwnRole(chain.front().get(), files.cert, server);
}

Result<std::shared_ptr<ssl::context>> MakeContext(const TlsFiles& files, bool server) {
  std::shared_ptr<ssl::context> context;
  try {
    context = std::make_shared<ssl::context>(ssl::context::tls);
  } catch (const boost::system::system_error& e) {
    return Internal("crypto: cannot create TLS context: {}", e.what());
  }
  SSL_CTX* ctx = context->native_handle();
  // TLS 1.3 only: one protocol to reason about, no renegotiation, and the
  // handshake (certificates included) is encrypted.
  if (SSL_CTX_set_min_proto_version(ctx, TLS1_3_VERSION) != 1) {
    return Internal("crypto: cannot require TLS 1.3: {}", TakeOpenSslErrors());
  }
  SSL_CTX_set_options(ctx, SSL_OP_NO_COMPRESSION | SSL_OP_NO_RENEGOTIATION | SSL_OP_CIPHER_SERVER_PREFERENCE);
  // AES-128-GCM first: the certificates (ECDSA P-256) and the key exchange
  // (X25519 or P-256) are at the 128-bit level, so AES-256 adds no strength to
  // the connection, only 30% more cycles on every model byte.
  if (SSL_CTX_set_ciphersuites(ctx, "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256") != 1) {
    return Internal("crypto: cannot set the TLS 1.3 cipher suites: {}", TakeOpenSslErrors());
  }
  if (SSL_CTX_set1_groups_list(ctx, kGroups) != 1) {
    return Internal("crypto: cannot set the key exchange groups {}: {}", kGroups, TakeOpenSslErrors());
  }
  if (SSL_CTX_set1_sigalgs_list(ctx, kSignatureAlgorithms) != 1) {
    return Internal("crypto: cannot set the signature algorithms {}: {}", kSignatureAlgorithms, TakeOpenSslErrors());
  }
  // Each end checks the other's role: the server wants a site (clientAuth),
  // a site wants the server (serverAuth); RequireStatedRole below.
  if (SSL_CTX_set_purpose(ctx, server ? X509_PURPOSE_SSL_CLIENT : X509_PURPOSE_SSL_SERVER) != 1) {
    return Internal("crypto: cannot set the peer's certificate purpose: {}", TakeOpenSslErrors());
  }
  ESTUARY_RETURN_IF_ERROR(LoadFiles(ctx, files, server));

  boost::system::error_code ec;
  // Set first: set_verify_mode keeps the context's callback.
  SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, RequireStatedRole);
  if (server) {
    context->set_verify_mode(ssl::verify_peer | ssl::verify_fail_if_no_peer_cert, ec);
    if (!ec && SSL_CTX_set_session_id_context(ctx, kSessionIdContext, sizeof(kSessionIdContext) - 1) != 1) {
      return Internal("crypto: cannot set session id context: {}", TakeOpenSslErrors());
    }
    // No resumption: every connection proves its certificate afresh, and the
    // two session tickets OpenSSL would issue per handshake (a third of the
    // server's handshake cost) go unused, since clients never resume.
    SSL_CTX_set_session_cache_mode(ctx, SSL_SESS_CACHE_OFF);
    if (SSL_CTX_set_num_tickets(ctx, 0) != 1) {
      return Internal("crypto: cannot turn off session tickets: {}", TakeOpenSslErrors());
    }
  } else {
    context->set_verify_mode(ssl::verify_peer, ec);
  }
  if (ec) return Internal("crypto: cannot set verify mode: {}", ec.message());
  return context;
}

bool IsIpLiteral(const std::string& host) {
  ASN1_OCTET_STRING* ip = a2i_IPADDRESS(host.c_str());
  if (ip == nullptr) return false;
  ASN1_OCTET_STRING_free(ip);
  return true;
}

}  // namespace

Result<std::shared_ptr<ssl::context>> MakeServerContext(const TlsFiles& files) { return MakeContext(files, true); }

Result<std::shared_ptr<ssl::context>> MakeClientContext(const TlsFiles& files) {
  if (files.cert.empty() || files.key.empty()) {
    return InvalidArgument("crypto: a client context needs a certificate and a key");
  }
  return MakeContext(files, false);
}

Result<std::shared_ptr<ssl::context>> MakeTrustOnlyClientContext(const std::filesystem::path& ca,
                                                                 const std::filesystem::path& crl) {
  return MakeContext({{}, {}, ca, crl}, false);
}

Result<CrlInfo> ReloadCrl(ssl::context& context, const TlsFiles& files) {
  if (files.crl.empty()) return InvalidArgument("crypto: no CRL file to reload");
  std::unique_ptr<X509_STORE, internal::FreeWith<X509_STORE_free>> store(X509_STORE_new());
  if (!store) return Internal("crypto: X509_STORE_new failed: {}", TakeOpenSslErrors());
  ESTUARY_ASSIGN_OR_RETURN(CrlInfo info, Trust(store.get(), files));
  // The context owns the new store from here and frees the old one; a
  // handshake reads the store when it verifies, so the next one uses the list.
  SSL_CTX_set_cert_store(context.native_handle(), store.release());
  return info;
}

std::string PeerSerial(SSL* ssl) {
  if (ssl == nullptr) return "";
  X509Ptr peer(SSL_get1_peer_certificate(ssl));
  return peer ? internal::SerialHex(X509_get0_serialNumber(peer.get())) : "";
}

bool IsCertificateRevokedAlert(const boost::system::error_code& ec) {
  return ec && ec.category() == boost::asio::error::get_ssl_category() &&
         ERR_GET_REASON(static_cast<unsigned long>(ec.value())) == SSL_R_SSLV3_ALERT_CERTIFICATE_REVOKED;
}

struct Identity::Parts {
  std::vector<X509Ptr> chain;
  internal::PkeyPtr key;
};

Identity::Identity(std::unique_ptr<Parts> parts) : parts_(std::move(parts)) {}
Identity::~Identity() = default;

Result<std::shared_ptr<const Identity>> LoadIdentity(const std::filesystem::path& cert,
                                                     const std::filesystem::path& key) {
  auto parts = std::make_unique<Identity::Parts>();
  ESTUARY_ASSIGN_OR_RETURN(parts->chain, internal::ReadCertificates(cert));
  ESTUARY_ASSIGN_OR_RETURN(parts->key, internal::ReadPrivateKey(key));
  ESTUARY_RETURN_IF_ERROR(internal::CheckKeyMatches(parts->chain.front().get(), parts->key.get(), cert, key));
  ESTUARY_RETURN_IF_ERROR(CheckOwnRole(parts->chain.front().get(), cert, false));
  return std::make_shared<const Identity>(std::move(parts));
}

Status UseIdentity(SSL* ssl, const Identity& identity) {
  const auto& parts = identity.parts();
  ERR_clear_error();
  if (SSL_use_certificate(ssl, parts.chain.front().get()) != 1) {
    return InvalidArgument("crypto: certificate refused: {}", TakeOpenSslErrors());
  }
  for (size_t i = 1; i < parts.chain.size(); ++i) {
    if (SSL_add1_chain_cert(ssl, parts.chain[i].get()) != 1) {
      return InvalidArgument("crypto: chain certificate {} refused: {}", i, TakeOpenSslErrors());
    }
  }
  if (SSL_use_PrivateKey(ssl, parts.key.get()) != 1) {
    return InvalidArgument("crypto: private key refused: {}", TakeOpenSslErrors());
  }
  return Status::Ok();
}

Status VerifyServerName(SSL* ssl, const std::string& host_in) {
  if (ssl == nullptr) return InvalidArgument("crypto: VerifyServerName: no SSL stream");
  // Accept the URL form of IPv6 literals ("[::1]") as well as the bare one.
  std::string host = host_in;
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  if (host.empty()) return InvalidArgument("crypto: expected server name is empty");

  ERR_clear_error();
  X509_VERIFY_PARAM* param = SSL_get0_param(ssl);
  if (IsIpLiteral(host)) {
    // OpenSSL 3.0's SSL_set1_host treats its argument as a DNS name, so an IP
    // must go through the IP check explicitly. No SNI: RFC 6066 forbids
    // literal addresses there.
    if (X509_VERIFY_PARAM_set1_ip_asc(param, host.c_str()) != 1) {
      return InvalidArgument("crypto: cannot expect server address '{}': {}", host, TakeOpenSslErrors());
    }
    return Status::Ok();
  }
  // Names come from subjectAltName only: a site's certificate names no host,
  // and its common name must not stand in for one.
  X509_VERIFY_PARAM_set_hostflags(param, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS | X509_CHECK_FLAG_NEVER_CHECK_SUBJECT);
  if (SSL_set1_host(ssl, host.c_str()) != 1) {
    return InvalidArgument("crypto: cannot expect server name '{}': {}", host, TakeOpenSslErrors());
  }
  if (SSL_set_tlsext_host_name(ssl, host.c_str()) != 1) {
    return InvalidArgument("crypto: cannot set SNI '{}': {}", host, TakeOpenSslErrors());
  }
  return Status::Ok();
}

std::string PeerVerifyError(SSL* ssl) {
  if (ssl == nullptr) return "";
  const long verify = SSL_get_verify_result(ssl);
  return verify == X509_V_OK ? "" : X509_verify_cert_error_string(verify);
}

bool PeerVerifyErrorIsLasting(SSL* ssl) {
  if (ssl == nullptr) return false;
  switch (SSL_get_verify_result(ssl)) {
    case X509_V_OK:
    case X509_V_ERR_CERT_NOT_YET_VALID:
    case X509_V_ERR_CERT_HAS_EXPIRED:
    case X509_V_ERR_CRL_NOT_YET_VALID:
    case X509_V_ERR_CRL_HAS_EXPIRED:
      return false;
    default:
      return true;
  }
}

Result<std::string> PeerCommonName(SSL* ssl) {
  if (ssl == nullptr) return InvalidArgument("crypto: PeerCommonName: no SSL stream");
  X509Ptr peer(SSL_get1_peer_certificate(ssl));
  if (!peer) return FailedPrecondition("crypto: peer presented no certificate");
  const long verify = SSL_get_verify_result(ssl);
  if (verify != X509_V_OK) {
    return FailedPrecondition("crypto: peer certificate not verified: {}", X509_verify_cert_error_string(verify));
  }
  return internal::CommonName(peer.get());
}

std::string HandshakeFailureReason(SSL* ssl, const boost::system::error_code& ec) {
  std::string reason = ec ? ec.message() : "no error reported";
  if (ec && ec.category() == boost::asio::error::get_ssl_category()) {
    // Asio keeps the packed OpenSSL code; the library name says which layer.
    if (const char* lib = ERR_lib_error_string(static_cast<unsigned long>(ec.value()))) {
      reason = fmt::format("{} ({})", reason, lib);
    }
  }
  if (ssl != nullptr) {
    const long verify = SSL_get_verify_result(ssl);
    if (verify != X509_V_OK) reason += fmt::format("; verify: {}", X509_verify_cert_error_string(verify));
  }
  const std::string queued = TakeOpenSslErrors("");
  if (!queued.empty()) reason += "; " + queued;
  // Keep it to one log line whatever OpenSSL put in its strings.
  std::replace(reason.begin(), reason.end(), '\n', ' ');
  return reason;
}

}  // namespace estuary::crypto
