// Internal: numbers in messages, as the shortest text that reads back as the same value.
//
// std::to_string(double) prints six decimals ("0.000000" for 1e-8) and "%.17g" prints
// noise ("0.10000000000000001" for 0.1); this prints what the user wrote: 1e-08 ->
// "1e-08", 0.1 -> "0.1", 3e-4 -> "3e-04", 2000 -> "2000", 1e+20 -> "1e+20", -0.0 ->
// "-0", inf -> "inf", NaN -> "nan". Only for text people read: texts that are compared
// or hashed (program text, cache keys, checkpoints) keep their own formats.
#pragma once

#include <charconv>
#include <cstdint>
#include <string>
#include <system_error>

namespace stepfuse::detail {

// The shortest decimal text that std::from_chars reads back as exactly `v` (std::to_chars
// without a precision: fixed or scientific, whichever is shorter).
inline std::string format_number(double v) {
  if (v != v) return "nan";  // whatever its sign bit ("-nan" reads as a different thing)
  char buf[32];  // the longest shortest form, "-2.2250738585072014e-308", is 24 characters
  const std::to_chars_result r = std::to_chars(buf, buf + sizeof buf, v);
  if (r.ec != std::errc{}) return "?";  // not reached: 32 characters always suffice
  return std::string(buf, r.ptr);
}

// A float's own shortest text (0.1f -> "0.1", where format_number(double(0.1f)) gives
// "0.10000000149011612").
inline std::string format_float(float v) {
  if (v != v) return "nan";
  char buf[32];
  const std::to_chars_result r = std::to_chars(buf, buf + sizeof buf, v);
  if (r.ec != std::errc{}) return "?";
  return std::string(buf, r.ptr);
}

// A pointer or handle as "0x7f..." ("null" for nullptr; a CUDA stream's null is the
// legacy default stream, which callers say in their own words).
inline std::string format_pointer(const void* p) {
  if (p == nullptr) return "null";
  char buf[2 + 16];
  const std::to_chars_result r = std::to_chars(buf + 2, buf + sizeof buf, reinterpret_cast<std::uintptr_t>(p), 16);
  buf[0] = '0';
  buf[1] = 'x';
  return std::string(buf, r.ptr);
}

}  // namespace stepfuse::detail
