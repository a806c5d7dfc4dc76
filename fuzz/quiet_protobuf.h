// For the targets that parse protobuf: libprotobuf logs a line to stderr for
// every string field that is not UTF-8 (an ERROR the parse then refuses),
// which would drown a fuzzer's output and slow it down. The target's
// LLVMFuzzerInitialize, run once before the first input (by libFuzzer and by
// regress_main.cc alike), drops those lines; include this in exactly one file
// of a target.
#pragma once

#include <google/protobuf/stubs/logging.h>

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}
