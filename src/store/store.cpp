// The evidence store: SQLite schema and migrations, safe open, multi-process writes, merge and
// JSON exchange.
//
// Note on open(): an existing file is classified before anything can write to it: first from the
// main file alone (immutable, no locks, no side files), then through a read-only connection.
// Only a file classified as ours (or empty) is reopened read-write.
//
// Note on merge and import: the source is streamed into the store inside one write transaction
// and checked row by row (fingerprint ids recomputed from their fields, every reference resolved);
// the first bad row rolls everything back, so a bad source adds nothing, and the natural key on
// results makes a repeated source add nothing new.
#include "store/store.h"

#include <sqlite3.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <span>
#include <sstream>
#include <thread>
#include <type_traits>
#include <utility>
#include <variant>

namespace kernelgate::store {
namespace {

namespace fs = std::filesystem;

constexpr int32_t kApplicationId = 0x4B474556;  // "KGEV" in the SQLite header
constexpr std::string_view kApplicationName = "kernelgate-evidence";
constexpr int kBusyTimeoutMs = 10000;
// BEGIN IMMEDIATE already waits kBusyTimeoutMs; these retries cover the BUSY cases SQLite does
// not hand to the busy handler (WAL recovery, a lock upgrade that would deadlock).
constexpr int kMaxWriteAttempts = 8;

// Schema version 1. Released steps are never edited; a change is a new step.
//
// Note: results repeats its run's fingerprint_id so that every reader's lookup (fingerprint, op)
// and the resume probe (fingerprint, op, backend, case_id) use one index, whose leftmost prefix
// serves the former. UNIQUE (run_id, op, backend, case_id) is the natural key that makes merge
// idempotent (run_id stands for the run's uuid, which merge maps).
constexpr std::string_view kSchemaV1 = R"sql(
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE fingerprints (
  id TEXT PRIMARY KEY,
  gpu_name TEXT NOT NULL, compute_capability TEXT NOT NULL, sm_count INTEGER NOT NULL,
  memory_bytes INTEGER NOT NULL, driver TEXT NOT NULL, cuda_runtime TEXT NOT NULL,
  torch_version TEXT NOT NULL, kernelgate_version TEXT NOT NULL, source_hash TEXT NOT NULL,
  backend_versions TEXT NOT NULL,
  clocks_seen TEXT NOT NULL);
CREATE TABLE runs (
  id INTEGER PRIMARY KEY,
  uuid TEXT NOT NULL UNIQUE,
  fingerprint_id TEXT NOT NULL REFERENCES fingerprints (id),
  command TEXT NOT NULL, started_at INTEGER NOT NULL, kernelgate_version TEXT NOT NULL);
CREATE TABLE results (
  id INTEGER PRIMARY KEY,
  run_id INTEGER NOT NULL REFERENCES runs (id),
  fingerprint_id TEXT NOT NULL REFERENCES fingerprints (id),
  op TEXT NOT NULL, backend TEXT NOT NULL, case_id TEXT NOT NULL,
  arch INTEGER NOT NULL, dtype TEXT NOT NULL, buckets TEXT NOT NULL, region TEXT NOT NULL,
  align TEXT NOT NULL,
  grad INTEGER NOT NULL, shape TEXT NOT NULL, layout TEXT NOT NULL, regime TEXT NOT NULL,
  seed INTEGER NOT NULL,
  disposition TEXT NOT NULL CHECK (disposition IN ('passed', 'incorrect', 'crashed',
                                                   'timed_out', 'out_of_memory', 'unsupported')),
  reason TEXT NOT NULL,
  max_rel_l2 REAL, max_max_over_rms REAL,
  device_median_us REAL, device_spread_us REAL, device_samples INTEGER NOT NULL,
  eager_median_us REAL, eager_spread_us REAL, eager_samples INTEGER NOT NULL,
  rel_noise REAL, throttled INTEGER NOT NULL,
  clocks_before TEXT NOT NULL, clocks_after TEXT NOT NULL,
  created_at INTEGER NOT NULL,
  UNIQUE (run_id, op, backend, case_id));
CREATE INDEX results_by_case ON results (fingerprint_id, op, backend, case_id);
)sql";

constexpr Migration kMigrations[] = {{1, kSchemaV1}};
static_assert(std::size(kMigrations) == kSchemaVersion, "one step per schema version");

int64_t unix_now() {
  using namespace std::chrono;
  return duration_cast<seconds>(system_clock::now().time_since_epoch()).count();
}

std::string random_uuid() {
  std::random_device rd;  // fresh per call, so forked children never share a sequence
  char buf[33];
  std::snprintf(buf, sizeof(buf), "%08x%08x%08x%08x", rd(), rd(), rd(), rd());
  return buf;
}

bool is_busy(int code) { return (code & 0xff) == SQLITE_BUSY || (code & 0xff) == SQLITE_LOCKED; }

[[noreturn]] void fail(sqlite3* db, const std::string& path, const std::string& what) {
  throw StoreError("evidence store " + path + ": " + what + ": " + sqlite3_errmsg(db),
                   sqlite3_extended_errcode(db));
}

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw StoreError("evidence store " + path + ": " + what);
}

void exec(sqlite3* db, const std::string& path, std::string_view sql) {
  if (sqlite3_exec(db, std::string(sql).c_str(), nullptr, nullptr, nullptr) != SQLITE_OK) {
    fail(db, path, "executing " + std::string(sql.substr(0, 60)));
  }
}

// A prepared statement that binds and reads the C++ types of Fingerprint and Result.
// NaN and nullopt are NULL; NULL reads back as NaN or nullopt.
class Stmt {
 public:
  Stmt(sqlite3* db, const std::string& path, std::string_view sql) : db_(db), path_(path) {
    if (sqlite3_prepare_v2(db, sql.data(), static_cast<int>(sql.size()), &stmt_, nullptr) !=
        SQLITE_OK) {
      fail(db, path, "preparing " + std::string(sql.substr(0, 60)));
    }
  }
  ~Stmt() { sqlite3_finalize(stmt_); }
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;

  void bind(int i, std::string_view v) {
    check(sqlite3_bind_text(stmt_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT));
  }
  void bind(int i, const std::string& v) { bind(i, std::string_view(v)); }
  void bind(int i, const char* v) { bind(i, std::string_view(v)); }
  void bind(int i, int64_t v) { check(sqlite3_bind_int64(stmt_, i, v)); }
  void bind(int i, int v) { bind(i, int64_t{v}); }
  void bind(int i, bool v) { bind(i, int64_t{v ? 1 : 0}); }
  void bind(int i, double v) {
    check(std::isnan(v) ? sqlite3_bind_null(stmt_, i) : sqlite3_bind_double(stmt_, i, v));
  }
  void bind(int i, const std::optional<double>& v) { bind(i, v ? *v : Result::kNotMeasured); }
  void bind(int i, Disposition v) { bind(i, to_string(v)); }

  // True while there is a row.
  bool step() {
    int rc = sqlite3_step(stmt_);
    if (rc == SQLITE_ROW) return true;
    if (rc == SQLITE_DONE) return false;
    fail(db_, path_, "running " + std::string(sqlite3_sql(stmt_)).substr(0, 60));
  }
  void reset() {
    sqlite3_reset(stmt_);
    sqlite3_clear_bindings(stmt_);
  }

  bool is_null(int c) const { return sqlite3_column_type(stmt_, c) == SQLITE_NULL; }
  void get(int c, std::string& out) const {
    auto* text = reinterpret_cast<const char*>(sqlite3_column_text(stmt_, c));
    out.assign(text ? text : "", static_cast<size_t>(sqlite3_column_bytes(stmt_, c)));
  }
  void get(int c, int64_t& out) const { out = sqlite3_column_int64(stmt_, c); }
  void get(int c, int& out) const { out = sqlite3_column_int(stmt_, c); }
  void get(int c, bool& out) const { out = sqlite3_column_int64(stmt_, c) != 0; }
  void get(int c, double& out) const {
    out = is_null(c) ? Result::kNotMeasured : sqlite3_column_double(stmt_, c);
  }
  void get(int c, std::optional<double>& out) const {
    out = is_null(c) ? std::nullopt : std::optional(sqlite3_column_double(stmt_, c));
  }
  void get(int c, Disposition& out) const {
    std::string text = get<std::string>(c);
    auto d = disposition_from_string(text);
    if (!d) fail(path_, "unknown disposition '" + text + "'");
    out = *d;
  }
  template <class T>
  T get(int c) const {
    T v{};
    get(c, v);
    return v;
  }

 private:
  void check(int rc) {
    if (rc != SQLITE_OK) fail(db_, path_, "binding a value");
  }
  sqlite3* db_;
  const std::string& path_;
  sqlite3_stmt* stmt_ = nullptr;
};

void rollback(sqlite3* db) {
  if (!sqlite3_get_autocommit(db)) sqlite3_exec(db, "ROLLBACK", nullptr, nullptr, nullptr);
}

// Calls body again while it fails with SQLITE_BUSY, up to kMaxWriteAttempts times.
template <class F>
auto retry_busy(F&& body) -> decltype(body()) {
  for (int attempt = 1;; ++attempt) {
    try {
      return body();
    } catch (const StoreError& e) {
      if (!is_busy(e.sqlite_code()) || attempt >= kMaxWriteAttempts) throw;
    }
    // Jitter by pid, so that processes that collided once do not collide again in step.
    std::this_thread::sleep_for(std::chrono::milliseconds(5 * attempt + ::getpid() % 17));
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

// ---- A small JSON reader and writer for exactly the export format -------------------------
// Numbers keep their text so int64 values round-trip exactly; non-finite doubles are written
// as null (NaN) or the strings "inf" / "-inf", which JSON has no numbers for.
namespace json {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };

struct Value {
  Kind kind = Kind::kNull;
  bool boolean = false;
  std::string text;               // a string's contents or a number's literal
  std::vector<Value> items;       // an array's elements, or an object's member values
  std::vector<std::string> keys;  // an object's member names, parallel to items

  const Value* find(std::string_view key) const {
    for (size_t i = 0; i < keys.size(); ++i) {
      if (keys[i] == key) return &items[i];
    }
    return nullptr;
  }
};

class Parser {
 public:
  explicit Parser(std::string_view s) : s_(s) {}

  Value document() {
    Value v = value(0);
    finish();
    return v;
  }

  // Streaming use, so that a large document is never held as one tree: members() calls
  // on_member(key) for each member of an object, which must consume the value with value() or
  // items(); items() hands over an array's elements one at a time.
  void members(const std::function<void(const std::string&)>& on_member) {
    expect('{');
    if (consume('}')) return;
    do {
      std::string key = member_name();
      on_member(key);
    } while (consume(','));
    expect('}');
  }
  void items(const std::function<void(Value&&)>& on_item) {
    expect('[');
    if (consume(']')) return;
    do on_item(value(1));
    while (consume(','));
    expect(']');
  }
  Value value() { return value(1); }
  void finish() {
    skip_space();
    if (pos_ != s_.size()) error("unexpected text after the document");
  }

 private:
  static constexpr int kMaxDepth = 32;  // the format nests 3 deep; bounds the recursion

  [[noreturn]] void error(const std::string& what) const {
    throw Error("malformed JSON at byte " + std::to_string(pos_) + ": " + what);
  }
  void skip_space() {
    while (pos_ < s_.size() &&
           std::string_view(" \t\r\n").find(s_[pos_]) != std::string_view::npos) {
      ++pos_;
    }
  }
  bool consume(char c) {
    skip_space();
    if (pos_ < s_.size() && s_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!consume(c)) error(std::string("expected '") + c + "'");
  }
  bool literal(std::string_view word) {
    if (s_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }

  Value value(int depth) {
    if (depth > kMaxDepth) error("nested too deeply");
    skip_space();
    if (pos_ >= s_.size()) error("unexpected end");
    Value v;
    char c = s_[pos_];
    if (c == '{') {
      v.kind = Kind::kObject;
      ++pos_;
      if (consume('}')) return v;
      do {
        std::string key = member_name();
        v.keys.push_back(std::move(key));
        v.items.push_back(value(depth + 1));
      } while (consume(','));
      expect('}');
    } else if (c == '[') {
      v.kind = Kind::kArray;
      ++pos_;
      if (consume(']')) return v;
      do v.items.push_back(value(depth + 1));
      while (consume(','));
      expect(']');
    } else if (c == '"') {
      v.kind = Kind::kString;
      v.text = string();
    } else if (literal("true")) {
      v.kind = Kind::kBool;
      v.boolean = true;
    } else if (literal("false")) {
      v.kind = Kind::kBool;
    } else if (literal("null")) {
      v.kind = Kind::kNull;
    } else {
      v.kind = Kind::kNumber;
      v.text = number();
    }
    return v;
  }

  std::string member_name() {
    skip_space();
    if (pos_ >= s_.size() || s_[pos_] != '"') error("expected a member name");
    std::string key = string();
    expect(':');
    return key;
  }

  std::string number() {
    size_t start = pos_;
    auto digits = [&] {
      size_t from = pos_;
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
      return pos_ > from;
    };
    if (pos_ < s_.size() && s_[pos_] == '-') ++pos_;
    if (pos_ < s_.size() && s_[pos_] == '0') {
      ++pos_;
    } else if (!digits()) {
      error("expected a value");
    }
    if (pos_ < s_.size() && s_[pos_] == '.') {
      ++pos_;
      if (!digits()) error("expected digits after '.'");
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (!digits()) error("expected digits in the exponent");
    }
    return std::string(s_.substr(start, pos_ - start));
  }

  unsigned hex4() {
    if (pos_ + 4 > s_.size()) error("short \\u escape");
    unsigned v = 0;
    auto [end, ec] = std::from_chars(s_.data() + pos_, s_.data() + pos_ + 4, v, 16);
    if (ec != std::errc() || end != s_.data() + pos_ + 4) error("bad \\u escape");
    pos_ += 4;
    return v;
  }

  static void append_utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  std::string string() {
    ++pos_;  // the opening quote
    std::string out;
    while (true) {
      if (pos_ >= s_.size()) error("unterminated string");
      char c = s_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) error("control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= s_.size()) error("unterminated string");
      char e = s_[pos_++];
      if (e == 'u') {
        unsigned cp = hex4();
        if (cp >= 0xDC00 && cp <= 0xDFFF) error("lone low surrogate");
        if (cp >= 0xD800 && cp <= 0xDBFF) {
          if (!literal("\\u")) error("lone high surrogate");
          unsigned low = hex4();
          if (low < 0xDC00 || low > 0xDFFF) error("bad low surrogate");
          cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
        }
        append_utf8(out, cp);
      } else if (size_t k = kEscaped.find(e); k != std::string_view::npos) {
        out += kUnescaped[k];
      } else {
        error("bad escape");
      }
    }
  }

  static constexpr std::string_view kEscaped = "\"\\/bfnrt", kUnescaped = "\"\\/\b\f\n\r\t";

  std::string_view s_;
  size_t pos_ = 0;
};

Value parse(std::string_view text) { return Parser(text).document(); }

void write(std::string& out, std::string_view s) {
  out += '"';
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char esc[8];
      std::snprintf(esc, sizeof(esc), "\\u%04x", static_cast<unsigned>(c));
      out += esc;
    } else {
      out += c;  // UTF-8 passes through
    }
  }
  out += '"';
}
void write(std::string& out, const std::string& s) { write(out, std::string_view(s)); }
void write(std::string& out, const char* s) { write(out, std::string_view(s)); }
void write(std::string& out, int64_t v) { out += std::to_string(v); }
void write(std::string& out, int v) { out += std::to_string(v); }
void write(std::string& out, bool v) { out += v ? "true" : "false"; }
void write(std::string& out, double v) {
  if (std::isnan(v)) {
    out += "null";
  } else if (std::isinf(v)) {
    out += v > 0 ? "\"inf\"" : "\"-inf\"";
  } else {
    char buf[32];
    auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);  // shortest exact round trip
    out.append(buf, end);
  }
}
void write(std::string& out, const std::optional<double>& v) {
  write(out, v ? *v : std::numeric_limits<double>::quiet_NaN());
}
void write(std::string& out, Disposition d) { write(out, to_string(d)); }

std::string write_string_map(const std::map<std::string, std::string>& m) {
  std::string out = "{";
  for (const auto& [k, v] : m) {
    if (out.size() > 1) out += ", ";
    write(out, k);
    out += ": ";
    write(out, v);
  }
  return out + "}";
}

// ---- Typed access with the location in every error -----------------------------------------

const Value& member(const Value& obj, const char* key, const std::string& where) {
  if (obj.kind != Kind::kObject) throw Error(where + ": expected an object");
  const Value* v = obj.find(key);
  if (!v) throw Error(where + ": missing \"" + key + "\"");
  return *v;
}

// The whole text is one number that fits T (from_chars alone accepts a prefix and leaves an
// out-of-range value unset).
template <class T>
bool parse_all(const std::string& text, T& out) {
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  return ec == std::errc() && end == text.data() + text.size();
}

[[noreturn]] void wrong(const char* key, const std::string& where, const char* expected) {
  throw Error(where + "." + key + ": expected " + expected);
}

void get(const Value& obj, const char* key, std::string& out, const std::string& where) {
  const Value& v = member(obj, key, where);
  if (v.kind != Kind::kString) wrong(key, where, "a string");
  out = v.text;
}
void get(const Value& obj, const char* key, int64_t& out, const std::string& where) {
  const Value& v = member(obj, key, where);
  if (v.kind != Kind::kNumber || !parse_all(v.text, out)) wrong(key, where, "an integer");
}
void get(const Value& obj, const char* key, int& out, const std::string& where) {
  int64_t wide = 0;
  get(obj, key, wide, where);
  if (wide < std::numeric_limits<int>::min() || wide > std::numeric_limits<int>::max()) {
    wrong(key, where, "a 32-bit integer");
  }
  out = static_cast<int>(wide);
}
void get(const Value& obj, const char* key, bool& out, const std::string& where) {
  const Value& v = member(obj, key, where);
  if (v.kind != Kind::kBool) wrong(key, where, "true or false");
  out = v.boolean;
}
void get(const Value& obj, const char* key, double& out, const std::string& where) {
  const Value& v = member(obj, key, where);
  if (v.kind == Kind::kNull) {
    out = std::numeric_limits<double>::quiet_NaN();
  } else if (v.kind == Kind::kString && (v.text == "inf" || v.text == "-inf")) {
    out = v.text == "inf" ? HUGE_VAL : -HUGE_VAL;
  } else if (v.kind != Kind::kNumber || !parse_all(v.text, out)) {
    wrong(key, where, "a number, null, \"inf\" or \"-inf\"");
  }
}
void get(const Value& obj, const char* key, std::optional<double>& out, const std::string& where) {
  double v = 0;
  get(obj, key, v, where);
  out = std::isnan(v) ? std::nullopt : std::optional(v);
}
void get(const Value& obj, const char* key, Disposition& out, const std::string& where) {
  std::string text;
  get(obj, key, text, where);
  auto d = disposition_from_string(text);
  if (!d) wrong(key, where, "a disposition (passed, incorrect, crashed, ...)");
  out = *d;
}

std::map<std::string, std::string> string_map(const Value& v, const std::string& where) {
  if (v.kind != Kind::kObject) throw Error(where + ": expected an object of strings");
  std::map<std::string, std::string> out;
  for (size_t i = 0; i < v.keys.size(); ++i) {
    const std::string& k = v.keys[i];
    if (v.items[i].kind != Kind::kString) throw Error(where + "." + k + ": expected a string");
    if (!out.emplace(k, v.items[i].text).second) throw Error(where + ": repeated key " + k);
  }
  return out;
}

}  // namespace json

// ---- Field tables ---------------------------------------------------------------------------
// One list per struct drives SQL column lists, binding, reading and JSON, so a field is added in
// one place (plus a schema step).

// Identity fields in id() order. Names and order are part of every stored id: changing them
// changes every id (and so makes all stored evidence stale); bump kFingerprintIdScheme with it.
constexpr std::string_view kFingerprintIdScheme = "kernelgate.fingerprint.1";
using FingerprintField =
    std::variant<std::string Fingerprint::*, int Fingerprint::*, int64_t Fingerprint::*>;
struct FingerprintColumn {
  const char* name;
  FingerprintField field;
};
const FingerprintColumn kFingerprintIdentity[] = {
    {"gpu_name", &Fingerprint::gpu_name},
    {"compute_capability", &Fingerprint::compute_capability},
    {"sm_count", &Fingerprint::sm_count},
    {"memory_bytes", &Fingerprint::memory_bytes},
    {"driver", &Fingerprint::driver},
    {"cuda_runtime", &Fingerprint::cuda_runtime},
    {"torch_version", &Fingerprint::torch_version},
    {"kernelgate_version", &Fingerprint::kernelgate_version},
    {"source_hash", &Fingerprint::source_hash},
};

using ResultField =
    std::variant<std::string Result::*, int Result::*, int64_t Result::*, bool Result::*,
                 double Result::*, std::optional<double> Result::*, Disposition Result::*>;
struct ResultColumn {
  const char* name;
  ResultField field;
};
const ResultColumn kResultColumns[] = {
    {"op", &Result::op},
    {"backend", &Result::backend},
    {"case_id", &Result::case_id},
    {"arch", &Result::arch},
    {"dtype", &Result::dtype},
    {"buckets", &Result::buckets},
    {"region", &Result::region},
    {"align", &Result::align},
    {"grad", &Result::grad},
    {"shape", &Result::shape},
    {"layout", &Result::layout},
    {"regime", &Result::regime},
    {"seed", &Result::seed},
    {"disposition", &Result::disposition},
    {"reason", &Result::reason},
    {"max_rel_l2", &Result::max_rel_l2},
    {"max_max_over_rms", &Result::max_max_over_rms},
    {"device_median_us", &Result::device_median_us},
    {"device_spread_us", &Result::device_spread_us},
    {"device_samples", &Result::device_samples},
    {"eager_median_us", &Result::eager_median_us},
    {"eager_spread_us", &Result::eager_spread_us},
    {"eager_samples", &Result::eager_samples},
    {"rel_noise", &Result::rel_noise},
    {"throttled", &Result::throttled},
    {"clocks_before", &Result::clocks_before},
    {"clocks_after", &Result::clocks_after},
    {"created_at", &Result::created_at},
};

template <class Columns>
std::string column_list(const Columns& columns, std::string_view prefix = "") {
  std::string out;
  for (const auto& c : columns) out += (out.empty() ? "" : ", ") + std::string(prefix) + c.name;
  return out;
}

std::string placeholders(int first, int count) {
  std::string out;
  for (int i = first; i < first + count; ++i) out += (i == first ? "?" : ", ?") + std::to_string(i);
  return out;
}

std::string as_text(const std::string& v) { return v; }
std::string as_text(int64_t v) { return std::to_string(v); }
std::string as_text(int v) { return std::to_string(v); }

std::string identity_text(const Fingerprint& fp, const FingerprintColumn& c) {
  return std::visit([&](auto m) { return as_text(fp.*m); }, c.field);
}

// ---- Rows as stored, merged and exchanged --------------------------------------------------
// Merge, import and export stream rows in one order (fingerprints, runs, results) from a source
// to a sink, so memory stays flat however large the store.

// A merge or import source that is inconsistent; nothing of it is kept.
struct SourceError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct RunRow {
  std::string uuid;
  std::string fingerprint_id;
  std::string command;
  int64_t started_at = 0;
  std::string kernelgate_version;
};

const std::string& fingerprint_select() {
  static const std::string sql = "SELECT id, " + column_list(kFingerprintIdentity) +
                                 ", backend_versions, clocks_seen FROM fingerprints";
  return sql;
}

// Reads a row of fingerprint_select() starting at column `first`.
Fingerprint read_fingerprint(const Stmt& s, const std::string& path, int first = 1) {
  Fingerprint fp;
  int c = first;
  for (const auto& col : kFingerprintIdentity) {
    std::visit([&](auto m) { s.get(c, fp.*m); }, col.field);
    ++c;
  }
  try {
    fp.backend_versions = json::string_map(json::parse(s.get<std::string>(c)), "backend_versions");
  } catch (const json::Error& e) {
    fail(path, std::string("damaged fingerprint row: ") + e.what());
  }
  s.get(c + 1, fp.clocks_seen);
  return fp;
}

bool insert_fingerprint(sqlite3* db, const std::string& path, const std::string& id,
                        const Fingerprint& fp) {
  constexpr int n = static_cast<int>(std::size(kFingerprintIdentity));
  static const std::string sql = "INSERT INTO fingerprints (id, " +
                                 column_list(kFingerprintIdentity) +
                                 ", backend_versions, clocks_seen) VALUES (" +
                                 placeholders(1, n + 3) + ") ON CONFLICT (id) DO NOTHING";
  Stmt s(db, path, sql);
  s.bind(1, id);
  int i = 2;
  for (const auto& col : kFingerprintIdentity) {
    std::visit([&](auto m) { s.bind(i, fp.*m); }, col.field);
    ++i;
  }
  s.bind(i, json::write_string_map(fp.backend_versions));
  s.bind(i + 1, fp.clocks_seen);
  s.step();
  return sqlite3_changes(db) == 1;
}

// Inserts into results; with skip_duplicates a row whose natural key exists is left alone
// (returns false), otherwise that is an error.
class ResultInserter {
 public:
  ResultInserter(sqlite3* db, const std::string& path, bool skip_duplicates)
      : db_(db), path_(path), stmt_(db, path, sql(skip_duplicates)) {}

  bool insert(int64_t run_id, const std::string& fingerprint_id, const Result& r) {
    stmt_.reset();
    stmt_.bind(1, run_id);
    stmt_.bind(2, fingerprint_id);
    int i = 3;
    for (const auto& col : kResultColumns) {
      std::visit([&](auto m) { stmt_.bind(i, r.*m); }, col.field);
      ++i;
    }
    try {
      stmt_.step();
    } catch (const StoreError& e) {
      if (e.sqlite_code() != SQLITE_CONSTRAINT_UNIQUE) throw;
      fail(path_, "run " + std::to_string(run_id) + " already has a result for op " + r.op +
                      ", backend " + r.backend + ", case " + r.case_id +
                      " (results are never overwritten)");
    }
    return sqlite3_changes(db_) == 1;
  }

 private:
  static std::string sql(bool skip_duplicates) {
    constexpr int n = static_cast<int>(std::size(kResultColumns));
    return "INSERT INTO results (run_id, fingerprint_id, " + column_list(kResultColumns) +
           ") VALUES (" + placeholders(1, n + 2) + ")" +
           (skip_duplicates ? " ON CONFLICT (run_id, op, backend, case_id) DO NOTHING" : "");
  }
  sqlite3* db_;
  const std::string& path_;
  Stmt stmt_;
};

// Reads the result columns of a row starting at column `first`.
Result read_result(const Stmt& s, int first) {
  Result r;
  int c = first;
  for (const auto& col : kResultColumns) {
    std::visit([&](auto m) { s.get(c, r.*m); }, col.field);
    ++c;
  }
  return r;
}

// Source: every row of a store, from one read snapshot.
template <class Sink>
void read_store(sqlite3* db, const std::string& path, Sink& sink) {
  exec(db, path, "BEGIN");
  try {
    sink.begin("fingerprints");
    Stmt f(db, path, fingerprint_select() + " ORDER BY id");
    while (f.step()) sink.fingerprint(f.get<std::string>(0), read_fingerprint(f, path));
    sink.begin("runs");
    Stmt r(db, path,
           "SELECT uuid, fingerprint_id, command, started_at, kernelgate_version FROM runs "
           "ORDER BY id");
    while (r.step()) {
      sink.run({r.get<std::string>(0), r.get<std::string>(1), r.get<std::string>(2),
                r.get<int64_t>(3), r.get<std::string>(4)});
    }
    sink.begin("results");
    Stmt x(db, path,
           "SELECT r.uuid, " + column_list(kResultColumns, "x.") +
               " FROM results x JOIN runs r ON r.id = x.run_id ORDER BY x.id");
    while (x.step()) sink.result(x.get<std::string>(0), read_result(x, 1));
  } catch (...) {
    rollback(db);
    throw;
  }
  exec(db, path, "COMMIT");
}

// Source: an export document. "format" and "schema_version" must precede the row arrays, and
// each row may only name fingerprints and runs listed before it (export writes it so).
template <class Sink>
void read_json(std::string_view text, Sink& sink) {
  using json::get;
  json::Parser parser(text);
  bool format = false, version = false;
  std::set<std::string> sections;
  auto rows = [&](const std::string& section, auto&& take) {
    if (!format || !version) {
      throw SourceError(
          "not a kernelgate evidence document (\"format\" and \"schema_version\" "
          "must come first)");
    }
    sections.insert(section);
    sink.begin(section);
    size_t i = 0;
    parser.items(
        [&](json::Value&& item) { take(item, section + "[" + std::to_string(i++) + "]"); });
  };
  parser.members([&](const std::string& key) {
    if (key == "format") {
      json::Value v = parser.value();
      if (v.kind != json::Kind::kString || v.text != kApplicationName) {
        throw SourceError("not a kernelgate evidence document (\"format\" is not \"" +
                          std::string(kApplicationName) + "\")");
      }
      format = true;
    } else if (key == "schema_version") {
      json::Value v = parser.value();
      int n = 0;
      if (v.kind != json::Kind::kNumber || !json::parse_all(v.text, n) || n != kSchemaVersion) {
        throw SourceError("schema_version " + v.text + " is not " + std::to_string(kSchemaVersion) +
                          ", the only version this build reads");
      }
      version = true;
    } else if (key == "fingerprints") {
      rows(key, [&](const json::Value& item, const std::string& where) {
        std::string id;
        Fingerprint fp;
        get(item, "id", id, where);
        for (const auto& col : kFingerprintIdentity) {
          std::visit([&](auto m) { get(item, col.name, fp.*m, where); }, col.field);
        }
        fp.backend_versions = json::string_map(json::member(item, "backend_versions", where),
                                               where + ".backend_versions");
        get(item, "clocks_seen", fp.clocks_seen, where);
        sink.fingerprint(id, fp);
      });
    } else if (key == "runs") {
      rows(key, [&](const json::Value& item, const std::string& where) {
        RunRow run;
        get(item, "uuid", run.uuid, where);
        get(item, "fingerprint_id", run.fingerprint_id, where);
        get(item, "command", run.command, where);
        get(item, "started_at", run.started_at, where);
        get(item, "kernelgate_version", run.kernelgate_version, where);
        sink.run(run);
      });
    } else if (key == "results") {
      rows(key, [&](const json::Value& item, const std::string& where) {
        std::string run_uuid;
        Result r;
        get(item, "run_uuid", run_uuid, where);
        for (const auto& col : kResultColumns) {
          std::visit([&](auto m) { get(item, col.name, r.*m, where); }, col.field);
        }
        sink.result(run_uuid, r);
      });
    } else {
      parser.value();  // a member this version does not use
    }
  });
  parser.finish();
  if (sections.size() != 3) throw SourceError("\"fingerprints\", \"runs\" or \"results\" missing");
}

// Sink: inserts into a store inside the caller's write transaction. A source must be
// self-contained and consistent: each fingerprint id is recomputed from its fields, and every
// run and result must name a fingerprint or run listed before it.
class Importer {
 public:
  Importer(sqlite3* db, const std::string& path)
      : db_(db),
        path_(path),
        add_run_(db, path,
                 "INSERT INTO runs (uuid, fingerprint_id, command, started_at, kernelgate_version) "
                 "VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT (uuid) DO NOTHING"),
        find_run_(db, path, "SELECT id, fingerprint_id FROM runs WHERE uuid = ?1"),
        results_(db, path, /*skip_duplicates=*/true) {}

  void begin(const std::string&) {}

  void fingerprint(const std::string& id, const Fingerprint& fp) {
    if (id != fp.id()) {
      throw SourceError("fingerprint " + id + " does not match its fields (they hash to " +
                        fp.id() + ")");
    }
    fingerprints_.insert(id);
    stats_.fingerprints_added += insert_fingerprint(db_, path_, id, fp);
  }

  void run(const RunRow& run) {
    if (run.uuid.empty() || runs_.count(run.uuid)) {
      throw SourceError("run uuid '" + run.uuid + "' is empty or repeated");
    }
    if (!fingerprints_.count(run.fingerprint_id)) {
      throw SourceError("run " + run.uuid +
                        " names a fingerprint not listed before it: " + run.fingerprint_id);
    }
    add_run_.reset();
    add_run_.bind(1, run.uuid);
    add_run_.bind(2, run.fingerprint_id);
    add_run_.bind(3, run.command);
    add_run_.bind(4, run.started_at);
    add_run_.bind(5, run.kernelgate_version);
    add_run_.step();
    stats_.runs_added += sqlite3_changes(db_);
    find_run_.reset();
    find_run_.bind(1, run.uuid);
    find_run_.step();
    auto here = find_run_.get<std::string>(1);
    if (here != run.fingerprint_id) {
      throw SourceError("run " + run.uuid + " is recorded here under fingerprint " + here +
                        " but under " + run.fingerprint_id + " in the source");
    }
    runs_[run.uuid] = {find_run_.get<int64_t>(0), here};
  }

  void result(const std::string& run_uuid, const Result& r) {
    auto it = runs_.find(run_uuid);
    if (it == runs_.end()) {
      throw SourceError("a result names a run not listed before it: " + run_uuid);
    }
    bool added = results_.insert(it->second.first, it->second.second, r);
    ++(added ? stats_.results_added : stats_.results_skipped);
  }

  const MergeStats& stats() const { return stats_; }

 private:
  sqlite3* db_;
  const std::string& path_;
  Stmt add_run_, find_run_;
  ResultInserter results_;
  std::set<std::string> fingerprints_;
  std::map<std::string, std::pair<int64_t, std::string>> runs_;  // uuid -> (local id, fp id)
  MergeStats stats_;
};

// Sink: the export document, one row per line.
class JsonWriter {
 public:
  explicit JsonWriter(std::ostream& out) : out_(out) {
    line_ = "{\n\"format\": ";
    json::write(line_, kApplicationName);
    line_ += ",\n\"schema_version\": " + std::to_string(kSchemaVersion);
  }

  void begin(const std::string& section) {
    line_ += (section == "fingerprints" ? ",\n\"" : "\n],\n\"") + section + "\": [";
    separator_ = "\n";
  }

  void fingerprint(const std::string& id, const Fingerprint& fp) {
    row("id", id);
    for (const auto& col : kFingerprintIdentity) {
      std::visit([&](auto m) { member(col.name, fp.*m); }, col.field);
    }
    line_ += ", \"backend_versions\": " + json::write_string_map(fp.backend_versions);
    member("clocks_seen", fp.clocks_seen);
    flush();
  }

  void run(const RunRow& run) {
    row("uuid", run.uuid);
    member("fingerprint_id", run.fingerprint_id);
    member("command", run.command);
    member("started_at", run.started_at);
    member("kernelgate_version", run.kernelgate_version);
    flush();
  }

  void result(const std::string& run_uuid, const Result& r) {
    row("run_uuid", run_uuid);
    for (const auto& col : kResultColumns) {
      std::visit([&](auto m) { member(col.name, r.*m); }, col.field);
    }
    flush();
  }

  void finish() {
    line_ += "\n]\n}\n";
    out_ << line_;
  }

 private:
  template <class T>
  void row(const char* key, const T& value) {
    line_ += std::exchange(separator_, ",\n");
    line_ += "{";
    json::write(line_, key);
    line_ += ": ";
    json::write(line_, value);
  }
  template <class T>
  void member(const char* key, const T& value) {
    line_ += ", ";
    json::write(line_, key);
    line_ += ": ";
    json::write(line_, value);
  }
  void flush() {
    line_ += "}";
    out_ << line_;
    line_.clear();
  }

  std::ostream& out_;
  std::string line_;
  const char* separator_ = "\n";
};

// ---- Open, classify, migrate ----------------------------------------------------------------

struct DbCloser {
  void operator()(sqlite3* db) const { sqlite3_close_v2(db); }
};
using DbPtr = std::unique_ptr<sqlite3, DbCloser>;

// A reason the file cannot be used; becomes OpenResult::problem.
struct Problem {
  std::string message;
};

// `filename` is the path or a URI naming it.
DbPtr open_connection(const std::string& path, int flags, const std::string& filename = "") {
  sqlite3* raw = nullptr;
  int rc = sqlite3_open_v2((filename.empty() ? path : filename).c_str(), &raw, flags, nullptr);
  DbPtr db(raw);
  if (rc != SQLITE_OK) {
    throw Problem{"cannot open evidence store " + path + ": " +
                  (raw ? sqlite3_errmsg(raw) : sqlite3_errstr(rc))};
  }
  sqlite3_extended_result_codes(raw, 1);
  sqlite3_busy_timeout(raw, kBusyTimeoutMs);
  return db;
}

struct Classification {
  bool empty = false;  // no tables and no application id: a new store
  int version = 0;
};

// Throws Problem unless the database is empty or one of ours at a version <= known.
Classification classify(sqlite3* db, const std::string& path, int known) {
  auto unusable = [&](const std::string& why) {
    return Problem{"evidence store " + path + " " + why + "; the file was left as it was"};
  };
  try {
    Stmt app(db, path, "PRAGMA application_id");
    app.step();
    auto application_id = app.get<int64_t>(0);
    std::vector<std::string> tables;
    Stmt t(db, path,
           "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' "
           "ORDER BY name");
    while (t.step()) tables.push_back(t.get<std::string>(0));
    if (application_id == 0 && tables.empty()) return {true, 0};
    if (application_id != kApplicationId) {
      std::string names;
      for (const auto& name : tables) names += (names.empty() ? "" : ", ") + name;
      char id[16];
      std::snprintf(id, sizeof(id), "0x%08llx", static_cast<unsigned long long>(application_id));
      throw unusable("is a SQLite database of another application (application_id " +
                     std::string(id) + ", tables: " + names + ")");
    }
    Stmt m(db, path, "SELECT key, value FROM meta WHERE key IN ('application', 'schema_version')");
    std::map<std::string, std::string> meta;
    while (m.step()) meta[m.get<std::string>(0)] = m.get<std::string>(1);
    int version = 0;
    if (meta["application"] != kApplicationName ||
        !json::parse_all(meta["schema_version"], version) || version < 1) {
      throw unusable("has a damaged meta table (no valid application and schema_version)");
    }
    if (version > known) {
      throw unusable("has schema version " + std::to_string(version) + ", newer than " +
                     std::to_string(known) +
                     " which this kernelgate knows; upgrade kernelgate "
                     "or use another store (KERNELGATE_DB)");
    }
    return {false, version};
  } catch (const StoreError& e) {
    if (is_busy(e.sqlite_code())) throw;  // in use, not unusable
    throw unusable(std::string("is not a SQLite database or is damaged (") +
                   sqlite3_errstr(e.sqlite_code()) + ")");
  }
}

bool main_file_is_whole(const std::string& path) {
  std::error_code ec;
  return !fs::exists(path + "-wal", ec) && !fs::exists(path + "-journal", ec);
}

// A SQLite URI that opens the file without locks or side files, trusting that nobody writes it.
std::string immutable_uri(const std::string& path) {
  std::string uri = "file://";
  for (unsigned char c : fs::absolute(path).string()) {
    if (std::isalnum(c) ||
        std::string_view("/-._~").find(static_cast<char>(c)) != std::string_view::npos) {
      uri += static_cast<char>(c);
    } else {
      char esc[4];
      std::snprintf(esc, sizeof(esc), "%%%02X", c);
      uri += esc;
    }
  }
  return uri + "?immutable=1";
}

// A refusal decided from the main file alone, without a lock or a side file. Only trusted when no
// -wal or -journal exists before and after the look: otherwise the main file may lag the real
// database (a checkpoint in progress or interrupted), and a normal connection must decide.
std::optional<Problem> first_look(const std::string& path, int known) {
  if (!main_file_is_whole(path)) return std::nullopt;
  DbPtr db = open_connection(path, SQLITE_OPEN_READONLY | SQLITE_OPEN_URI, immutable_uri(path));
  try {
    classify(db.get(), path, known);
  } catch (const Problem& p) {
    if (main_file_is_whole(path)) return p;
  }
  return std::nullopt;
}

// Evidence shipped inside an installed package sits in a directory we cannot write, where SQLite
// cannot create the -shm a WAL-mode file needs even to be read; nobody can be writing it there
// either, so it is read as immutable.
DbPtr open_read_only(const std::string& path) {
  fs::path dir = fs::path(path).parent_path();
  bool dir_writable = ::access(dir.empty() ? "." : dir.c_str(), W_OK) == 0;
  if (!dir_writable && main_file_is_whole(path)) {
    return open_connection(path, SQLITE_OPEN_READONLY | SQLITE_OPEN_URI, immutable_uri(path));
  }
  return open_connection(path, SQLITE_OPEN_READONLY);
}

void migrate(sqlite3* db, const std::string& path, int from, std::span<const Migration> steps) {
  for (const auto& step : steps) {
    if (step.to_version <= from) continue;
    if (sqlite3_exec(db, std::string(step.sql).c_str(), nullptr, nullptr, nullptr) != SQLITE_OK) {
      fail(db, path, "migrating to schema version " + std::to_string(step.to_version));
    }
  }
  if (from == 0) {
    exec(db, path, "PRAGMA application_id = " + std::to_string(kApplicationId));
    Stmt s(db, path, "INSERT INTO meta (key, value) VALUES ('application', ?1)");
    s.bind(1, kApplicationName);
    s.step();
  }
  Stmt s(db, path,
         "INSERT INTO meta (key, value) VALUES ('schema_version', ?1) "
         "ON CONFLICT (key) DO UPDATE SET value = excluded.value");
  s.bind(1, std::to_string(steps.back().to_version));
  s.step();
}

}  // namespace

// ---- Fingerprint and Disposition ------------------------------------------------------------

std::string fnv1a64_hex(std::string_view bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : bytes) h = (h ^ c) * 0x100000001b3ull;
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

std::string Fingerprint::id() const {
  // Every piece is length-prefixed, so no two field sets serialise alike.
  std::string canon;
  auto piece = [&](std::string_view s) {
    canon += std::to_string(s.size());
    canon += ':';
    canon += s;
  };
  piece(kFingerprintIdScheme);
  for (const auto& col : kFingerprintIdentity) {
    piece(col.name);
    piece(identity_text(*this, col));
  }
  piece("backend_versions");
  piece(std::to_string(backend_versions.size()));
  for (const auto& [package, version] : backend_versions) {
    piece(package);
    piece(version);
  }
  return fnv1a64_hex(canon);
}

std::vector<std::string> Fingerprint::differences(const Fingerprint& current) const {
  auto show = [](const std::string& v) { return v.empty() ? std::string("(empty)") : v; };
  std::vector<std::string> out;
  for (const auto& col : kFingerprintIdentity) {
    auto stored = identity_text(*this, col), now = identity_text(current, col);
    if (stored != now) {
      out.push_back(std::string(col.name) + ": stored " + show(stored) + ", current " + show(now));
    }
  }
  std::set<std::string> packages;
  for (const auto* m : {&backend_versions, &current.backend_versions}) {
    for (const auto& entry : *m) packages.insert(entry.first);
  }
  for (const auto& package : packages) {
    auto version = [&](const std::map<std::string, std::string>& m) {
      auto it = m.find(package);
      return it == m.end() ? std::string("(absent)") : show(it->second);
    };
    if (version(backend_versions) != version(current.backend_versions)) {
      out.push_back("backend_versions[" + package + "]: stored " + version(backend_versions) +
                    ", current " + version(current.backend_versions));
    }
  }
  return out;
}

namespace {
constexpr std::pair<Disposition, std::string_view> kDispositionNames[] = {
    {Disposition::kPassed, "passed"},
    {Disposition::kIncorrect, "incorrect"},
    {Disposition::kCrashed, "crashed"},
    {Disposition::kTimedOut, "timed_out"},
    {Disposition::kOutOfMemory, "out_of_memory"},
    {Disposition::kUnsupported, "unsupported"},
};
}  // namespace

std::string_view to_string(Disposition disposition) {
  for (const auto& [d, name] : kDispositionNames) {
    if (d == disposition) return name;
  }
  return "invalid";
}

std::optional<Disposition> disposition_from_string(std::string_view text) {
  for (const auto& [d, name] : kDispositionNames) {
    if (name == text) return d;
  }
  return std::nullopt;
}

std::span<const Migration> schema_migrations() { return kMigrations; }

// ---- Store ----------------------------------------------------------------------------------

Store::Store(sqlite3* db, std::string path, Mode mode, int schema_version)
    : db_(db), path_(std::move(path)), mode_(mode), schema_version_(schema_version) {}

Store::~Store() { sqlite3_close_v2(db_); }

OpenResult Store::open(const std::string& path, Mode mode) {
  return open(path, mode, schema_migrations());
}

OpenResult Store::open(const std::string& path, Mode mode, std::span<const Migration> steps) {
  OpenResult out;
  try {
    for (size_t i = 0; i < steps.size(); ++i) {
      if (steps[i].to_version != static_cast<int>(i) + 1) {
        throw Problem{"internal: migration steps must be numbered 1, 2, ... in order"};
      }
    }
    if (steps.empty()) throw Problem{"internal: no migration steps"};
    const int known = steps.back().to_version;
    std::error_code ec;
    bool exists = fs::exists(path, ec);
    if (ec) throw Problem{"cannot inspect evidence store " + path + ": " + ec.message()};
    if (exists && fs::is_directory(path, ec)) {
      throw Problem{"evidence store " + path + " is a directory, not a file"};
    }
    if (!exists && mode == Mode::kReadOnly) {
      throw Problem{"no evidence store at " + path + " (a read-only open creates nothing)"};
    }
    if (exists) {
      if (auto problem = first_look(path, known)) throw *problem;
      // Read-only, so a file refused here is not written (a WAL-mode file gains -wal/-shm).
      DbPtr probe = open_read_only(path);
      Classification c = classify(probe.get(), path, known);
      if (mode == Mode::kReadOnly) {
        if (c.empty || c.version < known) {
          throw Problem{"evidence store " + path +
                        (c.empty
                             ? std::string(" is empty (a read-only open does not initialise it)")
                             : " has schema version " + std::to_string(c.version) +
                                   "; open it read-write once to migrate it to version " +
                                   std::to_string(known))};
        }
        exec(probe.get(), path, "PRAGMA query_only = ON");
        out.store.reset(new Store(probe.release(), path, mode, c.version));
        return out;
      }
    } else {
      fs::path parent = fs::path(path).parent_path();
      if (!parent.empty()) fs::create_directories(parent, ec);
      if (ec)
        throw Problem{"cannot create the directory of evidence store " + path + ": " +
                      ec.message()};
    }
    DbPtr db = open_connection(path, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE);
    if (sqlite3_db_readonly(db.get(), "main") == 1) {
      throw Problem{"evidence store " + path + " is not writable"};
    }
    exec(db.get(), path, "PRAGMA foreign_keys = ON");
    // WAL lets readers run beside one writer; where the file system cannot do WAL, SQLite keeps
    // the rollback journal, which is slower but just as safe. NORMAL sync is durable in WAL
    // except for the last commits on power loss, which only costs re-measuring them.
    retry_busy([&] { exec(db.get(), path, "PRAGMA journal_mode = WAL"); });
    exec(db.get(), path, "PRAGMA synchronous = NORMAL");
    // Classify again under the write lock: another process may have created or migrated it.
    int version = write_txn(db.get(), path, [&] {
      Classification c = classify(db.get(), path, known);
      if (c.version < known) migrate(db.get(), path, c.version, steps);
      return known;
    });
    out.store.reset(new Store(db.release(), path, mode, version));
  } catch (const Problem& p) {
    out.problem = p.message;
  } catch (const StoreError& e) {
    out.problem = e.what();
  } catch (const std::exception& e) {
    out.problem = std::string("cannot open evidence store ") + path + ": " + e.what();
  } catch (...) {
    out.problem = "cannot open evidence store " + path + ": unknown error";
  }
  return out;
}

std::string Store::default_path() {
  auto env = [](const char* name) -> std::string {
    const char* v = std::getenv(name);
    return v ? v : "";
  };
  if (auto db = env("KERNELGATE_DB"); !db.empty()) return db;
  if (auto cache = env("XDG_CACHE_HOME"); !cache.empty()) {
    return (fs::path(cache) / "kernelgate" / "evidence.sqlite").string();
  }
  return (fs::path(env("HOME")) / ".cache" / "kernelgate" / "evidence.sqlite").string();
}

namespace {
void require_writable(const Store& store) {
  if (store.mode() != Mode::kReadWrite) fail(store.path(), "opened read-only; cannot write");
}
}  // namespace

int64_t Store::begin_run(const Fingerprint& fingerprint, const std::string& command) {
  require_writable(*this);
  const std::string id = fingerprint.id(), uuid = random_uuid();
  const int64_t now = unix_now();
  return write_txn(db_, path_, [&] {
    insert_fingerprint(db_, path_, id, fingerprint);
    Stmt s(db_, path_,
           "INSERT INTO runs (uuid, fingerprint_id, command, started_at, kernelgate_version) "
           "VALUES (?1, ?2, ?3, ?4, ?5)");
    s.bind(1, uuid);
    s.bind(2, id);
    s.bind(3, command);
    s.bind(4, now);
    s.bind(5, fingerprint.kernelgate_version);
    s.step();
    return static_cast<int64_t>(sqlite3_last_insert_rowid(db_));
  });
}

void Store::add_result(int64_t run_id, const Result& result) {
  require_writable(*this);
  Result row = result;
  if (row.created_at == 0) row.created_at = unix_now();
  write_txn(db_, path_, [&] {
    Stmt run(db_, path_, "SELECT fingerprint_id FROM runs WHERE id = ?1");
    run.bind(1, run_id);
    if (!run.step()) fail(path_, "no run with id " + std::to_string(run_id));
    ResultInserter(db_, path_, /*skip_duplicates=*/false)
        .insert(run_id, run.get<std::string>(0), row);
  });
}

bool Store::has_result(const std::string& fingerprint_id, const std::string& op,
                       const std::string& backend, const std::string& case_id) const {
  Stmt s(db_, path_,
         "SELECT 1 FROM results WHERE fingerprint_id = ?1 AND op = ?2 AND backend = ?3 "
         "AND case_id = ?4 LIMIT 1");
  s.bind(1, fingerprint_id);
  s.bind(2, op);
  s.bind(3, backend);
  s.bind(4, case_id);
  return s.step();
}

std::vector<Result> Store::results(const std::string& fingerprint_id, const std::string& op) const {
  Stmt s(db_, path_,
         "SELECT run_id, " + column_list(kResultColumns) +
             " FROM results WHERE fingerprint_id = ?1" + (op.empty() ? "" : " AND op = ?2") +
             " ORDER BY id");
  s.bind(1, fingerprint_id);
  if (!op.empty()) s.bind(2, op);
  std::vector<Result> out;
  while (s.step()) {
    out.push_back(read_result(s, 1));
    out.back().run_id = s.get<int64_t>(0);
  }
  return out;
}

std::optional<Fingerprint> Store::fingerprint(const std::string& fingerprint_id) const {
  Stmt s(db_, path_, fingerprint_select() + " WHERE id = ?1");
  s.bind(1, fingerprint_id);
  if (!s.step()) return std::nullopt;
  return read_fingerprint(s, path_);
}

StaleReport Store::stale(const Fingerprint& current) const {
  StaleReport report;
  report.current_id = current.id();
  Stmt s(db_, path_,
         "SELECT (SELECT COUNT(*) FROM runs WHERE fingerprint_id = f.id), "
         "(SELECT COUNT(*) FROM results WHERE fingerprint_id = f.id), f.* FROM (" +
             fingerprint_select() + ") f ORDER BY f.id");
  while (s.step()) {
    auto id = s.get<std::string>(2);
    auto results = s.get<int64_t>(1);
    if (id == report.current_id) {
      report.current_results = results;
      continue;
    }
    StaleFingerprint entry{id, read_fingerprint(s, path_, 3), s.get<int64_t>(0), results, {}};
    entry.differences = entry.fingerprint.differences(current);
    if (entry.differences.empty()) {  // fields equal, id not: written under another id scheme
      entry.differences.push_back("id: stored " + id + ", current " + report.current_id);
    }
    report.stale.push_back(std::move(entry));
  }
  return report;
}

MergeStats Store::merge(const std::string& other_path) {
  require_writable(*this);
  OpenResult other = Store::open(other_path, Mode::kReadOnly);
  if (!other) fail(path_, "cannot merge: " + other.problem);
  try {
    return write_txn(db_, path_, [&] {
      Importer importer(db_, path_);
      read_store(other.store->db_, other.store->path_, importer);
      return importer.stats();
    });
  } catch (const SourceError& e) {
    fail(path_, "cannot merge " + other_path + ": " + e.what() + "; nothing was merged");
  }
}

void Store::export_json(const std::string& json_path) const {
  // Written beside the target and renamed, so a reader never sees half a document.
  const std::string tmp = json_path + ".tmp." + std::to_string(::getpid());
  try {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    JsonWriter writer(f);
    read_store(db_, path_, writer);
    writer.finish();
    f.close();
    if (!f) fail(path_, "cannot write " + tmp);
    std::error_code ec;
    fs::rename(tmp, json_path, ec);
    if (ec) fail(path_, "cannot move the export into " + json_path + ": " + ec.message());
  } catch (...) {
    std::remove(tmp.c_str());
    throw;
  }
}

MergeStats Store::import_json(const std::string& json_path) {
  require_writable(*this);
  std::ifstream f(json_path, std::ios::binary);
  if (!f) fail(path_, "cannot read " + json_path);
  std::stringstream text;
  text << f.rdbuf();
  const std::string document = text.str();
  try {
    return write_txn(db_, path_, [&] {
      Importer importer(db_, path_);
      read_json(document, importer);
      return importer.stats();
    });
  } catch (const json::Error& e) {
    fail(path_, "cannot import " + json_path + ": " + e.what() + "; nothing was imported");
  } catch (const SourceError& e) {
    fail(path_, "cannot import " + json_path + ": " + e.what() + "; nothing was imported");
  }
}

}  // namespace kernelgate::store
