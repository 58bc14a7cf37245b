#include "data/regex.h"

#include <functional>
#include <limits>
#include <stdexcept>

#include "data/unicode.h"

namespace keel::data {

namespace {

namespace uc = unicode;

// A set of code points: explicit ranges, general-category masks (\p{..}), negated masks
// (\P{..}, \D, \W), white space (\s, \S); then optionally negated as a whole ([^...]).
struct CharSet {
  std::vector<std::pair<char32_t, char32_t>> ranges;
  uint32_t cats = 0;
  std::vector<uint32_t> not_cats;
  bool space = false, not_space = false;
  bool negated = false, icase = false;

  bool raw_contains(char32_t c) const {
    for (const auto& [lo, hi] : ranges)
      if (c >= lo && c <= hi) return true;
    if (cats && uc::in_mask(cats, c)) return true;
    for (uint32_t m : not_cats)
      if (!uc::in_mask(m, c)) return true;
    if (space && uc::is_white_space(c)) return true;
    if (not_space && !uc::is_white_space(c)) return true;
    return false;
  }
  bool contains(char32_t c) const {
    bool in = raw_contains(c);
    if (!in && icase) {
      // Case-insensitive: c matches when its folded form, or a letter folding to the same, is in.
      const char32_t f = uc::fold_case(c);
      in = raw_contains(f);
      if (!in && f >= 'a' && f <= 'z') in = raw_contains(f - 32);
    }
    return in != negated;
  }
};

enum class Kind { Char, Set, Any, Seq, Alt, Repeat, Group, Atomic, LookAhead, NegLookAhead, LineStart, LineEnd,
                  TextStart, TextEnd, TextEndNewline };
enum class Mode { Greedy, Lazy, Possessive };

struct Node {
  explicit Node(Kind k) : kind(k) {}
  Kind kind;
  char32_t ch = 0;
  bool icase = false;
  int set = -1;                // Kind::Set: index into sets
  std::vector<int> kids;       // Seq, Alt; Repeat / Group / Atomic / Look*: kids[0]
  int min = 0, max = -1;       // Repeat; max -1 = unbounded
  Mode mode = Mode::Greedy;
};

using Cont = std::function<bool(size_t)>;

}  // namespace

struct Regex::Impl {
  std::vector<Node> nodes;
  std::vector<CharSet> sets;
  int root = -1;

  // ---------------------------------------------------------------- parsing
  struct Parser {
    Impl& re;
    const std::u32string& p;
    const std::string& text;  // the pattern as given, for messages
    size_t i = 0;

    [[noreturn]] void error(const std::string& what) const {
      throw std::invalid_argument("tokenizer regex /" + text + "/: " + what + " (at character " + std::to_string(i) +
                                  ")");
    }
    bool done() const { return i >= p.size(); }
    char32_t peek() const { return done() ? 0 : p[i]; }
    bool eat(char32_t c) {
      if (!done() && p[i] == c) {
        ++i;
        return true;
      }
      return false;
    }
    int add(Node n) {
      re.nodes.push_back(std::move(n));
      return static_cast<int>(re.nodes.size()) - 1;
    }

    int parse_alt(bool& icase) {
      std::vector<int> alts{parse_seq(icase)};
      while (eat('|')) alts.push_back(parse_seq(icase));
      if (alts.size() == 1) return alts[0];
      Node n(Kind::Alt);
      n.kids = std::move(alts);
      return add(std::move(n));
    }

    int parse_seq(bool& icase) {
      Node seq(Kind::Seq);
      while (!done() && peek() != '|' && peek() != ')') {
        // Inline flags "(?i)" change the rest of the enclosing group.
        if (p.compare(i, 4, U"(?i)") == 0) {
          i += 4;
          icase = true;
          continue;
        }
        if (p.compare(i, 5, U"(?-i)") == 0) {
          i += 5;
          icase = false;
          continue;
        }
        int atom = parse_atom(icase);
        seq.kids.push_back(parse_quantifier(atom));
      }
      if (seq.kids.size() == 1) return seq.kids[0];
      return add(std::move(seq));
    }

    int parse_number() {
      if (done() || peek() < '0' || peek() > '9') error("expected a number in a {m,n} quantifier");
      int v = 0;
      while (!done() && peek() >= '0' && peek() <= '9') {
        v = v * 10 + static_cast<int>(p[i++] - '0');
        if (v > 100000) error("repeat count too large");
      }
      return v;
    }

    int parse_quantifier(int atom) {
      int min = -1, max = -1;
      if (eat('*')) min = 0, max = -1;
      else if (eat('+')) min = 1, max = -1;
      else if (eat('?')) min = 0, max = 1;
      else if (peek() == '{' && i + 1 < p.size() && p[i + 1] >= '0' && p[i + 1] <= '9') {
        ++i;
        min = parse_number();
        max = min;
        if (eat(',')) max = peek() == '}' ? -1 : parse_number();
        if (!eat('}')) error("unterminated {m,n} quantifier");
        if (max >= 0 && max < min) error("{m,n} with n < m");
      } else {
        return atom;
      }
      Node n(Kind::Repeat);
      n.kids = {atom};
      n.min = min;
      n.max = max;
      if (eat('?')) n.mode = Mode::Lazy;
      else if (eat('+')) n.mode = Mode::Possessive;
      const int r = add(std::move(n));
      if (peek() == '*' || peek() == '+' || peek() == '?' || peek() == '{') return parse_quantifier(r);
      return r;
    }

    int parse_group(bool icase) {
      // after '('
      Kind kind = Kind::Group;
      bool inner_icase = icase;
      if (eat('?')) {
        if (eat(':')) {
        } else if (eat('=')) {
          kind = Kind::LookAhead;
        } else if (eat('!')) {
          kind = Kind::NegLookAhead;
        } else if (eat('>')) {
          kind = Kind::Atomic;
        } else if (peek() == '<') {
          error("lookbehind and named groups are not supported");
        } else {
          // flags: (?i:...) (?-i:...)
          bool on = true, any = false;
          while (!done() && peek() != ':') {
            if (eat('-')) {
              on = false;
            } else if (eat('i')) {
              inner_icase = on;
              any = true;
            } else {
              error(std::string("unsupported group flag '") + static_cast<char>(peek()) + "'");
            }
          }
          if (!any || !eat(':')) error("malformed (?flags:...) group");
        }
      }
      int body = parse_alt(inner_icase);
      if (!eat(')')) error("missing ')'");
      Node n(kind);
      n.kids = {body};
      return add(std::move(n));
    }

    char32_t parse_hex(int digits) {
      char32_t v = 0;
      for (int k = 0; k < digits; ++k) {
        if (done()) error("truncated hex escape");
        const char32_t c = p[i++];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) error("bad hex digit in escape");
        v = v * 16 + static_cast<char32_t>(d);
      }
      return v;
    }

    std::string parse_property_name() {
      std::string name;
      if (eat('{')) {
        bool neg = eat('^');
        while (!done() && peek() != '}') name += static_cast<char>(p[i++]);
        if (!eat('}')) error("unterminated \\p{...}");
        if (neg) name = "^" + name;
      } else {
        if (done()) error("truncated \\p");
        name = static_cast<char>(p[i++]);
      }
      return name;
    }

    // An escape after '\'. Either a single code point (returns true, sets cp) or a class
    // (adds to `set`, returns false).
    bool parse_escape(char32_t& cp, CharSet& set) {
      if (done()) error("pattern ends with '\\'");
      const char32_t c = p[i++];
      switch (c) {
        case 'n': cp = '\n'; return true;
        case 'r': cp = '\r'; return true;
        case 't': cp = '\t'; return true;
        case 'f': cp = '\f'; return true;
        case 'v': cp = '\v'; return true;
        case 'e': cp = 0x1B; return true;
        case 'a': cp = 0x07; return true;
        case '0': cp = 0; return true;
        case 'x':
          if (eat('{')) {
            cp = 0;
            while (!done() && peek() != '}') cp = cp * 16 + parse_hex(1);
            if (!eat('}')) error("unterminated \\x{...}");
          } else {
            cp = parse_hex(2);
          }
          return true;
        case 'u': cp = parse_hex(4); return true;
        case 's': set.space = true; return false;
        case 'S': set.not_space = true; return false;
        case 'd': set.cats |= uc::category_mask("Nd"); return false;
        case 'D': set.not_cats.push_back(uc::category_mask("Nd")); return false;
        case 'w': set.cats |= word_mask(); return false;
        case 'W': set.not_cats.push_back(word_mask()); return false;
        case 'p':
        case 'P': {
          std::string name = parse_property_name();
          bool neg = c == 'P';
          if (!name.empty() && name[0] == '^') neg = !neg, name = name.substr(1);
          const uint32_t mask = uc::category_mask(name);
          if (mask == 0) error("unsupported Unicode property \\p{" + name + "} (keel knows general categories)");
          if (neg) set.not_cats.push_back(mask);
          else set.cats |= mask;
          return false;
        }
        default:
          if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '1' && c <= '9'))
            error(std::string("unsupported escape \\") + static_cast<char>(c));
          cp = c;  // escaped punctuation stands for itself
          return true;
      }
    }

    static uint32_t word_mask() {
      return uc::category_mask("L") | uc::category_mask("M") | uc::category_mask("Nd") | uc::category_mask("Pc");
    }

    int parse_class(bool icase) {
      // after '['
      CharSet set;
      set.icase = icase;
      set.negated = eat('^');
      bool first = true;
      while (true) {
        if (done()) error("unterminated [...] class");
        if (peek() == ']' && !first) {
          ++i;
          break;
        }
        first = false;
        if (peek() == '[') error("nested classes and POSIX [:name:] classes are not supported");
        char32_t lo;
        if (eat('\\')) {
          if (!parse_escape(lo, set)) continue;
        } else {
          lo = p[i++];
        }
        char32_t hi = lo;
        if (peek() == '-' && i + 1 < p.size() && p[i + 1] != ']') {
          ++i;
          if (eat('\\')) {
            CharSet dummy;
            if (!parse_escape(hi, dummy)) error("a class cannot end a range");
          } else {
            hi = p[i++];
          }
          if (hi < lo) error("reversed range in a class");
        }
        set.ranges.emplace_back(lo, hi);
      }
      re.sets.push_back(std::move(set));
      Node n(Kind::Set);
      n.set = static_cast<int>(re.sets.size()) - 1;
      return add(std::move(n));
    }

    int parse_atom(bool icase) {
      const char32_t c = p[i++];
      switch (c) {
        case '(': return parse_group(icase);
        case '[': return parse_class(icase);
        case '.': return add(Node(Kind::Any));
        case '^': return add(Node(Kind::LineStart));
        case '$': return add(Node(Kind::LineEnd));
        case '*': case '+': case '?': error("quantifier with nothing to repeat");
        case '\\': {
          if (eat('A')) return add(Node(Kind::TextStart));
          if (eat('z')) return add(Node(Kind::TextEnd));
          if (eat('Z')) return add(Node(Kind::TextEndNewline));
          if (peek() == 'b' || peek() == 'B') error("word boundaries (\\b, \\B) are not supported");
          if (peek() == 'k' || peek() == 'g') error("backreferences are not supported");
          CharSet set;
          set.icase = icase;
          char32_t cp;
          if (parse_escape(cp, set)) {
            Node n(Kind::Char);
            n.ch = cp;
            n.icase = icase;
            return add(std::move(n));
          }
          re.sets.push_back(std::move(set));
          Node n(Kind::Set);
          n.set = static_cast<int>(re.sets.size()) - 1;
          return add(std::move(n));
        }
        default: {
          Node n(Kind::Char);
          n.ch = c;
          n.icase = icase;
          return add(std::move(n));
        }
      }
    }
  };

  // ---------------------------------------------------------------- matching
  // The text is passed down every call, never stored: one Regex matches in many threads at
  // once (keel tokenize encodes in parallel with one Tokenizer).

  bool single(const Node& n) const { return n.kind == Kind::Char || n.kind == Kind::Set || n.kind == Kind::Any; }

  bool step(const Node& n, char32_t c) const {
    switch (n.kind) {
      case Kind::Char: return c == n.ch || (n.icase && uc::fold_case(c) == uc::fold_case(n.ch));
      case Kind::Set: return sets[static_cast<size_t>(n.set)].contains(c);
      case Kind::Any: return c != '\n';
      default: return false;
    }
  }

  bool match(const std::u32string& t, int id, size_t i, const Cont& k) const {
    const Node& n = nodes[static_cast<size_t>(id)];
    switch (n.kind) {
      case Kind::Char:
      case Kind::Set:
      case Kind::Any:
        return i < t.size() && step(n, t[i]) && k(i + 1);
      case Kind::Seq:
        return match_seq(t, n, 0, i, k);
      case Kind::Alt:
        for (int alt : n.kids)
          if (match(t, alt, i, k)) return true;
        return false;
      case Kind::Group:
        return match(t, n.kids[0], i, k);
      case Kind::Atomic: {
        size_t end = 0;
        if (!match(t, n.kids[0], i, [&](size_t j) { end = j; return true; })) return false;
        return k(end);
      }
      case Kind::LookAhead:
        return match(t, n.kids[0], i, [](size_t) { return true; }) && k(i);
      case Kind::NegLookAhead:
        return !match(t, n.kids[0], i, [](size_t) { return true; }) && k(i);
      case Kind::LineStart:
        return (i == 0 || t[i - 1] == '\n') && k(i);
      case Kind::LineEnd:
        return (i == t.size() || t[i] == '\n') && k(i);
      case Kind::TextStart:
        return i == 0 && k(i);
      case Kind::TextEnd:
        return i == t.size() && k(i);
      case Kind::TextEndNewline:
        return (i == t.size() || (i + 1 == t.size() && t[i] == '\n')) && k(i);
      case Kind::Repeat:
        return match_repeat(t, n, i, k);
    }
    return false;
  }

  bool match_seq(const std::u32string& t, const Node& n, size_t idx, size_t i, const Cont& k) const {
    if (idx == n.kids.size()) return k(i);
    return match(t, n.kids[idx], i, [&](size_t j) { return match_seq(t, n, idx + 1, j, k); });
  }

  bool match_repeat(const std::u32string& t, const Node& n, size_t i, const Cont& k) const {
    const Node& child = nodes[static_cast<size_t>(n.kids[0])];
    const size_t max = n.max < 0 ? std::numeric_limits<size_t>::max() : static_cast<size_t>(n.max);
    const size_t min = static_cast<size_t>(n.min);
    if (single(child)) {
      // Runs of one character class: count the longest run, then try the lengths in the order
      // the quantifier prefers, no recursion.
      size_t run = 0;
      while (run < max && i + run < t.size() && step(child, t[i + run])) ++run;
      if (run < min) return false;
      switch (n.mode) {
        case Mode::Greedy:
          for (size_t len = run + 1; len-- > min;)
            if (k(i + len)) return true;
          return false;
        case Mode::Lazy:
          for (size_t len = min; len <= run; ++len)
            if (k(i + len)) return true;
          return false;
        case Mode::Possessive:
          return k(i + run);
      }
      return false;
    }
    if (n.mode == Mode::Possessive) {
      size_t end = 0;
      if (!repeat_general(t, n, Mode::Greedy, i, 0, min, max, [&](size_t j) { end = j; return true; })) return false;
      return k(end);
    }
    return repeat_general(t, n, n.mode, i, 0, min, max, k);
  }

  bool repeat_general(const std::u32string& t, const Node& n, Mode mode, size_t i, size_t count, size_t min, size_t max, const Cont& k) const {
    auto more = [&]() {
      if (count >= max) return false;
      return match(t, n.kids[0], i, [&](size_t j) {
        if (j == i && count >= min) return false;  // an empty iteration cannot make progress
        return repeat_general(t, n, mode, j, count + 1, min, max, k);
      });
    };
    if (mode == Mode::Lazy) {
      if (count >= min && k(i)) return true;
      return more();
    }
    if (more()) return true;
    return count >= min && k(i);
  }
};

Regex::Regex(std::string_view pattern) : pattern_(pattern), impl_(std::make_unique<Impl>()) {
  std::u32string p;
  for (char32_t c : unicode::decode_utf8(pattern, "tokenizer regex")) p += c;
  Impl::Parser parser{*impl_, p, pattern_};
  bool icase = false;
  impl_->root = parser.parse_alt(icase);
  if (!parser.done()) parser.error("unbalanced ')'");
}

Regex::~Regex() = default;
Regex::Regex(Regex&&) noexcept = default;
Regex& Regex::operator=(Regex&&) noexcept = default;

bool Regex::search(const std::u32string& text, size_t from, size_t& begin, size_t& end) const {
  for (size_t start = from; start < text.size(); ++start) {
    size_t found = 0;
    // The first match the backtracking order finds is Perl's (and Oniguruma's) match.
    if (impl_->match(text, impl_->root, start, [&](size_t j) {
          if (j == start) return false;
          found = j;
          return true;
        })) {
      begin = start;
      end = found;
      return true;
    }
  }
  return false;
}

std::vector<std::pair<size_t, size_t>> Regex::find_all(const std::u32string& text) const {
  std::vector<std::pair<size_t, size_t>> out;
  size_t pos = 0, b = 0, e = 0;
  while (pos < text.size() && search(text, pos, b, e)) {
    out.emplace_back(b, e);
    pos = e;
  }
  return out;
}

}  // namespace keel::data
