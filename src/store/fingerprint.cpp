// Fingerprint identity (ids and why two differ) and the names of dispositions.
#include "store/store.h"

#include <cstdio>
#include <set>
#include <utility>

#include "store/store_internal.h"

namespace kernelgate::store {
namespace {

std::string as_text(const std::string& v) { return v; }
std::string as_text(int64_t v) { return std::to_string(v); }
std::string as_text(int v) { return std::to_string(v); }

std::string identity_text(const Fingerprint& fp, const detail::FingerprintColumn& c) {
  return std::visit([&](auto m) { return as_text(fp.*m); }, c.field);
}

constexpr std::pair<Disposition, std::string_view> kDispositionNames[] = {
    {Disposition::kPassed, "passed"},
    {Disposition::kIncorrect, "incorrect"},
    {Disposition::kCrashed, "crashed"},
    {Disposition::kTimedOut, "timed_out"},
    {Disposition::kOutOfMemory, "out_of_memory"},
    {Disposition::kUnsupported, "unsupported"},
};

}  // namespace

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
  piece(detail::kFingerprintIdScheme);
  for (const auto& col : detail::kFingerprintIdentity) {
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
  for (const auto& col : detail::kFingerprintIdentity) {
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

}  // namespace kernelgate::store
