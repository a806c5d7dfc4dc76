// TLS contexts for the server and the clients: TLS 1.3 only, mutual
// authentication against the federation CA.
//
// Both ends speak one profile: key exchange X25519 or P-256, signatures
// ECDSA P-256 with SHA-256 (our certificates'); a peer that offers none of
// them is refused at its ClientHello, before any costly work. And each end
// checks the other's role (crypto/certs.h CertRole): the server takes only a
// certificate whose extendedKeyUsage states clientAuth, a site only one that
// states serverAuth and names, in its subjectAltName, the host it dialled.
// A context refuses, up front, our own certificate if it lacks our role.
//
// Files are checked up front so a bad path or a corrupt PEM gives one line
// naming the file ("crypto: site-a.key: cannot read private key: ...").
#pragma once

#include <boost/asio/ssl.hpp>
#include <filesystem>
#include <memory>
#include <string>

#include "base/status.h"
#include "crypto/revocation.h"

namespace estuary::crypto {

struct TlsFiles {
  std::filesystem::path cert;  // our certificate chain (PEM)
  std::filesystem::path key;   // our private key (PEM)
  std::filesystem::path ca;    // the federation CA (PEM)
  // Optional: the CA's revocation list (crypto/revocation.h). With one, a
  // peer certificate it lists fails verification ("certificate revoked"); a
  // list not signed by `ca`, or past its next update, is refused up front.
  std::filesystem::path crl = {};
};

// Server: requires and verifies a client certificate (verify_peer |
// verify_fail_if_no_peer_cert), a site's (clientAuth). files.cert must be a
// server's (serverAuth).
Result<std::shared_ptr<boost::asio::ssl::context>> MakeServerContext(const TlsFiles& files);
// Client: verifies the server's chain against the CA and its role
// (serverAuth); the caller also sets the expected host name on each stream
// (VerifyServerName). files.cert must be a site's (clientAuth).
Result<std::shared_ptr<boost::asio::ssl::context>> MakeClientContext(const TlsFiles& files);

// A site's certificate chain and private key, parsed and checked once. One
// process can then run many sites over one client context (OpenSSL 3 makes
// each SSL_CTX expensive), each site attaching its identity to its own
// connections with UseIdentity.
class Identity {
 public:
  struct Parts;
  explicit Identity(std::unique_ptr<Parts> parts);
  ~Identity();
  const Parts& parts() const { return *parts_; }

 private:
  std::unique_ptr<Parts> parts_;
};

// Fails, naming the file, unless `cert` is a site's (clientAuth).
Result<std::shared_ptr<const Identity>> LoadIdentity(const std::filesystem::path& cert,
                                                     const std::filesystem::path& key);
// Presents `identity` on this connection (before its handshake).
Status UseIdentity(SSL* ssl, const Identity& identity);
// A client context that trusts `ca` and has no identity of its own: every
// connection made from it needs UseIdentity.
Result<std::shared_ptr<boost::asio::ssl::context>> MakeTrustOnlyClientContext(const std::filesystem::path& ca,
                                                                                const std::filesystem::path& crl = {});

// Rereads files.crl (checked as at creation) and swaps the context's trust
// store for one with the CA and that list: handshakes from then on verify
// against it; a bad file changes nothing. Call it on the thread that runs the
// context's handshakes. Returns what the list holds.
Result<CrlInfo> ReloadCrl(boost::asio::ssl::context& context, const TlsFiles& files);

// The serial number of the peer's certificate, as CrlInfo writes serials
// ("" without one).
std::string PeerSerial(SSL* ssl);

// Whether a TLS error is the peer's "certificate revoked" alert: the server
// refused our certificate for good, and retrying cannot help.
bool IsCertificateRevokedAlert(const boost::system::error_code& ec);

// Makes `ssl` check the server certificate's subjectAltName against `host`
// (an IP literal or a DNS name; never the subject's common name) and sets
// SNI for DNS names.
Status VerifyServerName(SSL* ssl, const std::string& host);

// Why our check of the peer's certificate failed ("certificate has expired",
// "unsupported certificate purpose", "hostname mismatch", ...), or "" when it
// passed or the handshake ended before it. A failure here is the peer's
// certificate, not the network: retrying cannot help.
std::string PeerVerifyError(SSL* ssl);
// Whether that failure is about who the peer is (its role, its names, its
// issuer, its signature, revoked), which no retry changes, rather than when
// (expired or not yet valid, or our revocation list past its update), which
// the peer's operator or a clock may put right.
bool PeerVerifyErrorIsLasting(SSL* ssl);

// The subject CN of the peer's verified certificate, or an error if none.
Result<std::string> PeerCommonName(SSL* ssl);

// A one-line reason for the last handshake failure on `ssl` (verify result
// plus OpenSSL's error queue), for the server's log of refused peers.
std::string HandshakeFailureReason(SSL* ssl, const boost::system::error_code& ec);

}  // namespace estuary::crypto
