// The precompiled header needs a source to be built with (tests/CMakeLists.txt).
