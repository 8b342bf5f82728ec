// The vector scan of the JSON format: each value's vector read by simdjson (On-Demand)
// straight into one matrix, outside the interpreter lock. See sink/vector_scan.py for the
// contract; this file only reads, it never decides a value's fault.
//
// scan(payloads: list[bytes], path: tuple[str, ...], dim: int, base64: bool, simd: bool)
//     -> (matrix: bytearray, positions: bytes, stripped: list[bytes])
//
// For every payload whose vector it is sure of (see `scan_one`), the vector goes to the
// next row of `matrix`, its position (int64, native order) to `positions`, and the payload
// with the vector's text replaced by `null` to `stripped`. A row is the vector's dim
// float32 values (a JSON array), or with `base64` the base64 text of its 4 * dim bytes as
// it stands between the quotes (decoded by the caller). Every other payload (anything but
// bytes too) is left out: the caller parses it whole.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "simdjson.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define VECTOR_SCAN_SSSE3 1
#include <immintrin.h>
#endif

namespace {

using simdjson::ondemand::array;
using simdjson::ondemand::document;
using simdjson::ondemand::object;
using simdjson::ondemand::parser;
using simdjson::ondemand::value;

constexpr std::string_view kBom{"\xEF\xBB\xBF"};

struct Span {
  size_t start = 0;  // the vector's '['
  size_t end = 0;    // one past its ']'
};

// Whether float32(d) may differ from rounding d's decimal text straight to float32, as
// Arrow's reader does: d lies exactly halfway between two adjacent float32 values (every
// such point is a double, so any other double rounds like its text), or beyond float32's
// finite range (left to Arrow's reader, which names it). As sink.vector_json.float32_ties.
bool float32_unsure(double d, float f) {
  if (!std::isfinite(f) || std::fabs(d) > static_cast<double>(FLT_MAX)) return true;
  uint64_t bits;
  std::memcpy(&bits, &d, sizeof bits);
  constexpr uint64_t kExponent = 0x7FF0000000000000ULL;
  constexpr uint64_t kTiny = static_cast<uint64_t>(1023 - 126) << 52;  // float32 normals
  if ((bits & kExponent) >= kTiny) {
    // In float32's normal range a halfway double has exactly the top one of the 29
    // mantissa bits float32 drops.
    return (bits & ((1ULL << 29) - 1)) == (1ULL << 28);
  }
  // Subnormal float32 range (or zero): the neighbours of f and their midpoint, all doubles.
  const double back = static_cast<double>(f);
  if (back == d) return false;
  const float other = std::nextafter(f, d > back ? INFINITY : -INFINITY);
  return (back + static_cast<double>(other)) * 0.5 == d;
}

// Powers of ten a double holds exactly (10^22 is the last).
constexpr double kExactPowers[] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,
                                   1e8,  1e9,  1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
                                   1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

inline bool is_digit(char c) { return static_cast<unsigned char>(c - '0') < 10; }
inline bool is_space(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

// One JSON number at `p` read to the nearest double when that takes one exact IEEE
// operation (Clinger's fast path: at most 19 digits, a significand within 2^53 and a power
// of ten within 10^22, so the product or quotient is correctly rounded, as simdjson's
// reader gives it). False for anything else (a number this cannot read exactly, or text
// that is not a number: the caller then reads the value with simdjson's reader).
inline bool read_exact_number(const char*& p, double* out) {
  const char* s = p;
  const bool negative = *s == '-';
  s += negative;
  uint64_t significand = 0;
  const char* digits = s;
  if (*s == '0') {
    ++s;
  } else if (is_digit(*s)) {
    while (is_digit(*s)) significand = significand * 10 + static_cast<uint64_t>(*s++ - '0');
  } else {
    return false;
  }
  int64_t exponent = 0;
  if (*s == '.') {
    const char* fraction = ++s;
    while (is_digit(*s)) significand = significand * 10 + static_cast<uint64_t>(*s++ - '0');
    if (s == fraction) return false;
    exponent = fraction - s;
  }
  // The digits read (a leading "0." included): at most 19 cannot overflow 64 bits.
  if (s - digits > 20 || (s - digits > 19 && *digits != '0')) return false;
  if (*s == 'e' || *s == 'E') {
    ++s;
    const bool minus = *s == '-';
    if (*s == '-' || *s == '+') ++s;
    if (!is_digit(*s)) return false;
    int64_t written = 0;
    while (is_digit(*s)) {
      if (written > 1000) return false;  // far outside the fast path anyway
      written = written * 10 + (*s++ - '0');
    }
    exponent += minus ? -written : written;
  }
  if (significand > (1ULL << 53) || exponent < -22 || exponent > 22) return false;
  double d = static_cast<double>(significand);
  d = exponent < 0 ? d / kExactPowers[-exponent] : d * kExactPowers[exponent];
  *out = negative ? -d : d;
  p = s;
  return true;
}

// A component read as the double `d` goes to `out` as float32; false when float32 may not
// round it as Arrow's reader does (`float32_unsure`).
inline bool store_float32(double d, char* out) {
  const float f = static_cast<float>(d);
  if (float32_unsure(d, f)) return false;
  std::memcpy(out, &f, sizeof f);
  return true;
}

// Steps over JSON whitespace to the separator after a component: ',' or, after the last
// one, ']'; true when it is there (p then stands after it).
inline bool at_separator(const char*& p, bool last) {
  while (is_space(*p)) ++p;
  return *p++ == (last ? ']' : ',');
}

// A flat array of `dim` numbers `Read` reads, with JSON whitespace only around them, from
// its '[' at `begin`; the float32 components to `out`, and `*end` one past its ']'. False
// for anything else, which the caller then reads with simdjson's reader. Always inlined, so
// that a `Read` built for SSSE3 is inlined in turn into its SSSE3 caller.
template <bool (*Read)(const char*&, double*)>
__attribute__((always_inline)) inline bool read_flat_with(const char* begin, size_t dim,
                                                          char* out, const char** end) {
  if (*begin != '[') return false;
  const char* p = begin + 1;
  for (size_t count = 0; count < dim; ++count) {
    while (is_space(*p)) ++p;
    const char* text = p;
    double d;
    if (!Read(p, &d)) return false;
    // A negative zero is kept as -0.0, as Arrow's reader gives it, but for the integer
    // "-0": the decoder's own readers disagree on its sign (Arrow's bulk read gives -0.0,
    // the screening of a value it refused +0), so it is left to the decoder's other path.
    if (d == 0.0 && p - text == 2 && std::signbit(d)) return false;
    if (!store_float32(d, out + count * sizeof(float))) return false;
    if (!at_separator(p, count + 1 == dim)) return false;
  }
  *end = p;
  return true;
}

bool read_flat_portable(const char* begin, size_t dim, char* out, const char** end) {
  return read_flat_with<read_exact_number>(begin, dim, out, end);
}

#ifdef VECTOR_SCAN_SSSE3
// The shuffles that right-align a number's digits in 16 bytes, its '.' left out: row
// [dot][count] takes the `count` digits of a text whose '.' is at `dot` (or `dot` == the
// text's length: no '.').
struct DigitShuffles {
  alignas(16) uint8_t rows[16][16][16];
  DigitShuffles() {
    for (int dot = 0; dot < 16; ++dot) {
      for (int count = 0; count < 16; ++count) {
        for (int j = 0; j < 16; ++j) {
          const int digit = j - (16 - count);  // which digit lands in byte j, if any
          rows[dot][count][j] =
              digit < 0 ? 0x80 : static_cast<uint8_t>(digit < dot ? digit : digit + 1);
        }
      }
    }
  }
};
const DigitShuffles kDigitShuffles;

// One component at `p` in a single SIMD step: a text of at most 15 characters after its
// sign, `-?(0|[1-9][0-9]*)(\.[0-9]+)?` up to the ',' or ']' that ends it (so no
// whitespace, no exponent), read to the nearest double by one exact IEEE division
// (at most 15 digits, so the significand is below 2^53 and the power of ten at most 10^14:
// Clinger's fast path, as `read_exact_number`). False for any other text, left to
// `read_exact_number`. The 16 bytes read from `p` lie within the document's padding.
__attribute__((target("ssse3"))) inline bool read_short_number(const char*& p, double* out) {
  const uint64_t negative = *p == '-';
  const char* text = p + negative;
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(text));
  const auto ends = static_cast<unsigned>(_mm_movemask_epi8(
      _mm_or_si128(_mm_cmpeq_epi8(bytes, _mm_set1_epi8(',')),
                   _mm_cmpeq_epi8(bytes, _mm_set1_epi8(']')))));
  if (ends == 0) return false;
  const auto len = static_cast<unsigned>(__builtin_ctz(ends));
  if (len == 0) return false;
  const __m128i inside = _mm_cmplt_epi8(
      _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm_set1_epi8(static_cast<char>(len)));
  const __m128i values = _mm_sub_epi8(bytes, _mm_set1_epi8('0'));
  const __m128i digits = _mm_cmpeq_epi8(_mm_min_epu8(values, _mm_set1_epi8(9)), values);
  const auto others = static_cast<unsigned>(_mm_movemask_epi8(_mm_andnot_si128(digits, inside)));
  if (others & (others - 1)) return false;  // two characters or more that are not digits
  const unsigned dot = others != 0 ? static_cast<unsigned>(__builtin_ctz(others)) : len;
  if (others != 0 && (text[dot] != '.' || dot == 0 || dot + 1 == len)) return false;
  if (dot > 1 && text[0] == '0') return false;  // a leading zero
  const unsigned count = len - (others != 0 ? 1 : 0);
  const __m128i aligned = _mm_shuffle_epi8(
      values, _mm_load_si128(reinterpret_cast<const __m128i*>(kDigitShuffles.rows[dot][count])));
  // Pairs, then fours, then the two halves of eight digits (as simdjson's SIMD kernels).
  const __m128i pairs = _mm_maddubs_epi16(
      aligned, _mm_setr_epi8(10, 1, 10, 1, 10, 1, 10, 1, 10, 1, 10, 1, 10, 1, 10, 1));
  const __m128i fours = _mm_madd_epi16(pairs, _mm_setr_epi16(100, 1, 100, 1, 100, 1, 100, 1));
  const __m128i eights = _mm_madd_epi16(
      _mm_packs_epi32(fours, fours), _mm_setr_epi16(10000, 1, 10000, 1, 10000, 1, 10000, 1));
  const uint64_t high = static_cast<uint32_t>(_mm_cvtsi128_si32(eights));
  const uint64_t low = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm_srli_si128(eights, 4)));
  const uint64_t significand = high * 100000000ULL + low;
  const double d = static_cast<double>(static_cast<int64_t>(significand)) /
                   kExactPowers[others != 0 ? count - dot : 0];
  *out = negative != 0 ? -d : d;
  p = text + len;
  return true;
}

// One component by `read_short_number` when it can, else by `read_exact_number`.
__attribute__((target("ssse3"))) inline bool read_number_ssse3(const char*& p, double* out) {
  return read_short_number(p, out) || read_exact_number(p, out);
}

// As `read_flat_portable`, each component read by `read_number_ssse3`.
__attribute__((target("ssse3"))) bool read_flat_ssse3(const char* begin, size_t dim, char* out,
                                                       const char** end) {
  return read_flat_with<read_number_ssse3>(begin, dim, out, end);
}

const bool kHasSsse3 = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("ssse3") != 0;
}();
#else
const bool kHasSsse3 = false;
#endif

// Base64 text of `bytes` bytes: its length, and how many '=' end it (standard alphabet).
size_t base64_chars(size_t bytes) { return (bytes + 2) / 3 * 4; }
size_t base64_padding(size_t bytes) { return (3 - bytes % 3) % 3; }

// The standard base64 alphabet (RFC 4648 section 4), without the padding '='.
struct Base64Alphabet {
  bool in[256] = {};
  Base64Alphabet() {
    for (unsigned char c = 'A'; c <= 'Z'; ++c) in[c] = true;
    for (unsigned char c = 'a'; c <= 'z'; ++c) in[c] = true;
    for (unsigned char c = '0'; c <= '9'; ++c) in[c] = true;
    in[static_cast<unsigned char>('+')] = in[static_cast<unsigned char>('/')] = true;
  }
};
const Base64Alphabet kBase64;

class Scanner {
 public:
  Scanner(std::vector<std::string> path, size_t dim, bool base64, bool simd)
      : path_(std::move(path)),
        dim_(dim),
        base64_(base64),
        simd_(simd && kHasSsse3),
        chars_(base64_chars(dim * sizeof(float))),
        padding_(base64_padding(dim * sizeof(float))) {}

  // Bytes of one row of the matrix.
  size_t row_bytes() const { return base64_ ? chars_ : dim_ * sizeof(float); }

  // Reads one payload; true when its vector went to `out` (one row) and `span`.
  bool scan_one(const char* data, size_t len, char* out, Span* span) {
    if (len >= kBom.size() && std::string_view(data, kBom.size()) == kBom) return false;
    if (padded_.size() < len + simdjson::SIMDJSON_PADDING) {
      padded_.resize(len + simdjson::SIMDJSON_PADDING);
    }
    std::memcpy(padded_.data(), data, len);
    std::memset(padded_.data() + len, 0, simdjson::SIMDJSON_PADDING);
    document doc;
    if (parser_.iterate(padded_.data(), len, padded_.size()).get(doc)) return false;
    object root;
    if (doc.get_object().get(root)) return false;
    out_ = out;
    found_ = false;
    if (!walk(doc, root, 0)) return false;
    if (!found_) return false;
    // The rest of the document is left to Arrow's reader (it gets the stripped text).
    span->start = start_;
    span->end = end_;
    return true;
  }

 private:
  // Walks the object at path_[level - 1]: exactly one key path_[level] (a duplicate key is
  // read differently by simdjson and by Arrow), an object below it or the vector at the end.
  bool walk(document& doc, object obj, size_t level) {
    bool seen = false;
    for (auto item : obj) {
      simdjson::ondemand::field field;
      if (std::move(item).get(field)) return false;
      std::string_view key;
      if (field.unescaped_key().get(key)) return false;
      if (key != path_[level]) continue;  // the value is skipped by the next step
      if (seen) return false;
      seen = true;
      value child = field.value();
      if (level + 1 == path_.size()) {
        if (!(base64_ ? read_base64(child) : read_vector(doc, child))) return false;
        found_ = true;
        continue;
      }
      object inner;
      if (child.get_object().get(inner)) return false;
      if (!walk(doc, inner, level + 1)) return false;
    }
    return true;
  }

  bool read_vector(document& doc, value v) {
    const char* begin = v.raw_json_token().data();
    // Most vectors are flat arrays of short decimals: read in one pass over the text, the
    // array left unconsumed (the object's iteration skips it). Any other text is read
    // again below by simdjson's reader, which decides it.
    if (read_flat(begin)) return true;
    array arr;
    if (v.get_array().get(arr)) return false;
    size_t count = 0;
    for (auto item : arr) {
      value element;
      if (std::move(item).get(element)) return false;
      double d;
      if (element.get_double().get(d)) return false;  // not a number (nested arrays too)
      if (count == dim_) return false;
      // simdjson gives the integer -0 as +0 (see read_flat_with).
      if (d == 0.0 && element.raw_json_token().front() == '-') return false;
      if (!store_float32(d, out_ + count++ * sizeof(float))) return false;
    }
    if (count != dim_) return false;
    // The iterator now stands on the token after the array's ']'.
    const char* after;
    if (doc.current_location().get(after)) return false;
    const char* end = after;
    while (end > begin && end[-1] != ']') --end;
    if (end == begin) return false;
    start_ = static_cast<size_t>(begin - padded_.data());
    end_ = static_cast<size_t>(end - padded_.data());
    return true;
  }

  // The vector as a flat array of short decimals, read in one pass over its text.
  bool read_flat(const char* begin) {
    const char* end;
#ifdef VECTOR_SCAN_SSSE3
    const bool read = simd_ ? read_flat_ssse3(begin, dim_, out_, &end)
                            : read_flat_portable(begin, dim_, out_, &end);
#else
    const bool read = read_flat_portable(begin, dim_, out_, &end);
#endif
    if (!read) return false;
    start_ = static_cast<size_t>(begin - padded_.data());
    end_ = static_cast<size_t>(end - padded_.data());
    return true;
  }

  // A base64 vector: a string of exactly chars_ characters, the alphabet's but for its
  // padding_ closing '='. Nothing else is sure: an escape (even "\/") or a character
  // outside the alphabet is left to the decoder's other path, which names the fault.
  // Strict base64 (Python's binascii, pybase64 with validate) accepts exactly such text
  // of the right length, so the caller's decode of these rows cannot refuse one.
  bool read_base64(value v) {
    const char* open = v.raw_json_token().data();
    simdjson::ondemand::raw_json_string raw;
    if (v.get_raw_json_string().get(raw)) return false;  // not a string
    const char* text = raw.raw();
    const size_t letters = chars_ - padding_;
    for (size_t i = 0; i < letters; ++i) {
      // The closing quote, a backslash or any other byte outside the alphabet ends it.
      if (!kBase64.in[static_cast<unsigned char>(text[i])]) return false;
    }
    for (size_t i = letters; i < chars_; ++i) {
      if (text[i] != '=') return false;
    }
    if (text[chars_] != '"') return false;
    std::memcpy(out_, text, chars_);
    start_ = static_cast<size_t>(open - padded_.data());
    end_ = static_cast<size_t>(text + chars_ + 1 - padded_.data());
    return true;
  }

  std::vector<std::string> path_;
  size_t dim_;
  bool base64_;
  bool simd_;  // components read by read_flat_ssse3
  size_t chars_;
  size_t padding_;
  parser parser_;
  std::vector<char> padded_;
  char* out_ = nullptr;
  bool found_ = false;
  size_t start_ = 0;
  size_t end_ = 0;
};

// An owned reference, released when it goes out of scope.
struct Owned {
  PyObject* ref = nullptr;
  Owned() = default;
  explicit Owned(PyObject* r) : ref(r) {}
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  ~Owned() { Py_XDECREF(ref); }
  PyObject* release() {
    PyObject* r = ref;
    ref = nullptr;
    return r;
  }
};

PyObject* scan_batch(PyObject* payloads, PyObject* path_obj, Py_ssize_t dim, bool base64,
                      bool simd) {
  std::vector<std::string> path;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(path_obj); ++i) {
    Py_ssize_t size;
    const char* name = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(path_obj, i), &size);
    if (name == nullptr) return nullptr;
    path.emplace_back(name, static_cast<size_t>(size));
  }
  // A copy of the list is held (and bytes are immutable) while the lock is let go.
  Owned held(PyList_GetSlice(payloads, 0, PyList_GET_SIZE(payloads)));
  if (held.ref == nullptr) return nullptr;
  const Py_ssize_t n = PyList_GET_SIZE(held.ref);
  std::vector<const char*> data(static_cast<size_t>(n), nullptr);
  std::vector<size_t> lengths(static_cast<size_t>(n), 0);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyList_GET_ITEM(held.ref, i);
    if (PyBytes_Check(item)) {  // anything else is left out
      data[i] = PyBytes_AS_STRING(item);
      lengths[i] = static_cast<size_t>(PyBytes_GET_SIZE(item));
    }
  }
  Scanner scanner(std::move(path), static_cast<size_t>(dim), base64, simd);
  const size_t row_bytes = scanner.row_bytes();
  Owned matrix(PyByteArray_FromStringAndSize(nullptr, n * row_bytes));
  if (matrix.ref == nullptr) return nullptr;
  std::vector<int64_t> positions;
  std::vector<Span> spans;
  positions.reserve(static_cast<size_t>(n));
  spans.reserve(static_cast<size_t>(n));
  char* rows = PyByteArray_AS_STRING(matrix.ref);
  bool failed = false;
  Py_BEGIN_ALLOW_THREADS
  try {
    for (Py_ssize_t i = 0; i < n; ++i) {
      Span span;
      char* out = rows + positions.size() * row_bytes;
      if (data[i] != nullptr && scanner.scan_one(data[i], lengths[i], out, &span)) {
        positions.push_back(i);
        spans.push_back(span);
      }
    }
  } catch (const std::bad_alloc&) {  // no exception may cross the lock's release
    failed = true;
  }
  Py_END_ALLOW_THREADS
  if (failed) return PyErr_NoMemory();
  Owned stripped(PyList_New(static_cast<Py_ssize_t>(positions.size())));
  if (stripped.ref == nullptr) return nullptr;
  for (size_t k = 0; k < positions.size(); ++k) {
    const char* src = data[positions[k]];
    const size_t len = lengths[positions[k]];
    const Span& s = spans[k];
    PyObject* text = PyBytes_FromStringAndSize(
        nullptr, static_cast<Py_ssize_t>(s.start + 4 + (len - s.end)));
    if (text == nullptr) return nullptr;
    char* dst = PyBytes_AS_STRING(text);
    std::memcpy(dst, src, s.start);
    std::memcpy(dst + s.start, "null", 4);
    std::memcpy(dst + s.start + 4, src + s.end, len - s.end);
    PyList_SET_ITEM(stripped.ref, static_cast<Py_ssize_t>(k), text);
  }
  Owned where(PyBytes_FromStringAndSize(reinterpret_cast<const char*>(positions.data()),
                                        positions.size() * sizeof(int64_t)));
  if (where.ref == nullptr) return nullptr;
  return Py_BuildValue("(NNN)", matrix.release(), where.release(), stripped.release());
}

PyObject* scan(PyObject*, PyObject* args) {
  PyObject* payloads;
  PyObject* path_obj;
  Py_ssize_t dim;
  int base64 = 0;
  int simd = 1;
  if (!PyArg_ParseTuple(args, "O!O!n|pp", &PyList_Type, &payloads, &PyTuple_Type, &path_obj,
                        &dim, &base64, &simd)) {
    return nullptr;
  }
  if (dim <= 0 || PyTuple_GET_SIZE(path_obj) == 0) {
    PyErr_SetString(PyExc_ValueError, "scan needs a positive dim and a non-empty path");
    return nullptr;
  }
  try {
    return scan_batch(payloads, path_obj, dim, base64 != 0, simd != 0);
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  }
}

PyMethodDef kMethods[] = {
    {"scan", scan, METH_VARARGS,
     "scan(payloads, path, dim, base64=False, simd=True) -> (matrix, positions, stripped): "
     "see sink.vector_scan."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT, "sink._vector_scan",
    "simdjson's On-Demand reader of JSON vectors, outside the interpreter lock.", -1, kMethods,
};

}  // namespace

PyMODINIT_FUNC PyInit__vector_scan() { return PyModule_Create(&kModule); }
