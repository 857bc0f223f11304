#include "store/sqlite_db.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <thread>

namespace kernelgate::store::detail {
namespace {

constexpr int kBusyTimeoutMs = 10000;
// BEGIN IMMEDIATE already waits kBusyTimeoutMs; these retries cover the BUSY cases SQLite does
// not hand to the busy handler (WAL recovery, a lock upgrade that would deadlock).
constexpr int kMaxWriteAttempts = 8;

}  // namespace

void fail(sqlite3* db, const std::string& path, const std::string& what) {
  throw StoreError("evidence store " + path + ": " + what + ": " + sqlite3_errmsg(db),
                   sqlite3_extended_errcode(db));
}

void fail(const std::string& path, const std::string& what) {
  throw StoreError("evidence store " + path + ": " + what);
}

DbPtr open_connection(const std::string& path, int flags, const std::string& filename) {
  sqlite3* raw = nullptr;
  int rc = sqlite3_open_v2((filename.empty() ? path : filename).c_str(), &raw, flags, nullptr);
  DbPtr db(raw);
  if (rc != SQLITE_OK) {
    throw StoreError("cannot open evidence store " + path + ": " +
                         (raw ? sqlite3_errmsg(raw) : sqlite3_errstr(rc)),
                     rc);
  }
  sqlite3_extended_result_codes(raw, 1);
  sqlite3_busy_timeout(raw, kBusyTimeoutMs);
  return db;
}

void exec(sqlite3* db, const std::string& path, std::string_view sql) {
  if (sqlite3_exec(db, std::string(sql).c_str(), nullptr, nullptr, nullptr) != SQLITE_OK) {
    fail(db, path, "executing " + std::string(sql.substr(0, 60)));
  }
}

void rollback(sqlite3* db) {
  if (!sqlite3_get_autocommit(db)) sqlite3_exec(db, "ROLLBACK", nullptr, nullptr, nullptr);
}

bool wait_before_retry(int attempt) {
  if (attempt >= kMaxWriteAttempts) return false;
  // Jitter by pid, so that processes that collided once do not collide again in step.
  std::this_thread::sleep_for(std::chrono::milliseconds(5 * attempt + ::getpid() % 17));
  return true;
}

Stmt::Stmt(sqlite3* db, const std::string& path, std::string_view sql) : db_(db), path_(path) {
  if (sqlite3_prepare_v2(db, sql.data(), static_cast<int>(sql.size()), &stmt_, nullptr) !=
      SQLITE_OK) {
    fail(db, path, "preparing " + std::string(sql.substr(0, 60)));
  }
}

void Stmt::bind(int i, std::string_view v) {
  check(sqlite3_bind_text(stmt_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT));
}

void Stmt::bind(int i, int64_t v) { check(sqlite3_bind_int64(stmt_, i, v)); }

void Stmt::bind(int i, double v) {
  check(std::isnan(v) ? sqlite3_bind_null(stmt_, i) : sqlite3_bind_double(stmt_, i, v));
}

bool Stmt::step() {
  int rc = sqlite3_step(stmt_);
  if (rc == SQLITE_ROW) return true;
  if (rc == SQLITE_DONE) return false;
  fail(db_, path_, "running " + std::string(sqlite3_sql(stmt_)).substr(0, 60));
}

void Stmt::reset() {
  sqlite3_reset(stmt_);
  sqlite3_clear_bindings(stmt_);
}

void Stmt::get(int c, std::string& out) const {
  auto* text = reinterpret_cast<const char*>(sqlite3_column_text(stmt_, c));
  out.assign(text ? text : "", static_cast<size_t>(sqlite3_column_bytes(stmt_, c)));
}

void Stmt::get(int c, double& out) const {
  out = is_null(c) ? Result::kNotMeasured : sqlite3_column_double(stmt_, c);
}

void Stmt::get(int c, std::optional<double>& out) const {
  out = is_null(c) ? std::nullopt : std::optional(sqlite3_column_double(stmt_, c));
}

void Stmt::get(int c, Disposition& out) const {
  std::string text = get<std::string>(c);
  auto d = disposition_from_string(text);
  if (!d) fail(path_, "unknown disposition '" + text + "'");
  out = *d;
}

void Stmt::check(int rc) {
  if (rc != SQLITE_OK) fail(db_, path_, "binding a value");
}

}  // namespace kernelgate::store::detail
