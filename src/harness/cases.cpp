// Cases from an op's contract, and the one-line encodings that cross the worker pipe.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>

#include "harness/harness.h"
#include "kernelgate/dispatch.h"

namespace kernelgate::harness {
namespace {

// key=value;key=value with '%', ';', '=' and newlines percent-escaped.
std::string escape(const std::string& s) {
  std::string out;
  for (char ch : s) {
    if (ch == '%' || ch == ';' || ch == '=' || ch == '\n' || ch == '\r') {
      char buf[4];
      std::snprintf(buf, sizeof(buf), "%%%02X", static_cast<unsigned char>(ch));
      out += buf;
    } else {
      out += ch;
    }
  }
  return out;
}

std::string unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size()) {
      out += static_cast<char>(std::stoi(s.substr(i + 1, 2), nullptr, 16));
      i += 2;
    } else {
      out += s[i];
    }
  }
  return out;
}

}  // namespace

std::string encode_fields(const std::vector<std::pair<std::string, std::string>>& kv) {
  std::string out;
  for (const auto& [k, v] : kv) {
    if (!out.empty()) out += ';';
    out += k + "=" + escape(v);
  }
  return out;
}

bool decode_fields(const std::string& text, std::map<std::string, std::string>* out,
                   std::string* problem) {
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ';')) {
    size_t eq = item.find('=');
    if (eq == std::string::npos) {
      *problem = "malformed field '" + item + "'";
      return false;
    }
    try {
      (*out)[item.substr(0, eq)] = unescape(item.substr(eq + 1));
    } catch (const std::exception&) {
      *problem = "bad escape in '" + item + "'";
      return false;
    }
  }
  return true;
}

namespace {

// Round-trip text of a double. snprintf, not an ostream: on a machine where a library loaded
// earlier exports its own copy of libstdc++'s stream internals, ostream << double crashed.
std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

std::string join_map(const std::map<std::string, int64_t>& m) {
  std::string s;
  for (const auto& [k, v] : m) s += (s.empty() ? "" : ",") + k + "=" + std::to_string(v);
  return s;
}

std::string join_scalars(const std::map<std::string, double>& m) {
  std::string s;
  for (const auto& [k, v] : m) s += (s.empty() ? "" : ",") + k + "=" + num(v);
  return s;
}

std::string join_strings(const std::map<std::string, std::string>& m) {
  std::string s;
  for (const auto& [k, v] : m) s += (s.empty() ? "" : ",") + k + "=" + v;
  return s;
}

template <class T>
bool parse_pairs(const std::string& s, std::map<std::string, T>* out) {
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t eq = item.find('=');
    if (eq == std::string::npos) return false;
    try {
      if constexpr (std::is_same_v<T, std::string>) {
        (*out)[item.substr(0, eq)] = item.substr(eq + 1);
      } else if constexpr (std::is_same_v<T, int64_t>) {
        (*out)[item.substr(0, eq)] = std::stoll(item.substr(eq + 1));
      } else {
        (*out)[item.substr(0, eq)] = std::stod(item.substr(eq + 1));
      }
    } catch (const std::exception&) {
      return false;
    }
  }
  return true;
}

}  // namespace

std::string Case::id() const {
  std::string s = op + "/" + join_map(dims) + "/" + dtype + "/" + layout + "/" + regime;
  if (!scalars.empty()) s += "/" + join_scalars(scalars);
  if (!strings.empty()) s += "/" + join_strings(strings);
  if (!with_optional) s += "/no_optional";
  s += grad ? "/grad" : "/nograd";
  return s;
}

std::string Case::encode() const {
  return encode_fields({{"op", op},
                        {"dims", join_map(dims)},
                        {"dtype", dtype},
                        {"layout", layout},
                        {"regime", regime},
                        {"scalars", join_scalars(scalars)},
                        {"strings", join_strings(strings)},
                        {"optional", with_optional ? "1" : "0"},
                        {"grad", grad ? "1" : "0"},
                        {"seed", std::to_string(seed)}});
}

std::optional<Case> Case::decode(const std::string& text, std::string* problem) {
  std::map<std::string, std::string> kv;
  if (!decode_fields(text, &kv, problem)) return std::nullopt;
  Case c;
  for (const char* k :
       {"op", "dims", "dtype", "layout", "regime", "scalars", "optional", "grad", "seed"}) {
    if (!kv.count(k)) {
      *problem = std::string("case lacks '") + k + "'";
      return std::nullopt;
    }
  }
  c.op = kv["op"];
  c.dtype = kv["dtype"];
  c.layout = kv["layout"];
  c.regime = kv["regime"];
  c.with_optional = kv["optional"] == "1";
  c.grad = kv["grad"] == "1";
  try {
    c.seed = std::stoi(kv["seed"]);
  } catch (const std::exception&) {
    *problem = "bad seed '" + kv["seed"] + "'";
    return std::nullopt;
  }
  if (!parse_pairs(kv["dims"], &c.dims) || !parse_pairs(kv["scalars"], &c.scalars) ||
      !parse_pairs(kv["strings"], &c.strings)) {
    *problem = "bad dims, scalars or strings";
    return std::nullopt;
  }
  return c;
}

std::string Measured::encode() const {
  auto opt = [](const std::optional<double>& v) { return v ? num(*v) : std::string(); };
  return encode_fields({{"disposition", std::string(store::to_string(disposition))},
                        {"reason", reason},
                        {"region", region},
                        {"arch", std::to_string(arch)},
                        {"buckets", buckets},
                        {"align", align},
                        {"l2", num(max_rel_l2)},
                        {"max", num(max_max_over_rms)},
                        {"dev_med", opt(device_median_us)},
                        {"dev_spread", opt(device_spread_us)},
                        {"dev_n", std::to_string(device_samples)},
                        {"eager_med", opt(eager_median_us)},
                        {"eager_spread", opt(eager_spread_us)},
                        {"eager_n", std::to_string(eager_samples)},
                        {"noise", num(rel_noise)},
                        {"throttled", throttled ? "1" : "0"},
                        {"clk0", clocks_before},
                        {"clk1", clocks_after}});
}

std::optional<Measured> Measured::decode(const std::string& text, std::string* problem) {
  std::map<std::string, std::string> kv;
  if (!decode_fields(text, &kv, problem)) return std::nullopt;
  if (!kv.count("disposition")) {
    *problem = "response lacks a disposition";
    return std::nullopt;
  }
  Measured m;
  if (auto d = store::disposition_from_string(kv["disposition"])) {
    m.disposition = *d;
  } else {
    *problem = "unknown disposition '" + kv["disposition"] + "'";
    return std::nullopt;
  }
  auto opt = [&](const char* k) -> std::optional<double> {
    return kv[k].empty() ? std::nullopt : std::optional<double>(std::stod(kv[k]));
  };
  try {
    m.reason = kv["reason"];
    m.region = kv["region"];
    m.arch = kv["arch"].empty() ? -1 : std::stoi(kv["arch"]);
    m.buckets = kv["buckets"];
    m.align = kv["align"];
    m.max_rel_l2 = kv["l2"].empty() ? 0 : std::stod(kv["l2"]);
    m.max_max_over_rms = kv["max"].empty() ? 0 : std::stod(kv["max"]);
    m.device_median_us = opt("dev_med");
    m.device_spread_us = opt("dev_spread");
    m.device_samples = kv["dev_n"].empty() ? 0 : std::stoi(kv["dev_n"]);
    m.eager_median_us = opt("eager_med");
    m.eager_spread_us = opt("eager_spread");
    m.eager_samples = kv["eager_n"].empty() ? 0 : std::stoi(kv["eager_n"]);
    m.rel_noise = kv["noise"].empty() ? 0 : std::stod(kv["noise"]);
    m.throttled = kv["throttled"] == "1";
    m.clocks_before = kv["clk0"];
    m.clocks_after = kv["clk1"];
  } catch (const std::exception& e) {
    *problem = std::string("bad number in response: ") + e.what();
    return std::nullopt;
  }
  return m;
}

// ---- case generation -------------------------------------------------------------------------

namespace {

// Edges of each power-of-two bucket and sizes just off them (odd, unaligned), within [lo, hi].
std::vector<int64_t> edge_sizes(int64_t lo, int64_t hi, bool full) {
  std::set<int64_t> s;
  for (int64_t p = 1; p <= hi; p *= 2) {
    if (!full && p != 1 && p != 128 && p != 4096 && p < hi) continue;
    for (int64_t v : {p - 1, p, p + 1}) {
      if (v >= lo && v <= hi) s.insert(v);
    }
  }
  for (int64_t v : {int64_t{7}, int64_t{33}, int64_t{1000}, int64_t{12288}}) {
    if (v >= lo && v <= hi && (full || v == 33)) s.insert(v);
  }
  return {s.begin(), s.end()};
}

}  // namespace

std::vector<Case> make_cases(const std::string& op, Grid grid,
                             const std::vector<std::string>& dtypes_in, int seeds,
                             int64_t max_elements) {
  const OpEntry* e = Dispatcher::get().find_op(op);
  TORCH_CHECK(e != nullptr, "unknown op '", op, "'");
  const OpContract& c = e->contract;
  for (const auto& layout : c.production_layouts) {
    TORCH_CHECK(layout == "contiguous" || layout == "row_strided" || layout == "offset" ||
                    layout == "transposed" || layout == "expanded",
                "op ", op, ": production_layouts names no layout '", layout,
                "' (contiguous, row_strided, offset, transposed, expanded)");
  }
  TORCH_CHECK(!c.production_layouts.empty() && !c.production_optionals.empty(), "op ", op,
              ": production_layouts and production_optionals need at least one entry each");
  const bool full = grid == Grid::kFull;
  std::vector<std::string> dtypes = dtypes_in;
  if (dtypes.empty()) {
    for (auto t : c.dtypes) dtypes.push_back(dtype_name(t));
  }
  // Shapes: production shapes, then one named dim at a time over its edges (others at a
  // production value), then tiny and degenerate shapes.
  std::vector<std::map<std::string, int64_t>> shapes;
  std::set<std::string> seen;
  auto fit = [&](std::map<std::string, int64_t> d) {  // sizes the contract requires multiples of
    for (auto& [name, v] : d) {
      auto m = c.dim_multiples.find(name);
      if (m != c.dim_multiples.end() && m->second > 1)
        v = (v + m->second - 1) / m->second * m->second;
    }
    return d;
  };
  // A shape's size is its largest tensor argument's element count (linear_cross_entropy's
  // rows x hidden x classes is no tensor's size: its largest is weight, classes x hidden).
  auto largest_tensor = [&](const std::map<std::string, int64_t>& d) {
    int64_t largest = 1;
    for (const auto& t : c.tensor_args) {
      int64_t n = 1;
      for (const auto& ds : t.dims) {
        auto it = d.find(c.named_dims[ds.named_dim]);
        n *= std::max<int64_t>(it == d.end() ? 1 : it->second, 1);
      }
      largest = std::max(largest, n);
    }
    return largest;
  };
  auto add_shape = [&](std::map<std::string, int64_t> d) {
    d = fit(std::move(d));
    if (largest_tensor(d) > max_elements) return;
    std::string key;
    for (const auto& [k, v] : d) key += k + std::to_string(v) + ",";
    if (seen.insert(key).second) shapes.push_back(std::move(d));
  };
  const auto& prod = c.production_shapes;
  for (size_t i = 0; i < prod.size() && (full || i < 2); ++i) add_shape(prod[i]);
  std::map<std::string, int64_t> base = prod.empty() ? std::map<std::string, int64_t>{} : prod[0];
  for (const auto& name : c.named_dims) {
    if (!base.count(name)) base[name] = 64;
  }
  // The mid-size shape the layouts, value regimes and scalar values are tried on: each dim at
  // most 256, and the largest halved until the whole fits max_elements.
  std::map<std::string, int64_t> small_base = base;
  for (auto& [k, v] : small_base) v = std::min<int64_t>(v, 256);
  for (;;) {
    int64_t elems = 1;
    for (const auto& [k, v] : small_base) elems *= std::max<int64_t>(v, 1);
    auto largest =
        std::max_element(small_base.begin(), small_base.end(),
                         [](const auto& a, const auto& b) { return a.second < b.second; });
    if (elems <= max_elements || largest == small_base.end() || largest->second <= 1) break;
    largest->second = (largest->second + 1) / 2;
  }
  for (const auto& name : c.named_dims) {
    auto range = c.dim_ranges.count(name) ? c.dim_ranges.at(name)
                                          : std::make_pair<int64_t, int64_t>(1, 65536);
    for (int64_t v : edge_sizes(range.first, range.second, full)) {
      auto d = small_base;
      d[name] = v;
      add_shape(d);
    }
  }
  {
    std::map<std::string, int64_t> tiny;
    for (const auto& name : c.named_dims) {
      tiny[name] = c.dim_ranges.count(name) ? std::max<int64_t>(c.dim_ranges.at(name).first, 1) : 1;
    }
    add_shape(tiny);
  }

  if (grid == Grid::kSmoke) {
    shapes.clear();
    shapes.push_back(fit(small_base));
    std::map<std::string, int64_t> odd = small_base;
    for (auto& [k, v] : odd) v = std::max<int64_t>(1, v / 4 + 1);
    shapes.push_back(fit(odd));
  }
  std::map<std::string, double> default_scalars;
  for (const auto& [name, values] : c.scalar_test_values) default_scalars[name] = values.front();
  std::vector<Case> out;
  std::set<std::string> emitted;
  // Every group of cases the dispatcher tells apart (each shape, dtype, layout, grad mode,
  // optional and variant) is tried in every value regime, so that every region's evidence holds
  // values where eps matters, special values, large and offset ones, not only N(0, 1): a backend
  // wrong in one regime can be ranked nowhere. A case with the contract's default scalars takes
  // another of their test values in each regime; seeds draw fresh inputs for each.
  static const char* kRegimes[] = {"normal", "small", "special", "large", "offset"};
  constexpr size_t kNumRegimes = sizeof(kRegimes) / sizeof(kRegimes[0]);
  auto emit = [&](const Case& k) {
    for (size_t r = 0; r < kNumRegimes; ++r) {
      for (int s = 0; s < seeds; ++s) {
        Case v = k;
        v.seed = s;
        v.regime = kRegimes[r];
        if (k.scalars == default_scalars) {
          for (const auto& [name, values] : c.scalar_test_values)
            v.scalars[name] = values[r % values.size()];
        }
        if (emitted.insert(v.id() + "/" + std::to_string(s)).second) out.push_back(v);
      }
    }
  };
  // Production shapes in each layout and optional-argument form the contract says production
  // calls take; the other shapes contiguous, with the optionals.
  std::set<std::string> production_keys;
  for (size_t i = 0; i < prod.size(); ++i) {
    auto d = fit(prod[i]);
    std::string key;
    for (const auto& [k, v] : d) key += k + std::to_string(v) + ",";
    production_keys.insert(key);
  }
  for (const auto& dt : dtypes) {
    for (const auto& d : shapes) {
      std::string key;
      for (const auto& [k, v] : d) key += k + std::to_string(v) + ",";
      const bool production = production_keys.count(key) > 0 && grid != Grid::kSmoke;
      const std::vector<std::string> layouts =
          production ? c.production_layouts : std::vector<std::string>{"contiguous"};
      const std::vector<bool> optionals = production ? c.production_optionals : std::vector<bool>{true};
      for (const auto& layout : layouts) {
        for (bool with_optional : optionals) {
          for (bool grad : {true, false}) {
            Case k;
            k.op = op;
            k.dims = d;
            k.dtype = dt;
            k.grad = grad;
            k.layout = layout;
            k.with_optional = with_optional;
            k.scalars = default_scalars;
            emit(k);
          }
        }
      }
    }
    // Layouts, value regimes, scalar values and absent optionals on one mid-size shape.
    Case k;
    k.op = op;
    k.dims = fit(small_base);
    k.dtype = dt;
    k.scalars = default_scalars;
    const bool smoke = grid == Grid::kSmoke;  // one layout
    for (const char* layout : {"row_strided", "offset", "transposed", "expanded"}) {
      if (smoke && std::string(layout) != "row_strided") continue;
      Case l = k;
      l.layout = layout;
      emit(l);
    }
    // Test values the regimes' rotation does not reach.
    for (const auto& [name, values] : c.scalar_test_values) {
      for (size_t i = kNumRegimes; i < values.size(); ++i) {
        Case s = k;
        s.scalars[name] = values[i];
        emit(s);
      }
    }
    Case no_opt = k;
    no_opt.with_optional = false;
    emit(no_opt);
    // Every non-default value of a string argument (a call variant), in both grad modes.
    for (const auto& [name, values] : c.variant_args) {
      for (size_t i = 1; i < values.size(); ++i) {
        for (bool grad : {true, false}) {
          Case v = k;
          v.strings[name] = values[i];
          v.grad = grad;
          emit(v);
        }
      }
    }
  }
  return out;
}

}  // namespace kernelgate::harness
