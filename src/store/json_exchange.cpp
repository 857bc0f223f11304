// The JSON exchange document (Store::export_json, Store::import_json) and the JSON text of
// backend_versions.
#include <unistd.h>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <set>
#include <sstream>
#include <utility>

#include "store/store_internal.h"

namespace kernelgate::store {

using namespace detail;

namespace {

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

// Source: an export document. "format" and "schema_version" must precede the row arrays, and
// each row may only name fingerprints and runs listed before it (export writes it so).
void read_json(std::string_view text, RowSink& sink) {
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
        for_each_column(fp, kFingerprintIdentity,
                        [&](const char* name, auto& field) { get(item, name, field, where); });
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
        for_each_column(r, kResultColumns,
                        [&](const char* name, auto& field) { get(item, name, field, where); });
        sink.result(run_uuid, r);
      });
    } else {
      parser.value();  // a member this version does not use
    }
  });
  parser.finish();
  if (sections.size() != 3) throw SourceError("\"fingerprints\", \"runs\" or \"results\" missing");
}

// Sink: the export document, one row per line.
class JsonWriter final : public RowSink {
 public:
  explicit JsonWriter(std::ostream& out) : out_(out) {
    line_ = "{\n\"format\": ";
    json::write(line_, kApplicationName);
    line_ += ",\n\"schema_version\": " + std::to_string(kSchemaVersion);
  }

  void begin(const std::string& section) override {
    line_ += (section == "fingerprints" ? ",\n\"" : "\n],\n\"") + section + "\": [";
    separator_ = "\n";
  }

  void fingerprint(const std::string& id, const Fingerprint& fp) override {
    row("id", id);
    for_each_column(fp, kFingerprintIdentity,
                    [&](const char* name, const auto& field) { member(name, field); });
    line_ += ", \"backend_versions\": " + json::write_string_map(fp.backend_versions);
    member("clocks_seen", fp.clocks_seen);
    flush();
  }

  void run(const RunRow& run) override {
    row("uuid", run.uuid);
    member("fingerprint_id", run.fingerprint_id);
    member("command", run.command);
    member("started_at", run.started_at);
    member("kernelgate_version", run.kernelgate_version);
    flush();
  }

  void result(const std::string& run_uuid, const Result& r) override {
    row("run_uuid", run_uuid);
    for_each_column(r, kResultColumns,
                    [&](const char* name, const auto& field) { member(name, field); });
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

}  // namespace

namespace detail {

std::string string_map_to_json(const std::map<std::string, std::string>& map,
                               const std::string&) {
  return json::write_string_map(map);
}

std::map<std::string, std::string> string_map_from_json(const std::string& text,
                                                        const std::string& where) {
  try {
    return json::string_map(json::parse(text), where);
  } catch (const json::Error& e) {
    throw SourceError(e.what());
  }
}

}  // namespace detail

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
    std::filesystem::rename(tmp, json_path, ec);
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
