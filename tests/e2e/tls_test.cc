// End-to-end: the TLS profile and the certificate roles of the real
// estuary-server and estuary-client binaries, from outside.
//
//   - a scan of the running server: a ClientHello recorded once per key
//     exchange group, signature algorithm set and protocol version, each
//     offering only that, replayed over TCP as an attacker would; only
//     X25519 and P-256 under TLS 1.3 get a ServerHello, and 40 replays of the
//     costliest (ffdhe8192, 145 ms of server CPU each before) cost the server
//     almost nothing;
//   - a rogue server holding a site's certificate: a real estuary-client
//     refuses it at the handshake, sends it nothing and exits saying why;
//   - a server reached by IP address or by DNS name verifies when its
//     certificate names that address or name (certs issue --dns/--ip), and is
//     refused by one that it does not;
//   - `certs issue` gives sites client authentication only and the server
//     server authentication only; the server will not start with a site's;
//   - an upload's checksum in upper case is the same checksum.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cstring>
#include <fstream>
#include <functional>
#include <thread>

#include "crypto/certs.h"
#include "crypto/openssl_util.h"
#include "proto/frame.h"
#include "tests/e2e/attacker.h"
#include "tests/e2e/federation.h"
#include "tests/e2e/harness.h"

namespace estuary::testing {
namespace {

namespace asio = boost::asio;
namespace ssl = boost::asio::ssl;
using tcp = asio::ip::tcp;

// A blocking TCP connection to 127.0.0.1:port whose reads give up after 10 s.
class Socket {
 public:
  explicit Socket(uint16_t port) : fd_(socket(AF_INET, SOCK_STREAM, 0)) {
    timeval timeout{10, 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
    setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(port);
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = connect(fd_, reinterpret_cast<sockaddr*>(&to), sizeof to) == 0;
  }
  ~Socket() { close(fd_); }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  int fd() const { return fd_; }
  bool connected() const { return connected_; }
  bool Send(const std::string& bytes) {
    for (size_t sent = 0; sent < bytes.size();) {
      const ssize_t n = send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return false;
      sent += size_t(n);
    }
    return true;
  }
  // Exactly n bytes, or fewer when the peer closed or went quiet.
  std::string Read(size_t n) {
    std::string out(n, '\0');
    size_t got = 0;
    while (got < n) {
      const ssize_t r = recv(fd_, out.data() + got, n - got, 0);
      if (r <= 0) break;
      got += size_t(r);
    }
    out.resize(got);
    return out;
  }

 private:
  int fd_;
  bool connected_ = false;
};

using Tweak = std::function<bool(SSL_CTX*)>;  // false: this OpenSSL cannot make such a hello

// The bytes of the first flight of a client made by OpenSSL and narrowed by
// `tweak`: one ClientHello, as a recording an attacker replays at will.
Result<std::string> RecordHelloWith(const Tweak& tweak) {
  std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> ctx(SSL_CTX_new(TLS_client_method()), SSL_CTX_free);
  SSL_CTX_set_security_level(ctx.get(), 0);  // let it offer what a default build refuses to
  if (!tweak(ctx.get())) return FailedPrecondition("this OpenSSL cannot offer it: {}", crypto::internal::TakeOpenSslErrors());
  std::unique_ptr<SSL, decltype(&SSL_free)> ssl(SSL_new(ctx.get()), SSL_free);
  BIO* in = BIO_new(BIO_s_mem());
  BIO* out = BIO_new(BIO_s_mem());
  SSL_set_bio(ssl.get(), in, out);
  SSL_set_connect_state(ssl.get());
  (void)SSL_do_handshake(ssl.get());  // wants to read the answer: the hello is written
  char* data = nullptr;
  const long size = BIO_get_mem_data(out, &data);
  if (size <= 0) return Internal("no ClientHello: {}", crypto::internal::TakeOpenSslErrors());
  return std::string(data, size_t(size));
}

// What the server answered a replayed ClientHello with.
struct Answer {
  bool server_hello = false;  // a ServerHello: the server went on with the handshake
  int alert = -1;             // or the alert it refused it with
  std::string Describe() const {
    return server_hello ? "ServerHello" : alert >= 0 ? fmt::format("alert {}", alert) : "closed without a word";
  }
};

constexpr int kHandshakeFailure = 40;
constexpr int kProtocolVersion = 70;

Answer Replay(uint16_t port, const std::string& hello) {
  Socket socket(port);
  Answer answer;
  if (!socket.connected() || !socket.Send(hello)) return answer;
  const std::string header = socket.Read(5);
  if (header.size() < 5) return answer;
  const size_t length = size_t(uint8_t(header[3])) << 8 | uint8_t(header[4]);
  const std::string body = socket.Read(length);
  if (header[0] == 0x16 && !body.empty() && body[0] == 0x02) {
    // A HelloRetryRequest is a ServerHello with this random: the server asks
    // for another group, so it took none offered.
    static constexpr uint8_t kRetry[] = {0xcf, 0x21, 0xad, 0x74, 0xe5, 0x9a, 0x61, 0x11};
    answer.server_hello = body.size() < 6 + sizeof kRetry || std::memcmp(body.data() + 6, kRetry, sizeof kRetry) != 0;
  } else if (header[0] == 0x15 && body.size() == 2) {
    answer.alert = uint8_t(body[1]);
  }
  return answer;
}

// A whole handshake as a site, with a client OpenSSL makes and `tweak`
// narrows, then Hello and Welcome over it.
struct Session {
  std::string error;          // empty: it worked
  std::string group;          // the key exchange negotiated
  std::vector<uint16_t> asked;  // the signature algorithms the server's CertificateRequest allows
  bool welcomed = false;
};

Session SiteSession(uint16_t port, const crypto::TlsFiles& files, const Tweak& tweak) {
  Session out;
  std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> ctx(SSL_CTX_new(TLS_client_method()), SSL_CTX_free);
  SSL_CTX_set_min_proto_version(ctx.get(), TLS1_3_VERSION);
  if (SSL_CTX_use_certificate_chain_file(ctx.get(), files.cert.c_str()) != 1 ||
      SSL_CTX_use_PrivateKey_file(ctx.get(), files.key.c_str(), SSL_FILETYPE_PEM) != 1 ||
      SSL_CTX_load_verify_locations(ctx.get(), files.ca.c_str(), nullptr) != 1 || !tweak(ctx.get())) {
    out.error = "client context: " + crypto::internal::TakeOpenSslErrors();
    return out;
  }
  SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER, nullptr);
  Socket socket(port);
  std::unique_ptr<SSL, decltype(&SSL_free)> ssl(SSL_new(ctx.get()), SSL_free);
  SSL_set_fd(ssl.get(), socket.fd());
  if (SSL_connect(ssl.get()) != 1) {
    out.error = "handshake: " + crypto::internal::TakeOpenSslErrors();
    return out;
  }
  const int nid = SSL_get_negotiated_group(ssl.get());
  out.group = SSL_group_to_name(ssl.get(), nid) ? SSL_group_to_name(ssl.get(), nid) : std::to_string(nid);
  const int count = SSL_get_sigalgs(ssl.get(), 0, nullptr, nullptr, nullptr, nullptr, nullptr);
  for (int i = 0; i < count; ++i) {
    unsigned char sig = 0, hash = 0;
    SSL_get_sigalgs(ssl.get(), i, nullptr, nullptr, nullptr, &sig, &hash);
    out.asked.push_back(uint16_t(hash << 8 | sig));
  }
  v1::Envelope hello;
  hello.mutable_hello()->set_protocol_version(proto::kProtocolVersion);
  hello.mutable_hello()->set_num_examples(10);
  const proto::Frame frame = proto::EncodeFrame(hello);
  if (SSL_write(ssl.get(), frame.data(), int(frame.size())) != int(frame.size())) {
    out.error = "write: " + crypto::internal::TakeOpenSslErrors();
    return out;
  }
  std::array<uint8_t, 4> header{};
  size_t got = 0;
  while (got < header.size()) {
    const int n = SSL_read(ssl.get(), header.data() + got, int(header.size() - got));
    if (n <= 0) break;
    got += size_t(n);
  }
  auto size = got == header.size() ? proto::ParseFrameHeader(header, 1 << 20) : Result<uint32_t>(Aborted("eof"));
  if (!size.ok()) {
    out.error = "read: " + size.status().message() + " " + crypto::internal::TakeOpenSslErrors();
    return out;
  }
  std::vector<uint8_t> body(*size);
  for (got = 0; got < body.size();) {
    const int n = SSL_read(ssl.get(), body.data() + got, int(body.size() - got));
    if (n <= 0) break;
    got += size_t(n);
  }
  auto welcome = proto::ParseEnvelope(body.data(), got);
  out.welcomed = welcome.ok() && welcome->has_welcome();
  if (!out.welcomed) out.error = "no welcome";
  return out;
}

Tweak Groups(const std::string& groups) {
  return [groups](SSL_CTX* ctx) {
    return SSL_CTX_set_min_proto_version(ctx, TLS1_3_VERSION) == 1 && SSL_CTX_set1_groups_list(ctx, groups.c_str()) == 1;
  };
}

// The server in the scan: the defaults of the e2e federation, waiting for a site.
TEST(TlsScan, OnlyTheModernGroupsSignatureAlgorithmsAndTls13AreTaken) {
  Federation f;
  f.Issue("site-a");
  const uint16_t port = f.StartServer(1, 1);
  ASSERT_NE(port, 0);

  // Key exchange groups, each offered alone.
  for (const char* group : {"X25519", "P-256"}) {
    auto hello = RecordHelloWith(Groups(group));
    ASSERT_TRUE(hello.ok()) << group << ": " << hello.status().ToString();
    const Answer answer = Replay(port, *hello);
    EXPECT_TRUE(answer.server_hello) << group << ": " << answer.Describe();
  }
  for (const char* group : {"P-384", "P-521", "X448", "ffdhe2048", "ffdhe3072", "ffdhe4096", "ffdhe6144", "ffdhe8192"}) {
    auto hello = RecordHelloWith(Groups(group));
    ASSERT_TRUE(hello.ok()) << group << ": " << hello.status().ToString();
    const Answer answer = Replay(port, *hello);
    EXPECT_EQ(answer.alert, kHandshakeFailure) << group << ": " << answer.Describe();
  }

  // Signature algorithms: a hello that allows the server's certificate none
  // but legacy or other-key ones.
  for (const char* sigalgs : {"ECDSA+SHA1", "RSA+SHA1", "RSA+SHA256", "rsa_pss_rsae_sha256", "rsa_pss_pss_sha256",
                              "ecdsa_secp384r1_sha384", "ecdsa_secp521r1_sha512", "ed25519", "ed448"}) {
    auto hello = RecordHelloWith([&](SSL_CTX* ctx) {
      return SSL_CTX_set_min_proto_version(ctx, TLS1_3_VERSION) == 1 && SSL_CTX_set1_sigalgs_list(ctx, sigalgs) == 1;
    });
    if (!hello.ok()) {  // OpenSSL will not even offer it under TLS 1.3
      std::printf("%s: not offered by this OpenSSL under TLS 1.3 (%s)\n", sigalgs, hello.status().ToString().c_str());
      continue;
    }
    // Refused with an alert: handshake_failure ("no shared signature
    // algorithms"), or for a hello of SHA-1 only, which TLS 1.3 forbids,
    // whatever alert OpenSSL picks.
    const Answer answer = Replay(port, *hello);
    EXPECT_FALSE(answer.server_hello) << sigalgs << ": " << answer.Describe();
    EXPECT_GE(answer.alert, 0) << sigalgs << ": " << answer.Describe();
    if (std::string(sigalgs).find("SHA1") == std::string::npos) {
      EXPECT_EQ(answer.alert, kHandshakeFailure) << sigalgs << ": " << answer.Describe();
    }
  }

  // Protocol versions before 1.3, each alone.
  for (const auto& [name, version] : {std::pair<const char*, int>{"TLS 1.0", TLS1_VERSION},
                                      {"TLS 1.1", TLS1_1_VERSION}, {"TLS 1.2", TLS1_2_VERSION}}) {
    auto hello = RecordHelloWith([version = version](SSL_CTX* ctx) {
      return SSL_CTX_set_min_proto_version(ctx, version) == 1 && SSL_CTX_set_max_proto_version(ctx, version) == 1 &&
             SSL_CTX_set_cipher_list(ctx, "ALL:@SECLEVEL=0") == 1;
    });
    ASSERT_TRUE(hello.ok()) << name << ": " << hello.status().ToString();
    const Answer answer = Replay(port, *hello);
    EXPECT_EQ(answer.alert, kProtocolVersion) << name << ": " << answer.Describe();
  }

  // What a refused hello costs the server now: 40 replays of the costliest
  // group (before: 145 ms of CPU each, about 6 s in all).
  auto costly = RecordHelloWith(Groups("ffdhe8192"));
  ASSERT_TRUE(costly.ok());
  const double cpu_before = CpuSeconds(f.server().pid());
  for (int i = 0; i < 40; ++i) EXPECT_EQ(Replay(port, *costly).alert, kHandshakeFailure) << i;
  const double cpu = CpuSeconds(f.server().pid()) - cpu_before;
  std::printf("server CPU for 40 refused ffdhe8192 ClientHellos: %.3f s\n", cpu);
  EXPECT_LT(cpu, 1.0) << "server CPU for 40 refused ffdhe8192 hellos: " << cpu << " s";

  // And a site gets through with either group; the server asks it to sign
  // with ECDSA P-256 and SHA-256, and nothing else.
  for (const char* group : {"X25519", "P-256"}) {
    const Session session = SiteSession(port, f.Files("site-a"), Groups(group));
    EXPECT_TRUE(session.error.empty() && session.welcomed) << group << ": " << session.error;
    EXPECT_EQ(session.group, group == std::string("X25519") ? "x25519" : "secp256r1") << group;
    EXPECT_EQ(session.asked, (std::vector<uint16_t>{0x0403})) << group << ": ecdsa_secp256r1_sha256 only";
  }
}

// A TLS server that runs none of our checks, holding a certificate the CA
// signed (a site's): what a site's stolen or misused key would be.
class RogueServer {
 public:
  explicit RogueServer(const crypto::TlsFiles& files)
      : context_(ssl::context::tls_server), acceptor_(io_, {asio::ip::make_address("127.0.0.1"), 0}) {
    context_.use_certificate_chain_file(files.cert.string());
    context_.use_private_key_file(files.key.string(), ssl::context::pem);
    context_.set_verify_mode(ssl::verify_none);
    Accept();
    thread_ = std::thread([this] { io_.run(); });
  }
  ~RogueServer() {
    io_.stop();
    thread_.join();
  }
  uint16_t port() const { return acceptor_.local_endpoint().port(); }
  int accepts() const { return accepts_; }
  int handshakes() const { return handshakes_; }
  size_t bytes() const { return bytes_; }  // application bytes the sites sent

 private:
  struct Connection {
    explicit Connection(tcp::socket s, ssl::context& context) : stream(std::move(s), context) {}
    ssl::stream<tcp::socket> stream;
    std::array<char, 4096> buffer;
  };
  void Accept() {
    acceptor_.async_accept([this](const boost::system::error_code& ec, tcp::socket socket) {
      if (ec) return;
      ++accepts_;
      auto connection = std::make_shared<Connection>(std::move(socket), context_);
      connection->stream.async_handshake(ssl::stream_base::server, [this, connection](const boost::system::error_code& ec) {
        if (ec) return;
        ++handshakes_;
        Read(connection);
      });
      Accept();
    });
  }
  void Read(const std::shared_ptr<Connection>& connection) {
    connection->stream.async_read_some(asio::buffer(connection->buffer),
                                       [this, connection](const boost::system::error_code& ec, size_t n) {
      bytes_ += n;
      if (!ec) Read(connection);
    });
  }
  asio::io_context io_;
  ssl::context context_;
  tcp::acceptor acceptor_;
  std::thread thread_;
  std::atomic<int> accepts_{0}, handshakes_{0};
  std::atomic<size_t> bytes_{0};
};

// estuary-client for `name`, dialling host:port.
std::unique_ptr<ChildProcess> StartClientAt(Federation& f, const std::string& name, const std::string& host,
                                            uint16_t port) {
  const auto files = f.Files(name);
  return std::make_unique<ChildProcess>(
      std::vector<std::string>{BinaryPath("estuary-client").string(), "--server", fmt::format("{}:{}", host, port),
                               "--cert", files.cert.string(), "--key", files.key.string(), "--ca", files.ca.string(),
                               "--data", f.data().string(), "--max-backoff", "1"},
      f.dir() / (name + ".log"));
}

// Before certificate roles, a real estuary-client trained for and uploaded
// to a server holding site-2's certificate. Now it refuses it at the handshake, sends it
// nothing (no Hello: not even its name), does not retry, and says why.
TEST(TlsRoles, ARealClientRefusesARogueServerHoldingASitesCertificate) {
  Federation f;
  f.Issue("site-1");
  f.Issue("site-2");
  RogueServer rogue(f.Files("site-2"));
  auto client = f.StartClient("site-1", rogue.port());
  const int exit_code = client->Wait(std::chrono::seconds(60));
  const std::string log = f.ClientLog("site-1");
  EXPECT_EQ(exit_code, 1) << log;
  EXPECT_NE(log.find(fmt::format("site-1: refused the server at 127.0.0.1:{}: its certificate failed verification "
                                 "(unsuitable certificate purpose): it is not the federation's server for that "
                                 "address; nothing was sent to it",
                                 rogue.port())),
            std::string::npos)
      << log;
  EXPECT_EQ(log.find("trained"), std::string::npos) << log;
  EXPECT_EQ(log.find("uploading"), std::string::npos) << log;
  EXPECT_EQ(rogue.accepts(), 1) << "not retried";
  EXPECT_EQ(rogue.bytes(), 0u) << "the rogue heard nothing from the site";
}

// The server refuses to run with a site's certificate, and sites refuse one
// that serves with the server's certificate (a server cannot join as a site).
TEST(TlsRoles, EachRoleStaysInItsPlace) {
  Federation f;
  f.Issue("site-a");
  const std::string server = BinaryPath("estuary-server").string();
  // (Bounded: a server that took the certificate would serve for ever.)
  const auto r = RunCommand(fmt::format("timeout 30 {} serve --listen 127.0.0.1:0 --cert {} --key {} --ca {} --db {}", server,
                                        f.Files("site-a").cert.string(), f.Files("site-a").key.string(),
                                        f.Files("site-a").ca.string(), (f.dir() / "x.db").string()));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find(f.Files("site-a").cert.string() +
                          ": not a server certificate: its extendedKeyUsage lacks serverAuth"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;

  // The server's own certificate as a site's, against the real server: its
  // handshake is refused and the server says why.
  const uint16_t port = f.StartServer(1, 1);
  auto client = RawClient::Connect(port, f.Files("server"));
  if (client.ok()) {
    EXPECT_TRUE((*client)->Closed()) << "the server must not talk to its own certificate";
  }
  EXPECT_TRUE(f.AwaitLog("unsuitable certificate purpose", std::chrono::seconds(10))) << f.ServerLog();
}

// Replaces the federation's server certificate with one `certs issue` makes
// from `flags`, as an operator would.
void ReissueServer(Federation& f, const std::string& flags) {
  fs::remove(f.Files("server").cert);
  fs::remove(f.Files("server").key);
  const auto r = RunCommand(fmt::format("{} certs issue --dir {} --name server --role server {}",
                                        BinaryPath("estuary-server").string(), f.certs().string(), flags));
  ASSERT_EQ(r.exit_code, 0) << r.output;
}

// Sites dial the server by a DNS name or by its address; either verifies
// when the certificate names it (the names and addresses given to certs
// issue replace the loopback defaults).
TEST(TlsRoles, AServerReachedByIpOrByNameVerifies) {
  Federation f;
  f.Issue("site-ip");
  f.Issue("site-dns");
  ReissueServer(f, "--dns localhost --ip 127.0.0.1");
  const uint16_t port = f.StartServer(1, 2);
  auto by_ip = StartClientAt(f, "site-ip", "127.0.0.1", port);
  auto by_name = StartClientAt(f, "site-dns", "localhost", port);
  EXPECT_EQ(by_ip->Wait(), 0) << f.ClientLog("site-ip");
  EXPECT_EQ(by_name->Wait(), 0) << f.ClientLog("site-dns");
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto rounds = store->Rounds();
  ASSERT_TRUE(rounds.ok() && rounds->size() == 1u);
  EXPECT_EQ((*rounds)[0].state, server::RoundState::kCommitted);
  EXPECT_EQ((*rounds)[0].updates_received, 2u);
}

// A real server whose certificate names another host: sites that dial it by
// an address or a name the certificate does not hold refuse it for good.
TEST(TlsRoles, AServerReachedByANameItsCertificateLacksIsRefused) {
  Federation f;
  f.Issue("site-ip");
  f.Issue("site-dns");
  ReissueServer(f, "--dns fl.example.org --ip 10.11.12.13");
  const uint16_t port = f.StartServer(1, 2);
  auto by_ip = StartClientAt(f, "site-ip", "127.0.0.1", port);
  auto by_name = StartClientAt(f, "site-dns", "localhost", port);
  EXPECT_EQ(by_ip->Wait(std::chrono::seconds(60)), 1);
  EXPECT_EQ(by_name->Wait(std::chrono::seconds(60)), 1);
  EXPECT_NE(f.ClientLog("site-ip").find(fmt::format("refused the server at 127.0.0.1:{}: its certificate failed "
                                                    "verification (IP address mismatch)",
                                                    port)),
            std::string::npos)
      << f.ClientLog("site-ip");
  EXPECT_NE(f.ClientLog("site-dns").find(fmt::format("refused the server at localhost:{}: its certificate failed "
                                                     "verification (hostname mismatch)",
                                                     port)),
            std::string::npos)
      << f.ClientLog("site-dns");
}

// The extendedKeyUsage and names of a certificate file.
struct Issued {
  uint32_t usage = 0;
  std::vector<std::string> names;  // subjectAltName entries, "DNS:x" / "IP:x"
};

Issued Inspect(const fs::path& pem) {
  Issued out;
  auto cert = crypto::internal::ReadCertificate(pem);
  EXPECT_TRUE(cert.ok()) << cert.status().ToString();
  if (!cert.ok()) return out;
  out.usage = X509_get_extended_key_usage(cert->get());
  auto* names = static_cast<GENERAL_NAMES*>(X509_get_ext_d2i(cert->get(), NID_subject_alt_name, nullptr, nullptr));
  for (int i = 0; names != nullptr && i < sk_GENERAL_NAME_num(names); ++i) {
    const GENERAL_NAME* name = sk_GENERAL_NAME_value(names, i);
    if (name->type == GEN_DNS) {
      out.names.push_back("DNS:" + std::string(reinterpret_cast<const char*>(ASN1_STRING_get0_data(name->d.dNSName)),
                                                 size_t(ASN1_STRING_length(name->d.dNSName))));
    } else if (name->type == GEN_IPADD) {
      char text[64] = "";
      const int family = name->d.iPAddress->length == 4 ? AF_INET : AF_INET6;
      inet_ntop(family, name->d.iPAddress->data, text, sizeof text);
      out.names.push_back(std::string("IP:") + text);
    }
  }
  GENERAL_NAMES_free(names);
  return out;
}

TEST(TlsRoles, CertsIssueGivesEachRoleItsUsageAndTheOperatorsNames) {
  TempDir dir;
  const std::string bin = BinaryPath("estuary-server").string();
  const std::string certs = (dir / "certs").string();
  ASSERT_EQ(RunCommand(fmt::format("{} certs init --dir {}", bin, certs)).exit_code, 0);

  auto r = RunCommand(fmt::format("{} certs issue --dir {} --name site-a", bin, certs));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output, fmt::format("issued {0}/site-a.pem and {0}/site-a.key: a site's\n", certs));
  Issued site = Inspect(dir / "certs/site-a.pem");
  EXPECT_EQ(site.usage, uint32_t{XKU_SSL_CLIENT});
  EXPECT_TRUE(site.names.empty());

  r = RunCommand(fmt::format("{} certs issue --dir {} --name agg --role server --dns fl.example.org --ip 10.0.0.5 "
                             "--ip fd00::5",
                             bin, certs));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output, fmt::format("issued {0}/agg.pem and {0}/agg.key: the server's, for fl.example.org, 10.0.0.5, "
                                  "fd00::5\n",
                                  certs));
  Issued named = Inspect(dir / "certs/agg.pem");
  EXPECT_EQ(named.usage, uint32_t{XKU_SSL_SERVER});
  EXPECT_EQ(named.names, (std::vector<std::string>{"DNS:fl.example.org", "IP:10.0.0.5", "IP:fd00::5"}));

  // Without names: the loopback ones, for a federation on one machine.
  r = RunCommand(fmt::format("{} certs issue --dir {} --name server", bin, certs));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("the server's, for localhost, 127.0.0.1, ::1"), std::string::npos) << r.output;
  EXPECT_EQ(Inspect(dir / "certs/server.pem").names, (std::vector<std::string>{"DNS:localhost", "IP:127.0.0.1", "IP:::1"}));

  // Names for a site, and names that are not names: one line, nothing written.
  for (const auto& [flags, expected] :
       {std::pair<std::string, std::string>{"--name site-b --dns site-b.example.org",
                                            "--dns and --ip name the server's hosts"},
        {"--name site-b --role site --ip 10.0.0.1", "--dns and --ip name the server's hosts"},
        {"--name s2 --role server --dns *.example.org", "DNS name '*.example.org' is not a host name"},
        {"--name s2 --role server --ip 10.0.0.256", "'10.0.0.256' is not an IPv4 or IPv6 address"},
        {"--name s2 --role server --dns 10.0.0.5", "is an IP address"},
        {"--name s2 --role admin", "--role: admin not in {site,server}"}}) {
    r = RunCommand(fmt::format("{} certs issue --dir {} {}", bin, certs, flags));
    EXPECT_NE(r.exit_code, 0) << flags;
    EXPECT_NE(r.output.find(expected), std::string::npos) << flags << ": " << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << flags << ": " << r.output;
  }
  EXPECT_FALSE(fs::exists(dir / "certs/site-b.pem"));
  EXPECT_FALSE(fs::exists(dir / "certs/s2.pem"));
}

// An upload whose digest is written in upper case: the same digest, so the
// server takes it (it used to refuse it as a mismatch).
TEST(TlsDigests, AnUpperCaseUploadDigestIsTheSameDigest) {
  Federation f;
  f.Issue("site-a");
  const uint16_t port = f.StartServer(1, 1, {"--chunk-bytes", "65536"});
  auto client = RawClient::Connect(port, f.Files("site-a"));
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  ASSERT_TRUE((*client)->Handshake().ok());
  std::vector<float> global;
  auto start = (*client)->AwaitRound(&global);
  ASSERT_TRUE(start.ok()) << start.status().ToString();
  const std::vector<float> delta(global.size(), 0.001f);
  auto& c = **client;
  ASSERT_TRUE(c.Send(MakeUpdateBegin(*start, delta, 50)).ok());
  const size_t bytes = delta.size() * sizeof(float);
  for (size_t offset = 0; offset < bytes; offset += 65536) {
    ASSERT_TRUE(c.Send(MakeChunk(start->round(), offset, reinterpret_cast<const char*>(delta.data()) + offset,
                                 std::min<size_t>(65536, bytes - offset)))
                    .ok());
  }
  v1::Envelope commit = MakeCommit(start->round(), delta);
  std::string& digest = *commit.mutable_update_commit()->mutable_digest();
  for (char& ch : digest) ch = char(std::toupper(static_cast<unsigned char>(ch)));
  ASSERT_TRUE(c.Send(commit).ok());
  for (;;) {
    auto reply = c.Receive();
    ASSERT_TRUE(reply.ok()) << reply.status().ToString() << "\n" << f.ServerLog();
    if (reply->has_heartbeat()) continue;
    ASSERT_TRUE(reply->has_update_ack()) << proto::BodyName(*reply);
    EXPECT_TRUE(reply->update_ack().accepted()) << reply->update_ack().detail();
    break;
  }
  ASSERT_EQ(f.WaitServer(), 0) << f.ServerLog();
  auto store = f.OpenStore();
  ASSERT_TRUE(store);
  auto rounds = store->Rounds();
  ASSERT_TRUE(rounds.ok() && rounds->size() == 1u);
  EXPECT_EQ((*rounds)[0].state, server::RoundState::kCommitted);
}

}  // namespace
}  // namespace estuary::testing
