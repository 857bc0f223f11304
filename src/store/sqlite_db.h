// The thin SQLite layer under the evidence store: a connection, a prepared statement that binds
// and reads the C++ types of Fingerprint and Result, and short write transactions that are redone
// while another process holds the write lock. Every failure is a StoreError naming the store's
// path and SQLite's message. Private to src/store.
#pragma once

#include <sqlite3.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

#include "store/store.h"

namespace kernelgate::store::detail {

[[noreturn]] void fail(sqlite3* db, const std::string& path, const std::string& what);
[[noreturn]] void fail(const std::string& path, const std::string& what);

inline bool is_busy(int code) {
  return (code & 0xff) == SQLITE_BUSY || (code & 0xff) == SQLITE_LOCKED;
}

struct DbCloser {
  void operator()(sqlite3* db) const { sqlite3_close_v2(db); }
};
using DbPtr = std::unique_ptr<sqlite3, DbCloser>;

// A connection with extended result codes and the store's busy timeout. `filename` is the path
// or a URI naming it. Throws StoreError "cannot open evidence store <path>: ...".
DbPtr open_connection(const std::string& path, int flags, const std::string& filename = "");

void exec(sqlite3* db, const std::string& path, std::string_view sql);
// Ends the open transaction, if any, discarding its changes.
void rollback(sqlite3* db);

// A prepared statement. NaN and nullopt are bound as NULL; NULL reads back as NaN or nullopt.
class Stmt {
 public:
  Stmt(sqlite3* db, const std::string& path, std::string_view sql);
  ~Stmt() { sqlite3_finalize(stmt_); }
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;

  void bind(int i, std::string_view v);
  void bind(int i, const std::string& v) { bind(i, std::string_view(v)); }
  void bind(int i, const char* v) { bind(i, std::string_view(v)); }
  void bind(int i, int64_t v);
  void bind(int i, int v) { bind(i, int64_t{v}); }
  void bind(int i, bool v) { bind(i, int64_t{v ? 1 : 0}); }
  void bind(int i, double v);
  void bind(int i, const std::optional<double>& v) { bind(i, v ? *v : Result::kNotMeasured); }
  void bind(int i, Disposition v) { bind(i, to_string(v)); }

  // True while there is a row.
  bool step();
  void reset();

  bool is_null(int c) const { return sqlite3_column_type(stmt_, c) == SQLITE_NULL; }
  void get(int c, std::string& out) const;
  void get(int c, int64_t& out) const { out = sqlite3_column_int64(stmt_, c); }
  void get(int c, int& out) const { out = sqlite3_column_int(stmt_, c); }
  void get(int c, bool& out) const { out = sqlite3_column_int64(stmt_, c) != 0; }
  void get(int c, double& out) const;
  void get(int c, std::optional<double>& out) const;
  void get(int c, Disposition& out) const;
  template <class T>
  T get(int c) const {
    T v{};
    get(c, v);
    return v;
  }

 private:
  void check(int rc);

  sqlite3* db_;
  const std::string& path_;
  sqlite3_stmt* stmt_ = nullptr;
};

// Sleeps before the next attempt; false once `attempt` attempts are all a write may have.
bool wait_before_retry(int attempt);

// Calls body again while it fails with SQLITE_BUSY, a bounded number of times.
template <class F>
auto retry_busy(F&& body) -> decltype(body()) {
  for (int attempt = 1;; ++attempt) {
    try {
      return body();
    } catch (const StoreError& e) {
      if (!is_busy(e.sqlite_code()) || !wait_before_retry(attempt)) throw;
    }
  }
}

// Runs body in a write transaction, redoing it from the start while another process holds the
// write lock. body must not keep state across attempts.
template <class F>
auto write_txn(sqlite3* db, const std::string& path, F&& body) -> decltype(body()) {
  return retry_busy([&]() -> decltype(body()) {
    exec(db, path, "BEGIN IMMEDIATE");
    try {
      if constexpr (std::is_void_v<decltype(body())>) {
        body();
        exec(db, path, "COMMIT");
      } else {
        auto value = body();
        exec(db, path, "COMMIT");
        return value;
      }
    } catch (...) {
      rollback(db);
      throw;
    }
  });
}

}  // namespace kernelgate::store::detail
