#include "data/unicode.h"

#include <algorithm>
#include <stdexcept>

namespace keel::data::unicode {

namespace detail {
extern const char kUnicodeVersion[];
extern const size_t kCategoryRunCount;
extern const uint32_t kCategoryRuns[];
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
