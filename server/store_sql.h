// The Store's SQL helpers (store.cc): one prepared statement, one
// transaction, and a statement run for its effect. Nothing but the Store
// talks to SQLite; these keep its methods to what they store.
#pragma once

#include <sqlite3.h>

#include <cstdint>
#include <optional>
#include <string>

#include "base/status.h"

namespace estuary::server::sql {

// One prepared statement; binds by position, steps, finalizes on scope exit.
class Statement {
 public:
  Statement(sqlite3* db, const char* sql) : db_(db) { rc_ = sqlite3_prepare_v2(db, sql, -1, &stmt_, nullptr); }
  ~Statement() { sqlite3_finalize(stmt_); }
  Statement(const Statement&) = delete;
  Statement& operator=(const Statement&) = delete;

  Statement& Bind(int64_t v) { return Check(sqlite3_bind_int64(stmt_, ++index_, v)); }
  Statement& Bind(uint64_t v) { return Bind(int64_t(v)); }
  Statement& Bind(uint32_t v) { return Bind(int64_t(v)); }
  Statement& Bind(double v) { return Check(sqlite3_bind_double(stmt_, ++index_, v)); }
  Statement& Bind(const std::string& v) {
    return Check(sqlite3_bind_text(stmt_, ++index_, v.data(), int(v.size()), SQLITE_TRANSIENT));
  }
  Statement& Bind(const std::optional<double>& v) {
    return v ? Bind(*v) : Check(sqlite3_bind_null(stmt_, ++index_));
  }

  // SQLITE_ROW -> true, SQLITE_DONE -> false, else error.
  Result<bool> Step() {
    if (rc_ != SQLITE_OK) return Error("prepare");
    const int rc = sqlite3_step(stmt_);
    if (rc == SQLITE_ROW) return true;
    if (rc == SQLITE_DONE) return false;
    rc_ = rc;
    return Error("step");
  }
  Status Run() {
    auto r = Step();
    return r.ok() ? Status::Ok() : r.status();
  }

  int64_t Int(int col) const { return sqlite3_column_int64(stmt_, col); }
  double Real(int col) const { return sqlite3_column_double(stmt_, col); }
  std::optional<double> MaybeReal(int col) const {
    if (sqlite3_column_type(stmt_, col) == SQLITE_NULL) return std::nullopt;
    return Real(col);
  }
  std::string Text(int col) const {
    const auto* p = sqlite3_column_text(stmt_, col);
    return p ? std::string(reinterpret_cast<const char*>(p), sqlite3_column_bytes(stmt_, col)) : std::string();
  }

 private:
  Statement& Check(int rc) {
    if (rc != SQLITE_OK && rc_ == SQLITE_OK) rc_ = rc;
    return *this;
  }
  Status Error(const char* what) const {
    return IoError("store: {}: {} failed: {}", sqlite3_db_filename(db_, "main") ? sqlite3_db_filename(db_, "main") : "?",
                   what, sqlite3_errmsg(db_));
  }

  sqlite3* db_;
  sqlite3_stmt* stmt_ = nullptr;
  int rc_ = SQLITE_OK;
  int index_ = 0;
};

inline Status Exec(sqlite3* db, const char* sql) {
  char* message = nullptr;
  if (sqlite3_exec(db, sql, nullptr, nullptr, &message) != SQLITE_OK) {
    Status s = IoError("store: {}: {}", sqlite3_db_filename(db, "main"), message ? message : "exec failed");
    sqlite3_free(message);
    return s;
  }
  return Status::Ok();
}

// Rolls back unless Commit() ran.
class Transaction {
 public:
  explicit Transaction(sqlite3* db) : db_(db) { status_ = Exec(db, "BEGIN IMMEDIATE"); }
  ~Transaction() {
    if (status_.ok() && !done_) Exec(db_, "ROLLBACK").ok();
  }
  const Status& status() const { return status_; }
  Status Commit() {
    done_ = true;
    return Exec(db_, "COMMIT");
  }

 private:
  sqlite3* db_;
  Status status_;
  bool done_ = false;
};

}  // namespace estuary::server::sql
