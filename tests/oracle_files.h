// Whole-file binary I/O for the oracle programs that a Python test drives (tests/common/
// bnb4bit_oracle.cpp, tests/cpu_optim/adam8bit_oracle.cpp): the script writes arrays as raw
// little-endian files and reads back what the oracle writes.
#pragma once

#include <fstream>
#include <string>
#include <vector>

namespace zo::testing {

// Reads exactly out->size() elements from `path`: false if the file is shorter or longer.
template <class T>
bool read_all(const std::string& path, std::vector<T>* out) {
  std::ifstream f(path, std::ios::binary);
  f.read(reinterpret_cast<char*>(out->data()), static_cast<std::streamsize>(out->size() * sizeof(T)));
  return f.good() && f.peek() == std::ifstream::traits_type::eof();
}

// Writes `v` to `path`, replacing it.
template <class T>
bool write_all(const std::string& path, const std::vector<T>& v) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(T)));
  return f.good();
}

}  // namespace zo::testing
