// Jinja for chat templates (data/jinja.h): a lexer that applies jinja's whitespace rules
// (trim_blocks, lstrip_blocks, - and + markers) while it splits the source into text, {{ }}
// and {% %} pieces; a recursive-descent parser with jinja's operator precedence; and a
// tree-walking renderer with jinja's scoping (a for loop's body is a new scope each
// iteration; if bodies are not; macros see the template's top level).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <unordered_map>

#include "data/corpus.h"
#include "data/jinja_value.h"
#include "data/unicode.h"

namespace keel::data::jinja {

namespace {

// The name a block set's filters read the captured text from (no template can spell it).
constexpr const char* kCaptured = "\x01" "captured";

// ---- lexer --------------------------------------------------------------------------------

struct Token {
  enum Type { Name, String, Int, Float, Op, End } type = End;
  std::string text;  // the name, the operator, or the decoded string
  int64_t i = 0;
  double f = 0;
  int line = 0;
};

struct Piece {
  enum Kind { Text, Output, Statement } kind = Text;
  std::string text;
  std::vector<Token> tokens;  // Output and Statement: the tag's tokens, then End
  int line = 0;
};

// Whitespace as jinja's regexes (\s) and Python's strip see it: data/corpus.h's python_*strip.
std::string rstrip_space(const std::string& s) { return std::string(python_rstrip(s)); }

size_t skip_space(const std::string& s, size_t pos) {
  return pos >= s.size() ? pos : s.size() - python_lstrip(std::string_view(s).substr(pos)).size();
}

bool all_space(const std::string& s, size_t from) {
  return from < s.size() && skip_space(s, from) == s.size();
}

class Lexer {
 public:
  Lexer(std::string_view source, const std::string& name) : name_(name) {
    // As jinja: every newline sequence becomes \n, and one trailing newline is dropped.
    for (size_t k = 0; k < source.size(); ++k) {
      if (source[k] == '\r') {
        src_ += '\n';
        if (k + 1 < source.size() && source[k + 1] == '\n') ++k;
      } else {
        src_ += source[k];
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
  }

  std::vector<Piece> run() {
    bool line_starting = true;
    while (pos_ < src_.size()) {
      const size_t open = find_opener(pos_);
      std::string text = src_.substr(pos_, open == std::string::npos ? std::string::npos : open - pos_);
      if (open == std::string::npos) {
        add_text(std::move(text), pos_);
        break;
      }
      const char kind = src_[open + 1];
      const char sign = open + 2 < src_.size() && (src_[open + 2] == '-' || src_[open + 2] == '+') ? src_[open + 2] : 0;
      if (sign == '-') {
        text = rstrip_space(text);
      } else if (sign != '+' && kind != '{') {  // lstrip_blocks: not for {{ }}
        const size_t l_pos = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
        if ((l_pos > 0 || line_starting) && all_space(text, l_pos)) text.resize(l_pos);
      }
      add_text(std::move(text), pos_);
      pos_ = open + 2 + (sign ? 1 : 0);
      if (kind == '#') line_starting = comment(open);
      else if (kind == '%' && raw_block(open)) line_starting = raw_line_starting_;
      else line_starting = tag(kind == '%' ? Piece::Statement : Piece::Output, open);
    }
    return std::move(pieces_);
  }

 private:
  [[noreturn]] void fail(size_t pos, const std::string& message) const {
    throw TemplateError(name_ + ", line " + std::to_string(line_at(pos)) + ": " + message);
  }

  int line_at(size_t pos) const {
    return 1 + static_cast<int>(std::count(src_.begin(), src_.begin() + static_cast<std::ptrdiff_t>(std::min(pos, src_.size())), '\n'));
  }

  size_t find_opener(size_t from) const {
    for (size_t p = src_.find('{', from); p != std::string::npos; p = src_.find('{', p + 1))
      if (p + 1 < src_.size() && (src_[p + 1] == '{' || src_[p + 1] == '%' || src_[p + 1] == '#')) return p;
    return std::string::npos;
  }

  void add_text(std::string text, size_t at) {
    if (text.empty()) return;
    Piece p;
    p.kind = Piece::Text;
    p.text = std::move(text);
    p.line = line_at(at);
    pieces_.push_back(std::move(p));
  }

  // After an end marker: `-` eats the whitespace that follows, trim_blocks one newline.
  // Returns whether what the end consumed ends with a newline (jinja's "line starting").
  bool after_end(char sign, bool trim_newline) {
    if (sign == '-') {
      const size_t end = skip_space(src_, pos_);
      const bool nl = end > pos_ && src_[end - 1] == '\n';
      pos_ = end;
      return nl;
    }
    if (sign != '+' && trim_newline && pos_ < src_.size() && src_[pos_] == '\n') {
      ++pos_;
      return true;
    }
    return false;
  }

  bool comment(size_t open) {
    const size_t close = src_.find("#}", pos_);
    if (close == std::string::npos) fail(open, "missing end of comment tag");
    const char sign = close > pos_ && (src_[close - 1] == '-' || src_[close - 1] == '+') ? src_[close - 1] : 0;
    pos_ = close + 2;
    return after_end(sign, true);
  }

  // {% raw %}...{% endraw %}: the text between, verbatim (its end tag strips as any block).
  bool raw_block(size_t open) {
    size_t p = skip_space(src_, pos_);
    if (src_.compare(p, 3, "raw") != 0) return false;
    p = skip_space(src_, p + 3);
    char sign = 0;
    if (p < src_.size() && src_[p] == '-') sign = '-', ++p;
    if (src_.compare(p, 2, "%}") != 0) return false;
    pos_ = p + 2;
    if (sign == '-') pos_ = skip_space(src_, pos_);  // raw's own end: no trim_blocks newline
    for (size_t q = src_.find("{%", pos_); q != std::string::npos; q = src_.find("{%", q + 2)) {
      size_t r = q + 2;
      const char open_sign = r < src_.size() && (src_[r] == '-' || src_[r] == '+') ? src_[r++] : 0;
      r = skip_space(src_, r);
      if (src_.compare(r, 6, "endraw") != 0) continue;
      r = skip_space(src_, r + 6);
      const char close_sign = r < src_.size() && (src_[r] == '-' || src_[r] == '+') ? src_[r++] : 0;
      if (src_.compare(r, 2, "%}") != 0) continue;
      std::string text = src_.substr(pos_, q - pos_);
      if (open_sign == '-') {
        text = rstrip_space(text);
      } else if (open_sign != '+') {
        const size_t l_pos = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
        if (l_pos > 0 && all_space(text, l_pos)) text.resize(l_pos);
      }
      add_text(std::move(text), pos_);
      pos_ = r + 2;
      raw_line_starting_ = after_end(close_sign, true);
      return true;
    }
    fail(open, "missing {% endraw %} for this {% raw %}");
  }

  // The tokens of a {{ }} or {% %} tag, up to its end marker (outside brackets).
  bool tag(Piece::Kind kind, size_t open) {
    Piece piece;
    piece.kind = kind;
    piece.line = line_at(open);
    std::vector<char> brackets;
    const char* end = kind == Piece::Statement ? "%}" : "}}";
    while (true) {
      pos_ = skip_space(src_, pos_);
      if (pos_ >= src_.size()) fail(open, std::string("unexpected end of template: missing '") + end + "'");
      if (brackets.empty()) {
        for (const char sign : {'-', '+', '\0'}) {
          if (sign == '+' && kind == Piece::Output) continue;
          const size_t at = pos_ + (sign ? 1 : 0);
          if ((sign && src_[pos_] != sign) || src_.compare(at, 2, end) != 0) continue;
          pos_ = at + 2;
          Token e;
          e.line = line_at(pos_);
          piece.tokens.push_back(e);
          pieces_.push_back(std::move(piece));
          return after_end(sign, kind == Piece::Statement);
        }
      }
      piece.tokens.push_back(token(brackets, piece.tokens.empty() ? nullptr : &piece.tokens.back()));
    }
  }

  Token token(std::vector<char>& brackets, const Token* previous) {
    Token t;
    t.line = line_at(pos_);
    const char c = src_[pos_];
    auto is_digit = [](char x) { return x >= '0' && x <= '9'; };
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t e = pos_;
      while (e < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
      t.type = Token::Name;
      t.text = src_.substr(pos_, e - pos_);
      pos_ = e;
      return t;
    }
    if (is_digit(c)) return number(previous && previous->type == Token::Op && previous->text == ".");
    if (c == '\'' || c == '"') return string_literal();
    static const char* const ops[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/", "*", "%", "~", "[", "]", "(",
                                      ")", "{", "}", ">", "<", "=", ".", ":", "|", ",", ";"};
    for (const char* op : ops) {
      const size_t n = std::char_traits<char>::length(op);
      if (src_.compare(pos_, n, op) != 0) continue;
      t.type = Token::Op;
      t.text = op;
      pos_ += n;
      if (n == 1 && (c == '(' || c == '[' || c == '{')) brackets.push_back(c);
      if (n == 1 && (c == ')' || c == ']' || c == '}')) {
        const char want = c == ')' ? '(' : c == ']' ? '[' : '{';
        if (brackets.empty() || brackets.back() != want) fail(pos_ - 1, std::string("unexpected '") + c + "'");
        brackets.pop_back();
      }
      return t;
    }
    fail(pos_, std::string("unexpected character '") + c + "'");
  }

  Token number(bool after_dot) {
    Token t;
    t.line = line_at(pos_);
    auto digits = [&](size_t p) {
      while (p < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[p])) || src_[p] == '_')) ++p;
      return p;
    };
    size_t e = digits(pos_);
    bool is_float = false;
    if (!after_dot && e + 1 < src_.size() && src_[e] == '.' && std::isdigit(static_cast<unsigned char>(src_[e + 1]))) {
      e = digits(e + 1);
      is_float = true;
    }
    if (!after_dot && e < src_.size() && (src_[e] == 'e' || src_[e] == 'E')) {
      size_t p = e + 1;
      if (p < src_.size() && (src_[p] == '+' || src_[p] == '-')) ++p;
      if (p < src_.size() && std::isdigit(static_cast<unsigned char>(src_[p]))) {
        e = digits(p);
        is_float = true;
      }
    }
    std::string text = src_.substr(pos_, e - pos_);
    text.erase(std::remove(text.begin(), text.end(), '_'), text.end());
    // 0x1F, 0o17, 0b101
    if (!is_float && text == "0" && e < src_.size() && std::strchr("xXoObB", src_[e]) && src_[e] != '\0') {
      const int base = (src_[e] == 'x' || src_[e] == 'X') ? 16 : (src_[e] == 'o' || src_[e] == 'O') ? 8 : 2;
      size_t p = e + 1;
      std::string radix;
      while (p < src_.size() && (std::isxdigit(static_cast<unsigned char>(src_[p])) || src_[p] == '_'))
        if (src_[p++] != '_') radix += src_[p - 1];
      if (!radix.empty()) {
        pos_ = p;
        t.type = Token::Int;
        t.i = std::stoll(radix, nullptr, base);
        return t;
      }
    }
    pos_ = e;
    if (is_float) {
      t.type = Token::Float;
      t.f = std::stod(text);
    } else {
      t.type = Token::Int;
      try {
        t.i = std::stoll(text);
      } catch (const std::out_of_range&) {
        fail(pos_, "integer " + text + " does not fit in 64 bits");
      }
    }
    return t;
  }

  // A quoted string, with Python's escapes (jinja decodes them as "unicode-escape").
  Token string_literal() {
    Token t;
    t.type = Token::String;
    t.line = line_at(pos_);
    const char quote = src_[pos_];
    size_t p = pos_ + 1;
    std::string out;
    auto hex = [&](size_t n) {
      if (p + n > src_.size()) fail(p, "truncated \\x, \\u or \\U escape");
      uint32_t v = 0;
      for (size_t k = 0; k < n; ++k) {
        const char h = src_[p + k];
        if (!std::isxdigit(static_cast<unsigned char>(h))) fail(p, "truncated \\x, \\u or \\U escape");
        v = v * 16 + static_cast<uint32_t>(std::isdigit(static_cast<unsigned char>(h)) ? h - '0' : (std::tolower(h) - 'a' + 10));
      }
      p += n;
      return v;
    };
    while (true) {
      if (p >= src_.size()) fail(pos_, "unterminated string literal");
      const char c = src_[p];
      if (c == quote) break;
      if (c != '\\') {
        out += c;
        ++p;
        continue;
      }
      if (p + 1 >= src_.size()) fail(pos_, "unterminated string literal");
      const char e = src_[p + 1];
      p += 2;
      switch (e) {
        case '\n': break;
        case '\\': out += '\\'; break;
        case '\'': out += '\''; break;
        case '"': out += '"'; break;
        case 'a': out += '\a'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'v': out += '\v'; break;
        case 'x': unicode::append_utf8(out, hex(2)); break;
        case 'u': unicode::append_utf8(out, hex(4)); break;
        case 'U': unicode::append_utf8(out, hex(8)); break;
        default:
          if (e >= '0' && e <= '7') {
            uint32_t v = static_cast<uint32_t>(e - '0');
            for (int k = 0; k < 2 && p < src_.size() && src_[p] >= '0' && src_[p] <= '7'; ++k) v = v * 8 + static_cast<uint32_t>(src_[p++] - '0');
            unicode::append_utf8(out, v);
          } else {
            out += '\\';
            out += e;
          }
      }
    }
    pos_ = p + 1;
    t.text = std::move(out);
    return t;
  }

  std::string src_;
  const std::string& name_;
  size_t pos_ = 0;
  bool raw_line_starting_ = false;
  std::vector<Piece> pieces_;
};

// ---- syntax tree --------------------------------------------------------------------------

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum Kind { Literal, Name, List, Tuple, Dict, Attr, Item, Slice, Call, Filter, Test, Not, Neg, Pos, Binary, And, Or,
              Compare, Concat, Cond };
  Kind kind = Literal;
  int line = 0;
  Value value;                                          // Literal
  std::string name;                                     // Name, Attr, Filter, Test; Binary: the operator
  std::vector<ExprPtr> items;                           // List, Tuple, Concat, Compare operands; Dict: k, v, k, v;
                                                        // Call, Filter, Test: positional arguments
  std::vector<std::pair<std::string, ExprPtr>> kwargs;  // Call, Filter, Test
  std::vector<std::string> ops;                         // Compare
  ExprPtr a, b, c, d;  // Attr/Item/Slice/Call/Filter/Test: a is the object; Item: b the key; Slice: b, c, d;
                       // unary: a; Binary/And/Or: a, b; Cond: a if b else c
  bool negated = false;  // Test: is not
  // Filter, Test: the builtin, looked up once here (null: unknown, an error only if it runs,
  // as in jinja), and the name errors give it ("filter 'join'"); Call: "call".
  const jinja::Filter* filter_fn = nullptr;
  const jinja::Test* test_fn = nullptr;
  std::string what;
};

struct Node;
using Body = std::vector<std::unique_ptr<Node>>;

struct Node {
  enum Kind { Text, Output, If, For, Set, SetBlock, Macro, Break, Continue, Block };
  Kind kind = Text;
  int line = 0;
  std::string text;                                // Text; Macro and SetBlock: the name
  ExprPtr expr;                                    // Output; For: the iterable; Set: the value
  std::vector<std::pair<ExprPtr, Body>> branches;  // If: condition and body, in order
  Body body, else_body;                            // For (else: no items), If (else), SetBlock, Macro, Block
  std::vector<std::string> targets;                // For, Set: names to bind (several: unpacking)
  std::string attribute;                           // Set ns.attribute = ...: targets = {ns}
  ExprPtr filter;                                  // For ... if filter
  std::vector<std::string> params;                 // Macro
  std::vector<ExprPtr> defaults;                   // Macro: one per param (null: none)
};

// ---- parser -------------------------------------------------------------------------------

class Parser {
 public:
  Parser(std::vector<Piece> pieces, const std::string& name) : pieces_(std::move(pieces)), name_(name) {}

  Body parse() {
    Body body = statements({});
    return body;
  }

 private:
  [[noreturn]] void fail(int line, const std::string& message) const {
    throw TemplateError(name_ + ", line " + std::to_string(line) + ": " + message);
  }

  // Statements up to one of `ends` (returned through *which, its piece consumed and left in
  // tokens_ for the caller to read); at the top level (no ends), up to the end of the template.
  Body statements(const std::vector<std::string>& ends, std::string* which = nullptr, const char* block = nullptr) {
    Body body;
    while (next_ < pieces_.size()) {
      Piece& p = pieces_[next_++];
      auto node = std::make_unique<Node>();
      node->line = p.line;
      if (p.kind == Piece::Text) {
        node->kind = Node::Text;
        node->text = std::move(p.text);
        body.push_back(std::move(node));
        continue;
      }
      tokens_ = &p.tokens;
      at_ = 0;
      if (p.kind == Piece::Output) {
        node->kind = Node::Output;
        node->expr = tuple_or_expression();
        expect_end();
        body.push_back(std::move(node));
        continue;
      }
      const Token& kw = peek();
      if (kw.type != Token::Name) fail(kw.line, "expected a tag name after {%");
      if (std::find(ends.begin(), ends.end(), kw.text) != ends.end()) {
        ++at_;
        if (which) *which = kw.text;
        return body;
      }
      body.push_back(statement(p.line, ends, block));
    }
    if (!ends.empty()) {
      std::string want;
      for (const std::string& e : ends) want += (want.empty() ? "'" : " or '") + e + "'";
      fail(pieces_.empty() ? 1 : pieces_.back().line,
           std::string("unexpected end of template: the '") + block + "' block needs " + want);
    }
    return body;
  }

  std::unique_ptr<Node> statement(int line, const std::vector<std::string>& outer_ends, const char* outer_block) {
    auto node = std::make_unique<Node>();
    node->line = line;
    const std::string kw = next().text;
    if (kw == "if") {
      node->kind = Node::If;
      ExprPtr cond = expression();
      expect_end();
      while (true) {
        std::string which;
        Body body = statements({"elif", "else", "endif"}, &which, "if");
        node->branches.emplace_back(std::move(cond), std::move(body));
        if (which == "elif") {
          cond = expression();
          expect_end();
          continue;
        }
        expect_end();
        if (which == "else") {
          node->else_body = statements({"endif"}, &which, "if");
          expect_end();
        }
        return node;
      }
    }
    if (kw == "for") {
      node->kind = Node::For;
      node->targets = target_names("for");
      expect_name("in");
      node->expr = expression(false);
      if (peek_name("if")) {
        ++at_;
        node->filter = expression(false);
      }
      if (peek_name("recursive")) fail(line, "recursive for loops are not supported");
      expect_end();
      std::string which;
      node->body = statements({"else", "endfor"}, &which, "for");
      expect_end();
      if (which == "else") {
        node->else_body = statements({"endfor"}, &which, "for");
        expect_end();
      }
      return node;
    }
    if (kw == "set") {
      const Token& first = peek();
      if (first.type != Token::Name) fail(first.line, "expected a name after set");
      if (peek(1).type == Token::Op && peek(1).text == ".") {
        node->targets = {next().text};
        ++at_;
        const Token& attr = next();
        if (attr.type != Token::Name) fail(attr.line, "expected an attribute name after '.'");
        node->attribute = attr.text;
      } else {
        node->targets = target_names("set");
      }
      if ((peek().type == Token::End || peek_op("|")) && node->targets.size() == 1 && node->attribute.empty()) {
        node->kind = Node::SetBlock;
        node->text = node->targets[0];
        if (peek_op("|")) {  // {% set x | upper %}: filters over the captured text
          ExprPtr captured = make(Expr::Name, line);
          captured->name = kCaptured;
          node->expr = filters(std::move(captured));
        }
        expect_end();
        std::string which;
        node->body = statements({"endset"}, &which, "set");
        expect_end();
        return node;
      }
      node->kind = Node::Set;
      expect_op("=");
      node->expr = tuple_or_expression();
      expect_end();
      return node;
    }
    if (kw == "macro") {
      node->kind = Node::Macro;
      const Token& name = next();
      if (name.type != Token::Name) fail(name.line, "expected the macro's name");
      node->text = name.text;
      expect_op("(");
      while (!peek_op(")")) {
        const Token& param = next();
        if (param.type != Token::Name) fail(param.line, "expected a parameter name");
        node->params.push_back(param.text);
        ExprPtr dflt;
        if (peek_op("=")) {
          ++at_;
          dflt = expression();
        }
        node->defaults.push_back(std::move(dflt));
        if (!peek_op(")")) expect_op(",");
      }
      ++at_;
      expect_end();
      std::string which;
      node->body = statements({"endmacro"}, &which, "macro");
      expect_end();
      return node;
    }
    if (kw == "break" || kw == "continue") {
      node->kind = kw == "break" ? Node::Break : Node::Continue;
      expect_end();
      return node;
    }
    if (kw == "generation") {  // HF's assistant-mask marker: renders its body
      node->kind = Node::Block;
      expect_end();
      std::string which;
      node->body = statements({"endgeneration"}, &which, "generation");
      expect_end();
      return node;
    }
    std::string msg = "unknown tag '" + kw + "'";
    if (outer_block) {
      std::string want;
      for (const std::string& e : outer_ends) want += (want.empty() ? "'" : " or '") + e + "'";
      msg += "; the innermost open block is '" + std::string(outer_block) + "', which needs " + want;
    } else if (kw == "call" || kw == "filter" || kw == "include" || kw == "extends" || kw == "import" || kw == "from" ||
               kw == "block" || kw == "with" || kw == "do") {
      msg = "the '" + kw + "' tag is not supported in keel's chat templates";
    }
    fail(line, msg);
  }

  std::vector<std::string> target_names(const char* where) {
    std::vector<std::string> names;
    const bool paren = peek_op("(");
    if (paren) ++at_;
    while (true) {
      const Token& t = next();
      if (t.type != Token::Name) fail(t.line, std::string("expected a variable name in ") + where);
      names.push_back(t.text);
      if (!peek_op(",")) break;
      ++at_;
    }
    if (paren) expect_op(")");
    return names;
  }

  // ---- expressions ------------------------------------------------------------------------

  const Token& peek(size_t ahead = 0) const {
    const size_t k = std::min(at_ + ahead, tokens_->size() - 1);
    return (*tokens_)[k];
  }
  const Token& next() {
    const Token& t = peek();
    if (t.type != Token::End) ++at_;
    return t;
  }
  bool peek_op(const char* op, size_t ahead = 0) const {
    const Token& t = peek(ahead);
    return t.type == Token::Op && t.text == op;
  }
  bool peek_name(const char* name, size_t ahead = 0) const {
    const Token& t = peek(ahead);
    return t.type == Token::Name && t.text == name;
  }
  static std::string describe(const Token& t) {
    switch (t.type) {
      case Token::End: return "the end of the tag";
      case Token::String: return "a string";
      case Token::Int: case Token::Float: return "a number";
      default: return "'" + t.text + "'";
    }
  }
  void expect_op(const char* op) {
    const Token& t = next();
    if (t.type != Token::Op || t.text != op) fail(t.line, std::string("expected '") + op + "', found " + describe(t));
  }
  void expect_name(const char* name) {
    const Token& t = next();
    if (t.type != Token::Name || t.text != name) fail(t.line, std::string("expected '") + name + "', found " + describe(t));
  }
  void expect_end() {
    const Token& t = peek();
    if (t.type != Token::End) fail(t.line, "expected the end of the tag, found " + describe(t));
  }

  ExprPtr make(Expr::Kind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }

  // An expression, or a tuple of them without parentheses (`{% set a = 1, 2 %}`).
  ExprPtr tuple_or_expression() {
    const int line = peek().line;
    ExprPtr first = expression();
    if (!peek_op(",")) return first;
    ExprPtr t = make(Expr::Tuple, line);
    t->items.push_back(std::move(first));
    while (peek_op(",")) {
      ++at_;
      if (peek().type == Token::End) break;
      t->items.push_back(expression());
    }
    return t;
  }

  ExprPtr expression(bool with_condition = true) { return with_condition ? conditional() : or_expr(); }

  ExprPtr conditional() {
    ExprPtr value = or_expr();
    while (peek_name("if")) {
      const int line = next().line;
      ExprPtr cond = or_expr();
      ExprPtr otherwise;
      if (peek_name("else")) {
        ++at_;
        otherwise = conditional();
      }
      ExprPtr e = make(Expr::Cond, line);
      e->a = std::move(value);
      e->b = std::move(cond);
      e->c = std::move(otherwise);
      value = std::move(e);
    }
    return value;
  }

  ExprPtr binary(Expr::Kind kind, std::string op, ExprPtr a, ExprPtr b, int line) {
    ExprPtr e = make(kind, line);
    e->name = std::move(op);
    e->a = std::move(a);
    e->b = std::move(b);
    return e;
  }

  ExprPtr or_expr() {
    ExprPtr left = and_expr();
    while (peek_name("or")) {
      const int line = next().line;
      left = binary(Expr::Or, "or", std::move(left), and_expr(), line);
    }
    return left;
  }

  ExprPtr and_expr() {
    ExprPtr left = not_expr();
    while (peek_name("and")) {
      const int line = next().line;
      left = binary(Expr::And, "and", std::move(left), not_expr(), line);
    }
    return left;
  }

  ExprPtr not_expr() {
    if (peek_name("not")) {
      const int line = next().line;
      ExprPtr e = make(Expr::Not, line);
      e->a = not_expr();
      return e;
    }
    return compare();
  }

  ExprPtr compare() {
    const int line = peek().line;
    ExprPtr first = math1();
    ExprPtr e;
    while (true) {
      std::string op;
      const Token& t = peek();
      if (t.type == Token::Op && (t.text == "==" || t.text == "!=" || t.text == "<" || t.text == ">" ||
                                  t.text == "<=" || t.text == ">=")) {
        op = t.text;
        ++at_;
      } else if (peek_name("in")) {
        op = "in";
        ++at_;
      } else if (peek_name("not") && peek_name("in", 1)) {
        op = "not in";
        at_ += 2;
      } else {
        break;
      }
      if (!e) {
        e = make(Expr::Compare, line);
        e->items.push_back(std::move(first));
      }
      e->ops.push_back(op);
      e->items.push_back(math1());
    }
    return e ? std::move(e) : std::move(first);
  }

  ExprPtr math1() {
    ExprPtr left = concat();
    while (peek_op("+") || peek_op("-")) {
      const Token& t = next();
      left = binary(Expr::Binary, t.text, std::move(left), concat(), t.line);
    }
    return left;
  }

  ExprPtr concat() {
    const int line = peek().line;
    ExprPtr first = math2();
    if (!peek_op("~")) return first;
    ExprPtr e = make(Expr::Concat, line);
    e->items.push_back(std::move(first));
    while (peek_op("~")) {
      ++at_;
      e->items.push_back(math2());
    }
    return e;
  }

  ExprPtr math2() {
    ExprPtr left = power();
    while (peek_op("*") || peek_op("/") || peek_op("//") || peek_op("%")) {
      const Token& t = next();
      left = binary(Expr::Binary, t.text, std::move(left), power(), t.line);
    }
    return left;
  }

  ExprPtr power() {
    ExprPtr left = unary(true);
    while (peek_op("**")) {
      const int line = next().line;
      left = binary(Expr::Binary, "**", std::move(left), unary(true), line);
    }
    return left;
  }

  // As jinja: -x|f is (-x)|f, and the operand of - takes no filters of its own.
  ExprPtr unary(bool with_filter) {
    ExprPtr node;
    if (peek_op("-") || peek_op("+")) {
      const Token& t = next();
      node = make(t.text == "-" ? Expr::Neg : Expr::Pos, t.line);
      node->a = unary(false);
    } else {
      node = primary();
    }
    node = postfix(std::move(node));
    if (with_filter) node = filters(std::move(node));
    return node;
  }

  ExprPtr primary() {
    const Token& t = next();
    ExprPtr e;
    switch (t.type) {
      case Token::Name:
        if (t.text == "true" || t.text == "True" || t.text == "false" || t.text == "False") {
          e = make(Expr::Literal, t.line);
          e->value = Value::boolean(t.text == "true" || t.text == "True");
        } else if (t.text == "none" || t.text == "None") {
          e = make(Expr::Literal, t.line);
          e->value = Value::none();
        } else {
          e = make(Expr::Name, t.line);
          e->name = t.text;
        }
        return e;
      case Token::String: {
        std::string s = t.text;
        while (peek().type == Token::String) s += next().text;  // adjacent literals join
        e = make(Expr::Literal, t.line);
        e->value = Value::string(std::move(s));
        return e;
      }
      case Token::Int:
        e = make(Expr::Literal, t.line);
        e->value = Value::integer(t.i);
        return e;
      case Token::Float:
        e = make(Expr::Literal, t.line);
        e->value = Value::real(t.f);
        return e;
      case Token::Op:
        if (t.text == "(") {
          if (peek_op(")")) {
            ++at_;
            return make(Expr::Tuple, t.line);
          }
          ExprPtr first = expression();
          if (peek_op(")")) {
            ++at_;
            return first;
          }
          e = make(Expr::Tuple, t.line);
          e->items.push_back(std::move(first));
          while (peek_op(",")) {
            ++at_;
            if (peek_op(")")) break;
            e->items.push_back(expression());
          }
          expect_op(")");
          return e;
        }
        if (t.text == "[") {
          e = make(Expr::List, t.line);
          while (!peek_op("]")) {
            e->items.push_back(expression());
            if (!peek_op("]")) expect_op(",");
          }
          ++at_;
          return e;
        }
        if (t.text == "{") {
          e = make(Expr::Dict, t.line);
          while (!peek_op("}")) {
            e->items.push_back(expression());
            expect_op(":");
            e->items.push_back(expression());
            if (!peek_op("}")) expect_op(",");
          }
          ++at_;
          return e;
        }
        break;
      default: break;
    }
    fail(t.line, "unexpected " + describe(t));
  }

  ExprPtr postfix(ExprPtr node) {
    while (true) {
      if (peek_op(".")) {
        const int line = next().line;
        const Token& t = next();
        if (t.type == Token::Name) {
          ExprPtr e = make(Expr::Attr, line);
          e->a = std::move(node);
          e->name = t.text;
          node = std::move(e);
        } else if (t.type == Token::Int) {
          ExprPtr e = make(Expr::Item, line);
          e->a = std::move(node);
          e->b = make(Expr::Literal, line);
          e->b->value = Value::integer(t.i);
          node = std::move(e);
        } else {
          fail(t.line, "expected an attribute name after '.', found " + describe(t));
        }
      } else if (peek_op("[")) {
        const int line = next().line;
        node = subscript(std::move(node), line);
      } else if (peek_op("(")) {
        const int line = next().line;
        ExprPtr e = make(Expr::Call, line);
        e->what = "call";
        e->a = std::move(node);
        call_args(*e);
        node = std::move(e);
      } else {
        return node;
      }
    }
  }

  ExprPtr subscript(ExprPtr obj, int line) {
    ExprPtr parts[3];
    int part = 0;
    bool is_slice = false;
    while (!peek_op("]")) {
      if (peek_op(":")) {
        ++at_;
        is_slice = true;
        if (++part > 2) fail(line, "too many ':' in a slice");
        continue;
      }
      if (parts[part]) fail(peek().line, "expected ']' or ':', found " + describe(peek()));
      parts[part] = expression();
    }
    ++at_;
    if (!is_slice) {
      if (!parts[0]) fail(line, "empty subscript []");
      ExprPtr e = make(Expr::Item, line);
      e->a = std::move(obj);
      e->b = std::move(parts[0]);
      return e;
    }
    ExprPtr e = make(Expr::Slice, line);
    e->a = std::move(obj);
    e->b = std::move(parts[0]);
    e->c = std::move(parts[1]);
    e->d = std::move(parts[2]);
    return e;
  }

  // ( args ): positional expressions, then name=expression keywords; the '(' is consumed.
  void call_args(Expr& e) {
    while (!peek_op(")")) {
      if (peek().type == Token::Name && peek_op("=", 1)) {
        std::string key = next().text;
        ++at_;
        e.kwargs.emplace_back(std::move(key), expression());
      } else {
        if (!e.kwargs.empty()) fail(peek().line, "a positional argument follows a keyword argument");
        e.items.push_back(expression());
      }
      if (!peek_op(")")) expect_op(",");
    }
    ++at_;
  }

  ExprPtr filters(ExprPtr node) {
    while (true) {
      if (peek_op("|")) {
        const int line = next().line;
        const Token& name = next();
        if (name.type != Token::Name) fail(name.line, "expected a filter name after '|'");
        ExprPtr e = make(Expr::Filter, line);
        e->a = std::move(node);
        e->name = name.text;
        e->filter_fn = find_filter(name.text);
        e->what = "filter '" + name.text + "'";
        if (peek_op("(")) {
          ++at_;
          call_args(*e);
        }
        node = std::move(e);
      } else if (peek_name("is")) {
        const int line = next().line;
        ExprPtr e = make(Expr::Test, line);
        e->a = std::move(node);
        if (peek_name("not")) {
          ++at_;
          e->negated = true;
        }
        const Token& name = next();
        if (name.type != Token::Name && !(name.type == Token::Op && (name.text == "==" || name.text == "!=" ||
                                                                     name.text == "<" || name.text == ">" ||
                                                                     name.text == "<=" || name.text == ">=")))
          fail(name.line, "expected a test name after 'is'");
        e->name = name.text;
        e->test_fn = find_test(name.text);
        e->what = "test '" + name.text + "'";
        const Token& t = peek();
        if (peek_op("(")) {
          ++at_;
          call_args(*e);
        } else if ((t.type == Token::Name || t.type == Token::String || t.type == Token::Int || t.type == Token::Float ||
                    peek_op("[") || peek_op("{")) &&
                   !(peek_name("else") || peek_name("or") || peek_name("and"))) {
          if (peek_name("is")) fail(t.line, "tests cannot be chained with 'is'");
          e->items.push_back(postfix(primary()));  // `x is divisibleby 3`
        }
        node = std::move(e);
      } else {
        return node;
      }
    }
  }

  std::vector<Piece> pieces_;
  const std::string& name_;
  size_t next_ = 0;
  const std::vector<Token>* tokens_ = nullptr;
  size_t at_ = 0;
};

}  // namespace

struct Template::Impl {
  std::string name;
  Body body;
};

namespace {

// ---- renderer -----------------------------------------------------------------------------

using Scope = std::unordered_map<std::string, Value>;

class Renderer {
 public:
  Renderer(const Template::Impl& t, Dict globals) : t_(t), globals_(std::move(globals)) {
    scopes_.push_back(std::make_shared<Scope>());
  }

  std::string run() {
    std::string out;
    exec(t_.body, out);
    return out;
  }

 private:
  enum class Flow { Normal, Break, Continue };

  [[noreturn]] void fail(int line, const std::string& message) const {
    throw TemplateError(t_.name + ", line " + std::to_string(line) + ": " + message);
  }

  Flow exec(const Body& body, std::string& out) {
    for (const auto& node : body) {
      Flow f = Flow::Normal;
      try {
        f = exec(*node, out);
      } catch (const RenderError& e) {
        fail(node->line, e.what());
      }
      if (f != Flow::Normal) return f;
    }
    return Flow::Normal;
  }

  Flow exec(const Node& n, std::string& out) {
    switch (n.kind) {
      case Node::Text: out += n.text; return Flow::Normal;
      case Node::Output: out += to_str(eval(*n.expr)); return Flow::Normal;
      case Node::If:
        for (const auto& [cond, body] : n.branches)
          if (truthy(eval(*cond))) return exec(body, out);
        return exec(n.else_body, out);
      case Node::For: return exec_for(n, out);
      case Node::Set: {
        Value v = eval(*n.expr);
        if (!n.attribute.empty()) {
          Value ns = lookup(n.targets[0]);
          if (!ns.is_dict() || !ns.dict->is_namespace)
            throw RenderError("cannot assign attribute '" + n.attribute + "' on " + type_name(ns) + " '" + n.targets[0] +
                              "' (only a namespace() takes attributes)");
          if (n.attribute.starts_with("_"))
            throw RenderError("chat templates cannot store underscore-prefixed attributes on a namespace ('" +
                              n.attribute + "')");
          ns.dict->set(n.attribute, std::move(v));
        } else {
          bind(n.targets, v);
        }
        return Flow::Normal;
      }
      case Node::SetBlock: {
        std::string captured;
        exec(n.body, captured);
        Value v = Value::string(std::move(captured));
        if (n.expr) {
          scopes_.push_back(std::make_shared<Scope>());
          assign(kCaptured, std::move(v));
          try {
            v = eval(*n.expr);
          } catch (...) {
            scopes_.pop_back();
            throw;
          }
          scopes_.pop_back();
        }
        assign(n.text, std::move(v));
        return Flow::Normal;
      }
      case Node::Macro: assign(n.text, macro(n)); return Flow::Normal;
      case Node::Break: return Flow::Break;
      case Node::Continue: return Flow::Continue;
      case Node::Block: return exec(n.body, out);
    }
    return Flow::Normal;
  }

  Flow exec_for(const Node& n, std::string& out) {
    const Value iterable = eval(*n.expr);
    std::vector<Value> items = iterate(iterable);
    if (n.filter) {
      std::vector<Value> kept;
      for (const Value& item : items) {
        scopes_.push_back(std::make_shared<Scope>());
        bind(n.targets, item);
        const bool keep = truthy(eval(*n.filter));
        scopes_.pop_back();
        if (keep) kept.push_back(item);
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      scopes_.push_back(std::make_shared<Scope>());
      exec(n.else_body, out);
      scopes_.pop_back();
      return Flow::Normal;
    }
    const int64_t count = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < count; ++k) {
      scopes_.push_back(std::make_shared<Scope>());
      bind(n.targets, items[static_cast<size_t>(k)]);
      auto loop = std::make_shared<Dict>();
      loop->set("index", Value::integer(k + 1));
      loop->set("index0", Value::integer(k));
      loop->set("revindex", Value::integer(count - k));
      loop->set("revindex0", Value::integer(count - k - 1));
      loop->set("first", Value::boolean(k == 0));
      loop->set("last", Value::boolean(k == count - 1));
      loop->set("length", Value::integer(count));
      loop->set("depth", Value::integer(1));
      loop->set("depth0", Value::integer(0));
      loop->set("previtem", k > 0 ? items[static_cast<size_t>(k - 1)] : Value::undefined("there is no previous item"));
      loop->set("nextitem", k + 1 < count ? items[static_cast<size_t>(k + 1)] : Value::undefined("there is no next item"));
      loop->set("cycle", Value::function([k](Args& a) {
        if (a.pos.empty()) throw RenderError("no items for cycling given");
        return a.pos[static_cast<size_t>(k) % a.pos.size()];
      }));
      scopes_.back()->insert_or_assign("loop", Value::make_dict(loop));
      const Flow f = exec(n.body, out);
      scopes_.pop_back();
      if (f == Flow::Break) break;
    }
    return Flow::Normal;
  }

  void assign(const std::string& name, Value v) { scopes_.back()->insert_or_assign(name, std::move(v)); }

  void bind(const std::vector<std::string>& names, const Value& v) {
    if (names.size() == 1) {
      assign(names[0], v);
      return;
    }
    std::vector<Value> parts = iterate(v);
    if (parts.size() != names.size())
      throw RenderError((parts.size() > names.size() ? "too many" : "not enough") + std::string(" values to unpack (expected ") +
                        std::to_string(names.size()) + ", got " + std::to_string(parts.size()) + ")");
    for (size_t k = 0; k < names.size(); ++k) assign(names[k], parts[k]);
  }

  Value lookup(const std::string& name) const {
    for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
      auto hit = (*it)->find(name);
      if (hit != (*it)->end()) return hit->second;
    }
    if (const Value* v = globals_.find(name)) return *v;
    return Value::undefined("'" + name + "' is undefined");
  }

  // A macro: a call renders its body in a scope of its own over the template's top level.
  Value macro(const Node& n) {
    return Value::function([this, &n](Args& a) {
      auto frame = std::make_shared<Scope>();
      if (a.pos.size() > n.params.size())
        throw RenderError("macro '" + n.text + "' takes " + std::to_string(n.params.size()) + " arguments, got " +
                          std::to_string(a.pos.size()));
      std::vector<std::shared_ptr<Scope>> saved = std::move(scopes_);
      scopes_ = {saved.front(), frame};
      for (size_t k = 0; k < n.params.size(); ++k) {
        Value v = a.get(k, n.params[k]);
        if (v.is_undefined() && n.defaults[k]) v = eval(*n.defaults[k]);
        frame->insert_or_assign(n.params[k], v.is_undefined() ? Value::undefined("'" + n.params[k] + "' is undefined") : v);
      }
      a.what = "macro '" + n.text + "'";
      std::string out;
      try {
        a.done();
        exec(n.body, out);
      } catch (...) {
        scopes_ = std::move(saved);
        throw;
      }
      scopes_ = std::move(saved);
      return Value::string(std::move(out));
    });
  }

  // The arguments of a call, filter or test, evaluated.
  Args args_of(const Expr& e) {
    Args a;
    a.what = e.what;
    for (const auto& x : e.items) a.pos.push_back(eval(*x));
    for (const auto& [k, x] : e.kwargs) a.kw.emplace_back(k, eval(*x));
    return a;
  }

  Value call(const Value& fn, const Expr& e) {
    Args a = args_of(e);
    if (fn.is_undefined()) throw RenderError(fn.s.empty() ? "call of an undefined value" : fn.s);
    if (fn.kind != Value::Kind::Function) throw RenderError("'" + type_name(fn) + "' object is not callable");
    return (*fn.fn)(a);
  }

  Value eval(const Expr& e) {
    switch (e.kind) {
      case Expr::Literal: return e.value;
      case Expr::Name: return lookup(e.name);
      case Expr::List: case Expr::Tuple: {
        std::vector<Value> items;
        for (const auto& x : e.items) items.push_back(eval(*x));
        Value v = Value::make_list(std::move(items));
        v.is_tuple = e.kind == Expr::Tuple;
        return v;
      }
      case Expr::Dict: {
        auto d = std::make_shared<Dict>();
        for (size_t k = 0; k + 1 < e.items.size(); k += 2) {
          Value key = eval(*e.items[k]);
          if (key.kind == Value::Kind::Int) {
            key = Value::string(std::to_string(key.i));
            d->int_keys.push_back(key.s);
          } else if (!key.is_string()) {
            throw RenderError("dict keys must be strings or integers here, not " + type_name(key));
          }
          d->set(key.s, eval(*e.items[k + 1]));
        }
        return Value::make_dict(d);
      }
      case Expr::Attr: return get_attr(eval(*e.a), e.name);
      case Expr::Item: return get_item(eval(*e.a), eval(*e.b));
      case Expr::Slice: {
        Value obj = eval(*e.a);
        auto opt = [&](const ExprPtr& p) { return p ? eval(*p) : Value::none(); };
        return slice(obj, opt(e.b), opt(e.c), opt(e.d));
      }
      case Expr::Call: return call(eval(*e.a), e);
      case Expr::Filter: {
        Value v = eval(*e.a);
        Args a = args_of(e);
        if (!e.filter_fn) throw RenderError("no filter named '" + e.name + "'");
        return (*e.filter_fn)(v, a);
      }
      case Expr::Test: {
        Value v = eval(*e.a);
        Args a = args_of(e);
        if (!e.test_fn) throw RenderError("no test named '" + e.name + "'");
        return Value::boolean((*e.test_fn)(v, a) != e.negated);
      }
      case Expr::Not: return Value::boolean(!truthy(eval(*e.a)));
      case Expr::Neg: case Expr::Pos: {
        Value v = eval(*e.a);
        const bool neg = e.kind == Expr::Neg;
        if (v.kind == Value::Kind::Int) return Value::integer(neg ? -v.i : v.i);
        if (v.kind == Value::Kind::Bool) return Value::integer(neg ? -int64_t{v.b} : int64_t{v.b});
        if (v.kind == Value::Kind::Float) return Value::real(neg ? -v.f : v.f);
        if (v.is_undefined()) throw RenderError(v.s.empty() ? "operand is undefined" : v.s);
        throw RenderError(std::string("bad operand type for unary ") + (neg ? "-" : "+") + ": '" + type_name(v) + "'");
      }
      case Expr::And: {
        Value a = eval(*e.a);
        return truthy(a) ? eval(*e.b) : a;
      }
      case Expr::Or: {
        Value a = eval(*e.a);
        return truthy(a) ? a : eval(*e.b);
      }
      case Expr::Concat: {
        std::string s;
        for (const auto& x : e.items) s += to_str(eval(*x));
        return Value::string(std::move(s));
      }
      case Expr::Cond:
        if (truthy(eval(*e.b))) return eval(*e.a);
        return e.c ? eval(*e.c) : Value::undefined("the conditional expression had no else");
      case Expr::Compare: {
        Value left = eval(*e.items[0]);
        for (size_t k = 0; k < e.ops.size(); ++k) {
          Value right = eval(*e.items[k + 1]);
          if (!compare(e.ops[k], left, right)) return Value::boolean(false);
          left = std::move(right);
        }
        return Value::boolean(true);
      }
      case Expr::Binary: return arithmetic(e.name, eval(*e.a), eval(*e.b));
    }
    return Value::undefined();
  }

  static bool contains(const Value& container, const Value& item) {
    switch (container.kind) {
      case Value::Kind::String:
        if (!item.is_string())
          throw RenderError("'in <string>' requires a string as left operand, not " + type_name(item));
        return container.s.find(item.s) != std::string::npos;
      case Value::Kind::Dict: return item.is_string() && container.dict->find(item.s) != nullptr;
      case Value::Kind::List:
        return std::any_of(container.list->begin(), container.list->end(), [&](const Value& v) { return equal(v, item); });
      case Value::Kind::Undefined: return false;
      default: throw RenderError("argument of type '" + type_name(container) + "' is not iterable");
    }
  }

  static bool compare(const std::string& op, const Value& a, const Value& b) {
    if (op == "==") return equal(a, b);
    if (op == "!=") return !equal(a, b);
    if (op == "in") return contains(b, a);
    if (op == "not in") return !contains(b, a);
    for (const Value* v : {&a, &b})
      if (v->is_undefined()) throw RenderError(v->s.empty() ? "comparison with an undefined value" : v->s);
    if (op == "<") return less(a, b);
    if (op == ">") return less(b, a);
    if (op == "<=") return !less(b, a);
    return !less(a, b);  // >=
  }

  static int64_t as_int(const Value& v) { return v.kind == Value::Kind::Int ? v.i : int64_t{v.b}; }

  static Value arithmetic(const std::string& op, const Value& a, const Value& b) {
    for (const Value* v : {&a, &b})
      if (v->is_undefined()) throw RenderError(v->s.empty() ? "operand is undefined" : v->s);
    const bool ints = (a.kind == Value::Kind::Int || a.kind == Value::Kind::Bool) &&
                      (b.kind == Value::Kind::Int || b.kind == Value::Kind::Bool);
    const bool nums = a.is_number() && b.is_number();
    auto unsupported = [&]() -> RenderError {
      return RenderError("unsupported operand type(s) for " + op + ": '" + type_name(a) + "' and '" + type_name(b) + "'");
    };
    if (op == "+") {
      if (ints) return Value::integer(as_int(a) + as_int(b));
      if (nums) return Value::real(a.as_double() + b.as_double());
      if (a.is_string() && b.is_string()) return Value::string(a.s + b.s);
      if (a.is_list() && b.is_list()) {
        std::vector<Value> items = *a.list;
        items.insert(items.end(), b.list->begin(), b.list->end());
        return Value::make_list(std::move(items));
      }
      if (a.is_string() || b.is_string())
        throw RenderError("can only concatenate str (not \"" + type_name(a.is_string() ? b : a) + "\") to str");
      throw unsupported();
    }
    if (op == "-") {
      if (ints) return Value::integer(as_int(a) - as_int(b));
      if (nums) return Value::real(a.as_double() - b.as_double());
      throw unsupported();
    }
    if (op == "*") {
      if (ints) return Value::integer(as_int(a) * as_int(b));
      if (nums) return Value::real(a.as_double() * b.as_double());
      const Value* seq = a.is_string() || a.is_list() ? &a : &b;
      const Value* n = seq == &a ? &b : &a;
      if ((seq->is_string() || seq->is_list()) && (n->kind == Value::Kind::Int || n->kind == Value::Kind::Bool)) {
        const int64_t times = std::max<int64_t>(0, as_int(*n));
        if (seq->is_string()) {
          std::string s;
          for (int64_t k = 0; k < times; ++k) s += seq->s;
          return Value::string(s);
        }
        std::vector<Value> items;
        for (int64_t k = 0; k < times; ++k) items.insert(items.end(), seq->list->begin(), seq->list->end());
        return Value::make_list(std::move(items));
      }
      throw unsupported();
    }
    if (!nums) throw unsupported();
    if (op == "/") {
      if (b.as_double() == 0) throw RenderError("division by zero");
      return Value::real(a.as_double() / b.as_double());
    }
    if (op == "//" || op == "%") {
      if (b.as_double() == 0) throw RenderError(ints ? "integer division or modulo by zero" : "float floor division by zero");
      if (ints) {
        const int64_t x = as_int(a), y = as_int(b);
        int64_t q = x / y, r = x % y;
        if (r != 0 && ((r < 0) != (y < 0))) --q, r += y;  // floor, as Python
        return Value::integer(op == "//" ? q : r);
      }
      // float divmod, as CPython's float_divmod.
      const double x = a.as_double(), y = b.as_double();
      double mod = std::fmod(x, y), div = (x - mod) / y;
      if (mod != 0) {
        if ((y < 0) != (mod < 0)) mod += y, div -= 1.0;
      } else {
        mod = std::copysign(0.0, y);
      }
      if (op == "%") return Value::real(mod);
      double floordiv = std::copysign(0.0, x / y);
      if (div != 0) {
        floordiv = std::floor(div);
        if (div - floordiv > 0.5) floordiv += 1.0;
      }
      return Value::real(floordiv);
    }
    if (op == "**") {
      if (ints && as_int(b) >= 0) {
        int64_t r = 1, base = as_int(a);
        for (int64_t k = 0; k < as_int(b); ++k) r *= base;
        return Value::integer(r);
      }
      return Value::real(std::pow(a.as_double(), b.as_double()));
    }
    throw unsupported();
  }

  const Template::Impl& t_;
  Dict globals_;
  std::vector<std::shared_ptr<Scope>> scopes_;
};

}  // namespace

Template::Template() = default;
Template::~Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;
Template::Template(const Template&) = default;

Template Template::parse(std::string_view source, std::string name) {
  auto impl = std::make_shared<Impl>();
  impl->name = std::move(name);
  Lexer lexer(source, impl->name);
  Parser parser(lexer.run(), impl->name);
  impl->body = parser.parse();
  Template t;
  t.impl_ = std::move(impl);
  return t;
}

const std::string& Template::name() const { return impl_->name; }

std::string Template::render(const nlohmann::ordered_json& context, const std::function<std::time_t()>& now) const {
  if (!context.is_object()) throw TemplateError(impl_->name + ": the render context must be a JSON object");
  Dict globals;
  add_globals(globals, now);
  for (const auto& [k, v] : context.items()) globals.set(k, from_json(v));
  Renderer r(*impl_, std::move(globals));
  return r.run();
}

}  // namespace keel::data::jinja
