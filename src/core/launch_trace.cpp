#include "core/launch_trace.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include "core/log.h"

namespace metrale::trace {
namespace {

using Clock = std::chrono::steady_clock;

// Rows kept per file: a trace of a long run stops growing here (the count of the rest is in
// "otherData"), so tracing cannot exhaust host memory.
constexpr std::size_t kMaxLaunches = std::size_t{1} << 20;

}  // namespace

// Everything written to one path: the launches of every backend that traced to it.
class TraceFile {
 public:
  explicit TraceFile(std::string path) : path_(std::move(path)), epoch_(Clock::now()) {}

  const std::string& path() const { return path_; }
  double now_us() const {
    return std::chrono::duration<double, std::micro>(Clock::now() - epoch_).count();
  }
  int new_pid() {
    std::lock_guard lock(mu_);
    return next_pid_++;
  }
  void add(int pid, std::string_view backend, TracedLaunch launch) {
    std::lock_guard lock(mu_);
    if (!labels_.contains(pid)) labels_[pid] = fmt::format("{} backend #{}", backend, pid);
    if (rows_.size() >= kMaxLaunches) {
      if (dropped_++ == 0) {
        log::warn("METRALE_TRACE={}: {} launches traced; later ones are counted, not kept", path_,
                  kMaxLaunches);
      }
      return;
    }
    rows_.push_back(Row{pid, std::move(launch)});
  }
  void note_untraced() {
    std::lock_guard lock(mu_);
    ++untraced_;
  }
  // The whole document; false (and errno set) when the file cannot be written.
  bool write() const {
    std::lock_guard lock(mu_);
    std::ofstream out(path_, std::ios::trunc);
    if (!out) return false;
    out << "{\"displayTimeUnit\": \"ms\",\n\"otherData\": "
        << nlohmann::json{{"writer", "metrale"},
                          {"dropped_launches", dropped_},
                          {"untraced_launches", untraced_}}
               .dump()
        << ",\n\"traceEvents\": [";
    bool first = true;
    const auto emit = [&](const nlohmann::json& j) {
      out << (first ? "\n" : ",\n") << j.dump();
      first = false;
    };
    // Rows: a backend is a process, each of its streams a thread numbered in order of use.
    std::map<std::pair<int, std::uint64_t>, int> tids;
    for (const auto& [pid, label] : labels_) {
      emit({{"name", "process_name"}, {"ph", "M"}, {"pid", pid}, {"args", {{"name", label}}}});
    }
    for (const Row& r : rows_) {
      auto [it, added] = tids.emplace(std::pair{r.pid, r.launch.stream}, 0);
      if (added) {
        int n = 0;
        for (const auto& [key, tid] : tids) n += key.first == r.pid ? 1 : 0;
        it->second = n;
        emit({{"name", "thread_name"},
              {"ph", "M"},
              {"pid", r.pid},
              {"tid", n},
              {"args", {{"name", fmt::format("stream 0x{:x}", r.launch.stream)}}}});
      }
      const TracedLaunch& l = r.launch;
      emit({{"name", l.kernel},
            {"cat", "launch"},
            {"ph", "X"},
            {"ts", l.start_us},
            {"dur", l.dur_us},
            {"pid", r.pid},
            {"tid", it->second},
            {"args",
             {{"grid", {l.grid.x, l.grid.y, l.grid.z}},
              {"block", {l.block.x, l.block.y, l.block.z}},
              {"shared_bytes", l.shared_bytes},
              {"stream", fmt::format("0x{:x}", l.stream)}}}});
    }
    out << "\n]}\n";
    out.flush();
    return static_cast<bool>(out);
  }

 private:
  struct Row {
    int pid;
    TracedLaunch launch;
  };
  const std::string path_;
  const Clock::time_point epoch_;
  mutable std::mutex mu_;
  int next_pid_ = 1;
  std::map<int, std::string> labels_;
  std::vector<Row> rows_;
  std::uint64_t dropped_ = 0, untraced_ = 0;
};

namespace {

// The files of this process by path. Kept to the end of the process, so a backend made after
// another one died adds to the same file instead of truncating it.
struct Files {
  std::mutex mu;
  std::map<std::string, std::shared_ptr<TraceFile>> open;
  std::set<std::string> refused;  // paths already warned about
};
Files& files() {
  static Files* f = new Files;  // never destroyed: a backend may die during static destruction
  return *f;
}

}  // namespace

std::unique_ptr<LaunchTracer> LaunchTracer::from_env() {
  const char* v = std::getenv("METRALE_TRACE");
  if (v == nullptr || *v == '\0') return nullptr;
  return open(v);
}

std::unique_ptr<LaunchTracer> LaunchTracer::open(const std::string& path) {
  Files& f = files();
  std::lock_guard lock(f.mu);
  auto it = f.open.find(path);
  if (it == f.open.end()) {
    auto file = std::make_shared<TraceFile>(path);
    // Written at once, empty: a bad path is found now, not at exit, and a run that dies early
    // still leaves a file Perfetto opens.
    errno = 0;
    if (!file->write()) {
      if (f.refused.insert(path).second) {
        log::warn("METRALE_TRACE={}: cannot write the trace file ({}); launches are not traced",
                  path, errno != 0 ? std::strerror(errno) : "write failed");
      }
      return nullptr;
    }
    it = f.open.emplace(path, std::move(file)).first;
  }
  return std::unique_ptr<LaunchTracer>(new LaunchTracer(it->second, it->second->new_pid()));
}

LaunchTracer::LaunchTracer(std::shared_ptr<TraceFile> file, int pid)
    : file_(std::move(file)), pid_(pid) {}

LaunchTracer::~LaunchTracer() {
  flush();
}

double LaunchTracer::now_us() const {
  return file_->now_us();
}

void LaunchTracer::add(std::string_view backend, TracedLaunch launch) {
  file_->add(pid_, backend, std::move(launch));
}

void LaunchTracer::note_untraced() {
  file_->note_untraced();
}

void LaunchTracer::flush() noexcept {
  try {
    errno = 0;
    if (!file_->write()) {
      log::warn("METRALE_TRACE={}: writing the trace file failed ({})", file_->path(),
                errno != 0 ? std::strerror(errno) : "write failed");
    }
  } catch (const std::exception& e) {
    log::warn("METRALE_TRACE={}: writing the trace file failed ({})", file_->path(), e.what());
  }
}

const std::string& LaunchTracer::path() const {
  return file_->path();
}

}  // namespace metrale::trace
