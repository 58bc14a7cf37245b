// The Jinja2 template language as Hugging Face chat templates use it, in C++: what
// transformers' apply_chat_template renders, character for character, without Python.
//
// The environment is HF's: trim_blocks and lstrip_blocks on, the loopcontrols extension
// (break, continue), the {% generation %} block (rendered as its body), no autoescape, and
// the globals raise_exception(message), strftime_now(format), namespace(...), dict(...) and
// range(...); tojson is HF's (json.dumps with ensure_ascii=False, indent, separators,
// sort_keys). Covered:
//   tags:        {{ }}, {% %}, {# #}, whitespace control (-, +), raw blocks; source newlines
//                normalized to \n and one trailing newline dropped, as jinja does
//   statements:  if/elif/else, for (tuple targets, loop filter, else, loop.index/index0/
//                revindex/revindex0/first/last/length/previtem/nextitem/cycle), set (names,
//                tuples, namespace attributes, blocks), macro (positional, default and keyword
//                arguments), break, continue, generation
//   expressions: Python literals, lists, tuples, dicts, attribute and item access, slices,
//                calls with keyword arguments, filters, tests, arithmetic, ~, comparisons
//                (chained), in / not in, and / or / not, conditional expressions
//   values:      Python semantics: str() and repr() of every type (floats as Python prints
//                them), truthiness, int/float arithmetic with floor division and modulo,
//                code-point indexing of strings, insertion-ordered dicts, jinja's Undefined
//                (prints empty, is falsy, fails on attribute access)
//   filters, tests, str/dict methods: the ones chat templates use (see jinja_builtins.cpp)
// Not covered (an error names them): recursive loops, {% call %}, {% filter %}, {% include %},
// {% extends %}, {% import %}, the rarer filters. Case mappings (upper, lower, title,
// capitalize) are the C library's simple Unicode mappings plus ß -> SS; Python's other
// special casings (ligatures, final sigma, dotted I) are not applied. Checked against jinja2
// itself on 396 templates (test/data/test_chat_template.cpp, from scripts/make_chat_fixtures.py).
#pragma once

#include <ctime>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>

#include <nlohmann/json_fwd.hpp>

namespace keel::data::jinja {

// A syntax error (from parse) or a render error (an undefined attribute, a bad operand, a
// raise_exception call); what() names the template, the line and the problem.
class TemplateError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Template {
 public:
  // Parses once; render as often as needed, from any number of threads at once.
  // `name` appears in error messages ("chat template of tokenizer_config.json").
  static Template parse(std::string_view source, std::string name = "template");
  ~Template();
  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;
  Template(const Template&);

  // Renders with the variables of `context` (a JSON object; key order is kept, as Python's
  // dicts keep it). `now` replaces the clock of strftime_now when set (tests, reproducible data).
  std::string render(const nlohmann::ordered_json& context, const std::function<std::time_t()>& now = {}) const;

  const std::string& name() const;

  struct Impl;

 private:
  Template();
  std::shared_ptr<const Impl> impl_;
};

}  // namespace keel::data::jinja
