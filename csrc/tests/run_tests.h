// The C++ tests' one runner: each named test runs in turn, an exception is its failure; exit code 1 if any failed.
#pragma once

#include <exception>
#include <functional>
#include <iostream>
#include <utility>
#include <vector>

namespace megarl::testing {

using Tests = std::vector<std::pair<const char*, std::function<void()>>>;

inline int run_tests(const Tests& tests) {
  int failed = 0;
  for (const auto& [name, run] : tests) {
    try {
      run();
      std::cout << "ok     " << name << "\n" << std::flush;
    } catch (const std::exception& e) {
      ++failed;
      std::cout << "FAILED " << name << ": " << e.what() << "\n" << std::flush;
    }
  }
  return failed == 0 ? 0 : 1;
}

}  // namespace megarl::testing
