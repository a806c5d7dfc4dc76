// Real TLS handshakes over 127.0.0.1 between a server and a client context,
// each end a TlsSocket, as the server's sessions and the sites' agents are.
// Everything runs on one io_context; the test ends when both sides have
// finished, and a timer bounds the run so a bug fails instead of hanging.
#include "crypto/tls.h"

#include <gtest/gtest.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <chrono>
#include <functional>
#include <optional>
#include <vector>

#include <openssl/pem.h>
#include <openssl/x509v3.h>

#include "crypto/certs.h"
#include "crypto/openssl_util.h"
#include "crypto/revocation.h"
#include "crypto/tls_socket.h"
#include "test_dir.h"

namespace estuary::crypto {
namespace {

namespace asio = boost::asio;
namespace ssl = boost::asio::ssl;
using asio::ip::tcp;
using testing::TempDir;
using testing::WriteText;

constexpr auto kOverallTimeout = std::chrono::seconds(20);
constexpr char kGreeting = 'k';

struct SideOutcome {
  bool handshake_ok = false;
  std::string failure;            // HandshakeFailureReason when !handshake_ok
  std::optional<std::string> peer_cn;
  std::string cipher;
  bool resumable = false;         // the client holds a session ticket
  bool greeting_ok = false;       // data flowed after the handshake
  std::string greeting_failure;
  bool revoked_alert = false;     // the peer said "certificate revoked"
  // The client's: the signature algorithms the server's CertificateRequest
  // asked for (TLS code points).
  std::vector<uint16_t> peer_sigalgs;
};

struct Outcome {
  SideOutcome server;
  SideOutcome client;
  bool timed_out = false;
};

// Runs one connection: the server accepts, handshakes, and on success sends
// one byte; the client handshakes and, on success, reads that byte (in TLS 1.3
// a client's handshake can complete before the server has judged the client
// certificate, so the read is where a refused client learns of it).
Outcome RunConnection(ssl::context& server_ctx, ssl::context& client_ctx, const std::string& expected_server_name) {
  asio::io_context io;
  tcp::acceptor acceptor(io, tcp::endpoint(asio::ip::address_v4::loopback(), 0));
  TlsSocket server(io, server_ctx);
  TlsSocket client(io, client_ctx);
  asio::steady_timer timeout(io, kOverallTimeout);
  Outcome out;
  int sides_running = 2;
  auto side_done = [&] {
    if (--sides_running == 0) timeout.cancel();
  };
  timeout.async_wait([&](const boost::system::error_code& ec) {
    if (ec) return;  // cancelled: both sides finished in time
    out.timed_out = true;
    boost::system::error_code ignored;
    acceptor.close(ignored);
    server.lowest_layer().close(ignored);
    client.lowest_layer().close(ignored);
  });

  char server_byte = kGreeting;
  acceptor.async_accept(server.lowest_layer(), [&](const boost::system::error_code& ec) {
    if (ec) {
      out.server.failure = ec.message();
      side_done();
      return;
    }
    server.async_handshake(ssl::stream_base::server, [&](const boost::system::error_code& ec) {
      if (ec) {
        out.server.failure = HandshakeFailureReason(server.native_handle(), ec);
        boost::system::error_code ignored;
        server.lowest_layer().close(ignored);
        side_done();
        return;
      }
      out.server.handshake_ok = true;
      if (auto cn = PeerCommonName(server.native_handle()); cn.ok()) out.server.peer_cn = *cn;
      asio::async_write(server, asio::buffer(&server_byte, 1),
                        [&](const boost::system::error_code& ec, size_t) {
                          out.server.greeting_ok = !ec;
                          if (ec) out.server.greeting_failure = ec.message();
                          side_done();
                        });
    });
  });

  if (!expected_server_name.empty()) {
    Status status = VerifyServerName(client.native_handle(), expected_server_name);
    EXPECT_TRUE(status.ok()) << status.ToString();
  }
  char client_byte = 0;
  client.lowest_layer().async_connect(acceptor.local_endpoint(), [&](const boost::system::error_code& ec) {
    if (ec) {
      out.client.failure = ec.message();
      side_done();
      return;
    }
    client.async_handshake(ssl::stream_base::client, [&](const boost::system::error_code& ec) {
      if (ec) {
        out.client.failure = HandshakeFailureReason(client.native_handle(), ec);
        out.client.revoked_alert = IsCertificateRevokedAlert(ec);
        boost::system::error_code ignored;
        client.lowest_layer().close(ignored);
        side_done();
        return;
      }
      out.client.handshake_ok = true;
      out.client.cipher = SSL_CIPHER_get_name(SSL_get_current_cipher(client.native_handle()));
      const int sigalgs = SSL_get_sigalgs(client.native_handle(), 0, nullptr, nullptr, nullptr, nullptr, nullptr);
      for (int i = 0; i < sigalgs; ++i) {
        unsigned char sig = 0, hash = 0;
        SSL_get_sigalgs(client.native_handle(), i, nullptr, nullptr, nullptr, &sig, &hash);
        out.client.peer_sigalgs.push_back(uint16_t(hash << 8 | sig));
      }
      if (auto cn = PeerCommonName(client.native_handle()); cn.ok()) out.client.peer_cn = *cn;
      asio::async_read(client, asio::buffer(&client_byte, 1), [&](const boost::system::error_code& ec, size_t) {
        out.client.greeting_ok = !ec && client_byte == kGreeting;
        // Tickets arrive after the handshake, before the first data.
        SSL_SESSION* session = SSL_get0_session(client.native_handle());
        out.client.resumable = session != nullptr && SSL_SESSION_is_resumable(session) == 1;
        if (ec) out.client.greeting_failure = HandshakeFailureReason(client.native_handle(), ec);
        out.client.revoked_alert = IsCertificateRevokedAlert(ec);
        side_done();
      });
    });
  });

  io.run();
  return out;
}

std::string Describe(const Outcome& out) {
  return fmt::format("timed_out={} server[ok={} failure='{}' greeting='{}'] client[ok={} failure='{}' greeting='{}']",
                     out.timed_out, out.server.handshake_ok, out.server.failure, out.server.greeting_failure,
                     out.client.handshake_ok, out.client.failure, out.client.greeting_failure);
}

class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir;
    foreign_ = new TempDir;
    const auto& d = dir_->path();
    ASSERT_TRUE(InitCa(d).ok());
    ASSERT_TRUE(IssueCertificate(d, "server", {.role = CertRole::kServer}).ok());
    ASSERT_TRUE(IssueCertificate(d, "elsewhere", {.role = CertRole::kServer, .dns = {"fl.example.org"}}).ok());
    ASSERT_TRUE(IssueCertificate(d, "site-a").ok());
    ASSERT_TRUE(IssueCertificate(d, "site-b").ok());
    // The same two certificates with no extendedKeyUsage: valid for every use, as far as OpenSSL is concerned.
    WithExtendedKeyUsage("site-b", "site-unstated", "");
    WithExtendedKeyUsage("server", "server-unstated", "");
    // As every certificate was issued before roles: both, and the loopback names.
    WithExtendedKeyUsage("server", "both-roles", "serverAuth,clientAuth");
    ASSERT_TRUE(IssueCertificate(d, "site-old", {.not_before = -std::chrono::hours(48),
                                                 .not_after = -std::chrono::hours(24)})
                    .ok());
    ASSERT_TRUE(InitCa(foreign_->path(), "foreign-ca").ok());
    ASSERT_TRUE(IssueCertificateWith(foreign_->path() / "ca.pem", foreign_->path() / "ca.key", "site-a",
                                     d / "intruder.pem", d / "intruder.key")
                    .ok());
  }
  static void TearDownTestSuite() {
    delete dir_;
    delete foreign_;
  }

  static TlsFiles FilesFor(const std::string& name) {
    const auto& d = dir_->path();
    return {d / (name + ".pem"), d / (name + ".key"), d / "ca.pem"};
  }
  // name.pem re-signed by the CA as out.pem/out.key with extendedKeyUsage
  // `usage` ("serverAuth,clientAuth"; empty: without the extension).
  static void WithExtendedKeyUsage(const std::string& name, const std::string& out, const std::string& usage) {
    const auto& d = dir_->path();
    auto cert = internal::ReadCertificate(d / (name + ".pem"));
    auto ca_key = internal::ReadPrivateKey(d / "ca.key");
    ASSERT_TRUE(cert.ok() && ca_key.ok());
    X509_EXTENSION* eku = X509_delete_ext(cert->get(), X509_get_ext_by_NID(cert->get(), NID_ext_key_usage, -1));
    ASSERT_NE(eku, nullptr);
    X509_EXTENSION_free(eku);
    if (!usage.empty()) {
      X509_EXTENSION* stated = X509V3_EXT_conf_nid(nullptr, nullptr, NID_ext_key_usage, usage.c_str());
      ASSERT_NE(stated, nullptr);
      ASSERT_EQ(X509_add_ext(cert->get(), stated, -1), 1);
      X509_EXTENSION_free(stated);
    }
    ASSERT_GT(X509_sign(cert->get(), ca_key->get(), EVP_sha256()), 0);
    internal::BioPtr bio(BIO_new_file((d / (out + ".pem")).c_str(), "w"));
    ASSERT_EQ(PEM_write_bio_X509(bio.get(), cert->get()), 1);
    std::filesystem::copy_file(d / (name + ".key"), d / (out + ".key"));
  }
  // A context as OpenSSL makes it (TLS 1.3, its default groups and signature
  // algorithms, its default purpose check) with `name`'s certificate: a peer
  // that does not run our code. `tweak` narrows it further.
  static std::shared_ptr<ssl::context> Plain(const std::string& name, bool server,
                                             const std::function<void(SSL_CTX*)>& tweak = {}) {
    auto ctx = std::make_shared<ssl::context>(ssl::context::tls);
    SSL_CTX_set_min_proto_version(ctx->native_handle(), TLS1_3_VERSION);
    ctx->use_certificate_chain_file(FilesFor(name).cert.string());
    ctx->use_private_key_file(FilesFor(name).key.string(), ssl::context::pem);
    ctx->load_verify_file(FilesFor(name).ca.string());
    ctx->set_verify_mode(server ? ssl::verify_peer | ssl::verify_fail_if_no_peer_cert : ssl::verify_peer);
    if (tweak) tweak(ctx->native_handle());
    return ctx;
  }
  static std::shared_ptr<ssl::context> Server() {
    auto ctx = MakeServerContext(FilesFor("server"));
    EXPECT_TRUE(ctx.ok()) << ctx.status().ToString();
    return ctx.ok() ? *ctx : nullptr;
  }
  static std::shared_ptr<ssl::context> Client(const std::string& name) {
    auto ctx = MakeClientContext(FilesFor(name));
    EXPECT_TRUE(ctx.ok()) << ctx.status().ToString();
    return ctx.ok() ? *ctx : nullptr;
  }

  static TempDir* dir_;
  static TempDir* foreign_;
};
TempDir* TlsTest::dir_ = nullptr;
TempDir* TlsTest::foreign_ = nullptr;

TEST_F(TlsTest, ValidClientIsAccepted) {
  auto server = Server();
  auto client = Client("site-a");
  ASSERT_TRUE(server && client);
  Outcome out = RunConnection(*server, *client, "");
  ASSERT_FALSE(out.timed_out) << Describe(out);
  EXPECT_TRUE(out.server.handshake_ok) << Describe(out);
  EXPECT_TRUE(out.client.handshake_ok) << Describe(out);
  EXPECT_EQ(out.server.peer_cn, "site-a");
  EXPECT_EQ(out.client.peer_cn, "server");
  EXPECT_TRUE(out.server.greeting_ok && out.client.greeting_ok) << Describe(out);
  // OpenSSL's default order would pick AES-256-GCM; the server's preference wins.
  EXPECT_EQ(out.client.cipher, "TLS_AES_128_GCM_SHA256");
  EXPECT_FALSE(out.client.resumable) << "the server issues no session tickets: every connection is verified afresh";
}

TEST_F(TlsTest, ClientWithoutCertificateIsRefused) {
  auto server = Server();
  ASSERT_TRUE(server);
  ssl::context anonymous(ssl::context::tls);
  anonymous.load_verify_file((dir_->path() / "ca.pem").string());
  anonymous.set_verify_mode(ssl::verify_peer);
  Outcome out = RunConnection(*server, anonymous, "");
  ASSERT_FALSE(out.timed_out) << Describe(out);
  EXPECT_FALSE(out.server.handshake_ok) << Describe(out);
  EXPECT_NE(out.server.failure.find("certificate"), std::string::npos) << Describe(out);
  EXPECT_FALSE(out.client.greeting_ok) << Describe(out);
}

TEST_F(TlsTest, ClientFromForeignCaIsRefused) {
  auto server = Server();
  auto client = Client("intruder");
  ASSERT_TRUE(server && client);
  Outcome out = RunConnection(*server, *client, "");
  ASSERT_FALSE(out.timed_out) << Describe(out);
  EXPECT_FALSE(out.server.handshake_ok) << Describe(out);
  EXPECT_NE(out.server.failure.find("verify"), std::string::npos) << Describe(out);
  EXPECT_FALSE(out.client.greeting_ok) << Describe(out);
}

TEST_F(TlsTest, ExpiredClientIsRefused) {
  auto server = Server();
  auto client = Client("site-old");
  ASSERT_TRUE(server && client);
  Outcome out = RunConnection(*server, *client, "");
  ASSERT_FALSE(out.timed_out) << Describe(out);
  EXPECT_FALSE(out.server.handshake_ok) << Describe(out);
  EXPECT_NE(out.server.failure.find("expired"), std::string::npos) << Describe(out);
  EXPECT_FALSE(out.client.greeting_ok) << Describe(out);
}

TEST_F(TlsTest, Tls12ClientIsRefused) {
  auto server = Server();
  ASSERT_TRUE(server);
  // A well-configured client except that it stops at TLS 1.2.
  ssl::context legacy(ssl::context::tls);
  ASSERT_EQ(SSL_CTX_set_max_proto_version(legacy.native_handle(), TLS1_2_VERSION), 1);
  legacy.use_certificate_chain_file((dir_->path() / "site-a.pem").string());
  legacy.use_private_key_file((dir_->path() / "site-a.key").string(), ssl::context::pem);
  legacy.load_verify_file((dir_->path() / "ca.pem").string());
  legacy.set_verify_mode(ssl::verify_peer);
  Outcome out = RunConnection(*server, legacy, "");
  ASSERT_FALSE(out.timed_out) << Describe(out);
  EXPECT_FALSE(out.server.handshake_ok) << Describe(out);
  EXPECT_FALSE(out.client.handshake_ok) << Describe(out);
  EXPECT_NE(out.server.failure.find("protocol"), std::string::npos) << Describe(out);
}

TEST_F(TlsTest, ServerNameVerification) {
  auto server = Server();
  auto client = Client("site-a");
  ASSERT_TRUE(server && client);
  for (const std::string good : {"127.0.0.1", "localhost", "::1", "[::1]"}) {
    Outcome out = RunConnection(*server, *client, good);
    ASSERT_FALSE(out.timed_out) << good << ": " << Describe(out);
    EXPECT_TRUE(out.client.handshake_ok && out.server.handshake_ok) << good << ": " << Describe(out);
  }
  struct Wrong {
    std::string name;
    std::string verify_error;
  };
  // The certificate's name is not a host name: only its subjectAltName counts.
  for (const Wrong& wrong : {Wrong{"wrong.example", "hostname mismatch"}, Wrong{"site-a", "hostname mismatch"},
                             Wrong{"server", "hostname mismatch"}, Wrong{"10.1.2.3", "IP address mismatch"}}) {
    Outcome out = RunConnection(*server, *client, wrong.name);
    ASSERT_FALSE(out.timed_out) << wrong.name << ": " << Describe(out);
    EXPECT_FALSE(out.client.handshake_ok) << wrong.name << ": " << Describe(out);
    EXPECT_NE(out.client.failure.find(wrong.verify_error), std::string::npos) << wrong.name << ": " << Describe(out);
    EXPECT_FALSE(out.server.handshake_ok) << wrong.name << ": " << Describe(out);
  }
}

// The server's certificate presented by a site: refused, though the CA signed it.
TEST_F(TlsTest, TheServersCertificateIsRefusedAsASite) {
  auto server = Server();
  ASSERT_TRUE(server);
  for (const char* name : {"server", "server-unstated", "both-roles"}) {
    Outcome out = RunConnection(*server, *Plain(name, false), "");
    ASSERT_FALSE(out.timed_out) << name << ": " << Describe(out);
    EXPECT_FALSE(out.server.handshake_ok) << name << ": " << Describe(out);
    EXPECT_NE(out.server.failure.find("unsuitable certificate purpose"), std::string::npos)
        << name << ": " << Describe(out);
    EXPECT_FALSE(out.client.greeting_ok) << name << ": " << Describe(out);
  }
}

// A server holding a site's certificate, or a server's for other hosts: a
// site refuses it at the handshake.
TEST_F(TlsTest, ASiteRefusesAServerThatIsNotTheServerItDialled) {
  auto client = Client("site-a");
  ASSERT_TRUE(client);
  struct Rogue {
    std::string cert;
    std::string verify_error;
  };
  for (const Rogue& rogue : {Rogue{"site-b", "unsuitable certificate purpose"},
                             Rogue{"site-unstated", "IP address mismatch"},  // it names no host either
                             Rogue{"server-unstated", "unsuitable certificate purpose"},
                             // A certificate issued before roles names 127.0.0.1 and states serverAuth, but
                             // clientAuth too: any site's could have been it.
                             Rogue{"both-roles", "unsuitable certificate purpose"},
                             Rogue{"elsewhere", "IP address mismatch"}}) {
    Outcome out = RunConnection(*Plain(rogue.cert, true), *client, "127.0.0.1");
    ASSERT_FALSE(out.timed_out) << rogue.cert << ": " << Describe(out);
    EXPECT_FALSE(out.client.handshake_ok) << rogue.cert << ": " << Describe(out);
    EXPECT_NE(out.client.failure.find(rogue.verify_error), std::string::npos) << rogue.cert << ": " << Describe(out);
  }
  // The server's certificate for a DNS name verifies under that name only.
  Outcome named = RunConnection(*Plain("elsewhere", true), *client, "fl.example.org");
  EXPECT_TRUE(named.client.handshake_ok && named.client.greeting_ok) << Describe(named);
}

// Our own certificate in the wrong role is refused before any handshake,
// naming the file.
TEST_F(TlsTest, AContextRefusesACertificateOfTheOtherRole) {
  struct Case {
    Result<std::shared_ptr<ssl::context>> made;
    std::string name;
    std::string problem;
  };
  Case cases[] = {{MakeServerContext(FilesFor("site-a")), "site-a", "not a server certificate"},
                  {MakeServerContext(FilesFor("server-unstated")), "server-unstated", "not a server certificate"},
                  {MakeClientContext(FilesFor("server")), "server", "not a site certificate"},
                  {MakeClientContext(FilesFor("site-unstated")), "site-unstated", "not a site certificate"}};
  for (const Case& c : cases) {
    ASSERT_FALSE(c.made.ok()) << c.name;
    EXPECT_EQ(c.made.status().message(),
              fmt::format("crypto: {}: {}: its extendedKeyUsage lacks {}", FilesFor(c.name).cert.string(), c.problem,
                          c.problem == "not a server certificate" ? "serverAuth" : "clientAuth"));
  }
  // A certificate issued before roles, either way: it says how to replace it.
  for (const bool server : {true, false}) {
    auto made = server ? MakeServerContext(FilesFor("both-roles")) : MakeClientContext(FilesFor("both-roles"));
    ASSERT_FALSE(made.ok()) << server;
    EXPECT_EQ(made.status().message(),
              fmt::format("crypto: {}: not a {} certificate: its extendedKeyUsage states both serverAuth and clientAuth "
                          "(issued before certificate roles); issue it anew (estuary-server certs issue{})",
                          FilesFor("both-roles").cert.string(), server ? "server" : "site",
                          server ? " --role server --dns/--ip ..." : ""));
  }
  EXPECT_FALSE(LoadIdentity(FilesFor("both-roles").cert, FilesFor("both-roles").key).ok());
  auto identity = LoadIdentity(FilesFor("server").cert, FilesFor("server").key);
  ASSERT_FALSE(identity.ok());
  EXPECT_NE(identity.status().message().find("not a site certificate"), std::string::npos)
      << identity.status().message();
  EXPECT_TRUE(LoadIdentity(FilesFor("site-a").cert, FilesFor("site-a").key).ok());
}

// The groups a peer may offer: X25519 and P-256 only. What OpenSSL offers by
// default besides costs the server far more per handshake (ffdhe8192: about
// 300 times X25519's), so a ClientHello with only those is refused at once.
TEST_F(TlsTest, TheServerTakesOnlyTheModernGroups) {
  auto server = Server();
  ASSERT_TRUE(server);
  std::vector<std::string> accepted;
  for (const char* group : {"X25519", "P-256", "P-384", "P-521", "X448", "ffdhe2048", "ffdhe3072", "ffdhe4096",
                            "ffdhe6144", "ffdhe8192"}) {
    auto client = Plain("site-a", false, [&](SSL_CTX* ctx) { ASSERT_EQ(SSL_CTX_set1_groups_list(ctx, group), 1); });
    Outcome out = RunConnection(*server, *client, "");
    ASSERT_FALSE(out.timed_out) << group << ": " << Describe(out);
    if (out.server.handshake_ok && out.client.greeting_ok) {
      accepted.push_back(group);
    } else {
      EXPECT_NE(out.server.failure.find("no suitable key share"), std::string::npos) << group << ": " << Describe(out);
    }
  }
  EXPECT_EQ(accepted, (std::vector<std::string>{"X25519", "P-256"}));
}

// Each end offers exactly the profile: the client in its ClientHello (groups
// and signature algorithms), the server in its CertificateRequest.
TEST_F(TlsTest, BothEndsOfferOnlyTheProfile) {
  struct Hello {
    std::vector<uint16_t> groups, sigalgs;
  } hello;
  auto listen = Plain("server", true, [&](SSL_CTX* ctx) {
    SSL_CTX_set_client_hello_cb(
        ctx,
        [](SSL* ssl, int*, void* arg) {
          auto list = [&](unsigned type) {
            const unsigned char* data = nullptr;
            size_t size = 0;
            std::vector<uint16_t> out;
            if (SSL_client_hello_get0_ext(ssl, type, &data, &size) != 1 || size < 2) return out;
            for (size_t i = 2; i + 1 < size; i += 2) out.push_back(uint16_t(data[i] << 8 | data[i + 1]));
            return out;
          };
          auto* seen = static_cast<Hello*>(arg);
          seen->groups = list(TLSEXT_TYPE_supported_groups);
          seen->sigalgs = list(TLSEXT_TYPE_signature_algorithms);
          return int(SSL_CLIENT_HELLO_SUCCESS);
        },
        &hello);
  });
  auto client = Client("site-a");
  ASSERT_TRUE(client);
  Outcome out = RunConnection(*listen, *client, "127.0.0.1");
  EXPECT_TRUE(out.client.handshake_ok) << Describe(out);
  constexpr uint16_t kX25519 = 0x001d, kSecp256r1 = 0x0017, kEcdsaSecp256r1Sha256 = 0x0403;
  EXPECT_EQ(hello.groups, (std::vector<uint16_t>{kX25519, kSecp256r1}));
  EXPECT_EQ(hello.sigalgs, (std::vector<uint16_t>{kEcdsaSecp256r1Sha256}));

  auto server = Server();
  ASSERT_TRUE(server);
  Outcome asked = RunConnection(*server, *Plain("site-a", false), "");
  ASSERT_TRUE(asked.client.handshake_ok) << Describe(asked);
  EXPECT_EQ(asked.client.peer_sigalgs, (std::vector<uint16_t>{kEcdsaSecp256r1Sha256}));

  // And a server that insists on a slow group finds no client to take it.
  auto slow = Plain("server", true, [](SSL_CTX* ctx) { ASSERT_EQ(SSL_CTX_set1_groups_list(ctx, "ffdhe2048"), 1); });
  Outcome refused = RunConnection(*slow, *client, "127.0.0.1");
  ASSERT_FALSE(refused.timed_out) << Describe(refused);
  EXPECT_FALSE(refused.client.handshake_ok) << Describe(refused);
}

TEST_F(TlsTest, VerifyServerNameRejectsEmpty) {
  auto client = Client("site-a");
  ASSERT_TRUE(client);
  std::unique_ptr<SSL, decltype(&SSL_free)> ssl(SSL_new(client->native_handle()), &SSL_free);
  EXPECT_EQ(VerifyServerName(ssl.get(), "").code(), Code::kInvalidArgument);
}

TEST_F(TlsTest, PeerCommonNameNeedsAPeer) {
  auto client = Client("site-a");
  ASSERT_TRUE(client);
  std::unique_ptr<SSL, decltype(&SSL_free)> ssl(SSL_new(client->native_handle()), &SSL_free);
  EXPECT_FALSE(PeerCommonName(ssl.get()).ok());
}

// Every bad-file case yields one line that names the offending file.
TEST_F(TlsTest, FileErrorsNameTheFile) {
  TempDir scratch;
  const auto& d = dir_->path();
  const auto& s = scratch.path();
  WriteText(s / "not-pem.pem", "hello, I am not a certificate\n");
  WriteText(s / "bad-body.pem", "-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n");
  WriteText(s / "bad-key.key", "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n");
  WriteText(s / "empty.pem", "");
  std::filesystem::copy_file(d / "site-a.key", s / "key-only.pem");

  struct Case {
    TlsFiles files;
    std::filesystem::path blamed;
    std::string problem;
  };
  const std::vector<Case> cases = {
      {{s / "missing.pem", d / "server.key", d / "ca.pem"}, s / "missing.pem", "no such file"},
      {{d / "server.pem", s / "missing.key", d / "ca.pem"}, s / "missing.key", "no such file"},
      {{d / "server.pem", d / "server.key", s / "missing-ca.pem"}, s / "missing-ca.pem", "no such file"},
      {{s / "not-pem.pem", d / "server.key", d / "ca.pem"}, s / "not-pem.pem", "not a PEM file"},
      {{s / "empty.pem", d / "server.key", d / "ca.pem"}, s / "empty.pem", "empty"},
      {{s / "bad-body.pem", d / "server.key", d / "ca.pem"}, s / "bad-body.pem", "cannot read certificate"},
      {{s / "key-only.pem", d / "server.key", d / "ca.pem"}, s / "key-only.pem", "cannot read certificate"},
      {{d / "server.pem", s / "bad-key.key", d / "ca.pem"}, s / "bad-key.key", "cannot read private key"},
      {{d / "server.pem", d / "site-a.key", d / "ca.pem"}, d / "site-a.key", "does not match"},
      {{d / "server.pem", d / "server.key", s}, s, "directory"},
  };
  for (const Case& c : cases) {
    for (bool server_side : {true, false}) {
      auto ctx = server_side ? MakeServerContext(c.files) : MakeClientContext(c.files);
      ASSERT_FALSE(ctx.ok()) << c.blamed;
      const std::string& message = ctx.status().message();
      EXPECT_EQ(message.rfind("crypto: " + c.blamed.string() + ": ", 0), 0u) << message;
      EXPECT_NE(message.find(c.problem), std::string::npos) << message;
      EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    }
  }
}

// A federation whose CA keeps a revocation list (crypto/revocation.h).
class TlsRevocation : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(InitCa(dir()).ok());
    ASSERT_TRUE(IssueCertificate(dir(), "server", {.role = CertRole::kServer}).ok());
    for (const char* name : {"site-a", "site-b"}) ASSERT_TRUE(IssueCertificate(dir(), name).ok());
    ASSERT_TRUE(RenewCrl(dir()).ok());  // an empty list
  }
  const std::filesystem::path& dir() const { return dir_.path(); }
  TlsFiles FilesFor(const std::string& name, bool with_crl) const {
    return {dir() / (name + ".pem"), dir() / (name + ".key"), dir() / "ca.pem", with_crl ? dir() / "crl.pem" : ""};
  }
  std::shared_ptr<ssl::context> Server() {
    auto ctx = MakeServerContext(FilesFor("server", true));
    EXPECT_TRUE(ctx.ok()) << ctx.status().ToString();
    return ctx.ok() ? *ctx : nullptr;
  }
  std::shared_ptr<ssl::context> Client(const std::string& name, bool with_crl = false) {
    auto ctx = MakeClientContext(FilesFor(name, with_crl));
    EXPECT_TRUE(ctx.ok()) << ctx.status().ToString();
    return ctx.ok() ? *ctx : nullptr;
  }
  bool Accepted(ssl::context& server, const std::string& client) {
    Outcome out = RunConnection(server, *Client(client), "");
    EXPECT_FALSE(out.timed_out) << Describe(out);
    return out.server.handshake_ok && out.client.greeting_ok;
  }
  TempDir dir_;
};

TEST_F(TlsRevocation, ARevokedClientIsRefusedAndHearsWhy) {
  ASSERT_TRUE(RevokeCertificate(dir(), "site-b").ok());
  auto server = Server();
  ASSERT_TRUE(server);
  EXPECT_TRUE(Accepted(*server, "site-a"));
  Outcome out = RunConnection(*server, *Client("site-b"), "");
  ASSERT_FALSE(out.timed_out) << Describe(out);
  EXPECT_FALSE(out.server.handshake_ok) << Describe(out);
  EXPECT_NE(out.server.failure.find("certificate revoked"), std::string::npos) << Describe(out);
  EXPECT_FALSE(out.client.greeting_ok) << Describe(out);
  EXPECT_TRUE(out.client.revoked_alert) << Describe(out);
  // Without the list the same server context would take site-b: the list is what refuses it.
  auto without = MakeServerContext(FilesFor("server", false));
  ASSERT_TRUE(without.ok());
  EXPECT_TRUE(Accepted(**without, "site-b"));
}

TEST_F(TlsRevocation, AReloadAppliesToTheNextHandshakeAndABadFileChangesNothing) {
  auto server = Server();
  ASSERT_TRUE(server);
  EXPECT_TRUE(Accepted(*server, "site-b"));
  ASSERT_TRUE(RevokeCertificate(dir(), "site-b").ok());
  EXPECT_TRUE(Accepted(*server, "site-b")) << "the list on disk applies only once reloaded";
  auto reloaded = ReloadCrl(*server, FilesFor("server", true));
  ASSERT_TRUE(reloaded.ok()) << reloaded.status().ToString();
  EXPECT_EQ(reloaded->number, 2u);
  ASSERT_EQ(reloaded->revoked.size(), 1u);
  EXPECT_FALSE(Accepted(*server, "site-b"));
  EXPECT_TRUE(Accepted(*server, "site-a"));
  // A garbled list is refused in one line and the one in force stays.
  WriteText(dir() / "crl.pem", "-----BEGIN X509 CRL-----\nAAAA\n-----END X509 CRL-----\n");
  auto bad = ReloadCrl(*server, FilesFor("server", true));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("crl.pem: cannot read a certificate revocation list"), std::string::npos)
      << bad.status().message();
  EXPECT_FALSE(Accepted(*server, "site-b"));
  EXPECT_TRUE(Accepted(*server, "site-a"));
}

TEST_F(TlsRevocation, AClientWithTheListRefusesARevokedServer) {
  ASSERT_TRUE(RevokeCertificate(dir(), "server").ok());
  auto server = MakeServerContext(FilesFor("server", false));
  ASSERT_TRUE(server.ok());
  Outcome out = RunConnection(**server, *Client("site-a", true), "");
  ASSERT_FALSE(out.timed_out) << Describe(out);
  EXPECT_FALSE(out.client.handshake_ok) << Describe(out);
  EXPECT_NE(out.client.failure.find("certificate revoked"), std::string::npos) << Describe(out);
}

TEST_F(TlsRevocation, AListFromAnotherCaIsRefusedWhenTheContextIsMade) {
  TempDir foreign;
  ASSERT_TRUE(InitCa(foreign.path(), "foreign-ca").ok());
  ASSERT_TRUE(RenewCrl(foreign.path()).ok());
  TlsFiles files = FilesFor("server", false);
  files.crl = foreign.path() / "crl.pem";
  auto ctx = MakeServerContext(files);
  ASSERT_FALSE(ctx.ok());
  EXPECT_EQ(ctx.status().message().rfind("crypto: " + files.crl.string() + ": not issued and signed by", 0), 0u)
      << ctx.status().message();
}

}  // namespace
}  // namespace estuary::crypto
