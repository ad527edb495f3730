// NVTX ranges: named spans around ops that Nsight Systems shows above the kernels they queue.
// libnvToolsExt.so.1 is loaded at run time on first use, never linked; where it is absent every
// range is a no-op (a load of a null pointer).
#pragma once

namespace metrale::nvtx {

// Whether libnvToolsExt.so.1 was found with both entry points (the first call looks once).
bool available() noexcept;

// A range named name for the scope of the object: nvtxRangePushA at construction,
// nvtxRangePop at destruction. name must outlive the push (a string literal).
class Range {
 public:
  explicit Range(const char* name) noexcept;
  ~Range();
  Range(const Range&) = delete;
  Range& operator=(const Range&) = delete;

 private:
  bool pushed_;
};

}  // namespace metrale::nvtx
