// The JSON exchange document (Store::export_json, Store::import_json) and the JSON text of
// backend_versions, with nlohmann-json.
//
// Note on numbers: JSON has none for NaN and the infinities, so a NaN metric is null and an
// infinite one the string "inf" or "-inf". nlohmann writes a double in digits that read back to
// the same double, and reads an integer as an integer, so int64 values round-trip exactly too.
//
// Note on text: JSON text is UTF-8. A stored string that is not (a worker's stderr cut mid
// character, say) is exported with U+FFFD in place of each bad byte, so that one such row never
// stops an export. backend_versions is part of the fingerprint id, so there a bad byte is an
// error instead: replacing it would store a map that no longer hashes to its id.
#include "store/store.h"

#include <unistd.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>
#include <vector>

#include "store/store_internal.h"

namespace kernelgate::store {

using namespace detail;
using nlohmann::json;
using nlohmann::ordered_json;  // keeps members in the order they are set: the column order

namespace {

// nlohmann's message without its "[json.exception.parse_error.101] " tag.
std::string message_of(const json::exception& e) {
  std::string_view what = e.what();
  if (what.starts_with("[json.exception.")) what.remove_prefix(what.find("] ") + 2);
  return std::string(what);
}

// ---- Reading values, with the location in every error -----------------------------------------
// read_value() reads v into out and returns nullptr, or returns what it expected instead.

const char* read_value(const json& v, std::string& out) {
  if (!v.is_string()) return "a string";
  out = v.get_ref<const std::string&>();
  return nullptr;
}
const char* read_value(const json& v, int64_t& out) {
  // A non-negative integer is parsed as unsigned; one above INT64_MAX does not fit.
  if (!v.is_number_integer() ||
      (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t{INT64_MAX})) {
    return "an integer";
  }
  out = v.get<int64_t>();
  return nullptr;
}
const char* read_value(const json& v, int& out) {
  int64_t wide = 0;
  if (read_value(v, wide) || wide < INT_MIN || wide > INT_MAX) return "a 32-bit integer";
  out = static_cast<int>(wide);
  return nullptr;
}
const char* read_value(const json& v, bool& out) {
  if (!v.is_boolean()) return "true or false";
  out = v.get<bool>();
  return nullptr;
}
const char* read_value(const json& v, double& out) {
  const auto* text = v.get_ptr<const std::string*>();
  if (v.is_null()) {
    out = std::numeric_limits<double>::quiet_NaN();
  } else if (text && (*text == "inf" || *text == "-inf")) {
    out = *text == "inf" ? HUGE_VAL : -HUGE_VAL;
  } else if (v.is_number()) {
    out = v.get<double>();
  } else {
    return "a number, null, \"inf\" or \"-inf\"";
  }
  return nullptr;
}
const char* read_value(const json& v, std::optional<double>& out) {
  double d = 0;
  if (const char* expected = read_value(v, d)) return expected;
  out = std::isnan(d) ? std::nullopt : std::optional(d);
  return nullptr;
}
const char* read_value(const json& v, Disposition& out) {
  auto d = v.is_string() ? disposition_from_string(v.get_ref<const std::string&>()) : std::nullopt;
  if (!d) return "a disposition (passed, incorrect, crashed, ...)";
  out = *d;
  return nullptr;
}
const char* read_value(const json& v, std::map<std::string, std::string>& out) {
  if (!v.is_object()) return "an object of strings";
  for (const auto& [key, value] : v.items()) {
    if (!value.is_string()) return "an object of strings";
    out[key] = value.get_ref<const std::string&>();
  }
  return nullptr;
}

// Reads member `key` of a row object into out.
template <class T>
void get(const json& row, const char* key, T& out, const std::string& where) {
  auto it = row.find(key);
  if (it == row.end()) throw SourceError(where + ": missing \"" + key + "\"");
  if (const char* expected = read_value(*it, out)) {
    throw SourceError(where + "." + key + ": expected " + expected);
  }
}

// ---- Writing values -------------------------------------------------------------------------

ordered_json cell(const std::string& v) { return v; }
ordered_json cell(int64_t v) { return v; }
ordered_json cell(int v) { return v; }
ordered_json cell(bool v) { return v; }
ordered_json cell(double v) {
  if (std::isnan(v)) return nullptr;
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return v;
}
ordered_json cell(const std::optional<double>& v) { return cell(v.value_or(Result::kNotMeasured)); }
ordered_json cell(Disposition d) { return std::string(to_string(d)); }
ordered_json cell(const std::map<std::string, std::string>& m) { return m; }

// An object as export has always laid it out, {"name": value, "name": value} on one line (hand
// edits and tests match on that spacing, which nlohmann's compact form lacks); each name and
// value is nlohmann's text. `bad_utf8` says what becomes of text that is not UTF-8.
using BadUtf8 = ordered_json::error_handler_t;
void write_object(std::string& out, const ordered_json& object, BadUtf8 bad_utf8) {
  out += '{';
  bool first = true;
  for (const auto& [name, value] : object.items()) {
    out += std::exchange(first, false) ? "" : ", ";
    out += ordered_json(name).dump(-1, ' ', /*ensure_ascii=*/false, bad_utf8) + ": ";
    if (value.is_object()) {
      write_object(out, value, bad_utf8);
    } else {
      out += value.dump(-1, ' ', /*ensure_ascii=*/false, bad_utf8);
    }
  }
  out += '}';
}

// JSON leaves the meaning of a repeated member name open (nlohmann keeps the last one), so where
// a name is read, a repeated one is refused rather than read either way.
class MemberNames {
 public:
  // Call for every parse event; false for the key event of a name its object already had.
  bool see(int depth, json::parse_event_t event, const json& parsed) {
    const auto at = static_cast<size_t>(depth);
    if (event == json::parse_event_t::object_start) {
      if (names_.size() < at + 2) names_.resize(at + 2);
      names_[at + 1].clear();  // its members are reported one level down
    } else if (event == json::parse_event_t::key) {
      return names_[at].insert(parsed.get<std::string>()).second;
    }
    return true;
  }

 private:
  std::vector<std::set<std::string>> names_;  // per depth, those of the object open there
};

// ---- The export document ------------------------------------------------------------------

constexpr const char* kSections[] = {"fingerprints", "runs", "results"};

bool is_section(const std::string& name) {
  return name == kSections[0] || name == kSections[1] || name == kSections[2];
}

const std::string kNotOurs = "not a kernelgate evidence document";

// Source: an export document, read as it is parsed, so that a large document is never held as one
// tree: each row is handed to the sink and dropped once its closing brace is read. "format" and
// "schema_version" must precede the row arrays, and each row may only name fingerprints and runs
// listed before it (export writes it so).
class DocumentReader {
 public:
  explicit DocumentReader(RowSink& sink) : sink_(sink) {}

  void read(std::istream& in) {
    // What parse() keeps: the header members and the emptied row arrays.
    const json kept = json::parse(in, [this](int depth, json::parse_event_t event, json& parsed) {
      return on_event(depth, event, parsed);
    });
    for (const char* section : kSections) {
      if (!kept.contains(section)) {
        throw SourceError("\"fingerprints\", \"runs\" or \"results\" missing");
      }
    }
  }

 private:
  using Event = json::parse_event_t;

  // Returns whether the parser keeps what the event completes (see nlohmann's parser_callback_t).
  bool on_event(int depth, Event event, json& parsed) {
    if (names_matter(depth) && !names_.see(depth, event, parsed)) {
      const std::string at = section_.empty() ? "the document"
                             : depth > 3      ? where() + "." + row_member_
                                              : where();
      throw SourceError(at + ": repeated key " + parsed.get<std::string>());
    }
    if (depth == 3 && event == Event::key) row_member_ = parsed.get<std::string>();
    if (depth == 0) {
      if (event != Event::object_start && event != Event::object_end) {
        throw SourceError(kNotOurs + " (not a JSON object)");
      }
      return true;
    }
    if (depth == 1) return on_member(event, parsed);
    if (section_.empty() || depth > 2) return true;  // inside a row, or a member we do not read
    if (event == Event::object_start) return true;
    if (event != Event::object_end) throw SourceError(where() + ": expected an object");
    take_row(parsed);
    ++row_;
    return false;  // handled: not kept
  }

  // A name repeated in the document, in a row or in a row's backend_versions is refused; inside
  // any other member it is ignored with that member.
  bool names_matter(int depth) const {
    if (depth <= 1) return true;
    return !section_.empty() && (depth <= 3 || row_member_ == "backend_versions");
  }

  // An event of a member of the document itself.
  bool on_member(Event event, const json& parsed) {
    switch (event) {
      case Event::key:
        member_ = parsed.get<std::string>();
        if (is_section(member_) && !(format_ && version_)) {
          throw SourceError(kNotOurs + " (\"format\" and \"schema_version\" must come first)");
        }
        return is_section(member_) || member_ == "format" || member_ == "schema_version";
      case Event::array_start:
        if (is_section(member_)) {
          section_ = member_;
          row_ = 0;
          sink_.begin(section_);
        }
        return true;
      case Event::array_end:
        if (!section_.empty()) {
          section_.clear();
          return true;
        }
        check_header(parsed);
        return true;
      default:  // object_start, object_end, value
        if (is_section(member_)) throw SourceError("\"" + member_ + "\" is not an array");
        if (event != Event::object_start) check_header(parsed);
        return true;
    }
  }

  // Called with the whole value of each member of the document that is not a row array.
  void check_header(const json& v) {
    if (member_ == "format") {
      if (const auto* text = v.get_ptr<const std::string*>(); !text || *text != kApplicationName) {
        throw SourceError(kNotOurs + " (\"format\" is not \"" + std::string(kApplicationName) +
                          "\")");
      }
      format_ = true;
    } else if (member_ == "schema_version") {
      if (!v.is_number_integer() || v.get<int64_t>() != kExchangeVersion) {
        throw SourceError("schema_version " + v.dump() + " is not " +
                          std::to_string(kExchangeVersion) + ", the only version this build reads");
      }
      version_ = true;
    }
  }

  std::string where() const { return section_ + "[" + std::to_string(row_) + "]"; }

  void take_row(const json& row) {
    const std::string at = where();
    if (section_ == "fingerprints") {
      std::string id;
      Fingerprint fp;
      get(row, "id", id, at);
      for_each_column(fp, kFingerprintIdentity,
                      [&](const char* name, auto& field) { get(row, name, field, at); });
      get(row, "backend_versions", fp.backend_versions, at);
      get(row, "clocks_seen", fp.clocks_seen, at);
      sink_.fingerprint(id, fp);
    } else if (section_ == "runs") {
      RunRow run;
      get(row, "uuid", run.uuid, at);
      get(row, "fingerprint_id", run.fingerprint_id, at);
      get(row, "command", run.command, at);
      get(row, "started_at", run.started_at, at);
      get(row, "kernelgate_version", run.kernelgate_version, at);
      sink_.run(run);
    } else {
      std::string run_uuid;
      Result r;
      get(row, "run_uuid", run_uuid, at);
      for_each_column(r, kResultColumns,
                      [&](const char* name, auto& field) { get(row, name, field, at); });
      sink_.result(run_uuid, r);
    }
  }

  RowSink& sink_;
  MemberNames names_;
  std::string member_;      // the document's member being read
  std::string section_;     // the row array being read, or empty
  size_t row_ = 0;          // index of the row being read in section_
  std::string row_member_;  // the member of that row being read
  bool format_ = false, version_ = false;
};

// Sink: the export document, one row per line.
class JsonWriter final : public RowSink {
 public:
  explicit JsonWriter(std::ostream& out) : out_(out) {
    out_ << "{\n\"format\": " << json(kApplicationName).dump()
         << ",\n\"schema_version\": " << kExchangeVersion;
  }

  void begin(const std::string& section) override {
    out_ << (section == kSections[0] ? ",\n\"" : "\n],\n\"") << section << "\": [";
    separator_ = "\n";
  }

  void fingerprint(const std::string& id, const Fingerprint& fp) override {
    ordered_json row = {{"id", id}};
    for_each_column(fp, kFingerprintIdentity,
                    [&](const char* name, const auto& field) { row[name] = cell(field); });
    row["backend_versions"] = cell(fp.backend_versions);
    row["clocks_seen"] = fp.clocks_seen;
    write(row);
  }

  void run(const RunRow& run) override {
    write({{"uuid", run.uuid},
           {"fingerprint_id", run.fingerprint_id},
           {"command", run.command},
           {"started_at", run.started_at},
           {"kernelgate_version", run.kernelgate_version}});
  }

  void result(const std::string& run_uuid, const Result& r) override {
    ordered_json row = {{"run_uuid", run_uuid}};
    for_each_column(r, kResultColumns,
                    [&](const char* name, const auto& field) { row[name] = cell(field); });
    write(row);
  }

  void finish() { out_ << "\n]\n}\n"; }

 private:
  void write(const ordered_json& row) {
    std::string line = std::exchange(separator_, ",\n");
    write_object(line, row, BadUtf8::replace);
    out_ << line;
  }

  std::ostream& out_;
  const char* separator_ = "\n";
};

}  // namespace

namespace detail {

std::string string_map_to_json(const std::map<std::string, std::string>& map,
                               const std::string& where) {
  try {
    std::string out;
    write_object(out, ordered_json(map), BadUtf8::strict);
    return out;
  } catch (const json::exception& e) {
    throw SourceError(where + ": " + message_of(e));
  }
}

std::map<std::string, std::string> string_map_from_json(const std::string& text,
                                                        const std::string& where) {
  std::map<std::string, std::string> out;
  MemberNames names;
  json value;
  try {
    value = json::parse(text, [&](int depth, json::parse_event_t event, json& parsed) {
      if (!names.see(depth, event, parsed)) {
        throw SourceError(where + ": repeated key " + parsed.get<std::string>());
      }
      return true;
    });
  } catch (const json::exception& e) {
    throw SourceError(where + ": malformed JSON: " + message_of(e));
  }
  if (const char* expected = read_value(value, out)) {
    throw SourceError(where + ": expected " + expected);
  }
  return out;
}

}  // namespace detail

void Store::export_json(const std::string& json_path) const {
  // The document goes into what the user named: a new path or a regular file (through its
  // symbolic links: the link stays a link); anything else is refused, never replaced.
  if (std::string why = detail::unwritable_reason(json_path); !why.empty()) {
    fail(path_, "cannot export to " + json_path + ": it " + why +
                    "; export writes only a regular file or a new path");
  }
  std::error_code ec;
  const std::string target = std::filesystem::exists(json_path, ec)
                                 ? std::filesystem::canonical(json_path, ec).string()
                                 : json_path;
  if (ec) fail(path_, "cannot export to " + json_path + ": " + ec.message());
  // Written beside the target and renamed, so a reader never sees half a document.
  const std::string tmp = target + ".tmp." + std::to_string(::getpid());
  try {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    JsonWriter writer(f);
    read_store(db_, path_, writer);
    writer.finish();
    f.close();
    if (!f) fail(path_, "cannot write " + tmp);
    std::filesystem::rename(tmp, target, ec);
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
  try {
    return write_txn(db_, path_, [&] {
      // From the start on every attempt: a transaction redone after a busy error rereads it.
      f.clear();
      f.seekg(0);
      Importer importer(db_, path_);
      DocumentReader(importer).read(f);
      return importer.stats();
    });
  } catch (const json::exception& e) {
    fail(path_, "cannot import " + json_path + ": malformed JSON: " + message_of(e) +
                    "; nothing was imported");
  } catch (const SourceError& e) {
    fail(path_, "cannot import " + json_path + ": " + e.what() + "; nothing was imported");
  }
}

}  // namespace kernelgate::store
