// Status and Result<T>: how Estuary reports failure without exceptions.
//
// A Status is either ok or carries a code and a one-line message that names
// what was wrong and where ("models/idx: data/train-images.idx: bad magic 0x0803").
// Result<T> holds a value or a non-ok Status. Functions that can fail on input
// return one of these; exceptions are reserved for programming errors.
#pragma once

#include <fmt/format.h>

#include <cassert>
#include <optional>
#include <string>
#include <utility>

namespace estuary {

enum class Code {
  kOk = 0,
  kInvalidArgument,  // malformed input: a file, a frame, a flag
  kNotFound,
  kIo,               // the operating system refused
  kProtocol,         // a peer broke the wire contract
  kFailedPrecondition,
  kAborted,          // the operation was cancelled or the peer went away
  kInternal,
};

const char* CodeName(Code code);

// `message` as one line: each line break or other control character (a
// name read from a file or sent by a peer may hold any) written as an escape,
// \n, \r or \xNN, so an error can neither split a log line nor forge one.
std::string OneLine(std::string message);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(OneLine(std::move(message))) {}

  static Status Ok() { return {}; }
  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  // "invalid argument: <message>", or "ok".
  std::string ToString() const;

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

// The error constructors, one per code, each formatting its message with fmt:
//   return InvalidArgument("config: rounds = {}: must be >= 1", rounds);
template <Code kCode>
struct StatusWithCode {
  template <typename... Args>
  Status operator()(fmt::format_string<Args...> f, Args&&... args) const {
    return {kCode, fmt::format(f, std::forward<Args>(args)...)};
  }
};
inline constexpr StatusWithCode<Code::kInvalidArgument> InvalidArgument;
inline constexpr StatusWithCode<Code::kNotFound> NotFound;
inline constexpr StatusWithCode<Code::kIo> IoError;
inline constexpr StatusWithCode<Code::kProtocol> ProtocolError;
inline constexpr StatusWithCode<Code::kFailedPrecondition> FailedPrecondition;
inline constexpr StatusWithCode<Code::kAborted> Aborted;
inline constexpr StatusWithCode<Code::kInternal> Internal;

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) { assert(!status_.ok()); }  // NOLINT

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  T& value() & { assert(ok()); return *value_; }
  const T& value() const& { assert(ok()); return *value_; }
  T&& value() && { assert(ok()); return std::move(*value_); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  Status status_;
  std::optional<T> value_;
};

inline const char* CodeName(Code code) {
  switch (code) {
    case Code::kOk: return "ok";
    case Code::kInvalidArgument: return "invalid argument";
    case Code::kNotFound: return "not found";
    case Code::kIo: return "i/o error";
    case Code::kProtocol: return "protocol error";
    case Code::kFailedPrecondition: return "failed precondition";
    case Code::kAborted: return "aborted";
    case Code::kInternal: return "internal error";
  }
  return "unknown";
}

inline std::string OneLine(std::string message) {
  auto is_control = [](char c) { return (static_cast<unsigned char>(c) < 0x20 && c != '\t') || c == 0x7f; };
  size_t at = 0;
  while (at < message.size() && !is_control(message[at])) ++at;
  if (at == message.size()) return message;
  std::string out = message.substr(0, at);
  for (; at < message.size(); ++at) {
    const char c = message[at];
    if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (is_control(c)) out += fmt::format("\\x{:02x}", static_cast<unsigned char>(c));
    else out += c;
  }
  return out;
}

inline std::string Status::ToString() const {
  if (ok()) return "ok";
  return fmt::format("{}: {}", CodeName(code_), message_);
}

}  // namespace estuary

// Propagates a non-ok Status (or the Status of a failed Result) to the caller.
#define ESTUARY_RETURN_IF_ERROR(expr)              \
  do {                                             \
    ::estuary::Status estuary_status_ = (expr);    \
    if (!estuary_status_.ok()) return estuary_status_; \
  } while (0)

#define ESTUARY_CONCAT_INNER(a, b) a##b
#define ESTUARY_CONCAT(a, b) ESTUARY_CONCAT_INNER(a, b)
// ESTUARY_ASSIGN_OR_RETURN(auto x, MakeX()); binds the value or returns the error.
#define ESTUARY_ASSIGN_OR_RETURN(lhs, expr) \
  ESTUARY_ASSIGN_OR_RETURN_IMPL(ESTUARY_CONCAT(estuary_result_, __LINE__), lhs, expr)
#define ESTUARY_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return tmp.status();                 \
  lhs = std::move(tmp).value()
