// Python's value semantics and jinja's builtins for data/jinja.h: str() and repr(), equality
// and ordering, JSON in and out (json.dumps as HF's tojson calls it), attribute and item
// access with the str and dict methods templates call, and the filters, tests and globals.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <clocale>
#include <cwctype>
#include <locale.h>
#include <map>
#include <optional>

#include "data/corpus.h"
#include "data/jinja_value.h"
#include "data/unicode.h"

namespace keel::data::jinja {

namespace {

[[noreturn]] void fail(const std::string& message) { throw RenderError(message); }

// A string's code points, each as its UTF-8 bytes (Python indexes strings by code point).
std::vector<std::string> code_points(const std::string& s) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t start = pos;
    unicode::next_utf8(s, pos);
    out.push_back(s.substr(start, pos - start));
  }
  return out;
}

char32_t code_point(const std::string& s) {
  size_t pos = 0;
  const int32_t c = unicode::next_utf8(s, pos);
  return c < 0 ? 0xFFFD : static_cast<char32_t>(c);
}

bool is_space(const std::string& cp) { return unicode::is_python_space(code_point(cp)); }

// str.strip / lstrip / rstrip: whitespace (data/corpus.h's python_*strip: the common case,
// |trim on every message, without splitting into code points), or any code point of `chars`.
std::string strip(const std::string& s, const Value& chars, bool left, bool right) {
  if (!chars.is_string()) {
    std::string_view v = s;
    if (left) v = python_lstrip(v);
    if (right) v = python_rstrip(v);
    return std::string(v);
  }
  const std::vector<std::string> cps = code_points(s), set = code_points(chars.s);
  auto strippable = [&](const std::string& cp) { return std::find(set.begin(), set.end(), cp) != set.end(); };
  size_t b = 0, e = cps.size();
  if (left)
    while (b < e && strippable(cps[b])) ++b;
  if (right)
    while (e > b && strippable(cps[e - 1])) --e;
  std::string out;
  for (size_t k = b; k < e; ++k) out += cps[k];
  return out;
}

// Unicode case mappings, as Python's str.upper()/lower(): the simple mappings of the C
// library's C.UTF-8 locale, plus the full uppercase of U+00DF (ß -> SS, Ss in title case).
locale_t utf8_locale() {
  static const locale_t loc = newlocale(LC_CTYPE_MASK, "C.UTF-8", static_cast<locale_t>(nullptr));
  return loc;
}

enum class Case { upper, lower, title };

std::string map_case(char32_t c, Case to) {
  std::string out;
  if (c == 0xDF && to != Case::lower) return to == Case::upper ? "SS" : "Ss";
  char32_t m = c;
  if (c < 0x80) {
    if (to == Case::lower && c >= 'A' && c <= 'Z') m = c + 32;
    if (to != Case::lower && c >= 'a' && c <= 'z') m = c - 32;
  } else if (utf8_locale()) {
    m = static_cast<char32_t>(to == Case::lower ? towlower_l(static_cast<wint_t>(c), utf8_locale())
                                                : towupper_l(static_cast<wint_t>(c), utf8_locale()));
  }
  unicode::append_utf8(out, m);
  return out;
}

bool is_cased(char32_t c) {
  using unicode::Category;
  const Category cat = unicode::category(c);
  return cat == Category::Lu || cat == Category::Ll || cat == Category::Lt;
}

std::string to_case(const std::string& s, Case to) {
  std::string out;
  for (const std::string& cp : code_points(s)) out += map_case(code_point(cp), to);
  return out;
}
std::string to_upper(const std::string& s) { return to_case(s, Case::upper); }
std::string to_lower(const std::string& s) { return to_case(s, Case::lower); }

// str.capitalize(): the first character in title case, the rest lower.
std::string capitalize(const std::string& s) {
  std::string out;
  bool first = true;
  for (const std::string& cp : code_points(s)) {
    out += map_case(code_point(cp), first ? Case::title : Case::lower);
    first = false;
  }
  return out;
}

// str.title(): title case after an uncased character, lower case after a cased one.
std::string python_title(const std::string& s) {
  std::string out;
  bool prev_cased = false;
  for (const std::string& cp : code_points(s)) {
    const char32_t c = code_point(cp);
    out += map_case(c, prev_cased ? Case::lower : Case::title);
    prev_cased = is_cased(c);
  }
  return out;
}

// jinja's title filter: every word (after -, whitespace or an opening bracket) capitalized.
std::string title(const std::string& s) {
  std::string out;
  bool word_start = true;
  for (const std::string& cp : code_points(s)) {
    const bool boundary = is_space(cp) || cp == "-" || cp == "(" || cp == "{" || cp == "[" || cp == "<";
    out += boundary ? cp : map_case(code_point(cp), word_start ? Case::upper : Case::lower);
    word_start = boundary;
  }
  return out;
}

// str.islower() / isupper(): some cased character, and none of the other case.
bool has_only_case(const std::string& s, bool lower) {
  bool cased = false;
  for (const std::string& cp : code_points(s)) {
    const char32_t c = code_point(cp);
    using unicode::Category;
    const Category cat = unicode::category(c);
    if (cat == Category::Lt || cat == (lower ? Category::Lu : Category::Ll)) return false;
    cased |= is_cased(c);
  }
  return cased;
}

std::vector<std::string> split(const std::string& s, const Value& sep, int64_t maxsplit) {
  std::vector<std::string> out;
  if (!sep.is_string()) {  // runs of whitespace, no empty parts
    const std::vector<std::string> cps = code_points(s);
    size_t k = 0;
    while (k < cps.size()) {
      while (k < cps.size() && is_space(cps[k])) ++k;
      if (k == cps.size()) break;
      if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
        std::string rest;
        for (size_t j = k; j < cps.size(); ++j) rest += cps[j];
        // Python keeps the remainder's trailing whitespace only when... it strips it: rstrip.
        out.push_back(strip(rest, Value::none(), false, true));
        return out;
      }
      std::string word;
      while (k < cps.size() && !is_space(cps[k])) word += cps[k++];
      out.push_back(word);
    }
    return out;
  }
  if (sep.s.empty()) fail("empty separator");
  size_t pos = 0;
  while (true) {
    const size_t hit = s.find(sep.s, pos);
    if (hit == std::string::npos || (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit)) {
      out.push_back(s.substr(pos));
      return out;
    }
    out.push_back(s.substr(pos, hit - pos));
    pos = hit + sep.s.size();
  }
}

std::vector<std::string> splitlines(const std::string& s) {
  std::vector<std::string> out;
  const std::vector<std::string> cps = code_points(s);
  std::string line;
  for (size_t k = 0; k < cps.size(); ++k) {
    const std::string& c = cps[k];
    const char32_t cp = code_point(c);
    const bool br = cp == '\n' || cp == '\r' || cp == 0x0B || cp == 0x0C || cp == 0x1C || cp == 0x1D ||
                    cp == 0x1E || cp == 0x85 || cp == 0x2028 || cp == 0x2029;
    if (!br) {
      line += c;
      continue;
    }
    if (cp == '\r' && k + 1 < cps.size() && cps[k + 1] == "\n") ++k;
    out.push_back(line);
    line.clear();
  }
  if (!line.empty()) out.push_back(line);
  return out;
}

std::string replace(const std::string& s, const std::string& from, const std::string& to, int64_t count) {
  std::string out;
  if (from.empty()) {  // Python inserts `to` between code points (and at both ends)
    const std::vector<std::string> cps = code_points(s);
    int64_t n = 0;
    for (const std::string& c : cps) {
      if (count < 0 || n < count) out += to, ++n;
      out += c;
    }
    if (count < 0 || n < count) out += to;
    return out;
  }
  size_t pos = 0;
  int64_t n = 0;
  while (count < 0 || n < count) {
    const size_t hit = s.find(from, pos);
    if (hit == std::string::npos) break;
    out += s.substr(pos, hit - pos) + to;
    pos = hit + from.size();
    ++n;
  }
  return out + s.substr(pos);
}

int64_t count_of(const std::string& s, const std::string& sub) {
  if (sub.empty()) return static_cast<int64_t>(code_points(s).size()) + 1;
  int64_t n = 0;
  for (size_t pos = s.find(sub); pos != std::string::npos; pos = s.find(sub, pos + sub.size())) ++n;
  return n;
}

// str.find: the code-point index of the first occurrence, or -1.
int64_t find_index(const std::string& s, const std::string& sub) {
  const size_t hit = s.find(sub);
  if (hit == std::string::npos) return -1;
  return static_cast<int64_t>(code_points(s.substr(0, hit)).size());
}

bool starts_or_ends(const std::string& s, const Value& arg, bool start) {
  auto one = [&](const Value& v) {
    if (!v.is_string()) fail("startswith/endswith takes a string or a tuple of strings, not " + type_name(v));
    const std::string& p = v.s;
    return p.size() <= s.size() && (start ? s.compare(0, p.size(), p) == 0 : s.compare(s.size() - p.size(), p.size(), p) == 0);
  };
  if (arg.is_list()) return std::any_of(arg.list->begin(), arg.list->end(), one);
  return one(arg);
}

// A JSON string as json.dumps writes it (\uXXXX in lower-case hex for control characters and,
// with ensure_ascii, for non-ASCII ones as surrogate pairs): nlohmann's escaping is the same.
std::string json_string(const std::string& s, bool ensure_ascii) {
  return nlohmann::json(s).dump(-1, ' ', ensure_ascii, nlohmann::json::error_handler_t::replace);
}

std::string repr_string(const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos, has_double = s.find('"') != std::string::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  size_t pos = 0;
  char buf[16];
  while (pos < s.size()) {
    const size_t start = pos;
    const int32_t c = unicode::next_utf8(s, pos);
    if (c == quote || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == ' ') {
      out += ' ';
    } else {
      // str.isprintable(): not Cc, Cf, Cs, Co, Cn, Zl, Zp, Zs (space excepted, above).
      using unicode::Category;
      const Category cat = c < 0 ? Category::Cn : unicode::category(static_cast<char32_t>(c));
      const bool printable = !(cat == Category::Cc || cat == Category::Cf || cat == Category::Cs ||
                               cat == Category::Co || cat == Category::Cn || cat == Category::Zl ||
                               cat == Category::Zp || cat == Category::Zs);
      if (printable) {
        out += s.substr(start, pos - start);
      } else {
        const int32_t v = c < 0 ? 0xFFFD : c;
        std::snprintf(buf, sizeof buf, v < 0x100 ? "\\x%02x" : v < 0x10000 ? "\\u%04x" : "\\U%08x", v);
        out += buf;
      }
    }
  }
  return out + quote;
}

// Python slicing of n items: the indices of x[start:stop:step].
std::vector<int64_t> slice_indices(int64_t n, const Value& start, const Value& stop, const Value& step) {
  auto as_int = [](const Value& v, const char* what) -> std::optional<int64_t> {
    if (v.is_undefined() || v.is_none()) return std::nullopt;
    if (v.kind != Value::Kind::Int) fail(std::string("slice ") + what + " must be an integer, not " + type_name(v));
    return v.i;
  };
  const int64_t st = as_int(step, "step").value_or(1);
  if (st == 0) fail("slice step cannot be zero");
  auto clamp = [&](std::optional<int64_t> x, int64_t dflt) {
    if (!x) return dflt;
    int64_t v = *x < 0 ? *x + n : *x;
    if (st > 0) return std::clamp<int64_t>(v, 0, n);
    return std::clamp<int64_t>(v, -1, n - 1);
  };
  const int64_t b = clamp(as_int(start, "start"), st > 0 ? 0 : n - 1);
  const int64_t e = clamp(as_int(stop, "stop"), st > 0 ? n : -1);
  std::vector<int64_t> out;
  for (int64_t k = b; st > 0 ? k < e : k > e; k += st) out.push_back(k);
  return out;
}

Value method(Function fn) { return Value::function(std::move(fn)); }

Value string_method(const std::string& s, const std::string& name) {
  auto str = [](Args& a, size_t i, const char* n) {
    Value v = a.get(i, n);
    if (!v.is_string()) fail(a.what + ": argument '" + n + "' must be a string, not " + type_name(v));
    return v.s;
  };
  if (name == "strip" || name == "lstrip" || name == "rstrip")
    return method([s, name](Args& a) {
      Value chars = a.get(0, "chars", Value::none());
      a.done();
      return Value::string(strip(s, chars, name != "rstrip", name != "lstrip"));
    });
  if (name == "split")
    return method([s](Args& a) {
      Value sep = a.get(0, "sep", Value::none());
      Value maxsplit = a.get(1, "maxsplit", Value::integer(-1));
      a.done();
      std::vector<Value> parts;
      for (std::string& p : split(s, sep, maxsplit.i)) parts.push_back(Value::string(std::move(p)));
      return Value::make_list(std::move(parts));
    });
  if (name == "splitlines")
    return method([s](Args& a) {
      a.done();
      std::vector<Value> parts;
      for (std::string& p : splitlines(s)) parts.push_back(Value::string(std::move(p)));
      return Value::make_list(std::move(parts));
    });
  if (name == "startswith" || name == "endswith")
    return method([s, name](Args& a) {
      Value p = a.get(0, "prefix");
      a.done();
      return Value::boolean(starts_or_ends(s, p, name == "startswith"));
    });
  if (name == "upper" || name == "lower" || name == "title" || name == "capitalize")
    return method([s, name](Args& a) {
      a.done();
      return Value::string(name == "upper"   ? to_upper(s)
                           : name == "lower" ? to_lower(s)
                           : name == "title" ? python_title(s)
                                             : capitalize(s));
    });
  if (name == "replace")
    return method([s, str](Args& a) {
      const std::string from = str(a, 0, "old"), to = str(a, 1, "new");
      Value count = a.get(2, "count", Value::integer(-1));
      a.done();
      return Value::string(replace(s, from, to, count.i));
    });
  if (name == "find")
    return method([s, str](Args& a) {
      const std::string sub = str(a, 0, "sub");
      a.done();
      return Value::integer(find_index(s, sub));
    });
  if (name == "count")
    return method([s, str](Args& a) {
      const std::string sub = str(a, 0, "sub");
      a.done();
      return Value::integer(count_of(s, sub));
    });
  if (name == "join")
    return method([s](Args& a) {
      Value items = a.get(0, "iterable");
      a.done();
      std::string out;
      bool first = true;
      for (const Value& v : iterate(items)) {
        if (!v.is_string()) fail("str.join: expected str items, found " + type_name(v));
        out += (first ? "" : s) + v.s;
        first = false;
      }
      return Value::string(out);
    });
  return Value::undefined("'str object' has no attribute '" + name + "'");
}

Value dict_method(const std::shared_ptr<Dict>& d, const std::string& name) {
  if (name == "items" || name == "keys" || name == "values")
    return method([d, name](Args& a) {
      a.done();
      std::vector<Value> out;
      for (const auto& [k, v] : d->items) {
        if (name == "items") {
          Value pair = Value::make_list({Value::string(k), v});
          pair.is_tuple = true;
          out.push_back(pair);
        } else {
          out.push_back(name == "keys" ? Value::string(k) : v);
        }
      }
      return Value::make_list(std::move(out));
    });
  if (name == "get")
    return method([d](Args& a) {
      Value key = a.get(0, "key");
      Value dflt = a.get(1, "default", Value::none());
      a.done();
      const Value* v = key.is_string() ? d->find(key.s) : nullptr;
      return v ? *v : dflt;
    });
  return Value::undefined("'dict object' has no attribute '" + name + "'");
}

// ---- filters ------------------------------------------------------------------------------

std::string soft_str(const Value& v) { return to_str(v); }

// int(text, base) as Python parses it: whitespace, a sign, underscores between digits, and a
// 0x/0o/0b prefix matching the base (base 0: the prefix picks it). nullopt when it does not parse.
std::optional<int64_t> parse_int(std::string t, int base) {
  if (base != 0 && (base < 2 || base > 36)) return std::nullopt;
  bool neg = false;
  if (!t.empty() && (t[0] == '+' || t[0] == '-')) neg = t[0] == '-', t.erase(0, 1);
  if (t.size() > 2 && t[0] == '0') {
    const char p = static_cast<char>(std::tolower(t[1]));
    const int pb = p == 'x' ? 16 : p == 'o' ? 8 : p == 'b' ? 2 : 0;
    if (pb && (base == 0 || base == pb)) base = pb, t.erase(0, 2);
  }
  if (base == 0) base = 10;
  if (t.empty() || t.front() == '_' || t.back() == '_' || t.find("__") != std::string::npos) return std::nullopt;
  t.erase(std::remove(t.begin(), t.end(), '_'), t.end());
  int64_t x = 0;
  auto [p, ec] = std::from_chars(t.data(), t.data() + t.size(), x, base);
  if (ec != std::errc() || p != t.data() + t.size()) return std::nullopt;
  return neg ? -x : x;
}

Value to_int(const Value& v, const Value& dflt, int base = 10) {
  switch (v.kind) {
    case Value::Kind::Int: return v;
    case Value::Kind::Bool: return Value::integer(v.b);
    case Value::Kind::Float: return Value::integer(static_cast<int64_t>(v.f));
    case Value::Kind::String: {
      const std::string t = strip(v.s, Value::none(), true, true);
      if (auto x = parse_int(t, base)) return Value::integer(*x);
      double d = 0;  // jinja then tries int(float(text))
      auto [p2, ec2] = std::from_chars(t.data(), t.data() + t.size(), d);
      if (ec2 == std::errc() && p2 == t.data() + t.size() && !t.empty()) return Value::integer(static_cast<int64_t>(d));
      return dflt;
    }
    default: return dflt;
  }
}

Value to_float(const Value& v, const Value& dflt) {
  switch (v.kind) {
    case Value::Kind::Int: case Value::Kind::Bool: case Value::Kind::Float: return Value::real(v.as_double());
    case Value::Kind::String: {
      const std::string t = strip(v.s, Value::none(), true, true);
      double d = 0;
      auto [p, ec] = std::from_chars(t.data(), t.data() + t.size(), d);
      if (ec == std::errc() && p == t.data() + t.size() && !t.empty()) return Value::real(d);
      return dflt;
    }
    default: return dflt;
  }
}

// The attribute `attr` of an item (dotted paths as jinja's environment.getitem chain).
Value attribute_of(const Value& item, const std::string& attr) {
  Value v = item;
  size_t pos = 0;
  while (true) {
    const size_t dot = attr.find('.', pos);
    const std::string part = attr.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
    v = get_item(v, Value::string(part));
    if (dot == std::string::npos) return v;
    pos = dot + 1;
  }
}

// Sort key for sort/unique/min/max: strings compared case-insensitively unless asked.
Value sort_key(const Value& v, bool case_sensitive) {
  return v.is_string() && !case_sensitive ? Value::string(to_lower(v.s)) : v;
}

Value select_items(const Value& seq, Args& a, bool by_attribute, bool keep) {
  const std::string attr = by_attribute ? to_str(a.get(0, "attribute")) : "";
  const size_t first_test_arg = by_attribute ? 1 : 0;
  Value test_name = a.pos.size() > first_test_arg ? a.pos[first_test_arg] : Value::undefined();
  if (!test_name.is_undefined()) a.get(first_test_arg, "");
  const Test* test = nullptr;
  if (test_name.is_string()) {
    test = find_test(test_name.s);
    if (!test) fail("no test named '" + test_name.s + "'");
  }
  Args test_args;
  test_args.what = "test";
  for (size_t k = first_test_arg + 1; k < a.pos.size(); ++k) test_args.pos.push_back(a.get(k, ""));
  a.done();
  std::vector<Value> out;
  for (const Value& item : iterate(seq)) {
    const Value v = by_attribute ? attribute_of(item, attr) : item;
    Args t = test_args;
    const bool ok = test ? (*test)(v, t) : truthy(v);
    if (ok == keep) out.push_back(item);
  }
  return Value::make_list(std::move(out));
}

std::string indent(std::string s, const Value& width, bool first, bool blank) {
  const std::string pad = width.is_string() ? width.s : std::string(static_cast<size_t>(std::max<int64_t>(0, width.i)), ' ');
  s += "\n";
  std::vector<std::string> lines = splitlines(s);
  std::string rv;
  if (blank) {
    for (size_t k = 0; k < lines.size(); ++k) rv += (k ? "\n" + pad : "") + lines[k];
  } else {
    rv = lines.empty() ? "" : lines[0];
    for (size_t k = 1; k < lines.size(); ++k) rv += "\n" + (lines[k].empty() ? "" : pad + lines[k]);
  }
  return first ? pad + rv : rv;
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

// round(x, digits) as Python: the exact binary value rounded to `digits` decimals, ties to
// even (2.675 is 2.67499999... and rounds to 2.67), which is what printf's %.*f does.
double python_round(double x, int64_t digits) {
  if (digits < 0) {
    const double scale = std::pow(10.0, static_cast<double>(-digits));
    return std::nearbyint(x / scale) * scale;
  }
  char buf[512];
  std::snprintf(buf, sizeof buf, "%.*f", static_cast<int>(std::min<int64_t>(digits, 300)), x);
  return std::strtod(buf, nullptr);
}

std::map<std::string, Filter> make_filters() {
  std::map<std::string, Filter> f;
  f["trim"] = [](const Value& v, Args& a) {
    Value chars = a.get(0, "chars", Value::none());
    a.done();
    return Value::string(strip(soft_str(v), chars, true, true));
  };
  f["length"] = f["count"] = [](const Value& v, Args& a) {
    a.done();
    return Value::integer(length(v));
  };
  f["lower"] = [](const Value& v, Args& a) { a.done(); return Value::string(to_lower(soft_str(v))); };
  f["upper"] = [](const Value& v, Args& a) { a.done(); return Value::string(to_upper(soft_str(v))); };
  f["title"] = [](const Value& v, Args& a) { a.done(); return Value::string(title(soft_str(v))); };
  f["capitalize"] = [](const Value& v, Args& a) { a.done(); return Value::string(capitalize(soft_str(v))); };
  f["string"] = [](const Value& v, Args& a) { a.done(); return Value::string(to_str(v)); };
  f["safe"] = [](const Value& v, Args& a) { a.done(); return v; };
  f["e"] = f["escape"] = [](const Value& v, Args& a) { a.done(); return Value::string(html_escape(to_str(v))); };
  f["tojson"] = [](const Value& v, Args& a) {
    const bool ascii = truthy(a.get(0, "ensure_ascii", Value::boolean(false)));
    Value ind = a.get(1, "indent", Value::none());
    Value seps = a.get(2, "separators", Value::none());
    const bool sort = truthy(a.get(3, "sort_keys", Value::boolean(false)));
    a.done();
    int indent = -1;
    if (ind.kind == Value::Kind::Int) indent = static_cast<int>(std::max<int64_t>(0, ind.i));
    else if (!ind.is_none()) fail("tojson: indent must be an integer");
    std::string item_sep = indent < 0 ? ", " : ",", key_sep = ": ";
    if (!seps.is_none()) {
      if (!seps.is_list() || seps.list->size() != 2 || !(*seps.list)[0].is_string() || !(*seps.list)[1].is_string())
        fail("tojson: separators must be a pair of strings");
      item_sep = (*seps.list)[0].s;
      key_sep = (*seps.list)[1].s;
    }
    return Value::string(to_json(v, ascii, indent, item_sep, key_sep, sort));
  };
  f["int"] = [](const Value& v, Args& a) {
    Value dflt = a.get(0, "default", Value::integer(0));
    Value base = a.get(1, "base", Value::integer(10));
    a.done();
    return to_int(v, dflt, static_cast<int>(base.i));
  };
  f["float"] = [](const Value& v, Args& a) {
    Value dflt = a.get(0, "default", Value::real(0.0));
    a.done();
    return to_float(v, dflt);
  };
  f["abs"] = [](const Value& v, Args& a) {
    a.done();
    if (v.kind == Value::Kind::Int || v.kind == Value::Kind::Bool) return Value::integer(std::llabs(v.kind == Value::Kind::Int ? v.i : v.b));
    if (v.kind == Value::Kind::Float) return Value::real(std::fabs(v.f));
    fail("bad operand type for abs(): '" + type_name(v) + "'");
  };
  f["round"] = [](const Value& v, Args& a) {
    Value prec = a.get(0, "precision", Value::integer(0));
    Value how = a.get(1, "method", Value::string("common"));
    a.done();
    if (!v.is_number()) fail("round: expected a number, not " + type_name(v));
    const double x = v.as_double(), scale = std::pow(10.0, static_cast<double>(prec.i));
    if (how.s == "common") {
      if (v.kind != Value::Kind::Float) return Value::integer(v.kind == Value::Kind::Int ? v.i : v.b);
      return Value::real(python_round(x, prec.i));
    }
    if (how.s == "floor") return Value::real(std::floor(x * scale) / scale);
    if (how.s == "ceil") return Value::real(std::ceil(x * scale) / scale);
    fail("round: method must be 'common', 'ceil' or 'floor'");
  };
  f["list"] = [](const Value& v, Args& a) {
    a.done();
    return Value::make_list(iterate(v));
  };
  f["first"] = [](const Value& v, Args& a) {
    a.done();
    std::vector<Value> items = iterate(v);
    return items.empty() ? Value::undefined("no first item, sequence was empty") : items.front();
  };
  f["last"] = [](const Value& v, Args& a) {
    a.done();
    std::vector<Value> items = iterate(v);
    return items.empty() ? Value::undefined("no last item, sequence was empty") : items.back();
  };
  f["reverse"] = [](const Value& v, Args& a) {
    a.done();
    if (v.is_string()) {
      std::vector<std::string> cps = code_points(v.s);
      std::string out;
      for (auto it = cps.rbegin(); it != cps.rend(); ++it) out += *it;
      return Value::string(out);
    }
    std::vector<Value> items = iterate(v);
    std::reverse(items.begin(), items.end());
    return Value::make_list(std::move(items));
  };
  f["join"] = [](const Value& v, Args& a) {
    const std::string sep = to_str(a.get(0, "d", Value::string("")));
    Value attr = a.get(1, "attribute", Value::none());
    a.done();
    std::string out;
    bool first = true;
    for (const Value& item : iterate(v)) {
      out += (first ? "" : sep) + to_str(attr.is_none() ? item : attribute_of(item, to_str(attr)));
      first = false;
    }
    return Value::string(out);
  };
  f["default"] = f["d"] = [](const Value& v, Args& a) {
    Value dflt = a.get(0, "default_value", Value::string(""));
    const bool boolean = truthy(a.get(1, "boolean", Value::boolean(false)));
    a.done();
    return v.is_undefined() || (boolean && !truthy(v)) ? dflt : v;
  };
  f["replace"] = [](const Value& v, Args& a) {
    const std::string from = to_str(a.get(0, "old")), to = to_str(a.get(1, "new"));
    Value count = a.get(2, "count", Value::none());
    a.done();
    return Value::string(replace(soft_str(v), from, to, count.is_none() ? -1 : count.i));
  };
  f["items"] = [](const Value& v, Args& a) {
    a.done();
    if (v.is_undefined()) return Value::make_list();
    if (!v.is_dict()) fail("items: expected a dict, not " + type_name(v));
    Args none;
    return (*get_attr(v, "items").fn)(none);
  };
  f["selectattr"] = [](const Value& v, Args& a) { return select_items(v, a, true, true); };
  f["rejectattr"] = [](const Value& v, Args& a) { return select_items(v, a, true, false); };
  f["select"] = [](const Value& v, Args& a) { return select_items(v, a, false, true); };
  f["reject"] = [](const Value& v, Args& a) { return select_items(v, a, false, false); };
  f["map"] = [](const Value& v, Args& a) {
    std::vector<Value> out;
    Value attr = a.get(static_cast<size_t>(-1), "attribute");
    if (!attr.is_undefined()) {
      Value dflt = a.get(static_cast<size_t>(-1), "default");
      a.done();
      for (const Value& item : iterate(v)) {
        Value x = attribute_of(item, to_str(attr));
        out.push_back(x.is_undefined() && !dflt.is_undefined() ? dflt : x);
      }
      return Value::make_list(std::move(out));
    }
    Value name = a.get(0, "");
    if (!name.is_string()) fail("map: give a filter name or attribute=");
    const Filter* filter = find_filter(name.s);
    if (!filter) fail("no filter named '" + name.s + "'");
    Args rest;
    rest.what = "filter '" + name.s + "'";
    for (size_t k = 1; k < a.pos.size(); ++k) rest.pos.push_back(a.get(k, ""));
    rest.kw = a.kw;
    for (const Value& item : iterate(v)) {
      Args each = rest;
      out.push_back((*filter)(item, each));
    }
    return Value::make_list(std::move(out));
  };
  f["sort"] = [](const Value& v, Args& a) {
    const bool rev = truthy(a.get(0, "reverse", Value::boolean(false)));
    const bool cs = truthy(a.get(1, "case_sensitive", Value::boolean(false)));
    Value attr = a.get(2, "attribute", Value::none());
    a.done();
    std::vector<Value> items = iterate(v);
    auto key = [&](const Value& x) { return sort_key(attr.is_none() ? x : attribute_of(x, to_str(attr)), cs); };
    std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
      return rev ? less(key(y), key(x)) : less(key(x), key(y));
    });
    return Value::make_list(std::move(items));
  };
  f["unique"] = [](const Value& v, Args& a) {
    const bool cs = truthy(a.get(0, "case_sensitive", Value::boolean(false)));
    Value attr = a.get(1, "attribute", Value::none());
    a.done();
    std::vector<Value> out, seen;
    for (const Value& x : iterate(v)) {
      Value k = sort_key(attr.is_none() ? x : attribute_of(x, to_str(attr)), cs);
      if (std::none_of(seen.begin(), seen.end(), [&](const Value& s) { return equal(s, k); })) {
        seen.push_back(k);
        out.push_back(x);
      }
    }
    return Value::make_list(std::move(out));
  };
  auto extreme = [](bool want_max) {
    return [want_max](const Value& v, Args& a) {
      const bool cs = truthy(a.get(0, "case_sensitive", Value::boolean(false)));
      Value attr = a.get(1, "attribute", Value::none());
      a.done();
      std::vector<Value> items = iterate(v);
      if (items.empty()) return Value::undefined("no " + std::string(want_max ? "max" : "min") + " item, sequence was empty");
      auto key = [&](const Value& x) { return sort_key(attr.is_none() ? x : attribute_of(x, to_str(attr)), cs); };
      Value best = items[0];
      for (size_t k = 1; k < items.size(); ++k)
        if (want_max ? less(key(best), key(items[k])) : less(key(items[k]), key(best))) best = items[k];
      return best;
    };
  };
  f["max"] = extreme(true);
  f["min"] = extreme(false);
  f["sum"] = [](const Value& v, Args& a) {
    Value attr = a.get(0, "attribute", Value::none());
    Value total = a.get(1, "start", Value::integer(0));
    a.done();
    for (const Value& x : iterate(v)) {
      const Value y = attr.is_none() ? x : attribute_of(x, to_str(attr));
      if (!y.is_number() || !total.is_number()) fail("sum: unsupported operand type " + type_name(y));
      total = total.kind == Value::Kind::Float || y.kind == Value::Kind::Float
                  ? Value::real(total.as_double() + y.as_double())
                  : Value::integer(static_cast<int64_t>(total.as_double()) + static_cast<int64_t>(y.as_double()));
    }
    return total;
  };
  f["indent"] = [](const Value& v, Args& a) {
    Value width = a.get(0, "width", Value::integer(4));
    const bool first = truthy(a.get(1, "first", Value::boolean(false)));
    const bool blank = truthy(a.get(2, "blank", Value::boolean(false)));
    a.done();
    return Value::string(indent(soft_str(v), width, first, blank));
  };
  f["wordcount"] = [](const Value& v, Args& a) {
    a.done();
    int64_t n = 0;
    bool in_word = false;
    for (const std::string& cp : code_points(soft_str(v))) {
      const char32_t c = code_point(cp);
      using unicode::Category;
      const Category cat = unicode::category(c);
      const bool word = c == '_' || unicode::in_mask(unicode::category_mask("L"), c) ||
                        unicode::in_mask(unicode::category_mask("N"), c) || cat == Category::Mn || cat == Category::Mc;
      if (word && !in_word) ++n;
      in_word = word;
    }
    return Value::integer(n);
  };
  f["dictsort"] = [](const Value& v, Args& a) {
    const bool cs = truthy(a.get(0, "case_sensitive", Value::boolean(false)));
    const std::string by = to_str(a.get(1, "by", Value::string("key")));
    const bool rev = truthy(a.get(2, "reverse", Value::boolean(false)));
    a.done();
    if (!v.is_dict()) fail("dictsort: expected a dict, not " + type_name(v));
    if (by != "key" && by != "value") fail("dictsort: 'by' must be 'key' or 'value'");
    std::vector<Value> items;
    for (const auto& [k, x] : v.dict->items) {
      Value pair = Value::make_list({Value::string(k), x});
      pair.is_tuple = true;
      items.push_back(pair);
    }
    const size_t at = by == "key" ? 0 : 1;
    std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
      const Value kx = sort_key((*x.list)[at], cs), ky = sort_key((*y.list)[at], cs);
      return rev ? less(ky, kx) : less(kx, ky);
    });
    return Value::make_list(std::move(items));
  };
  f["attr"] = [](const Value& v, Args& a) {
    Value name = a.get(0, "name");
    a.done();
    return get_attr(v, to_str(name));
  };
  return f;
}

// ---- tests --------------------------------------------------------------------------------

std::map<std::string, Test> make_tests() {
  std::map<std::string, Test> t;
  auto unary = [](std::function<bool(const Value&)> p) {
    return [p](const Value& v, Args& a) {
      a.done();
      return p(v);
    };
  };
  using K = Value::Kind;
  t["defined"] = unary([](const Value& v) { return !v.is_undefined(); });
  t["undefined"] = unary([](const Value& v) { return v.is_undefined(); });
  t["none"] = unary([](const Value& v) { return v.is_none(); });
  t["string"] = unary([](const Value& v) { return v.is_string(); });
  t["number"] = unary([](const Value& v) { return v.is_number(); });
  t["integer"] = unary([](const Value& v) { return v.kind == K::Int; });
  t["float"] = unary([](const Value& v) { return v.kind == K::Float; });
  t["boolean"] = unary([](const Value& v) { return v.kind == K::Bool; });
  t["true"] = unary([](const Value& v) { return v.kind == K::Bool && v.b; });
  t["false"] = unary([](const Value& v) { return v.kind == K::Bool && !v.b; });
  t["mapping"] = unary([](const Value& v) { return v.is_dict(); });
  // Undefined iterates (as nothing) and is callable (it raises), so jinja counts it as both.
  t["iterable"] = unary([](const Value& v) { return v.is_list() || v.is_dict() || v.is_string() || v.is_undefined(); });
  t["sequence"] = unary([](const Value& v) { return v.is_list() || v.is_dict() || v.is_string(); });
  t["callable"] = unary([](const Value& v) { return v.kind == K::Function || v.is_undefined(); });
  t["lower"] = unary([](const Value& v) { return v.is_string() && has_only_case(v.s, true); });
  t["upper"] = unary([](const Value& v) { return v.is_string() && has_only_case(v.s, false); });
  auto parity = [](bool odd) {
    return [odd](const Value& v, Args& a) {
      a.done();
      if (v.kind != K::Int && v.kind != K::Bool) fail("odd/even: expected an integer, not " + type_name(v));
      const int64_t x = v.kind == K::Int ? v.i : v.b;
      return ((x % 2) != 0) == odd;
    };
  };
  t["odd"] = parity(true);
  t["even"] = parity(false);
  t["divisibleby"] = [](const Value& v, Args& a) {
    Value n = a.get(0, "num");
    a.done();
    if (v.kind != K::Int || n.kind != K::Int) fail("divisibleby: expected integers");
    if (n.i == 0) fail("integer division or modulo by zero");
    return v.i % n.i == 0;
  };
  auto compare = [](std::function<bool(const Value&, const Value&)> p) {
    return [p](const Value& v, Args& a) {
      Value other = a.get(0, "other");
      a.done();
      return p(v, other);
    };
  };
  t["eq"] = t["equalto"] = t["=="] = compare([](const Value& x, const Value& y) { return equal(x, y); });
  t["ne"] = t["!="] = compare([](const Value& x, const Value& y) { return !equal(x, y); });
  t["lt"] = t["lessthan"] = t["<"] = compare([](const Value& x, const Value& y) { return less(x, y); });
  t["gt"] = t["greaterthan"] = t[">"] = compare([](const Value& x, const Value& y) { return less(y, x); });
  t["le"] = t["<="] = compare([](const Value& x, const Value& y) { return !less(y, x); });
  t["ge"] = t[">="] = compare([](const Value& x, const Value& y) { return !less(x, y); });
  t["in"] = compare([](const Value& x, const Value& y) {
    if (y.is_string()) return x.is_string() && y.s.find(x.s) != std::string::npos;
    if (y.is_dict()) return x.is_string() && y.dict->find(x.s) != nullptr;
    for (const Value& item : iterate(y))
      if (equal(item, x)) return true;
    return false;
  });
  t["sameas"] = compare([](const Value& x, const Value& y) {
    if (x.kind != y.kind) return false;
    switch (x.kind) {
      case K::None: case K::Undefined: return true;
      case K::Bool: return x.b == y.b;
      case K::Int: return x.i == y.i;
      case K::List: return x.list == y.list;
      case K::Dict: return x.dict == y.dict;
      case K::Function: return x.fn == y.fn;
      default: return false;
    }
  });
  return t;
}

}  // namespace

// ---- Value --------------------------------------------------------------------------------

const Value* Dict::find(const std::string& key) const {
  for (const auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}

bool Dict::is_int_key(const std::string& key) const {
  return std::find(int_keys.begin(), int_keys.end(), key) != int_keys.end();
}

void Dict::set(const std::string& key, Value v) {
  for (auto& [k, old] : items)
    if (k == key) {
      old = std::move(v);
      return;
    }
  items.emplace_back(key, std::move(v));
}

Value Value::undefined(std::string what) {
  Value v;
  v.s = std::move(what);
  return v;
}
Value Value::none() {
  Value v;
  v.kind = Kind::None;
  return v;
}
Value Value::boolean(bool x) {
  Value v;
  v.kind = Kind::Bool;
  v.b = x;
  return v;
}
Value Value::integer(int64_t x) {
  Value v;
  v.kind = Kind::Int;
  v.i = x;
  return v;
}
Value Value::real(double x) {
  Value v;
  v.kind = Kind::Float;
  v.f = x;
  return v;
}
Value Value::string(std::string x) {
  Value v;
  v.kind = Kind::String;
  v.s = std::move(x);
  return v;
}
Value Value::make_list(std::vector<Value> items) {
  Value v;
  v.kind = Kind::List;
  v.list = std::make_shared<std::vector<Value>>(std::move(items));
  return v;
}
Value Value::make_dict(std::shared_ptr<Dict> d) {
  Value v;
  v.kind = Kind::Dict;
  v.dict = d ? std::move(d) : std::make_shared<Dict>();
  return v;
}
Value Value::function(Function fn) {
  Value v;
  v.kind = Kind::Function;
  v.fn = std::make_shared<Function>(std::move(fn));
  return v;
}

double Value::as_double() const {
  switch (kind) {
    case Kind::Int: return static_cast<double>(i);
    case Kind::Float: return f;
    case Kind::Bool: return b ? 1.0 : 0.0;
    default: fail("expected a number, not " + type_name(*this));
  }
}

Value Args::get(size_t i, const std::string& name, Value fallback) {
  used_pos_.resize(pos.size(), false);
  used_kw_.resize(kw.size(), false);
  if (i < pos.size()) {
    used_pos_[i] = true;
    return pos[i];
  }
  for (size_t k = 0; k < kw.size(); ++k)
    if (!name.empty() && kw[k].first == name) {
      used_kw_[k] = true;
      return kw[k].second;
    }
  return fallback;
}

void Args::done() const {
  for (size_t k = 0; k < pos.size(); ++k)
    if (k >= used_pos_.size() || !used_pos_[k]) fail(what + ": too many arguments");
  for (size_t k = 0; k < kw.size(); ++k)
    if (k >= used_kw_.size() || !used_kw_[k]) fail(what + ": unexpected keyword argument '" + kw[k].first + "'");
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined: case Value::Kind::None: return false;
    case Value::Kind::Bool: return v.b;
    case Value::Kind::Int: return v.i != 0;
    case Value::Kind::Float: return v.f != 0.0;
    case Value::Kind::String: return !v.s.empty();
    case Value::Kind::List: return !v.list->empty();
    case Value::Kind::Dict: return v.dict->is_namespace || !v.dict->items.empty();
    case Value::Kind::Function: return true;
  }
  return false;
}

std::string float_repr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  if (x == 0) return std::signbit(x) ? "-0.0" : "0.0";
  // Shortest round-trip digits, then Python's layout: positional for 1e-4 <= |x| < 1e16.
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);
  std::string sci(buf, end);
  const bool neg = sci[0] == '-';
  if (neg) sci.erase(0, 1);
  const size_t e = sci.find('e');
  std::string digits = sci.substr(0, 1) + (e > 2 ? sci.substr(2, e - 2) : "");
  const int exp10 = std::stoi(sci.substr(e + 1));
  const int decpt = exp10 + 1;  // x = 0.digits * 10^decpt
  std::string out = neg ? "-" : "";
  const int n = static_cast<int>(digits.size());
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) out += "0." + std::string(static_cast<size_t>(-decpt), '0') + digits;
    else if (decpt >= n) out += digits + std::string(static_cast<size_t>(decpt - n), '0') + ".0";
    else out += digits.substr(0, static_cast<size_t>(decpt)) + "." + digits.substr(static_cast<size_t>(decpt));
    return out;
  }
  out += digits.substr(0, 1);
  if (n > 1) out += "." + digits.substr(1);
  char ebuf[16];
  std::snprintf(ebuf, sizeof ebuf, "e%c%02d", exp10 < 0 ? '-' : '+', std::abs(exp10));
  return out + ebuf;
}

std::string to_str(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined: return "";
    case Value::Kind::String: return v.s;
    default: return repr(v);
  }
}

std::string repr(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined: return "";
    case Value::Kind::None: return "None";
    case Value::Kind::Bool: return v.b ? "True" : "False";
    case Value::Kind::Int: return std::to_string(v.i);
    case Value::Kind::Float: return float_repr(v.f);
    case Value::Kind::String: return repr_string(v.s);
    case Value::Kind::List: {
      if (!v.s.empty()) return v.s;  // a range: range(0, 3)
      std::string out = v.is_tuple ? "(" : "[";
      for (size_t k = 0; k < v.list->size(); ++k) out += (k ? ", " : "") + repr((*v.list)[k]);
      if (v.is_tuple && v.list->size() == 1) out += ",";
      return out + (v.is_tuple ? ")" : "]");
    }
    case Value::Kind::Dict: {
      std::string out = v.dict->is_namespace ? "<Namespace {" : "{";
      bool first = true;
      for (const auto& [k, x] : v.dict->items) {
        out += (first ? "" : ", ") + (v.dict->is_int_key(k) ? k : repr_string(k)) + ": " + repr(x);
        first = false;
      }
      return out + (v.dict->is_namespace ? "}>" : "}");
    }
    case Value::Kind::Function: return "<function>";
  }
  return "";
}

std::string type_name(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined: return "undefined";
    case Value::Kind::None: return "NoneType";
    case Value::Kind::Bool: return "bool";
    case Value::Kind::Int: return "int";
    case Value::Kind::Float: return "float";
    case Value::Kind::String: return "str";
    case Value::Kind::List: return v.is_tuple ? "tuple" : "list";
    case Value::Kind::Dict: return v.dict->is_namespace ? "Namespace" : "dict";
    case Value::Kind::Function: return "function";
  }
  return "?";
}

bool equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind == Value::Kind::Float || b.kind == Value::Kind::Float) return a.as_double() == b.as_double();
    return static_cast<int64_t>(a.as_double()) == static_cast<int64_t>(b.as_double()) &&
           (a.kind == Value::Kind::Int ? a.i : a.b) == (b.kind == Value::Kind::Int ? b.i : b.b);
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::Kind::Undefined: case Value::Kind::None: return true;
    case Value::Kind::String: return a.s == b.s;
    case Value::Kind::List:
      if (a.list->size() != b.list->size()) return false;
      for (size_t k = 0; k < a.list->size(); ++k)
        if (!equal((*a.list)[k], (*b.list)[k])) return false;
      return true;
    case Value::Kind::Dict:
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& [k, x] : a.dict->items) {
        const Value* y = b.dict->find(k);
        if (!y || !equal(x, *y)) return false;
      }
      return true;
    case Value::Kind::Function: return a.fn == b.fn;
    default: return false;
  }
}

bool less(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) return a.as_double() < b.as_double();
  if (a.is_string() && b.is_string()) return a.s < b.s;  // UTF-8 bytes order as code points do
  if (a.is_list() && b.is_list()) {
    const size_t n = std::min(a.list->size(), b.list->size());
    for (size_t k = 0; k < n; ++k) {
      if (!equal((*a.list)[k], (*b.list)[k])) return less((*a.list)[k], (*b.list)[k]);
    }
    return a.list->size() < b.list->size();
  }
  fail("'<' not supported between instances of '" + type_name(a) + "' and '" + type_name(b) + "'");
}

std::vector<Value> iterate(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined: return {};
    case Value::Kind::List: return *v.list;
    case Value::Kind::Dict: {
      std::vector<Value> keys;
      for (const auto& kv : v.dict->items) keys.push_back(Value::string(kv.first));
      return keys;
    }
    case Value::Kind::String: {
      std::vector<Value> out;
      for (std::string& cp : code_points(v.s)) out.push_back(Value::string(std::move(cp)));
      return out;
    }
    default: fail("'" + type_name(v) + "' object is not iterable");
  }
}

int64_t length(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined: return 0;
    case Value::Kind::String:  // code points: the bytes that do not continue a UTF-8 sequence
      return std::count_if(v.s.begin(), v.s.end(), [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; });
    case Value::Kind::List: return static_cast<int64_t>(v.list->size());
    case Value::Kind::Dict: return static_cast<int64_t>(v.dict->items.size());
    default: fail("object of type '" + type_name(v) + "' has no len()");
  }
}

Value from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::json::value_t::null: return Value::none();
    case nlohmann::json::value_t::boolean: return Value::boolean(j.get<bool>());
    case nlohmann::json::value_t::number_integer: return Value::integer(j.get<int64_t>());
    case nlohmann::json::value_t::number_unsigned: return Value::integer(static_cast<int64_t>(j.get<uint64_t>()));
    case nlohmann::json::value_t::number_float: return Value::real(j.get<double>());
    case nlohmann::json::value_t::string: return Value::string(j.get<std::string>());
    case nlohmann::json::value_t::array: {
      std::vector<Value> items;
      for (const auto& x : j) items.push_back(from_json(x));
      return Value::make_list(std::move(items));
    }
    case nlohmann::json::value_t::object: {
      auto d = std::make_shared<Dict>();
      for (const auto& [k, x] : j.items()) d->items.emplace_back(k, from_json(x));
      return Value::make_dict(d);
    }
    default: return Value::none();
  }
}

std::string to_json(const Value& v, bool ensure_ascii, int indent, const std::string& item_sep,
                    const std::string& key_sep, bool sort_keys) {
  // json.dumps: with an indent, items go on their own lines, and empty containers stay [] / {}.
  std::function<std::string(const Value&, int)> dump = [&](const Value& x, int level) -> std::string {
    const std::string nl = indent < 0 ? "" : "\n" + std::string(static_cast<size_t>(indent * (level + 1)), ' ');
    const std::string close = indent < 0 ? "" : "\n" + std::string(static_cast<size_t>(indent * level), ' ');
    switch (x.kind) {
      case Value::Kind::None: return "null";
      case Value::Kind::Bool: return x.b ? "true" : "false";
      case Value::Kind::Int: return std::to_string(x.i);
      case Value::Kind::Float:
        if (std::isnan(x.f)) return "NaN";
        if (std::isinf(x.f)) return x.f > 0 ? "Infinity" : "-Infinity";
        return float_repr(x.f);
      case Value::Kind::String: return json_string(x.s, ensure_ascii);
      case Value::Kind::List: {
        if (x.list->empty()) return "[]";
        std::string out = "[";
        for (size_t k = 0; k < x.list->size(); ++k) out += (k ? item_sep : "") + nl + dump((*x.list)[k], level + 1);
        return out + close + "]";
      }
      case Value::Kind::Dict: {
        if (x.dict->is_namespace) fail("Object of type Namespace is not JSON serializable");
        if (x.dict->items.empty()) return "{}";
        std::vector<const std::pair<std::string, Value>*> items;
        for (const auto& kv : x.dict->items) items.push_back(&kv);
        if (sort_keys)
          std::stable_sort(items.begin(), items.end(), [](auto* a, auto* b) { return a->first < b->first; });
        std::string out = "{";
        for (size_t k = 0; k < items.size(); ++k)
          out += (k ? item_sep : "") + nl + json_string(items[k]->first, ensure_ascii) + key_sep +
                 dump(items[k]->second, level + 1);
        return out + close + "}";
      }
      case Value::Kind::Undefined: fail("Object of type Undefined is not JSON serializable");
      case Value::Kind::Function: fail("Object of type function is not JSON serializable");
    }
    return "";
  };
  return dump(v, 0);
}

Value get_attr(const Value& obj, const std::string& name) {
  switch (obj.kind) {
    case Value::Kind::Undefined:
      fail(obj.s.empty() ? "'" + name + "' of an undefined value" : obj.s);
    case Value::Kind::Dict: {
      // jinja's getattr: the Python attribute (a dict's methods) before the entry.
      if (!obj.dict->is_namespace) {
        Value m = dict_method(obj.dict, name);
        if (!m.is_undefined()) return m;
      }
      if (const Value* v = obj.dict->find(name)) return *v;
      return Value::undefined("'" + std::string(obj.dict->is_namespace ? "Namespace" : "dict object") +
                              "' has no attribute '" + name + "'");
    }
    case Value::Kind::String: return string_method(obj.s, name);
    default: return Value::undefined("'" + type_name(obj) + " object' has no attribute '" + name + "'");
  }
}

Value get_item(const Value& obj, const Value& key) {
  switch (obj.kind) {
    case Value::Kind::Undefined:
      fail(obj.s.empty() ? "item " + repr(key) + " of an undefined value" : obj.s);
    case Value::Kind::Dict:
      if (key.is_string()) {
        if (const Value* v = obj.dict->find(key.s)) return *v;
        return get_attr(obj, key.s);  // jinja falls back to attributes (x['items'] is the method)
      }
      if (key.kind == Value::Kind::Int && obj.dict->is_int_key(std::to_string(key.i)))
        if (const Value* v = obj.dict->find(std::to_string(key.i))) return *v;
      return Value::undefined("'dict object' has no attribute " + repr(key));
    case Value::Kind::List: case Value::Kind::String: {
      if (key.kind != Value::Kind::Int && key.kind != Value::Kind::Bool) {
        if (key.is_string() && obj.is_string()) return string_method(obj.s, key.s);
        return Value::undefined("'" + type_name(obj) + " object' has no attribute " + repr(key));
      }
      const int64_t k0 = key.kind == Value::Kind::Int ? key.i : key.b;
      if (obj.is_list()) {
        const int64_t n = static_cast<int64_t>(obj.list->size()), k = k0 < 0 ? k0 + n : k0;
        if (k < 0 || k >= n) return Value::undefined("'list object' has no attribute " + std::to_string(k0));
        return (*obj.list)[static_cast<size_t>(k)];
      }
      const std::vector<std::string> cps = code_points(obj.s);
      const int64_t n = static_cast<int64_t>(cps.size()), k = k0 < 0 ? k0 + n : k0;
      if (k < 0 || k >= n) return Value::undefined("'str object' has no attribute " + std::to_string(k0));
      return Value::string(cps[static_cast<size_t>(k)]);
    }
    default: return Value::undefined("'" + type_name(obj) + " object' has no attribute " + repr(key));
  }
}

Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step) {
  if (obj.is_list()) {
    std::vector<Value> out;
    for (int64_t k : slice_indices(static_cast<int64_t>(obj.list->size()), start, stop, step))
      out.push_back((*obj.list)[static_cast<size_t>(k)]);
    return Value::make_list(std::move(out));
  }
  if (obj.is_string()) {
    const std::vector<std::string> cps = code_points(obj.s);
    std::string out;
    for (int64_t k : slice_indices(static_cast<int64_t>(cps.size()), start, stop, step)) out += cps[static_cast<size_t>(k)];
    return Value::string(out);
  }
  if (obj.is_undefined()) fail(obj.s.empty() ? "slice of an undefined value" : obj.s);
  fail("'" + type_name(obj) + "' object is not subscriptable");
}

const Filter* find_filter(const std::string& name) {
  static const std::map<std::string, Filter> filters = make_filters();
  auto it = filters.find(name);
  return it == filters.end() ? nullptr : &it->second;
}

const Test* find_test(const std::string& name) {
  static const std::map<std::string, Test> tests = make_tests();
  auto it = tests.find(name);
  return it == tests.end() ? nullptr : &it->second;
}

void add_globals(Dict& g, const std::function<std::time_t()>& now) {
  g.set("range", Value::function([](Args& a) {
    std::vector<int64_t> n;
    for (const Value& v : a.pos) {
      if (v.kind != Value::Kind::Int) fail("range() takes integers, not " + type_name(v));
      n.push_back(v.i);
    }
    if (n.empty() || n.size() > 3 || !a.kw.empty()) fail("range() takes 1 to 3 integer arguments");
    const int64_t start = n.size() > 1 ? n[0] : 0, stop = n.size() > 1 ? n[1] : n[0], step = n.size() > 2 ? n[2] : 1;
    if (step == 0) fail("range() arg 3 must not be zero");
    std::vector<Value> out;
    for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) {
      if (out.size() >= 100000) fail("range too big (at most 100000 items, as jinja's sandbox)");
      out.push_back(Value::integer(k));
    }
    Value r = Value::make_list(std::move(out));
    r.s = "range(" + std::to_string(start) + ", " + std::to_string(stop) + (step != 1 ? ", " + std::to_string(step) : "") + ")";
    return r;
  }));
  auto make_dict = [](Args& a, bool ns) {
    auto d = std::make_shared<Dict>();
    d->is_namespace = ns;
    for (const Value& p : a.pos) {
      if (!p.is_dict()) fail(std::string(ns ? "namespace" : "dict") + "() takes a dict or keyword arguments");
      for (const auto& [k, v] : p.dict->items) d->set(k, v);
    }
    for (const auto& [k, v] : a.kw) d->set(k, v);
    return Value::make_dict(d);
  };
  g.set("namespace", Value::function([make_dict](Args& a) { return make_dict(a, true); }));
  g.set("dict", Value::function([make_dict](Args& a) { return make_dict(a, false); }));
  g.set("raise_exception", Value::function([](Args& a) -> Value {
    throw RenderError(a.pos.empty() ? std::string("raise_exception") : to_str(a.pos[0]));
  }));
  g.set("strftime_now", Value::function([now](Args& a) {
    Value fmt = a.get(0, "format");
    a.done();
    const std::time_t t = now ? now() : std::time(nullptr);
    std::tm tm{};
    localtime_r(&t, &tm);
    char buf[256];
    const size_t n = std::strftime(buf, sizeof buf, to_str(fmt).c_str(), &tm);
    return Value::string(std::string(buf, n));
  }));
}

}  // namespace keel::data::jinja
