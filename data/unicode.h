// The bits of Unicode the tokenizer needs: general categories (for the \p{L}, \p{N}, ...
// classes of pre-tokenization regexes), the White_Space property (\s), a little case folding
// ((?i:...) groups), the normalization forms NFC, NFD, NFKC and NFKD (normalizers), and UTF-8
// encoding and decoding.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace keel::data::unicode {

// General categories, numbered as in data/unicode_tables.cpp (Cn = unassigned).
enum class Category : uint8_t {
  Cn, Lu, Ll, Lt, Lm, Lo, Mn, Mc, Me, Nd, Nl, No, Pc, Pd, Ps,
  Pe, Pi, Pf, Po, Sm, Sc, Sk, So, Zs, Zl, Zp, Cc, Cf, Cs, Co
};

Category category(char32_t c);
const char* unicode_version();  // of the tables (categories, normalization), e.g. "14.0.0"

// "L" (any letter), "Lu", "N", "Nd", ... -> the set of categories it names, as a bit mask over
// Category values; 0 when the name is not a general category (or one-letter group).
uint32_t category_mask(std::string_view name);
inline bool in_mask(uint32_t mask, char32_t c) { return (mask >> static_cast<unsigned>(category(c))) & 1u; }

// Unicode's White_Space property (what \s matches in Oniguruma, the regex engine of HF
// tokenizers): \t \n \v \f \r, space, U+0085, U+00A0, U+1680, U+2000..U+200A, U+2028, U+2029,
// U+202F, U+205F, U+3000.
bool is_white_space(char32_t c);
// Python's str.isspace() (and its re module's \s): White_Space plus U+001C..U+001F, which
// Python counts by their bidirectional class (B, S). What prepare_data.py's strip() removes.
bool is_python_space(char32_t c);

// Simple case folding for case-insensitive literals: ASCII and Latin-1 letters, Greek and
// Cyrillic basic letters, and the two compatibility characters that fold to ASCII (U+017F long
// s -> s, U+212A Kelvin sign -> k).
char32_t fold_case(char32_t c);

// The Unicode normalization forms of UAX #15: canonical (NFD) or compatibility (NFKD)
// decomposition, then canonical ordering, and for NFC and NFKC canonical composition.
enum class NormalForm { NFC, NFD, NFKC, NFKD };

// The canonical combining class of c (0 for starters; 230 for most accents above).
uint8_t combining_class(char32_t c);

// utf8 in the given normal form, by the tables of unicode_version(). Pure ASCII comes back
// unchanged without a look at the tables. Throws std::invalid_argument on invalid UTF-8.
std::string normalize(std::string_view utf8, NormalForm form);

// Appends the UTF-8 encoding of c.
void append_utf8(std::string& out, char32_t c);

// Decodes one UTF-8 sequence at s[pos]: returns the code point and advances pos. Invalid or
// truncated sequences (overlong forms, surrogates, values above U+10FFFF) return -1 and
// advance by one byte.
int32_t next_utf8(std::string_view s, size_t& pos);

// s with every ill-formed part replaced by U+FFFD, one per maximal subpart (the longest start
// of a well-formed sequence, else one byte), as Python's bytes.decode("utf-8", "replace") and
// Unicode's recommended practice (chapter 3, "U+FFFD Substitution of Maximal Subparts") do.
// Valid UTF-8 comes back unchanged.
std::string replace_invalid_utf8(std::string_view s);
bool is_valid_utf8(std::string_view s);

// The whole string as code points; throws std::invalid_argument naming the byte offset of
// the first invalid sequence.
std::vector<char32_t> decode_utf8(std::string_view s, const std::string& what = "text");

}  // namespace keel::data::unicode
