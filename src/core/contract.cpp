// Op contracts: parsing the named-dim spec, checking a call against it, and the dispatch key's
// per-call parts (size buckets, alignment class).
#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

#include "kernelgate/dispatch.h"

namespace kernelgate {
namespace {

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\n");
  size_t e = s.find_last_not_of(" \t\n");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string part;
  while (std::getline(ss, part, sep)) out.push_back(trim(part));
  return out;
}

const char* dtype_list(const OpContract& c) {
  // Built once per contract on the error path only.
  static thread_local std::string text;
  text.clear();
  for (size_t i = 0; i < c.dtypes.size(); ++i) {
    if (i) text += i + 1 == c.dtypes.size() ? " or " : ", ";
    text += dtype_name(c.dtypes[i]);
  }
  return text.c_str();
}

// Where a named dim was first bound, for error messages: "x.size(-1)".
struct Binding {
  int64_t size = -1;
  int arg = -1;
  int64_t dim = 0;  // negative: counted from the end
  bool variadic = false;
};

std::string where(const OpContract& c, const Binding& b) {
  const std::string& n = c.tensor_args[b.arg].name;
  if (b.variadic) return "the leading dims of " + n;
  return n + ".size(" + std::to_string(b.dim) + ")";
}

}  // namespace

std::string dtype_name(c10::ScalarType t) { return c10::getDtypeNames(t).first; }

void parse_dims(OpContract& c) {
  c.tensor_args.clear();
  c.named_dims.clear();
  for (const std::string& entry : split(c.dims, ';')) {
    if (entry.empty()) continue;
    size_t colon = entry.find(':');
    size_t open = entry.find('['), close = entry.find(']');
    TORCH_CHECK(colon != std::string::npos && open != std::string::npos &&
                    close != std::string::npos && colon < open && open < close,
                "op ", c.name, ": malformed dims entry '", entry, "'");
    TensorArgSpec arg;
    arg.name = trim(entry.substr(0, colon));
    if (!arg.name.empty() && arg.name.back() == '?') {
      arg.optional = true;
      arg.name.pop_back();
    }
    std::string tail = trim(entry.substr(close + 1));
    TORCH_CHECK(tail.empty() || tail == "index", "op ", c.name, ": unknown dtype class '", tail,
                "' for ", arg.name);
    if (tail == "index") arg.dtype_class = DTypeClass::kIndex;
    int variadics = 0;
    for (std::string d : split(entry.substr(open + 1, close - open - 1), ',')) {
      if (d.empty()) continue;
      DimSpec spec;
      if (d[0] == '*') {
        spec.variadic = true;
        d = d.substr(1);
        ++variadics;
      }
      auto it = std::find(c.named_dims.begin(), c.named_dims.end(), d);
      if (it == c.named_dims.end()) {
        c.named_dims.push_back(d);
        it = c.named_dims.end() - 1;
      }
      spec.named_dim = static_cast<int>(it - c.named_dims.begin());
      arg.dims.push_back(spec);
    }
    TORCH_CHECK(variadics <= 1, "op ", c.name, ": ", arg.name, " has more than one *dim");
    c.tensor_args.push_back(std::move(arg));
  }
  TORCH_CHECK(!c.tensor_args.empty(), "op ", c.name, ": dims names no tensor argument");
  TORCH_CHECK(c.tensor_args.size() <= kMaxTensorArgs && c.named_dims.size() <= kMaxNamedDims, "op ",
              c.name, ": too many tensor arguments or named dims");
}

std::string one_of(const std::vector<std::string>& values) {
  std::string out;
  for (size_t i = 0; i < values.size(); ++i) {
    if (i) out += i + 1 == values.size() ? " or " : ", ";
    out += "'" + values[i] + "'";
  }
  return out;
}

uint16_t variant_of(const OpContract& c, const std::map<std::string, std::string>& strings) {
  uint16_t variant = 0;
  for (const auto& [name, values] : c.variant_args) {
    auto it = strings.find(name);
    if (it == strings.end()) continue;
    auto pos = std::find(values.begin(), values.end(), it->second);
    if (pos == values.end()) {
      TORCH_CHECK(false, c.name, ": ", name, " must be ", one_of(values), ", got '", it->second,
                  "'");
    }
    variant = static_cast<uint16_t>(variant * values.size() + (pos - values.begin()));
  }
  return variant;
}

BoundDims check_call(const OpContract& c, const CallView& call) {
  TORCH_INTERNAL_ASSERT(call.num_tensors == static_cast<int>(c.tensor_args.size()));
  std::array<Binding, kMaxNamedDims> bound{};
  const at::Tensor* first = nullptr;  // first present tensor: device reference
  const at::Tensor* first_float = nullptr;
  int first_float_arg = -1;
  for (int a = 0; a < call.num_tensors; ++a) {
    const TensorArgSpec& spec = c.tensor_args[a];
    const at::Tensor* t = call.tensors[a];
    if (t == nullptr || !t->defined()) {
      TORCH_CHECK(spec.optional, c.name, ": ", spec.name, " must be a tensor, got None");
      continue;
    }
    if (first == nullptr) {
      first = t;
    } else {
      TORCH_CHECK(t->device() == first->device(), c.name, ": ", spec.name,
                  " must be on the same device as ", c.tensor_args[0].name, " (", first->device(),
                  "), got ", t->device());
    }
    const c10::ScalarType st = t->scalar_type();
    if (spec.dtype_class == DTypeClass::kIndex) {
      TORCH_CHECK(st == c10::kLong || st == c10::kInt, c.name, ": ", spec.name,
                  " must be an integer tensor of dtype int64 or int32, got ", dtype_name(st));
    } else if (first_float == nullptr) {
      bool ok = std::find(c.dtypes.begin(), c.dtypes.end(), st) != c.dtypes.end();
      TORCH_CHECK(ok, c.name, ": ", spec.name, " must be a floating-point tensor of dtype ",
                  dtype_list(c), ", got ", dtype_name(st));
      first_float = t;
      first_float_arg = a;
    } else {
      TORCH_CHECK(st == first_float->scalar_type(), c.name, ": ", spec.name,
                  " must have the dtype of ", c.tensor_args[first_float_arg].name, " (",
                  dtype_name(first_float->scalar_type()), "), got ", dtype_name(st));
    }
    const int64_t rank = t->dim();
    const int64_t fixed = static_cast<int64_t>(spec.dims.size());
    bool has_variadic = false;
    for (const DimSpec& d : spec.dims) has_variadic |= d.variadic;
    if (has_variadic) {
      TORCH_CHECK(rank >= fixed - 1, c.name, ": ", spec.name, " must have at least ", fixed - 1,
                  fixed - 1 == 1 ? " dim" : " dims", ", got ", rank, " (shape ", t->sizes(), ")");
    } else {
      TORCH_CHECK(rank == fixed, c.name, ": ", spec.name, " must have ", fixed,
                  fixed == 1 ? " dim" : " dims", ", got ", rank, " (shape ", t->sizes(), ")");
    }
    // Walk the spec; a variadic dim absorbs rank - (fixed - 1) leading dims.
    int64_t pos = 0;
    for (size_t k = 0; k < spec.dims.size(); ++k) {
      const DimSpec& d = spec.dims[k];
      int64_t size = 1;
      Binding here{0, a, 0, d.variadic};
      if (d.variadic) {
        int64_t n = rank - (fixed - 1);
        for (int64_t i = 0; i < n; ++i) size *= t->size(pos + i);
        pos += n;
      } else {
        size = t->size(pos);
        here.dim = pos - rank;  // report from the end: x.size(-1)
        ++pos;
      }
      here.size = size;
      Binding& b = bound[d.named_dim];
      if (b.arg < 0) {
        b = here;
      } else {
        TORCH_CHECK(size == b.size, c.name, ": ", where(c, here), " must be ", b.size, " to match ",
                    where(c, b), " (", c.named_dims[d.named_dim], "), got ", size);
      }
    }
  }
  BoundDims out;
  for (size_t i = 0; i < c.named_dims.size(); ++i)
    out.size[i] = bound[i].arg < 0 ? 0 : bound[i].size;
  return out;
}

uint8_t size_bucket(int64_t n) {
  if (n <= 0) return kEmptyBucket;
  uint64_t v = static_cast<uint64_t>(n);
  return static_cast<uint8_t>(v == 1 ? 0 : 64 - __builtin_clzll(v - 1));
}

AlignClass align_class(const CallView& call) {
  AlignClass worst = AlignClass::kVec16;
  for (int a = 0; a < call.num_tensors; ++a) {
    const at::Tensor* t = call.tensors[a];
    if (t == nullptr || !t->defined() || t->numel() == 0) continue;
    if (!t->is_contiguous()) return AlignClass::kStrided;
    // A tensor being traced (torch.compile's fake and functional tensors) has no address: taken
    // as aligned, as a fresh allocation is.
    const bool traced = t->key_set().has(c10::DispatchKey::Python) || t->is_meta() ||
                        !t->unsafeGetTensorImpl()->has_storage();
    const auto addr = traced ? uintptr_t{0} : reinterpret_cast<uintptr_t>(t->const_data_ptr());
    const int64_t inner = t->dim() == 0 ? 1 : t->size(-1);
    if (addr % 16 != 0 || (inner * static_cast<int64_t>(t->element_size())) % 16 != 0) {
      worst = AlignClass::kContiguous;
    }
  }
  return worst;
}

const char* align_class_name(AlignClass a) {
  switch (a) {
    case AlignClass::kVec16: return "vec16";
    case AlignClass::kContiguous: return "contiguous";
    case AlignClass::kStrided: return "strided";
  }
  return "?";
}

const char* backend_kind_name(BackendKind kind) {
  switch (kind) {
    case BackendKind::kReference: return "reference";
    case BackendKind::kKernelgate: return "kernelgate";
    case BackendKind::kVendor: return "vendor";
    case BackendKind::kPython: return "python";
    case BackendKind::kEager: return "eager";
  }
  return "?";
}

}  // namespace kernelgate
