// The sim extension's one translation unit (a "unity build", as CMake's UNITY_BUILD makes:
// https://cmake.org/cmake/help/latest/prop_tgt/UNITY_BUILD.html). Both files include ATen/ATen.h,
// dist.cpp through c10d's Backend.hpp and sim.cpp through ATen/autocast_mode.h, and parsing it
// is most of each file's compile time; compiled together, it is parsed once. Measured with g++ 12
// at -O1: sim.cpp 35 CPU-s + dist.cpp 27 CPU-s compiled apart, 50 CPU-s compiled here as one.
#include "sim.cpp"
#include "dist.cpp"
