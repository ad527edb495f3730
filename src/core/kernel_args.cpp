#include "metrale/kernel_args.h"

namespace metrale {

std::span<const std::byte> KernelArg::bytes() const noexcept {
  if (is_buffer()) return {};
  return std::get<std::vector<std::byte>>(data_);
}

PackedArgs::PackedArgs(std::span<const KernelArg> args) {
  // First pass sizes the slot vector so the parameter pointers taken below stay valid.
  std::vector<std::size_t> first_slot;
  first_slot.reserve(args.size());
  std::size_t slots = 0;
  for (const KernelArg& a : args) {
    first_slot.push_back(slots);
    slots += a.is_buffer() ? 1 : (a.bytes().size() + 7) / 8;
  }
  slots_.assign(slots, 0);
  params_.reserve(args.size());
  for (std::size_t i = 0; i < args.size(); ++i) {
    std::uint64_t* slot = slots_.data() + first_slot[i];
    if (args[i].is_buffer()) {
      *slot = args[i].ptr().address();
    } else if (!args[i].bytes().empty()) {
      std::memcpy(slot, args[i].bytes().data(), args[i].bytes().size());
    }
    params_.push_back(slot);
  }
}

}  // namespace metrale
