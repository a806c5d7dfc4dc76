#include "crypto/tls_socket.h"

#include <openssl/err.h>
#include <sys/socket.h>

#include <cerrno>

namespace estuary::crypto {

namespace asio = boost::asio;
using boost::system::error_code;

namespace {

// OpenSSL's own socket BIO writes with write(2): a peer that has closed
// would raise SIGPIPE and end the process (a site refused mid-handshake, say).
// This one sends with MSG_NOSIGNAL, as Asio does, and is otherwise the same.
struct SocketState {
  int fd;
  bool eof = false;  // OpenSSL asks (BIO_CTRL_EOF) to tell a truncation from a retry
};

SocketState* StateOf(BIO* bio) { return static_cast<SocketState*>(BIO_get_data(bio)); }

int SocketWrite(BIO* bio, const char* data, size_t size, size_t* written) {
  BIO_clear_retry_flags(bio);
  const ssize_t sent = ::send(StateOf(bio)->fd, data, size, MSG_NOSIGNAL);
  if (sent >= 0) {
    *written = size_t(sent);
    return 1;
  }
  if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) BIO_set_retry_write(bio);
  return 0;  // errno says why, for SSL_ERROR_SYSCALL
}

int SocketRead(BIO* bio, char* data, size_t size, size_t* read) {
  BIO_clear_retry_flags(bio);
  const ssize_t got = ::recv(StateOf(bio)->fd, data, size, 0);
  if (got > 0) {
    *read = size_t(got);
    return 1;
  }
  if (got == 0) {
    StateOf(bio)->eof = true;
  } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
    BIO_set_retry_read(bio);
  }
  return 0;
}

long SocketCtrl(BIO* bio, int command, long, void* out) {
  switch (command) {
    case BIO_CTRL_FLUSH: return 1;  // nothing is buffered here
    case BIO_CTRL_EOF: return StateOf(bio)->eof ? 1 : 0;
    case BIO_C_GET_FD:
      if (out != nullptr) *static_cast<int*>(out) = StateOf(bio)->fd;
      return StateOf(bio)->fd;
    default: return 0;
  }
}

int SocketDestroy(BIO* bio) {
  delete StateOf(bio);  // the descriptor is the socket's to close
  BIO_set_data(bio, nullptr);
  return 1;
}

const BIO_METHOD* SocketMethod() {
  static BIO_METHOD* const method = [] {
    BIO_METHOD* m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK | BIO_TYPE_DESCRIPTOR, "estuary socket");
    BIO_meth_set_write_ex(m, SocketWrite);
    BIO_meth_set_read_ex(m, SocketRead);
    BIO_meth_set_ctrl(m, SocketCtrl);
    BIO_meth_set_destroy(m, SocketDestroy);
    return m;
  }();
  return method;
}

SSL* NewSsl(asio::ssl::context& context) {
  SSL* ssl = SSL_new(context.native_handle());
  if (ssl == nullptr) {
    throw boost::system::system_error(error_code(int(ERR_get_error()), asio::error::get_ssl_category()));
  }
  // As ssl::stream sets them: a write returns once some records are out,
  // and may be retried from a buffer that moved.
  SSL_set_mode(ssl, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  return ssl;
}

}  // namespace

TlsSocket::TlsSocket(const executor_type& executor, asio::ssl::context& context)
    : socket_(executor), ssl_(NewSsl(context)) {}

TlsSocket::TlsSocket(lowest_layer_type socket, asio::ssl::context& context)
    : socket_(std::move(socket)), ssl_(NewSsl(context)) {}

TlsSocket::~TlsSocket() { SSL_free(ssl_); }  // null after a move; the socket closes itself after

error_code TlsSocket::Attach(asio::ssl::stream_base::handshake_type type) {
  error_code ec;
  if (!socket_.is_open()) return asio::error::not_connected;
  socket_.non_blocking(true, ec);
  if (ec) return ec;
  BIO* bio = BIO_new(SocketMethod());
  if (bio == nullptr) return error_code(int(ERR_get_error()), asio::error::get_ssl_category());
  BIO_set_data(bio, new SocketState{.fd = int(socket_.native_handle())});
  BIO_set_init(bio, 1);
  SSL_set_bio(ssl_, bio, bio);  // one reference, both directions
  if (type == asio::ssl::stream_base::client) {
    SSL_set_connect_state(ssl_);
  } else {
    SSL_set_accept_state(ssl_);
  }
  return {};
}

void TlsSocket::Prepare() {
  ERR_clear_error();
  errno = 0;
}

TlsSocket::Next TlsSocket::Classify(int result, error_code* ec) {
  const int saved_errno = errno;
  switch (SSL_get_error(ssl_, result)) {
    case SSL_ERROR_NONE: return Next::kDone;
    case SSL_ERROR_WANT_READ: return Next::kWaitRead;
    case SSL_ERROR_WANT_WRITE: return Next::kWaitWrite;
    case SSL_ERROR_ZERO_RETURN: *ec = asio::error::eof; return Next::kDone;  // the peer's close_notify
    case SSL_ERROR_SYSCALL: {
      const unsigned long code = ERR_get_error();
      if (code != 0 && ERR_GET_LIB(code) == ERR_LIB_SYS) {
        *ec = error_code(ERR_GET_REASON(code), boost::system::system_category());
      } else if (code != 0) {
        *ec = error_code(int(code), asio::error::get_ssl_category());
      } else if (saved_errno != 0) {
        *ec = error_code(saved_errno, boost::system::system_category());
      } else {
        *ec = asio::ssl::error::stream_truncated;
      }
      return Next::kDone;
    }
    case SSL_ERROR_SSL: {
      const unsigned long code = ERR_get_error();
      // ssl::stream reports a connection closed without close_notify so.
      if (ERR_GET_LIB(code) == ERR_LIB_SSL && ERR_GET_REASON(code) == SSL_R_UNEXPECTED_EOF_WHILE_READING) {
        *ec = asio::ssl::error::stream_truncated;
      } else {
        *ec = error_code(int(code), asio::error::get_ssl_category());
      }
      return Next::kDone;
    }
    default: *ec = asio::ssl::error::unexpected_result; return Next::kDone;
  }
}

}  // namespace estuary::crypto
