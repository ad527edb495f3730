#include "io/json_keys.h"

#include <cstddef>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>
#include <vector>

namespace metrale::io {
namespace {

using json = nlohmann::json;

// Keeps a key set for each open object the caller watches; stops at the first repeat.
class KeyScan final : public nlohmann::json_sax<json> {
 public:
  explicit KeyScan(const std::function<bool(int, std::string_view)>& watched) : watched_(watched) {}

  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return open(true); }
  bool start_array(std::size_t) override { return open(false); }
  bool end_object() override { return close(); }
  bool end_array() override { return close(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    return false;
  }

  bool key(string_t& k) override {
    Frame& f = frames_.back();
    if (frames_.size() == 1) root_key_ = k;
    if (!f.watched || f.keys.insert(k).second) return true;
    const int depth = static_cast<int>(frames_.size());
    found_ = DuplicateKey{depth, depth == 1 ? std::string() : root_key_, k};
    return false;  // stops the scan
  }

  std::optional<DuplicateKey> found() && { return std::move(found_); }

 private:
  struct Frame {
    bool object = false, watched = false;
    std::set<std::string, std::less<>> keys;
  };

  bool open(bool object) {
    const std::size_t depth = frames_.size() + 1;
    // Depth 2 is a member of the root object: an object inside a root array is none.
    const bool watch = object && (depth == 1 || (depth == 2 && frames_[0].object)) &&
                       watched_(static_cast<int>(depth), root_key_);
    frames_.push_back(Frame{object, watch, {}});
    return true;
  }
  bool close() {
    frames_.pop_back();
    return true;
  }

  const std::function<bool(int, std::string_view)>& watched_;
  std::vector<Frame> frames_;
  std::string root_key_;  // the root's member now being read
  std::optional<DuplicateKey> found_;
};

}  // namespace

std::optional<DuplicateKey> first_duplicate_key(
    std::string_view text, const std::function<bool(int depth, std::string_view parent)>& watched) {
  KeyScan scan(watched);
  (void)json::sax_parse(text.begin(), text.end(), &scan);
  return std::move(scan).found();
}

}  // namespace metrale::io
