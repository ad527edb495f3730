// The fake CUDA driver's public side (see fake_driver.h): construction and the table, set-up and
// observation. The entry points live by concept in the other fake_*.cpp files (fake_state.h).
#include "cuda/fake_driver.h"

#include <cstdlib>
#include <stdexcept>
#include <utility>

#include "cuda/fake_state.h"

#include "cuda/status.h"

namespace metrale::cuda::testing {
namespace fake {

std::atomic<State*> g_state{nullptr};
thread_local Current t_current;
thread_local CaptureModeOfThread t_capture_mode;

namespace {
std::atomic<std::uint64_t> g_next_id{1};
}  // namespace

}  // namespace fake

using fake::g_next_id;
using fake::g_state;
using fake::Kind;
using fake::locked;
using fake::State;

FakeModule& FakeModule::publish_u32(const std::string& name, std::uint32_t value) {
  FakeGlobal& global = globals[name];
  global.bytes.resize(4);
  for (std::size_t i = 0; i < 4; ++i) {
    global.bytes[i] = static_cast<std::byte>((value >> (8 * i)) & 0xFFu);
  }
  return *this;
}

bool FakeOutstanding::none() const noexcept {
  return allocations == 0 && host_allocs == 0 && modules == 0 && streams == 0 && events == 0 &&
         graphs == 0 && graph_execs == 0 && contexts == 0 && reservations == 0 &&
         vmm_handles == 0 && mappings == 0;
}

FakeDriver::FakeDriver(std::vector<FakeDevice> devices) : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.id = g_next_id.fetch_add(1);
  s.devices = std::move(devices);
  s.retains.assign(s.devices.size(), 0);
  for (std::size_t d = 0; d < s.devices.size(); ++d)
    s.contexts.push_back(fake::new_handle<CUcontext>(s));
#define METRALE_FAKE_FILL(name, version) s.api.name = &fake::fake_##name;
  METRALE_DRIVER_FUNCTIONS(METRALE_FAKE_FILL)
#undef METRALE_FAKE_FILL
  State* expected = nullptr;
  if (!g_state.compare_exchange_strong(expected, &s)) {
    throw std::logic_error("FakeDriver: another FakeDriver is alive");
  }
}

FakeDriver::~FakeDriver() {
  g_state.store(nullptr);  // calls through a table kept past this return DEINITIALIZED
  for (const auto& [base, alloc] : state_->allocs) std::free(fake::to_host(base));
  fake::drop_reservations(*state_);
}

const DriverApi& FakeDriver::api() const noexcept {
  return state_->api;
}

void FakeDriver::set_init_status(CUresult status) {
  locked(*state_, [&](State& s) { s.init_status = status; });
}

void FakeDriver::set_driver_version(int version) {
  locked(*state_, [&](State& s) { s.driver_version = version; });
}

void FakeDriver::add_module(const std::string& name, FakeModule module) {
  locked(*state_, [&](State& s) { s.registered[name] = std::move(module); });
}

std::vector<unsigned char> FakeDriver::fake_image(const std::string& name) {
  const std::string text = std::string(fake::kImagePrefix) + name;
  std::vector<unsigned char> image(text.begin(), text.end());
  image.push_back(0);
  return image;
}

void FakeDriver::hold_events(bool hold) {
  locked(*state_, [&](State& s) { s.hold_events = hold; });
}

void FakeDriver::release_events() {
  locked(*state_, [&](State& s) {
    for (auto& [handle, ev] : s.events) ev.held = false;
  });
}

void FakeDriver::set_events_ready(bool ready) {
  locked(*state_, [&](State& s) { s.events_ready = ready; });
}

void FakeDriver::advance_clock(double ms) {
  locked(*state_, [&](State& s) { s.clock_ms += ms; });
}

std::vector<FakeLaunch> FakeDriver::launches() const {
  return locked(*state_, [](State& s) { return s.launches; });
}

std::uint64_t FakeDriver::graph_replays() const {
  return locked(*state_, [](State& s) { return s.replays; });
}

std::size_t FakeDriver::device_bytes_in_use() const {
  return locked(*state_, [](State& s) { return fake::device_bytes(s, -1); });
}

FakeOutstanding FakeDriver::outstanding() const {
  return locked(*state_, [](State& s) {
    FakeOutstanding out;
    out.allocations = fake::count_allocs(s, {Kind::kDevice, Kind::kManaged});
    out.host_allocs = fake::count_allocs(s, {Kind::kHost});
    out.modules = s.modules.size();
    out.streams = s.streams.size();
    out.events = s.events.size();
    out.graphs = s.graphs.size();
    out.graph_execs = s.execs.size();
    for (int r : s.retains) out.contexts += static_cast<std::size_t>(r);
    out.reservations = s.reservations.size();
    out.vmm_handles = s.physical.size();
    out.mappings = s.mappings.size();
    return out;
  });
}

int FakeDriver::max_dynamic_shared(const std::string& function) const {
  return locked(*state_, [&](State& s) {
    auto it = s.last_max_dynamic.find(function);
    return it == s.last_max_dynamic.end() ? 0 : it->second;
  });
}

}  // namespace metrale::cuda::testing
