#include "data/unicode.h"

#include <algorithm>
#include <stdexcept>
#include <unordered_map>

namespace keel::data::unicode {

namespace detail {
extern const char kUnicodeVersion[];
extern const size_t kCategoryRunCount;
extern const uint32_t kCategoryRuns[];
extern const size_t kCombiningClassRunCount;
extern const uint32_t kCombiningClassRuns[];
extern const size_t kDecompositionSize;
extern const uint32_t kDecompositions[];
}  // namespace detail

Category category(char32_t c) {
  if (c > 0x10FFFF) return Category::Cn;
  // The last run starting at or before c. Runs are (start << 5 | cat), so comparing against
  // (c << 5 | 31) finds it with one binary search.
  const uint32_t key = (static_cast<uint32_t>(c) << 5) | 31u;
  const uint32_t* end = detail::kCategoryRuns + detail::kCategoryRunCount;
  const uint32_t* it = std::upper_bound(detail::kCategoryRuns, end, key);
  return static_cast<Category>(it[-1] & 31u);
}

const char* unicode_version() { return detail::kUnicodeVersion; }

uint32_t category_mask(std::string_view name) {
  static const char* const kNames[] = {"Cn", "Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd",
                                       "Nl", "No", "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "Sm",
                                       "Sc", "Sk", "So", "Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co"};
  uint32_t mask = 0;
  for (uint32_t i = 0; i < 30; ++i) {
    const std::string_view n = kNames[i];
    // "L" names the whole group (Lu Ll Lt Lm Lo); "Lu" one category. "C" includes Cn.
    if ((name.size() == 1 && n[0] == name[0]) || n == name) mask |= 1u << i;
  }
  // Long names that tokenizer patterns use now and then.
  if (name == "Letter") return category_mask("L");
  if (name == "Number") return category_mask("N");
  if (name == "Mark") return category_mask("M");
  if (name == "Punctuation") return category_mask("P");
  if (name == "Symbol") return category_mask("S");
  if (name == "Separator") return category_mask("Z");
  return mask;
}

bool is_white_space(char32_t c) {
  switch (c) {
    case 0x09: case 0x0A: case 0x0B: case 0x0C: case 0x0D: case 0x20: case 0x85: case 0xA0:
    case 0x1680: case 0x2028: case 0x2029: case 0x202F: case 0x205F: case 0x3000:
      return true;
    default:
      return c >= 0x2000 && c <= 0x200A;
  }
}

bool is_python_space(char32_t c) { return is_white_space(c) || (c >= 0x1C && c <= 0x1F); }

char32_t fold_case(char32_t c) {
  if (c >= 'A' && c <= 'Z') return c + 32;
  if (c == 0x017F) return 's';  // long s
  if (c == 0x212A) return 'k';  // Kelvin sign
  if (c == 0x212B) return 0xE5;  // Angstrom sign
  if ((c >= 0xC0 && c <= 0xDE && c != 0xD7)) return c + 32;  // Latin-1 capitals
  if (c >= 0x391 && c <= 0x3AB && c != 0x3A2) return c + 32;  // Greek capitals
  if (c >= 0x410 && c <= 0x42F) return c + 32;  // Cyrillic capitals
  if (c >= 0x400 && c <= 0x40F) return c + 80;
  return c;
}

uint8_t combining_class(char32_t c) {
  if (c > 0x10FFFF) return 0;
  // Runs are (start << 8 | ccc); the first starts at 0, as in category().
  const uint32_t key = (static_cast<uint32_t>(c) << 8) | 0xFFu;
  const uint32_t* end = detail::kCombiningClassRuns + detail::kCombiningClassRunCount;
  return static_cast<uint8_t>(std::upper_bound(detail::kCombiningClassRuns, end, key)[-1] & 0xFFu);
}

namespace {

// Hangul syllables, arithmetically (The Unicode Standard, 3.12): S = SBase + (L * VCount + V) *
// TCount + T, with L, V, T the indices of the leading consonant, vowel and trailing consonant
// jamo (T = 0: none, so TBase is one below the first trailing jamo).
constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr char32_t kLCount = 19, kVCount = 21, kTCount = 28, kSCount = kLCount * kVCount * kTCount;

// kDecompositions indexed for lookup, and its primary composites as a pair -> composite map.
struct NormalizationTables {
  std::vector<char32_t> mapped;   // code points with a mapping, ascending
  std::vector<uint32_t> header;   // the offset of each one's header in kDecompositions
  std::unordered_map<uint64_t, char32_t> composite;

  static uint64_t pair_key(char32_t a, char32_t b) { return (static_cast<uint64_t>(a) << 21) | b; }

  NormalizationTables() {
    for (size_t pos = 0; pos < detail::kDecompositionSize;) {
      const uint32_t h = detail::kDecompositions[pos];
      mapped.push_back(h >> 8);
      header.push_back(static_cast<uint32_t>(pos));
      if (h & 1u) {  // a primary composite: a pair to compose
        const char32_t a = detail::kDecompositions[pos + 1], b = detail::kDecompositions[pos + 2];
        composite.emplace(pair_key(a, b), h >> 8);
      }
      pos += 1 + ((h >> 2) & 63u);
    }
  }

  // Appends the full decomposition of c: its mapping, applied again to each code point of it
  // (the table holds one level, as UnicodeData.txt does).
  void decompose(char32_t c, bool compat, std::u32string& out) const {
    if (c >= kSBase && c < kSBase + kSCount) {
      const char32_t s = c - kSBase;
      out += static_cast<char32_t>(kLBase + s / (kVCount * kTCount));
      out += static_cast<char32_t>(kVBase + (s % (kVCount * kTCount)) / kTCount);
      if (s % kTCount) out += static_cast<char32_t>(kTBase + s % kTCount);
      return;
    }
    const auto it = std::lower_bound(mapped.begin(), mapped.end(), c);
    if (it == mapped.end() || *it != c) {
      out += c;
      return;
    }
    const uint32_t* h = detail::kDecompositions + header[static_cast<size_t>(it - mapped.begin())];
    if (((*h >> 1) & 1u) && !compat) {  // a compatibility mapping, and NFD / NFC keep c
      out += c;
      return;
    }
    const uint32_t n = (*h >> 2) & 63u;
    for (uint32_t k = 1; k <= n; ++k) decompose(h[k], compat, out);
  }

  // The primary composite of a + b, or 0 when there is none.
  char32_t compose(char32_t a, char32_t b) const {
    if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount)
      return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;  // L + V -> LV
    if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase && b < kTBase + kTCount)
      return a + (b - kTBase);  // LV + T -> LVT
    const auto it = composite.find(pair_key(a, b));
    return it == composite.end() ? 0 : it->second;
  }
};

const NormalizationTables& normalization_tables() {
  static const NormalizationTables t;
  return t;
}

}  // namespace

std::string normalize(std::string_view utf8, NormalForm form) {
  if (std::all_of(utf8.begin(), utf8.end(), [](char b) { return static_cast<unsigned char>(b) < 0x80; }))
    return std::string(utf8);  // ASCII is invariant under every form
  const NormalizationTables& t = normalization_tables();
  const bool compat = form == NormalForm::NFKC || form == NormalForm::NFKD;
  std::u32string d;
  d.reserve(utf8.size());
  for (char32_t c : decode_utf8(utf8, "text to normalize")) t.decompose(c, compat, d);

  // Canonical ordering: each run of non-starters sorted by combining class, stably (marks of
  // one class keep their order; they do not commute).
  struct Char {
    char32_t c;
    uint8_t ccc;
  };
  std::vector<Char> chars(d.size());
  for (size_t i = 0; i < d.size(); ++i) chars[i] = {d[i], combining_class(d[i])};
  for (size_t i = 0; i < chars.size();) {
    size_t j = i;
    while (j < chars.size() && chars[j].ccc != 0) ++j;
    if (j - i > 1)
      std::stable_sort(chars.begin() + i, chars.begin() + j, [](const Char& a, const Char& b) { return a.ccc < b.ccc; });
    i = j + 1;
  }

  // Canonical composition: each character joins the last starter when a primary composite of
  // the two exists and nothing between them blocks it. Between them stand only non-starters in
  // ascending class order, so the last kept one has the highest class: c is blocked when that
  // class is >= its own (a starter c is blocked by any).
  size_t kept = chars.size();
  if (form == NormalForm::NFC || form == NormalForm::NFKC) {
    constexpr size_t kNone = static_cast<size_t>(-1);
    size_t starter = kNone;
    kept = 0;
    for (size_t i = 0; i < chars.size(); ++i) {
      const Char ch = chars[i];
      if (starter != kNone && (kept == starter + 1 || chars[kept - 1].ccc < ch.ccc)) {
        if (const char32_t comp = t.compose(chars[starter].c, ch.c)) {
          chars[starter].c = comp;  // primary composites are starters
          continue;
        }
      }
      if (ch.ccc == 0) starter = kept;
      chars[kept++] = ch;
    }
  }
  std::string out;
  out.reserve(utf8.size() + utf8.size() / 2);
  for (size_t i = 0; i < kept; ++i) append_utf8(out, chars[i].c);
  return out;
}

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

int32_t next_utf8(std::string_view s, size_t& pos) {
  const auto b0 = static_cast<unsigned char>(s[pos]);
  if (b0 < 0x80) {
    ++pos;
    return b0;
  }
  int len = 0;
  uint32_t cp = 0, min = 0;
  if ((b0 & 0xE0) == 0xC0) len = 2, cp = b0 & 0x1F, min = 0x80;
  else if ((b0 & 0xF0) == 0xE0) len = 3, cp = b0 & 0x0F, min = 0x800;
  else if ((b0 & 0xF8) == 0xF0) len = 4, cp = b0 & 0x07, min = 0x10000;
  if (len == 0 || pos + len > s.size()) {
    ++pos;
    return -1;
  }
  for (int k = 1; k < len; ++k) {
    const auto b = static_cast<unsigned char>(s[pos + k]);
    if ((b & 0xC0) != 0x80) {
      ++pos;
      return -1;
    }
    cp = (cp << 6) | (b & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
    ++pos;
    return -1;
  }
  pos += len;
  return static_cast<int32_t>(cp);
}

namespace {

// Length of the well-formed UTF-8 sequence at s[pos], or minus the length of its maximal
// subpart (at least 1) when it is ill-formed. The allowed second bytes follow Unicode's table
// of well-formed byte sequences (E0: A0..BF, ED: 80..9F, F0: 90..BF, F4: 80..8F).
int utf8_sequence_length(std::string_view s, size_t pos) {
  const auto b0 = static_cast<unsigned char>(s[pos]);
  if (b0 < 0x80) return 1;
  int len = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) len = 2;
  else if (b0 == 0xE0) len = 3, lo = 0xA0;
  else if (b0 >= 0xE1 && b0 <= 0xEF) len = 3, hi = b0 == 0xED ? 0x9F : 0xBF;
  else if (b0 == 0xF0) len = 4, lo = 0x90;
  else if (b0 >= 0xF1 && b0 <= 0xF3) len = 4;
  else if (b0 == 0xF4) len = 4, hi = 0x8F;
  else return -1;  // 80..C1, F5..FF never start a sequence
  for (int k = 1; k < len; ++k) {
    if (pos + k >= s.size()) return -k;
    const auto b = static_cast<unsigned char>(s[pos + k]);
    if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xBF)) return -k;
  }
  return len;
}

}  // namespace

bool is_valid_utf8(std::string_view s) {
  for (size_t pos = 0; pos < s.size();) {
    const int n = utf8_sequence_length(s, pos);
    if (n < 0) return false;
    pos += static_cast<size_t>(n);
  }
  return true;
}

std::string replace_invalid_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t pos = 0; pos < s.size();) {
    const int n = utf8_sequence_length(s, pos);
    if (n > 0) {
      out.append(s.substr(pos, static_cast<size_t>(n)));
      pos += static_cast<size_t>(n);
    } else {
      out += "\xEF\xBF\xBD";  // U+FFFD
      pos += static_cast<size_t>(-n);
    }
  }
  return out;
}

std::vector<char32_t> decode_utf8(std::string_view s, const std::string& what) {
  std::vector<char32_t> out;
  out.reserve(s.size());
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t at = pos;
    const int32_t cp = next_utf8(s, pos);
    if (cp < 0) throw std::invalid_argument(what + " is not valid UTF-8 (bad byte sequence at byte " + std::to_string(at) + ")");
    out.push_back(static_cast<char32_t>(cp));
  }
  return out;
}

}  // namespace keel::data::unicode
