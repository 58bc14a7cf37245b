// Values of the Jinja interpreter (data/jinja.h), with Python's semantics: what the renderer
// (jinja.cpp) and the builtins (jinja_builtins.cpp) share. Internal to data/.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/jinja.h"

namespace keel::data::jinja {

struct Value;

// A Python dict with string keys, in insertion order. A namespace() is a dict whose entries
// templates may assign ({% set ns.x = ... %}); every other dict is immutable, as in HF's
// sandbox.
struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  bool is_namespace = false;
  std::vector<std::string> int_keys;  // keys written as integers in a literal ({1: 'a'}): repr shows them bare
  const Value* find(const std::string& key) const;
  bool is_int_key(const std::string& key) const;
  void set(const std::string& key, Value v);
};

struct Args;
using Function = std::function<Value(Args&)>;

struct Value {
  enum class Kind { Undefined, None, Bool, Int, Float, String, List, Dict, Function };
  Kind kind = Kind::Undefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;  // String; Undefined: what was looked up ("'x' is undefined"); List: a range's repr
  std::shared_ptr<std::vector<Value>> list;
  std::shared_ptr<Dict> dict;
  std::shared_ptr<Function> fn;
  bool is_tuple = false;  // a List written as a tuple: prints with ( )

  static Value undefined(std::string what = {});
  static Value none();
  static Value boolean(bool v);
  static Value integer(int64_t v);
  static Value real(double v);
  static Value string(std::string v);
  static Value make_list(std::vector<Value> items = {});
  static Value make_dict(std::shared_ptr<Dict> d = nullptr);
  static Value function(Function fn);

  bool is_undefined() const { return kind == Kind::Undefined; }
  bool is_none() const { return kind == Kind::None; }
  bool is_string() const { return kind == Kind::String; }
  bool is_number() const { return kind == Kind::Int || kind == Kind::Float || kind == Kind::Bool; }
  bool is_list() const { return kind == Kind::List; }
  bool is_dict() const { return kind == Kind::Dict; }
  double as_double() const;  // numbers (bools count as 0/1)
};

// Arguments of a call: positional, then keyword.
struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  std::string what;  // "filter 'join'", for errors

  // The argument at position i or named `name`, else `fallback`; taking it marks it used.
  Value get(size_t i, const std::string& name, Value fallback = Value::undefined());
  // Throws unless every argument was taken (too many, or an unknown keyword).
  void done() const;

 private:
  std::vector<bool> used_pos_, used_kw_;
};

// Python's semantics.
bool truthy(const Value& v);
std::string to_str(const Value& v);   // str(v); Undefined prints as ""
std::string repr(const Value& v);     // repr(v)
std::string type_name(const Value& v);  // "str", "int", "dict", "undefined", ...
std::string float_repr(double x);     // repr(float): 1.0, 1e+16, 1e-05, inf, nan
bool equal(const Value& a, const Value& b);
// a < b for numbers, strings and lists; throws for other pairs (as Python's TypeError).
bool less(const Value& a, const Value& b);
// The items a for loop visits: list items, dict keys, string characters; Undefined: none.
std::vector<Value> iterate(const Value& v);
int64_t length(const Value& v);

// JSON <-> values. Objects keep key order.
Value from_json(const nlohmann::ordered_json& j);
// json.dumps(v, ensure_ascii, indent, separators, sort_keys); indent < 0: none (one line).
std::string to_json(const Value& v, bool ensure_ascii, int indent, const std::string& item_sep,
                    const std::string& key_sep, bool sort_keys);

// Attribute access (x.name): dict entries, then the methods of strings and dicts; anything
// else is Undefined (an error only when x itself is Undefined).
Value get_attr(const Value& obj, const std::string& name);
// Item access (x[key]): dict entries, list and string items by (negative) index.
Value get_item(const Value& obj, const Value& key);
// x[start:stop:step] of a list or string (Undefined or None bounds: the defaults).
Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step);

// The builtins: filters and tests by name (nullptr when there is none), and the globals of
// HF's environment. `now` is strftime_now's clock.
using Filter = std::function<Value(const Value&, Args&)>;
using Test = std::function<bool(const Value&, Args&)>;
const Filter* find_filter(const std::string& name);
const Test* find_test(const std::string& name);
void add_globals(Dict& globals, const std::function<std::time_t()>& now);

// Thrown by raise_exception and by any failed operation; the renderer adds the line.
struct RenderError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace keel::data::jinja
