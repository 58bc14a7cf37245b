#include "train/cli_checks.h"

#include <cmath>
#include <sstream>

#include "train/config.h"
#include "train/plan.h"

namespace keel::cli {

CLI::Validator number(double lo, double hi, bool lo_open, bool hi_open) {
  std::ostringstream range;
  if (std::isinf(hi))
    range << (lo_open ? "> " : ">= ") << lo;
  else
    range << "in " << (lo_open ? "(" : "[") << lo << ", " << hi << (hi_open ? ")" : "]");
  const std::string allowed = "a number " + range.str();
  auto check = [=](std::string& arg) -> std::string {
    double x = 0;
    const char* begin = arg.data() + (!arg.empty() && arg[0] == '+' ? 1 : 0);
    const auto [end, ec] = std::from_chars(begin, arg.data() + arg.size(), x);
    if (arg.empty() || end != arg.data() + arg.size() || ec == std::errc::invalid_argument)
      return "'" + arg + "' is not a number";
    if (ec == std::errc::result_out_of_range) return arg + " must be " + allowed;  // beyond a double
    if (!std::isfinite(x)) return "'" + arg + "' is not a finite number";
    if ((lo_open ? x <= lo : x < lo) || (hi_open ? x >= hi : x > hi)) return arg + " must be " + allowed;
    return {};
  };
  return CLI::Validator(check, range.str(), kCheckName);
}

CLI::Validator memory_size(bool allow_zero) {
  auto check = [allow_zero](std::string& arg) -> std::string {
    try {
      plan::parse_memory_size(arg, allow_zero);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return {};
  };
  return CLI::Validator(check, "SIZE", kCheckName);
}

}  // namespace keel::cli
