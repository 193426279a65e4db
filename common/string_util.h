// Small string helpers: numbers as shortest round-trip text, edit distance and "did you mean"
// suggestions, joining and splitting, bounded quotes of untrusted text.
// Pure functions; thread-safe.
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace zo {

// The shortest text that reads back as exactly `v` (std::to_chars: fixed or scientific, whichever
// is shorter, fixed on a tie: "0.1", "1e-05", "1500000", "0.3333333333333333"), so two different
// values never print alike. For config errors, CSV cells and the like.
std::string format_number(double v);

// Levenshtein distance (insert, delete, substitute each cost 1), case-sensitive.
size_t edit_distance(std::string_view a, std::string_view b);

// The candidate closest to `word` if it is plausibly a typo of it (distance ≤ max(2, |word|/3),
// ignoring case and '_'/'-' differences), else "".
std::string closest_match(std::string_view word, std::span<const std::string> candidates);

std::vector<std::string> split(std::string_view text, char sep);
std::string join(std::span<const std::string> parts, std::string_view sep);

// Untrusted text (a file's contents, a token) as an error may quote it: at most `max_bytes` of it,
// with bytes outside printable ASCII written as \n, \t or \xHH, and "... (N bytes)" when cut.
std::string quote_excerpt(std::string_view text, size_t max_bytes = 64);

// A name the user gave (a file path, a config key) as an error line shows it: unchanged when it is
// at most `max_bytes` long and holds no control character, else quote_excerpt(name, max_bytes).
std::string bounded_name(std::string_view name, size_t max_bytes = 200);

}  // namespace zo
