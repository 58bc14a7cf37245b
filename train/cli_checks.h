// Validators for the numeric options of every subcommand. CLI11's own checks let "nan" through
// (every comparison with it is false), clamp 99999999999999999999 to the type's limit, read
// "010" as octal and word their errors as "Value 0 not in range 0.000000 to 1797...(309 digits)".
// These read the whole argument as a decimal number of the option's type and say what is wrong:
//   --steps: 0 must be a positive integer
//   --steps: 'abc' is not an integer
//   --steps: 99999999999999999999 is too large (allowed: a positive integer, at most 9223372036854775807)
//   --temperature: 'nan' is not a finite number
// Every numeric option uses one of them (test_train "[cli_checks]" checks that it does).
#pragma once

#include <charconv>
#include <limits>
#include <string>

#include <CLI/CLI.hpp>

namespace keel::cli {

inline constexpr const char* kCheckName = "keel-number";

// Whole numbers of type T in [lo, hi]. The argument is rewritten in canonical decimal, so that
// CLI11's conversion (strtoll, base 0) reads what was checked.
template <class T>
CLI::Validator integer(T lo, T hi = std::numeric_limits<T>::max()) {
  static_assert(std::is_integral_v<T>);
  const bool open_top = hi == std::numeric_limits<T>::max();
  const std::string allowed = lo == 1 && open_top   ? "a positive integer"
                              : lo == 0 && open_top ? "a non-negative integer"
                              : open_top            ? "an integer >= " + std::to_string(lo)
                                         : "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  const std::string shown = lo == 1 && open_top ? "POSITIVE" : lo == 0 && open_top ? "NONNEGATIVE" : allowed;
  auto check = [=](std::string& arg) -> std::string {
    const size_t sign = !arg.empty() && (arg[0] == '-' || arg[0] == '+') ? 1 : 0;
    if (arg.size() == sign || arg.find_first_not_of("0123456789", sign) != std::string::npos)
      return "'" + arg + "' is not an integer";
    T v{};
    const char* begin = arg.data() + (arg[0] == '+' ? 1 : 0);
    const auto [end, ec] = std::from_chars(begin, arg.data() + arg.size(), v);
    if (ec != std::errc() || end != arg.data() + arg.size()) {  // beyond T (or a negative unsigned)
      if (arg[0] == '-' && lo >= 0) return arg + " must be " + allowed;
      return arg + " is too " + (arg[0] == '-' ? "small (allowed: " + allowed + ", at least " + std::to_string(lo)
                                               : "large (allowed: " + allowed + ", at most " + std::to_string(hi)) +
             ")";
    }
    if (v < lo || v > hi) return arg + " must be " + allowed;
    arg = std::to_string(v);
    return {};
  };
  return CLI::Validator(check, shown, kCheckName);
}

// Finite numbers in [lo, hi]; lo_open / hi_open leave an end out.
CLI::Validator number(double lo, double hi = std::numeric_limits<double>::infinity(), bool lo_open = false,
                      bool hi_open = false);

// Finite numbers > 0.
inline CLI::Validator positive_number() { return number(0, std::numeric_limits<double>::infinity(), true); }

// Memory sizes as plan::parse_memory_size reads them ("80GiB", "40G", "80GB"); 0 too where
// `allow_zero`.
CLI::Validator memory_size(bool allow_zero = false);

}  // namespace keel::cli
